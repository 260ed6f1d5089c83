"""What the logits at <|startoftranscript|> say: the probability of no speech, and, for a
multilingual model asked to detect it, the window's language; computed on the device."""

from __future__ import annotations

import torch

from engine.device import upload
from engine.model.tokenizer import WhisperTokenizer


def detect_language(
    tokenizer: WhisperTokenizer, sot_logits: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row of ``sot_logits`` [N, V], the most likely language token at <|startoftranscript|>,
    as openai-whisper's detect_language; on the device, so the host need not wait for it.
    ``allowed`` [N, languages] bool, in ``tokenizer.language_tokens``' order: per row, the languages
    it may be detected as (a request's ``languages``); None: any."""
    ids = upload(list(tokenizer.language_tokens.values()), torch.long, sot_logits.device)
    scores = sot_logits[:, ids]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return ids[scores.argmax(dim=-1)]


def no_speech_probability(tokenizer: WhisperTokenizer, sot_logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``sot_logits`` [N, V], the probability of <|nospeech|>, as openai-whisper reads it."""
    return torch.softmax(sot_logits, dim=-1)[:, tokenizer.special.no_speech]
