"""openai-whisper as the reference for beam search: the same weights in its own Whisper module,
decoded by its own DecodingTask (BeamSearchDecoder, MaximumLikelihoodRanker, its logit filters)."""

from __future__ import annotations

import re

import torch
import whisper
from whisper.decoding import DecodingTask
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
    openai_whisper_beam_search takes it in place of the log-mel, so a window decoded at several
    settings is encoded once."""
    return model.embed_audio(mel[None])[0]


class _BeamsOfSeveralWindows(DecodingTask):
    """openai-whisper's DecodingTask with each window's audio features repeated for its beams, as
    its tokens are: its own ``run`` repeats only the tokens, which broadcast against one window's
    features but not against several."""

    def _get_audio_features(self, mel: torch.Tensor) -> torch.Tensor:
        return super()._get_audio_features(mel).repeat_interleave(self.n_group, dim=0)

    def _detect_language(self, audio_features: torch.Tensor, tokens: torch.Tensor):
        return super()._detect_language(audio_features[:: self.n_group], tokens)


# The beams one DecodingTask decodes together: it steps until its last window's search ends, so a
# larger batch carries more rows of windows already finished.
_ROWS_PER_BATCH = 30


@torch.inference_mode()
def openai_whisper_beam_search(
    model: whisper.model.Whisper,
    windows: torch.Tensor,
    beam_size: int,
    suppress_tokens: list[int],
    patience: float | None = None,
    length_penalty: float | None = None,
    timestamps: bool = False,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """The tokens openai-whisper's beam search decodes from each window of ``windows``: their
    log-mels [N, n_mels, 3000] or their encoder outputs (openai_whisper_audio_features) [N,
    n_audio_ctx, d] (English, transcribe, end of text excluded). Several windows go through one
    DecodingTask, a batch of their beams in each step."""
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
    windows_per_batch = max(1, _ROWS_PER_BATCH // beam_size)
    return [
        list(result.tokens)
        for start in range(0, len(windows), windows_per_batch)
        for result in _BeamsOfSeveralWindows(model, options).run(windows[start : start + windows_per_batch])
    ]
