"""The decoder's matrix products at a decode step's few rows: one Triton kernel each that loads its
weights before it waits for the kernel ahead of it.

At batch 1 cuBLAS pays a fixed cost on each of a step's many products however few its bytes (the
launch, the first reads' latency and the tail, one after another): far more than the bytes' time at
the GPU's bandwidth. Here each program holds ``BLOCK_N`` whole weight rows in registers. Launched
with programmatic dependent launch (Hopper and later; Triton's ``launch_pdl``), a kernel may start
while the one before it still runs, as soon as that one lets it
(``gdc_launch_dependents``, first thing in these kernels, the fused residual norm's and attention's
decode kernels): it loads its weights and bias, then ``gdc_wait`` holds it until the kernel before
has finished and its output is visible, and only then reads its input rows. So the weights' reads
overlap the previous kernel instead of following it. Nothing is written before the wait, and
nothing but weights read, so the order of results is the stream's, in or out of a CUDA graph.

The self-attention QKV product stores its keys and values straight into their cache slots
(``KVSlots``): otherwise an indexed write, one more kernel a layer, and not one of ours, so the
attention kernel after it could not start early either.

One kernel, two ways by the rows (at most ``engine.gpu.small_rows_products``):
- up to ``CUDA_CORE_ROWS``, each program sums each row's products on CUDA cores from its registers;
- up to ``TILE_ROWS``, each program multiplies its 32 weight rows by the input rows, padded to a
  16-row tile, on tensor cores. Whole weight rows wider than ``TILE_MAX_IN`` (fc2's 5120 in
  large-v3) would not fit a program's registers: such an input is split in parts, a program each,
  and the last program of a tile of outputs to finish adds the parts' sums up (counted in with an
  atomic add), so the product is still one kernel.
fc1's GELU (the exact form, as the decoder's unfused path) is applied before the store.

At one row, a product after a layer norm (QKV, cross-attention's query, fc1) also does the residual
add and the norm before it (``triton_add_norm_linear``, ``FoldedNorm``): one kernel a sublayer fewer
in a step's chain; past one row the tile program had no registers to spare for it.
JIT-decorated on first use, so Triton's CPU interpreter can run them in tests (without the launch
control, which the interpreter lacks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import early_launch, launch_control, tl, triton, triton_available

# Weight elements one program holds in registers (~40 KB in 16 bits): enough rows of the product
# to keep a kernel's programs few, few enough to stay in registers beside the rows' sums.
_ELEMENTS_PER_PROGRAM = 20480
_MIN_PROGRAMS = 64  # below this a product's programs leave most of a large GPU's SMs idle
# Up to this many rows, sums on CUDA cores; beyond, the tensor-core tile. At two rows the tile's
# products make a decode step faster than the CUDA cores'.
CUDA_CORE_ROWS = 1
TILE_ROWS = 16  # tl.dot's least tile height: the input rows padded to it
TILE_MAX_IN = 2048  # the widest input whose 32 whole weight rows a tile program holds
# A wider input (fc2's 5120 in large-v3) is split in parts of this width, a program each, whose sums
# the last program of a tile of outputs adds up.
_SPLIT_WIDTH = 1024
_TILE_OUTS = 32


@dataclass(frozen=True)
class FoldedNorm:
    """A layer norm (weight g, bias beta) folded into the product after it, weight w [out, in] and
    bias b: g, g @ w and b + beta @ w, the last two in float32, made once (``of``)."""

    weight: torch.Tensor  # g [in]
    weight_sums: torch.Tensor  # [out]
    bias: torch.Tensor  # [out]
    eps: float

    @classmethod
    def of(cls, norm: torch.nn.LayerNorm, linear: torch.nn.Linear) -> FoldedNorm:
        with torch.no_grad():
            weight = linear.weight.float()
            bias = weight @ norm.bias.float()
            if linear.bias is not None:
                bias += linear.bias.float()
            return cls(norm.weight, weight @ norm.weight.float(), bias, norm.eps)


@dataclass(frozen=True)
class KVSlots:
    """Where a QKV product's keys and values go: one layer's cache [num_blocks, 2 (k|v), block_size,
    H, D] (a strided view, heads and dimensions contiguous), and each row's block and offset there."""

    cache: torch.Tensor
    block_ids: torch.Tensor  # [rows]
    offsets: torch.Tensor  # [rows]


