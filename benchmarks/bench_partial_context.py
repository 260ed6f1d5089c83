"""Partial passes on a shortened encoder context against the full 30 s window (issue 69, item 1),
and policies for when partial text goes out (item 2: as soon as it can be trusted).

Each clip of the speech set is replayed as a live turn sees it (0.3 s of silence, the speech, 0.5 s
of silence): partial passes over the audio so far on a policy's schedule (today's: every 0.5 s of
audio from 1.5 s on), decoded as the live turn decodes one (greedy, its token cap), its words
through LocalAgreement with the policy's settings as the session sends them; then the final pass
over the whole turn on the full window, with fallback. The partial passes are encoded over the full
window, or over the audio they have (engine/encode/context.py) with the silence after it padded by
``pad_s`` and the context at least ``min_s``. The replay is deterministic: a pass's text depends on
the audio it heard, never on when it ran or how fast this machine is.

Per model, context and policy, it prints:
- turns with text: turns with a delta sent before the final pass;
- first word (s): audio heard when the first delta went out, from the speech's start (median over
  the turns with text);
- sent kept: of the words sent before the final pass, the share the final pass's text has too;
- retracted: words sent that the final pass's text has not (deltas never take words back, so
  these stay in the turn's text where the final pass heard otherwise);
- turns = final: turns whose deltas join to exactly the final pass's text;
- WER: of the turns' texts (the deltas joined) against the references;
- encoder ms/pass: the partial passes' encoder time (median), on this machine as loaded now.

    python benchmarks/bench_partial_context.py [--models tiny.en base] [--clips 6]
        [--contexts "full window" ...] [--policies today ... | all] [--passes-cache FILE] [--record]
"""

from __future__ import annotations

import argparse
import difflib
import os
import pickle
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
from engine.transcribe.agreement import LocalAgreement, _bare, word_probabilities
from engine.transcribe.evaluation import word_error_rate
from engine.types import DecodeOptions, FallbackOptions
from tests.support.engines import run_to_completion_by_id
from tests.support.speech import sample_of, short_english_clips

LEAD_S, TAIL_S = 0.3, 0.5  # the silence around a turn's speech, as the server's VAD leaves it
# (label, min_s, pad_s); None: the full 30 s window.
CONTEXTS: list[tuple[str, float | None, float | None]] = [
    ("full window", None, None),
    ("audio", 0.0, 0.0),
    ("audio + 1 s", 0.0, 1.0),
    ("audio + 1 s, >= 5 s", 5.0, 1.0),
]


@dataclass(frozen=True)
class Policy:
    """When a turn's partial passes run (seconds of the turn's audio) and what LocalAgreement
    commits of them (engine/transcribe/agreement.py)."""

    first_s: float = 1.5  # the first pass, once the turn holds this much audio
    every_s: float = 0.5  # then one per this much more audio
    early_every_s: float | None = None  # the first passes' interval, until early_until_s
    early_until_s: float = 0.0
    passes: int = 3
    span_s: float = 2.0
    sure_passes: int = 0
    sure_prob: float = 1.0
    sure_span_s: float = 0.0
    release_prob: float | None = None

    def pass_ends_s(self, turn_s: float) -> list[float]:
        ends, end = [], self.first_s
        while end <= turn_s + 1e-9:
            ends.append(round(end, 3))
            early = self.early_every_s is not None and end < self.early_until_s - 1e-9
            end += self.early_every_s if early else self.every_s
        return ends

    def agreement(self) -> LocalAgreement:
        return LocalAgreement(
            self.passes, self.span_s, self.sure_passes, self.sure_prob, self.sure_span_s, self.release_prob
        )


