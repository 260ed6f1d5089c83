"""A request's multipart body as it arrives, within the upload's limits: its size (413), the wait
for its first bytes, the gap between its parts and its rate (408), its place among the uploads
arriving at once (deployments/http/pending_uploads.py: 408 when cut, 503 when full), and its form
(400)."""

import asyncio
import time

from fastapi import Request
from starlette.datastructures import FormData
from starlette.types import Message, Receive

from deployments.config import AppConfig
from deployments.http.errors import APIError
from deployments.http.pending_uploads import PendingUpload, PendingUploads, UploadsFull

# A list field sends a part per item: room for the scalar fields, every language Whisper knows in
# languages[], and as many keywords[] as the prompt's budget of tokens could hold, one token each.
MAX_FORM_FIELDS = 512


class _BodyStalled(Exception):
    """The client sent nothing of its body for the upload timeout (or, before its first bytes, the
    first-byte timeout)."""

    def __init__(self, waited_s: float):
        super().__init__(waited_s)
        self.waited_s = waited_s


class _BodyTooSlow(Exception):
    """The client's body came slower than the upload's minimum rate."""


class _BodyCut(Exception):
    """The upload was cut to make room for another (PendingUploads)."""


def _receive_within_limits(
    receive: Receive,
    gap_s: float,
    min_bytes_per_s: float,
    first_gap_s: float | None = None,
    upload: PendingUpload | None = None,
) -> Receive:
    """``receive``, failing when one part of the body takes longer than ``gap_s`` to come (the
    first part: ``first_gap_s``, where given), when the body falls behind ``min_bytes_per_s``, or
    when ``upload`` is cut. ``upload`` is kept told how much of the body has come.

    The gap limit is on the wait for each part, not on the whole body (as nginx's
    client_body_timeout): a large upload on a slow link keeps going, and a burst that keeps the
    server busy is not blamed on its clients, while a client that stalls still frees its place.
    The rate is Apache mod_reqtimeout's MinRate: the body may take ``gap_s``, plus a second for
    every ``min_bytes_per_s`` bytes that have come. Without it a client that sends a byte now and
    then would hold its place (and its in-flight slot) for as long as it liked.
    """
    started_s = time.monotonic()
    received_bytes = 0

    async def receive_within() -> Message:
        nonlocal received_bytes
        # A client that has sent nothing yet gets the shorter first wait: opening an upload and
        # then sending nothing is the cheapest way to hold a place.
        limit_s = gap_s if received_bytes or first_gap_s is None else min(gap_s, first_gap_s)
        wait_s = limit_s
        if min_bytes_per_s > 0:
            allowed_until_s = started_s + gap_s + received_bytes / min_bytes_per_s
            wait_s = min(limit_s, allowed_until_s - time.monotonic())
        message = await _received_within(receive, max(wait_s, 0.0), upload)
        if message is None:
            raise _BodyStalled(limit_s) if wait_s >= limit_s else _BodyTooSlow
        received_bytes += len(message.get("body", b""))
        if upload is not None:
            upload.received_bytes = received_bytes
        return message

    return receive_within


async def _received_within(receive: Receive, wait_s: float, upload: PendingUpload | None) -> Message | None:
    """The next message, or None after ``wait_s``; raises _BodyCut when ``upload`` is cut first."""
    if upload is None:
        try:
            return await asyncio.wait_for(receive(), wait_s)
        except asyncio.TimeoutError:
            return None
    receiving = asyncio.ensure_future(receive())
    cutting = asyncio.ensure_future(upload.cut.wait())
    done, _ = await asyncio.wait({receiving, cutting}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    cutting.cancel()
    if receiving in done:
        return receiving.result()
    receiving.cancel()
    if upload.cut.is_set():
        raise _BodyCut
    return None


async def read_upload(request: Request, config: AppConfig, pending: PendingUploads) -> tuple[FormData, bytes]:
    """The multipart form and its audio file's bytes, within the upload's size and time limits,
    holding a place in ``pending`` while it arrives."""
    limit_bytes = int(config.http.max_upload_mb * 2**20)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit_bytes + 64 * 1024:
        raise APIError(
            413,
            f"Request body exceeds {config.http.max_upload_mb:g} MB.",
            param="file",
            code="file_too_large",
        )
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "Send the audio as multipart/form-data with a 'file' field.", param="file")
    gap_s = config.http.upload_timeout_s
    min_rate = config.http.min_upload_bytes_per_s
    try:
        place = pending.admit(request.client.host if request.client else "")
    except UploadsFull:
        raise APIError(
            503,
            "Too many uploads are arriving at once; retry shortly.",
            code="overloaded",
            error_type="server_overloaded",
            retry_after_s=1,
        ) from None
    receive = _receive_within_limits(
        request.receive, gap_s, min_rate, config.http.upload_first_byte_timeout_s, place
    )
    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=MAX_FORM_FIELDS)
    except _BodyStalled as stalled:
        raise APIError(
            408,
            f"The request body stopped arriving: nothing came for {stalled.waited_s:g} s.",
            code="upload_timeout",
        ) from None
    except _BodyCut:
        raise APIError(
            408,
            "The request body came too slowly while other uploads waited for its place; it was cut "
            "to make room for them.",
            code="upload_too_slow",
        ) from None
    except _BodyTooSlow:
        raise APIError(
            408,
            f"The request body came too slowly: a body may take {gap_s:g} s plus a second for every "
            f"{min_rate:g} bytes of it.",
            code="upload_too_slow",
        ) from None
    except Exception as error:
        raise APIError(400, f"Could not parse the multipart body: {error}") from None
    finally:
        pending.finish(place)
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise APIError(
            400, "Missing required field 'file' (the audio file).", param="file", code="missing_file"
        )
    data = await upload.read()
    if len(data) > limit_bytes:
        raise APIError(
            413, f"File exceeds {config.http.max_upload_mb:g} MB.", param="file", code="file_too_large"
        )
    return form, data
