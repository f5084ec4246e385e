"""Host side of the q/k norm + RoPE kernels (``qk_kernels.py``): their tiling, output allocation and launches.

The tiles hold a row's heads as ``[heads, half, half, pass]`` pieces (``qk_kernels``): each piece's width is
padded to a power of two, and a row (one head, or every head of a whole-projection norm) is one tile, at most
``QK_MAX_ROW_ELEMENTS`` padded elements; wider rows are refused (``checks.check_qk_norm_rope``), the caller then
runs the norms and its RoPE apart. Narrow rows (one head of 64 to 256) share a program, ``TARGET_TILE_ELEMENTS``
elements a tile as in the norm kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch.library import wrap_triton

from . import launch as norm_launch
from .launch import (
    BWD_MAX_PROGRAMS_PER_SM,
    BWD_REGISTERS_PER_THREAD,
    REGISTERS_PER_SM,
    TARGET_TILE_ELEMENTS,
    cdiv,
    is_traced,
    program_slots,
)
from .fast_launch import all_aligned, int_class
from .host_cache import host_cache
from .modes import STATS_SYNC_SLOTS, dtype_of, get_mode
from .qk_kernels import ROUND_BF16, ROUND_FP16, ROUND_FP32, qk_norm_rope_bwd_kernel, qk_norm_rope_fwd_kernel

# The widest row one tile holds, in padded elements (``qk_row_tile``): 64 heads of 128 (OLMo 2's and OLMo 3's
# projections have at most 40; the padding takes them to 64). Offline (Triton 3.6 and 3.9, sm_80 and sm_90,
# scripts/inspect_kernels.py) such tiles compile without spilling more than kernel_inspect.MAX_SPILL_BYTES.
QK_MAX_ROW_ELEMENTS = 8192
# The code of each dtype a norm's output can have, for the kernels (which no pointer tells the norm's dtype).
_ROUND_CODES = {torch.float32: ROUND_FP32.value, torch.bfloat16: ROUND_BF16.value, torch.float16: ROUND_FP16.value}


class RowTile(NamedTuple):
    """How one norm row lies in a tile: its heads (padded) and the padded widths of a head's pieces."""

    heads_block: int
    half_block: int
    pass_block: int  # 0 without a pass-through part

    @property
    def elements(self) -> int:
        return self.heads_block * (2 * self.half_block + self.pass_block)