# "today": the live turn's schedule and realtime's defaults (deployments/orchestration/live_turn.py,
# deployments/config.py); "first1.0": the first pass at 1.0 s of audio; "fast": passes every 0.25 s
# of audio from 0.75 s until 2.5 s, then every 0.5 s; "spanX": agreement over X s of audio instead
# of 2 s; "sureN@p": a word is also committed once N consecutive passes agree on it, each at least p
# sure of it (LocalAgreement's sure_passes); "lastP": a pass's last word goes too when every
# agreeing pass is at least P sure of it (LocalAgreement's release_prob).
FAST = {"first_s": 0.75, "early_every_s": 0.25, "early_until_s": 2.5}
POLICIES: dict[str, Policy] = {
    "today": Policy(),
    "first1.0": Policy(first_s=1.0),
    "first1.0 span1.5": Policy(first_s=1.0, span_s=1.5),
    "first1.0 span1.0": Policy(first_s=1.0, span_s=1.0),
    "first1.0 sure2@0.9": Policy(first_s=1.0, sure_passes=2, sure_prob=0.9),
    "fast": Policy(**FAST),
    "fast span1.5": Policy(**FAST, span_s=1.5),
    "fast span1.25": Policy(**FAST, span_s=1.25),
    **{f"fast sure2@{prob}": Policy(**FAST, sure_passes=2, sure_prob=prob) for prob in (0.5, 0.7, 0.9)},
    "fast sure3@0.7": Policy(**FAST, sure_passes=3, sure_prob=0.7),
    "fast sure2@0.7 last0.9": Policy(**FAST, sure_passes=2, sure_prob=0.7, release_prob=0.9),
}


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

    def row(self) -> list:
        first = statistics.median(self.first_word_s) if self.first_word_s else float("nan")
        return [
            f"{self.turns_with_text}/{self.turns}",
            first,
            self.kept / self.sent if self.sent else float("nan"),
            self.sent - self.kept,
            f"{self.turns_equal_final}/{self.turns}",
            100 * word_error_rate(self.references, self.texts),
            1000 * statistics.median(self.encoder_s),
        ]

    def add(self, clip_text: str, final: str, policy: Policy, passes: list[tuple[float, str, list | None]]):
        agreement = policy.agreement()
        first_s = None
        for heard_s, text, word_probs in passes:
            if agreement.update(text, heard_s, word_probs) and first_s is None:
                first_s = heard_s - LEAD_S
        sent = list(agreement.committed)
        agreement.finish_window(final)
        self.turns += 1
        self.turns_with_text += bool(sent)
        if first_s is not None:
            self.first_word_s.append(first_s)
        self.sent += len(sent)
        self.kept += sent_words_kept(sent, final.split())
        self.turns_equal_final += agreement.text == final.strip()
        self.references.append(clip_text)
        self.texts.append(agreement.text)


def partial_options(duration_s: float) -> DecodeOptions:
    """A live turn's partial pass (deployments/orchestration/live_turn.py): greedy, capped."""
    return DecodeOptions(max_tokens=min(224, int(10 + 6 * duration_s)), token_logprobs=True)


def partial_texts(
    runner: EncoderRunner, engine: DecoderEngine, turn: np.ndarray, min_s, pad_s, ends_s: list[float]
) -> tuple[dict[float, tuple[str, list[float] | None]], list[float]]:
    """Each partial pass's text and its words' probabilities by the audio it heard, and each pass's
    encoder seconds."""
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
    texts = {}
    for index, end_s in enumerate(ends_s):
        result = results[f"p{index}"]
        texts[end_s] = (result.text, word_probabilities(result.token_logprobs or [], result.text))
    return texts, encoder_s


def final_text(runner: EncoderRunner, engine: DecoderEngine, turn: np.ndarray) -> str:
    kv = runner.cross_kv(runner.encode([turn]))[0]
    engine.submit(engine.make_request(DecodeOptions(fallback=FallbackOptions()), CrossKVTensor(kv), "final"))
    return run_to_completion_by_id(engine)["final"].text


