"""An encoder replica's work: batches of 30 s windows -> encoder states -> each window's
cross-attention K/V, in the KV cache's dtype. A batch may be encoded over fewer frames than a full
window's (engine/encode/context.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.flash_attention_3 import (
    MIN_WINDOWS,
    FlashAttention3,
    attention_dtype,
    flash_attention_3_problem,
    installed_flash_attention_3,
)
from engine.config import EncoderAttention
from engine.encode.context import WINDOW_FRAMES, context_samples
from engine.encode.graphs import EncoderGraphs
from engine.encode.staging import WindowStaging
from engine.kv.storage import to_cache_dtype
from engine.model.audio import N_FFT, N_SAMPLES, log_mel_spectrogram
from engine.model.fp8 import fp8_supported, quantize_linears
from engine.model.loading import LoadedModel

# Graphs of the compiled encoder beyond those its warm-up makes before torch stops compiling it:
# torch's default for any function.
RECOMPILE_ROOM = 8

# An encoder batch: [N, 480000] float32 samples (padded), or each window's samples as they came.
Windows = torch.Tensor | Sequence[np.ndarray]


def quantize_encoder_fp8(loaded: LoadedModel) -> None:
    """The encoder's products and the cross-K/V projection in FP8 (engine.gpu.fp8_encoder), once
    per model: a decoder engine sharing the model in one process sees the same projection."""
    model, device = loaded.model, loaded.config.torch_device
    if not fp8_supported(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(
            f"engine.gpu.fp8_encoder needs FP8 tensor cores (compute capability 8.9 or up); this GPU "
            f"is {capability}: set it to false"
        )
    if getattr(model.encoder, "fp8", False):
        return
    model.encoder.quantize_fp8()
    if model.decoder.cross_kv is not None:
        quantize_linears(model.decoder, ["cross_kv"])
    model.encoder.fp8 = True


def choose_encoder_attention(loaded: LoadedModel, choice: EncoderAttention) -> str:
    """Route the encoder's self-attention through FlashAttention-3 where ``choice`` asks for it and
    it can run (engine.gpu.encoder_attention); returns what the encoder now runs, for the start-up
    log. Once per model, after any FP8 quantization (the QKV product's dtype follows) and before
    compiling."""
    encoder, config = loaded.model.encoder, loaded.config
    fp8_products = getattr(encoder, "fp8", False)
    routed = encoder.layers[0].flash_attention
    if routed is not None:  # a runner before this one on the same model routed it
        qkv = encoder.layers[0].qkv
        return _flash_attention_named(routed, qkv.dtype if fp8_products else config.torch_dtype)
    if choice == "sdpa":
        return "sdpa"
    dims = loaded.weights.dims
    problem = flash_attention_3_problem(config.torch_device, dims.d_model // dims.encoder_heads)
    build = installed_flash_attention_3() if problem is None else None
    dtype = attention_dtype(build, config.torch_dtype, fp8_products) if build is not None else None
    if build is not None and dtype is None:
        problem = (
            f"the installed FlashAttention-3 build ({build.module}) has no kernels for the "
            f"encoder's {str(config.torch_dtype).removeprefix('torch.')}"
        )
    if problem is not None:
        if choice == "flash_attn_3":
            raise ValueError(
                f"engine.gpu.encoder_attention is flash_attn_3, but {problem}; set it to auto or sdpa"
            )
        return "sdpa"
    encoder.use_flash_attention(build, dtype)
    return _flash_attention_named(build, dtype)


def _flash_attention_named(build: FlashAttention3, dtype: torch.dtype) -> str:
    return f"FlashAttention-3 ({build.module}, {str(dtype).removeprefix('torch.')})"


class EncoderRunner:
    """Batches of 30 s windows -> encoder states -> each window's cross-attention K/V."""

    def __init__(self, loaded: LoadedModel, graph_batch_size: int = 0, contexts: Sequence[int] = ()):
        """``graph_batch_size``: with engine.gpu.encoder_cuda_graphs on a GPU, the largest batch to
        capture CUDA graphs for (the replica's encoder.max_batch_size); larger batches and 0 run
        without. ``contexts``: the shortened contexts (encoder frames) windows will come with,
        compiled and captured at start-up beside the full window's, so that no request waits for
        it; any other context runs without graphs, compiled on first use."""
        self.model = loaded.model
        self.dims = loaded.weights.dims
        self.device = loaded.config.torch_device
        self.dtype = loaded.config.torch_dtype
        self.kv_cache_dtype = loaded.config.kv_cache_torch_dtype
        switches = loaded.config.gpu_switches()
        # For a caller that encodes on a stream of its own (engine/encode/overlap.py).
        self.stream_first = switches.encoder_stream_first
        self.sm_share = switches.encoder_sm_share
        self.graphs: EncoderGraphs | None = None
        self.staging = WindowStaging(self.device, graph_batch_size)
        if switches.fp8_encoder:
            quantize_encoder_fp8(loaded)
        elif switches.fused_encoder_gelu:
            self.model.encoder.fuse_gelu()  # before compiling: the compiled graph takes the fused product
        self.attention = choose_encoder_attention(loaded, switches.encoder_attention)
        contexts = [WINDOW_FRAMES, *sorted(set(contexts) - {WINDOW_FRAMES}, reverse=True)]
        if switches.compile_encoder:
            # The whole encoder, not each layer alone: fusions across layers count.
            if not self.compiled:
                self.model.encoder.compile()
            self.warm_compiled(contexts)
        if switches.encoder_cuda_graphs and graph_batch_size > 0:
            self.graphs = EncoderGraphs(
                self.model.encoder, self.dims.n_mels, contexts, graph_batch_size, self.device
            )

    @property
    def compiled(self) -> bool:
        return bool(getattr(self.model.encoder, "_compiled_call_impl", None))

    def warm_compiled(self, contexts: Sequence[int]) -> None:
        """Compile the encoder now, not in a request, for windows over each of ``contexts`` (encoder
        frames) at every batch size it is specialised on: a second batch size makes a context's
        graph batch-dynamic, and batches that take FlashAttention-3 where smaller ones do not are
        a graph of their own. A request that finds no graph waits for a compile, and so does every
        window queued behind it."""
        flash = self.model.encoder.layers[0].flash_attention is not None
        batches = (1, 2, MIN_WINDOWS) if flash else (1, 2)
        # Past a number of graphs of one function, torch runs it uncompiled from then on, and says
        # so only once in the log: room for these and as many more as torch allows by default.
        made = len(batches) * len(contexts)
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, made + RECOMPILE_ROOM
        )
        for frames in contexts:
            for batch in batches:
                self.encode(torch.zeros(batch, N_SAMPLES), frames)

    @torch.inference_mode()
    def encode(self, windows: Windows, frames: int | None = None) -> torch.Tensor:
        """windows [N, 480000] float32 samples (padded), or each window's samples as they came (any
        length up to 30 s, copied through ``staging``) -> encoder states [N, frames, d_model];
        ``frames`` None: a full window's 1500."""
        if not isinstance(windows, torch.Tensor):
            windows = self.staging.to_device(windows)
        shortened = frames is not None and frames < WINDOW_FRAMES
        if shortened:
            # One FFT's worth of the zeros after the context too, so that its last mel frames are
            # those of the whole window (the STFT reflects at the end of what it is given).
            windows = windows[:, : context_samples(frames) + N_FFT]
        mels = log_mel_spectrogram(windows.to(self.device), self.dims.n_mels)
        if shortened:
            # The encoder reads its positional table from the start, as many rows as frames. In
            # memory of their own: a compiled encoder's graph holds to its input's strides too.
            mels = mels[..., : 2 * frames].contiguous()
        # In the model's dtype: a CPU's bf16 encoder hands float32 states to the float32 decoder.
        if self.graphs is not None and self.graphs.holds(mels):
            return self.graphs(mels).to(self.dtype)
        if self.compiled:
            # A graph of its own for each context, as warm_compiled made them. Left to itself, torch
            # would compile the second context it sees as one graph for any number of frames, in the
            # request that brought it, and might run the full windows through that graph from then on.
            torch._dynamo.mark_static(mels, 2)
        return self.model.encoder(mels).to(self.dtype)

    @torch.inference_mode()
    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[N, frames, d] -> [N, layers, 2, frames, H, D], in the KV cache's dtype: the bytes a decoder's
        blocks hold, so a transfer copies them as they are (and an fp8 cache ships half the bytes)."""
        return to_cache_dtype(self.model.decoder.project_cross_kv(states), self.kv_cache_dtype)
