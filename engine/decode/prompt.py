"""Whisper's decoder prompt for a window, the request built around it, and how much of the prompt a
step feeds.

<|startofprev|> keywords and previous text, <|startoftranscript|>, the language (a placeholder
while it is to be detected), the task, and <|notimestamps|> when timestamps are off; as
openai-whisper builds it, with faster-whisper's hotwords as the keywords.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decode.request import Request
from engine.errors import RequestRejectedError, quoted
from engine.kv.sources import CrossKVSource
from engine.model.tokenizer import WhisperTokenizer
from engine.model.weights import ModelDims
from engine.types import DecodeOptions, Priority


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    sot_index: int
    max_tokens: int
    detect_language: bool
    language: str | None  # decoded in; None while it is to be detected


def build_prompt(tokenizer: WhisperTokenizer, dims: ModelDims, options: DecodeOptions) -> Prompt:
    special = tokenizer.special
    tokens: list[int] = []
    # openai-whisper keeps at most half the context for the text before <|startoftranscript|>.
    budget = dims.n_text_ctx // 2 - 1
    keywords = _keyword_tokens(tokenizer, options.keywords, budget)
    previous: list[int] = []
    if options.prompt:
        previous = (
            tokenizer.encode(" " + options.prompt.strip())
            if isinstance(options.prompt, str)
            else list(options.prompt)
        )
    # The keywords stay whole; the previous text gets what is left, its most recent tokens.
    room = budget - len(keywords)
    previous = previous[-room:] if room > 0 else []
    if keywords or previous:
        tokens = [special.sot_prev, *keywords, *previous]
    sot_index = len(tokens)
    tokens.append(special.sot)
    language = _language_to_decode_in(tokenizer, dims, options)
    detect = False
    if dims.is_multilingual:
        detect = language is None
        tokens.append(tokenizer.language_tokens[language or "en"])  # "en": a placeholder until detected
        tokens.append(special.translate if options.task == "translate" else special.transcribe)
    elif options.task == "translate":
        raise RequestRejectedError("model is English-only; it cannot translate", param="task")
    if options.word_timestamps and not options.timestamps:
        raise RequestRejectedError(
            "word timestamps need segment timestamps (timestamps=True)", param="timestamp_granularities[]"
        )
    _check_beam_options(options)
    if not options.timestamps:
        tokens.append(special.no_timestamps)
    room = dims.n_text_ctx - len(tokens)
    max_tokens = options.max_tokens if options.max_tokens is not None else dims.n_text_ctx // 2
    if max_tokens < 1:
        raise RequestRejectedError(f"max_tokens must be at least 1, got {max_tokens}")
    return Prompt(
        tokens=tokens,
        sot_index=sot_index,
        max_tokens=min(max_tokens, room),
        detect_language=detect,
        language=language,
    )


def _keyword_tokens(tokenizer: WhisperTokenizer, keywords: tuple[str, ...] | None, budget: int) -> list[int]:
    """The keywords as prompt text, as faster-whisper's hotwords: after <|startofprev|>, before any
    previous text. Joined with commas, as a list of names reads in the text Whisper learned from:
    each keyword kept apart from the next, its words together and its spelling untouched."""
    if not keywords:
        return []
    if any(not keyword.strip() for keyword in keywords):
        raise RequestRejectedError("keywords must not be empty", param="keywords")
    tokens = tokenizer.encode(" " + ", ".join(keyword.strip() for keyword in keywords))
    if len(tokens) > budget:
        raise RequestRejectedError(
            f"keywords take {len(tokens)} tokens, more than the {budget} the prompt holds; "
            "send fewer or shorter keywords",
            param="keywords",
        )
    return tokens


def _language_to_decode_in(
    tokenizer: WhisperTokenizer, dims: ModelDims, options: DecodeOptions
) -> str | None:
    """``language``, or the only one of ``languages``; None: detect it (among ``languages``, if
    given). English-only models decode in English, so their ``languages`` must include it."""
    known = tokenizer.language_tokens
    languages = options.languages
    if languages is not None:
        if not languages:
            raise RequestRejectedError("languages must name at least one language", param="languages")
        unknown = [code for code in languages if code not in known]
        if unknown:
            raise RequestRejectedError(
                f"languages must be language codes this model knows; not {quoted(', '.join(unknown))}",
                param="languages",
            )
        if not dims.is_multilingual and "en" not in languages:
            raise RequestRejectedError(
                "model is English-only; languages must include 'en'", param="languages"
            )
        if options.language is not None and options.language not in languages:
            raise RequestRejectedError(
                f"language {quoted(options.language)} is not among languages "
                f"({quoted(', '.join(languages))}); "
                "send one of them, or languages alone",
                param="language",
            )
    if not dims.is_multilingual:
        if options.language not in (None, "en"):
            raise RequestRejectedError(
                f"model is English-only; language {quoted(options.language)} is not available",
                param="language",
            )
        return "en"
    if options.language is not None and options.language not in known:
        raise RequestRejectedError(
            f"language {quoted(options.language)} is not one this model knows", param="language"
        )
    if options.language is None and languages is not None and len(languages) == 1:
        return languages[0]
    return options.language


def _check_beam_options(options: DecodeOptions) -> None:
    """openai-whisper's rules for the options of beam search and best-of sampling."""
    if options.beam_size < 1:
        raise RequestRejectedError(
            f"beam_size must be at least 1, got {options.beam_size}", param="beam_size"
        )
    if options.patience is not None and (options.beam_size == 1 or options.patience <= 0):
        raise RequestRejectedError("patience needs beam_size > 1 and must be above 0", param="patience")
    if options.length_penalty is not None and not 0 <= options.length_penalty <= 1:
        raise RequestRejectedError(
            f"length_penalty must be between 0 and 1, got {options.length_penalty}", param="length_penalty"
        )


