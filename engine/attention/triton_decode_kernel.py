"""The grouped-heads decode kernel of the Triton paged-attention backend (the design is in
engine/attention/triton_kernels.py's docstring): one query per request, several heads per program,
and with ``SHARED`` the queries of a window's beams, which read one cross-attention table, served by
one pass over its keys. JIT-decorated by ``triton_kernels.kernels()`` on first use."""

from __future__ import annotations

from engine.kernels import tl, triton

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _key_tile(
        K,
        V,
        table_row,
        k_cols,
        v_cols,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        stride_btm,
        start_n,
        first,
        end,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The tile of keys and values from ``start_n``, [BLOCK_N, WIDTH] each, holding those in
        [``first``, ``end``) and zeros elsewhere, and which those are."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = (offs_n >= first) & (offs_n < end)
        block_id = tl.load(table_row + (offs_n // PAGE_SIZE) * stride_btm, mask=n_valid, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k = tl.load(
            K + (block_id * stride_kb + slot * stride_ks)[:, None] + k_cols[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            V + (block_id * stride_vb + slot * stride_vs)[:, None] + v_cols[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )
        return k, v, n_valid

    @triton.jit
    def _attend_tile(
        q, k, v, n_valid, m_i, l_i, acc, scale_log2, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr
    ):
        """One key tile into the online softmax's running max, sum and weighted values."""
        s = (
            tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        )  # [ROWS, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [ROWS, WIDTH]
        return m_new, l_i, acc * alpha[:, None] + pv

    def paged_decode_kernel(
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
        KEY_READERS,
        scale_log2,
        num_heads,
        num_groups,
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
        HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        CLAMP_Q: tl.constexpr,
        SHARED: tl.constexpr,
        EARLY_TILE: tl.constexpr,
        NEWEST_KEY_IS_INPUT: tl.constexpr,
        LAUNCH_CONTROL: tl.constexpr,
    ):
        """A decode step (one query per request): one program per (request, group of HEADS
        adjacent heads, key split). Each key tile is loaded as [BLOCK_N, HEADS * HEAD_DIM], the
        group's heads side by side, so a row is one contiguous run of memory; the query enters
        the MMA block-diagonally (row h holds head h's query in head h's columns, zeros
        elsewhere), so the scores come out as one row per head and the softmax bookkeeping of
        the padded 16-row tile serves HEADS heads instead of one. The P @ V product's diagonal
        blocks are the heads' outputs.

        SHARED (cross-attention of a window's beams, which read one table): KEY_READERS[req] rows
        from ``req`` on read ``req``'s keys, and its program serves them all, reader r's heads in
        tile rows r * HEADS onwards, so each key tile is read once for all of them; a row whose
        keys an earlier row's program reads (KEY_READERS 0) does nothing.

        EARLY_TILE (a step of few requests): with LAUNCH_CONTROL a program reads its first key tile
        before ``gdc_wait``, beside the kernel before it, as the products load their weights. The
        keys and values were written before this step began, by kernels not launched early, all but
        self-attention's newest (NEWEST_KEY_IS_INPUT): the QKV product just before writes it, and it
        is read after the wait, with the query."""
        if LAUNCH_CONTROL:
            gdc_launch_dependents()  # the product after attention loads its weights meanwhile
            if not EARLY_TILE:
                gdc_wait()  # launched early itself: the kernel before (the query's) has ended
        ROWS: tl.constexpr = 16  # tl.dot's least M; rows past the readers' heads hold a zero query
        WIDTH: tl.constexpr = HEADS * HEAD_DIM
        flat = tl.program_id(0)
        group = flat % num_groups
        split = (flat // num_groups) % NUM_SPLITS
        req = flat // (num_groups * NUM_SPLITS)
        tok = tl.load(QUERY_START + req).to(tl.int64)
        seq_len = tl.load(SEQ_LENS + req)

        offs_r = tl.arange(0, ROWS)
        offs_c = tl.arange(0, WIDTH)
        col_head = group * HEADS + offs_c // HEAD_DIM  # the head each column belongs to
        col_d = offs_c % HEAD_DIM
        k_cols = col_head * stride_kh + col_d * stride_kd
        v_cols = col_head * stride_vh + col_d * stride_vd
        split_start = split * keys_per_split
        split_end = tl.minimum(split_start + keys_per_split, seq_len)
        if SHARED:
            readers = tl.load(KEY_READERS + req)
            split_end = tl.where(readers > 0, split_end, split_start)  # read for it by another program
        table_row = BLOCK_TABLES + req.to(tl.int64) * stride_btb
        if EARLY_TILE:
            # The first tile before the wait, but for self-attention's newest key, which the kernel
            # before (the QKV product) writes: read after it, with the query.
            newest = seq_len
            if NEWEST_KEY_IS_INPUT:
                newest = seq_len - 1
            k, v, n_valid = _key_tile(
                K, V, table_row, k_cols, v_cols, stride_kb, stride_ks, stride_vb, stride_vs, stride_btm,
                split_start, split_start, tl.minimum(split_end, newest), PAGE_SIZE, BLOCK_N,
            )  # fmt: skip
            if LAUNCH_CONTROL:
                gdc_wait()
            if NEWEST_KEY_IS_INPUT:
                k_new, v_new, is_new = _key_tile(
                    K, V, table_row, k_cols, v_cols, stride_kb, stride_ks, stride_vb, stride_vs, stride_btm,
                    split_start, newest, split_end, PAGE_SIZE, BLOCK_N,
                )  # fmt: skip
                k = tl.where(is_new[:, None], k_new, k)
                v = tl.where(is_new[:, None], v_new, v)
                n_valid = n_valid | is_new

        if SHARED:
            reader = offs_r // HEADS
            row_live = reader < readers
            row_head = group * HEADS + offs_r % HEADS
            row_tok = tok + reader  # one query per request: the readers' queries follow req's
            diagonal = (row_head[:, None] == col_head[None, :]) & row_live[:, None]  # [ROWS, WIDTH]
            q = tl.load(
                Q + row_tok[:, None] * stride_qt + col_head[None, :] * stride_qh + col_d[None, :] * stride_qd,
                mask=diagonal,
                other=0.0,
            )
            if CLAMP_Q:
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
            q = q.to(DOT_DTYPE)
        else:
            diagonal = (group * HEADS + offs_r)[:, None] == col_head[None, :]  # [ROWS, WIDTH]
            q = tl.load(Q + tok * stride_qt + col_head * stride_qh + col_d * stride_qd)
            if CLAMP_Q:
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
            q = tl.where(diagonal, q.to(DOT_DTYPE)[None, :], 0.0).to(DOT_DTYPE)

        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, WIDTH], dtype=tl.float32)
        first_in_loop = split_start
        if EARLY_TILE:  # (a split past the keys' end has none valid: it leaves the sums as they are)
            m_i, l_i, acc = _attend_tile(
                q, k, v, n_valid, m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION
            )
            first_in_loop = split_start + BLOCK_N
        for start_n in range(first_in_loop, split_end, BLOCK_N):
            k, v, n_valid = _key_tile(
                K, V, table_row, k_cols, v_cols, stride_kb, stride_ks, stride_vb, stride_vs, stride_btm,
                start_n, start_n, split_end, PAGE_SIZE, BLOCK_N,
            )  # fmt: skip
            m_i, l_i, acc = _attend_tile(
                q, k, v, n_valid, m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION
            )

        if SHARED and NUM_SPLITS == 1:
            denom = tl.where(l_i > 0.0, l_i, 1.0)
            tl.store(
                OUT
                + row_tok[:, None] * stride_ot
                + col_head[None, :] * stride_oh
                + col_d[None, :] * stride_od,
                (acc / denom[:, None]).to(OUT.dtype.element_ty),
                mask=diagonal,
            )
        elif SHARED:
            row_part = (row_tok * num_heads + row_head) * NUM_SPLITS + split
            tl.store(PART_M + row_part, m_i, mask=row_live)
            tl.store(PART_L + row_part, l_i, mask=row_live)
            col_part = (row_tok[:, None] * num_heads + col_head[None, :]) * NUM_SPLITS + split
            tl.store(PART_ACC + col_part * HEAD_DIM + col_d[None, :], acc, mask=diagonal)
        elif NUM_SPLITS == 1:
            denom = tl.where(l_i > 0.0, l_i, 1.0)
            out = tl.sum(tl.where(diagonal, acc / denom[:, None], 0.0), axis=0)  # [WIDTH]
            tl.store(
                OUT + tok * stride_ot + col_head * stride_oh + col_d * stride_od, out.to(OUT.dtype.element_ty)
            )
        else:
            row_part = (tok * num_heads + group * HEADS + offs_r) * NUM_SPLITS + split
            tl.store(PART_M + row_part, m_i, mask=offs_r < HEADS)
            tl.store(PART_L + row_part, l_i, mask=offs_r < HEADS)
            col_part = (tok * num_heads + col_head) * NUM_SPLITS + split
            tl.store(PART_ACC + col_part * HEAD_DIM + col_d, tl.sum(tl.where(diagonal, acc, 0.0), axis=0))
