"""Scoring transcripts on a speech set: its manifest, Whisper's English normalizer, and WER.

Used by the accuracy tests and the benchmarks alike, so both score the same way.
(whisper-normalizer and jiwer come with the project's `test` extra.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ClipNoise:
    """Noise added to a clip as it is read (clip_samples): stored, noise would not compress."""

    color: str  # "white" or "pink"
    snr_db: float  # the clip's power over the noise's
    seed: int


@dataclass(frozen=True)
class SpeechClip:
    id: str
    path: Path
    text: str | None
    duration_s: float
    noise: ClipNoise | None = None
    voice: str | None = None  # the synthetic voice that spoke it, where one did
    split: str | None = None  # "tuning" or "held_out", in a set that keeps one apart


def load_manifest(folder: Path) -> list[SpeechClip]:
    clips = []
    for line in (folder / "manifest.jsonl").read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            noise = ClipNoise(**item["noise"]) if item.get("noise") else None
            clips.append(
                SpeechClip(
                    item["id"],
                    folder / item["audio"],
                    item.get("text"),
                    item["duration_s"],
                    noise,
                    item.get("voice"),
                    item.get("split"),
                )
            )
    return clips


def clip_samples(clip: SpeechClip) -> np.ndarray:
    """The clip's 16 kHz float32 samples, with its noise added (the same noise on every read)."""
    from engine.model.audio import load_audio_file

    samples = load_audio_file(clip.path)
    if clip.noise is None:
        return samples
    rng = np.random.default_rng(clip.noise.seed)
    noise = rng.standard_normal(len(samples))
    if clip.noise.color == "pink":  # power falling as 1/f: white noise shaped in frequency
        spectrum = np.fft.rfft(noise)
        spectrum[1:] /= np.sqrt(np.arange(1, len(spectrum)))
        spectrum[0] = 0
        noise = np.fft.irfft(spectrum, n=len(samples))
    elif clip.noise.color != "white":
        raise ValueError(f"clip {clip.id}: unknown noise colour {clip.noise.color!r}")
    signal_power = float(np.mean(samples.astype(np.float64) ** 2))
    noise *= np.sqrt(signal_power / 10 ** (clip.noise.snr_db / 10) / np.mean(noise**2))
    return np.clip(samples + noise, -1.0, 1.0).astype(np.float32)


@dataclass(frozen=True)
class ConcatenatedSpeech:
    """Clips played one after another with silence between them: a long file with a known text."""

    samples: np.ndarray  # float32, 16 kHz
    text: str
    clip_starts_s: list[float]  # where each clip begins in ``samples``
    clip_ends_s: list[float]  # and ends; silence follows it

    @property
    def duration_s(self) -> float:
        return len(self.samples) / 16000


def concatenate_clips(clips: list[SpeechClip], silence_s: float | list[float]) -> ConcatenatedSpeech:
    """Built when needed from the speech set, so no long audio sits in the repository.
    ``silence_s``: after every clip, or a list of the pause after each clip."""
    from engine.model.audio import SAMPLE_RATE, load_audio_file

    pauses_s = silence_s if isinstance(silence_s, list) else [silence_s] * len(clips)
    pieces, starts, ends, position = [], [], [], 0
    for clip, pause_s in zip(clips, pauses_s):
        silence = np.zeros(round(pause_s * SAMPLE_RATE), dtype=np.float32)
        audio = load_audio_file(clip.path)
        starts.append(position / SAMPLE_RATE)
        ends.append((position + len(audio)) / SAMPLE_RATE)
        pieces += [audio, silence]
        position += len(audio) + len(silence)
    return ConcatenatedSpeech(np.concatenate(pieces), " ".join(clip.text for clip in clips), starts, ends)


# The long-form test file (tests/engine/transcribe/test_long_form.py, benchmarks/bench_long_form.py):
# 73 s, three windows; real speech (JFK, the Harvard sentences) and synthetic.
LONG_FORM_CLIP_IDS = [
    "jfk",
    *(f"osr72_{i:02d}" for i in range(1, 11)),
    *(f"tts_{i:02d}" for i in range(1, 7)),
]


def paused_speech_file(folder: Path, seed: int = 0) -> ConcatenatedSpeech:
    """Every English clip of the speech set once, in a seeded order, with pauses of 1 to 8 s
    between them: 5.5 minutes with many pauses, as a meeting or a dictation has."""
    clips = [clip for clip in load_manifest(folder) if clip.text]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(clips))
    pauses_s = [round(float(pause), 2) for pause in rng.uniform(1.0, 8.0, size=len(clips))]
    return concatenate_clips([clips[index] for index in order], pauses_s)


def long_form_file(folder: Path) -> ConcatenatedSpeech:
    clips = {clip.id: clip for clip in load_manifest(folder)}
    return concatenate_clips([clips[clip_id] for clip_id in LONG_FORM_CLIP_IDS], silence_s=1.0)


@lru_cache(maxsize=1)
def _normalizer():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


def normalize_english(text: str) -> str:
    return _normalizer()(text)


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER (total edits / total reference words) after Whisper's English normalization."""
    import jiwer

    pairs = [
        (normalize_english(r), normalize_english(h)) for r, h in zip(references, hypotheses, strict=True)
    ]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])


