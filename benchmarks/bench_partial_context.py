"""Partial passes on a shortened encoder context against the full 30 s window (issue 69, item 1).

Each clip of the speech set is replayed as a live turn sees it (0.3 s of silence, the speech, 0.5 s
of silence): a partial pass every 0.5 s of audio from 1.5 s on, decoded as the live turn decodes
one (greedy, its token cap), its words through LocalAgreement as the session sends them; then the
final pass over the whole turn on the full window, with fallback. The partial passes are encoded
over the full window, or over the audio they have (engine/encode/context.py) with the silence
after it padded by ``pad_s`` and the context at least ``min_s``.

Per model and context, it prints:
- turns with text: turns with a delta sent before the final pass;
- first word (s): audio heard when the first delta went out, from the speech's start (median);
- sent kept: of the words sent before the final pass, the share the final pass's text has too;
- retracted: words sent that the final pass's text has not (deltas never take words back, so
  these stay in the turn's text where the final pass heard otherwise);
- turns = final: turns whose deltas join to exactly the final pass's text;
- WER: of the turns' texts (the deltas joined) against the references;
- encoder ms/pass: the partial passes' encoder time (median), on this machine as loaded now.

    python benchmarks/bench_partial_context.py [--models tiny.en base] [--clips 6] [--record]
"""

from __future__ import annotations

import argparse
import difflib
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from engine import EngineConfig, load_model
from engine.decode.engine import DecoderEngine
from engine.encode.context import context_frames
from engine.encode.runner import EncoderRunner
from engine.kv.sources import CrossKVTensor
from engine.model.audio import SAMPLE_RATE, load_audio_file
from engine.transcribe.agreement import LocalAgreement, _bare
from engine.transcribe.evaluation import word_error_rate
from engine.types import DecodeOptions, FallbackOptions
from tests.support.engines import run_to_completion_by_id
from tests.support.speech import sample_of, short_english_clips

LEAD_S, TAIL_S = 0.3, 0.5  # the silence around a turn's speech, as the server's VAD leaves it
FIRST_PASS_S, PASS_EVERY_S = 1.5, 0.5  # deployments/orchestration/live_turn.py's
# (label, min_s, pad_s); None: the full 30 s window.
CONTEXTS: list[tuple[str, float | None, float | None]] = [
    ("full window", None, None),
    ("audio", 0.0, 0.0),
    ("audio + 1 s", 0.0, 1.0),
    ("audio + 1 s, >= 5 s", 5.0, 1.0),
]


@dataclass
class ContextTally:
    turns: int = 0
    turns_with_text: int = 0
    first_word_s: list[float] = field(default_factory=list)
    sent: int = 0
    kept: int = 0
    turns_equal_final: int = 0
    encoder_s: list[float] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def row(self, label: str) -> list:
        first = statistics.median(self.first_word_s) if self.first_word_s else float("nan")
        return [
            label,
            f"{self.turns_with_text}/{self.turns}",
            first,
            self.kept / self.sent if self.sent else float("nan"),
            self.sent - self.kept,
            f"{self.turns_equal_final}/{self.turns}",
            100 * word_error_rate(self.references, self.texts),
            1000 * statistics.median(self.encoder_s),
        ]


def partial_options(duration_s: float) -> DecodeOptions:
    """A live turn's partial pass (deployments/orchestration/live_turn.py): greedy, capped."""
    return DecodeOptions(max_tokens=min(224, int(10 + 6 * duration_s)))


