"""openai-whisper's temperature fallback: a window whose text fails the thresholds is decoded
again at the next temperature; a window judged silent gives no text.

A restart keeps the request's blocks: the cross-attention K/V is unchanged (no re-encode) and so
is the prompt's self-attention K/V, so only the last prompt token is fed again for its logits.
"""

from __future__ import annotations

import zlib

import torch

from engine.decode.request import Request
from engine.model.tokenizer import WhisperTokenizer
from engine.types import FallbackOptions


def avg_logprob(request: Request) -> float:
    # openai-whisper divides by (sampled tokens + 1): the end-of-text token counts too.
    return request.sum_logprob / (len(request.output_tokens) + 1)


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
    too_repetitive = (
        fallback.compression_ratio_threshold is not None
        and compression_ratio(text) > fallback.compression_ratio_threshold
    )
    too_unsure = fallback.logprob_threshold is not None and avg_logprob < fallback.logprob_threshold
    return too_repetitive or too_unsure


def restart_hotter(request: Request, tokenizer: WhisperTokenizer, undo_draw: torch.Tensor | None) -> bool:
    """If the window's text fails the thresholds and a hotter temperature is left, start its text
    again at that temperature and return True.

    ``undo_draw``: the request's generator state before the draw of a step launched after the one
    that ended it (async steps), restored so the next attempt samples what it would have without."""
    fallback = request.options.fallback
    temperatures = request.options.temperatures()
    if fallback is None or request.attempt + 1 >= len(temperatures):
        return False
    text = tokenizer.decode(request.output_tokens)
    if not needs_fallback(fallback, text, avg_logprob(request), request.no_speech_prob or 0.0):
        return False
    request.start_again(temperatures[request.attempt + 1], undo_draw)
    return True
