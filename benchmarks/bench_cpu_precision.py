"""Where the CPU's bf16 path moves tiny.en's tokens: float32 against engine.cpu_dtype bfloat16 and
against bf16 with one part of it put back in float32, on the broad speech set (tests/data/broad_speech
and the English clips of tests/data/speech).

Each variant transcribes the clips of the split asked for (greedy, no timestamps, 2 threads) and is
scored against the references (WER) and against float32's transcripts (how many are identical).
Ablations look at the tuning split only; the held-out split is for the final figures.

    .venv/bin/python benchmarks/bench_cpu_precision.py --split tuning --variants all [--record]
    .venv/bin/python benchmarks/bench_cpu_precision.py --split all --variants 'float32;bfloat16' [--record]

Transcripts are kept in --cache (JSON, by variant and clip id), so a later run adds variants
without transcribing float32 again. Prints a table; --record appends it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model import cpu_attention  # noqa: E402
from engine.model.bf16_products import ENCODER_LAYER_PRODUCTS, products_in_bf16  # noqa: E402
from engine.model.loading import LoadedModel, load_model  # noqa: E402
from engine.transcribe.evaluation import word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from tests.support.speech import broad_clips, sample_of, samples_of  # noqa: E402


def bf16() -> LoadedModel:
    return load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16"))


def vocabulary_in_float32() -> LoadedModel:
    loaded = bf16()
    loaded.model.decoder.vocabulary.bf16 = None
    return loaded


def cross_kv_in_float32() -> LoadedModel:
    loaded = bf16()
    loaded.model.decoder.cross_kv.float()
    loaded.model.decoder.cross_kv_in_bf16 = False
    return loaded


def encoder_in_float32() -> LoadedModel:
    """The decoder's side of the bf16 path (vocabulary, cross-K/V) on a float32 encoder."""
    loaded = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    loaded.model.decoder.vocabulary.keep_bf16_copy()
    loaded.model.decoder.project_cross_kv_in_bf16()
    return loaded


def sdpa_attention() -> LoadedModel:
    """torch's bf16 SDPA in the encoder instead of the explicit products."""
    loaded = bf16()
    for layer in loaded.model.encoder.layers:
        layer.attention_by_products = False
    return loaded


def float32_attention_scores() -> LoadedModel:
    """The encoder's attention scores and softmax in float32 (the products' inputs bf16)."""

    def attend(q, k, v):
        scores = (q.float() * q.shape[-1] ** -0.5) @ k.float().transpose(-1, -2)
        return (scores.softmax(-1).to(v.dtype) @ v).transpose(1, 2).contiguous()

    loaded = bf16()
    cpu_attention_fn = cpu_attention.attention_by_products
    import engine.model.whisper as whisper

    whisper.attention_by_products = attend  # this process only: the variant is measured, not shipped
    loaded.restore = lambda: setattr(whisper, "attention_by_products", cpu_attention_fn)
    return loaded


def encoder_layers_in_float32(indices: tuple[int, ...]) -> Callable[[], LoadedModel]:
    """The bf16 path with the encoder layers of ``indices`` (and the norm after the last) in float32."""

    def make() -> LoadedModel:
        loaded = bf16()
        encoder = loaded.model.encoder
        for index in indices:
            layer = encoder.layers[index].float()
            layer.attention_by_products = False
            layer.register_forward_pre_hook(lambda module, args: (args[0].float(),))
            layer.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
        return loaded

    return make


def bf16_products_except(
    layers: tuple[int, ...] = (), products: tuple[str, ...] = (), scores_in_float32: bool = True
) -> Callable[[], LoadedModel]:
    """engine.cpu_dtype 'bfloat16-products' in every encoder layer but those of ``layers`` (wholly
    float32), with the products named in ``products`` (of ENCODER_LAYER_PRODUCTS) kept float32, and
    the attention scores in bf16 unless ``scores_in_float32``. With the defaults: the shipped path."""

    def make() -> LoadedModel:
        loaded = load_model(EngineConfig(model="tiny.en", dtype="float32"))
        encoder = loaded.model.encoder
        for index, layer in enumerate(encoder.layers):
            if index in [i % len(encoder.layers) for i in layers]:
                continue
            products_in_bf16(
                layer,
                tuple(name for name in ENCODER_LAYER_PRODUCTS if name not in products),
                torch.float32 if scores_in_float32 else None,
            )
        return loaded

    return make


