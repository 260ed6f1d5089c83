"""`whisper-disagg transcribe FILE...`: the offline engine from the shell."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.types import DecodeOptions, FallbackOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whisper-disagg")
    commands = parser.add_subparsers(dest="command", required=True)
    transcribe = commands.add_parser("transcribe", help="transcribe audio files")
    transcribe.add_argument("files", nargs="+")
    transcribe.add_argument("--model", default="tiny.en", help="bundled name, folder, or cached HF id")
    transcribe.add_argument(
        "--language", default=None, help="language code; default: detect (English for .en)"
    )
    transcribe.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    transcribe.add_argument("--device", default="cpu")
    transcribe.add_argument("--temperature", type=float, default=0.0)
    transcribe.add_argument(
        "--no-fallback", action="store_true", help="decode each window once (no temperature fallback)"
    )
    transcribe.add_argument(
        "--beam-size", type=int, default=1, help="beams at temperature 0 (openai-whisper's CLI uses 5)"
    )
    transcribe.add_argument(
        "--patience", type=float, default=None, help="with beams: beam_size * patience must end"
    )
    transcribe.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        help="alpha in [0, 1]; default: rank by log-probability per token",
    )
    transcribe.add_argument(
        "--best-of",
        type=int,
        default=1,
        help="samples per fallback attempt above temperature 0; the best is kept",
    )
    transcribe.add_argument("--long-form", choices=("parallel", "sequential"), default="parallel")
    transcribe.add_argument("--json", action="store_true", help="one JSON object per file, one per line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from engine.transcribe.offline import Transcriber  # heavy imports after argument errors are reported

    try:
        options = DecodeOptions(
            language=args.language,
            task=args.task,
            temperature=args.temperature,
            fallback=None if args.no_fallback else FallbackOptions(),
            beam_size=args.beam_size,
            patience=args.patience,
            length_penalty=args.length_penalty,
            best_of=args.best_of,
        )
        with Transcriber(EngineConfig(model=args.model, device=args.device)) as transcriber:
            results = transcriber.transcribe(args.files, options, long_form=args.long_form)
    except (EngineError, OSError, ValueError) as exc:
        print(f"whisper-disagg: error: {exc}", file=sys.stderr)
        return 2
    for path, result in zip(args.files, results):
        if args.json:
            print(
                json.dumps(
                    {
                        "file": path,
                        "text": result.text,
                        "language": result.language,
                        "duration_s": round(result.duration_s, 3),
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(result.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
