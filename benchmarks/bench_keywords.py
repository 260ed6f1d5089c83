"""What keywords do to spelling: synthetic clips of rare names, product names and jargon
(benchmarks/keyword_clips.py), each transcribed by tiny.en and base with and without its
keywords through the offline API (greedy, in English, no fallback).

    .venv/bin/python benchmarks/bench_keywords.py [--clips DIR] [--models tiny.en base] [--record]
    .venv/bin/python benchmarks/bench_keywords.py --clips tests/data/speech --only kw_siobhan --make-only

Makes the clips in DIR first (a temporary folder unless given; needs espeak-ng and sox). Prints a
table per model and condition: the terms spelled exactly as given (case and all), the clips with
every term right, and the WER of whole sentences; then each clip's texts. --record appends the
table to the results log (benchmarks/recording.py). --make-only writes the clips and stops (how
tests/data/speech/kw_siobhan.flac was made).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.keyword_clips import KeywordClip, write_clips  # noqa: E402
from benchmarks.recording import markdown_table, record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.transcribe.evaluation import word_error_rate  # noqa: E402
from engine.transcribe.offline import Transcriber  # noqa: E402
from engine.types import DecodeOptions  # noqa: E402


def spelled(clip: KeywordClip, text: str) -> int:
    """How many of the clip's terms the text spells exactly as given."""
    return sum(keyword in text for keyword in clip.keywords)


def transcripts(model: str, clips: list[KeywordClip], folder: Path, with_keywords: bool) -> list[str]:
    transcriber = Transcriber(loaded=load_model(EngineConfig(model=model)))
    texts = []
    for clip in clips:
        # English for both models: base left to detect may pick another language for synthetic
        # speech, which would measure detection, not spelling.
        options = DecodeOptions(language="en", keywords=clip.keywords if with_keywords else None)
        texts.append(transcriber.transcribe([folder / f"{clip.id}.flac"], options)[0].text)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clips", type=Path, help="folder to make the clips in (default: a temporary one)")
    parser.add_argument("--only", nargs="*", help="clip ids (default: all)")
    parser.add_argument("--make-only", action="store_true", help="make the clips and stop")
    parser.add_argument("--models", nargs="*", default=["tiny.en", "base"])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.clips or Path(scratch)
        clips = write_clips(folder, args.only)
        if args.make_only:
            return
        terms = sum(len(clip.keywords) for clip in clips)
        rows, texts = [], {}
        for model in args.models:
            for with_keywords in (False, True):
                found = transcripts(model, clips, folder, with_keywords)
                texts[model, with_keywords] = found
                right = [spelled(clip, text) for clip, text in zip(clips, found)]
                whole = sum(count == len(clip.keywords) for clip, count in zip(clips, right))
                wer = word_error_rate([clip.text for clip in clips], found)
                rows.append(
                    [
                        model,
                        "with" if with_keywords else "without",
                        f"{sum(right)}/{terms}",
                        f"{whole}/{len(clips)}",
                        wer,
                    ]
                )
    table = markdown_table(
        [
            "model",
            "keywords",
            "terms spelled as given",
            "clips with every term right",
            "WER (whole sentences)",
        ],
        rows,
    )
    print(table)
    for index, clip in enumerate(clips):
        print(f"\n{clip.id} ({', '.join(clip.keywords)}): {clip.text}")
        for (model, with_keywords), found in texts.items():
            print(f"  {model:8} {'with' if with_keywords else 'without':8} {found[index]}")
    if args.record:
        record(
            f"Keywords on {len(clips)} synthetic clips of rare names and product names",
            table,
            notes="Clips: benchmarks/keyword_clips.py (espeak-ng, five voices; each term spoken as it "
            "sounds, the reference spelling it as given). Terms are matched exactly, case included.",
        )


if __name__ == "__main__":
    main()