@host_cache
def qk_row_tile(head_dim: int, rotary_dim: int, heads_in_row: int) -> RowTile:
    """The tile of a norm row of ``heads_in_row`` heads (1: a per-head norm) of ``head_dim``, the first
    ``rotary_dim`` columns of each rotated."""
    passed = head_dim - rotary_dim
    return RowTile(triton.next_power_of_2(heads_in_row), triton.next_power_of_2(rotary_dim // 2),
                   triton.next_power_of_2(passed) if passed else 0)


class QKPlan(NamedTuple):
    """The tiling of one q/k launch: each tensor's rows a program and row tile, the warps."""

    q_block_m: int
    k_block_m: int
    q_tile: RowTile
    k_tile: RowTile
    num_warps: int

    def constexprs(self) -> dict[str, int]:
        return dict(Q_BLOCK_M=self.q_block_m, K_BLOCK_M=self.k_block_m, Q_HEADS_BLOCK=self.q_tile.heads_block,
                    K_HEADS_BLOCK=self.k_tile.heads_block, HALF_BLOCK=self.q_tile.half_block,
                    PASS_BLOCK=max(1, self.q_tile.pass_block))  # a block of 1, never read, without a pass part


def _rows_a_program(tile: RowTile) -> int:
    # As tile_config: several narrow rows a program (each then has enough work), up to 64, a power of two.
    return 1 << (max(1, min(64, TARGET_TILE_ELEMENTS // tile.elements)).bit_length() - 1)


@functools.lru_cache(maxsize=None)
def qk_plan(head_dim: int, rotary_dim: int, q_heads_in_row: int, k_heads_in_row: int) -> QKPlan:
    """The plan of a launch on rows of ``q_heads_in_row`` / ``k_heads_in_row`` heads (1 each for per-head norms):
    about 16 elements a thread and tensor, 4 to 16 warps, as the norm kernels' ``tile_config``."""
    q_tile = qk_row_tile(head_dim, rotary_dim, q_heads_in_row)
    k_tile = qk_row_tile(head_dim, rotary_dim, k_heads_in_row)
    q_block_m, k_block_m = _rows_a_program(q_tile), _rows_a_program(k_tile)
    elements = max(q_block_m * q_tile.elements, k_block_m * k_tile.elements)
    return QKPlan(q_block_m, k_block_m, q_tile, k_tile, max(4, min(16, elements // 512)))


@host_cache  # torch.promote_types is an aten op, dispatched on every call
def qk_output_dtype(norm_dtype: torch.dtype, cos_dtype: torch.dtype) -> torch.dtype:
    """The dtype eager's ``n * cos + rotate_half(n) * sin`` returns for a norm output of ``norm_dtype``."""
    return torch.promote_types(norm_dtype, cos_dtype)


@host_cache
def qk_result_dtype(mode: str, x_dtype: torch.dtype, weight_dtype: torch.dtype | None, cos_dtype: torch.dtype,
                    rope_first: bool) -> torch.dtype:
    """The dtype of ``qk_norm_rope``'s output for an input of ``x_dtype``: the RoPE's (``qk_output_dtype``) of the
    norm's output, or, rotating first, the norm's output dtype for rows in the RoPE's dtype."""
    m = get_mode(mode)
    if rope_first:
        return m.output_dtype_of(qk_output_dtype(x_dtype, cos_dtype), weight_dtype, None)
    return qk_output_dtype(m.output_dtype_of(x_dtype, weight_dtype, None), cos_dtype)


def _rotation_constexprs(q_dtype: torch.dtype, k_dtype: torch.dtype, cos_dtype: torch.dtype, rope_first: bool,
                         negate_sin: bool) -> dict[str, bool]:
    """The kernels' ``ROPE_FIRST``, ``NEGATE_SIN`` and ``ROPE_IN_COS_DTYPE``: the rotated rows are in ``cos``'s
    dtype, not each input's own (``checks.check_qk_norm_rope`` admits only dtypes where the RoPE's dtype, their
    promotion, is either, for both q and k)."""
    own = (qk_output_dtype(q_dtype, cos_dtype), qk_output_dtype(k_dtype, cos_dtype)) == (q_dtype, k_dtype)
    return dict(ROPE_FIRST=rope_first, ROPE_IN_COS_DTYPE=rope_first and not own, NEGATE_SIN=negate_sin)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The batch, token and head strides of a ``[batch, tokens, heads, head_dim]`` tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _trig_strides(t: torch.Tensor) -> tuple[int, int]:
    """The batch and token strides of ``cos`` or ``sin`` (``[batch or 1, tokens, rotary_dim]``): 0 along a batch
    of one, which every row shares."""
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last dimension is contiguous (the kernels' loads are along it), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_in_row(t: torch.Tensor, per_head: bool) -> int:
    return 1 if per_head else int(t.shape[2])


class QKForwardLaunch:
    """The forward kernel's launch for one combination of dtypes (None: an absent weight), head layout, mode and
    flags: the output dtypes, the plan and the constexprs, worked out once by ``qk_forward_launch``, and the launch
    itself (calling it). Its identity keys its launches in the launcher's cache (``fast_launch.CachedLauncher``'s
    key by plan): it fixes every tensor's dtype (``sin``'s is ``cos``'s: ``checks.check_qk_norm_rope``), which
    pointers are None, the constexprs and ``num_warps``."""

    __slots__ = ("q_out_dtype", "k_out_dtype", "plan", "constexprs", "store_stats")

    def __init__(self, q_dtype: torch.dtype, k_dtype: torch.dtype, q_weight_dtype: torch.dtype | None,
                 k_weight_dtype: torch.dtype | None, cos_dtype: torch.dtype, head_dim: int, rotary_dim: int,
                 q_heads: int, k_heads: int, per_head: bool, mode: str, store_stats: bool, rope_first: bool,
                 negate_sin: bool) -> None:
        m = get_mode(mode)
        self.q_out_dtype = qk_result_dtype(mode, q_dtype, q_weight_dtype, cos_dtype, rope_first)
        self.k_out_dtype = qk_result_dtype(mode, k_dtype, k_weight_dtype, cos_dtype, rope_first)
        # The norm's output dtype: the result's, or (rotated after the norm) the norm's for the input.
        q_norm_dtype = self.q_out_dtype if rope_first else m.output_dtype_of(q_dtype, q_weight_dtype, None)
        k_norm_dtype = self.k_out_dtype if rope_first else m.output_dtype_of(k_dtype, k_weight_dtype, None)
        self.plan = qk_plan(head_dim, rotary_dim, 1 if per_head else q_heads, 1 if per_head else k_heads)
        self.store_stats = norm_launch.stats_flag(store_stats)
        self.constexprs = dict(
            HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, PER_HEAD=per_head,
            HAS_Q_WEIGHT=q_weight_dtype is not None, HAS_K_WEIGHT=k_weight_dtype is not None,
            CAST_BEFORE_WEIGHT=m.cast_before_weight, WEIGHT_OFFSET=m.weight_offset,
            Q_NORM_ROUND=_ROUND_CODES[q_norm_dtype], K_NORM_ROUND=_ROUND_CODES[k_norm_dtype],
            **_rotation_constexprs(q_dtype, k_dtype, cos_dtype, rope_first, negate_sin), **self.plan.constexprs())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, q_eps: float, k_eps: float,
                 per_head: bool, traced_kernel: object = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``qk_norm_rope_forward`` on arguments of this launch's combination. ``traced_kernel``: while torch.compile
        traces, ``wrap_triton(qk_norm_rope_fwd_kernel)``, which records the launch in the graph
        (``qk_norm_rope_forward`` spells it out: see ``launch._launch``)."""
        (qb, qt, qh, qd), (kb, kt, kh, kd) = q.stride(), k.stride()
        if qd != 1 or kd != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:  # the kernel loads along the last dims
            q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
            (qb, qt, qh, _), (kb, kt, kh, _) = q.stride(), k.stride()
        q_out = q.new_empty(q.shape, dtype=self.q_out_dtype)
        k_out = k.new_empty(k.shape, dtype=self.k_out_dtype)
        q_rows, k_rows = qk_rows(q, per_head), qk_rows(k, per_head)  # symbolic while torch.compile traces: rows vary
        stats = (torch.empty(qk_stats_shape(q, k, per_head), dtype=torch.float32, device=q.device)
                 if self.store_stats else None)
        plan = self.plan
        grid = cdiv(q_rows, plan.q_block_m) + cdiv(k_rows, plan.k_block_m)
        if grid == 0:
            return q_out, k_out, stats
        q_weight, k_weight = _contiguous(q_weight), _contiguous(k_weight)
        (qob, qot, qoh, _), (kob, kot, koh, _) = q_out.stride(), k_out.stride()
        (cb, ct), (sb, st) = _trig_strides(cos), _trig_strides(sin)
        tokens = q.shape[1]
        stats_arg = norm_launch.stats_argument(stats, q, q.get_device(), traced_kernel is not None)
        args = (q, k, q_weight, k_weight, cos, sin, q_out, k_out, stats_arg, q_rows, k_rows, q.shape[2], k.shape[2],
                tokens, qb, qt, qh, kb, kt, kh, qob, qot, qoh, kob, kot, koh, cb, ct, sb, st, q_eps, k_eps,
                self.store_stats)
        if traced_kernel is not None:
            norm_launch._launch(traced_kernel, grid, args, self.constexprs, plan.num_warps)
            return q_out, k_out, stats
        # The launcher's key by plan: this launch fixes the dtypes, the None pointers, the constexprs, the warps, the
        # head counts and head_dim (so the outputs' token and head strides); per call there remain the pointers'
        # alignment (unaligned ones, and an eps other than a float, take the key by arguments), the classes of the
        # integers that follow the token count, and the inputs' token and head strides, exact (a model repeats one
        # layout).
        by_plan = type(q_eps) is float and type(k_eps) is float and all_aligned(q, k, q_weight, k_weight, cos, sin,
                                                                                 q_out, k_out, stats_arg)
        varying = (tuple(map(int_class, (q_rows, k_rows, tokens, qb, kb, qob, kob, cb, sb))), qt, qh, kt, kh, ct, st)
        norm_launch._launch(qk_norm_rope_fwd_kernel, grid, args, self.constexprs, plan.num_warps,
                            self if by_plan else None, varying)
        return q_out, k_out, stats


@functools.lru_cache(maxsize=None)
def qk_forward_launch(q_dtype: torch.dtype, k_dtype: torch.dtype, q_weight_dtype: torch.dtype | None,
                      k_weight_dtype: torch.dtype | None, cos_dtype: torch.dtype, head_dim: int, rotary_dim: int,
                      q_heads: int, k_heads: int, per_head: bool, mode: str, store_stats: bool,
                      rope_first: bool = False, negate_sin: bool = False) -> QKForwardLaunch:
    """The ``QKForwardLaunch`` of one combination: a pure function of its arguments, cached (decode repeats a
    handful and is host-bound; the launcher's cache keys on the launch's identity)."""
    return QKForwardLaunch(q_dtype, k_dtype, q_weight_dtype, k_weight_dtype, cos_dtype, head_dim, rotary_dim,
                           q_heads, k_heads, per_head, mode, store_stats, rope_first, negate_sin)


def qk_norm_rope_forward(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, q_eps: float, k_eps: float, mode: str, per_head: bool,
    store_stats: bool = True, rope_first: bool = False, negate_sin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Runs the forward kernel on arguments ``checks.check_qk_norm_rope`` passed. Returns ``(q_out, k_out,
    stats)``: the outputs ``[batch, tokens, heads, head_dim]``, contiguous, and the statistics (None unless
    ``store_stats``): the counters, then fp32 ``rstd`` of q's rows and of k's. ``rope_first``: rotate, then
    normalise; ``negate_sin``: rotate by the opposite angle."""
    launch = qk_forward_launch(q.dtype, k.dtype, dtype_of(q_weight), dtype_of(k_weight), cos.dtype, int(q.shape[3]),
                               int(cos.shape[2]), int(q.shape[2]), int(k.shape[2]), per_head, mode, store_stats,
                               rope_first, negate_sin)
    if type(q) is not torch.Tensor and is_traced(q):  # the type test first: it is 20 times cheaper
        return launch(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, per_head, wrap_triton(qk_norm_rope_fwd_kernel))
    return launch(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, per_head)


def qk_norm_rope_backward(
    dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, stats: torch.Tensor, mode: str,
    per_head: bool, rope_first: bool = False, negate_sin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Runs the backward kernel (of the order ``rope_first`` names, the angle ``negate_sin`` names): ``(dq, dk, d q_weight, d k_weight)`` (None for an absent weight), the input
    gradients ``[batch, tokens, heads, head_dim]`` contiguous in the inputs' dtypes, the weight gradients in the
    weights' (summed in fp32, rounded once). ``stats`` must be as the forward returned them, their counters zero:
    the kernel counts on them and leaves them zero again (``kernels.sum_partials_once_written``)."""
    m = get_mode(mode)
    head_dim, rotary_dim = int(q.shape[3]), int(cos.shape[2])
    dq_out, dk_out, q, k, cos, sin = (_unit_last_stride(t) for t in (dq_out, dk_out, q, k, cos, sin))
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    q_rows, k_rows = qk_rows(q, per_head), qk_rows(k, per_head)  # symbolic while torch.compile traces: rows vary
    plan = qk_plan(head_dim, rotary_dim, _heads_in_row(q, per_head), _heads_in_row(k, per_head))
    q_blocks, k_blocks = cdiv(q_rows, plan.q_block_m), cdiv(k_rows, plan.k_block_m)
    device = q.device
    if q_blocks + k_blocks == 0:
        return dq, dk, _zeros_like(q_weight), _zeros_like(k_weight)
    programs_per_sm = min(BWD_MAX_PROGRAMS_PER_SM,
                          max(1, REGISTERS_PER_SM // (plan.num_warps * 32 * BWD_REGISTERS_PER_THREAD)))
    grid = min(program_slots(programs_per_sm, q.get_device()), max(q_blocks, k_blocks))
    q_width, k_width = _weight_width(q, per_head), _weight_width(k, per_head)
    dqw_partial = None if q_weight is None else torch.empty((grid, q_width), dtype=torch.float32, device=device)
    dkw_partial = None if k_weight is None else torch.empty((grid, k_width), dtype=torch.float32, device=device)
    dqw = None if q_weight is None else torch.empty_like(q_weight, memory_format=torch.contiguous_format)
    dkw = None if k_weight is None else torch.empty_like(k_weight, memory_format=torch.contiguous_format)
    # The counters: the statistics' own, or, while torch.compile traces, fresh zeros (launch.norm_backward).
    sync = torch.zeros(STATS_SYNC_SLOTS, dtype=stats.dtype, device=device) if is_traced(dq_out) else stats
    args = (dq_out, dk_out, q, k, _contiguous(q_weight), _contiguous(k_weight), cos, sin, stats.contiguous(), dq, dk,
            dqw_partial, dkw_partial, dqw, dkw, sync,
            q_rows, k_rows, int(q.shape[2]), int(k.shape[2]), q.shape[1],
            *_strides(dq_out), *_strides(dk_out), *_strides(q), *_strides(k), *_strides(dq), *_strides(dk),
            *_trig_strides(cos), *_trig_strides(sin))
    constexprs = dict(HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, PER_HEAD=per_head,
                      HAS_Q_WEIGHT=q_weight is not None, HAS_K_WEIGHT=k_weight is not None,
                      CAST_BEFORE_WEIGHT=m.cast_before_weight, WEIGHT_OFFSET=m.weight_offset,
                      **_rotation_constexprs(q.dtype, k.dtype, cos.dtype, rope_first, negate_sin),
                      **plan.constexprs())
    norm_launch._launch(wrap_triton(qk_norm_rope_bwd_kernel) if is_traced(dq_out) else qk_norm_rope_bwd_kernel,
                        grid, args, constexprs, plan.num_warps)
    return dq, dk, dqw, dkw


def qk_rows(t: torch.Tensor, per_head: bool) -> int:
    """Norm rows of a ``[batch, tokens, heads, head_dim]`` tensor: heads of tokens, or tokens."""
    tokens = t.shape[0] * t.shape[1]
    return tokens * t.shape[2] if per_head else tokens


def qk_stats_shape(q: torch.Tensor, k: torch.Tensor, per_head: bool) -> tuple[int]:
    """The shape of the statistics a forward saves: the counters, then ``rstd`` of every norm row of q and k."""
    return (STATS_SYNC_SLOTS + qk_rows(q, per_head) + qk_rows(k, per_head),)


def _weight_width(t: torch.Tensor, per_head: bool) -> int:
    return int(t.shape[3]) * (1 if per_head else int(t.shape[2]))


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    # The kernels index the weights with unit stride; contiguous() returns a contiguous tensor itself.
    return None if t is None else t.contiguous()


def _zeros_like(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.zeros_like(t)
