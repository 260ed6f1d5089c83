"""Paged attention in Triton: reads K/V blocks in place through the block table.

Design (flash-decoding style):

* One program per (request, query tile, head, key split), heads varying fastest. Query tiles are
  ``BLOCK_M`` packed query rows of one request; key splits cut a request's visible key range into
  chunks of ``keys_per_split`` keys (a multiple of ``BLOCK_N``), so that a decode step with few
  requests still puts enough programs on the GPU (split-K). Each program walks its key range in tiles of
  ``BLOCK_N`` keys, looking up each key's physical block (``block_tables[req, key // page]``)
  and slot (``key % page``), so any power-of-two page size works, including pages smaller or
  larger than ``BLOCK_N``. Keys past the request's length (partly filled last block, padding
  entries of the block table) are masked loads and never touch memory.
* Online softmax in fp32 (base-2 exponent, the softmax scale folded into log2(e)).
* Scores and the weighted sum go through ``tl.dot`` on ``BLOCK_M x BLOCK_N`` tiles (tensor cores),
  skipping key tiles above the causal diagonal. A decode step (every request has ``q_len == 1``)
  still uses a 16-row tile with one valid row: the step is memory-bound, so the wasted rows cost
  no bandwidth, and the padded MMA streams the K/V close to a plain read's rate, as fast as or
  faster than a one-row multiply-and-reduce or prefetching the next tile into registers by hand.
  Decode tiles are small (32 keys) with a deep load pipeline (4 stages), the fastest of the sizes
  tried.
* An fp8 (e4m3) cache is upcast to fp16, not bf16, as it is loaded: e4m3 -> fp16 is one hardware
  conversion per pair of values, and fp16 holds every e4m3 value exactly. The bf16 query is
  saturated to fp16's range. Decode tiles are 128 keys over 3 stages (the same bytes per tile as 64
  bf16 keys). Read this way an fp8 layer is faster than upcasting it to bf16, and faster than a
  bf16 cache, which has twice the bytes.
* A decode step over a cache whose head_dim is a power of two runs a second kernel, grouped
  decode (engine/attention/triton_decode_kernel.py): one program per (request, group of adjacent
  heads, split) reads each key tile as one row of all the group's heads side by side (a contiguous
  run of memory per key) and enters the query into the MMA block-diagonally, so the scores come out
  one row per head and the padded 16-row tile's softmax work serves several heads. The tile's
  spare rows hold the other beams of a window that share its cross-attention table, so one pass
  over the keys serves them all. Two heads per program (128 keys per tile for
  fp8) read a layer faster than one head per program, clearly for fp8 at large batches and
  slightly for bf16; four heads per program (256 columns) was slower than one.
* With more than one split the programs write unnormalised partials (running max ``m``, running
  sum ``l`` and accumulator) to fp32 scratch, and a second kernel merges them per (token, head).
  With one split the first kernel normalises and writes the output directly.

All strides of query and caches are kernel arguments, so the per-layer views
``cache[:, layer, 0]`` (block stride ``n_layers * 2 * block_size * H * D``) are read in place.

Kernels are JIT-decorated lazily, on first use, so ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, read when a function is decorated) only has to be set before the first call, not
before this module is imported. Importing this module never fails when Triton is absent.
"""

from __future__ import annotations

from engine.kernels import tl, triton

