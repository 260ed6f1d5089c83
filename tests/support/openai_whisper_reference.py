"""openai-whisper as the reference for beam search: the same weights in its own Whisper module,
decoded by its own ``decode`` (BeamSearchDecoder, MaximumLikelihoodRanker, its logit filters)."""

from __future__ import annotations

import re

import torch
import whisper
from whisper.model import ModelDimensions

from engine.model.weights import LoadedWeights

# transformers' names (the engine's canonical state dict) -> openai-whisper's, in order.
_RENAMES = [
    (r"^encoder\.embed_positions\.weight$", "encoder.positional_embedding"),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"\.layers\.", ".blocks."),
    (r"\.self_attn\.q_proj\.", ".attn.query."),
    (r"\.self_attn\.k_proj\.", ".attn.key."),
    (r"\.self_attn\.v_proj\.", ".attn.value."),
    (r"\.self_attn\.out_proj\.", ".attn.out."),
    (r"\.encoder_attn\.q_proj\.", ".cross_attn.query."),
    (r"\.encoder_attn\.k_proj\.", ".cross_attn.key."),
    (r"\.encoder_attn\.v_proj\.", ".cross_attn.value."),
    (r"\.encoder_attn\.out_proj\.", ".cross_attn.out."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.fc1\.", ".mlp.0."),
    (r"\.fc2\.", ".mlp.2."),
]


def openai_whisper_model(weights: LoadedWeights) -> whisper.model.Whisper:
    """openai-whisper's Whisper module holding ``weights`` (fp32, CPU)."""
    dims = weights.dims
    model = whisper.model.Whisper(
        ModelDimensions(
            n_mels=dims.n_mels,
            n_audio_ctx=dims.n_audio_ctx,
            n_audio_state=dims.d_model,
            n_audio_head=dims.encoder_heads,
            n_audio_layer=dims.encoder_layers,
            n_vocab=dims.vocab_size,
            n_text_ctx=dims.n_text_ctx,
            n_text_state=dims.d_model,
            n_text_head=dims.decoder_heads,
            n_text_layer=dims.decoder_layers,
        )
    )
    state = {}
    for name, tensor in weights.state_dict.items():
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        state[name] = tensor.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # k_proj has no bias in either; the alignment heads are a buffer openai-whisper fills itself.
    assert set(missing) <= {"alignment_heads"} and not unexpected, (missing, unexpected)
    return model.eval()


@torch.inference_mode()
def openai_whisper_audio_features(model: whisper.model.Whisper, mel: torch.Tensor) -> torch.Tensor:
    """openai-whisper's encoder output for one window's log-mel [n_mels, 3000]: [n_audio_ctx, d].
    Its ``decode`` takes it in place of the log-mel, so a window decoded at several settings is
    encoded once."""
    return model.embed_audio(mel[None])[0]


@torch.inference_mode()
def openai_whisper_beam_search(
    model: whisper.model.Whisper,
    window: torch.Tensor,
    beam_size: int,
    suppress_tokens: list[int],
    patience: float | None = None,
    length_penalty: float | None = None,
    timestamps: bool = False,
    max_tokens: int | None = None,
) -> list[int]:
    """The tokens openai-whisper's beam search decodes from one window's log-mel [n_mels, 3000], or
    from its encoder output (openai_whisper_audio_features) (English, transcribe, end of text
    excluded)."""
    options = whisper.DecodingOptions(
        language="en",
        beam_size=beam_size,
        patience=patience,
        length_penalty=length_penalty,
        without_timestamps=not timestamps,
        suppress_tokens=suppress_tokens,
        sample_len=max_tokens,
        fp16=False,
    )
    return list(whisper.decode(model, window, options).tokens)