def sent_words_kept(sent: list[str], final: list[str]) -> int:
    """Of the words sent, how many the final text has in the same order (case and punctuation aside)."""
    matcher = difflib.SequenceMatcher(a=[_bare(w) for w in sent], b=[_bare(w) for w in final], autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


class PassCache:
    """Partial passes' texts (and encoder seconds) and final texts kept from earlier runs, in a
    pickle: a pass's text depends on the model, the clip, the context and the audio it heard alone,
    so policies can be compared on passes decoded once."""

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict = {}
        if path and os.path.exists(path):
            with open(path, "rb") as source:
                self.entries = pickle.load(source)

    def save(self) -> None:
        if self.path:
            with open(self.path, "wb") as out:
                pickle.dump(self.entries, out)


def measure(
    model: str, clip_count: int, contexts: list[str], policies: list[str], cache: PassCache
) -> list[list]:
    models: list = []  # loaded on the first pass the cache lacks

    def runner_engine():
        if not models:
            loaded = load_model(EngineConfig(model=model))
            models.extend([EncoderRunner(loaded), DecoderEngine(loaded)])
        return models

    chosen = [context for context in CONTEXTS if context[0] in contexts]
    tallies = {(label, name): ContextTally() for label, _, _ in chosen for name in policies}
    for clip in sample_of(short_english_clips(), clip_count):
        speech = load_audio_file(clip.path)
        silence = np.zeros(int(LEAD_S * SAMPLE_RATE), dtype=np.float32)
        turn = np.concatenate([silence, speech, np.zeros(int(TAIL_S * SAMPLE_RATE), np.float32)])
        if (model, clip.id, "final") not in cache.entries:
            cache.entries[model, clip.id, "final"] = final_text(*runner_engine(), turn)
        final = cache.entries[model, clip.id, "final"]
        turn_s = len(turn) / SAMPLE_RATE
        schedules = {name: POLICIES[name].pass_ends_s(turn_s) for name in policies}
        ends_s = sorted({end_s for ends in schedules.values() for end_s in ends})
        for label, min_s, pad_s in chosen:
            # Every policy's passes at once: a pass's text depends on the audio it heard alone.
            texts, encoder_s = cache.entries.get((model, clip.id, label), ({}, []))
            missing = [end_s for end_s in ends_s if end_s not in texts]
            if missing:
                new_texts, new_encoder_s = partial_texts(*runner_engine(), turn, min_s, pad_s, missing)
                texts, encoder_s = {**texts, **new_texts}, encoder_s + new_encoder_s
                cache.entries[model, clip.id, label] = texts, encoder_s
            for name in policies:
                passes = [(end_s, *texts[end_s]) for end_s in schedules[name]]
                tallies[label, name].add(clip.text, final, POLICIES[name], passes)
                tallies[label, name].encoder_s += encoder_s
        cache.save()
        print(f"{model} {clip.id}: done", flush=True)
    return [[model, label, name, *tally.row()] for (label, name), tally in tallies.items()]


HEADERS = [
    "model",
    "partial context",
    "policy",
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
    parser.add_argument(
        "--contexts",
        nargs="*",
        default=[label for label, _, _ in CONTEXTS],
        choices=[label for label, _, _ in CONTEXTS],
    )
    parser.add_argument("--policies", nargs="*", default=["today"], choices=[*POLICIES, "all"])
    parser.add_argument(
        "--passes-cache", help="a pickle of the passes decoded (reused, and extended by this run)"
    )
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    from benchmarks.recording import markdown_table, record

    if "all" in args.policies:
        args.policies = list(POLICIES)
    cache = PassCache(args.passes_cache)
    rows = []
    for model in args.models:
        rows += measure(model, args.clips, args.contexts, args.policies, cache)
        print(markdown_table(HEADERS, rows), flush=True)  # so far: a long run shows each model's
    table = markdown_table(HEADERS, rows)
    print(table)
    if args.record:
        title = "Partial passes on the audio they have: a shortened encoder context"
        if args.policies != ["today"]:
            title = "When partial text goes out: first pass, cadence and agreement policies"
        record(
            title,
            table,
            notes=(
                f"{args.clips} clips of the speech set as live turns; policy today: a partial pass every "
                "0.5 s of audio from 1.5 s, LocalAgreement (3 passes over 2 s); the other policies as "
                "bench_partial_context.py's POLICIES define them. Final passes on the full window. "
                "Encoder times on a shared CPU: compare within a row set."
                + (
                    " Passes (texts, word probabilities, encoder times) from --passes-cache where an "
                    "earlier run of this replay decoded them."
                    if args.passes_cache
                    else ""
                )
            ),
        )


if __name__ == "__main__":
    main()
