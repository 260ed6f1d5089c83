"""A finished window's DecodeResult: its text, the judgement of silence, timestamp segments and,
when asked for, word timings (read from its cross-attention K/V while it still holds its blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.decode.alignment import align_words
from engine.decode.fallback import avg_logprob, compression_ratio, is_silence
from engine.decode.request import Request
from engine.kv.storage import PagedKVStorage
from engine.model.audio import CHUNK_LENGTH_S
from engine.model.tokenizer import WhisperTokenizer
from engine.model.whisper import Whisper
from engine.types import DecodeResult, FinishReason, TimedText, TokenLogprob


@dataclass
class ResultBuilder:
    tokenizer: WhisperTokenizer
    model: Whisper
    storage: PagedKVStorage
    alignment_heads: list[tuple[int, int]]

    def build(self, request: Request, reason: FinishReason | None = None) -> DecodeResult:
        """The request's result; for a decoded one (``reason`` given), called while it still holds
        its blocks, since word alignment reads its cross-attention K/V."""
        options = request.options
        tokens = list(request.output_tokens)
        text = self.tokenizer.decode(tokens)
        mean_logprob = avg_logprob(request)
        no_speech_prob = request.no_speech_prob if request.no_speech_prob is not None else float("nan")
        silent = (
            options.fallback is not None
            and reason is not None
            and is_silence(options.fallback, mean_logprob, no_speech_prob)
        )
        if silent:
            tokens, text = [], ""  # openai-whisper skips a window it judges silent
        # The tail segment runs to the window's end; the transcript clamps it to the audio's.
        segments = timed_segments(self.tokenizer, tokens, CHUNK_LENGTH_S) if options.timestamps else None
        if options.word_timestamps and reason is not None:
            segments = align_words(
                self.model, self.storage, self.tokenizer, self.alignment_heads, request, segments
            )
        token_logprobs = None
        if options.token_logprobs:
            eot = self.tokenizer.special.eot  # timestamps and special tokens are not text
            token_logprobs = [
                TokenLogprob(self.tokenizer.decode([token]), float(logprob))
                for token, logprob in zip(tokens, request.output_logprobs)
                if token < eot
            ]
        return DecodeResult(
            request_id=request.request_id,
            tokens=tokens,
            text=text,
            avg_logprob=mean_logprob,
            no_speech_prob=no_speech_prob,
            language=request.language,
            temperature=request.temperature,
            finish_reason=reason or request.finish_reason,
            error=request.error,
            retriable=request.error_retriable,
            segments=segments,
            compression_ratio=compression_ratio(text),
            no_speech=silent,
            token_logprobs=token_logprobs,
        )


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
            segments.append(
                TimedText(
                    start_s if start_s is not None else last_end_s,
                    end_s,
                    tokenizer.decode(text_tokens),
                    text_tokens,
                )
            )
            start_s, last_end_s, text_tokens = None, end_s, []
        else:  # a segment's opening timestamp
            start_s = tokenizer.timestamp_seconds(token)
    if text_tokens:
        start = start_s if start_s is not None else last_end_s
        segments.append(
            TimedText(start, max(window_s, start), tokenizer.decode(text_tokens), text_tokens, closed=False)
        )
    return [segment for segment in segments if segment.text.strip()]
