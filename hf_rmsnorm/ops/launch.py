"""Host side of the Triton kernels: block-size heuristics, output allocation and launches.

Kept lean because decode calls these with a handful of rows, where host time is the whole cost: the
heuristics are cached per (width, dtype size) and nothing is autotuned.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton

from .fast_launch import CachedLauncher
from .kernels import norm_bwd_kernel, norm_fwd_kernel
from .modes import Mode, dtype_of, get_mode, sum_dtype

# Widest row (in elements) kept whole in registers; wider rows loop over column blocks of LOOP_BLOCK_N.
# The backward keeps more values live per element (dy, n, g and the weight-gradient accumulator).
FWD_MAX_TILE_N = 16384
BWD_MAX_TILE_N = 8192
LOOP_BLOCK_N = 4096
# Elements per program for narrow rows: several rows share a program so each has enough work.
TARGET_TILE_ELEMENTS = 4096
# Backward programs per SM: each keeps its own weight-gradient partials, summed on the host.
BWD_PROGRAMS_PER_SM = 4
# The interpreter runs programs one after another; a few are enough to exercise the partial sums.
INTERPRET_BWD_PROGRAMS = 3


@functools.lru_cache(maxsize=None)
def tile_config(n_cols: int, max_tile_n: int) -> tuple[int, int, bool, int]:
    """``(BLOCK_M, BLOCK_N, SINGLE_TILE, num_warps)`` for rows of ``n_cols`` elements."""
    block_n = triton.next_power_of_2(n_cols)
    if block_n > max_tile_n:
        return 1, LOOP_BLOCK_N, False, 8
    block_m = max(1, min(64, TARGET_TILE_ELEMENTS // block_n))
    # About 16 elements (two 128-bit bf16 loads) per thread and tensor, between 4 and 16 warps.
    num_warps = max(4, min(16, block_m * block_n // 512))
    return block_m, block_n, True, num_warps


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` stands for a tensor while torch.compile traces a graph (fake or functional), rather than holding
    data: the kernels' launches are then recorded in the graph instead of run."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


_LAUNCHERS = {kernel: CachedLauncher(kernel) for kernel in (norm_fwd_kernel, norm_bwd_kernel)}


def _launch(kernel, grid: int, args: tuple, constexprs: dict, num_warps: int) -> None:
    """``kernel[(grid,)](*args, **constexprs, num_warps=num_warps)``; one of the kernels runs on the first tensor's
    GPU through its ``CachedLauncher``. Anything else is launched as it is: above all the caller's
    ``wrap_triton(<kernel>)`` while a graph is traced (``is_traced``), which records the launch in the graph for
    inductor to make from its own code. The callers spell that call out with the kernel's name: torch finds a
    Triton op's kernels, which its compile caches key on, by reading the op's source for such calls."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
        return
    with _on_device(args[0]):
        launcher(grid, args, constexprs, num_warps)


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv goes through Triton's constexpr-function machinery: microseconds per call on the host.
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _as_rows(t: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int]:
    """``t`` as rows of ``n_cols`` with a contiguous last dim, and the row stride; copies only when no such
    view exists. A contiguous tensor (the common case) goes through untouched: a view costs a microsecond."""
    if t.is_contiguous():
        return t, n_cols
    t = t.reshape(-1, n_cols)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


