"""Live streams at real-time pace against the realtime endpoint, and the same streams through a
whisper_streaming-style use of faster-whisper (one model and one thread per stream), in one run.

Each stream plays speech-set utterances as pcm16 24 kHz in 40 ms chunks with 1 s of silence
between them and commits each utterance as its audio ends (the end of speech is then known to the
millisecond on both sides). Reported per N concurrent streams:
- final latency: from the end of an utterance's audio to its completed text, p50/p95;
- partial delay: how far partial text lags the audio it transcribes, p50/p95, for text sent before
  the utterance ended (a delta's last word is placed in the utterance by its rank among the final
  text's words, at an even speaking rate: no word timestamps are needed);
- WER of the live text against the file endpoint's text for the same audio, and against the
  reference transcripts;
- first word: from the start of an utterance's audio to its first partial text, p50/max over the
  turns that had any;
- the app's own account of each stream count's run (/metrics, before and after): encoder forwards
  and their busy seconds, partial passes run and skipped, the decoder loop's busy seconds;
- the largest N whose p95 final latency stays under 1 s.

    python benchmarks/bench_realtime.py --streams 1 2 4 8 --baseline-streams 1 2 4
(starts the default model of configs/default.yaml, tiny.en, as a one-model app on a local Ray; --url
uses a running one instead; --overrides merges JSON into the app's args section by section, a
section set to null removed: '{"realtime": {"partial_context": "audio"}, "diarizer": null}').

Prints a JSON row per system and stream count as it ends, and writes them all to --out
(benchmarks/results/realtime.json by default).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.model.audio import SAMPLE_RATE, load_audio_file, resample  # noqa: E402
from engine.transcribe.agreement import LocalAgreement  # noqa: E402
from engine.transcribe.evaluation import load_manifest, word_error_rate  # noqa: E402
from tests.support.app_metrics import metric_sum, scrape  # noqa: E402
from tests.support.live_stream import REALTIME_RATE_HZ, stream_live, to_pcm16_24k, transcription_session  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Utterances tiny.en transcribes well from the file (so WER gaps measure the live path), 2-4.6 s.
CLIP_IDS = ["tts_01", "osr72_04", "tts_11", "tts_14", "osr72_02", "tts_20", "tts_24", "tts_28", "osr72_08"]
UTTERANCES_PER_STREAM = 3
SILENCE_S = 1.0
CHUNK_MS = 40
# The app's counters each stream count's row reports, as differences over its run.
APP_COUNTERS = {
    "encoder_forwards": "whisper_encoder_forwards",
    "encoder_busy_s": "whisper_encoder_busy_seconds",
    "partial_passes": "whisper_realtime_partial_pass_seconds_count",
    "partial_pass_s": "whisper_realtime_partial_pass_seconds_sum",
    "partial_passes_skipped": "whisper_realtime_partial_passes_skipped_total",
    "decoder_busy_s": "whisper_decoder_loop_busy_seconds",
    # Windows' time by stage, summed over every window (partial and final passes alike).
    "encoder_windows": "whisper_encoder_windows_encoded",
    "encoder_queued_s": "whisper_encoder_window_seconds[queued]",
    "encoder_forward_s": "whisper_encoder_window_seconds[forward]",
    "decoder_windows": "whisper_decoder_windows_timed",
    "decoder_queued_s": "whisper_decoder_window_seconds[queued]",
    "decoder_loading_s": "whisper_decoder_window_seconds[loading]",
    "decoder_decoding_s": "whisper_decoder_window_seconds[decoding]",
}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _plans(n_streams: int) -> list[list[str]]:
    return [
        [CLIP_IDS[(stream * UTTERANCES_PER_STREAM + k) % len(CLIP_IDS)] for k in range(UTTERANCES_PER_STREAM)]
        for stream in range(n_streams)
    ]


def _partial_delays(
    deltas: list[tuple[float, str]], final_text: str, start_s: float, end_s: float
) -> list[float]:
    """Delays of the deltas that arrived before the utterance's audio ended."""
    n_words = max(1, len(final_text.split()))
    delays, words_so_far = [], 0
    for at, delta in deltas:
        words_so_far += len(delta.split())
        if at >= end_s:
            break
        spoken_s = start_s + min(1.0, words_so_far / n_words) * (end_s - start_s)
        delays.append(at - spoken_s)
    return delays


def _first_word_s(deltas: list[tuple[float, str]], start_s: float, end_s: float) -> float | None:
    """From the utterance's first audio to its first partial text (None: none before it ended)."""
    early = [at for at, delta in deltas if delta.strip() and at < end_s]
    return min(early) - start_s if early else None


