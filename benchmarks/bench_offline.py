"""Offline throughput on the broad speech set: our engine vs faster-whisper (same tiny.en weights,
fp32 and int8) vs transformers' generate, one request at a time and with 16 in flight, each run a
whole process as a user of a CLI runs it: interpreter start-up, imports and model load are counted.

RTFx = audio seconds / wall seconds of the process. All engines get the same CPU threads and the same
clips (the broad speech set of tests/support/speech.py: the English clips of tests/data/speech and
the synthetic utterances of tests/data/broad_speech, their noise added and written as WAV files
first; or an even sample of it with ``--sample``), greedy decoding (or ``--beam-size`` beams)
without timestamps. "start-up s" is how long each process took to be ready to transcribe.

    .venv/bin/python benchmarks/bench_offline.py [--threads 2] [--beam-size 5] [--sample 120] \
        [--no-transformers] [--record]

Prints a table of RTFx and WER per system and requests in flight; --record appends it to the
results log (benchmarks/recording.py). `make bench` runs it with the defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each system: what its process runs (see worker) and the precision it is given.
SYSTEMS = {
    "ours (fp32)": ("ours", "float32"),
    "ours (cpu_dtype bfloat16-products)": ("ours", "bfloat16-products"),
    "ours (cpu_dtype bfloat16)": ("ours", "bfloat16"),
    "faster-whisper fp32": ("faster-whisper", "float32"),
    "faster-whisper int8": ("faster-whisper", "int8"),
    "transformers generate (fp32)": ("transformers", "float32"),
}


def run_ours(files: list[str], in_flight: int, beam_size: int, cpu_dtype: str, ready) -> list[str]:
    from engine.config import EngineConfig
    from engine.model.loading import load_model
    from engine.transcribe.offline import Transcriber
    from engine.types import DecodeOptions

    # Each beam is a sequence of the decode loop: room for every window in flight and its beams.
    loaded = load_model(EngineConfig(max_num_seqs=max(in_flight, 1) * beam_size, cpu_dtype=cpu_dtype))
    transcriber = Transcriber(loaded=loaded, encoder_batch_size=min(in_flight, 8))
    options = DecodeOptions(beam_size=beam_size)
    ready()
    if in_flight == 1:
        return [transcriber.transcribe([path], options)[0].text for path in files]
    return [t.text for t in transcriber.transcribe(files, options)]


def run_faster_whisper(
    files: list[str],
    in_flight: int,
    beam_size: int,
    compute_type: str,
    ready,
    model_folder: str,
    threads: int,
) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    from faster_whisper import WhisperModel

    from engine.transcribe.evaluation import faster_whisper_text

    workers = 1 if in_flight == 1 else threads  # one CTranslate2 worker per core, fed by 16 client threads
    model = WhisperModel(
        model_folder,
        device="cpu",
        compute_type=compute_type,
        cpu_threads=threads // workers,
        num_workers=workers,
    )
    ready()

    def one(path: str) -> str:  # the file's path: transcribe decodes it, as a user's call does
        return faster_whisper_text(model, path, beam_size)

    if in_flight == 1:
        return [one(path) for path in files]
    with ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(one, files))


def run_transformers(files: list[str], in_flight: int, beam_size: int, ready) -> list[str]:
    import torch
    from transformers import GenerationMixin, WhisperFeatureExtractor

    from engine.config import EngineConfig
    from engine.decode.step.logit_rules import LogitRules
    from engine.model.audio import N_SAMPLES, load_audio_file
    from engine.model.loading import load_model
    from tests.support.hf_reference import hf_model

    model, weights = hf_model("tiny.en")
    loaded = load_model(EngineConfig(dtype="float32"))
    special = loaded.tokenizer.special
    rules = LogitRules(
        loaded.tokenizer,
        weights.dims.vocab_size,
        weights.suppress_tokens,
        weights.begin_suppress_tokens,
        torch.device("cpu"),
    )
    extractor = WhisperFeatureExtractor(feature_size=80)
    prompt = [special.sot, special.no_timestamps]
    ready()
    audio = [load_audio_file(path)[:N_SAMPLES] for path in files]

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

    return [t for i in range(0, len(audio), in_flight) for t in batch(audio[i : i + in_flight])]


def worker(args: argparse.Namespace) -> None:
    """One system's whole run, in a process of its own: prints its texts and when it was ready."""
    kind, precision = SYSTEMS[args.worker]
    files = Path(args.files_from).read_text().splitlines()
    ready_at = {}

    def ready() -> None:
        ready_at["s"] = time.time() - args.spawned_at

    if kind != "faster-whisper":  # faster-whisper's process never imports torch
        import torch

        torch.set_num_threads(args.threads)
    if kind == "ours":
        texts = run_ours(files, args.in_flight, args.beam_size, precision, ready)
    elif kind == "faster-whisper":
        texts = run_faster_whisper(
            files, args.in_flight, args.beam_size, precision, ready, args.model_folder, args.threads
        )
    else:
        texts = run_transformers(files, args.in_flight, args.beam_size, ready)
    print(json.dumps({"texts": texts, "ready_s": ready_at["s"]}))


