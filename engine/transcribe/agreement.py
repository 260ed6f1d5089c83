"""Partial text that never retracts: the LocalAgreement policy of whisper_streaming (Macháček et
al., 2023), on words.

A live turn is transcribed again and again as its audio grows. Words that consecutive passes agree
on (the longest common prefix of their hypotheses) are committed and sent; a committed word is never
taken back, so the deltas a client receives only ever extend its text. The final pass of
a window commits the rest of that window's text, aligned after what was committed before.

A turn longer than one 30 s window carries on in a new window: ``start_window`` marks where the new
window's words begin, and its hypotheses are read as extending everything committed so far.
"""

from __future__ import annotations

import difflib
import math

from engine.types import TokenLogprob


def _common_prefix_length(first: list[str], second: list[str]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


# How far (in words) a window's committed words may sit from the final words they stand for.
ALIGNMENT_BAND_WORDS = 10


class LocalAgreement:
    """``passes``: how many consecutive hypotheses must agree on a word (whisper_streaming's
    LocalAgreement-n). Three, not whisper_streaming's two: with tiny.en, two passes over the first
    second or two of a turn agree on wrong words often enough ("Very very" for "The river") that
    the text sent would differ from the file endpoint's (measured on the speech set, see
    tests/engine/transcribe/test_agreement.py); a third pass costs about one partial interval.

    ``span_s``: the agreeing passes must also reach back over this much audio: the newest pass and
    every pass back to one that heard ``span_s`` less. Passes come as often as the server keeps up,
    and a model hears a word wrongly for a second or more of audio cut just after it ("am I" for
    "my" in jfk from 2.6 to 3.9 s): counted in audio, not in passes, what is sent does not depend
    on how often passes run.

    Words are compared as written, case and punctuation included: a pass that changes a word's
    form is not yet sure of it ("Hiker" before "hikers").

    ``sure_passes`` (0: off), ``sure_prob``, ``sure_span_s``: a second, faster way to commit a word,
    confidence-gated agreement: ``sure_passes`` consecutive passes (over at least ``sure_span_s`` of
    audio) agree on it and each is at least ``sure_prob`` sure of it (``update``'s ``word_probs``).
    ``release_prob``: a word that ends an agreeing pass is committed too when every one of them is
    at least this sure of it. The live turn uses none of them: on the speech set, passes sure of a
    word they agree on still hear it otherwise than the final pass does often enough to send text
    that is not the final text (benchmarks/bench_partial_context.py's policies, RESULTS.md)."""

    def __init__(
        self,
        passes: int = 3,
        span_s: float = 0.0,
        sure_passes: int = 0,
        sure_prob: float = 1.0,
        sure_span_s: float = 0.0,
        release_prob: float | None = None,
    ):
        self.passes = passes
        self.span_s = span_s
        self.sure_passes = sure_passes
        self.sure_prob = sure_prob
        self.sure_span_s = sure_span_s
        self.release_prob = release_prob
        self.committed: list[str] = []  # the turn's committed words, every window's
        self._window_start = 0  # index in ``committed`` where the open window's words begin
        # The open window's recent hypotheses (committed words first), each with the seconds of
        # audio its pass heard: the newest and those back to the oldest that may still be needed.
        self._recent: list[tuple[float, list[str], list[float]]] = []

    @property
    def text(self) -> str:
        """Everything committed: the deltas sent so far, joined."""
        return " ".join(self.committed)

    def update(self, window_text: str, heard_s: float = 0.0, word_probs: list[float] | None = None) -> str:
        """Take a partial pass's text of the open window and the seconds of the turn's audio it
        heard (rising from pass to pass); returns the delta to send ("" if none). ``word_probs``:
        each of the text's words' probability (see ``word_probabilities``), for ``sure_passes``."""
        words = window_text.split()
        if word_probs is None or len(word_probs) != len(words):
            word_probs = [0.0] * len(words)  # unknown: no word of it is sure
        hypothesis = self.committed[: self._window_start] + words
        probs = [1.0] * self._window_start + list(word_probs)
        self._recent.append((heard_s, hypothesis, probs))
        if hypothesis[: len(self.committed)] != self.committed:
            return ""  # this pass heard the committed words differently: it confirms nothing after them
        # Each rule's oldest hypothesis it reads (None: not enough of them yet).
        firsts = [self._first_confirming(self.passes, self.span_s)]
        if self.sure_passes:
            firsts.append(self._first_confirming(self.sure_passes, self.sure_span_s))
        agreed = 0 if firsts[0] is None else self._agreed(firsts[0], None)
        if self.sure_passes and firsts[1] is not None:
            agreed = max(agreed, self._agreed(firsts[1], self.sure_prob))
        if None not in firsts:  # later passes heard more: what is older is never needed again
            del self._recent[: min(firsts)]
        return self._commit(hypothesis[len(self.committed) : max(agreed, len(self.committed))])

    def _agreed(self, first: int, sure_prob: float | None) -> int:
        """How many of the hypotheses' first words the recent ones from ``first`` on agree on; with
        ``sure_prob``, only up to the first word not committed yet that some pass is less sure of."""
        confirming = self._recent[first:]
        agreed = min(_common_prefix_length(confirming[0][1], words) for _, words, _ in confirming[1:])
        if sure_prob is not None:
            unsure = (
                index
                for index in range(len(self.committed), agreed)
                if any(probs[index] < sure_prob for _, _, probs in confirming)
            )
            agreed = next(unsure, agreed)
        # A word at the end of a pass may be cut off by the audio's end ("year." before "year,
        # and ..."): commit it only once a later word in every pass confirms it.
        if agreed and any(agreed == len(words) for _, words, _ in confirming):
            release = self.release_prob
            if release is None or any(probs[agreed - 1] < release for _, _, probs in confirming):
                agreed -= 1
        return agreed

    def _first_confirming(self, passes: int, span_s: float) -> int | None:
        """Where the hypotheses that must agree start: the newest ``passes``, and further back until
        one heard ``span_s`` less audio than the newest; None while there are not enough of them."""
        newest_s = self._recent[-1][0]
        first = len(self._recent) - passes
        while first >= 0 and newest_s - self._recent[first][0] < span_s:
            first -= 1
        return None if first < 0 else first

    def finish_window(self, window_text: str) -> str:
        """Take a window's final text: commit all of it, after the words of it already committed;
        returns the delta. The next hypotheses belong to a new window."""
        window_words = window_text.split()
        already = self.committed[self._window_start :]
        delta = self._commit(window_words[_aligned_end(already, window_words) :])
        self._window_start = len(self.committed)
        self._recent = []
        return delta

    def _commit(self, words: list[str]) -> str:
        if not words:
            return ""
        separator = " " if self.committed else ""
        self.committed.extend(words)
        return separator + " ".join(words)


def _aligned_end(committed: list[str], final: list[str]) -> int:
    """Where, in a window's final words, the words already committed from it end: after the prefix
    of the final words closest to them (words inserted, dropped or changed, a change costing less
    the more alike the two words are), the shortest of equally close ones.

    Usually the final text starts with them. When the final pass heard them differently, anchoring
    on a shared word instead would let one common word far ahead ("on" in "...the tires on my car")
    swallow every final word before it; the closest prefix keeps those words. Of two equally close
    prefixes the shorter repeats a word rather than dropping one."""
    shared = _common_prefix_length(committed, final)
    if shared == len(committed):
        return shared
    tail, rest = committed[shared:], final[shared:]
    # Word edit distance, one row per committed word after the shared ones: row i, column j is the
    # distance between tail[:i] and rest[:j]. The committed words were heard in the same audio as the
    # final's, so they stay within ALIGNMENT_BAND_WORDS of it: only that band is computed, which
    # bounds the work on the event loop for a window heard differently from its first word.
    matchers = [difflib.SequenceMatcher(b=_bare(word), autojunk=False) for word in rest]
    distances = [float(j) if j <= ALIGNMENT_BAND_WORDS else math.inf for j in range(len(rest) + 1)]
    for i, word in enumerate(tail, 1):
        previous, distances = distances, [float(i)] + [math.inf] * len(rest)
        bare = _bare(word)
        for j in range(max(1, i - ALIGNMENT_BAND_WORDS), min(len(rest), i + ALIGNMENT_BAND_WORDS) + 1):
            changed = previous[j - 1] + _change_cost(bare, matchers[j - 1])
            distances[j] = min(previous[j] + 1, distances[j - 1] + 1, changed)
    closest = min(distances)
    return shared + next(j for j, distance in enumerate(distances) if distance <= closest + 1e-9)


def _change_cost(bare: str, final_matcher: difflib.SequenceMatcher) -> float:
    """0 for the same word, up to 1 (less than dropping one and inserting the other) the less alike
    two words are, case and punctuation aside (``bare``, and the final word's matcher holds its bare
    form): another form of one word ("vegetables" for "vegetable") or a near-homophone ("am" for
    "my") costs less than another word."""
    if bare == final_matcher.b:
        return 0.0
    final_matcher.set_seq1(bare)
    return 1.0 - final_matcher.ratio()


def _bare(word: str) -> str:
    return "".join(character for character in word.lower() if character.isalnum())


def word_probabilities(tokens: list[TokenLogprob], text: str) -> list[float] | None:
    """Each of ``text``'s words' probability: its tokens' log-probabilities summed (a token that
    starts with a space starts a word); None where the tokens do not split into the text's words."""
    words: list[str] = []
    logprobs: list[float] = []
    for token in tokens:
        if token.token[:1].isspace() or not words:
            words.append("")
            logprobs.append(0.0)
        words[-1] += token.token
        logprobs[-1] += token.logprob
    if [word.strip() for word in words] != text.split():
        return None
    return [math.exp(logprob) for logprob in logprobs]