def _summary(system: str, n_streams: int, turns: list[dict], file_texts: dict, references: dict) -> dict:
    finals = [turn["final_latency_s"] for turn in turns]
    partials = [delay for turn in turns for delay in turn["partial_delays_s"]]
    first_words = [turn["first_word_s"] for turn in turns if turn["first_word_s"] is not None]
    live = [turn["text"] for turn in turns]
    return {
        "system": system,
        "streams": n_streams,
        "turns": len(turns),
        "final_p50_s": round(_percentile(finals, 50), 3),
        "final_p95_s": round(_percentile(finals, 95), 3),
        "partial_delay_p50_s": round(_percentile(partials, 50), 3),
        "partial_delay_p95_s": round(_percentile(partials, 95), 3),
        "turns_with_partial_text": sum(bool(turn["partial_delays_s"]) for turn in turns),
        "first_word_p50_s": round(_percentile(first_words, 50), 3),
        "first_word_max_s": round(max(first_words), 3) if first_words else float("nan"),
        "wer_vs_file_endpoint": round(word_error_rate([file_texts[t["clip"]] for t in turns], live), 4),
        "wer_vs_reference": round(word_error_rate([references[t["clip"]] for t in turns], live), 4),
    }


# ---- ours ---------------------------------------------------------------------------------------


def run_ours(url: str, api_key: str, n_streams: int, audio: dict[str, bytes]) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)

    def one_stream(plan: list[str]) -> list[dict]:
        with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
            json.loads(connection.recv_bytes())
            connection.session.update(session=transcription_session(None))
            json.loads(connection.recv_bytes())
            record = stream_live(
                connection,
                [audio[c] for c in plan],
                silence_s=SILENCE_S,
                chunk_ms=CHUNK_MS,
                commit=True,
                timeout_s=300,
            )
        turns = []
        for clip_id, turn, end_s in zip(plan, record.turns(), record.speech_ends_s):
            start_s = end_s - len(audio[clip_id]) / (2 * REALTIME_RATE_HZ)
            turns.append(
                {
                    "clip": clip_id,
                    "text": turn["text"],
                    "final_latency_s": turn["at"] - end_s,
                    "partial_delays_s": _partial_delays(turn["deltas"], turn["text"], start_s, end_s),
                    "first_word_s": _first_word_s(turn["deltas"], start_s, end_s),
                }
            )
        return turns

    with ThreadPoolExecutor(n_streams) as pool:
        return [turn for turns in pool.map(one_stream, _plans(n_streams)) for turn in turns]


# ---- whisper_streaming-style faster-whisper -------------------------------------------------------


def run_faster_whisper(model_folder: Path, n_streams: int, audio: dict[str, bytes]) -> list[dict]:
    """whisper_streaming's loop per stream, on its own faster-whisper model and thread: every
    0.5 s of new audio (its min_chunk_size) the utterance so far is transcribed again and
    LocalAgreement-2 (its policy) commits what two passes agree on; at the end of the utterance a
    last pass gives the rest. Greedy, no timestamps: the decoding our server does."""
    from faster_whisper import WhisperModel

    models = [
        WhisperModel(str(model_folder), device="cpu", compute_type="int8", cpu_threads=1)
        for _ in range(n_streams)
    ]

    def transcribe(model, samples: np.ndarray, final: bool) -> str:
        segments, _ = model.transcribe(
            samples,
            language="en",
            beam_size=1,
            temperature=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0] if final else 0.0,
            without_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        return "".join(segment.text for segment in segments).strip()

    def one_stream(index: int, plan: list[str]) -> list[dict]:
        model = models[index]
        started = time.perf_counter()
        audio_s, turns = 0.5, []  # the same lead silence as stream_live
        for clip_id in plan:
            samples = resample(
                np.frombuffer(audio[clip_id], dtype="<i2").astype(np.float32) / 32768,
                REALTIME_RATE_HZ,
                SAMPLE_RATE,
            )
            start_s = started + audio_s
            end_s = start_s + len(samples) / SAMPLE_RATE
            agreement, deltas = LocalAgreement(passes=2), []
            while (now := time.perf_counter()) < end_s:
                available = int((now - start_s) * SAMPLE_RATE)
                if available >= SAMPLE_RATE // 2:  # whisper_streaming's min_chunk_size: 0.5 s
                    delta = agreement.update(transcribe(model, samples[:available], final=False))
                    if delta:
                        deltas.append((time.perf_counter(), delta))
                time.sleep(max(0.0, min(now + 0.5, end_s) - time.perf_counter()))
            delta = agreement.finish_window(transcribe(model, samples, final=True))
            completed_at = time.perf_counter()
            if delta:
                deltas.append((completed_at, delta))
            turns.append(
                {
                    "clip": clip_id,
                    "text": agreement.text,
                    "final_latency_s": completed_at - end_s,
                    "partial_delays_s": _partial_delays(deltas, agreement.text, start_s, end_s),
                    "first_word_s": _first_word_s(deltas, start_s, end_s),
                }
            )
            audio_s += len(samples) / SAMPLE_RATE + SILENCE_S
            pause_s = started + audio_s - time.perf_counter()
            if pause_s > 0:
                time.sleep(pause_s)
        return turns

    with ThreadPoolExecutor(n_streams) as pool:
        results = pool.map(one_stream, range(n_streams), _plans(n_streams))
        return [turn for turns in results for turn in turns]


