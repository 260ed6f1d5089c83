"""transformers as the reference: the same weights in WhisperForConditionalGeneration, decoded by
its own greedy `generate` with Whisper's suppression (and timestamp) logits processors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, WhisperConfig, WhisperForConditionalGeneration
from transformers.generation.logits_process import LogitsProcessorList, WhisperTimeStampLogitsProcessor

from engine.config import EngineConfig
from engine.decode.engine import DecoderEngine
from engine.encode.runner import EncoderRunner
from engine.model.audio import log_mel_spectrogram
from engine.model.loading import load_model
from engine.model.weights import LoadedWeights, load_weights
from engine.model.whisper import TextDecoder
from engine.types import DecodeOptions
from tests.support.engines import decode_alone
from tests.support.speech import SPEECH_DIR, windows_of


def hf_model(model_name: str) -> tuple[WhisperForConditionalGeneration, LoadedWeights]:
    weights = load_weights(model_name)
    dims = weights.dims
    config = WhisperConfig(
        vocab_size=dims.vocab_size,
        num_mel_bins=dims.n_mels,
        d_model=dims.d_model,
        encoder_layers=dims.encoder_layers,
        decoder_layers=dims.decoder_layers,
        encoder_attention_heads=dims.encoder_heads,
        decoder_attention_heads=dims.decoder_heads,
        encoder_ffn_dim=dims.encoder_ffn_dim,
        decoder_ffn_dim=dims.decoder_ffn_dim,
        max_source_positions=dims.n_audio_ctx,
        max_target_positions=dims.n_text_ctx,
    )
    model = WhisperForConditionalGeneration(config).eval()
    state = {f"model.{k}": v.float() for k, v in weights.state_dict.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"proj_out.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model, weights


@torch.inference_mode()
def hf_greedy(
    model: WhisperForConditionalGeneration,
    input_features: torch.Tensor,
    prompt_tokens: list[int],
    max_new_tokens: int,
    eot: int,
    suppress_tokens: list[int],
    begin_suppress_tokens: list[int],
    timestamps: bool = False,
    no_timestamps_token: int | None = None,
) -> list[int]:
    processors = LogitsProcessorList()
    if timestamps:
        config = GenerationConfig(eos_token_id=eot, max_initial_timestamp_index=50)
        config.no_timestamps_token_id = no_timestamps_token
        processors.append(WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt_tokens)))
    out = GenerationMixin.generate(
        model,
        input_features=input_features,
        decoder_input_ids=torch.tensor([prompt_tokens], device=input_features.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        suppress_tokens=suppress_tokens,
        begin_suppress_tokens=begin_suppress_tokens,
        logits_processor=processors,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    tokens = out[0, len(prompt_tokens) :].tolist()
    return tokens[:-1] if tokens and tokens[-1] == eot else tokens


def hf_greedy_as_engine(
    model: WhisperForConditionalGeneration,
    input_features: torch.Tensor,
    engine,
    request,
    max_new_tokens: int | None = None,
) -> list[int]:
    """hf_greedy with what ``engine`` decodes ``request`` with: its prompt, its length (or
    ``max_new_tokens``), end of text, the suppression lists and the timestamp rules."""
    special = engine.tokenizer.special
    return hf_greedy(
        model,
        input_features,
        request.prompt_tokens,
        request.max_tokens if max_new_tokens is None else max_new_tokens,
        special.eot,
        engine.rules.suppress_token_ids,
        engine.rules.begin_suppress_token_ids,
        timestamps=request.options.timestamps,
        no_timestamps_token=special.no_timestamps,
    )


def jfk_tokens_beside_transformers(
    folder: Path, device: torch.device, prepare: Callable[[TextDecoder], None], max_tokens: int
) -> tuple[list[int], list[int]]:
    """The engine's greedy tokens for the jfk clip on the model saved in ``folder`` (float32, every
    step eager), the decoder first changed by ``prepare(decoder)``, and transformers' for the same
    prompt: (ours, theirs)."""
    reference, _ = hf_model(str(folder))
    config = EngineConfig(
        model=str(folder),
        device=device.type,
        dtype="float32",
        block_size=8,
        kv_cache_memory_mb=64,
        gpu={"compile_encoder": False, "cuda_graphs": False},
    )
    loaded = load_model(config)
    engine = DecoderEngine(loaded)
    prepare(loaded.model.decoder)  # after the engine set the decoder up for the device
    audio = windows_of([SPEECH_DIR / "jfk.flac"])
    with torch.inference_mode():
        mels = log_mel_spectrogram(audio, loaded.weights.dims.n_mels)
        cross_kv = EncoderRunner(loaded).cross_kv(loaded.model.encoder(mels.to(device)))[0]
    request, result = decode_alone(engine, cross_kv, DecodeOptions(max_tokens=max_tokens))
    return result.tokens, hf_greedy_as_engine(reference, mels, engine, request)
