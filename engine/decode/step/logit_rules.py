"""Whisper's logit rules, as openai-whisper's decoding.py applies them: suppress a fixed token list,
suppress blank and end-of-text at the first sampled position, and, with timestamps on, the
timestamp pairing and monotonicity rules; applied to a whole batch at once, on the device, with no
read back to the host (the decode loop runs a step ahead of the host's reading).
"""

from __future__ import annotations

import math

import torch

from engine.device import upload
from engine.kernels import triton_available
from engine.kernels.timestamp_rules import triton_apply_timestamp_rules, triton_record_timestamps
from engine.model.tokenizer import WhisperTokenizer

# openai-whisper: the first timestamp may not be later than 1 s into the window.
MAX_INITIAL_TIMESTAMP_S = 1.0


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
        for token in (
            special.translate,
            special.transcribe,
            special.sot,
            special.sot_prev,
            special.sot_lm,
            special.no_speech,
        ):
            if token is not None:
                suppress.add(token)
        self.suppress_token_ids = sorted(t for t in suppress if 0 <= t < vocab_size)
        self.suppress_ids = torch.tensor(self.suppress_token_ids, dtype=torch.long, device=device)
        begin = (
            begin_suppress_tokens
            if begin_suppress_tokens is not None
            else [tokenizer.encode(" ")[0], special.eot]
        )
        self.begin_suppress_token_ids = [t for t in begin if 0 <= t < vocab_size]
        self.max_initial_timestamp = special.timestamp_begin + round(MAX_INITIAL_TIMESTAMP_S / 0.02)
        self.device = device
        # Per slot: [last token was a timestamp, the one before was (or there was none), last timestamp
        # or -1].
        self._history = torch.zeros((3, num_slots), dtype=torch.long, device=device)
        self._stamp_offset_ids: torch.Tensor | None = None  # [1, timestamps], made on first use
        # On a GPU the timestamp rules run as two Triton kernels (engine/kernels/timestamp_rules.py);
        # None: there, and as PyTorch operations elsewhere (True runs them under Triton's interpreter).
        self.use_triton = (
            use_triton if use_triton is not None else device.type == "cuda" and triton_available()
        )

    @property
    def history(self) -> torch.Tensor:
        """[3, slots] on the device: each slot's timestamp history (for kernels that move it)."""
        return self._history

    def timestamp_rows(
        self, first: list[bool], timestamps: list[bool], slots: list[int]
    ) -> torch.Tensor | None:
        """Per row of a batch: is this its first sampled token, does it want timestamps, its slot
        (whose history ``record`` keeps) -> [3, R] on the device for the R rows with timestamps on:
        their row, slot and first flag (None when no row has them); ``apply`` and ``record`` take it."""
        if not any(timestamps):
            return None
        rows = [row for row, with_timestamps in enumerate(timestamps) if with_timestamps]
        return upload(
            [rows, [slots[row] for row in rows], [int(first[row]) for row in rows]], torch.long, self.device
        )

    def apply(self, logits: torch.Tensor, first: list[bool], stamp_rows: torch.Tensor | None) -> None:
        """logits [B, V] float32, contiguous; ``first``: per row, is this its first sampled token;
        ``stamp_rows``: from ``timestamp_rows``."""
        # Index ops, not boolean masks: a mask index costs a device sync (nonzero) per call.
        logits.index_fill_(1, self.suppress_ids, -math.inf)
        if any(first):
            # index_fill_ at flat positions, as above: an assignment through an index pair
            # (logits[rows, ids] = value) waits for the device on a GPU, and with it for the step.
            vocab = logits.shape[1]
            positions = [
                row * vocab + token
                for row, is_first in enumerate(first)
                if is_first
                for token in self.begin_suppress_token_ids
            ]
            logits.view(-1).index_fill_(0, upload(positions, torch.long, self.device), -math.inf)
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
        self._history[:, slot_index] = self._history_after(self._history[:, slot_index], sampled, is_first)

    def continue_histories(
        self, slots: torch.Tensor, parent_slots: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Beam hypotheses chosen on the device: each slot of ``slots`` [N] takes the history of
        ``parent_slots``'s text followed by ``tokens`` (parents read before any slot is written)."""
        parents = self._history[:, parent_slots]
        self._history[:, slots] = self._history_after(
            parents, tokens, torch.zeros_like(tokens, dtype=torch.bool)
        )

    def _history_after(
        self, history: torch.Tensor, tokens: torch.Tensor, is_first: torch.Tensor
    ) -> torch.Tensor:
        """[3, N] histories once ``tokens`` [N] follow the texts ``history`` describes."""
        last_was_stamp, _, last_stamp = history
        is_stamp = tokens >= self.special.timestamp_begin
        before_was_stamp = is_first | last_was_stamp.bool()  # a first token has none before it: counts as one
        kept_stamp = torch.where(is_first, -1, last_stamp)
        return torch.stack(
            [is_stamp.long(), before_was_stamp.long(), torch.where(is_stamp, tokens, kept_stamp)]
        )

    def restore_histories(self, slots: list[int], texts: list[list[int]]) -> None:
        """Set each slot's history to what ``record`` would have left after sampling the tokens of
        its text: a beam hypothesis that continues another's text takes that text's history."""
        begin = self.special.timestamp_begin
        histories = []
        for tokens in texts:
            # From the end: a step restores every hypothesis's history, and a text only grows.
            last_stamp = next((token for token in reversed(tokens) if token >= begin), -1)
            histories.append(
                [int(tokens[-1] >= begin), int(len(tokens) < 2 or tokens[-2] >= begin), last_stamp]
            )
        values = upload(histories, torch.long, self.device).T
        self._history[:, upload(slots, torch.long, self.device)] = values

    def _timestamp_rules(self, logits: torch.Tensor, stamp_rows: torch.Tensor) -> None:
        """The timestamp rules for the rows ``stamp_rows`` names, in place, for all rows at once.

        A row's history decides what it may not emit next: a prefix of the text tokens (none, all
        before end-of-text, or all), and in the timestamp range the ones below a floor and, for the
        first token, those past MAX_INITIAL_TIMESTAMP_S. Those bounds are worked out on the device
        from the slots' histories, so the rules cost the same few kernels at any batch size and
        never wait for the device. (Applied row by row, a device read per row stalls the step on
        every row, which at large batches costs more than the step's forward.)"""
        begin, eot = self.special.timestamp_begin, self.special.eot
        n_stamps = logits.shape[-1] - begin
        device = logits.device
        if self.use_triton:
            triton_apply_timestamp_rules(
                logits,
                stamp_rows,
                self._history,
                begin,
                eot,
                self.special.no_timestamps,
                self.max_initial_timestamp + 1 - begin,
            )
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
        floor = torch.where(
            closed_pair,
            n_stamps,
            torch.where(
                open_segment, last_stamp - begin, torch.where(after_stamp, last_stamp + 1 - begin, 0)
            ),
        )
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