if triton_available():
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _add_pairs(a_sum, a_squares, b_sum, b_squares):
        return a_sum + b_sum, a_squares + b_squares

    def _small_rows_kernel(
        X,
        W,
        BIAS,
        Y,
        CACHE,
        SLOT_BLOCKS,
        SLOT_OFFSETS,
        PARTIALS,
        ARRIVALS,
        DELTA,
        NORM_W,
        NORM_SUMS,
        SUM,
        rows,
        n_out,
        stride_x,
        stride_y,
        stride_block,
        stride_kv,
        stride_slot,
        stride_delta,
        stride_sum,
        eps,
        K_HIGH: tl.constexpr,
        K_LOW: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILE: tl.constexpr,  # 0: each row's sums on CUDA cores; else the rows padded to this tile height
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
        STORE_KV: tl.constexpr,  # a QKV product: queries to Y, keys and values to their cache slots
        SPLITS: tl.constexpr,  # tile only: the input's width is SPLITS x (K_HIGH + K_LOW), a program each
        NORM: tl.constexpr,  # CUDA cores only: the input is layer_norm(X + DELTA), X + DELTA stored in SUM
        LAUNCH_CONTROL: tl.constexpr,
    ):
        if LAUNCH_CONTROL:
            gdc_launch_dependents()
        outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = outs < n_out
        # The input dimension as two powers of two (1280 = 1024 + 256), each a block of its own; with
        # SPLITS, this program's part of it.
        split = tl.program_id(1)
        part_start = split * (K_HIGH + K_LOW)
        high = tl.arange(0, K_HIGH)
        row_start = W + outs[:, None].to(tl.int64) * ((K_HIGH + K_LOW) * SPLITS) + part_start
        w_high = tl.load(row_start + high[None, :], mask=valid[:, None], other=0.0)
        if TILE == 0:
            w_high = w_high.to(tl.float32)
        if K_LOW > 0:
            low = K_HIGH + tl.arange(0, K_LOW)
            w_low = tl.load(row_start + low[None, :], mask=valid[:, None], other=0.0)
            if TILE == 0:
                w_low = w_low.to(tl.float32)
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + outs, mask=valid, other=0.0).to(tl.float32)
        if NORM:
            # With s the row, m its mean and r its reciprocal deviation, layer_norm(s) @ w =
            # r * ((g * s) @ w - m * (g @ w)) + beta @ w: the row's statistics are summed beside its
            # products, not before them. g @ w (NORM_SUMS) and beta @ w (in BIAS) come made
            # (``FoldedNorm``): made here, or the weights scaled by g, they take twice the registers.
            g_high = tl.load(NORM_W + high).to(tl.float32)
            if K_LOW > 0:
                g_low = tl.load(NORM_W + low).to(tl.float32)
            weight_sums = tl.load(NORM_SUMS + outs, mask=valid, other=0.0)
        # With STORE_KV: outputs past the queries' ``stride_y`` go to key (0) or value (1) ``kv``'s
        # cache, at column ``within`` of a row's slot.
        to_y = valid
        if STORE_KV:
            to_y = valid & (outs < stride_y)
            kv = (outs // stride_y - 1).to(tl.int64) * stride_kv
            within = outs % stride_y
        if LAUNCH_CONTROL:
            gdc_wait()  # the kernel before has finished: its output, this kernel's input, is there
        if TILE == 0:
            for row in range(rows):
                x_high = tl.load(X + row * stride_x + high)
                if NORM:
                    # The residual sum rounded to the stream's dtype, as the unfused add leaves it.
                    x_high = (x_high + tl.load(DELTA + row * stride_delta + high)).to(SUM.dtype.element_ty)
                    if tl.program_id(0) == 0:
                        tl.store(SUM + row * stride_sum + high, x_high)
                    x_high = x_high.to(tl.float32)
                    row_sum, row_squares = tl.reduce((x_high, x_high * x_high), 0, _add_pairs)
                    x_high = x_high * g_high
                total = tl.sum(w_high * x_high.to(tl.float32)[None, :], axis=1)
                if K_LOW > 0:
                    x_low = tl.load(X + row * stride_x + low)
                    if NORM:
                        x_low = (x_low + tl.load(DELTA + row * stride_delta + low)).to(SUM.dtype.element_ty)
                        if tl.program_id(0) == 0:
                            tl.store(SUM + row * stride_sum + low, x_low)
                        x_low = x_low.to(tl.float32)
                        low_sum, low_squares = tl.reduce((x_low, x_low * x_low), 0, _add_pairs)
                        row_sum += low_sum
                        row_squares += low_squares
                        x_low = x_low * g_low
                    total += tl.sum(w_low * x_low.to(tl.float32)[None, :], axis=1)
                if NORM:
                    mean = row_sum / (K_HIGH + K_LOW)
                    variance = tl.maximum(row_squares / (K_HIGH + K_LOW) - mean * mean, 0.0)
                    total = (total - mean * weight_sums) / tl.sqrt(variance + eps)
                total += bias
                if GELU:
                    total = 0.5 * total * (1.0 + tl.math.erf(total * 0.7071067811865476))
                tl.store(Y + row * stride_y + outs, total.to(Y.dtype.element_ty), mask=to_y)
                if STORE_KV:
                    block = tl.load(SLOT_BLOCKS + row).to(tl.int64)
                    offset = tl.load(SLOT_OFFSETS + row).to(tl.int64)
                    cached = CACHE + block * stride_block + offset * stride_slot + kv + within
                    tl.store(cached, total.to(CACHE.dtype.element_ty), mask=valid & ~to_y)
        else:
            tile_rows = tl.arange(0, TILE)
            present = tile_rows < rows
            x_start = X + tile_rows[:, None] * stride_x + part_start
            # "ieee": float32 operands multiply in float32, not TF32 (16-bit ones are unaffected).
            x_high = tl.load(x_start + high[None, :], mask=present[:, None], other=0.0)
            total = tl.dot(x_high, tl.trans(w_high), input_precision="ieee")
            if K_LOW > 0:
                x_low = tl.load(x_start + low[None, :], mask=present[:, None], other=0.0)
                total += tl.dot(x_low, tl.trans(w_low), input_precision="ieee")
            if SPLITS > 1:
                # Each program leaves its part's sums in PARTIALS and counts itself in; the last of
                # these outputs' programs to arrive adds all parts up and stores, then resets the count.
                partials = PARTIALS + tile_rows[:, None] * n_out + outs[None, :]
                part_mask = present[:, None] & valid[None, :]
                tl.store(partials + split * (TILE * n_out), total, mask=part_mask)
                tl.debug_barrier()  # every thread's stores issued before the count releases them
                arrived = tl.atomic_add(ARRIVALS + tl.program_id(0), 1, sem="acq_rel")
                last = (arrived + tl.zeros([TILE], dtype=tl.int32)) == SPLITS - 1  # per tile row
                present = present & last
                total = tl.zeros([TILE, BLOCK_N], dtype=tl.float32)
                for other in tl.static_range(SPLITS):
                    part = partials + other * (TILE * n_out)
                    total += tl.load(part, mask=part_mask & last[:, None], other=0.0, cache_modifier=".cg")
                if arrived == SPLITS - 1:
                    tl.atomic_xchg(ARRIVALS + tl.program_id(0), 0)
            total += bias[None, :]
            if GELU:
                total = 0.5 * total * (1.0 + tl.math.erf(total * 0.7071067811865476))
            y = Y + tile_rows[:, None] * stride_y + outs[None, :]
            tl.store(y, total.to(Y.dtype.element_ty), mask=present[:, None] & to_y[None, :])
            if STORE_KV:
                blocks = tl.load(SLOT_BLOCKS + tile_rows, mask=present, other=0).to(tl.int64)
                offsets = tl.load(SLOT_OFFSETS + tile_rows, mask=present, other=0).to(tl.int64)
                slots = blocks[:, None] * stride_block + offsets[:, None] * stride_slot
                cached = CACHE + slots + kv[None, :] + within[None, :]
                kept = present[:, None] & (valid & ~to_y)[None, :]
                tl.store(cached, total.to(CACHE.dtype.element_ty), mask=kept)


_JITTED: dict[str, object] = {}
_ARRIVALS: dict[torch.device, torch.Tensor] = {}  # per device, zeros between products (see _arrivals)
_MOST_OUT_TILES = 4096


def _split_in_two_powers(k: int) -> tuple[int, int] | None:
    """``k`` as high + low, each a power of two (low may be 0), or None where it is not."""
    high = 1 << (k.bit_length() - 1)
    low = k - high
    return (high, low) if low == 0 or low & (low - 1) == 0 else None


def _input_parts(rows: int, k: int) -> tuple[int, int, int] | None:
    """How a program takes an input ``k`` wide at ``rows`` rows: (parts, high, low), each part
    ``high + low`` wide with both powers of two (low may be 0); None where no way fits. Past
    ``CUDA_CORE_ROWS`` rows an input wider than ``TILE_MAX_IN`` is split in parts of ``_SPLIT_WIDTH``."""
    splits = k // _SPLIT_WIDTH if rows > CUDA_CORE_ROWS and k > TILE_MAX_IN else 1
    if splits > 1 and k % _SPLIT_WIDTH:
        return None
    widths = _split_in_two_powers(k // splits)
    return (splits, *widths) if widths is not None else None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a kernel here takes this product: rows with a unit last stride, a row-major [out, in]
    weight, at most ``TILE_ROWS`` rows, and an input ``_input_parts`` has a way for (a split one at
    most ``_MOST_OUT_TILES`` tiles of outputs wide, its parts' counters)."""
    if not triton_available() or x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
        return False
    rows, k = x.shape
    parts = _input_parts(rows, k) if rows <= TILE_ROWS else None
    return parts is not None and (parts[0] == 1 or weight.shape[0] <= _MOST_OUT_TILES * _TILE_OUTS)


def _arrivals(device: torch.device) -> torch.Tensor:
    """The counters a split product's programs count themselves in with, one per tile of outputs;
    each product's last program resets its own, so they are zeros between products. Made once per
    device, outside any CUDA graph (the decode graphs' warm-up step runs first): a graph replays
    with it at the same address. One stream at a time, as a decoder's steps run."""
    if device not in _ARRIVALS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run a split small-rows product once before capturing it in a CUDA graph")
        _ARRIVALS[device] = torch.zeros(_MOST_OUT_TILES, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def stores_kv(x: torch.Tensor, slots: KVSlots) -> bool:
    """Whether the kernel can store a QKV product of ``x``'s rows into ``slots``' cache: the cache in
    the rows' dtype (into fp8 the dense path's saturating cast, ``engine.kv.storage.to_cache_dtype``),
    heads and their dimensions contiguous."""
    cache = slots.cache
    return cache.dtype == x.dtype and cache.stride(-1) == 1 and cache.stride(-2) == cache.shape[-1]


def folds_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes a product of ``layer_norm(x + delta)`` whole (``triton_add_norm_linear``):
    one a CUDA-core program sums, whose rows are contiguous."""
    return (
        x.shape[0] <= CUDA_CORE_ROWS and x.is_contiguous() and delta.is_contiguous() and supports(x, weight)
    )


def triton_small_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gelu: bool = False,
    slots: KVSlots | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (then the exact GELU where asked), x [rows, in], weight [out, in]; a
    product ``supports`` takes. With ``slots`` (a QKV product, ``stores_kv``), only the queries
    [rows, out / 3] come back, the keys and values going to their rows' cache slots."""
    return _launch(x, weight, bias, gelu, slots, None)


def triton_add_norm_linear(
    x: torch.Tensor,
    delta: torch.Tensor,
    norm: FoldedNorm,
    weight: torch.Tensor,
    gelu: bool = False,
    slots: KVSlots | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.model.sublayers.add_layer_norm`` and ``triton_small_rows_linear`` after it as one
    kernel, where ``folds_norm``: (x + delta, the product of layer_norm(x + delta), its bias in
    ``norm``). The sum is stored by one program; every program takes the row's statistics itself."""
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return total, _launch(x, weight, norm.bias, gelu, slots, (delta, norm, total))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gelu: bool,
    slots: KVSlots | None,
    folded: tuple[torch.Tensor, FoldedNorm, torch.Tensor] | None,
) -> torch.Tensor:
    if "kernel" not in _JITTED:
        _JITTED["kernel"] = triton.jit(_small_rows_kernel)
    rows, k = x.shape
    n_out = weight.shape[0]
    splits, high, low = _input_parts(rows, k)
    out = torch.empty((rows, n_out // 3 if slots is not None else n_out), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if rows <= CUDA_CORE_ROWS:
        fewest = min(_ELEMENTS_PER_PROGRAM // k, max(1, n_out // _MIN_PROGRAMS))
        block_n = 1 << max(0, fewest.bit_length() - 1)
        shape = {"TILE": 0, "num_warps": 8 if block_n * k >= 16384 else 4}
    else:
        if folded is not None:
            raise ValueError(f"a layer norm folds into products of at most {CUDA_CORE_ROWS} rows, not {rows}")
        block_n, shape = _TILE_OUTS, {"TILE": TILE_ROWS, "num_warps": 4}
    cache = slots.cache if slots is not None else out
    partials = (
        torch.empty((splits, TILE_ROWS, n_out), dtype=torch.float32, device=x.device) if splits > 1 else out
    )
    delta, norm, total = folded if folded is not None else (x, FoldedNorm(x, x, x, 0.0), x)
    control = launch_control(x.device)
    _JITTED["kernel"][(triton.cdiv(n_out, block_n), splits)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        cache,
        slots.block_ids if slots is not None else out,
        slots.offsets if slots is not None else out,
        partials,
        _arrivals(x.device) if splits > 1 else out,
        delta,
        norm.weight,
        norm.weight_sums,
        total,
        rows,
        n_out,
        x.stride(0),
        out.stride(0),
        *(cache.stride()[:3] if slots is not None else (0, 0, 0)),
        delta.stride(0),
        total.stride(0),
        norm.eps,
        K_HIGH=high,
        K_LOW=low,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        GELU=gelu,
        STORE_KV=slots is not None,
        SPLITS=splits,
        NORM=folded is not None,
        LAUNCH_CONTROL=control,
        **shape,
        **early_launch(control),
    )
    return out
