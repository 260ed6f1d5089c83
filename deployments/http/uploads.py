"""A request's multipart body as it arrives, within the upload's limits: its size (413), the gap
between its parts and its rate (408), and its form (400)."""

import asyncio
import time

from fastapi import Request
from starlette.datastructures import FormData
from starlette.types import Message, Receive

from deployments.config import AppConfig
from deployments.http.errors import APIError

# A list field sends a part per item: room for the scalar fields, every language Whisper knows in
# languages[], and as many keywords[] as the prompt's budget of tokens could hold, one token each.
MAX_FORM_FIELDS = 512


class _BodyStalled(Exception):
    """The client sent nothing of its body for the upload timeout."""


class _BodyTooSlow(Exception):
    """The client's body came slower than the upload's minimum rate."""


def _receive_within_limits(receive: Receive, gap_s: float, min_bytes_per_s: float) -> Receive:
    """``receive``, failing when one part of the body takes longer than ``gap_s`` to come, or when
    the body falls behind ``min_bytes_per_s``.

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
        wait_s = gap_s
        if min_bytes_per_s > 0:
            allowed_until_s = started_s + gap_s + received_bytes / min_bytes_per_s
            wait_s = min(gap_s, allowed_until_s - time.monotonic())
        try:
            message = await asyncio.wait_for(receive(), max(wait_s, 0.0))
        except asyncio.TimeoutError:
            raise (_BodyStalled if wait_s >= gap_s else _BodyTooSlow) from None
        received_bytes += len(message.get("body", b""))
        return message

    return receive_within


async def read_upload(request: Request, config: AppConfig) -> tuple[FormData, bytes]:
    """The multipart form and its audio file's bytes, within the upload's size and time limits."""
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
        body = Request(request.scope, _receive_within_limits(request.receive, gap_s, min_rate))
        form = await body.form(max_files=1, max_fields=MAX_FORM_FIELDS)
    except _BodyStalled:
        raise APIError(
            408,
            f"The request body stopped arriving: nothing came for {gap_s:g} s.",
            code="upload_timeout",
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