def float32_windows_one_at_a_time() -> LoadedModel:
    """float32 with the encoder given one window per forward instead of eight: the same arithmetic
    in another summation order (other matrix shapes, other kernel blocking), the noise floor of
    "identical to float32"."""
    loaded = load_model(EngineConfig(model="tiny.en", dtype="float32"))
    loaded.encoder_batch_size = 1
    return loaded


VARIANTS: dict[str, Callable[[], LoadedModel]] = {
    "float32": lambda: load_model(EngineConfig(model="tiny.en", dtype="float32")),
    "bfloat16": bf16,
    "bf16, encoder float32": encoder_in_float32,
    "bf16, vocabulary float32": vocabulary_in_float32,
    "bf16, cross-K/V float32": cross_kv_in_float32,
    "bf16, attention scores float32": float32_attention_scores,
    "bf16, encoder layer 0 float32": encoder_layers_in_float32((0,)),
    "bf16, encoder last layer float32": encoder_layers_in_float32((-1,)),
    "bf16, SDPA attention": sdpa_attention,
    "bfloat16-products": lambda: load_model(EngineConfig(model="tiny.en", cpu_dtype="bfloat16-products")),
    "bfloat16-products, scores bf16": bf16_products_except(scores_in_float32=False),
    "bfloat16-products, layer 0 float32": bf16_products_except(layers=(0,)),
    "bfloat16-products, last layer float32": bf16_products_except(layers=(-1,)),
    "bfloat16-products, QKV float32": bf16_products_except(products=("qkv",)),
    "float32, windows one at a time": float32_windows_one_at_a_time,
}


def transcribe(variant: str, clips, cache: dict) -> tuple[dict[str, str], float]:
    done = cache.setdefault(variant, {})
    todo = [clip for clip in clips if clip.id not in done]
    start = time.perf_counter()
    if todo:
        loaded = VARIANTS[variant]()
        batch = getattr(loaded, "encoder_batch_size", 8)
        texts = Transcriber(loaded=loaded, encoder_batch_size=batch).transcribe(samples_of(todo))
        getattr(loaded, "restore", lambda: None)()
        done.update({clip.id: text.text for clip, text in zip(todo, texts)})
    return {clip.id: done[clip.id] for clip in clips}, time.perf_counter() - start


def encoder_speed(cpu_dtypes: list[str], repeats: int = 5) -> str:
    """Each cpu_dtype's encoder forward on random log-mels of 1 and 8 windows: the best of
    ``repeats`` interleaved runs, and its speed against the first's."""
    encoders = {
        dtype: load_model(EngineConfig(model="tiny.en", cpu_dtype=dtype)).model.encoder
        for dtype in cpu_dtypes
    }
    rows = []
    for windows in (1, 8):
        mels = torch.randn(windows, 80, 3000)
        best = dict.fromkeys(encoders, float("inf"))
        with torch.inference_mode():
            for _ in range(repeats):
                for dtype, encoder in encoders.items():
                    start = time.perf_counter()
                    encoder(mels)
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
        first = best[cpu_dtypes[0]]
        rows.append([windows, *(f"{1000 * s:.0f} ms ({first / s:.2f}x)" for s in best.values())])
    return markdown_table(["windows", *cpu_dtypes], rows)