MAX_HEAD_DIM = 256


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    def _paged_attention_kernel(
        Q,
        K,
        V,
        OUT,
        PART_ACC,
        PART_M,
        PART_L,
        QUERY_START,
        SEQ_LENS,
        BLOCK_TABLES,
        scale_log2,
        num_heads,
        num_q_tiles,
        keys_per_split,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_btb,
        stride_btm,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        CLAMP_Q: tl.constexpr,
    ):
        # One flat grid, heads fastest: the programs running at once read the same requests'
        # blocks, all heads of each key slot, rather than one head of many requests' blocks.
        flat = tl.program_id(0)
        head = flat % num_heads
        split = (flat // num_heads) % NUM_SPLITS
        pid = flat // (num_heads * NUM_SPLITS)
        req = pid // num_q_tiles
        tile = pid % num_q_tiles

        q_start = tl.load(QUERY_START + req)
        q_len = tl.load(QUERY_START + req + 1) - q_start
        if tile * BLOCK_M >= q_len:
            return
        seq_len = tl.load(SEQ_LENS + req)

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < q_len
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_valid = offs_d < HEAD_DIM
        tok = (q_start + offs_m).to(tl.int64)

        # Masks only along dimensions that can be ragged. A mask over head_dim when head_dim is
        # already a power of two would still be evaluated per element, and per-element masks stop
        # Triton from vectorising the loads along the contiguous head_dim, which costs the
        # memory-bound decode step much of its bandwidth.
        if HEAD_DIM == HEAD_DIM_PAD:
            q_mask = m_valid[:, None]
        else:
            q_mask = m_valid[:, None] & d_valid[None, :]
        q = tl.load(
            Q + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
            mask=q_mask,
            other=0.0,
        )
        if CLAMP_Q:
            # A bf16 query computed in fp16 (fp8 cache): saturate rather than overflow to inf.
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
        q = q.to(DOT_DTYPE)

        if CAUSAL:
            # query row m sits at key position seq_len - q_len + m and sees keys <= that.
            q_pos = seq_len - q_len + offs_m
            last_row = tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
            kv_end = seq_len - q_len + last_row + 1
        else:
            kv_end = seq_len
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        table_row = BLOCK_TABLES + req.to(tl.int64) * stride_btb
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < split_end
            block_id = tl.load(table_row + (offs_n // PAGE_SIZE) * stride_btm, mask=n_valid, other=0).to(
                tl.int64
            )
            slot = offs_n % PAGE_SIZE
            if HEAD_DIM == HEAD_DIM_PAD:
                kv_mask = n_valid[:, None]
            else:
                kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(
                K
                + block_id[:, None] * stride_kb
                + slot[:, None] * stride_ks
                + head * stride_kh
                + offs_d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                V
                + block_id[:, None] * stride_vb
                + slot[:, None] * stride_vs
                + head * stride_vh
                + offs_d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            s = s * scale_log2
            keep = n_valid[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # rows with no visible key yet keep m == -inf; exponentiate against 0 so that
            # exp2(-inf - (-inf)) never produces NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out_mask = q_mask
        if NUM_SPLITS == 1:
            denom = tl.where(l_i > 0.0, l_i, 1.0)
            out = acc / denom[:, None]
            tl.store(
                OUT + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
                out.to(OUT.dtype.element_ty),
                mask=out_mask,
            )
        else:
            part = (tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] row of [T, H, S]
            tl.store(PART_M + part, m_i, mask=m_valid)
            tl.store(PART_L + part, l_i, mask=m_valid)
            tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)

    def _combine_splits_kernel(
        OUT,
        PART_ACC,
        PART_M,
        PART_L,
        num_heads,
        stride_ot,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        LAUNCH_CONTROL: tl.constexpr,
    ):
        if LAUNCH_CONTROL:
            gdc_launch_dependents()  # the product after attention loads its weights meanwhile
            gdc_wait()  # launched early itself: the split kernel before it has ended
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        s_valid = offs_s < NUM_SPLITS
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_valid = offs_d < HEAD_DIM
        part = (tok * num_heads + head) * NUM_SPLITS + offs_s

        m = tl.load(PART_M + part, mask=s_valid, other=float("-inf"))
        sums = tl.load(PART_L + part, mask=s_valid, other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_max)  # empty splits (m == -inf) weigh 0
        acc = tl.load(
            PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        num = tl.sum(acc * w[:, None], axis=0)
        den = tl.sum(sums * w, axis=0)
        den = tl.where(den > 0.0, den, 1.0)
        tl.store(
            OUT + tok * stride_ot + head * stride_oh + offs_d * stride_od,
            (num / den).to(OUT.dtype.element_ty),
            mask=d_valid,
        )


_JITTED: dict[str, object] = {}


def kernels():
    """JIT-decorate on first use (TRITON_INTERPRET is read at decoration time)."""
    if not _JITTED:
        _JITTED["attn"] = triton.jit(_paged_attention_kernel)
        from engine.attention.triton_decode_kernel import paged_decode_kernel

        _JITTED["decode"] = triton.jit(paged_decode_kernel)
        _JITTED["combine"] = triton.jit(_combine_splits_kernel)
    return _JITTED["attn"], _JITTED["decode"], _JITTED["combine"]
