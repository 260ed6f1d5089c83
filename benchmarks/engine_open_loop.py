"""The engine alone under an open-loop schedule of files, for benchmarks/bench_goodput.py's ceiling:
the same arrivals the app got, each file cut into windows as the offline Transcriber cuts them
(parallel long-form at quiet points) and fed to one in-process encoder and decoder engine, no
HTTP, no Ray, no K/V transfer. A window's wait for the encoder takes interactive work first, as
the app's encoder does; the decoder ranks by the priority each window carries.
"""

from __future__ import annotations

import time
from collections import deque

from benchmarks.goodput_traffic import FILE_PRIORITY, MixAudio
from engine.kv.sources import CrossKVTensor
from engine.model.audio import SAMPLE_RATE
from engine.transcribe.offline import Transcriber
from engine.transcribe.windows import long_form_cursor
from engine.types import DecodeOptions, FinishReason, Priority
from tests.support.mixed_load import Arrival, Outcome


def play_on_engine(
    transcriber: Transcriber, arrivals: list[Arrival], audio: MixAudio, options: DecodeOptions
) -> list[Outcome]:
    """Every file arrival at its time (live arrivals are left out: the engine has no live path of
    its own); a file's latency runs from its arrival to its last window decoded."""
    encoder, decoder, batch_size = transcriber.encoder, transcriber.decoder, transcriber.encoder_batch_size
    pending = deque(arrival for arrival in arrivals if arrival.kind in FILE_PRIORITY)
    outcomes: list[Outcome] = []
    waiting = {Priority.INTERACTIVE: deque(), Priority.BATCH: deque()}  # (outcome index, samples, options)
    windows_left: list[int] = []
    arrived_at: list[float] = []
    owner: dict[str, int] = {}
    encoding: list[tuple[int, object, DecodeOptions, Priority]] = []
    started = time.perf_counter()
    while pending or encoding or decoder.has_work or any(waiting.values()):
        while pending and pending[0].at_s <= time.perf_counter() - started:
            arrival = pending.popleft()
            samples = audio.file_samples(arrival)
            windows = long_form_cursor(samples, options, "parallel").next_windows()
            priority = Priority(FILE_PRIORITY[arrival.kind])
            waiting[priority].extend((len(outcomes), w.window.samples, w.options) for w in windows)
            outcomes.append(Outcome(arrival.kind, len(samples) / SAMPLE_RATE, expected=1))
            windows_left.append(len(windows))
            arrived_at.append(started + arrival.at_s)
        if not encoding and any(waiting.values()) and decoder.stats().num_waiting < batch_size:
            for priority in (Priority.INTERACTIVE, Priority.BATCH):
                while waiting[priority] and len(encoding) < batch_size:
                    encoding.append((*waiting[priority].popleft(), priority))
            encoder.submit([samples for _, samples, _, _ in encoding])
        if not encoding and not decoder.has_work:
            if pending:  # idle until the next arrival
                time.sleep(max(0.0, started + pending[0].at_s - time.perf_counter()))
            continue
        cross_kv = encoder.take(wait=not decoder.has_work) if encoding else None
        if cross_kv is not None:
            for (index, samples, window_options, priority), request_kv in zip(encoding, cross_kv):
                request = decoder.make_request(
                    window_options,
                    CrossKVTensor(request_kv),
                    audio_duration_s=len(samples) / SAMPLE_RATE,
                    priority=priority,
                )
                owner[request.request_id] = index
                decoder.submit(request)
            encoding = []
        for result in decoder.step() if decoder.has_work else []:
            index = owner.pop(result.request_id)
            if result.finish_reason == FinishReason.ERROR:
                outcomes[index].status = "engine error"
            windows_left[index] -= 1
            if windows_left[index] == 0 and outcomes[index].status == "ok":
                outcomes[index].latencies_s.append(time.perf_counter() - arrived_at[index])
    return outcomes
