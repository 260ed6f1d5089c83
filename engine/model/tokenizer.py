"""Whisper's tokenizer: text <-> ids, and the special ids that decoding is built from.

Special ids are read from tokenizer.json by name, so English-only, multilingual and large-v3
vocabularies (which shift every id after the language tokens) all work without tables.
Timestamp tokens are not in tokenizer.json; they follow ``<|notimestamps|>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from engine.errors import WeightsFormatError

# Seconds per timestamp token: Whisper's audio frames are 20 ms after the encoder's stride 2.
TIMESTAMP_RESOLUTION_S = 0.02


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    translate: int
    transcribe: int
    sot_lm: int
    sot_prev: int
    no_speech: int
    no_timestamps: int

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


class WhisperTokenizer:
    def __init__(self, tokenizer_file: Path, vocab_size: int):
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise WeightsFormatError(f"{tokenizer_file}: not a readable tokenizer ({exc})") from exc
        self.vocab_size = vocab_size
        ids = {
            name: self._tokenizer.token_to_id(f"<|{name}|>")
            for name in (
                "endoftext",
                "startoftranscript",
                "translate",
                "transcribe",
                "startoflm",
                "startofprev",
                "nospeech",
                "nocaptions",
                "notimestamps",
            )
        }
        missing = [name for name in ("endoftext", "startoftranscript", "notimestamps") if ids[name] is None]
        if missing:
            raise WeightsFormatError(f"{tokenizer_file}: no Whisper special tokens {missing}")
        self.special = SpecialTokens(
            eot=ids["endoftext"],
            sot=ids["startoftranscript"],
            translate=ids["translate"],
            transcribe=ids["transcribe"],
            sot_lm=ids["startoflm"],
            sot_prev=ids["startofprev"],
            no_speech=ids["nospeech"] if ids["nospeech"] is not None else ids["nocaptions"],
            no_timestamps=ids["notimestamps"],
        )

    @cached_property
    def language_tokens(self) -> dict[str, int]:
        """Language code -> token id, for the ids between <|startoftranscript|> and <|translate|>."""
        out = {}
        for token_id in range(self.special.sot + 1, self.special.translate):
            token = self._tokenizer.id_to_token(token_id)
            if token and token.startswith("<|") and token.endswith("|>"):
                out[token[2:-2]] = token_id
        return out

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of the ordinary tokens; special and timestamp tokens are dropped."""
        return self._tokenizer.decode([t for t in token_ids if t < self.special.eot])

    def timestamp_seconds(self, token_id: int) -> float:
        return (token_id - self.special.timestamp_begin) * TIMESTAMP_RESOLUTION_S

    @cached_property
    def non_speech_tokens(self) -> list[int]:
        """openai-whisper's list of symbol tokens to suppress when a model ships none."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        return sorted(result)