# ---- the run ------------------------------------------------------------------------------------


def _app_args(api_key: str, overrides: dict) -> dict:
    from tests.support.serving import default_app_args

    args = default_app_args()
    args["http"] = {**args["http"], "api_keys": [api_key]}
    for section, value in overrides.items():
        if value is None:
            args.pop(section, None)
        elif isinstance(value, dict) and isinstance(args.get(section), dict):
            args[section] = {**args[section], **value}
        else:
            args[section] = value
    return args


def _start_app(args: dict):
    import ray
    from ray import serve

    from deployments.app import build_app
    from tests.support.ports import free_port

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="whisper", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _file_texts(url: str, api_key: str, audio: dict[str, bytes]) -> dict[str, str]:
    import openai
    import soundfile

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)
    texts = {}
    for clip_id, pcm16 in audio.items():
        wav = io.BytesIO()
        soundfile.write(
            wav, np.frombuffer(pcm16, dtype="<i2"), REALTIME_RATE_HZ, format="WAV", subtype="PCM_16"
        )
        texts[clip_id] = client.audio.transcriptions.create(
            model="whisper-1", file=("a.wav", wav.getvalue())
        ).text
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running app; default: start configs/default.yaml on a local Ray")
    parser.add_argument("--api-key", default="bench-realtime")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--baseline-streams", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--model-label", default="tiny.en", help="what the app serves, for the report")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "realtime.json")
    parser.add_argument(
        "--overrides", type=json.loads, default={}, help="JSON merged into the started app's args, by section"
    )
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    from engine.model.weights import resolve_model_folder

    clips = {clip.id: clip for clip in load_manifest(REPO / "tests" / "data" / "speech")}
    audio = {clip_id: to_pcm16_24k(load_audio_file(clips[clip_id].path)) for clip_id in CLIP_IDS}
    references = {clip_id: clips[clip_id].text for clip_id in CLIP_IDS}
    url = args.url or _start_app(_app_args(args.api_key, args.overrides))
    auth = {"Authorization": f"Bearer {args.api_key}"}  # /metrics asks for the key when the app has one
    while metric_sum(url, "whisper_decoder_kv_blocks_free", auth) == 0:  # the app reports its pool once warm
        time.sleep(1)
    file_texts = _file_texts(url, args.api_key, audio)
    rows = []
    for n_streams in args.streams:
        before = scrape(url, auth)
        turns = run_ours(url, args.api_key, n_streams, audio)
        after = scrape(url, auth)
        rows.append(_summary("whisper-disagg /v1/realtime", n_streams, turns, file_texts, references))
        rows[-1]["app"] = {
            name: round(after.get(metric, 0.0) - before.get(metric, 0.0), 3)
            for name, metric in APP_COUNTERS.items()
        }
        print(json.dumps(rows[-1]), flush=True)
    for n_streams in args.baseline_streams:
        turns = run_faster_whisper(resolve_model_folder("tiny.en"), n_streams, audio)
        rows.append(
            _summary("faster-whisper, whisper_streaming-style", n_streams, turns, file_texts, references)
        )
        print(json.dumps(rows[-1]), flush=True)
    best = {
        system: max(
            (r["streams"] for r in rows if r["system"] == system and r["final_p95_s"] < 1.0), default=0
        )
        for system in {r["system"] for r in rows}
    }
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {args.model_label}",
        "date": datetime.date.today().isoformat(),
        "overrides": args.overrides,
        "rows": rows,
        "largest_streams_with_p95_final_under_1s": best,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(best))
    if args.record:
        _record(rows, args)


def _record(rows: list[dict], args: argparse.Namespace) -> None:
    headers = [
        "system",
        "streams",
        "final p50 s",
        "final p95 s",
        "turns with partial text",
        "first word p50 / max s",
        "partial delay p50 / p95 s",
        "WER vs file endpoint %",
    ]
    table = [
        [
            "ours" if row["system"].startswith("whisper-disagg") else "faster-whisper",
            row["streams"],
            row["final_p50_s"],
            row["final_p95_s"],
            f"{row['turns_with_partial_text']} / {row['turns']}",
            f"{row['first_word_p50_s']} / {row['first_word_max_s']}",
            f"{row['partial_delay_p50_s']} / {row['partial_delay_p95_s']}",
            round(100 * row["wer_vs_file_endpoint"], 1),
        ]
        for row in rows
    ]
    notes = (
        f"{args.model_label}; app overrides: `{json.dumps(args.overrides)}`; {UTTERANCES_PER_STREAM} "
        f"utterances of 2-4.6 s a stream, {SILENCE_S:g} s of silence between them, manual commits; "
        "faster-whisper int8, one model and one thread per stream, in the client's process. "
        f"Figures: {args.out}"
    )
    record(
        "Live streams on CPU: /v1/realtime against whisper_streaming-style faster-whisper "
        "(bench_realtime.py)",
        markdown_table(headers, table),
        notes,
    )


if __name__ == "__main__":
    main()
