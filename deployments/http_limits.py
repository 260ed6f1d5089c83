"""The HTTP API's limits and keys: the `http` section of the app's configuration
(deployments/config.py), validated with it at start-up."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_KEYS_ENV = "WHISPER_DISAGG_API_KEYS"


class HTTPLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_upload_mb: float = Field(25.0, gt=0, description="OpenAI's limit is 25 MB")
    max_audio_duration_s: float = Field(3600.0, gt=0, description="longest audio a request may send (413)")
    max_in_flight_requests: int = Field(
        256,
        ge=1,
        description="requests one ingress replica works on at once; beyond it new ones get 503 + Retry-After",
    )
    upload_timeout_s: float = Field(
        60.0, gt=0, description="longest a client may go without sending any of its request body (408 after)"
    )
    min_upload_bytes_per_s: float = Field(
        500.0,
        ge=0,
        description="slowest a request body may come: it may take upload_timeout_s plus a second for "
        "every this many bytes that have come, 408 after (Apache mod_reqtimeout's MinRate); 0: no "
        "minimum. Without it a client that trickles bytes holds its in-flight slot for as long as it likes",
    )
    upload_first_byte_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest a client may take to send the first bytes of its request body (408 after); "
        "shorter than upload_timeout_s, as opening uploads and sending nothing is the cheapest way to "
        "hold a place",
    )
    max_pending_uploads: int = Field(
        256,
        ge=1,
        description="request bodies one ingress replica receives at once; a request takes its in-flight "
        "slot (max_in_flight_requests) only once its body has come. When full, the upload furthest "
        "behind min_upload_bytes_per_s is cut (408) to make room, and only where none is behind does a "
        "new one get 503. With max_in_flight_requests, at most the ingress's max_ongoing_requests",
    )
    max_pending_uploads_per_address: int = Field(
        64,
        ge=1,
        description="request bodies from one client address received at once; beyond it the address's "
        "upload furthest behind the minimum rate is cut. Behind a load balancer every client has its "
        "address: raise it to max_pending_uploads there",
    )
    max_decoded_audio_s: float = Field(
        14400.0,
        gt=0,
        description="seconds of decoded audio (float32 samples at 16 kHz: 230 MB an hour) one ingress "
        "replica holds at once across its requests; a request whose samples do not fit waits for "
        "others to finish, up to decoded_audio_wait_s, then gets 503. At least max_audio_duration_s. "
        "The replica's memory for samples stays under it, plus each decoding process's one file",
    )
    decoded_audio_wait_s: float = Field(
        30.0,
        ge=0,
        description="longest a request waits for an idle decoding process (decode_processes), and then "
        "for room under max_decoded_audio_s (503 after either)",
    )
    decode_processes: int = Field(
        2,
        ge=1,
        description="worker processes per ingress replica that decode uploads (FFmpeg): a file that "
        "crashes native decoding code ends one of them and fails its own request (400), not the "
        "replica; at most this many uploads decode at once, the rest wait for one",
    )
    max_windows_in_flight: int = Field(
        16,
        ge=1,
        description="30 s windows of one file encoded or decoded at once (parallel long-form); the next "
        "starts as the oldest is answered, so an hour-long file holds at most this many windows' K/V",
    )
    interactive_max_duration_s: float = Field(
        30.0,
        ge=0,
        description="requests without a `priority` field are interactive up to this audio length, "
        "batch beyond it",
    )
    vad_by_default: bool = Field(
        True,
        description="requests that send no `chunking_strategy` (and no long_form=sequential) get Silero "
        "VAD as with chunking_strategy=auto: windows packed from detected speech, no-speech stretches not "
        "decoded, so audio without speech gives an empty transcript, as OpenAI's API answers for "
        "silence. A request may still send chunking_strategy=none for windows cut at quiet points "
        "without speech detection. Costs ingress CPU time (benchmarks/bench_ingest.py measures it); off, "
        "every request's audio is decoded whole, and Whisper may write words into silence",
    )
    default_beam_size: int = Field(
        1,
        ge=1,
        description="beam_size for requests that send none: 1 decodes greedily (OpenAI's whisper-1 "
        "behaviour); 5 is openai-whisper's CLI and faster-whisper's default. Beams apply at temperature "
        "0; each beam counts as a sequence against engine.max_num_seqs",
    )
    max_beam_size: int = Field(
        8, ge=1, description="the largest beam_size (or best_of) a request may ask for"
    )
    inline_window_kb: int = Field(
        0,
        ge=0,
        description="a window's samples up to this size travel inside the ingress's call to the encoder or "
        "decoder replica: one message, where Ray would send every argument over its own limit (100 KB) "
        "through its object store. Such calls are cheaper alone, but the app on a GPU serves no more "
        "tokens a second with them, so 0 (Ray's own limit) is the default; long windows cost the "
        "answering replica more CPU inside the call than through the store (bench_serve_call.py)",
    )
    benchmark_fields: bool = Field(
        False,
        description="accept the request fields that exist for benchmarks only (`fixed_output_tokens`: every "
        "window decodes exactly that many tokens, text or not); off, a request sending one gets a 400",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="when non-empty, requests need `Authorization: Bearer <key>`; also read from "
        f"${API_KEYS_ENV} (comma-separated) when the config gives none, so keys need not sit in the YAML",
    )

    def ingress_runtime_env(self) -> dict[str, dict[str, str]] | None:
        """The ingress replicas' runtime_env: Ray's workers read their argument limit from its
        environment (None: Ray's own limit)."""
        if not self.inline_window_kb:
            return None
        return {"env_vars": {"RAY_max_direct_call_object_size": str(self.inline_window_kb * 1024)}}

    @model_validator(mode="after")
    def _one_request_fits_the_decoded_audio(self) -> "HTTPLimits":
        if self.max_decoded_audio_s < self.max_audio_duration_s:
            raise ValueError(
                f"http.max_decoded_audio_s ({self.max_decoded_audio_s:g}) must be at least "
                f"http.max_audio_duration_s ({self.max_audio_duration_s:g}), or a request of the "
                "longest audio accepted could never be held"
            )
        return self

    @model_validator(mode="after")
    def _api_keys_from_environment(self) -> "HTTPLimits":
        if not self.api_keys and os.environ.get(API_KEYS_ENV):
            self.api_keys = [key.strip() for key in os.environ[API_KEYS_ENV].split(",") if key.strip()]
        return self
