"""On a CUDA machine: the engine runs unchanged on the GPU, with each attention backend, and
greedy-decodes the same tokens as transformers there (random weights of tiny.en's shapes, real
speech). Prints one row per (backend, dtype); --record appends the table to RESULTS.md.

    python benchmarks/check_gpu_engine.py --tokenizer path/to/tokenizer.json [--record]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.decode.engine import DecoderEngine  # noqa: E402
from engine.encode.runner import EncoderRunner  # noqa: E402
from engine.kv.sources import CrossKVTensor  # noqa: E402
from engine.model.audio import load_audio_file, log_mel_spectrogram, pad_or_trim  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.transcribe.evaluation import load_manifest  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402
from tests.support.hf_reference import hf_greedy, hf_model  # noqa: E402

SPEECH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"


def random_tiny_shaped_folder(tokenizer_file: Path) -> Path:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=51864,
        num_mel_bins=80,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25],
        begin_suppress_tokens=[220, 50256],
    )
    folder = Path(tempfile.mkdtemp(prefix="random-tiny-"))
    WhisperForConditionalGeneration(config).save_pretrained(folder)
    shutil.copy(tokenizer_file, folder / "tokenizer.json")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True, help="a Whisper tokenizer.json (English)")
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script itself")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    folder = random_tiny_shaped_folder(args.tokenizer)
    clips = [c for c in load_manifest(SPEECH_DIR) if c.text and c.duration_s <= 30][: args.clips]
    audio = torch.from_numpy(np.stack([pad_or_trim(load_audio_file(c.path)) for c in clips]))

    reference, _ = hf_model(str(folder))
    reference = reference.to(args.device)
    rows, expected = [], None
    for dtype in ("float32", "bfloat16") if on_gpu else ("float32",):
        for backend in ("torch", "triton") if on_gpu else ("torch",):
            loaded = load_model(
                EngineConfig(model=str(folder), device=args.device, dtype=dtype, attention_backend=backend)
            )
            engine, encoder = DecoderEngine(loaded), EncoderRunner(loaded)
            cross_kv = encoder.cross_kv(encoder.encode(audio.to(args.device)))
            requests = [
                engine.make_request(DecodeOptions(max_tokens=args.max_tokens), CrossKVTensor(kv))
                for kv in cross_kv
            ]
            started = time.perf_counter()
            for request in requests:  # all at once: one continuous batch
                engine.submit(request)
            results = {}
            while engine.has_work:
                results.update({r.request_id: r for r in engine.step()})
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            tokens = [results[r.request_id].tokens for r in requests]
            if expected is None:
                mels = log_mel_spectrogram(audio.to(args.device), 80)
                special = loaded.tokenizer.special
                expected = [
                    hf_greedy(
                        reference,
                        mels[i : i + 1],
                        requests[i].prompt_tokens,
                        requests[i].max_tokens,
                        special.eot,
                        engine.rules.suppress_token_ids,
                        engine.rules.begin_suppress_token_ids,
                    )
                    for i in range(len(requests))
                ]
            exact = sum(a == b for a, b in zip(tokens, expected))
            rows.append(
                [
                    backend,
                    dtype,
                    f"{exact}/{len(requests)}",
                    engine.pool.num_used_blocks,
                    round(seconds * 1000, 1),
                ]
            )
            print(rows[-1], flush=True)
    table = markdown_table(
        [
            "attention backend",
            "dtype",
            "token-exact vs transformers fp32 (GPU)",
            "blocks used after",
            "decode ms (16 x 40 tokens)",
        ],
        rows,
    )
    print(table)
    if args.record:
        record(
            "Engine on the GPU: backends vs transformers (check_gpu_engine.py)",
            table,
            "Random weights of tiny.en's shapes, 16 real speech clips decoded together, greedy, 40 tokens. "
            "bf16 rows compare bf16 engines with the fp32 reference: differences there are rounding, "
            "not bugs.",
        )


if __name__ == "__main__":
    main()