def next_prompt_tokens(request: Request, stepped_prompt_tokens: int) -> list[int]:
    """The prompt tokens to feed at the request's next step: one, while the rest of the prompt is
    short enough to feed a token a step (``stepped_prompt_tokens``), else all of it."""
    return _prompt_tokens_to_feed(
        request.prompt_tokens,
        request.sot_index,
        request.detect_language,
        request.num_computed_tokens,
        stepped_prompt_tokens,
    )


def _prompt_tokens_to_feed(
    tokens: list[int], sot_index: int, detect_language: bool, computed: int, stepped_prompt_tokens: int
) -> list[int]:
    # With detection pending, feed only up to <|startoftranscript|>; the language comes next.
    end = sot_index + 1 if detect_language else len(tokens)
    rest = tokens[computed:end]
    return rest[:1] if len(rest) <= stepped_prompt_tokens else rest


# A greedy decode's fallback samples from this seed unless given one, so its transcript is the
# same on every run and replica, offline and over HTTP; a temperature asked for stays random.
FALLBACK_SEED = 0


def build_request(
    tokenizer: WhisperTokenizer,
    dims: ModelDims,
    device: torch.device,
    options: DecodeOptions,
    cross_source: CrossKVSource | None,
    request_id: str,
    audio_duration_s: float | None,
    stepped_prompt_tokens: int,
    priority: Priority = Priority.INTERACTIVE,
) -> Request:
    """Validate ``options`` for this model and build the request that decodes a window with them;
    raises RequestRejectedError for options the model cannot honour."""
    prompt = build_prompt(tokenizer, dims, options)
    seed = options.seed if options.seed is not None or options.temperature > 0 else FALLBACK_SEED
    generator = None
    if seed is not None and max(options.temperatures()) > 0:
        generator = torch.Generator(device=device).manual_seed(seed)
    return Request(
        request_id=request_id,
        prompt_tokens=prompt.tokens,
        sot_index=prompt.sot_index,
        max_tokens=prompt.max_tokens,
        options=options,
        cross_source=cross_source,
        detect_language=prompt.detect_language,
        priority=priority,
        pending_tokens=_prompt_tokens_to_feed(
            prompt.tokens, prompt.sot_index, prompt.detect_language, 0, stepped_prompt_tokens
        ),
        language=prompt.language,
        generator=generator,
        temperature=options.temperature,
        audio_duration_s=audio_duration_s,
    )
