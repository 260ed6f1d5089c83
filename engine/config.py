"""Engine configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.attention.registry import kv_cache_dtype_problem


def cpu_has_bf16_instructions() -> bool:
    """Whether this machine's CPU multiplies bf16 natively (AVX-512 BF16, or AMX tiles), where
    oneDNN runs bf16 products faster than float32 ones."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# kv_cache_dtype names -> the cache's torch dtype ("auto" is the model's dtype).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}

# The encoder's self-attention: torch's SDPA, FlashAttention-3, or the second where it can run.
EncoderAttention = Literal["auto", "sdpa", "flash_attn_3"]

# Whisper's own prompt is 2 to 4 tokens (<|startoftranscript|>, language, task, <|notimestamps|>);
# fed one a step they cost a new request 3 steps more, against an eager step for everyone.
STEPPED_PROMPT_TOKENS_WITH_GRAPHS = 8


@dataclass(frozen=True)
class ResolvedGPUSwitches:
    """The switches as they apply on the configured device: each one a plain value."""

    cuda_graphs: bool
    async_steps: bool
    stepped_prompt_tokens: int
    compile_encoder: bool
    encoder_cuda_graphs: bool
    fused_encoder_gelu: bool
    fused_decoder_norms: bool
    small_rows_products: int
    fp8_encoder: bool
    encoder_stream_first: bool
    encoder_sm_share: float | None
    encoder_attention: EncoderAttention


