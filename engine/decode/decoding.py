"""How we decode what the model computes: Whisper's prompt, its logit rules, and sampling.

The rules are openai-whisper's (decoding.py): suppress a fixed token list, suppress blank and
end-of-text at the first sampled position, and, with timestamps on, the timestamp pairing and
monotonicity rules, applied to a whole batch at once, on the device, with no read back to the host
(the decode loop runs a step ahead of the host's reading; see engine/decode/engine.py).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from engine.errors import RequestRejectedError
from engine.kernels import triton_available
from engine.decode.host_device import upload
from engine.kernels.timestamp_rules import triton_apply_timestamp_rules, triton_record_timestamps
from engine.types import DecodeOptions, FallbackOptions, TimedText
from engine.model.tokenizer import WhisperTokenizer
from engine.model.weights import ModelDims

# openai-whisper: the first timestamp may not be later than 1 s into the window.
MAX_INITIAL_TIMESTAMP_S = 1.0


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    sot_index: int
    max_tokens: int
    detect_language: bool


def build_prompt(tokenizer: WhisperTokenizer, dims: ModelDims, options: DecodeOptions) -> Prompt:
    special = tokenizer.special
    tokens: list[int] = []
    if options.prompt:
        # openai-whisper keeps at most half the context for previous text, most recent last.
        previous = tokenizer.encode(" " + options.prompt.strip()) if isinstance(options.prompt, str) else list(options.prompt)
        previous = previous[-(dims.n_text_ctx // 2 - 1) :]
        tokens = [special.sot_prev, *previous]
    sot_index = len(tokens)
    tokens.append(special.sot)
    detect = False
    if dims.is_multilingual:
        if options.language is None:
            detect = True
            tokens.append(tokenizer.language_tokens["en"])  # placeholder until detection
        elif options.language not in tokenizer.language_tokens:
            raise RequestRejectedError(f"language {options.language!r} is not one this model knows", param="language")
        else:
            tokens.append(tokenizer.language_tokens[options.language])
        tokens.append(special.translate if options.task == "translate" else special.transcribe)
    else:
        if options.language not in (None, "en"):
            raise RequestRejectedError(
                f"model is English-only; language {options.language!r} is not available", param="language"
            )
        if options.task == "translate":
            raise RequestRejectedError("model is English-only; it cannot translate", param="task")
    if options.word_timestamps and not options.timestamps:
        raise RequestRejectedError("word timestamps need segment timestamps (timestamps=True)", param="timestamp_granularities[]")
    if not options.timestamps:
        tokens.append(special.no_timestamps)
    room = dims.n_text_ctx - len(tokens)
    max_tokens = options.max_tokens if options.max_tokens is not None else dims.n_text_ctx // 2
    if max_tokens < 1:
        raise RequestRejectedError(f"max_tokens must be at least 1, got {max_tokens}")
    return Prompt(tokens=tokens, sot_index=sot_index, max_tokens=min(max_tokens, room), detect_language=detect)


class LogitRules:
    """Applies Whisper's suppression and timestamp rules to a batch of logits, in place.

    What the timestamp rules need of a row's history (was its last token a timestamp, the one
    before, which was its last timestamp) is kept on the device, by block-table slot, and
    updated by ``record`` from the sampled tokens there: the decode loop launches a step before
    the host has read the tokens of the step before it. The host says only which rows have no
    history yet (their first sampled token), which it knows without reading any token."""

    def __init__(
        self,
        tokenizer: WhisperTokenizer,
        vocab_size: int,
        suppress_tokens: list[int] | None,
        begin_suppress_tokens: list[int] | None,
        device: torch.device,
        num_slots: int = 1,
        use_triton: bool | None = None,
    ):
        special = tokenizer.special
        self.special = special
        if suppress_tokens is None:
            suppress_tokens = tokenizer.non_speech_tokens
        suppress = set(suppress_tokens)
        # openai-whisper also always suppresses the task and prompt tokens.
        for token in (special.translate, special.transcribe, special.sot, special.sot_prev, special.sot_lm, special.no_speech):
            if token is not None:
                suppress.add(token)
        self.suppress_token_ids = sorted(t for t in suppress if 0 <= t < vocab_size)
        self.suppress_ids = torch.tensor(self.suppress_token_ids, dtype=torch.long, device=device)
        begin = begin_suppress_tokens if begin_suppress_tokens is not None else [tokenizer.encode(" ")[0], special.eot]
        self.begin_suppress_token_ids = [t for t in begin if 0 <= t < vocab_size]
        self.begin_suppress = torch.tensor(self.begin_suppress_token_ids, dtype=torch.long, device=device)
        self.max_initial_timestamp = special.timestamp_begin + round(MAX_INITIAL_TIMESTAMP_S / 0.02)
        self.device = device
        # Per slot: [last token was a timestamp, the one before was (or there was none), last timestamp or -1].
        self._history = torch.zeros((3, num_slots), dtype=torch.long, device=device)
        self._stamp_offset_ids: torch.Tensor | None = None  # [1, timestamps], made on first use
        # On a GPU the timestamp rules run as two Triton kernels (engine/kernels/timestamp_rules.py);
        # None: there, and as PyTorch operations elsewhere (True runs them under Triton's interpreter).
        self.use_triton = use_triton if use_triton is not None else device.type == "cuda" and triton_available()

    def timestamp_rows(self, first: list[bool], timestamps: list[bool], slots: list[int]) -> torch.Tensor | None:
        """Per row of a batch: is this its first sampled token, does it want timestamps, its slot
        (whose history ``record`` keeps) -> [3, R] on the device for the R rows with timestamps on:
        their row, slot and first flag (None when no row has them); ``apply`` and ``record`` take it."""
        rows = [row for row, with_timestamps in enumerate(timestamps) if with_timestamps]
        if not rows:
            return None
        return upload([rows, [slots[row] for row in rows], [int(first[row]) for row in rows]], torch.long, self.device)

    def apply(self, logits: torch.Tensor, first: list[bool], stamp_rows: torch.Tensor | None) -> None:
        """logits [B, V] float32; ``first``: per row, is this its first sampled token;
        ``stamp_rows``: from ``timestamp_rows``."""
        # Index ops, not boolean masks: a mask index costs a device sync (nonzero) per call.
        logits.index_fill_(1, self.suppress_ids, -math.inf)
        first_rows = [row for row, is_first in enumerate(first) if is_first]
        if first_rows:
            rows = upload(first_rows, torch.long, self.device)
            logits[rows[:, None], self.begin_suppress[None, :]] = -math.inf
        if stamp_rows is not None:
            self._timestamp_rules(logits, stamp_rows)

    def record(self, tokens: torch.Tensor, stamp_rows: torch.Tensor | None) -> None:
        """After sampling ``tokens`` [B] (device) for the batch ``stamp_rows`` describes: the rows
        with timestamps on update their slot's history, on the device."""
        if stamp_rows is None:
            return
        if self.use_triton:
            triton_record_timestamps(tokens, stamp_rows, self._history, self.special.timestamp_begin)
            return
        row_index, slot_index, is_first = stamp_rows[0], stamp_rows[1], stamp_rows[2].bool()
        sampled = tokens if stamp_rows.shape[1] == tokens.shape[0] else tokens[row_index]
        last_was_stamp, _, last_stamp = self._history[:, slot_index]
        is_stamp = sampled >= self.special.timestamp_begin
        before_was_stamp = is_first | last_was_stamp.bool()  # a first token has none before it: counts as one
        kept_stamp = torch.where(is_first, -1, last_stamp)
        self._history[:, slot_index] = torch.stack([is_stamp.long(), before_was_stamp.long(),
                                                    torch.where(is_stamp, sampled, kept_stamp)])

    def _timestamp_rules(self, logits: torch.Tensor, stamp_rows: torch.Tensor) -> None:
        """The timestamp rules for the rows ``stamp_rows`` names, in place, for all rows at once.

        A row's history decides what it may not emit next: a prefix of the text tokens (none, all
        before end-of-text, or all), and in the timestamp range the ones below a floor and, for the
        first token, those past MAX_INITIAL_TIMESTAMP_S. Those bounds are worked out on the device
        from the slots' histories, so the rules cost the same few kernels at any batch size and
        never wait for the device. (Applied row by row, with a device read per row, they made a
        256-request large-v3 step on an H100 take 52 ms instead of 17.)"""
        begin, eot = self.special.timestamp_begin, self.special.eot
        n_stamps = logits.shape[-1] - begin
        device = logits.device
        if self.use_triton:
            triton_apply_timestamp_rules(logits, stamp_rows, self._history, begin, eot, self.special.no_timestamps,
                                         self.max_initial_timestamp + 1 - begin)
            return
        every_row = stamp_rows.shape[1] == logits.shape[0]
        row_index, slot_index, is_first = stamp_rows[0], stamp_rows[1], stamp_rows[2].bool()
        selected = logits if every_row else logits[row_index]
        last_was_stamp, before_was_stamp, last_stamp = self._history[:, slot_index]
        has_history = ~is_first
        last_was_stamp = last_was_stamp.bool() & has_history
        closed_pair = last_was_stamp & before_was_stamp.bool()  # next must be text (or the end)
        open_segment = last_was_stamp & ~before_was_stamp.bool()  # next must close it (or end)
        after_stamp = has_history & ~last_was_stamp & (last_stamp >= 0)  # timestamps never go back
        # Forbidden timestamps as offsets from ``begin``: [0, floor) and [limit, n_stamps).
        # A closing timestamp may repeat the opening one.
        floor = torch.where(closed_pair, n_stamps, torch.where(
            open_segment, last_stamp - begin, torch.where(after_stamp, last_stamp + 1 - begin, 0)))
        # The first token is a timestamp, no later than MAX_INITIAL_TIMESTAMP_S.
        limit = torch.where(is_first, self.max_initial_timestamp + 1 - begin, n_stamps)
        selected[:, self.special.no_timestamps] = -math.inf
        selected[:, :begin].masked_fill_(is_first[:, None], -math.inf)
        selected[:, :eot].masked_fill_(open_segment[:, None], -math.inf)
        offsets = self._stamp_offsets(n_stamps, device)
        selected[:, begin:].masked_fill_((offsets < floor[:, None]) | (offsets >= limit[:, None]), -math.inf)
        # When timestamps together are likelier than any single text token, emit one.
        logprobs = torch.log_softmax(selected, dim=-1)
        timestamp_wins = torch.logsumexp(logprobs[:, begin:], dim=-1) > logprobs[:, :begin].amax(dim=-1)
        selected[:, :begin].masked_fill_(timestamp_wins[:, None], -math.inf)
        if not every_row:
            logits[row_index] = selected

    def _stamp_offsets(self, n_stamps: int, device: torch.device) -> torch.Tensor:
        if self._stamp_offset_ids is None or self._stamp_offset_ids.shape[-1] != n_stamps:
            self._stamp_offset_ids = torch.arange(n_stamps, device=device)[None, :]
        return self._stamp_offset_ids


