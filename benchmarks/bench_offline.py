"""Offline throughput on the speech set: our engine vs faster-whisper (same tiny.en weights, fp32
and int8) vs transformers' generate, one request at a time and with 16 in flight.

RTFx = audio seconds / wall seconds. All engines get the same CPU threads and the same clips
(the single-window English clips of tests/data/speech), greedy decoding (or ``--beam-size`` beams)
without timestamps.

    .venv/bin/python benchmarks/bench_offline.py [--threads 2] [--beam-size 5] [--no-transformers] [--record]

Prints a table of RTFx and WER per system and requests in flight; --record appends it to the
results log (benchmarks/recording.py). `make bench` runs it with the defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig, cpu_has_bf16_instructions  # noqa: E402
from engine.decode.step.logit_rules import LogitRules  # noqa: E402
from engine.model.audio import N_SAMPLES, load_audio_file  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.model.weights import resolve_model_folder  # noqa: E402
from engine.transcribe.evaluation import load_manifest, word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_ours(clips, in_flight: int, beam_size: int, cpu_dtype: str = "float32"):
    # Each beam is a sequence of the decode loop: room for every window in flight and its beams.
    loaded = load_model(EngineConfig(max_num_seqs=max(in_flight, 1) * beam_size, cpu_dtype=cpu_dtype))
    transcriber = Transcriber(loaded=loaded, encoder_batch_size=min(in_flight, 8))
    audio = [load_audio_file(c.path) for c in clips]
    options = DecodeOptions(beam_size=beam_size)
    transcriber.transcribe(audio[:1], options)  # warm-up
    if in_flight == 1:
        return timed(lambda: [transcriber.transcribe([a], options)[0].text for a in audio])
    return timed(lambda: [t.text for t in transcriber.transcribe(audio, options)])


def run_faster_whisper(clips, in_flight: int, compute_type: str, threads: int, beam_size: int):
    from faster_whisper import WhisperModel

    workers = 1 if in_flight == 1 else threads  # one CTranslate2 worker per core, fed by 16 client threads
    model = WhisperModel(
        str(resolve_model_folder("tiny.en")),
        device="cpu",
        compute_type=compute_type,
        cpu_threads=threads // workers,
        num_workers=workers,
    )
    audio = [load_audio_file(c.path) for c in clips]

    def one(samples):
        segments, _ = model.transcribe(
            samples,
            language="en",
            beam_size=beam_size,
            temperature=0.0,
            without_timestamps=True,
            condition_on_previous_text=False,
        )
        return "".join(s.text for s in segments).strip()

    one(audio[0])
    if in_flight == 1:
        return timed(lambda: [one(a) for a in audio])
    with ThreadPoolExecutor(in_flight) as pool:
        return timed(lambda: list(pool.map(one, audio)))


def run_transformers(clips, in_flight: int, beam_size: int):
    from transformers import GenerationMixin, WhisperFeatureExtractor

    from tests.support.hf_reference import hf_model

    model, weights = hf_model("tiny.en")
    loaded = load_model(EngineConfig())
    special = loaded.tokenizer.special
    rules = LogitRules(
        loaded.tokenizer,
        weights.dims.vocab_size,
        weights.suppress_tokens,
        weights.begin_suppress_tokens,
        torch.device("cpu"),
    )
    extractor = WhisperFeatureExtractor(feature_size=80)
    audio = [load_audio_file(c.path)[:N_SAMPLES] for c in clips]
    prompt = [special.sot, special.no_timestamps]

    def batch(samples_list):
        features = torch.from_numpy(
            extractor(samples_list, sampling_rate=16000, return_tensors="np").input_features
        )
        out = GenerationMixin.generate(
            model,
            input_features=features,
            decoder_input_ids=torch.tensor([prompt] * len(samples_list)),
            max_new_tokens=224,
            do_sample=False,
            num_beams=beam_size,
            suppress_tokens=rules.suppress_token_ids,
            begin_suppress_tokens=rules.begin_suppress_token_ids,
            eos_token_id=special.eot,
            pad_token_id=special.eot,
        )
        return [loaded.tokenizer.decode(row[len(prompt) :].tolist()).strip() for row in out]

    batch(audio[:1])
    return timed(
        lambda: [t for i in range(0, len(audio), in_flight) for t in batch(audio[i : i + in_flight])]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out")
    parser.add_argument("--record", action="store_true", help="append the table to the results log")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clips = [c for c in load_manifest(SPEECH_DIR) if c.text and c.duration_s <= 30]
    audio_s = sum(c.duration_s for c in clips)
    references = [c.text for c in clips]
    beams = args.beam_size
    systems = {
        "ours (fp32)": lambda n: run_ours(clips, n, beams),
        "ours (cpu_dtype bfloat16)": lambda n: run_ours(clips, n, beams, "bfloat16"),
        "faster-whisper fp32": lambda n: run_faster_whisper(clips, n, "float32", args.threads, beams),
        "faster-whisper int8": lambda n: run_faster_whisper(clips, n, "int8", args.threads, beams),
    }
    if not cpu_has_bf16_instructions():
        del systems["ours (cpu_dtype bfloat16)"]  # the engine refuses bf16 without the instructions
    best_ours = list(systems)[1] if len(systems) > 3 else "ours (fp32)"
    if not args.no_transformers:
        systems["transformers generate (fp32)"] = lambda n: run_transformers(clips, n, beams)
    rows, rtfx = [], {}
    for in_flight in (1, 16):
        for name, run in systems.items():
            texts, seconds = run(in_flight)
            rtfx[(name, in_flight)] = audio_s / seconds
            rows.append(
                [
                    name,
                    in_flight,
                    round(seconds, 2),
                    round(audio_s / seconds, 1),
                    f"{word_error_rate(references, texts):.1%}",
                ]
            )
            print(rows[-1], flush=True)
    for row in rows:
        row.append(round(rtfx[("ours (fp32)", row[1])] / rtfx[(row[0], row[1])], 2))
        row.append(round(rtfx[(best_ours, row[1])] / rtfx[(row[0], row[1])], 2))
    table = markdown_table(
        ["system", "in flight", "wall s", "RTFx", "WER", "ours fp32 / this", f"{best_ours} / this"], rows
    )
    notes = (
        f"{len(clips)} clips, {audio_s:.0f} s of audio, {args.threads} threads for every system; CPU "
        f"{torch.backends.cpu.get_cpu_capability()}, bf16 instructions "
        f"{'yes' if cpu_has_bf16_instructions() else 'no'}, "
        f"AMX {'yes' if torch.cpu._is_amx_tile_supported() else 'no'}; "
        f"{'greedy' if beams == 1 else f'beam {beams}'}, no timestamps, no fallback. 16 in flight: "
        "ours = continuous batching (encoder batches of 8); faster-whisper = 16 client threads over one "
        "CTranslate2 worker per core; transformers = static batches of 16."
    )
    print(table)
    if args.record:
        title = "Offline throughput, tiny.en on CPU (bench_offline.py)"
        record(title if beams == 1 else f"{title}, beam {beams}", table, notes)


if __name__ == "__main__":
    main()
