"""Triton kernels for RMSNorm and LayerNorm with an optional fused residual add, forward and backward.

Memory traffic is the whole cost of these kernels, so each one touches every element the minimum number of
times: the forward reads ``x`` and ``residual`` once and writes ``y`` and ``residual + x`` once (8 bytes per
element in bf16) plus one fp32 ``rstd`` per row; the backward reads ``dy``, the saved sum and the incoming
gradient of the sum once and writes the input gradient once. Its weight (and bias) gradient is summed over all
of a program's rows in fp32 registers and written once per program as a partial row; once every program has
written its own, the same launch adds them up in a fixed order (``sum_partials_once_written``), so one
backward is one launch. Rows wider than one tile take two kernels: ``row_dot_kernel`` reduces each row (reading
``dy`` and the norm's input), then ``column_bwd_kernel`` makes the input gradient and the weight gradient's
partial sums column block by column block (reading them again, with ``dsum``), and adds those up the same way:
12 bytes per bf16 element against the minimum's 8, with no partial sum read back per row.

Rows that fit in registers (``SINGLE_TILE``) are handled as 2-D tiles of ``BLOCK_M`` rows, so narrow rows
(``head_dim`` 128 for Qwen3's q/k norms) still give each program enough work. Wider rows loop over column
blocks: a first pass computes the sum of squares (and writes the residual sum), a second pass re-reads the
row, which the first pass has just brought into L2, and writes the output.

``norm_add_norm_fwd_kernel`` is two single-tile forwards in one launch, for sandwich norms: ``residual + norm(x)``
as the forward's ``ADD_AFTER`` computes it, then the next norm of that rounded sum, kept in registers between the
two (``_normalise_tile`` is the one body both kernels run per tile).

``CENTER`` turns the kernels into LayerNorm (the row mean is subtracted before the RMS; the mean is stored
next to ``rstd``): Hugging Face's LayerNorm models run on it, with the residual add fused as for RMSNorm. The
forward's ``DIVIDE_BY_STD`` (DeBERTa's LayerNorm) divides the centred row by ``sqrt(var + eps)``, rounded to
nearest as torch's ``/`` and ``torch.sqrt`` are (``div_rn``, ``sqrt_rn``: Triton's ``/`` and ``sqrt`` are
approximate on NVIDIA GPUs), with the plain mean and variance its body spells out.

All arithmetic is in fp32 after loading (which is also what Triton's CPU interpreter needs: it stores bf16 as
raw integers). Casts follow Hugging Face's order, selected by ``CAST_BEFORE_WEIGHT`` (to the input's dtype, or
with ``CAST_TO_WEIGHT`` to the weight's) and ``WEIGHT_OFFSET`` (the modes of ``modes.py``; ``reference.py`` is the
same maths in PyTorch). Row offsets are 64-bit, so a million tokens of width 8192 cannot overflow.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import triton
import triton.language as tl

from .modes import STATS_SYNC_SLOTS

# The kernels' arguments that carry the row count (or follow from it). Triton compiles no variant of a kernel for
# their values, as it would otherwise (an integer equal to 1 becomes a constant, one divisible by 16 an alignment
# fact): a row runs the same compiled code whatever the batch it is in, only the integers' width following their
# size (docs/numerics.md, "Batch invariance").
ROW_COUNT_ARGS = ("n_rows", "n_row_blocks", "rows_per_group", "q_rows", "k_rows", "tokens")
# Flags passed at run time, not as constexprs, so that the calls they tell apart run one compiled kernel: whether a
# forward stores its statistics (training, compiled calls) or not (inference). Two binaries of the same arithmetic
# need not round alike: ptxas may fuse a multiply and an add into one FMA, and on an H200 it fused different pairs
# in the binaries with and without the statistics' stores (docs/numerics.md, "Batch invariance").
RUNTIME_FLAG_ARGS = ("store_stats",)


def unspecialised_args(fn: Callable[..., Any]) -> list[str]:
    """The parameters of the kernel function ``fn`` that Triton must not specialise on: those carrying the row
    count (``ROW_COUNT_ARGS``) and the flags passed at run time (``RUNTIME_FLAG_ARGS``)."""
    return [name for name in inspect.signature(fn).parameters if name in ROW_COUNT_ARGS + RUNTIME_FLAG_ARGS]


def jit_unspecialised(fn: Callable[..., Any]) -> Any:
    """``triton.jit``, not specialised on the values of ``unspecialised_args``."""
    return triton.jit(fn, do_not_specialize=unspecialised_args(fn))


# The int32 counters at the start of the statistics (modes.STATS_SYNC_SLOTS), by index: the backward's programs
# that have started, that have written their partial weight-gradient rows, the column pieces of the final sum
# claimed, and the programs done with the counters.
SYNC_SLOTS = tl.constexpr(STATS_SYNC_SLOTS)
STARTED = tl.constexpr(0)
WRITTEN = tl.constexpr(1)
CLAIMED = tl.constexpr(2)
DONE = tl.constexpr(3)
# The final sum of the partial weight-gradient rows: REDUCE_BLOCK_P partial rows added per step, in pieces of
# REDUCE_BLOCK_N columns.
REDUCE_BLOCK_P = tl.constexpr(32)
REDUCE_BLOCK_N = tl.constexpr(64)


@triton.jit
def _load_norm_input(
    X, RESIDUAL, SUM_OUT, rows, cols, mask, stride_x, stride_res, stride_sum, HAS_RESIDUAL: tl.constexpr,
    READ_AGAIN: tl.constexpr = False,
):
    """Loads one tile of the norm's input in fp32; with a residual, writes ``residual + x`` rounded to the
    sum's dtype (exactly as ``residual + x`` rounds in torch) and returns that rounded value. ``READ_AGAIN``
    (the looped forward's first pass): the norm's input (the sum, or ``x``) is read back by the later passes, so
    it is kept in L2 ahead of what is not (the residual and, with one, ``x``)."""
    x_policy: tl.constexpr = "evict_first" if READ_AGAIN and HAS_RESIDUAL else ("evict_last" if READ_AGAIN else "")
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                eviction_policy=x_policy).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RESIDUAL + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first" if READ_AGAIN else "")
        s = (x + r.to(tl.float32)).to(SUM_OUT.dtype.element_ty)
        tl.store(SUM_OUT + rows[:, None] * stride_sum + cols[None, :], s, mask=mask,
                 eviction_policy="evict_last" if READ_AGAIN else "")
        x = s.to(tl.float32)
    return x


@triton.jit
def _load_back(X, SUM_OUT, rows, cols, mask, stride_x, stride_sum, HAS_RESIDUAL: tl.constexpr,
               LAST_READ: tl.constexpr):
    """Re-reads a tile of the norm's input (the residual sum this program wrote, or ``x``) in fp32; after its
    ``LAST_READ`` it may leave L2 first."""
    policy: tl.constexpr = "evict_first" if LAST_READ else "evict_last"
    if HAS_RESIDUAL:
        s = tl.load(SUM_OUT + rows[:, None] * stride_sum + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=policy)
    else:
        s = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy=policy)
    return s.to(tl.float32)


@triton.jit
def _rounded_row(n, W, NORM_DTYPE: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr):
    """The normalised row ``n`` (fp32) rounded as a ``cast_before_weight`` mode rounds it before the weight
    multiplies it: to the weight's dtype with ``CAST_TO_WEIGHT`` (T5; a no-op for an fp32 weight), else to the
    norm's input dtype ``NORM_DTYPE`` (Llama); returned in fp32."""
    if CAST_TO_WEIGHT:
        return n.to(W.dtype.element_ty).to(tl.float32)
    return n.to(NORM_DTYPE).to(tl.float32)


@triton.jit
def _scale_and_store(
    s, scale, W, B, Y, RESIDUAL, rows, cols, col_mask, mask, stride_y, stride_res, runtime_one,
    NORM_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    CAST_TO_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, DIVIDE_BY_STD: tl.constexpr, ADD_AFTER: tl.constexpr,
    STREAMED: tl.constexpr = False,
):
    """``y = w * norm(s) (+ b)`` in the casting order of the model family, stored in ``Y``'s dtype; without a
    weight ``y = norm(s) (+ b)`` in every mode. ``norm(s)`` is ``s * scale`` (``scale`` the rows' ``rstd``), or
    with ``DIVIDE_BY_STD`` ``s / scale`` rounded to nearest (``scale`` the rows' ``sqrt(var + eps)``). With ``ADD_AFTER`` (post-norm layers: ``residual + norm(x)``)
    ``y`` is rounded to ``Y``'s dtype and the residual tile added, rounded as torch rounds the add.
    ``runtime_one`` is 1.0, computed from a kernel argument so that the compiler cannot see it (see below).
    ``STREAMED`` (the looped forward's last pass): ``y`` and the residual tile are not read again by this kernel,
    so they leave L2 first, ahead of the rows other programs still re-read. Returns the tile as stored (in
    ``Y``'s dtype)."""
    if DIVIDE_BY_STD:
        y = tl.math.div_rn(s, scale[:, None])
    else:
        y = s * scale[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:
            w = w + WEIGHT_OFFSET
        if CAST_BEFORE_WEIGHT:
            # Llama: the normalised row is rounded to the input dtype before the weight multiplies it; T5
            # (CAST_TO_WEIGHT): to the weight's dtype (an fp32 weight: no rounding). The product of two fp16 or
            # two bf16 values is exact in fp32, so its one rounding on the store is torch's half-precision multiply.
            y = _rounded_row(y, W, NORM_DTYPE, CAST_TO_WEIGHT)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        if CAST_BEFORE_WEIGHT:
            # `w * n + b` in the promoted dtype rounds after the product as well. Left as is, the compiler turns
            # the bf16/fp16-exact product and sum into one half-precision FMA (seen in the PTX: fma.rn.bf16),
            # which skips that rounding; multiplying by an opaque 1.0 is exact and keeps it.
            y = y.to(Y.dtype.element_ty).to(tl.float32) * runtime_one
        y = y + b[None, :]
    if ADD_AFTER:
        r = tl.load(RESIDUAL + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first" if STREAMED else "").to(tl.float32)
        # The opaque 1.0 again: without it a rounded product and this add could become one half-precision FMA.
        y = y.to(Y.dtype.element_ty).to(tl.float32) * runtime_one + r
    stored = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], stored, mask=mask,
             eviction_policy="evict_first" if STREAMED else "")
    return stored


@jit_unspecialised
def norm_fwd_kernel(
    X, RESIDUAL, W, B, Y, SUM_OUT, STATS,
    n_rows, n_cols,
    stride_x, stride_res, stride_y, stride_sum,
    eps, store_stats,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    CENTER: tl.constexpr, DIVIDE_BY_STD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_TILE: tl.constexpr, ADD_AFTER: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Normalises rows ``BLOCK_M`` at a time. ``HAS_RESIDUAL``: the norm reads ``residual + x`` (pre-norm
    layers); ``ADD_AFTER``: the output is ``residual + norm(x)`` (post-norm layers); never both. ``SUM_OUT`` is
    the residual sum (unused without residual); ``STATS`` holds the backward's counters, which program 0 zeroes,
    then ``rstd`` for every row, followed by the row means when ``CENTER`` (``modes.STATS_SYNC_SLOTS``); written
    only where ``store_stats`` (a run-time flag, ``RUNTIME_FLAG_ARGS``: the backward's input; inference passes 0
    and a tensor the kernel leaves alone).

    Rows of one tile (``SINGLE_TILE``): one program per row block. Wider rows: a persistent grid, program ``p``
    of ``P`` normalising row blocks ``p, p + P, ...`` (``launch.forward_grid`` sizes ``P`` so that the rows in
    flight fit in L2, where their second pass finds them), each row in passes over column blocks, the first one
    pipelined over ``NUM_STAGES`` column blocks (``tl.range``: asynchronous copies on sm_80 and later)."""
    # torch.compile may hand eps over as fp64; an fp64 eps would drag the whole row into fp64 maths.
    eps = tl.cast(eps, tl.float32)
    runtime_one = eps * 0.0 + 1.0  # eps is finite (checked on the host); the compiler cannot fold this
    if HAS_RESIDUAL:
        NORM_DTYPE: tl.constexpr = SUM_OUT.dtype.element_ty
    else:
        NORM_DTYPE: tl.constexpr = X.dtype.element_ty
    if store_stats:
        if tl.program_id(0) == 0:
            tl.store(STATS.to(tl.pointer_type(tl.int32), bitcast=True) + tl.arange(0, SYNC_SLOTS),
                     tl.zeros([SYNC_SLOTS], dtype=tl.int32))

    if SINGLE_TILE:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        s = _load_norm_input(X, RESIDUAL, SUM_OUT, rows, cols, mask, stride_x, stride_res, stride_sum,
                               HAS_RESIDUAL)
        _normalise_tile(s, W, B, Y, RESIDUAL, STATS, rows, cols, row_mask, col_mask, mask, n_rows, n_cols,
                        stride_y, stride_res, eps, runtime_one, NORM_DTYPE, HAS_WEIGHT, HAS_BIAS, CAST_BEFORE_WEIGHT,
                        CAST_TO_WEIGHT, WEIGHT_OFFSET, CENTER, DIVIDE_BY_STD, ADD_AFTER, store_stats)
    else:
        for block in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_mask = rows < n_rows
            _normalise_looped_rows(
                X, RESIDUAL, W, B, Y, SUM_OUT, STATS, rows, row_mask, n_rows, n_cols,
                stride_x, stride_res, stride_y, stride_sum, eps, runtime_one, NORM_DTYPE,
                HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, WEIGHT_OFFSET, CENTER,
                DIVIDE_BY_STD, BLOCK_M, BLOCK_N, ADD_AFTER, store_stats, NUM_STAGES)


@triton.jit
def _normalise_tile(
    s, W, B, Y, RESIDUAL, STATS, rows, cols, row_mask, col_mask, mask, n_rows, n_cols, stride_y, stride_res, eps,
    runtime_one, NORM_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    CENTER: tl.constexpr, DIVIDE_BY_STD: tl.constexpr, ADD_AFTER: tl.constexpr, store_stats,
):
    """The single-tile forward of rows whose norm input ``s`` (fp32, zero where masked) is loaded: the statistics,
    ``_scale_and_store``'s output (stored, and returned as stored) and, where ``store_stats``, ``rstd`` (and the
    means when ``CENTER``) into ``STATS``."""
    if CENTER:
        mean = _row_mean(tl.sum(s, axis=1), n_cols, DIVIDE_BY_STD)
        s = tl.where(mask, s - mean[:, None], 0.0)
        if not DIVIDE_BY_STD:
            # Corrected two-pass: the mean of the deviations from a first mean removes its rounding error.
            correction = tl.sum(s, axis=1) / n_cols
            mean += correction
            s = tl.where(mask, s - correction[:, None], 0.0)
    variance = _row_mean(tl.sum(s * s, axis=1), n_cols, DIVIDE_BY_STD)
    rstd = tl.math.rsqrt(variance + eps)
    stored = _scale_and_store(s, _row_scale(variance, eps, rstd, DIVIDE_BY_STD), W, B, Y, RESIDUAL, rows, cols,
                              col_mask, mask, stride_y, stride_res, runtime_one, NORM_DTYPE, HAS_WEIGHT, HAS_BIAS,
                              CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, WEIGHT_OFFSET, DIVIDE_BY_STD, ADD_AFTER)
    if store_stats:
        _store_stats(STATS, rows, row_mask, n_rows, rstd, mean if CENTER else rstd, CENTER)
    return stored


@jit_unspecialised
def norm_add_norm_fwd_kernel(
    X, RESIDUAL, W, B, SUM_OUT, STATS, W2, B2, Y, STATS2,
    n_rows, n_cols,
    stride_x, stride_res,
    eps, eps2, store_stats,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    CENTER: tl.constexpr, DIVIDE_BY_STD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Two norms of one mode and the residual add between them (sandwich-norm layers: Gemma 2-4, GLM-4), for rows
    of one tile, ``BLOCK_M`` at a time: ``SUM_OUT = residual + norm(x)`` exactly as ``norm_fwd_kernel``'s
    ``ADD_AFTER`` computes it (the norm's output rounded to ``SUM_OUT``'s dtype, then the add, rounded), and
    ``Y = norm2(SUM_OUT)`` (weight ``W2``, bias ``B2``, ``eps2``) of that rounded sum, as ``norm_fwd_kernel``
    normalises an input of ``SUM_OUT``'s dtype. The sum stays in registers between the two: x and the residual are
    read once, the sum and ``Y`` written once (8 bytes per bf16 element, where the two kernels move 14). Where
    ``store_stats`` (a run-time flag, as in ``norm_fwd_kernel``), ``STATS`` gets the first norm's statistics and
    ``STATS2`` the second's, each as ``norm_fwd_kernel`` lays them out (program 0 zeroes both tensors' counters)."""
    eps = tl.cast(eps, tl.float32)  # as in norm_fwd_kernel: never fp64
    eps2 = tl.cast(eps2, tl.float32)
    runtime_one = eps * 0.0 + 1.0
    if store_stats:
        if tl.program_id(0) == 0:
            tl.store(STATS.to(tl.pointer_type(tl.int32), bitcast=True) + tl.arange(0, SYNC_SLOTS),
                     tl.zeros([SYNC_SLOTS], dtype=tl.int32))
            tl.store(STATS2.to(tl.pointer_type(tl.int32), bitcast=True) + tl.arange(0, SYNC_SLOTS),
                     tl.zeros([SYNC_SLOTS], dtype=tl.int32))
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load_norm_input(X, RESIDUAL, SUM_OUT, rows, cols, mask, stride_x, stride_res, n_cols, False)
    total = _normalise_tile(x, W, B, SUM_OUT, RESIDUAL, STATS, rows, cols, row_mask, col_mask, mask, n_rows,
                            n_cols, n_cols, stride_res, eps, runtime_one, X.dtype.element_ty, HAS_WEIGHT, HAS_BIAS,
                            CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, WEIGHT_OFFSET, CENTER, DIVIDE_BY_STD, True,
                            store_stats)
    total = tl.where(mask, total.to(tl.float32), 0.0)
    _normalise_tile(total, W2, B2, Y, RESIDUAL, STATS2, rows, cols, row_mask, col_mask, mask, n_rows, n_cols,
                    n_cols, stride_res, eps2, runtime_one, SUM_OUT.dtype.element_ty, HAS_WEIGHT2, HAS_BIAS2,
                    CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, WEIGHT_OFFSET, CENTER, DIVIDE_BY_STD, False, store_stats)


@triton.jit
def _row_mean(row_sum, n_cols, DIVIDE_BY_STD: tl.constexpr):
    """``row_sum / n_cols``: rounded to nearest with ``DIVIDE_BY_STD``, as torch's ``mean`` divides (Triton's
    ``/`` is approximate on NVIDIA GPUs, within 2 ulps)."""
    if DIVIDE_BY_STD:
        return tl.math.div_rn(row_sum, tl.cast(n_cols, tl.float32))
    return row_sum / n_cols


@triton.jit
def _row_scale(variance, eps, rstd, DIVIDE_BY_STD: tl.constexpr):
    """What ``_scale_and_store`` scales the rows by: ``sqrt(variance + eps)`` rounded to nearest (``torch.sqrt``)
    with ``DIVIDE_BY_STD``, else their ``rstd``."""
    if DIVIDE_BY_STD:
        return tl.math.sqrt_rn(variance + eps)
    return rstd


@triton.jit
def _store_stats(STATS, rows, row_mask, n_rows, rstd, mean, CENTER: tl.constexpr):
    """``rstd`` and, when ``CENTER``, the mean of ``rows`` into the statistics, after their counters."""
    values = STATS + SYNC_SLOTS
    tl.store(values + rows, rstd, mask=row_mask)
    if CENTER:
        tl.store(values + n_rows + rows, mean, mask=row_mask)


@triton.jit
def _normalise_looped_rows(
    X, RESIDUAL, W, B, Y, SUM_OUT, STATS, rows, row_mask, n_rows, n_cols,
    stride_x, stride_res, stride_y, stride_sum, eps, runtime_one, NORM_DTYPE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    CENTER: tl.constexpr, DIVIDE_BY_STD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ADD_AFTER: tl.constexpr, store_stats, NUM_STAGES: tl.constexpr,
):
    """One block of rows wider than a tile, in passes over column blocks: the first writes the residual sum and
    accumulates the sum of squares (the sum, when centring), pipelined; the last re-reads the norm's input,
    which the first has just brought into L2, and writes the output. The pipelined loads are asynchronous copies,
    which drop the eviction hints: what keeps the rows in L2 is the grid's budget of rows in flight."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        s = _load_norm_input(X, RESIDUAL, SUM_OUT, rows, cols, mask, stride_x, stride_res, stride_sum,
                               HAS_RESIDUAL, READ_AGAIN=True)
        if CENTER:
            acc += s
        else:
            acc += s * s
    # Later passes read back the sum other threads of this program wrote in the first.
    tl.debug_barrier()
    if CENTER:
        # Centred sum of squares in its own pass (E[s^2] - mean^2 cancels badly when the mean is large),
        # with the corrected two-pass algorithm's correction of the mean's rounding error (not DeBERTa's body).
        mean = _row_mean(tl.sum(acc, axis=1), n_cols, DIVIDE_BY_STD)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        deviation = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            s = _load_back(X, SUM_OUT, rows, cols, mask, stride_x, stride_sum, HAS_RESIDUAL, LAST_READ=False)
            s = tl.where(mask, s - mean[:, None], 0.0)
            if not DIVIDE_BY_STD:
                deviation += s
            acc += s * s
        if DIVIDE_BY_STD:
            variance = _row_mean(tl.sum(acc, axis=1), n_cols, DIVIDE_BY_STD)
        else:
            correction = tl.sum(deviation, axis=1) / n_cols
            mean += correction
            variance = tl.sum(acc, axis=1) / n_cols - correction * correction
    else:
        variance = tl.sum(acc, axis=1) / n_cols
        mean = variance  # not read without CENTER
    rstd = tl.math.rsqrt(variance + eps)
    scale = _row_scale(variance, eps, rstd, DIVIDE_BY_STD)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        s = _load_back(X, SUM_OUT, rows, cols, mask, stride_x, stride_sum, HAS_RESIDUAL, LAST_READ=True)
        if CENTER:
            s = s - mean[:, None]
        _scale_and_store(s, scale, W, B, Y, RESIDUAL, rows, cols, col_mask, mask, stride_y, stride_res,
                         runtime_one, NORM_DTYPE, HAS_WEIGHT, HAS_BIAS, CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT,
                         WEIGHT_OFFSET, DIVIDE_BY_STD, ADD_AFTER, STREAMED=True)
    if store_stats:
        _store_stats(STATS, rows, row_mask, n_rows, rstd, mean, CENTER)


@triton.jit
def _load_weight(W, cols, col_mask, HAS_WEIGHT: tl.constexpr, WEIGHT_OFFSET: tl.constexpr):
    """The weight's columns in fp32 with the family's offset added (Gemma's ``1 + w``); 0 without a weight."""
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:
            w = w + WEIGHT_OFFSET
    else:
        w = tl.zeros(cols.shape, dtype=tl.float32)
    return w


@triton.jit
def _normalised_row(S, rows, cols, mask, rstd, mean, stride_s, CENTER: tl.constexpr, LAST_READ: tl.constexpr = False):
    """The normalised row ``n`` of a tile of the norm's input, loaded (fp32); ``LAST_READ``: it may leave the
    caches first."""
    s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first" if LAST_READ else "").to(tl.float32)
    if CENTER:
        s = s - mean[:, None]
    return s * rstd[:, None]


@triton.jit
def _input_grad_tile(
    DY, S, W, w, rows, cols, mask, rstd, mean, stride_dy, stride_s,
    HAS_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr, CENTER: tl.constexpr,
):
    """Loads one tile and returns ``(dy, n, g, n_weighted)``: the output gradient, the normalised row,
    ``g = dy * w`` (the gradient at the normalised row; ``dy`` without a weight) and the row the weight was
    multiplied with. ``w`` is ``_load_weight``'s result for these columns (``W`` the weight's pointer, read for its
    dtype only)."""
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    n = _normalised_row(S, rows, cols, mask, rstd, mean, stride_s, CENTER)
    if HAS_WEIGHT:
        g = dy * w[None, :]
    else:
        g = dy
    if CAST_BEFORE_WEIGHT and HAS_WEIGHT:
        n_weighted = _rounded_row(n, W, S.dtype.element_ty, CAST_TO_WEIGHT)
    else:
        n_weighted = n
    return dy, n, g, n_weighted


@triton.jit
def _load_stats(STATS, rows, row_mask, n_rows, CENTER: tl.constexpr):
    """A pair of per-row statistics stored one after the other: ``STATS[rows]`` and, when ``CENTER``,
    ``STATS[n_rows + rows]`` (rstd and the mean, after the forward's statistics' counters; or, for the wide
    backward, mean(g * n) and mean(g)). Without ``CENTER`` the second is the first again, never read."""
    first = tl.load(STATS + rows, mask=row_mask, other=0.0)
    if CENTER:
        second = tl.load(STATS + n_rows + rows, mask=row_mask, other=0.0)
    else:
        second = first
    return first, second


@triton.jit
def _input_grad(g, n, c, g_mean, rstd, CENTER: tl.constexpr):
    """The norm's input gradient from its row reductions ``c = mean(g * n)`` and, when ``CENTER``,
    ``g_mean = mean(g)``: ``(g - n * c - g_mean) * rstd``."""
    dx = g - n * c[:, None]
    if CENTER:
        dx -= g_mean[:, None]
    return dx * rstd[:, None]


@triton.jit
def _store_input_grad(
    dx, rstd, DSUM, DX, DRES, rows, cols, mask, stride_dsum, stride_dx, stride_dres,
    HAS_DSUM: tl.constexpr, HAS_DRES: tl.constexpr, ROUND_BEFORE_DSUM: tl.constexpr,
):
    """Folds in the gradient that reached the residual sum and stores the input gradient (twice when x and
    the residual have different dtypes). ``dx`` is ``_input_grad``'s, of the rows' ``rstd``. With
    ``ROUND_BEFORE_DSUM`` the norm's own input gradient is rounded to ``DX``'s dtype before the fp32 add, so the
    stored sum is what autograd's accumulation of the two rounded gradients (an aten add in that dtype, computed in
    fp32 and rounded once) gives, bit for bit."""
    if HAS_DSUM:
        if ROUND_BEFORE_DSUM:
            dx = dx.to(DX.dtype.element_ty).to(tl.float32)
        else:
            # dx is a product (``* rstd``), which the GPU compiler would fuse with this add into one FMA: the sum
            # rounded once, where the adds apart round the product, then the sum (an fp32 model's gradients then
            # differed from the unfused ones in the last bit on an H200; the interpreter never fuses). Multiplying
            # by an opaque 1.0 (the compiler cannot know rstd is finite) is exact and keeps the product's rounding.
            dx = dx * (rstd * 0.0 + 1.0)[:, None]
        dx += tl.load(DSUM + rows[:, None] * stride_dsum + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + rows[:, None] * stride_dres + cols[None, :], dx.to(DRES.dtype.element_ty), mask=mask)


@jit_unspecialised
def norm_bwd_kernel(
    DY, DSUM, S, STATS, W, DX, DRES, DW_PARTIAL, DB_PARTIAL, DW, DB, SYNC,
    n_rows, n_cols, n_row_blocks,
    stride_dy, stride_dsum, stride_s, stride_dx, stride_dres,
    HAS_DSUM: tl.constexpr, HAS_DRES: tl.constexpr, ROUND_BEFORE_DSUM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, CENTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, REREAD_ROW: tl.constexpr,
):
    """The backward of rows that fit in one tile, on a persistent grid: program ``p`` of ``P`` handles row blocks
    ``p, p + P, p + 2P, ...`` and writes its own fp32 partial sums of the weight (and bias) gradient, over all its
    rows, into row ``p`` of ``DW_PARTIAL`` (``DB_PARTIAL``); once all ``P`` rows are written, they are added up in
    a fixed order into ``DW`` (``DB``) by ``sum_partials_once_written``, with the counters ``SYNC``. No atomics
    touch the data, so the result is deterministic, and a program with no rows still writes its zeros.
    ``STATS`` are the forward's statistics: counters, then ``rstd`` for every row, then the means when ``CENTER``;
    ``SYNC`` holds the counters the programs use (``STATS`` itself, or fresh zeros: ``launch.norm_backward``).

    The row loop is pipelined: ``tl.range(..., num_stages=NUM_STAGES)`` makes the compiler prefetch the next row
    blocks' loads into shared memory (asynchronous copies on sm_80 and later) while the current block is
    computed; the weight is loaded once, outside the loop. The widest tiles (``REREAD_ROW``:
    ``launch.bwd_rereads_row``) are too big to keep whole in registers beside the accumulators: they read the
    weight per row block, and the row again after its reductions (``launch.BWD_TILE_LIVE_VALUES``). Programs
    stride over the row blocks rather than take a contiguous range each: the programs' row counts then differ by
    at most one block (ranges of ``ceil(blocks / P)`` can leave the last programs idle), and at any moment they
    read neighbouring rows. Wider rows take ``row_dot_kernel`` and ``column_bwd_kernel``."""
    counters = SYNC.to(tl.pointer_type(tl.int32), bitcast=True)
    tl.atomic_add(counters + STARTED, 1, sem="relaxed")
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    partial_row = pid.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if not REREAD_ROW:
        w_kept = _load_weight(W, cols, col_mask, HAS_WEIGHT, WEIGHT_OFFSET)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in tl.range(pid, n_row_blocks, n_programs, num_stages=NUM_STAGES):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        if REREAD_ROW:
            # The widest tiles: the weight is read again per row block (it stays in the caches) rather than held
            # in registers for the whole loop, where it would be one more live tile.
            w = _load_weight(W, cols, col_mask, HAS_WEIGHT, WEIGHT_OFFSET)
        else:
            w = w_kept
        rstd, mean = _load_stats(STATS + SYNC_SLOTS, rows, row_mask, n_rows, CENTER)
        dy, n, g, n_weighted = _input_grad_tile(DY, S, W, w, rows, cols, mask, rstd, mean, stride_dy, stride_s,
                                                HAS_WEIGHT, CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, CENTER)
        # The weight (and bias) gradient first: dy and the weighted row are then dead before the row reductions,
        # instead of live across them beside g and n (at 16384 bf16 elements that spilled 200-344 bytes).
        if HAS_WEIGHT:
            dw_acc += dy * n_weighted
        if HAS_BIAS:
            db_acc += dy
        if CENTER:
            g_mean = tl.sum(g, axis=1) / n_cols
        else:
            g_mean = rstd  # not read without CENTER
        c = tl.sum(g * n, axis=1) / n_cols
        if REREAD_ROW:
            # The widest tiles: the row, read just before, is read again rather than kept live across the
            # reductions (the tests pin the traffic this adds: 2 bytes per bf16 element).
            n = _normalised_row(S, rows, cols, mask, rstd, mean, stride_s, CENTER, LAST_READ=True)
        dx = _input_grad(g, n, c, g_mean, rstd, CENTER)
        _store_input_grad(dx, rstd, DSUM, DX, DRES, rows, cols, mask, stride_dsum, stride_dx, stride_dres,
                          HAS_DSUM, HAS_DRES, ROUND_BEFORE_DSUM)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    sum_partials_once_written(counters, DW_PARTIAL, DB_PARTIAL, DW, DB, n_programs, n_cols, n_cols, HAS_WEIGHT,
                               HAS_BIAS)


@jit_unspecialised
def row_dot_kernel(
    DY, S, STATS, W, ROW_MEANS,
    n_rows, n_cols,
    stride_dy, stride_s,
    HAS_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, CENTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The wide backward's first kernel: for ``BLOCK_M`` rows, the row reductions every column of the input
    gradient needs, ``c = mean(g * n)`` into ``ROW_MEANS[rows]`` and, when ``CENTER``, ``mean(g)`` into
    ``ROW_MEANS[n_rows + rows]`` (``g = dy * w``, ``n`` the normalised row). It reads ``dy`` and the norm's
    input once; ``column_bwd_kernel`` then makes the input gradient and the weight gradient in one more pass."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < n_rows
    rstd, mean = _load_stats(STATS + SYNC_SLOTS, rows, row_mask, n_rows, CENTER)
    dot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        w = _load_weight(W, cols, col_mask, HAS_WEIGHT, WEIGHT_OFFSET)
        dy, n, g, n_weighted = _input_grad_tile(DY, S, W, w, rows, cols, mask, rstd, mean, stride_dy, stride_s,
                                                HAS_WEIGHT, CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, CENTER)
        dot += g * n
        if CENTER:
            g_sum += g
    tl.store(ROW_MEANS + rows, tl.sum(dot, axis=1) / n_cols, mask=row_mask)
    if CENTER:
        tl.store(ROW_MEANS + n_rows + rows, tl.sum(g_sum, axis=1) / n_cols, mask=row_mask)


@jit_unspecialised
def column_bwd_kernel(
    DY, DSUM, S, STATS, ROW_MEANS, W, DX, DRES, DW_PARTIAL, DB_PARTIAL, DW, DB, SYNC,
    n_rows, n_cols, n_col_blocks, rows_per_group,
    stride_dy, stride_dsum, stride_s, stride_dx, stride_dres,
    HAS_DSUM: tl.constexpr, HAS_DRES: tl.constexpr, ROUND_BEFORE_DSUM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, CAST_TO_WEIGHT: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr, CENTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """The wide backward's second kernel: program ``p`` owns column block ``p % n_col_blocks`` of the row group
    ``p // n_col_blocks`` (``rows_per_group`` rows, a multiple of ``BLOCK_M``). It makes the input gradient of
    its tile from ``row_dot_kernel``'s reductions, reading ``dy``, the norm's input and ``dsum`` once, and sums
    its columns' weight (and bias) gradient over its rows in fp32 registers, written once into row ``group`` of
    ``DW_PARTIAL`` (``DB_PARTIAL``), which ``sum_partials_once_written`` adds up into ``DW`` (``DB``) once every
    program has written its own. No partial sum is read back per row, and no row is read more than twice in the
    whole backward (once here, once for the reductions)."""
    counters = SYNC.to(tl.pointer_type(tl.int32), bitcast=True)
    tl.atomic_add(counters + STARTED, 1, sem="relaxed")
    pid = tl.program_id(0)
    group = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = _load_weight(W, cols, col_mask, HAS_WEIGHT, WEIGHT_OFFSET)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first_row = group * rows_per_group
    last_row = tl.minimum(first_row + rows_per_group, n_rows)
    for row_start in tl.range(first_row, last_row, BLOCK_M, num_stages=NUM_STAGES):
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        rstd, mean = _load_stats(STATS + SYNC_SLOTS, rows, row_mask, n_rows, CENTER)
        c, g_mean = _load_stats(ROW_MEANS, rows, row_mask, n_rows, CENTER)
        dy, n, g, n_weighted = _input_grad_tile(DY, S, W, w, rows, cols, mask, rstd, mean, stride_dy, stride_s,
                                                HAS_WEIGHT, CAST_BEFORE_WEIGHT, CAST_TO_WEIGHT, CENTER)
        dx = _input_grad(g, n, c, g_mean, rstd, CENTER)
        _store_input_grad(dx, rstd, DSUM, DX, DRES, rows, cols, mask, stride_dsum, stride_dx, stride_dres,
                          HAS_DSUM, HAS_DRES, ROUND_BEFORE_DSUM)
        if HAS_WEIGHT:
            dw_acc += dy * n_weighted
        if HAS_BIAS:
            db_acc += dy
    partial = group.to(tl.int64) * n_cols + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial, tl.sum(db_acc, axis=0), mask=col_mask)
    sum_partials_once_written(counters, DW_PARTIAL, DB_PARTIAL, DW, DB, tl.num_programs(0) // n_col_blocks, n_cols,
                               n_cols, HAS_WEIGHT, HAS_BIAS)


# Not inlined: ptxas then allocates the row loops' registers apart from this code's. Inlined into the single-tile
# backward, it took the bf16 16384 tile from no spill to 40-72 bytes a thread (sm_90, Triton 3.6).
@triton.jit(noinline=True)
def sum_partials_once_written(
    SYNC, DW_PARTIAL, DB_PARTIAL, DW, DB, n_partials, n_cols, n_cols_b, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The backward's last step, run by every program of its launch after writing its partial weight-gradient
    row(s): ``DW = DW_PARTIAL.sum(0)`` over the ``n_partials`` rows of ``n_cols``, cast to ``DW``'s dtype, and the
    same for ``DB`` from ``DB_PARTIAL``'s rows of ``n_cols_b`` (the bias's gradient: ``n_cols`` again; the q/k
    backward of ``qk_kernels.py`` sums the key norm's weight gradient there), once all of them are written, in the
    order fixed by the shapes alone.

    Who sums. Each program counts itself into ``SYNC[STARTED]`` as it begins and into ``SYNC[WRITTEN]`` once its
    partial rows are written. A program that then finds every program started waits until every program has
    written, and claims pieces of ``REDUCE_BLOCK_N`` columns (``SYNC[CLAIMED]``) until none is left, summing
    each. The others leave. Waiting cannot deadlock: a program waits only once every program of the launch has
    started, so those it waits for hold their SMs already and reach their ``WRITTEN`` increment without waiting
    on anything. At least one program sums: the last to start finds every program started. On a GPU where the
    whole grid is resident at once (the persistent grids are sized so), every program takes part and the sum is
    spread over the SMs; in Triton's interpreter, which runs programs one after another, the last one does it
    all. Which program sums a piece changes nothing in it: each column's partials are added in row order, in
    ``[REDUCE_BLOCK_P, REDUCE_BLOCK_N]`` tiles folded by one ``tl.sum``, so the result is bitwise the same run to
    run (atomics only count; none touches the data).

    The counters' zero. They are the first elements of the forward's statistics (``modes.STATS_SYNC_SLOTS``),
    which the forward that wrote those zeroed, and the last program to count itself into ``SYNC[DONE]``, after
    which no program reads them, zeroes them again. Each backward therefore finds them zero, whatever ran before
    (retain_graph, CUDA graph replays of the backward alone), as long as two backwards of one forward's statistics
    do not run at once: the autograd engine runs a node's backward on the stream of its forward, one call after
    another, and the custom op (``norm_bwd``) leaves the statistics as it found them, which is what its schema
    (``mutates_args=()``) promises of its effect. A launch torch.compile traces gets fresh zeros instead
    (``launch.norm_backward``).

    Memory ordering (the pattern of CUTLASS's semaphores and CUDA's threadFenceReduction sample). A scalar atomic
    is performed by one thread of the program. Every thread's partial-row stores come before the barrier, and
    the barrier before that thread's release increment of ``WRITTEN``; a program whose acquire load finds
    ``WRITTEN == n_programs`` synchronises with every program's release, which is cumulative over what that
    program's threads stored before its barrier, and the barrier after the acquire orders its own other threads'
    loads after it. Those loads bypass L1 (``.cg``: L1 is not coherent between SMs; on AMD the acquire also
    invalidates the compute unit's vector cache, which the program's waves share), so no line of a partial row
    cached before it was written can be read."""
    n_programs = tl.num_programs(0)
    tl.debug_barrier()
    tl.atomic_add(SYNC + WRITTEN, 1, sem="release")
    if tl.atomic_add(SYNC + STARTED, 0, sem="relaxed") == n_programs:
        while tl.atomic_add(SYNC + WRITTEN, 0, sem="acquire") < n_programs:
            pass
        tl.debug_barrier()
        piece = tl.atomic_add(SYNC + CLAIMED, 1, sem="relaxed")
        while piece < tl.cdiv(tl.maximum(n_cols, n_cols_b), REDUCE_BLOCK_N):
            _sum_partial_columns(DW_PARTIAL, DB_PARTIAL, DW, DB, piece, n_partials, n_cols, n_cols_b, HAS_WEIGHT,
                                 HAS_BIAS)
            piece = tl.atomic_add(SYNC + CLAIMED, 1, sem="relaxed")
    if tl.atomic_add(SYNC + DONE, 1, sem="acq_rel") == n_programs - 1:
        tl.store(SYNC + tl.arange(0, SYNC_SLOTS), tl.zeros([SYNC_SLOTS], dtype=tl.int32))


@triton.jit
def _sum_partial_columns(
    DW_PARTIAL, DB_PARTIAL, DW, DB, piece, n_partials, n_cols, n_cols_b, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Columns ``piece * REDUCE_BLOCK_N`` onwards of ``DW = DW_PARTIAL.sum(0)`` (rows of ``n_cols``) and ``DB``
    (rows of ``n_cols_b``): the ``n_partials`` rows added ``REDUCE_BLOCK_P`` at a time into a
    ``[REDUCE_BLOCK_P, REDUCE_BLOCK_N]`` fp32 accumulator that one ``tl.sum`` folds at the end (``REDUCE_BLOCK_P``
    interleaved chains rather than one keep the fp32 rounding error small), read past L1
    (``sum_partials_once_written``)."""
    cols = piece * REDUCE_BLOCK_N + tl.arange(0, REDUCE_BLOCK_N)
    col_mask = cols < n_cols
    col_mask_b = cols < n_cols_b
    dw_acc = tl.zeros([REDUCE_BLOCK_P, REDUCE_BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([REDUCE_BLOCK_P, REDUCE_BLOCK_N], dtype=tl.float32)
    for start in range(0, n_partials, REDUCE_BLOCK_P):
        parts = (start + tl.arange(0, REDUCE_BLOCK_P)).to(tl.int64)
        part_mask = (parts < n_partials)[:, None]
        if HAS_WEIGHT:
            dw_acc += tl.load(DW_PARTIAL + parts[:, None] * n_cols + cols[None, :], mask=part_mask & col_mask[None, :],
                              other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            db_acc += tl.load(DB_PARTIAL + parts[:, None] * n_cols_b + cols[None, :],
                              mask=part_mask & col_mask_b[None, :], other=0.0, cache_modifier=".cg")
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(dw_acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db_acc, axis=0).to(DB.dtype.element_ty), mask=col_mask_b)
