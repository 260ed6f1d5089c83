"""An encoder replica's work: batches of 30 s windows -> encoder states -> each window's
cross-attention K/V, in the KV cache's dtype."""

from __future__ import annotations

import torch

from engine.kv.storage import to_cache_dtype
from engine.model.audio import N_SAMPLES, log_mel_spectrogram
from engine.model.loading import LoadedModel


class EncoderRunner:
    """Batches of 30 s windows -> encoder states -> each window's cross-attention K/V."""

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.dims = loaded.weights.dims
        self.device = loaded.config.torch_device
        self.dtype = loaded.config.torch_dtype
        self.kv_cache_dtype = loaded.config.kv_cache_torch_dtype
        switches = loaded.config.gpu_switches()
        if switches.fused_encoder_gelu:
            self.model.encoder.fuse_gelu()  # before compiling: the compiled graph takes the fused product
        if switches.compile_encoder:
            # The whole encoder, not each layer alone: fusions across layers count (RESULTS.md).
            if not getattr(self.model.encoder, "_compiled_call_impl", None):
                self.model.encoder.compile()
            # Compile now, not in a request: a second batch size makes the graph batch-dynamic.
            for batch in (1, 2):
                self.encode(torch.zeros(batch, N_SAMPLES))

    @torch.inference_mode()
    def encode(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [N, 480000] float32 samples (padded) -> encoder states [N, 1500, d_model]."""
        mels = log_mel_spectrogram(windows.to(self.device), self.dims.n_mels)
        return self.model.encoder(mels.to(self.dtype))

    @torch.inference_mode()
    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[N, 1500, d] -> [N, layers, 2, 1500, H, D], in the KV cache's dtype: the bytes a decoder's
        blocks hold, so a transfer copies them as they are (and an fp8 cache ships half the bytes)."""
        return to_cache_dtype(self.model.decoder.project_cross_kv(states), self.kv_cache_dtype)