def partial_texts(
    runner: EncoderRunner, engine: DecoderEngine, turn: np.ndarray, min_s, pad_s
) -> tuple[list[tuple[float, str]], list[float]]:
    """Every partial pass's (audio heard, text), and each pass's encoder seconds."""
    ends_s = np.arange(FIRST_PASS_S, len(turn) / SAMPLE_RATE + 1e-9, PASS_EVERY_S)
    cuts = [turn[: int(end_s * SAMPLE_RATE)] for end_s in ends_s]
    by_frames: dict[int | None, list[int]] = {}
    for index, samples in enumerate(cuts):
        frames = None if min_s is None else context_frames(len(samples), min_s, pad_s)
        by_frames.setdefault(frames, []).append(index)
    encoder_s = []
    for frames, indexes in by_frames.items():  # one forward per context, as an encoder batch would
        started = time.perf_counter()
        states = runner.encode([cuts[index] for index in indexes], frames)
        encoder_s += [(time.perf_counter() - started) / len(indexes)] * len(indexes)
        for index, kv in zip(indexes, runner.cross_kv(states)):
            duration_s = len(cuts[index]) / SAMPLE_RATE
            engine.submit(engine.make_request(partial_options(duration_s), CrossKVTensor(kv), f"p{index}"))
    results = run_to_completion_by_id(engine)
    return [(float(ends_s[index]), results[f"p{index}"].text) for index in range(len(cuts))], encoder_s


def final_text(runner: EncoderRunner, engine: DecoderEngine, turn: np.ndarray) -> str:
    kv = runner.cross_kv(runner.encode([turn]))[0]
    engine.submit(engine.make_request(DecodeOptions(fallback=FallbackOptions()), CrossKVTensor(kv), "final"))
    return run_to_completion_by_id(engine)["final"].text


def sent_words_kept(sent: list[str], final: list[str]) -> int:
    """Of the words sent, how many the final text has in the same order (case and punctuation aside)."""
    matcher = difflib.SequenceMatcher(a=[_bare(w) for w in sent], b=[_bare(w) for w in final], autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def measure(model: str, clip_count: int) -> list[list]:
    loaded = load_model(EngineConfig(model=model))
    runner, engine = EncoderRunner(loaded), DecoderEngine(loaded)
    tallies = {label: ContextTally() for label, _, _ in CONTEXTS}
    for clip in sample_of(short_english_clips(), clip_count):
        speech = load_audio_file(clip.path)
        silence = np.zeros(int(LEAD_S * SAMPLE_RATE), dtype=np.float32)
        turn = np.concatenate([silence, speech, np.zeros(int(TAIL_S * SAMPLE_RATE), np.float32)])
        final = final_text(runner, engine, turn)
        for label, min_s, pad_s in CONTEXTS:
            tally = tallies[label]
            passes, encoder_s = partial_texts(runner, engine, turn, min_s, pad_s)
            agreement = LocalAgreement(span_s=2.0)  # realtime.partial_agreement_s's default
            first_s = None
            for heard_s, text in passes:
                if agreement.update(text, heard_s) and first_s is None:
                    first_s = heard_s - LEAD_S
            sent = list(agreement.committed)
            agreement.finish_window(final)
            tally.turns += 1
            tally.turns_with_text += bool(sent)
            if first_s is not None:
                tally.first_word_s.append(first_s)
            tally.sent += len(sent)
            tally.kept += sent_words_kept(sent, final.split())
            tally.turns_equal_final += agreement.text == final.strip()
            tally.encoder_s += encoder_s
            tally.references.append(clip.text)
            tally.texts.append(agreement.text)
        print(f"{model} {clip.id}: done", flush=True)
    return [[model, *tallies[label].row(label)] for label, _, _ in CONTEXTS]


HEADERS = [
    "model",
    "partial context",
    "turns with text",
    "first word (s)",
    "sent kept",
    "retracted",
    "turns = final",
    "WER %",
    "encoder ms/pass",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["tiny.en", "base"])
    parser.add_argument("--clips", type=int, default=6, help="clips of the speech set, spread evenly")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    from benchmarks.recording import markdown_table, record

    rows = []
    for model in args.models:
        rows += measure(model, args.clips)
        print(markdown_table(HEADERS, rows), flush=True)  # so far: a long run shows each model's
    table = markdown_table(HEADERS, rows)
    print(table)
    if args.record:
        record(
            "Partial passes on the audio they have: a shortened encoder context",
            table,
            notes=(
                f"{args.clips} clips of the speech set as live turns, a partial pass every "
                f"{PASS_EVERY_S} s of audio from {FIRST_PASS_S} s, LocalAgreement (3 passes over 2 s); "
                "final passes on the full window. Encoder times on a shared CPU: compare within a row set."
            ),
        )


if __name__ == "__main__":
    main()