def sample(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature 0 take the argmax; others sample from softmax(logits / T).

    Returns the tokens [B] and their log-probabilities under the rule-filtered logits [B]."""
    tokens = logits.argmax(dim=-1)
    for row, (temperature, generator) in enumerate(zip(temperatures, generators)):
        if temperature > 0:
            probs = torch.softmax(logits[row] / temperature, dim=-1)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def detect_language(tokenizer: WhisperTokenizer, sot_logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``sot_logits`` [N, V], the most likely language token at <|startoftranscript|>,
    as openai-whisper's detect_language; on the device, so the host need not wait for it."""
    ids = upload(list(tokenizer.language_tokens.values()), torch.long, sot_logits.device)
    return ids[sot_logits[:, ids].argmax(dim=-1)]


def timed_segments(tokenizer: WhisperTokenizer, tokens: list[int], window_s: float) -> list[TimedText]:
    """Cut a window's sampled tokens at timestamp tokens, as openai-whisper's transcribe does.

    Text between a pair of timestamps is one segment (a pair is two timestamps in a row: the end
    of one segment and the start of the next). Text after the last timestamp has no end marker
    and runs to the end of the window's audio (``window_s``).
    """
    begin = tokenizer.special.timestamp_begin
    segments: list[TimedText] = []
    start_s: float | None = None
    last_end_s = 0.0
    text_tokens: list[int] = []
    for token in tokens:
        if token < begin:
            text_tokens.append(token)
        elif text_tokens:  # the timestamp closing a segment
            end_s = tokenizer.timestamp_seconds(token)
            segments.append(TimedText(start_s if start_s is not None else last_end_s, end_s,
                                      tokenizer.decode(text_tokens), text_tokens))
            start_s, last_end_s, text_tokens = None, end_s, []
        else:  # a segment's opening timestamp
            start_s = tokenizer.timestamp_seconds(token)
    if text_tokens:
        start = start_s if start_s is not None else last_end_s
        segments.append(TimedText(start, max(window_s, start), tokenizer.decode(text_tokens), text_tokens, closed=False))
    return [segment for segment in segments if segment.text.strip()]


def compression_ratio(text: str) -> float:
    """openai-whisper's repetition signal: raw bytes / zlib-compressed bytes."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def is_silence(fallback: FallbackOptions, avg_logprob: float, no_speech_prob: float) -> bool:
    """openai-whisper's rule: <|nospeech|> is likely and the text unsure, so the window holds no speech."""
    if fallback.no_speech_threshold is None or no_speech_prob <= fallback.no_speech_threshold:
        return False
    return fallback.logprob_threshold is None or avg_logprob <= fallback.logprob_threshold


def needs_fallback(fallback: FallbackOptions, text: str, avg_logprob: float, no_speech_prob: float) -> bool:
    """Whether a decoded window fails the thresholds and should be decoded again, hotter."""
    if is_silence(fallback, avg_logprob, no_speech_prob) and fallback.logprob_threshold is not None:
        return False  # silence is not retried (openai-whisper: low log-probability is expected there)
    too_repetitive = fallback.compression_ratio_threshold is not None and compression_ratio(text) > fallback.compression_ratio_threshold
    too_unsure = fallback.logprob_threshold is not None and avg_logprob < fallback.logprob_threshold
    return too_repetitive or too_unsure