class GPUSwitches(BaseModel):
    """Speed switches that matter only on a CUDA device; on a CPU every one of them is off."""

    model_config = ConfigDict(extra="forbid")

    cuda_graphs: bool = Field(
        True,
        description="replay decode steps from CUDA graphs captured at batch sizes up to max_num_seqs "
        "(with an attention backend that can be captured: triton)",
    )
    async_steps: bool | None = Field(
        None,
        description="launch each decode step before reading the tokens of the one before, so the host's "
        "work (reading tokens, ending requests, scheduling, preparing inputs) overlaps the GPU's; costs a "
        "wasted row for each window that ends at end of text. None: on where decode CUDA graphs are captured",
    )
    stepped_prompt_tokens: int | None = Field(
        None,
        ge=0,
        description="a prompt of at most this many tokens is fed one token a step, so that a step "
        "admitting new requests is still a decode step a CUDA graph replays (a step that feeds several "
        "tokens of one request runs eagerly); a longer prompt (previous text) is fed in one step. None: "
        f"{STEPPED_PROMPT_TOKENS_WITH_GRAPHS} where decode CUDA graphs are captured, else 0",
    )
    compile_encoder: bool = Field(
        True,
        description="compile the encoder with torch.compile (fuses the norms, GELUs and layout copies "
        "between the matrix products); start-up takes longer while it compiles",
    )
    encoder_cuda_graphs: bool | None = Field(
        None,
        description="replay the encoder's forward from CUDA graphs captured at power-of-two batch sizes "
        "up to the replica's encoder.max_batch_size (engine/encode/graphs.py): one launch a batch "
        "instead of hundreds, which a decode loop in the same process would otherwise hold up. None: on "
        "with fp8_encoder, whose quantizing kernels and FP8 products take the host longer to launch than "
        "a small batch takes the GPU to run; off otherwise: beside a colocated decode loop the 16-bit "
        "encoder's graphs served no more tokens a second",
    )
    fused_encoder_gelu: bool = Field(
        True,
        description="in bf16 or fp16, apply the encoder MLPs' GELU in the first product's cuBLASLt "
        "epilogue, in its tanh form (error under bf16's rounding); fp32 keeps the exact GELU",
    )
    fused_decoder_norms: bool = Field(
        True,
        description="run each residual add in the decoder and the layer norm after it as one Triton kernel",
    )
    small_rows_products: int = Field(
        16,
        ge=0,
        le=16,
        description="on Hopper and later GPUs, a decoder step of at most this many rows runs its matrix "
        "products through Triton kernels that load their weights while the kernel before them runs "
        "(programmatic dependent launch; engine/kernels/small_products.py) instead of cuBLAS, except "
        "products past one row whose input is wider than 2048 and not in whole parts of 1024; 0: cuBLAS at "
        "every batch (and on other GPUs)",
    )
    fp8_encoder: bool = Field(
        False,
        description="run the encoder's matrix products (and the cross-K/V projection) in FP8 e4m3 with "
        "per-channel weight and per-token activation scales (engine/model/fp8.py); needs FP8 tensor "
        "cores (compute capability 8.9+: Ada, Hopper)",
    )
    encoder_stream_first: bool = Field(
        True,
        description="where the encoder runs beside the decode loop in one process (placement colocated, "
        "the offline API), give its CUDA stream a higher priority than the decode steps': the GPU then "
        "starts an encoder batch's blocks ahead of queued decode kernels, so windows reach the decoder "
        "sooner and more of them decode in each step",
    )
    encoder_sm_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="where the encoder runs beside the decode loop in one process, the share of the GPU's "
        "SMs its stream may use (a CUDA green context; needs a torch built with green contexts, CUDA "
        "12.4+). A full-GPU encoder product holds every SM, and a decode step's small kernels queue "
        "behind it; on a partition of its own it leaves the rest to the decode steps, which use every "
        "SM while the encoder is idle. None: no partition",
    )
    encoder_attention: EncoderAttention = Field(
        "auto",
        description="the encoder's self-attention: 'sdpa' (torch's scaled_dot_product_attention, cuDNN's "
        "fused kernel on a GPU), 'flash_attn_3' (FlashAttention-3, Hopper GPUs only, from an installed "
        "build: engine/attention/flash_attention_3.py; start-up fails on a GPU where it cannot run), "
        "'auto': FlashAttention-3 where it can run, else sdpa",
    )

    def resolve(
        self, device_type: str, dtype: torch.dtype, graphs_capturable: bool = True
    ) -> ResolvedGPUSwitches:
        """The switches on ``device_type`` in ``dtype``; ``graphs_capturable``: whether the attention
        backend in use can be captured in a CUDA graph (known once it is built)."""
        on_cuda = device_type == "cuda"
        graphs = on_cuda and self.cuda_graphs and graphs_capturable
        stepped = self.stepped_prompt_tokens
        if stepped is None:
            stepped = STEPPED_PROMPT_TOKENS_WITH_GRAPHS if graphs else 0
        return ResolvedGPUSwitches(
            cuda_graphs=graphs,
            # A CPU computes as it launches: nothing to overlap, unless asked for (tests do).
            async_steps=self.async_steps if self.async_steps is not None else graphs,
            stepped_prompt_tokens=stepped,
            compile_encoder=on_cuda and self.compile_encoder,
            encoder_cuda_graphs=on_cuda
            and (self.encoder_cuda_graphs if self.encoder_cuda_graphs is not None else self.fp8_encoder),
            fused_encoder_gelu=on_cuda
            and self.fused_encoder_gelu
            and dtype in (torch.bfloat16, torch.float16),
            fused_decoder_norms=on_cuda and self.fused_decoder_norms,
            small_rows_products=self.small_rows_products if on_cuda else 0,
            fp8_encoder=on_cuda and self.fp8_encoder,
            encoder_stream_first=on_cuda and self.encoder_stream_first,
            encoder_sm_share=self.encoder_sm_share if on_cuda and self.encoder_sm_share != 1 else None,
            encoder_attention=self.encoder_attention if on_cuda else "sdpa",
        )


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "tiny.en", description="bundled name, model folder, or Hugging Face id in the local cache"
    )
    device: str = Field("cpu", description="'cpu', 'cuda' or 'cuda:N'")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="'auto': float32 on CPU (no fast half matmuls there; engine.cpu_dtype 'bfloat16' "
        "runs the heaviest products in bf16), float16 on CUDA (Whisper was "
        "trained in fp16; bf16's 8-bit mantissa costs accuracy on real weights). A window whose "
        "activations overflow fp16 fails with a clear error",
    )
    cpu_dtype: Literal["auto", "float32", "bfloat16-products", "bfloat16"] = Field(
        "auto",
        description="precision of the heavy products on a CPU when engine.dtype is float32, on the "
        "CPU's bf16 instructions (AVX-512 BF16 or AMX) where it names bf16. 'bfloat16-products': the "
        "encoder's matrix products in bf16 around a float32 residual stream, with float32 attention "
        "scores; the decoder float32. 'bfloat16': the whole encoder, and the decoder's first pass "
        "over the vocabulary, in bf16 (the likeliest tokens' logits recomputed in float32): the "
        "fastest, but on speech unlike what it was tuned on it changes more transcripts than "
        "float32's accuracy allows. 'auto' is float32. Measurements in benchmarks/RESULTS.md. "
        "Ignored on CUDA, where engine.dtype rules",
    )
    block_size: int = Field(
        128,
        description="tokens per KV block, a power of two. The cache is block-major (a block holds all "
        "layers), so a layer's K/V of one block is one contiguous piece of block_size tokens: small "
        "blocks make a layer's reads jump across the pool, and cross-attention reads them markedly "
        "slower. 1500 frames fill 12 blocks of 128, 36 slots of "
        "padding",
    )
    kv_cache_memory_mb: float = Field(512, gt=0, description="memory for the paged KV cache")
    max_num_seqs: int = Field(64, ge=1, description="most requests decoding at once")
    max_num_batched_tokens: int = Field(2048, ge=448, description="most tokens in one decoder step")
    interactive_reserved_seqs: int = Field(
        0,
        ge=0,
        description="sequence slots (and room for as many requests in the KV pool) that batch-priority "
        "work may not take, so interactive requests are admitted at once behind a batch backlog",
    )
    batch_aging_s: float = Field(
        30.0,
        gt=0,
        description="a batch-priority window waiting this long is scheduled as interactive (no starvation)",
    )
    batch_share: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="while interactive and batch-priority windows both wait, the share of the decoder's "
        "sequence slots (max_num_seqs) and of each encoder forward's windows (encoder.max_batch_size) "
        "that goes to the oldest batch work, rounded up to at least one but never all of them, so a long "
        "file progresses under any interactive load; when only one class waits it takes everything "
        "(batch work beyond its share still leaves interactive_reserved_seqs free). 0: batch work takes "
        "only what interactive work leaves, and relies on batch_aging_s",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="dtype of the paged KV cache (self- and cross-attention blocks) and of the cross-K/V "
        "encoders ship: 'auto' is engine.dtype; 'fp8_e4m3' halves a bf16 cache's bytes (twice the blocks "
        "in kv_cache_memory_mb, half the K/V each decode step reads) at fp8's precision; flash_attn cannot "
        "read it",
    )
    kv_load_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="threads loading cross-attention K/V that travels (pulls from encoder replicas) beside "
        "the decode loop; a pull is mostly waiting on its link, so a few keep it busy, and one slow "
        "sender holds back only the windows queued behind its worker",
    )
    attention_backend: Literal["auto", "torch", "triton", "flash_attn"] = Field(
        "auto",
        description="the decoder's paged attention: 'torch' (the reference; on a CPU it reads "
        "cross-attention in place from the blocks), 'triton' (paged kernels on CUDA), 'flash_attn' "
        "(flash-attn's paged kernel, where that package is importable; not with an fp8 KV cache); "
        "'auto': flash_attn, else triton, where each can run on the device, else torch",
    )
    gpu: GPUSwitches = Field(default_factory=GPUSwitches, description="switches that matter on CUDA only")

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if value < 1 or value > 1024 or value & (value - 1):
            raise ValueError(f"block_size must be a power of two between 1 and 1024, got {value}")
        return value

    @field_validator("device")
    @classmethod
    def _device_exists(cls, value: str) -> str:
        try:
            device = torch.device(value)
        except RuntimeError as exc:
            raise ValueError(f"device {value!r} is not a torch device ('cpu', 'cuda', 'cuda:0')") from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device type {device.type!r} is not supported (cpu or cuda)")
        return value

    @model_validator(mode="after")
    def _reservation_leaves_room_for_batch_work(self) -> "EngineConfig":
        if self.interactive_reserved_seqs >= self.max_num_seqs:
            raise ValueError(
                f"interactive_reserved_seqs ({self.interactive_reserved_seqs}) must be below max_num_seqs "
                f"({self.max_num_seqs}), or batch-priority work could never be admitted before it ages"
            )
        return self

    @model_validator(mode="after")
    def _resolve_dtype(self) -> "EngineConfig":
        if self.cpu_dtype == "auto":
            # float32: the default must keep float32's text on speech no tuning looked at, and the
            # bf16 path, measured on the broad speech set, does not (benchmarks/bench_cpu_precision.py).
            self.cpu_dtype = "float32"
        if self.dtype == "auto":
            self.dtype = "float16" if torch.device(self.device).type == "cuda" else "float32"
        return self

    @model_validator(mode="after")
    def _cpu_has_what_cpu_dtype_needs(self) -> "EngineConfig":
        if self.cpu_dtype.startswith("bfloat16") and self.on_cpu and not cpu_has_bf16_instructions():
            raise ValueError(
                f"cpu_dtype '{self.cpu_dtype}' needs a CPU with bf16 instructions (AVX-512 BF16 or AMX); "
                "this one has neither, and emulated bf16 is slower than float32: use 'float32' or 'auto'"
            )
        return self

    @model_validator(mode="after")  # after _resolve_dtype: "auto" needs the resolved dtype
    def _backend_reads_the_kv_cache_dtype(self) -> "EngineConfig":
        problem = kv_cache_dtype_problem(self.attention_backend, self.kv_cache_torch_dtype)
        if problem:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} with attention_backend "
                f"{self.attention_backend!r}: {problem}"
            )
        return self

    def gpu_switches(self, graphs_capturable: bool = True) -> ResolvedGPUSwitches:
        """The GPU switches resolved against this config's device and dtype (the one place that does)."""
        return self.gpu.resolve(self.torch_device.type, self.torch_dtype, graphs_capturable)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def on_cpu(self) -> bool:
        return torch.device(self.device).type == "cpu"

    @property
    def encoder_torch_dtype(self) -> torch.dtype:
        """The encoder's dtype: engine.dtype, but bf16 for cpu_dtype 'bfloat16' on a CPU running
        float32 (with 'bfloat16-products' the encoder's stream stays float32)."""
        if self.on_cpu and self.torch_dtype == torch.float32 and self.cpu_dtype == "bfloat16":
            return torch.bfloat16
        return self.torch_dtype

    @property
    def cpu_bf16_products(self) -> bool:
        """Whether the encoder's products run in bf16 around a float32 stream (cpu_dtype
        'bfloat16-products')."""
        return self.on_cpu and self.torch_dtype == torch.float32 and self.cpu_dtype == "bfloat16-products"

    @property
    def cpu_bf16_logits(self) -> bool:
        """Whether the decoder's vocabulary projection runs in bf16 first (cpu_dtype bfloat16)."""
        return self.on_cpu and self.torch_dtype == torch.float32 and self.cpu_dtype == "bfloat16"

    @property
    def encoder_precision(self) -> str:
        """The encoder's precision path in words, for the logs and /metrics."""
        if self.cpu_bf16_products:
            return "float32 with bf16 products on CPU"
        if self.on_cpu:
            return f"{str(self.encoder_torch_dtype).removeprefix('torch.')} on CPU"
        fp8 = " + FP8 products" if self.gpu_switches().fp8_encoder else ""
        return f"{self.dtype}{fp8} on CUDA"

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def check_device_present(self) -> None:
        """Called where the model loads (a replica may sit on another node than the one that
        validated the config), so the check runs on the machine that needs the GPU."""
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"engine.device {self.device!r}, but this machine has no CUDA GPU; use device: cpu"
            )
