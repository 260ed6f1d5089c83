"""The Triton paged-attention backend: launch plans (splits, tiles, grouped heads) for the kernels in
engine/attention/triton_kernels.py, whose docstring gives the design."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.arith import ceil_div, round_up
from engine.attention.base import AttentionBackend, PagedAttentionBatch
from engine.attention.triton_kernels import MAX_HEAD_DIM, kernels
from engine.kernels import (
    TRITON_IMPORT_ERROR,
    early_launch,
    launch_control,
    sm_count,
    tl,
    triton_available,
    triton_interpreting,
)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclass(frozen=True)
class LaunchPlan:
    block_m: int
    block_n: int
    num_q_tiles: int
    num_splits: int
    keys_per_split: int
    num_warps: int
    num_stages: int
    heads_per_program: int = 1  # > 1: the grouped-heads decode kernel


# The grouped decode kernel's widest row of keys, in elements (heads_per_program * head_dim).
_MAX_GROUP_WIDTH = 128
# The grouped decode kernel's tiles by bytes per cached element: (keys per tile, warps, stages).
GROUPED_DECODE_TILES = {1: (128, 4, 3), 2: (32, 4, 3)}
# Decode steps of at most this many requests read each program's first key tile before they wait
# for the kernel ahead (EARLY_TILE in triton_decode_kernel.py), so the read overlaps that kernel;
# larger steps ran slower with it.
EARLY_TILE_MAX_REQUESTS = 4


def grouped_decode_heads(num_heads: int, head_dim: int) -> int:
    """Heads per program for the grouped decode kernel: the largest power of two that divides
    ``num_heads`` and keeps a key row within _MAX_GROUP_WIDTH elements; 1 (the per-head kernel)
    where head_dim is not a power of two (the kernel's columns are a power-of-two range)."""
    if head_dim & (head_dim - 1):
        return 1
    heads = 1
    while num_heads % (heads * 2) == 0 and heads * 2 * head_dim <= _MAX_GROUP_WIDTH and heads * 2 <= 16:
        heads *= 2
    return heads


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton: the per-head kernel (prefill, mixed steps, and decode where
    head_dim is not a power of two), the grouped-heads decode kernel, and a split-merge kernel
    when split-K is used.

    Tunables (None = heuristic):
      decode_heads_per_program: heads one decode program reads side by side (the grouped
                       decode kernel); default grouped_decode_heads(); 1 = one head per program.
      decode_block_n:  keys per tile when every request has one query (default 32; 128 for an
                       fp8 cache, whose keys are half the bytes).
      prefill_block_m: query rows per tile for prefill/mixed steps (default min(64, pow2 >= max
                       q_len), >= 16).
      prefill_block_n: keys per tile for prefill/mixed steps (default 64).
      num_splits:      key-range splits per (request, tile, head); None picks enough programs to
                       fill the GPU (about ``target_waves`` programs per SM), capped by
                       ``max_splits`` and by ``min_keys_per_split``. Without splits a small
                       decode step's cross-attention reads its 1500 keys from too few programs
                       to keep the memory busy.
    """

    name = "triton"
    graph_safe = True

    def __init__(
        self,
        *,
        decode_block_n: int | None = None,
        decode_heads_per_program: int | None = None,
        prefill_block_m: int | None = None,
        prefill_block_n: int = 64,
        num_splits: int | None = None,
        max_splits: int = 32,
        min_keys_per_split: int = 64,
        target_waves: float = 4.0,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> None:
        if not triton_available():
            raise ValueError(
                f"the triton attention backend needs the 'triton' package: {TRITON_IMPORT_ERROR}"
            )
        for label, value in (("decode_block_n", decode_block_n), ("prefill_block_n", prefill_block_n)):
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{label} must be a power of two >= 16, got {value}")
        if prefill_block_m is not None and (prefill_block_m < 16 or prefill_block_m & (prefill_block_m - 1)):
            raise ValueError(f"prefill_block_m must be a power of two >= 16, got {prefill_block_m}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if decode_heads_per_program is not None and (
            decode_heads_per_program < 1
            or decode_heads_per_program & (decode_heads_per_program - 1)
            or decode_heads_per_program > 16
        ):
            raise ValueError(
                f"decode_heads_per_program must be a power of two in 1..16, got {decode_heads_per_program}"
            )
        self.decode_block_n = decode_block_n
        self.decode_heads_per_program = decode_heads_per_program
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self.num_splits = num_splits
        self.max_splits = max_splits
        self.min_keys_per_split = min_keys_per_split
        self.target_waves = target_waves
        self.num_warps = num_warps
        self.num_stages = num_stages

    def max_key_readers(self, num_heads: int, head_dim: int) -> int:
        # The grouped decode kernel's 16-row tile holds HEADS rows per reader.
        heads = self.decode_heads_per_program or grouped_decode_heads(num_heads, head_dim)
        return 16 // heads if heads > 1 else 1

    # ------------------------------------------------------------------ planning
    def plan(
        self,
        batch: PagedAttentionBatch,
        num_heads: int,
        device: torch.device,
        cache_dtype: torch.dtype | None = None,
        head_dim: int = 64,
    ) -> LaunchPlan:
        max_q = max(1, int(batch.max_query_len))
        max_kv = max(1, int(batch.max_seq_len))
        decode = max_q == 1
        fp8 = cache_dtype == torch.float8_e4m3fn
        heads_per_program = 1
        if decode:
            heads_per_program = self.decode_heads_per_program or grouped_decode_heads(num_heads, head_dim)
            if heads_per_program > 1 and (num_heads % heads_per_program or head_dim & (head_dim - 1)):
                raise ValueError(
                    f"decode_heads_per_program {heads_per_program} needs a power-of-two head_dim "
                    f"and must divide the {num_heads} heads"
                )
        grouped_tile = GROUPED_DECODE_TILES.get(1 if fp8 else 2, GROUPED_DECODE_TILES[2])
        if decode and heads_per_program > 1:
            block_m, block_n = 16, self.decode_block_n or grouped_tile[0]
        elif decode:
            block_m, block_n = 16, self.decode_block_n or (128 if fp8 else 32)
        else:
            block_m = self.prefill_block_m or min(64, max(16, _next_pow2(max_q)))
            block_n = self.prefill_block_n
        num_q_tiles = ceil_div(max_q, block_m)

        if self.num_splits is not None:
            splits = self.num_splits
        else:
            programs = batch.num_requests * num_q_tiles * num_heads // heads_per_program
            target = int(self.target_waves * sm_count(device))
            splits = max(1, ceil_div(target, max(1, programs)))
            splits = min(splits, self.max_splits, max(1, max_kv // self.min_keys_per_split))
        keys_per_split = ceil_div(max_kv, splits)
        keys_per_split = round_up(keys_per_split, block_n)  # whole key tiles per split
        splits = ceil_div(max_kv, keys_per_split)

        if heads_per_program > 1:
            num_warps, num_stages = self.num_warps or grouped_tile[1], self.num_stages or grouped_tile[2]
        else:
            num_warps = self.num_warps or (2 if decode else 4)
            num_stages = self.num_stages or ((3 if fp8 else 4) if decode else 2)
        return LaunchPlan(
            block_m, block_n, num_q_tiles, splits, keys_per_split, num_warps, num_stages, heads_per_program
        )

    # ------------------------------------------------------------------ call
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PagedAttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        if query.device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                "the triton attention backend runs on CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                "(Triton's interpreter, for tests only) or use the 'torch' backend"
            )
        num_tokens, num_heads, head_dim = query.shape
        page_size = key_cache.shape[1]
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"block_size must be a power of two, got {page_size}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
        if key_cache.shape[2] != num_heads or value_cache.shape[2] != num_heads:
            raise ValueError("key/value cache head count must equal the query's (no GQA in Whisper)")
        if key_cache.dtype != value_cache.dtype:
            raise ValueError("key and value caches must share a dtype")

        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if num_tokens == 0 or batch.num_requests == 0:
            return out

        plan = self.plan(batch, num_heads, query.device, key_cache.dtype, head_dim)
        attn_kernel, decode_kernel, combine_kernel = kernels()

        # An fp8 cache is upcast as it is loaded (k.to(DOT_DTYPE)): to fp16 (see the module notes).
        fp8_cache = key_cache.dtype == torch.float8_e4m3fn
        half_query = query.dtype in (torch.float16, torch.bfloat16)
        if half_query and (fp8_cache or query.dtype == torch.float16):
            dot_dtype = tl.float16
        elif half_query and key_cache.dtype == query.dtype:
            dot_dtype = tl.bfloat16
        else:
            dot_dtype = tl.float32  # fp32, or other mixed query/cache dtypes: compute in fp32
        if dot_dtype == tl.bfloat16 and triton_interpreting():
            # Triton's CPU interpreter (3.9) computes tl.dot on bf16 operands wrongly (bit
            # patterns read as integers); upcast there. Compiled GPU kernels use bf16 MMA.
            dot_dtype = tl.float32
        dot_precision = "ieee"  # only matters for fp32 operands: no TF32 (keeps fp32 exact-ish)

        head_dim_pad = max(16, _next_pow2(head_dim))
        if plan.num_splits > 1:
            part_acc = torch.empty(
                (num_tokens, num_heads, plan.num_splits, head_dim), dtype=torch.float32, device=query.device
            )
            part_m = torch.empty(
                (num_tokens, num_heads, plan.num_splits), dtype=torch.float32, device=query.device
            )
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # unused placeholders

        block_tables = batch.block_tables
        clamp_q = dot_dtype == tl.float16 and query.dtype == torch.bfloat16
        # The two kernels' arguments but the third grid dimension (query tiles or head groups).
        tensors = (
            query,
            key_cache,
            value_cache,
            out,
            part_acc,
            part_m,
            part_l,
            batch.query_start_loc,
            batch.seq_lens,
            block_tables,
            float(scale) * math.log2(math.e),
        )
        strides = (
            *query.stride(),
            *key_cache.stride(),
            *value_cache.stride(),
            *out.stride(),
            *block_tables.stride(),
        )
        # The next kernel (a product: engine/kernels/small_products.py) may start as attention's last
        # kernel does, and waits for its end before it reads the output.
        control = launch_control(query.device)
        if plan.heads_per_program > 1:
            num_groups = num_heads // plan.heads_per_program
            shared = batch.key_readers is not None
            decode_kernel[(batch.num_requests * num_groups * plan.num_splits,)](
                *tensors[:10],
                batch.key_readers if shared else batch.seq_lens,  # the latter unread
                *tensors[10:],
                num_heads,
                num_groups,
                plan.keys_per_split,
                *strides,
                HEAD_DIM=head_dim,
                HEADS=plan.heads_per_program,
                PAGE_SIZE=page_size,
                BLOCK_N=plan.block_n,
                DOT_DTYPE=dot_dtype,
                DOT_PRECISION=dot_precision,
                NUM_SPLITS=plan.num_splits,
                CLAMP_Q=clamp_q,
                SHARED=shared,
                EARLY_TILE=batch.num_requests <= EARLY_TILE_MAX_REQUESTS,
                NEWEST_KEY_IS_INPUT=bool(batch.causal),
                LAUNCH_CONTROL=control,
                num_warps=plan.num_warps,
                **early_launch(control),  # each waits before it reads the query (and the newest key)
                num_stages=plan.num_stages,
            )
        else:
            grid = (batch.num_requests * plan.num_q_tiles * num_heads * plan.num_splits,)
            attn_kernel[grid](
                *tensors,
                num_heads,
                plan.num_q_tiles,
                plan.keys_per_split,
                *strides,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                PAGE_SIZE=page_size,
                BLOCK_M=plan.block_m,
                BLOCK_N=plan.block_n,
                CAUSAL=bool(batch.causal),
                DOT_DTYPE=dot_dtype,
                DOT_PRECISION=dot_precision,
                NUM_SPLITS=plan.num_splits,
                CLAMP_Q=clamp_q,
                num_warps=plan.num_warps,
                num_stages=plan.num_stages,
            )
        if plan.num_splits > 1:
            combine_kernel[(num_tokens, num_heads)](
                out,
                part_acc,
                part_m,
                part_l,
                num_heads,
                *out.stride(),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=_next_pow2(head_dim),
                NUM_SPLITS=plan.num_splits,
                SPLITS_PAD=max(2, _next_pow2(plan.num_splits)),
                LAUNCH_CONTROL=control,
                num_warps=1 if head_dim <= 64 else 2,
                **early_launch(control),  # each waits first thing
            )
        return out
