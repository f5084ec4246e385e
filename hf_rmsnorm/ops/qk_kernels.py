"""Triton kernels of the query and key norms fused with the rotary position embedding (RoPE), forward and
backward: what an attention module of Qwen3, Gemma 3 or OLMo 2 computes between its q/k projections and its
attention call, in one launch for both tensors.

What they compute, per tensor (``qk.py`` states the public contract, ``reference.qk_norm_rope_reference`` the same
maths in PyTorch)::

    n   = norm(x)                     one of modes.py's casting orders, rounded to the norm's output dtype
    out = n * cos + rotate_half(n) * sin     over the first ROTARY_DIM columns of each head, each product and
                                             the sum rounded to the output dtype as eager rounds them
    out = n                                  over the rest of each head (partial rotary)

or, with ``ROPE_FIRST`` (NanoChat and HunYuan rotate their queries and keys, then normalise them), the rotation of
``x`` rounded to the RoPE's dtype, then the norm of that. The backward of the second order computes the rotated
rows again, runs the norm's backward on them, and applies the rotation's transpose last. ``NEGATE_SIN`` rotates by
the opposite angle, ``x * cos - rotate_half(x) * sin`` (NanoChat's ``rotate_half`` returns ``(x2, -x1)``): ``sin``
negated, which is exact, gives its products and sums bit for bit.

``rotate_half`` pairs column ``j`` of a head's rotary part with column ``j + ROTARY_DIM / 2``. The kernels
therefore hold a head's rotary part as two halves, ``x1`` (columns ``[0, half)``) and ``x2`` (``[half,
ROTARY_DIM)``), and its pass-through part ``xp`` (``[ROTARY_DIM, HEAD_DIM)``), each a ``[BLOCK_M, HEADS_BLOCK,
width]`` tile whose last axis is contiguous in memory: every element is loaded once, with wide loads, and the
rotation needs no shuffle (``out1 = n1 * cos1 - n2 * sin1``, ``out2 = n2 * cos2 + n1 * sin2``).

A norm row is one head (``PER_HEAD``: Qwen3's and Gemma 3's norms over ``head_dim``; ``HEADS_BLOCK`` is 1) or
every head of a token (OLMo 2's norms over the whole projection, before the view into heads; the heads are the
tile's middle axis). Each tensor is addressed as a ``[batch, tokens, heads, head_dim]`` view with its own strides
(unit last stride), as the projection produces it; ``cos`` and ``sin`` as ``[batch, tokens, ROTARY_DIM]``
(batch stride 0 where shared). One launch covers q and k: the forward's first programs take q's row blocks, the
rest k's; the backward's persistent programs each take both tensors' row blocks in turn and write one partial row
of each norm weight's gradient, summed by ``kernels.sum_partials_once_written`` in the same launch.

Memory traffic is the cost: the forward reads q and k and writes them once (8 bytes per bf16 element) plus
``cos``/``sin`` once per token and tensor (``ROTARY_DIM`` each: a head's or a whole row's read again from the
caches), the backward reads the output gradient and the input and writes the input gradient (12 bytes per bf16
element), with the same ``cos``/``sin`` reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import SYNC_SLOTS, STARTED, jit_unspecialised, sum_partials_once_written

# The dtype a value is rounded to, as a constexpr code (a norm's output dtype, which no pointer carries):
# fp32 (no rounding: the kernels compute in fp32), bf16, fp16.
ROUND_FP32 = tl.constexpr(0)
ROUND_BF16 = tl.constexpr(1)
ROUND_FP16 = tl.constexpr(2)


@triton.jit
def _rounded(v, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to the dtype of code ``ROUND``, held in fp32 again."""
    if ROUND == ROUND_BF16:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif ROUND == ROUND_FP16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _block_rows(block, n_rows, heads, tokens, PER_HEAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(rows, row_mask, b, t, head)`` of row block ``block``: the rows, which exist, and each row's batch, token
    and head index. A row is one head of one token (``PER_HEAD``: row ``r`` is head ``r % heads`` of token
    ``r // heads``), otherwise one token, whose heads lie along the tiles' middle axis (``head`` 0)."""
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if PER_HEAD:
        token = rows // heads
        head = rows % heads
    else:
        token = rows
        head = rows * 0
    return rows, rows < n_rows, token // tokens, token % tokens, head


@triton.jit
def _row_geometry(heads, HEAD_DIM: tl.constexpr, PER_HEAD: tl.constexpr):
    """``(heads_in_row, width)`` of a tensor of ``heads`` heads: a norm row's heads (1 per head) and its elements,
    the norm's width and its weight's."""
    if PER_HEAD:
        return 1, HEAD_DIM
    return heads, heads * HEAD_DIM


@triton.jit
def _tile_offsets(b, t, head, stride_b, stride_t, stride_h, first, BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    """Offsets of the ``[BLOCK_M, HEADS_BLOCK, BLOCK]`` tile of columns ``first ..`` of each head, in a ``[batch,
    tokens, heads, head_dim]`` tensor of these strides (unit last stride): the heads of the middle axis follow
    each row's own (a per-head row's middle axis is its one head)."""
    rows = b * stride_b + t * stride_t + head * stride_h
    heads = tl.arange(0, HEADS_BLOCK).to(tl.int64) * stride_h
    cols = first + tl.arange(0, BLOCK)
    return rows[:, None, None] + heads[None, :, None] + cols[None, None, :]


@triton.jit
def _tile_mask(row_mask, heads_in_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    """Which elements of a tile of ``_tile_offsets`` exist: rows that do, heads below ``heads_in_row``, the
    ``WIDTH`` columns of the piece."""
    heads = tl.arange(0, HEADS_BLOCK) < heads_in_row
    cols = tl.arange(0, BLOCK) < WIDTH
    return row_mask[:, None, None] & heads[None, :, None] & cols[None, None, :]


@triton.jit
def _trig_tile(TRIG, b, t, stride_b, stride_t, row_mask, first, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """A ``[BLOCK_M, 1, HALF_BLOCK]`` tile of ``cos`` or ``sin`` (fp32): columns ``first ..`` of each row's token,
    broadcast over its heads."""
    cols = tl.arange(0, HALF_BLOCK)
    offsets = (b * stride_b + t * stride_t)[:, None, None] + first + cols[None, None, :]
    mask = row_mask[:, None, None] & (cols < HALF)[None, None, :]
    return tl.load(TRIG + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _trig_halves(TRIG, b, t, stride_b, stride_t, row_mask, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                 NEGATE: tl.constexpr):
    """The two halves of ``cos`` or ``sin`` (``_trig_tile``), negated where ``NEGATE`` (exactly: the sign bit)."""
    first = _trig_tile(TRIG, b, t, stride_b, stride_t, row_mask, 0, HALF, HALF_BLOCK)
    second = _trig_tile(TRIG, b, t, stride_b, stride_t, row_mask, HALF, HALF, HALF_BLOCK)
    if NEGATE:
        first = -first
        second = -second
    return first, second


@triton.jit
def _weight_tile(W, heads_in_row, first, WIDTH: tl.constexpr, BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr):
    """A ``[1, HEADS_BLOCK, BLOCK]`` tile of the norm's weight in fp32, the family's offset added (Gemma's
    ``1 + w``): columns ``first ..`` of each head of the tiles' middle axis (head ``h``'s weight starts at
    ``h * HEAD_DIM``: a whole-projection norm's; a per-head norm's middle axis is head 0). Zeros without a weight
    (never read then)."""
    heads = tl.arange(0, HEADS_BLOCK)
    cols = first + tl.arange(0, BLOCK)
    mask = (heads < heads_in_row)[:, None] & (tl.arange(0, BLOCK) < WIDTH)[None, :]
    if HAS_WEIGHT:
        w = tl.load(W + heads[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:
            w = w + WEIGHT_OFFSET
    else:
        w = tl.zeros([HEADS_BLOCK, BLOCK], dtype=tl.float32)
    return w[None, :, :]


@triton.jit
def _normed(x, rstd, w, X_DTYPE: tl.constexpr, NORM_ROUND: tl.constexpr, HAS_WEIGHT: tl.constexpr,
            CAST_BEFORE_WEIGHT: tl.constexpr):
    """The norm's output: ``x * rstd`` scaled by the weight in the family's casting order (modes.py), rounded to
    the norm's output dtype (code ``NORM_ROUND``; without a weight, the input dtype), held in fp32."""
    n = x * rstd[:, None, None]
    if HAS_WEIGHT:
        if CAST_BEFORE_WEIGHT:
            n = n.to(X_DTYPE).to(tl.float32)  # Llama: rounded to the input dtype before the weight multiplies it
        n = n * w
    return _rounded(n, NORM_ROUND)


@triton.jit
def _rotated(n_a, n_b, cos, sin, sign, runtime_one, OUT_DTYPE: tl.constexpr):
    """``n_a * cos + sign * n_b * sin`` as eager computes ``q * cos + rotate_half(q) * sin`` in the output dtype:
    each product rounded, then their sum. ``runtime_one`` is an opaque 1.0 (see ``kernels._scale_and_store``):
    multiplying each rounded product by it keeps the compiler from fusing a product and the sum into one FMA,
    which would skip that product's rounding (in half precision, where a rounded fp32 product of half-precision
    values is a half-precision multiply, and in fp32)."""
    first = (n_a * cos).to(OUT_DTYPE).to(tl.float32) * runtime_one
    second = (n_b * sin).to(OUT_DTYPE).to(tl.float32) * runtime_one
    return (first + sign * second).to(OUT_DTYPE)


@jit_unspecialised
def qk_norm_rope_fwd_kernel(
    Q, K, QW, KW, COS, SIN, QOUT, KOUT, STATS,
    q_rows, k_rows, q_heads, k_heads, tokens,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_qob, stride_qot, stride_qoh, stride_kob, stride_kot, stride_koh,
    stride_cb, stride_ct, stride_sb, stride_st,
    q_eps, k_eps, store_stats,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PER_HEAD: tl.constexpr,
    HAS_Q_WEIGHT: tl.constexpr, HAS_K_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, Q_NORM_ROUND: tl.constexpr, K_NORM_ROUND: tl.constexpr,
    Q_BLOCK_M: tl.constexpr, K_BLOCK_M: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr, K_HEADS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROPE_FIRST: tl.constexpr = False,
    ROPE_IN_COS_DTYPE: tl.constexpr = False, NEGATE_SIN: tl.constexpr = False,
):
    """Normalises and rotates q's rows (programs ``[0, cdiv(q_rows, Q_BLOCK_M))``, ``Q_BLOCK_M`` rows each) and
    k's (the programs after). ``STATS`` (written only where ``store_stats``, a run-time flag as in
    ``kernels.norm_fwd_kernel``: the backward's input) holds the
    backward's counters, which program 0 zeroes (``modes.STATS_SYNC_SLOTS``), then ``rstd`` of q's rows, then of
    k's. ``Q_NORM_ROUND`` / ``K_NORM_ROUND``: the code of each norm's output dtype (``ROUND_FP32``...).
    ``ROPE_FIRST``: rotate first, then normalise the rotated rows. ``NEGATE_SIN``: rotate by the opposite angle."""
    # torch.compile may hand eps over as fp64; an fp64 eps would drag the rows into fp64 maths.
    q_eps = tl.cast(q_eps, tl.float32)
    k_eps = tl.cast(k_eps, tl.float32)
    runtime_one = q_eps * 0.0 + 1.0  # eps is finite (checked on the host); the compiler cannot fold this
    pid = tl.program_id(0)
    if store_stats:
        if pid == 0:
            tl.store(STATS.to(tl.pointer_type(tl.int32), bitcast=True) + tl.arange(0, SYNC_SLOTS),
                     tl.zeros([SYNC_SLOTS], dtype=tl.int32))
    q_blocks = tl.cdiv(q_rows, Q_BLOCK_M)
    if pid < q_blocks:
        _norm_rope_block(Q, QW, COS, SIN, QOUT, STATS, 0, pid, q_rows, q_heads, tokens,
                         stride_qb, stride_qt, stride_qh, stride_qob, stride_qot, stride_qoh,
                         stride_cb, stride_ct, stride_sb, stride_st, q_eps, runtime_one,
                         HEAD_DIM, ROTARY_DIM, PER_HEAD, HAS_Q_WEIGHT, CAST_BEFORE_WEIGHT, WEIGHT_OFFSET,
                         Q_NORM_ROUND, Q_BLOCK_M, Q_HEADS_BLOCK, HALF_BLOCK, PASS_BLOCK, store_stats, ROPE_FIRST,
                         ROPE_IN_COS_DTYPE, NEGATE_SIN)
    else:
        _norm_rope_block(K, KW, COS, SIN, KOUT, STATS, q_rows, pid - q_blocks, k_rows, k_heads,
                         tokens, stride_kb, stride_kt, stride_kh, stride_kob, stride_kot, stride_koh,
                         stride_cb, stride_ct, stride_sb, stride_st, k_eps, runtime_one,
                         HEAD_DIM, ROTARY_DIM, PER_HEAD, HAS_K_WEIGHT, CAST_BEFORE_WEIGHT, WEIGHT_OFFSET,
                         K_NORM_ROUND, K_BLOCK_M, K_HEADS_BLOCK, HALF_BLOCK, PASS_BLOCK, store_stats, ROPE_FIRST,
                         ROPE_IN_COS_DTYPE, NEGATE_SIN)


@triton.jit
def _norm_rope_block(
    X, W, COS, SIN, OUT, STATS, first_row, block, n_rows, heads, tokens,
    stride_b, stride_t, stride_h, stride_ob, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_sb, stride_st, eps, runtime_one,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PER_HEAD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, NORM_ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    store_stats, ROPE_FIRST: tl.constexpr, ROPE_IN_COS_DTYPE: tl.constexpr, NEGATE_SIN: tl.constexpr,
):
    """The forward of one block of ``BLOCK_M`` rows of one tensor (``qk_norm_rope_fwd_kernel``), whose ``rstd``
    go to the statistics from row ``first_row`` on. ``ROPE_FIRST``: the rows are rotated (rounded as eager's RoPE
    rounds them), then normalised, the norm reading them in the RoPE's dtype."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    PASS: tl.constexpr = HEAD_DIM - ROTARY_DIM
    OUT_DTYPE: tl.constexpr = OUT.dtype.element_ty
    rows, row_mask, b, t, head = _block_rows(block, n_rows, heads, tokens, PER_HEAD, BLOCK_M)
    heads_in_row, width = _row_geometry(heads, HEAD_DIM, PER_HEAD)
    half_mask = _tile_mask(row_mask, heads_in_row, HALF, HALF_BLOCK, HEADS_BLOCK)
    x1 = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, 0, HALF_BLOCK, HEADS_BLOCK),
                 mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, HALF, HALF_BLOCK, HEADS_BLOCK),
                 mask=half_mask, other=0.0).to(tl.float32)
    if ROPE_FIRST:
        # The norm's input is the RoPE's output: the rotated halves, in the RoPE's dtype (the promotion of the
        # input's and cos's, one of the two: ROPE_IN_COS_DTYPE names which); the pass-through part is the input
        # itself, which that dtype holds exactly.
        if ROPE_IN_COS_DTYPE:
            NORM_IN_DTYPE: tl.constexpr = COS.dtype.element_ty
        else:
            NORM_IN_DTYPE: tl.constexpr = X.dtype.element_ty
        cos1, cos2 = _trig_halves(COS, b, t, stride_cb, stride_ct, row_mask, HALF, HALF_BLOCK, False)
        sin1, sin2 = _trig_halves(SIN, b, t, stride_sb, stride_st, row_mask, HALF, HALF_BLOCK, NEGATE_SIN)
        r1 = _rotated(x1, x2, cos1, sin1, -1.0, runtime_one, NORM_IN_DTYPE).to(tl.float32)
        x2 = _rotated(x2, x1, cos2, sin2, 1.0, runtime_one, NORM_IN_DTYPE).to(tl.float32)
        x1 = r1
    else:
        NORM_IN_DTYPE: tl.constexpr = X.dtype.element_ty
    sum_squares = tl.sum(tl.sum(x1 * x1 + x2 * x2, axis=2), axis=1)
    if PASS > 0:
        pass_mask = _tile_mask(row_mask, heads_in_row, PASS, PASS_BLOCK, HEADS_BLOCK)
        xp = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, ROTARY_DIM, PASS_BLOCK,
                                       HEADS_BLOCK), mask=pass_mask, other=0.0).to(tl.float32)
        sum_squares += tl.sum(tl.sum(xp * xp, axis=2), axis=1)
    rstd = tl.math.rsqrt(sum_squares / width + eps)
    if store_stats:
        tl.store(STATS + SYNC_SLOTS + first_row + rows, rstd, mask=row_mask)

    w1 = _weight_tile(W, heads_in_row, 0, HALF, HALF_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT, WEIGHT_OFFSET)
    w2 = _weight_tile(W, heads_in_row, HALF, HALF, HALF_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT, WEIGHT_OFFSET)
    n1 = _normed(x1, rstd, w1, NORM_IN_DTYPE, NORM_ROUND, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
    n2 = _normed(x2, rstd, w2, NORM_IN_DTYPE, NORM_ROUND, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
    offsets1 = _tile_offsets(b, t, head, stride_ob, stride_ot, stride_oh, 0, HALF_BLOCK, HEADS_BLOCK)
    offsets2 = _tile_offsets(b, t, head, stride_ob, stride_ot, stride_oh, HALF, HALF_BLOCK, HEADS_BLOCK)
    if ROPE_FIRST:
        tl.store(OUT + offsets1, n1.to(OUT_DTYPE), mask=half_mask)
        tl.store(OUT + offsets2, n2.to(OUT_DTYPE), mask=half_mask)
    else:
        cos1, cos2 = _trig_halves(COS, b, t, stride_cb, stride_ct, row_mask, HALF, HALF_BLOCK, False)
        sin1, sin2 = _trig_halves(SIN, b, t, stride_sb, stride_st, row_mask, HALF, HALF_BLOCK, NEGATE_SIN)
        # rotate_half(n) is (-n2, n1): out1 = n1 * cos1 + (-n2) * sin1, out2 = n2 * cos2 + n1 * sin2.
        tl.store(OUT + offsets1, _rotated(n1, n2, cos1, sin1, -1.0, runtime_one, OUT_DTYPE), mask=half_mask)
        tl.store(OUT + offsets2, _rotated(n2, n1, cos2, sin2, 1.0, runtime_one, OUT_DTYPE), mask=half_mask)
    if PASS > 0:
        wp = _weight_tile(W, heads_in_row, ROTARY_DIM, PASS, PASS_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT,
                          WEIGHT_OFFSET)
        n_pass = _normed(xp, rstd, wp, NORM_IN_DTYPE, NORM_ROUND, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
        tl.store(OUT + _tile_offsets(b, t, head, stride_ob, stride_ot, stride_oh, ROTARY_DIM, PASS_BLOCK,
                                     HEADS_BLOCK), n_pass.to(OUT_DTYPE), mask=pass_mask)


@jit_unspecialised
def qk_norm_rope_bwd_kernel(
    DQOUT, DKOUT, Q, K, QW, KW, COS, SIN, STATS, DQ, DK, DQW_PARTIAL, DKW_PARTIAL, DQW, DKW, SYNC,
    q_rows, k_rows, q_heads, k_heads, tokens,
    stride_dqob, stride_dqot, stride_dqoh, stride_dkob, stride_dkot, stride_dkoh,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_dqb, stride_dqt, stride_dqh, stride_dkb, stride_dkt, stride_dkh,
    stride_cb, stride_ct, stride_sb, stride_st,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PER_HEAD: tl.constexpr,
    HAS_Q_WEIGHT: tl.constexpr, HAS_K_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    Q_BLOCK_M: tl.constexpr, K_BLOCK_M: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr, K_HEADS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROPE_FIRST: tl.constexpr = False,
    ROPE_IN_COS_DTYPE: tl.constexpr = False, NEGATE_SIN: tl.constexpr = False,
):
    """The backward on a persistent grid: program ``p`` of ``P`` takes q's row blocks ``p, p + P, ...``, then k's
    likewise, writes the input gradients ``DQ`` and ``DK`` and its fp32 partial sums of each weight's gradient
    over its rows, into row ``p`` of ``DQW_PARTIAL`` and ``DKW_PARTIAL`` (a program without rows writes zeros);
    ``kernels.sum_partials_once_written`` then adds them up in a fixed order into ``DQW`` and ``DKW``, counting
    on ``SYNC`` (the statistics' counters, or fresh zeros: ``qk_launch.qk_norm_rope_backward``). No atomics touch
    the data: the result is deterministic. ``STATS`` are the forward's: counters, ``rstd`` of q's rows, of k's."""
    counters = SYNC.to(tl.pointer_type(tl.int32), bitcast=True)
    tl.atomic_add(counters + STARTED, 1, sem="relaxed")
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    _rows_bwd(DQOUT, Q, QW, COS, SIN, STATS + SYNC_SLOTS, DQ, DQW_PARTIAL, pid, n_programs, q_rows, q_heads, tokens,
              stride_dqob, stride_dqot, stride_dqoh, stride_qb, stride_qt, stride_qh, stride_dqb, stride_dqt,
              stride_dqh, stride_cb, stride_ct, stride_sb, stride_st,
              HEAD_DIM, ROTARY_DIM, PER_HEAD, HAS_Q_WEIGHT, CAST_BEFORE_WEIGHT, WEIGHT_OFFSET,
              Q_BLOCK_M, Q_HEADS_BLOCK, HALF_BLOCK, PASS_BLOCK, ROPE_FIRST, ROPE_IN_COS_DTYPE, NEGATE_SIN)
    _rows_bwd(DKOUT, K, KW, COS, SIN, STATS + SYNC_SLOTS + q_rows, DK, DKW_PARTIAL, pid, n_programs, k_rows, k_heads,
              tokens, stride_dkob, stride_dkot, stride_dkoh, stride_kb, stride_kt, stride_kh, stride_dkb, stride_dkt,
              stride_dkh, stride_cb, stride_ct, stride_sb, stride_st,
              HEAD_DIM, ROTARY_DIM, PER_HEAD, HAS_K_WEIGHT, CAST_BEFORE_WEIGHT, WEIGHT_OFFSET,
              K_BLOCK_M, K_HEADS_BLOCK, HALF_BLOCK, PASS_BLOCK, ROPE_FIRST, ROPE_IN_COS_DTYPE, NEGATE_SIN)
    _, q_width = _row_geometry(q_heads, HEAD_DIM, PER_HEAD)
    _, k_width = _row_geometry(k_heads, HEAD_DIM, PER_HEAD)
    sum_partials_once_written(counters, DQW_PARTIAL, DKW_PARTIAL, DQW, DKW, n_programs, q_width, k_width,
                              HAS_Q_WEIGHT, HAS_K_WEIGHT)


@triton.jit
def _rows_bwd(
    DOUT, X, W, COS, SIN, RSTD, DX, DW_PARTIAL, pid, n_programs, n_rows, heads, tokens,
    stride_dob, stride_dot, stride_doh, stride_b, stride_t, stride_h, stride_dxb, stride_dxt, stride_dxh,
    stride_cb, stride_ct, stride_sb, stride_st,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PER_HEAD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    ROPE_FIRST: tl.constexpr, ROPE_IN_COS_DTYPE: tl.constexpr, NEGATE_SIN: tl.constexpr,
):
    """One tensor's share of program ``pid``'s backward (``qk_norm_rope_bwd_kernel``): its row blocks ``pid,
    pid + n_programs, ...``, then its partial weight-gradient row. The weight is loaded once, outside the loop; the
    weight gradient accumulates over the rows in fp32 tiles, folded once at the end. ``ROPE_FIRST``: the norm's
    input, the rotated rows, is computed again as the forward computed it, and the rotation's transpose comes last."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    PASS: tl.constexpr = HEAD_DIM - ROTARY_DIM
    if ROPE_FIRST and ROPE_IN_COS_DTYPE:
        NORM_IN_DTYPE: tl.constexpr = COS.dtype.element_ty
    else:
        NORM_IN_DTYPE: tl.constexpr = X.dtype.element_ty
    heads_in_row, width = _row_geometry(heads, HEAD_DIM, PER_HEAD)
    w1 = _weight_tile(W, heads_in_row, 0, HALF, HALF_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT, WEIGHT_OFFSET)
    w2 = _weight_tile(W, heads_in_row, HALF, HALF, HALF_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT, WEIGHT_OFFSET)
    wp = _weight_tile(W, heads_in_row, ROTARY_DIM, PASS, PASS_BLOCK, HEADS_BLOCK, HEAD_DIM, HAS_WEIGHT,
                      WEIGHT_OFFSET)
    dw1 = tl.zeros([BLOCK_M, HEADS_BLOCK, HALF_BLOCK], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_M, HEADS_BLOCK, HALF_BLOCK], dtype=tl.float32)
    dwp = tl.zeros([BLOCK_M, HEADS_BLOCK, PASS_BLOCK], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
        rows, row_mask, b, t, head = _block_rows(block, n_rows, heads, tokens, PER_HEAD, BLOCK_M)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        half_mask = _tile_mask(row_mask, heads_in_row, HALF, HALF_BLOCK, HEADS_BLOCK)
        # The rotation out1 = n1 * cos1 - n2 * sin1, out2 = n2 * cos2 + n1 * sin2 has the transpose
        # (d1, d2) -> (d1 * cos1 + d2 * sin2, d2 * cos2 - d1 * sin1): applied to the output's gradient (the norm's
        # output is rotated), or last, to the norm's input gradient (ROPE_FIRST: the rotated rows are normalised).
        dy1 = tl.load(DOUT + _tile_offsets(b, t, head, stride_dob, stride_dot, stride_doh, 0, HALF_BLOCK,
                                           HEADS_BLOCK), mask=half_mask, other=0.0).to(tl.float32)
        dy2 = tl.load(DOUT + _tile_offsets(b, t, head, stride_dob, stride_dot, stride_doh, HALF, HALF_BLOCK,
                                           HEADS_BLOCK), mask=half_mask, other=0.0).to(tl.float32)
        cos1, cos2 = _trig_halves(COS, b, t, stride_cb, stride_ct, row_mask, HALF, HALF_BLOCK, False)
        sin1, sin2 = _trig_halves(SIN, b, t, stride_sb, stride_st, row_mask, HALF, HALF_BLOCK, NEGATE_SIN)
        x1 = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, 0, HALF_BLOCK, HEADS_BLOCK),
                     mask=half_mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, HALF, HALF_BLOCK, HEADS_BLOCK),
                     mask=half_mask, other=0.0).to(tl.float32)
        if ROPE_FIRST:
            # An opaque 1.0 (see _rotated): rstd is loaded, so no compiler folds this (a row whose rstd is not
            # finite has NaN outputs and gradients whatever this is).
            runtime_one = rstd * 0.0 + 1.0
            r1 = _rotated(x1, x2, cos1, sin1, -1.0, runtime_one[:, None, None], NORM_IN_DTYPE).to(tl.float32)
            x2 = _rotated(x2, x1, cos2, sin2, 1.0, runtime_one[:, None, None], NORM_IN_DTYPE).to(tl.float32)
            x1 = r1
            dn1 = dy1
            dn2 = dy2
        else:
            dn1 = dy1 * cos1 + dy2 * sin2
            dn2 = dy2 * cos2 - dy1 * sin1
        n1 = x1 * rstd[:, None, None]
        n2 = x2 * rstd[:, None, None]
        g1, dw_1 = _norm_grads(dn1, n1, w1, NORM_IN_DTYPE, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
        g2, dw_2 = _norm_grads(dn2, n2, w2, NORM_IN_DTYPE, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
        dw1 += dw_1
        dw2 += dw_2
        dot = tl.sum(tl.sum(g1 * n1 + g2 * n2, axis=2), axis=1)
        if PASS > 0:
            pass_mask = _tile_mask(row_mask, heads_in_row, PASS, PASS_BLOCK, HEADS_BLOCK)
            dnp = tl.load(DOUT + _tile_offsets(b, t, head, stride_dob, stride_dot, stride_doh, ROTARY_DIM,
                                               PASS_BLOCK, HEADS_BLOCK), mask=pass_mask, other=0.0).to(tl.float32)
            n_pass = tl.load(X + _tile_offsets(b, t, head, stride_b, stride_t, stride_h, ROTARY_DIM, PASS_BLOCK,
                                               HEADS_BLOCK), mask=pass_mask, other=0.0).to(tl.float32)
            n_pass = n_pass * rstd[:, None, None]
            gp, dw_p = _norm_grads(dnp, n_pass, wp, NORM_IN_DTYPE, HAS_WEIGHT, CAST_BEFORE_WEIGHT)
            dwp += dw_p
            dot += tl.sum(tl.sum(gp * n_pass, axis=2), axis=1)
        c = (dot / width)[:, None, None]
        r = rstd[:, None, None]
        dx1 = (g1 - n1 * c) * r
        dx2 = (g2 - n2 * c) * r
        if ROPE_FIRST:
            d1 = dx1
            dx1 = d1 * cos1 + dx2 * sin2
            dx2 = dx2 * cos2 - d1 * sin1
        tl.store(DX + _tile_offsets(b, t, head, stride_dxb, stride_dxt, stride_dxh, 0, HALF_BLOCK, HEADS_BLOCK),
                 dx1.to(DX.dtype.element_ty), mask=half_mask)
        tl.store(DX + _tile_offsets(b, t, head, stride_dxb, stride_dxt, stride_dxh, HALF, HALF_BLOCK, HEADS_BLOCK),
                 dx2.to(DX.dtype.element_ty), mask=half_mask)
        if PASS > 0:
            tl.store(DX + _tile_offsets(b, t, head, stride_dxb, stride_dxt, stride_dxh, ROTARY_DIM, PASS_BLOCK,
                                        HEADS_BLOCK), ((gp - n_pass * c) * r).to(DX.dtype.element_ty),
                     mask=pass_mask)
    if HAS_WEIGHT:
        partial = DW_PARTIAL + pid.to(tl.int64) * width
        _store_weight_partial(partial, tl.sum(dw1, axis=0), heads_in_row, 0, HALF, HALF_BLOCK, HEADS_BLOCK,
                              HEAD_DIM)
        _store_weight_partial(partial, tl.sum(dw2, axis=0), heads_in_row, HALF, HALF, HALF_BLOCK, HEADS_BLOCK,
                              HEAD_DIM)
        if PASS > 0:
            _store_weight_partial(partial, tl.sum(dwp, axis=0), heads_in_row, ROTARY_DIM, PASS, PASS_BLOCK,
                                  HEADS_BLOCK, HEAD_DIM)


@triton.jit
def _norm_grads(dn, n, w, X_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):
    """``(g, dw)`` of a tile whose norm output's gradient is ``dn`` and normalised row ``n`` (fp32, unrounded):
    the gradient at the normalised row ``g = dn * w`` (``dn`` without a weight) and the weight gradient's
    contribution ``dn * n_weighted``, ``n_weighted`` being the row the weight multiplied (rounded to the input
    dtype first in the Llama order). The roundings of the forward have an identity gradient, as in autograd."""
    if HAS_WEIGHT:
        g = dn * w
        if CAST_BEFORE_WEIGHT:
            dw = dn * n.to(X_DTYPE).to(tl.float32)
        else:
            dw = dn * n
    else:
        g = dn
        dw = dn
    return g, dw


@triton.jit
def _store_weight_partial(PARTIAL, dw, heads_in_row, first, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                          HEADS_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A ``[HEADS_BLOCK, BLOCK]`` piece of a partial weight-gradient row: columns ``first ..`` of each head."""
    heads = tl.arange(0, HEADS_BLOCK)
    cols = first + tl.arange(0, BLOCK)
    mask = (heads < heads_in_row)[:, None] & (tl.arange(0, BLOCK) < WIDTH)[None, :]
    tl.store(PARTIAL + heads[:, None] * HEAD_DIM + cols[None, :], dw, mask=mask)