def ctranslate2_int8_against_float32(clips) -> str:
    """faster-whisper (CTranslate2) on the same tiny.en weights in float32 and in int8 (per-channel
    weight scales, int8 activations): how many of its own float32 transcripts its int8 keeps, the
    measure the default's rule applies to ours."""
    import numpy as np
    from faster_whisper import WhisperModel

    from engine.model.weights import resolve_model_folder

    audio, references, texts = samples_of(clips), [clip.text for clip in clips], {}
    for compute_type in ("float32", "int8"):
        model = WhisperModel(str(resolve_model_folder("tiny.en")), device="cpu", compute_type=compute_type)
        texts[compute_type] = [
            "".join(
                segment.text
                for segment in model.transcribe(
                    np.asarray(samples, dtype=np.float32),
                    language="en",
                    beam_size=1,
                    temperature=0.0,
                    without_timestamps=True,
                    condition_on_previous_text=False,
                )[0]
            ).strip()
            for samples in audio
        ]
    identical = sum(a == b for a, b in zip(texts["float32"], texts["int8"]))
    rows = [
        [
            "faster-whisper float32",
            f"{word_error_rate(references, texts['float32']):.2%}",
            f"{len(clips)}/{len(clips)}",
        ],
        [
            "faster-whisper int8",
            f"{word_error_rate(references, texts['int8']):.2%}",
            f"{identical}/{len(clips)}",
        ],
    ]
    return markdown_table(["system", "WER", "identical to its float32"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--split", choices=("tuning", "held_out", "all"), default="tuning")
    parser.add_argument("--variants", default="all", help=f"separated by ';', of: {'; '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/cpu_precision_transcripts.json"))
    parser.add_argument(
        "--changed-by",
        metavar="VARIANT",
        help="only the clips whose transcript VARIANT (transcribed before, in --cache) changed, and as "
        "many it left alone: an ablation that asks which part of the bf16 path moves the tokens",
    )
    parser.add_argument(
        "--encoder-speed",
        action="store_true",
        help="instead: time the encoder under each engine.cpu_dtype (float32, bfloat16-products, bfloat16)",
    )
    parser.add_argument(
        "--ctranslate2-sample",
        type=int,
        metavar="N",
        help="instead: how many of faster-whisper's float32 transcripts its int8 keeps, on N clips",
    )
    parser.add_argument("--record", action="store_true", help="append the table to the results log")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.ctranslate2_sample:
        table = ctranslate2_int8_against_float32(sample_of(broad_clips(), args.ctranslate2_sample))
        print(table)
        if args.record:
            record("faster-whisper int8 against its float32 (bench_cpu_precision.py)", table)
        return
    if args.encoder_speed:
        table = encoder_speed(["float32", "bfloat16-products", "bfloat16"])
        print(table)
        if args.record:
            record("Encoder speed by engine.cpu_dtype, tiny.en (bench_cpu_precision.py)", table)
        return
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(";")
    if "float32" not in names:
        names.insert(0, "float32")
    clips = broad_clips(None if args.split == "all" else args.split)
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    if args.changed_by:
        before, after = cache["float32"], cache[args.changed_by]
        changed = [clip for clip in clips if before[clip.id] != after[clip.id]]
        kept = [clip for clip in clips if before[clip.id] == after[clip.id]]
        clips = changed + sample_of(kept, len(changed))
    references = [clip.text for clip in clips]
    rows, float32 = [], None
    for name in names:
        texts, seconds = transcribe(name, clips, cache)
        args.cache.write_text(json.dumps(cache, indent=1))
        hypotheses = [texts[clip.id] for clip in clips]
        float32 = float32 or hypotheses
        identical = sum(ours == theirs for ours, theirs in zip(hypotheses, float32))
        rows.append([name, f"{word_error_rate(references, hypotheses):.2%}", f"{identical}/{len(clips)}"])
        print(rows[-1], f"{seconds:.0f} s", flush=True)
    table = markdown_table(["variant", "WER", "identical to float32"], rows)
    print(table)
    if args.record:
        subset = f", those {args.changed_by} changed and as many it did not" if args.changed_by else ""
        notes = (
            f"tiny.en, greedy, {args.threads} threads; split {args.split}{subset}: {len(clips)} clips, "
            f"{len({clip.voice for clip in clips if clip.voice})} synthetic voices"
        )
        record(f"CPU precision ablation, tiny.en, {args.split} split (bench_cpu_precision.py)", table, notes)


if __name__ == "__main__":
    main()