def _new_rows(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # empty_like is about twice as cheap on the host as torch.empty(shape, dtype=, device=).
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


class _on_device:
    """Launches on the tensor's own GPU (models split across GPUs) without a context switch when it is
    already the current one."""

    __slots__ = ("guard",)

    def __init__(self, t: torch.Tensor):
        index = t.device.index
        self.guard = (
            torch.cuda.device(index) if t.is_cuda and index is not None and index != torch.cuda.current_device()
            else None
        )

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


class _ForwardPlan(NamedTuple):
    """What a forward launch depends on besides the tensors' addresses and row count."""

    mode: Mode
    y_dtype: torch.dtype
    norm_dtype: torch.dtype
    block_m: int
    num_warps: int
    constexprs: dict


@functools.lru_cache(maxsize=None)
def _forward_plan(x_dtype: torch.dtype, residual_dtype: torch.dtype | None, weight_dtype: torch.dtype | None,
                  bias_dtype: torch.dtype | None, n_cols: int, mode: str, add_after: bool,
                  store_stats: bool) -> _ForwardPlan:
    """The forward's dtypes, tiling and kernel flags for one combination of argument dtypes, width and flags.
    A pure function of its arguments, cached because decode repeats a handful of combinations and is host-bound:
    computing them costs several microseconds, looking them up a fraction of one."""
    m = get_mode(mode)
    norm_dtype = sum_dtype(x_dtype, residual_dtype)
    block_m, block_n, single_tile, num_warps = tile_config(n_cols, FWD_MAX_TILE_N)
    constexprs = dict(HAS_RESIDUAL=residual_dtype is not None, HAS_WEIGHT=weight_dtype is not None,
                      HAS_BIAS=bias_dtype is not None, **m.kernel_flags,
                      BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_TILE=single_tile, ADD_AFTER=add_after,
                      STORE_STATS=store_stats)
    return _ForwardPlan(m, m.output_dtype_of(norm_dtype, weight_dtype, bias_dtype), norm_dtype, block_m,
                        num_warps, constexprs)


def norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mode: str,
    residual_after: torch.Tensor | None = None,
    store_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Runs the forward kernel. Returns ``(y, residual + x or None, stats)``: fp32 ``rstd`` of shape
    ``x.shape[:-1]``, stacked with the row means in ``"layernorm"`` mode; None unless ``store_stats`` (only the
    backward reads them). With ``residual_after`` (of ``x``'s shape and of the norm's output dtype; ``residual``
    then None), ``y`` is ``residual_after + norm(x)``."""
    shape = x.shape
    # A concrete width even where torch.compile traces it as symbolic (dynamic=True): the tiling depends on it, so
    # a compiled graph is specialised on it (and recompiled for another width); the rows may stay symbolic.
    n_cols = int(shape[-1])
    plan = _forward_plan(x.dtype, dtype_of(residual), dtype_of(weight), dtype_of(bias), n_cols, mode,
                         residual_after is not None, store_stats)
    y = _new_rows(x, plan.y_dtype)
    new_residual = None if residual is None else _new_rows(x, plan.norm_dtype)
    stats = (torch.empty(plan.mode.stats_shape(shape), dtype=torch.float32, device=x.device) if store_stats
             else None)
    n_rows = y.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        return y, new_residual, stats

    x2, stride_x = _as_rows(x, n_cols)
    added = residual if residual_after is None else residual_after
    # A pointer the kernel does not touch is None: no tensor reaches it twice, so a traced graph's outputs cannot
    # be confused with one another (torch.compile clones each tensor a traced kernel writes, one by one).
    r2, stride_r = (None, 0) if added is None else _as_rows(added, n_cols)
    # The kernels index weight and bias with unit stride (a strided view would be read wrongly, an expanded
    # one out of bounds); contiguous() returns a contiguous tensor itself, so the usual call copies nothing.
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    # Outputs are fresh and contiguous: their row stride is n_cols.
    _launch(
        wrap_triton(norm_fwd_kernel) if is_traced(x) else norm_fwd_kernel, _cdiv(n_rows, plan.block_m),
        (x2, r2, weight, bias, y, new_residual, stats,
         n_rows, n_cols,
         stride_x, stride_r, n_cols, n_cols,
         eps),
        plan.constexprs,
        plan.num_warps,
    )
    return y, new_residual, stats


def norm_backward(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    norm_input: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor | None,
    bias_dtype: torch.dtype | None,
    mode: str,
    dx_dtype: torch.dtype,
    dres_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Runs the backward kernel. Returns ``(dx, dresidual, dweight, dbias)``; ``dresidual`` is only
    allocated when its dtype differs from ``dx``'s (otherwise the caller reuses ``dx``); ``dweight`` is None
    without a weight."""
    shape = norm_input.shape
    n_cols = int(shape[-1])  # concrete, as in the forward
    device = norm_input.device
    dx = _new_rows(norm_input, dx_dtype)
    dres = None if dres_dtype is None else _new_rows(norm_input, dres_dtype)
    n_rows = norm_input.numel() // n_cols if n_cols else 0
    block_m, block_n, single_tile, num_warps = tile_config(n_cols, BWD_MAX_TILE_N)
    n_row_blocks = _cdiv(n_rows, block_m)
    if n_row_blocks == 0 or n_cols == 0:
        dweight = None if weight is None else torch.zeros_like(weight)
        dbias = None if bias_dtype is None else torch.zeros(n_cols, dtype=bias_dtype, device=device)
        return dx, dres, dweight, dbias

    if not dy.is_cuda:  # Triton's interpreter (launch.py only runs on the CPU there)
        n_programs = min(n_row_blocks, INTERPRET_BWD_PROGRAMS)
    else:
        n_programs = min(n_row_blocks, _sm_count(device.index or 0) * BWD_PROGRAMS_PER_SM)
    row_blocks_per_program = _cdiv(n_row_blocks, n_programs)
    dw_partial = None if weight is None else torch.empty((n_programs, n_cols), dtype=torch.float32, device=device)
    db_partial = None if bias_dtype is None else torch.empty((n_programs, n_cols), dtype=torch.float32, device=device)

    dy2, stride_dy = _as_rows(dy, n_cols)
    s2, stride_s = _as_rows(norm_input, n_cols)
    weight = None if weight is None else weight.contiguous()  # unit stride, as in the forward
    stats = stats.contiguous()
    dsum2, stride_dsum = (None, 0) if dsum is None else _as_rows(dsum, n_cols)  # None: untouched, as in the forward
    _launch(
        wrap_triton(norm_bwd_kernel) if is_traced(dy) else norm_bwd_kernel, n_programs,
        (dy2, dsum2, s2, stats, weight, dx, dres, dw_partial, db_partial,
         n_rows, n_cols, n_row_blocks, row_blocks_per_program,
         stride_dy, stride_dsum, stride_s, n_cols, n_cols),
        dict(HAS_DSUM=dsum is not None, HAS_DRES=dres is not None, HAS_WEIGHT=weight is not None,
             HAS_BIAS=bias_dtype is not None,
             **get_mode(mode).kernel_flags, BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_TILE=single_tile),
        num_warps,
    )
    dweight = None if dw_partial is None else dw_partial.sum(0).to(weight.dtype)
    dbias = None if db_partial is None else db_partial.sum(0).to(bias_dtype)
    return dx, dres, dweight, dbias
