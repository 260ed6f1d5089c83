"""Word timestamps: when each word of a decoded window is spoken, from the cross-attention of the
alignment heads and dynamic time warping, as openai-whisper's timing.py does.

The paged attention backends return attention outputs, not weights, so alignment is a pass of its
own: after a window is decoded and before its blocks are freed, its text is read once more by the
same decoder layers (prompt <|startoftranscript|> [language task] <|notimestamps|> text
<|endoftext|>, as openai-whisper reads it) with a backend that also keeps the alignment heads'
cross-attention scores. The cross-attention K/V is the window's own, still in its blocks; the
request's self-attention blocks, finished with, take that pass's self-attention K/V.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np
import torch

from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.attention.torch_ref import TorchReferenceBackend
from engine.decode.request import Request
from engine.model.tokenizer import TIMESTAMP_RESOLUTION_S, WhisperTokenizer
from engine.model.weights import LoadedWeights
from engine.model.whisper import DecoderStepMetadata
from engine.types import TimedText, TimedWord

# openai-whisper's choices: the width of the median filter over audio frames, and the punctuation
# that joins the word after it (prepended) or before it (appended).
MEDIAN_FILTER_WIDTH = 7
# The median of 7 values by elementwise min/max pairs: Batcher's odd-even merge sort of 8 inputs
# (the eighth +inf), pruned to the pairs that decide its middle output. Applied to 7 shifted copies
# of the scores it filters every frame at once; a sort of every 7-frame window cost a CPU far more.
_MEDIAN_OF_7 = (
    (0, 1), (2, 3), (0, 2), (1, 3), (1, 2), (4, 5), (4, 6),
    (5, 6), (0, 4), (2, 6), (2, 4), (1, 5), (3, 5), (3, 4),
)  # fmt: skip
PREPENDED_PUNCTUATION = "\"'“¿([{-"
APPENDED_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
# Languages written without spaces between words: every character (unicode unit) is a word.
LANGUAGES_WITHOUT_SPACES = {"zh", "ja", "th", "lo", "my", "yue"}


def alignment_heads_of(weights: LoadedWeights) -> list[tuple[int, int]]:
    """(layer, head) pairs whose cross-attention follows the speech: the model's own table when it
    ships one, else openai-whisper's fallback of every head in the last half of the layers."""
    if weights.alignment_heads:
        return [tuple(head) for head in weights.alignment_heads]
    dims = weights.dims
    return [
        (layer, head)
        for layer in range(dims.decoder_layers // 2, dims.decoder_layers)
        for head in range(dims.decoder_heads)
    ]


class _AllScoresKept(Exception):
    """The recorder has kept the scores of every alignment head: nothing later in the forward (the
    layers after the last head's, that layer's attention output and MLP) could change them."""


class CrossAttentionRecorder(AttentionBackend):
    """For one request: self-attention through the reference backend; cross-attention computed
    densely, keeping the scaled scores (before softmax) of the alignment heads of each layer, up to
    the last layer that holds one, where it ends the forward (raising _AllScoresKept)."""

    name = "alignment-recorder"

    def __init__(self, heads: list[tuple[int, int]]):
        self.reference = TorchReferenceBackend()
        self.heads = heads
        self.last_layer = max(layer for layer, _ in heads)
        self.layer = 0  # the decoder calls cross-attention once per layer, in layer order
        self.scores: dict[tuple[int, int], torch.Tensor] = {}  # (layer, head) -> [tokens, frames]

    def paged_attention(
        self, query, key_cache, value_cache, batch: PagedAttentionBatch, scale: float
    ) -> torch.Tensor:
        if batch.causal:
            return self.reference.paged_attention(query, key_cache, value_cache, batch, scale)
        block_size = key_cache.shape[1]
        table = batch.block_tables[0, : -(-batch.max_seq_len // block_size)].long()
        frames = batch.max_seq_len
        keys = (
            self.reference.gather_blocks(key_cache, table, "keys").flatten(0, 1)[:frames].float()
        )  # [frames, H, D]
        scores = torch.einsum("thd,fhd->htf", query.float(), keys) * scale
        for layer, head in self.heads:
            if layer == self.layer:
                self.scores[(layer, head)] = scores[head]
        if self.layer == self.last_layer:
            raise _AllScoresKept
        self.layer += 1
        values = self.reference.gather_blocks(value_cache, table, "values").flatten(0, 1)[:frames].float()
        return torch.einsum("htf,fhd->thd", scores.softmax(dim=-1), values).to(query.dtype)


def align_words(
    model,
    storage,
    tokenizer: WhisperTokenizer,
    heads: list[tuple[int, int]],
    request: Request,
    segments: list[TimedText],
) -> list[TimedText]:
    """The window's segments with their words timed (seconds from the window's start), each word
    kept inside its segment. ``request`` must still hold its blocks."""
    text_tokens = [token for segment in segments for token in segment.tokens]
    if not text_tokens:
        return segments
    special = tokenizer.special
    sot_sequence = request.prompt_tokens[request.sot_index :]  # <|sot|> [language, task]: timestamps are on
    tokens = [*sot_sequence, special.no_timestamps, *text_tokens, special.eot]
    recorder = CrossAttentionRecorder(heads)
    _read_once(model, storage, recorder, request, tokens)

    frames = request.blocks.cross_len
    seconds_per_frame = TIMESTAMP_RESOLUTION_S  # an encoder position is 20 ms of audio, as a timestamp step
    if request.audio_duration_s is not None:
        frames = max(1, min(frames, round(request.audio_duration_s / seconds_per_frame)))
    weights = torch.stack([recorder.scores[head] for head in heads])[:, :, :frames].softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = _median_filter(((weights - mean) / std).float().cpu().numpy())
    # Rows: the position predicting each text token, then the one predicting <|endoftext|>.
    matrix = weights.mean(axis=0)[len(sot_sequence) : -1].astype(np.float64)
    token_rows, frame_columns = _dtw_path(-matrix)
    first_of_row = np.diff(token_rows, prepend=-1) > 0
    token_start_s = frame_columns[first_of_row] * seconds_per_frame  # [text tokens + 1]

    timed: list[TimedText] = []
    offset = 0
    for segment in segments:
        words = []
        for word, count in _merge_punctuation(_split_words(tokenizer, segment.tokens, request.language)):
            start_s = min(max(float(token_start_s[offset]), segment.start_s), segment.end_s)
            end_s = min(max(float(token_start_s[offset + count]), start_s), segment.end_s)
            words.append(
                TimedWord(word, round(start_s, 3), round(end_s, 3), text_tokens[offset : offset + count])
            )
            offset += count
        timed.append(dataclasses.replace(segment, words=words))
    return timed


def _read_once(model, storage, recorder: CrossAttentionRecorder, request: Request, tokens: list[int]) -> None:
    """One decoder forward over ``tokens`` for this request alone, through ``recorder``."""
    device = storage.cache.device
    block_size = storage.block_size
    count = len(tokens)
    if count > len(request.blocks.self_block_ids) * block_size:
        raise RuntimeError(
            f"alignment needs {count} self-attention slots; request {request.request_id} reserved fewer"
        )
    positions = torch.arange(count, device=device)
    self_table = torch.tensor([request.blocks.self_block_ids], dtype=torch.int32, device=device)
    cross_table = torch.tensor([request.blocks.cross_block_ids], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, count], dtype=torch.int32, device=device)
    cross_len = request.blocks.cross_len
    meta = DecoderStepMetadata(
        positions=positions,
        slot_block_ids=self_table[0].long()[positions // block_size],
        slot_offsets=positions % block_size,
        self_attention=PagedAttentionBatch(
            query_start_loc,
            torch.tensor([count], dtype=torch.int32, device=device),
            self_table,
            causal=True,
            max_query_len=count,
            max_seq_len=count,
        ),
        cross_attention=PagedAttentionBatch(
            query_start_loc,
            torch.tensor([cross_len], dtype=torch.int32, device=device),
            cross_table,
            causal=False,
            max_query_len=count,
            max_seq_len=cross_len,
        ),
    )
    try:
        with torch.inference_mode():
            model.decoder(torch.tensor(tokens, device=device), meta, storage, recorder)
    except _AllScoresKept:
        pass  # the forward's only use here is the scores, all kept


def _median_filter(x: np.ndarray) -> np.ndarray:
    """Median over a sliding window of MEDIAN_FILTER_WIDTH frames along the last axis, edges
    reflected."""
    half = MEDIAN_FILTER_WIDTH // 2
    if x.shape[-1] <= half:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], mode="reflect")
    frames = x.shape[-1]
    shifted = [padded[..., k : k + frames] for k in range(MEDIAN_FILTER_WIDTH)]
    for low, high in _MEDIAN_OF_7:
        shifted[low], shifted[high] = (
            np.minimum(shifted[low], shifted[high]),
            np.maximum(shifted[low], shifted[high]),
        )
    return shifted[half]


def _dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through ``cost`` [tokens, frames] from its first cell to its
    last, stepping to the next frame, the next token, or both: (token rows, frame columns). Among
    equal choices the first of (both, token, frame) wins; a NaN total wins over any number.

    Cells on one anti-diagonal depend only on earlier ones, so each diagonal is one numpy step. The
    running totals are kept skewed, one row per anti-diagonal (``total[d, i]`` is the cell of token
    row ``i`` and frame column ``d - i``, both counted from 1 after a border row and column), so that
    a diagonal and the two before it are slices, not gathers."""
    rows, columns = cost.shape
    diagonals = rows + columns + 1
    total = np.full((diagonals, rows + 1), np.inf)
    total[0, 0] = 0.0
    step = np.zeros((diagonals, rows + 1), dtype=np.int8)  # 0: both, 1: next token, 2: next frame
    mirrored = cost[:, ::-1]  # its diagonals are the anti-diagonals of ``cost``, as views
    # Comparisons are false for NaN: a cost holding NaN takes argmin's choice, the first NaN.
    with_nan = bool(np.isnan(cost).any())
    for diagonal in range(2, diagonals):
        low, high = max(1, diagonal - columns), min(rows, diagonal - 1)  # token rows i on it
        both = total[diagonal - 2, low - 1 : high]
        token = total[diagonal - 1, low - 1 : high]
        frame = total[diagonal - 1, low : high + 1]
        lower = np.minimum(both, token)
        if with_nan:
            step[diagonal, low : high + 1] = np.stack([both, token, frame]).argmin(axis=0)
        else:
            best = step[diagonal, low : high + 1]
            np.less(token, both, out=best, casting="unsafe")
            best[frame < lower] = 2
        # cost[i - 1, diagonal - i - 1] for i from low to high
        np.add(
            mirrored.diagonal(columns + 1 - diagonal),
            np.minimum(lower, frame),
            out=total[diagonal, low : high + 1],
        )
    path = []
    i, j = rows, columns
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        move = step[i + j, i]
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    path.reverse()
    array = np.array(path)
    return array[:, 0], array[:, 1]


def _split_words(
    tokenizer: WhisperTokenizer, tokens: list[int], language: str | None
) -> list[tuple[str, int]]:
    """(word, token count) in order. Tokens are grouped into whole characters first (one
    character may take several tokens); a word starts at a space or punctuation mark, or at every
    character in languages written without spaces."""
    units: list[tuple[str, int]] = []
    pending: list[int] = []
    for token in tokens:
        pending.append(token)
        text = tokenizer.decode(pending)
        if "\ufffd" not in text:
            units.append((text, len(pending)))
            pending = []
    if pending:
        units.append((tokenizer.decode(pending), len(pending)))
    if language in LANGUAGES_WITHOUT_SPACES:
        return units
    words: list[tuple[str, int]] = []
    for text, count in units:
        starts_word = text.startswith(" ") or text.strip() in string.punctuation
        if words and not starts_word:
            words[-1] = (words[-1][0] + text, words[-1][1] + count)
        else:
            words.append((text, count))
    return words


def _merge_punctuation(words: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Opening marks join the word after them, closing marks the word before, as openai-whisper
    does, so no word is a lone quote or comma."""
    merged: list[tuple[str, int]] = []
    carry = ("", 0)
    for word, count in words:
        word, count = carry[0] + word, carry[1] + count
        carry = ("", 0)
        bare = word.strip()
        if bare and all(ch in PREPENDED_PUNCTUATION for ch in bare) and word.startswith(" "):
            carry = (word, count)
        elif merged and bare and all(ch in APPENDED_PUNCTUATION for ch in bare) and not word.startswith(" "):
            merged[-1] = (merged[-1][0] + word, merged[-1][1] + count)
        else:
            merged.append((word, count))
    if carry[1]:
        merged.append(carry)
    return merged