# The decoding our engine does, asked of faster-whisper's transcribe: English, greedy or beams at
# temperature 0 without fallback, no timestamps, each window decoded without the previous one's
# text, no VAD. A WER gap against it measures the engine, not the decoding options.
FASTER_WHISPER_DECODING = dict(
    language="en",
    temperature=0.0,
    without_timestamps=True,
    condition_on_previous_text=False,
    vad_filter=False,
)


def faster_whisper_text(model, audio, beam_size: int) -> str:
    """One file's (a path) or waveform's transcript by a faster_whisper.WhisperModel's
    transcribe, as a user calls it, decoding as FASTER_WHISPER_DECODING says."""
    segments, _ = model.transcribe(audio, beam_size=beam_size, **FASTER_WHISPER_DECODING)
    return "".join(segment.text for segment in segments).strip()


def faster_whisper_texts_by_beam(model, audio: np.ndarray, beam_sizes: tuple[int, ...]) -> dict[int, str]:
    """faster_whisper_text at each of ``beam_sizes``, the first window encoded once for all of
    them. transcribe's own path: the options are those transcribe builds (its segments, a lazy
    generator, are never run), and its generate_segments decodes them, given the first window's
    encoder output as transcribe gives it language detection's; later windows it encodes itself."""
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.tokenizer import Tokenizer

    features = model.feature_extractor(audio)
    # transcribe's first window: up to 30 s of the log-mel's frames but the last, padded with zeros.
    first_window_frames = min(model.feature_extractor.nb_max_frames, features.shape[-1] - 1)
    first_window = model.encode(pad_or_trim(features[:, :first_window_frames]))
    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language="en")
    texts = {}
    for beam_size in beam_sizes:
        _, info = model.transcribe(audio, beam_size=beam_size, **FASTER_WHISPER_DECODING)
        segments = model.generate_segments(
            features, tokenizer, info.transcription_options, False, first_window
        )
        texts[beam_size] = "".join(segment.text for segment in segments).strip()
    return texts


def faster_whisper_transcripts(
    model_folder: Path,
    clips: list[SpeechClip],
    compute_type: str,
    threads: int,
    beam_sizes: tuple[int, ...] = (1,),
) -> dict[int, list[str]]:
    """faster-whisper (CTranslate2) on the same weights, decoding as FASTER_WHISPER_DECODING says at
    each of ``beam_sizes``: its transcripts, by beam size. Each clip's first window is encoded once
    for every beam size (faster_whisper_texts_by_beam)."""
    from faster_whisper import WhisperModel, decode_audio

    model = WhisperModel(str(model_folder), device="cpu", compute_type=compute_type, cpu_threads=threads)
    texts: dict[int, list[str]] = {beam_size: [] for beam_size in beam_sizes}
    for clip in clips:
        audio = decode_audio(str(clip.path), sampling_rate=model.feature_extractor.sampling_rate)
        for beam_size, text in faster_whisper_texts_by_beam(model, audio, beam_sizes).items():
            texts[beam_size].append(text)
    return texts


def ctranslate2_transcripts(
    model_folder: Path,
    clip_windows: list[list],
    threads: int,
    beam_sizes: tuple[int, ...] = (1,),
    windows_per_batch: int = 16,
) -> dict[int, list[str]]:
    """CTranslate2 (faster-whisper's decoder) on log-mel windows we computed, one list of
    [n_mels, 3000] arrays per clip: the same decoder as faster_whisper_transcripts, our front end.
    Greedy (beam size 1) or with beams, each of ``beam_sizes``: its transcripts, by beam size. A
    clip's windows are encoded once for every beam size, as faster-whisper encodes a window once
    for its decoding attempts, and decoded ``windows_per_batch`` at a time, the clips' windows
    together: each window's search in a batch is its own, so a clip's text is the one its windows
    decoded by themselves give, with fewer of the decoder's small steps.

    faster-whisper (like openai-whisper's transcribe) pads a short clip's log-mel with zeros, while
    transformers' feature extractor (and so our front end) pads the audio with silence; on short
    clips the two paddings lead the model to different words. This isolates the decoder.
    """
    import ctranslate2
    import numpy as np
    from faster_whisper import WhisperModel

    model = WhisperModel(str(model_folder), device="cpu", compute_type="float32", cpu_threads=threads)
    tokenizer = model.hf_tokenizer
    prompt = [tokenizer.token_to_id("<|startoftranscript|>"), tokenizer.token_to_id("<|notimestamps|>")]
    encoded: list[np.ndarray] = []  # every clip's windows' encoder outputs, in order
    for windows in clip_windows:
        features = ctranslate2.StorageView.from_array(
            np.ascontiguousarray(np.stack(windows), dtype=np.float32)
        )
        encoded.extend(np.array(model.model.encode(features)))
    texts: dict[int, list[str]] = {}
    for beam_size in beam_sizes:
        window_texts = []
        for start in range(0, len(encoded), windows_per_batch):
            batch = np.stack(encoded[start : start + windows_per_batch])
            results = model.model.generate(
                ctranslate2.StorageView.from_array(batch),  # the encoder's output in place of log-mels
                [prompt] * len(batch),
                beam_size=beam_size,
                max_length=448,
                suppress_blank=True,
                suppress_tokens=[-1],
            )
            window_texts += [tokenizer.decode(result.sequences_ids[0]) for result in results]
        ends = np.cumsum([len(windows) for windows in clip_windows])
        texts[beam_size] = [
            "".join(window_texts[end - len(windows) : end]).strip()
            for windows, end in zip(clip_windows, ends)
        ]
    return texts