def whole_process(
    name: str, in_flight: int, files_from: Path, args, model_folder: str
) -> tuple[list[str], float, float]:
    """``name``'s run as a child process: its texts, its wall seconds from spawn to exit, and how
    long it took to be ready to transcribe."""
    spawned_at = time.time()
    start = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            name,
            "--in-flight",
            str(in_flight),
            "--files-from",
            str(files_from),
            "--threads",
            str(args.threads),
            "--beam-size",
            str(args.beam_size),
            "--model-folder",
            model_folder,
            "--spawned-at",
            repr(spawned_at),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    seconds = time.perf_counter() - start
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["texts"], seconds, result["ready_s"]


def write_clips(clips, folder: Path) -> Path:
    """The clips as they are scored (noise added) in WAV files, and a list of their paths."""
    import soundfile

    from engine.model.audio import SAMPLE_RATE
    from engine.transcribe.evaluation import clip_samples

    paths = []
    for clip in clips:
        path = folder / f"{clip.id}.wav"
        soundfile.write(path, clip_samples(clip), SAMPLE_RATE, subtype="FLOAT")
        paths.append(str(path))
    files_from = folder / "files.txt"
    files_from.write_text("\n".join(paths))
    return files_from


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--sample", type=int, default=None, help="an even sample of this many clips")
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out")
    parser.add_argument(
        "--systems",
        help=f"only these systems, separated by ';' (faster-whisper int8 always runs): {'; '.join(SYSTEMS)}",
    )
    parser.add_argument("--record", action="store_true", help="append the table to the results log")
    # A system's own process (see whole_process):
    parser.add_argument("--worker", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--files-from", help=argparse.SUPPRESS)
    parser.add_argument("--model-folder", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.worker:
        worker(args)
        return

    import torch

    from benchmarks.recording import markdown_table, record
    from engine.config import EngineConfig, cpu_has_bf16_instructions
    from engine.model.weights import resolve_model_folder
    from engine.transcribe.evaluation import word_error_rate
    from tests.support.speech import broad_clips, sample_of

    clips = broad_clips()
    if args.sample:
        clips = sample_of(clips, args.sample)
    audio_s = sum(c.duration_s for c in clips)
    references = [c.text for c in clips]
    default_dtype = EngineConfig().cpu_dtype
    systems = [name for name in SYSTEMS if args.no_transformers is False or "transformers" not in name]
    if args.systems:
        asked = set(args.systems.split(";")) | {"faster-whisper int8"}  # every ratio is against it
        systems = [name for name in systems if name in asked]
    if not cpu_has_bf16_instructions():  # the engine refuses bf16 without the instructions
        systems = [name for name in systems if not SYSTEMS[name][1].startswith("bfloat16")]
    labels = {
        name: f"{name}, the default" if SYSTEMS[name] == ("ours", default_dtype) else name for name in systems
    }
    model_folder = str(resolve_model_folder("tiny.en"))
    rows, rtfx = [], {}
    with tempfile.TemporaryDirectory() as folder:
        files_from = write_clips(clips, Path(folder))
        for in_flight in (1, 16):
            for name in systems:
                texts, seconds, ready_s = whole_process(name, in_flight, files_from, args, model_folder)
                rtfx[(name, in_flight)] = audio_s / seconds
                row = [
                    labels[name],
                    in_flight,
                    round(ready_s, 1),
                    round(seconds, 1),
                    round(audio_s / seconds, 1),
                ]
                rows.append([*row, f"{word_error_rate(references, texts):.1%}"])
                print(rows[-1], flush=True)
    figures = [
        {"system": row[0], "in_flight": row[1], "startup_s": row[2], "wall_s": row[3], "rtfx": row[4]}
        for row in rows
    ]
    for row, figure, (name, in_flight) in zip(rows, figures, [(n, f) for f in (1, 16) for n in systems]):
        figure["wer"] = round(float(row[5].rstrip("%")) / 100, 4)
        row.append(f"{rtfx[(name, in_flight)] / rtfx[('faster-whisper int8', in_flight)]:.2f}x")
    table = markdown_table(
        ["system", "in flight", "start-up s", "wall s", "RTFx", "WER", "RTFx / faster-whisper int8"], rows
    )
    voices = len({c.voice for c in clips if c.voice})
    notes = (
        f"{len(clips)} clips of the broad speech set ({voices} synthetic voices; {audio_s:.0f} s of audio), "
        f"{args.threads} threads for every system, each run a whole process (start-up, imports and model "
        f"load counted); CPU {torch.backends.cpu.get_cpu_capability()}, bf16 instructions "
        f"{'yes' if cpu_has_bf16_instructions() else 'no'}, "
        f"AMX {'yes' if torch.cpu._is_amx_tile_supported() else 'no'}; "
        f"{'greedy' if args.beam_size == 1 else f'beam {args.beam_size}'}, no timestamps, no fallback. "
        "16 in flight: ours = continuous batching (encoder batches of 8); faster-whisper = 16 client "
        "threads over one CTranslate2 worker per core; transformers = static batches of 16."
    )
    print(table)
    if args.record:
        title = "Offline throughput, tiny.en on CPU, whole processes (bench_offline.py)"
        if args.beam_size == 1:  # the performance page's figures (benchmarks/plot_performance.py)
            record(
                title,
                table,
                notes,
                REPO / "benchmarks" / "results" / "offline_cpu.json",
                {"load": notes, "rows": figures},
            )
        else:
            record(f"{title}, beam {args.beam_size}", table, notes)


if __name__ == "__main__":
    main()
