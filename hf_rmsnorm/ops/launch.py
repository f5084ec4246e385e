"""Host side of the Triton kernels: block-size heuristics, output allocation and launches.

Kept lean because decode calls these with a handful of rows, where host time is the whole cost: the
heuristics are cached per (width, dtype size, GPU architecture) and nothing is autotuned at run time (a GPU
sweep's winners are data: ``tuning.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton

from .fast_launch import CachedLauncher, all_aligned, int_class
from .kernels import column_bwd_kernel, norm_add_norm_fwd_kernel, norm_bwd_kernel, norm_fwd_kernel, row_dot_kernel
from .modes import STATS_SYNC_SLOTS, Mode, dtype_of, get_mode, sum_dtype
from .qk_kernels import qk_norm_rope_bwd_kernel, qk_norm_rope_fwd_kernel
from .tuning import PlanKey, device_arch, reads_tuned_plans, tuned, width_bucket

# Widest row kept whole in registers, as bytes of its activations' elements (so twice as many bf16 elements as
# fp32 ones); wider rows loop over column blocks of LOOP_BLOCK_N. Forward: 32768 bf16 elements compile without
# spills at 16 warps (offline, sm_80 and sm_90, Triton 3.9: 110-128 registers); fp32 rows of 32768 spill 8-24
# bytes there, so fp32 stops at 16384. Backward: bf16 rows of 16384 (Liger-Kernel's backward runs such a tile at
# 16 warps, one program per SM, the weight gradient in registers, at 2.1x the speed of our looped kernel on an
# H100: BENCHMARKS.md, run 3), fp32 rows of 8192; and within that, only as wide as bwd_max_tile_n's register rule.
FWD_MAX_TILE_BYTES = 65536
BWD_MAX_TILE_BYTES = 32768
# The single-tile backward keeps, for every element of its tile, fp32 values live across the row reductions: the
# gradient at the normalised row g and one accumulator per parameter gradient (weight, bias), and one more when
# centring (LayerNorm), as the compilers allocate them; the widest tiles (bwd_rereads_row) read the normalised row
# again after the reductions rather than keep it live too. At most BWD_TILE_LIVE_VALUES such values fit in a
# program's registers (16 warps at ptxas's 128 registers a thread hold 65536) with room for addresses and the
# reductions: offline (Triton 3.6 and 3.9, sm_80 and sm_90, BENCHMARKS.md) the variants within it spill at
# most 64 bytes a thread, while three values per element at 16384 (a bias gradient, or centring) spill up to 176
# bytes at Triton 3.6 on sm_90 (640 for LayerNorm with a bias), so those rows take the wide kernels.
BWD_TILE_LIVE_VALUES = 2 * 16384
BWD_BASE_LIVE_TILES = 2  # g and the weight gradient's accumulator: an RMSNorm with a weight, no bias
LOOP_BLOCK_N = 4096
# Elements per program for narrow rows: several rows share a program so each has enough work.
TARGET_TILE_ELEMENTS = 4096
# The backward's row loop is pipelined over up to BWD_MAX_STAGES row blocks (tl.range's num_stages), as many as
# keep the staging buffers, one [BLOCK_M, BLOCK_N] tile of dy, the norm's input and dsum per stage, within
# BWD_PIPELINE_SMEM_BYTES: an A100's 164 KiB of shared memory per block, less room for the reductions' scratch.
# The count is an upper bound: Triton allocates num_stages - 1 buffers (96 KiB for bf16 rows of 8192 with dsum
# and 3 stages, compiled offline with Triton 3.6 and 3.9). The widest tiles are not pipelined by default: with 2
# stages bf16 rows of 16384 take 128-160 KiB and spill 16-24 bytes on sm_90, 80-88 on sm_80 (Triton 3.9,
# BENCHMARKS.md); the tuner may pipeline them where that is faster on the card and spills at most 64 bytes.
BWD_MAX_STAGES = 3
BWD_PIPELINE_SMEM_BYTES = 160 * 1024
BWD_LOADED_TENSORS = 3
# The single-tile backward runs 16 warps a program whatever the tile: with 8 (the forward's choice for tiles of
# 4096 elements) ptxas held some pipelined variants to 128 registers and spilled 8 bytes (fp32 LayerNorm with a
# bias at width 4096 on Triton 3.9; bf16 at width 896 for sm_80 on 3.6); with 16 they take 58-110, no spill.
BWD_SINGLE_TILE_WARPS = 16
# Backward programs per SM: at most BWD_MAX_PROGRAMS_PER_SM, fewer where their registers or shared memory would
# not all be resident at once (a persistent grid wants every program running from the start). The register
# budget assumes ptxas's cap of BWD_REGISTERS_PER_THREAD; an SM has 64K registers and 228 KiB of shared memory on
# sm_90 (sm_80: 164 KiB).
BWD_MAX_PROGRAMS_PER_SM = 4
BWD_REGISTERS_PER_THREAD = 128
REGISTERS_PER_SM = 65536
SMEM_PER_SM_BYTES = 228 * 1024
# The looped forward (rows wider than its tile) re-reads each row's norm input, which its first pass has just
# written or read, from L2: its persistent grid keeps at most FWD_REREAD_L2_SHARE of the L2 in rows in flight (the
# streamed lines, x, the residual and y, pass through the rest), but never fewer programs than SMs. A non-persistent
# grid kept about 6 programs an SM busy on an H100, 52 MB of rows to re-read against 50 MB of L2, and reached 77%
# of the copy bandwidth at hidden 65536 (BENCHMARKS.md, run 3). Its first pass is pipelined over
# FWD_LOOP_STAGES column blocks.
FWD_REREAD_L2_SHARE = 0.5
FWD_LOOP_STAGES = 3
# The interpreter runs programs one after another; a few are enough to exercise the persistent grids (the
# backward's partial sums, the looped forward's row striding).
INTERPRET_PROGRAMS = 3


def fwd_max_tile_n(elem_bytes: int) -> int:
    """The forward's widest single tile, in elements of ``elem_bytes`` bytes."""
    return FWD_MAX_TILE_BYTES // elem_bytes


def bwd_live_tiles(has_weight: bool, has_bias: bool, mode: Mode) -> int:
    """The fp32 values the single-tile backward keeps live per element of its tile (``BWD_TILE_LIVE_VALUES``)."""
    return 1 + has_weight + has_bias + mode.centre


def bwd_max_tile_n(elem_bytes: int, live_tiles: int = BWD_BASE_LIVE_TILES) -> int:
    """The backward's widest single tile, in elements of ``elem_bytes`` bytes, for a variant keeping ``live_tiles``
    fp32 values live per element (``bwd_live_tiles``): a power of two."""
    by_registers = 1 << ((BWD_TILE_LIVE_VALUES // live_tiles).bit_length() - 1)
    return min(BWD_MAX_TILE_BYTES // elem_bytes, by_registers)


def bwd_rereads_row(plan: TilingPlan, elem_bytes: int) -> bool:
    """Whether the single-tile backward of ``plan`` reads each row again after its reductions and the weight per
    row block (``norm_bwd_kernel``'s ``REREAD_ROW``) rather than keep both live in registers: its tile holds
    ``BWD_MAX_TILE_BYTES`` of activations, the widest there is."""
    return plan.block_m * plan.block_n * elem_bytes >= BWD_MAX_TILE_BYTES


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


class TilingPlan(NamedTuple):
    """How a kernel is tiled and launched for one width, activation element size and GPU architecture
    (``forward_plan``, ``backward_plan``)."""

    block_m: int
    block_n: int
    single_tile: bool
    num_warps: int
    # Loads in flight in the pipelined loop (the backward's rows; the looped forward's first pass over the columns,
    # not tunable); 1: not pipelined.
    num_stages: int
    # The backward's persistent grid; None for the forward (forward_grid: by row blocks, or by L2 when looped).
    programs_per_sm: int | None


@reads_tuned_plans
@functools.lru_cache(maxsize=None)
def forward_plan(n_cols: int, elem_bytes: int, arch: str | None = None) -> TilingPlan:
    """The forward's tiling for rows of ``n_cols`` elements of ``elem_bytes`` bytes (the wider of ``x`` and the
    residual) on ``arch`` (``tuning.device_arch``; None on the CPU): ``tile_config``'s, with the tuned table's
    entry for ``arch`` applied where it has one. Rows up to ``fwd_max_tile_n`` are one tile."""
    max_tile_n = fwd_max_tile_n(elem_bytes)
    block_m, block_n, single_tile, num_warps = tile_config(n_cols, max_tile_n)
    default = TilingPlan(block_m, block_n, single_tile, num_warps, 1 if single_tile else FWD_LOOP_STAGES, None)
    return tuned(default, PlanKey(arch, "forward", elem_bytes, width_bucket(n_cols, max_tile_n)))


@reads_tuned_plans
@functools.lru_cache(maxsize=None)
def backward_plan(n_cols: int, elem_bytes: int, arch: str | None = None,
                  live_tiles: int = BWD_BASE_LIVE_TILES) -> TilingPlan:
    """The backward's tiling for rows of ``n_cols`` elements of ``elem_bytes`` bytes (the widest of the loaded
    activations: ``dy``, the norm's input, ``dsum``) on ``arch``, for a variant keeping ``live_tiles`` fp32 values
    live per element (``bwd_live_tiles``), with the tuned table's entry applied as in ``forward_plan``. Rows up to
    ``bwd_max_tile_n`` are one tile; wider rows take the two wide kernels (``row_dot_kernel``, then
    ``column_bwd_kernel`` over column blocks of ``LOOP_BLOCK_N``). Either's row loop is pipelined where its
    staging buffers fit; the plan's tile is the one the row loop stages. The table's width bucket of a single tile
    is its width; every wider row, whatever made it wider than its variant's tile, shares the wide kernels' one
    bucket (``width_bucket`` of the widest tile of any variant)."""
    max_tile_n = bwd_max_tile_n(elem_bytes, live_tiles)
    block_m, block_n, single_tile, num_warps = tile_config(n_cols, max_tile_n)
    widest_tile_n = bwd_max_tile_n(elem_bytes)
    key = PlanKey(arch, "backward", elem_bytes,
                  width_bucket(n_cols, widest_tile_n) if single_tile else 2 * widest_tile_n)
    if single_tile:
        num_warps = BWD_SINGLE_TILE_WARPS
    stage_bytes = BWD_LOADED_TENSORS * block_m * block_n * elem_bytes
    num_stages = max(1, min(BWD_MAX_STAGES, BWD_PIPELINE_SMEM_BYTES // stage_bytes))
    staged_bytes = stage_bytes * num_stages if num_stages > 1 else 0
    programs_per_sm = min(BWD_MAX_PROGRAMS_PER_SM,
                          REGISTERS_PER_SM // (num_warps * 32 * BWD_REGISTERS_PER_THREAD),
                          SMEM_PER_SM_BYTES // staged_bytes if staged_bytes else BWD_MAX_PROGRAMS_PER_SM)
    return tuned(TilingPlan(block_m, block_n, single_tile, num_warps, num_stages, max(1, programs_per_sm)), key)


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` stands for a tensor while torch.compile traces a graph (fake or functional), rather than holding
    data: the kernels' launches are then recorded in the graph instead of run."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


# ``torch.cuda.current_device()`` without its lazy-initialisation check, three Python calls at every launch: a launch
# on a GPU tensor finds CUDA initialised. A torch built without CUDA lacks the binding and never launches on a GPU.
_current_gpu = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

_LAUNCHERS = {kernel: CachedLauncher(kernel) for kernel in (
    norm_fwd_kernel, norm_add_norm_fwd_kernel, norm_bwd_kernel, row_dot_kernel, column_bwd_kernel,
    qk_norm_rope_fwd_kernel, qk_norm_rope_bwd_kernel,
)}


def _launch(kernel, grid: int, args: tuple, constexprs: dict, num_warps: int, plan: object = None,
            varying: tuple = (), device: int | None = None) -> None:
    """``kernel[(grid,)](*args, **constexprs, num_warps=num_warps)``; one of the kernels runs on the first tensor's
    GPU (``device``, its ``get_device()``, where the caller has it) through its ``CachedLauncher`` (looked up by
    ``plan`` and ``varying`` where given: see there). Anything else is launched as it is: above all the caller's
    ``wrap_triton(<kernel>)`` while a graph is traced (``is_traced``), which records the launch in the graph for
    inductor to make from its own code. The callers spell that call out with the kernel's name: torch finds a Triton
    op's kernels, which its compile caches key on, by reading the op's source for such calls."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
        return
    # Triton launches on the current GPU: switch to the first tensor's own (models split across GPUs) only when
    # it is another one. A CPU tensor (the interpreter) has device -1. Every kernel's first argument is a tensor.
    if device is None:
        device = args[0].get_device()
    if device < 0 or device == _current_gpu():
        launcher(grid, device, args, constexprs, num_warps, plan, varying)
        return
    with torch.cuda.device(device):
        launcher(grid, device, args, constexprs, num_warps, plan, varying)


def cdiv(a: int, b: int) -> int:
    # triton.cdiv goes through Triton's constexpr-function machinery: microseconds per call on the host.
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def forward_grid(tiling: TilingPlan, n_rows: int, n_cols: int, elem_bytes: int, device_index: int) -> int:
    """Programs of a forward launch of ``n_rows`` rows of ``n_cols`` elements of ``elem_bytes`` bytes (the norm's
    input, which the looped kernel re-reads) tiled as ``tiling`` (``forward_plan``) on GPU ``device_index`` (-1:
    the interpreter). Rows of one tile: one program per row block. Wider rows: a persistent grid of as many
    programs as keep ``FWD_REREAD_L2_SHARE`` of the GPU's L2 in rows in flight (one row block each), at least one
    per SM, at most one per row block; in the interpreter, ``INTERPRET_PROGRAMS``."""
    n_row_blocks = cdiv(n_rows, tiling.block_m)
    if tiling.single_tile:
        return n_row_blocks
    if device_index < 0:
        return min(n_row_blocks, INTERPRET_PROGRAMS)
    in_flight = int(FWD_REREAD_L2_SHARE * _l2_bytes(device_index)) // (tiling.block_m * n_cols * elem_bytes)
    return min(n_row_blocks, max(_sm_count(device_index), in_flight))


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
    # empty_like is about twice as cheap on the host as torch.empty(shape, dtype=, device=), and a quarter cheaper
    # again without keyword arguments: enough for a contiguous tensor of the same dtype, whose layout it keeps.
    if like.dtype == dtype and like.is_contiguous():
        return torch.empty_like(like)
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def _stats_left_alone(device_index: int) -> torch.Tensor:
    """The statistics argument of an eager forward that stores none, on GPU ``device_index`` (-1: the CPU):
    an fp32 tensor the kernel never touches (its ``store_stats`` is 0). A real pointer, rather than None, makes
    the launch bind the very compiled kernel that a forward storing them binds (``kernels.RUNTIME_FLAG_ARGS``).
    One per device, kept for the process: a CUDA graph may hold its address."""
    device = torch.device("cpu") if device_index < 0 else torch.device("cuda", device_index)
    return torch.empty(STATS_SYNC_SLOTS, dtype=torch.float32, device=device)


def stats_flag(store_stats: bool) -> int:
    """The kernels' ``store_stats`` argument, which the launch objects keep (and test) as it is passed: an int,
    which every Triton release and its interpreter take as a 32-bit integer (Triton 3.6's interpreter cannot pass a
    bool: it types it int1 and fails on numpy's 32 bits)."""
    return int(store_stats)


def stats_argument(stats: torch.Tensor | None, like: torch.Tensor, device_index: int, traced: bool) -> torch.Tensor:
    """What a forward launch passes for its statistics: ``stats`` where it stores them, otherwise a tensor the
    kernel leaves alone, on ``like``'s device (GPU ``device_index``): ``_stats_left_alone``'s, or, while a graph is
    traced, a fresh one (a traced graph takes no tensor from outside it)."""
    if stats is not None:
        return stats
    if traced:
        return like.new_empty(STATS_SYNC_SLOTS, dtype=torch.float32)
    return _stats_left_alone(device_index)


class ForwardLaunch:
    """The forward kernel's launch for one combination of argument dtypes (None: the tensor is absent), width, mode,
    flags and GPU architecture: the output dtypes, the tiling and the kernel flags, worked out once by
    ``forward_launch``, and the launch itself (calling it). Its identity keys its launches in the launcher's cache
    (``CachedLauncher``'s key by plan): it fixes every dtype, which pointers are None, the width, the constexprs and
    ``num_warps``."""

    __slots__ = ("mode", "y_dtype", "norm_dtype", "n_cols", "tiling", "num_warps", "single_tile_rows", "constexprs",
                 "store_stats", "y_like_x", "sum_like_x")

    def __init__(self, x_dtype: torch.dtype, residual_dtype: torch.dtype | None, weight_dtype: torch.dtype | None,
                 bias_dtype: torch.dtype | None, n_cols: int, mode: str, add_after: bool, store_stats: bool,
                 arch: str | None) -> None:
        m = get_mode(mode)
        self.mode = m
        self.norm_dtype = sum_dtype(x_dtype, residual_dtype)
        self.y_dtype = m.output_dtype_of(self.norm_dtype, weight_dtype, bias_dtype)
        self.n_cols = n_cols
        # The sum's dtype is the wider of x's and the residual's: the widest activation the forward loads.
        tiling = forward_plan(n_cols, self.norm_dtype.itemsize, arch)
        self.tiling, self.num_warps = tiling, tiling.num_warps
        # Rows of one tile: ``forward_grid``'s one program per BLOCK_M rows, worked out in the call (0: looped).
        self.single_tile_rows = tiling.block_m if tiling.single_tile else 0
        self.constexprs = dict(HAS_RESIDUAL=residual_dtype is not None, HAS_WEIGHT=weight_dtype is not None,
                               HAS_BIAS=bias_dtype is not None, **m.forward_kernel_flags,
                               BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, SINGLE_TILE=tiling.single_tile,
                               ADD_AFTER=add_after, NUM_STAGES=tiling.num_stages)
        self.store_stats = stats_flag(store_stats)
        # Whether an output of a contiguous x can be allocated like x (``_new_rows``), decided once here.
        self.y_like_x = self.y_dtype == x_dtype
        self.sum_like_x = self.norm_dtype == x_dtype

    def grid(self, n_rows: int, device_index: int) -> int:
        """Programs of a launch on ``n_rows`` rows on GPU ``device_index`` (-1: the interpreter): ``forward_grid``."""
        return forward_grid(self.tiling, n_rows, self.n_cols, self.norm_dtype.itemsize, device_index)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float, residual_after: torch.Tensor | None = None,
                 traced_kernel: object = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``norm_forward`` on arguments of this launch's combination, which the caller checked (``checks.py``).
        ``traced_kernel``: while torch.compile traces, ``wrap_triton(norm_fwd_kernel)``, which records the launch in
        the graph (``norm_forward`` spells it out: see ``_launch``)."""
        n_cols = self.n_cols
        contiguous = x.is_contiguous()
        # ``_new_rows``, with its test of the dtype made once.
        y = torch.empty_like(x) if self.y_like_x and contiguous else _new_rows(x, self.y_dtype)
        new_residual = None if residual is None else (
            torch.empty_like(x) if self.sum_like_x and contiguous else _new_rows(x, self.norm_dtype))
        stats = (torch.empty(self.mode.stats_shape(x.shape), dtype=torch.float32, device=x.device)
                 if self.store_stats else None)
        n_rows = y.numel() // n_cols if n_cols else 0
        if n_rows == 0:
            return y, new_residual, stats

        x2, stride_x = (x, n_cols) if contiguous else _as_rows(x, n_cols)
        added = residual if residual_after is None else residual_after
        # A pointer the kernel does not touch is None: no tensor reaches it twice, so a traced graph's outputs cannot
        # be confused with one another (torch.compile clones each tensor a traced kernel writes, one by one).
        r2, stride_r = (None, 0) if added is None else _as_rows(added, n_cols)
        # The kernels index weight and bias with unit stride (a strided view would be read wrongly, an expanded
        # one out of bounds); contiguous() returns a contiguous tensor itself, so the usual call copies nothing.
        weight = None if weight is None else weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        device = x.get_device()
        rows_per_program = self.single_tile_rows
        grid = -(-n_rows // rows_per_program) if rows_per_program else self.grid(n_rows, device)
        stats_arg = stats_argument(stats, x, device, traced_kernel is not None)
        # Outputs are fresh and contiguous: their row stride is n_cols.
        args = (x2, r2, weight, bias, y, new_residual, stats_arg, n_rows, n_cols, stride_x, stride_r, n_cols, n_cols,
                eps, self.store_stats)
        if traced_kernel is not None:
            _launch(traced_kernel, grid, args, self.constexprs, self.num_warps)
            return y, new_residual, stats
        # The launcher's key by plan: this launch fixes every dtype (residual_after's is the norm's output dtype,
        # which the key checks all the same), which pointers are None, n_cols, the constexprs and num_warps; per
        # call there remain the pointers' alignment and eps's type (unaligned pointers and an eps other than a
        # float, which the public ops pass and Triton never specialises, take the key by arguments), the row
        # count's class and the input row strides, exact (a model repeats a few).
        by_plan = type(eps) is float and all_aligned(x2, r2, weight, bias, y, new_residual, stats_arg)
        _launch(norm_fwd_kernel, grid, args, self.constexprs, self.num_warps, self if by_plan else None,
                (int_class(n_rows), stride_x, stride_r, dtype_of(residual_after)), device)
        return y, new_residual, stats


@reads_tuned_plans
@functools.lru_cache(maxsize=None)
def forward_launch(x_dtype: torch.dtype, residual_dtype: torch.dtype | None, weight_dtype: torch.dtype | None,
                   bias_dtype: torch.dtype | None, n_cols: int, mode: str, add_after: bool, store_stats: bool,
                   arch: str | None) -> ForwardLaunch:
    """The ``ForwardLaunch`` of one combination of argument dtypes, width, mode, flags (``add_after``:
    ``residual_after`` given) and GPU architecture (``tuning.device_arch``). A pure function of its arguments,
    cached: decode repeats a handful of combinations and is host-bound (working one out costs several microseconds,
    looking it up a fraction of one), and the launcher's cache keys on the launch's identity."""
    return ForwardLaunch(x_dtype, residual_dtype, weight_dtype, bias_dtype, n_cols, mode, add_after, store_stats,
                         arch)


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
    # A concrete width even where torch.compile traces it as symbolic (dynamic=True): the tiling depends on it, so
    # a compiled graph is specialised on it (and recompiled for another width); the rows may stay symbolic.
    n_cols = int(x.shape[-1])
    launch = forward_launch(x.dtype, dtype_of(residual), dtype_of(weight), dtype_of(bias), n_cols, mode,
                            residual_after is not None, store_stats, device_arch(x.get_device()))
    if type(x) is not torch.Tensor and is_traced(x):  # the type test first: it is 20 times cheaper
        return launch(x, residual, weight, bias, eps, residual_after, wrap_triton(norm_fwd_kernel))
    return launch(x, residual, weight, bias, eps, residual_after)


class SandwichLaunch:
    """``norm_add_norm_fwd_kernel``'s launch for one combination of argument dtypes (None: the tensor is absent),
    width, mode, ``store_stats`` and GPU architecture whose forward plan is a single tile: the tiling, the output
    dtypes and the kernel flags worked out once (``sandwich_launch``), and the launch itself (calling it). Its
    identity keys its launches in the launcher's cache, as ``ForwardLaunch``'s does: it fixes every dtype, which
    pointers are None, the width, the constexprs and ``num_warps``."""

    __slots__ = ("mode", "total_dtype", "y_dtype", "n_cols", "tiling", "constexprs", "store_stats")

    def __init__(self, residual_dtype: torch.dtype, weight2_dtype: torch.dtype | None,
                 bias2_dtype: torch.dtype | None, constexprs: dict, n_cols: int, mode: str, store_stats: bool,
                 tiling: TilingPlan) -> None:
        m = get_mode(mode)
        self.mode = m
        self.total_dtype = residual_dtype  # the first norm's output dtype, which the caller checked is this
        self.y_dtype = m.output_dtype_of(residual_dtype, weight2_dtype, bias2_dtype)
        self.n_cols, self.tiling, self.store_stats = n_cols, tiling, stats_flag(store_stats)
        self.constexprs = dict(constexprs, **m.forward_kernel_flags, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float, weight2: torch.Tensor | None, bias2: torch.Tensor | None,
                 eps2: float, traced_kernel: object = None) -> tuple[torch.Tensor, ...]:
        """``norm_add_norm_forward`` on arguments of this launch's combination, which the caller checked
        (``checks.py``); ``traced_kernel`` as ``ForwardLaunch``'s."""
        n_cols = self.n_cols
        total = _new_rows(x, self.total_dtype)
        y = _new_rows(total, self.y_dtype)
        stats, stats2 = (tuple(torch.empty(self.mode.stats_shape(x.shape), dtype=torch.float32, device=x.device)
                               for _ in range(2)) if self.store_stats else (None, None))
        n_rows = y.numel() // n_cols if n_cols else 0
        if n_rows == 0:
            return y, total, stats, stats2
        x2, stride_x = (x, n_cols) if x.is_contiguous() else _as_rows(x, n_cols)
        r2, stride_r = (residual, n_cols) if residual.is_contiguous() else _as_rows(residual, n_cols)
        # Unit stride for the parameters, as in ForwardLaunch (contiguous() of a contiguous tensor is itself).
        weight, bias, weight2, bias2 = (None if t is None else t.contiguous() for t in (weight, bias, weight2, bias2))
        device, traced = x.get_device(), traced_kernel is not None
        stats_arg, stats2_arg = (stats_argument(t, x, device, traced) for t in (stats, stats2))
        args = (x2, r2, weight, bias, total, stats_arg, weight2, bias2, y, stats2_arg, n_rows, n_cols, stride_x,
                stride_r, eps, eps2, self.store_stats)
        grid = cdiv(n_rows, self.tiling.block_m)
        if traced_kernel is not None:
            _launch(traced_kernel, grid, args, self.constexprs, self.tiling.num_warps)
            return y, total, stats, stats2
        # By plan as in ForwardLaunch: per call there remain the pointers' alignment, the eps values' type, the row
        # count's class and the input row strides.
        by_plan = type(eps) is float and type(eps2) is float and all_aligned(
            x2, r2, weight, bias, total, stats_arg, weight2, bias2, y, stats2_arg)
        _launch(norm_add_norm_fwd_kernel, grid, args, self.constexprs, self.tiling.num_warps,
                self if by_plan else None, (int_class(n_rows), stride_x, stride_r), device)
        return y, total, stats, stats2


@reads_tuned_plans
@functools.lru_cache(maxsize=None)
def sandwich_launch(x_dtype: torch.dtype, residual_dtype: torch.dtype, weight_dtype: torch.dtype | None,
                    bias_dtype: torch.dtype | None, weight2_dtype: torch.dtype | None, bias2_dtype: torch.dtype | None,
                    n_cols: int, mode: str, store_stats: bool, arch: str | None) -> SandwichLaunch | None:
    """The ``SandwichLaunch`` of one combination (a pure function of its arguments, cached as ``forward_launch``),
    or None where the forward's plan for the width and the wider of the two activations is not a single tile."""
    tiling = forward_plan(n_cols, max(x_dtype.itemsize, residual_dtype.itemsize), arch)
    if not tiling.single_tile:
        return None
    present = dict(HAS_WEIGHT=weight_dtype is not None, HAS_BIAS=bias_dtype is not None,
                   HAS_WEIGHT2=weight2_dtype is not None, HAS_BIAS2=bias2_dtype is not None)
    return SandwichLaunch(residual_dtype, weight2_dtype, bias2_dtype, present, n_cols, mode, store_stats, tiling)


def norm_add_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    weight2: torch.Tensor | None,
    bias2: torch.Tensor | None,
    eps2: float,
    mode: str,
    store_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, total, stats, stats2)`` with ``total = residual + norm(x)`` (``norm_forward`` with ``residual_after``:
    ``residual`` of ``x``'s shape and of the norm's output dtype) and ``y = norm2(total)`` (``weight2``, ``bias2``,
    ``eps2``, the same mode), ``stats`` and ``stats2`` each norm's statistics (None unless ``store_stats``). One
    launch of ``norm_add_norm_fwd_kernel`` where the forward's plan for the sum's width and dtype is a single tile
    (``sandwich_launch``); wider rows take ``norm_forward`` twice, which computes the same values (each kernel
    rounds where the other does)."""
    n_cols = int(x.shape[-1])  # concrete, as in norm_forward
    launch = sandwich_launch(x.dtype, residual.dtype, dtype_of(weight), dtype_of(bias), dtype_of(weight2),
                             dtype_of(bias2), n_cols, mode, store_stats, device_arch(x.get_device()))
    if launch is None:
        total, _, stats = norm_forward(x, None, weight, bias, eps, mode, residual_after=residual,
                                       store_stats=store_stats)
        y, _, stats2 = norm_forward(total, None, weight2, bias2, eps2, mode, store_stats=store_stats)
        return y, total, stats, stats2
    if type(x) is not torch.Tensor and is_traced(x):
        return launch(x, residual, weight, bias, eps, weight2, bias2, eps2, wrap_triton(norm_add_norm_fwd_kernel))
    return launch(x, residual, weight, bias, eps, weight2, bias2, eps2)


def program_slots(programs_per_sm: int, device_index: int) -> int:
    """Programs a persistent grid of ``programs_per_sm`` programs an SM holds on GPU ``device_index`` (-1: the
    interpreter, which runs programs one after another: ``INTERPRET_PROGRAMS``)."""
    return INTERPRET_PROGRAMS if device_index < 0 else _sm_count(device_index) * programs_per_sm


def backward_grid(tiling: TilingPlan, n_rows: int, n_cols: int, device_index: int) -> tuple[int, int, int]:
    """``(programs, partial rows, rows per group)`` of a backward launch of ``n_rows`` rows of ``n_cols`` elements
    tiled as ``tiling`` (``backward_plan``) on GPU ``device_index`` (-1: the interpreter, which runs programs one
    after another: ``INTERPRET_PROGRAMS`` do). The persistent grid holds ``tiling.programs_per_sm`` programs an SM.
    A single tile: one program and one partial row per slot, at most one per row block (rows per group: 0, unused).
    Wider rows: row groups of ``rows per group`` rows (a multiple of the tile's rows) times column blocks fill the
    slots, each group writing one partial row."""
    n_row_blocks = cdiv(n_rows, tiling.block_m)
    slots = program_slots(tiling.programs_per_sm, device_index)
    if tiling.single_tile:
        n_partials = min(n_row_blocks, slots)
        return n_partials, n_partials, 0
    n_col_blocks = cdiv(n_cols, tiling.block_n)
    rows_per_group = cdiv(n_row_blocks, max(1, min(n_row_blocks, slots // n_col_blocks))) * tiling.block_m
    n_partials = cdiv(n_rows, rows_per_group)
    return n_partials * n_col_blocks, n_partials, rows_per_group


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
    round_before_dsum: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Runs the backward: ``norm_bwd_kernel`` for rows of one tile, one launch; ``row_dot_kernel`` then
    ``column_bwd_kernel`` for wider ones, whose programs end by summing the weight (and bias) gradient. Returns
    ``(dx, dresidual, dweight, dbias)``; ``dresidual`` is only allocated when its dtype differs from ``dx``'s
    (otherwise the caller reuses ``dx``); ``dweight`` is None without a weight. ``dsum`` is added to the input
    gradient in fp32 before its one rounding, or, with ``round_before_dsum``, after the input gradient is rounded to
    ``dx_dtype`` (the sum autograd's accumulation of the two gradients gives: ``norm_add_norm``'s backward).

    ``stats`` must be as a forward returned them, their counters zero (``modes.STATS_SYNC_SLOTS``; autograd
    always passes them so): the kernels count on them and leave them zero again."""
    shape = norm_input.shape
    n_cols = int(shape[-1])  # concrete, as in the forward
    device = norm_input.device
    dx = _new_rows(norm_input, dx_dtype)
    dres = None if dres_dtype is None else _new_rows(norm_input, dres_dtype)
    n_rows = norm_input.numel() // n_cols if n_cols else 0
    elem_bytes = max(t.element_size() for t in (dy, norm_input, dsum) if t is not None)
    m = get_mode(mode)
    plan = backward_plan(n_cols, elem_bytes, device_arch(norm_input.get_device()),
                         bwd_live_tiles(weight is not None, bias_dtype is not None, m))
    n_row_blocks = cdiv(n_rows, plan.block_m)
    if n_row_blocks == 0 or n_cols == 0:
        dweight = None if weight is None else torch.zeros_like(weight)
        dbias = None if bias_dtype is None else torch.zeros(n_cols, dtype=bias_dtype, device=device)
        return dx, dres, dweight, dbias

    grid, n_partials, rows_per_group = backward_grid(plan, n_rows, n_cols, dy.get_device())
    dw_partial = None if weight is None else torch.empty((n_partials, n_cols), dtype=torch.float32, device=device)
    db_partial = None if bias_dtype is None else torch.empty((n_partials, n_cols), dtype=torch.float32, device=device)
    dweight = None if weight is None else torch.empty_like(weight)
    dbias = None if bias_dtype is None else torch.empty(n_cols, dtype=bias_dtype, device=device)

    dy2, stride_dy = _as_rows(dy, n_cols)
    s2, stride_s = _as_rows(norm_input, n_cols)
    weight = None if weight is None else weight.contiguous()  # unit stride, as in the forward
    stats = stats.contiguous()
    # The counters the kernels count on: the statistics' own (modes.STATS_SYNC_SLOTS), or, while torch.compile
    # traces the launch, fresh zeros: the statistics are an input of the traced backward graph, and torch's
    # analysis of the kernel would find them written and copy them back.
    sync = torch.zeros(STATS_SYNC_SLOTS, dtype=stats.dtype, device=device) if is_traced(dy) else stats
    dsum2, stride_dsum = (None, 0) if dsum is None else _as_rows(dsum, n_cols)  # None: untouched, as in the forward
    flags = m.kernel_flags
    gradients = dict(HAS_DSUM=dsum is not None, HAS_DRES=dres is not None,
                     ROUND_BEFORE_DSUM=round_before_dsum and dsum is not None, HAS_WEIGHT=weight is not None,
                     HAS_BIAS=bias_dtype is not None, **flags, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                     NUM_STAGES=plan.num_stages)
    if plan.single_tile:
        _launch(
            wrap_triton(norm_bwd_kernel) if is_traced(dy) else norm_bwd_kernel, grid,
            (dy2, dsum2, s2, stats, weight, dx, dres, dw_partial, db_partial, dweight, dbias, sync,
             n_rows, n_cols, n_row_blocks,
             stride_dy, stride_dsum, stride_s, n_cols, n_cols),
            dict(gradients, REREAD_ROW=bwd_rereads_row(plan, elem_bytes)), plan.num_warps,
        )
    else:
        # The rows' reductions first (mean(g * n), and mean(g) when centring), then every column from them.
        row_means = torch.empty(((2 if flags["CENTER"] else 1) * n_rows,), dtype=torch.float32, device=device)
        _launch(
            wrap_triton(row_dot_kernel) if is_traced(dy) else row_dot_kernel, n_row_blocks,
            (dy2, s2, stats, weight, row_means, n_rows, n_cols, stride_dy, stride_s),
            dict(HAS_WEIGHT=weight is not None, **flags, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n),
            plan.num_warps,
        )
        _launch(
            wrap_triton(column_bwd_kernel) if is_traced(dy) else column_bwd_kernel, grid,
            (dy2, dsum2, s2, stats, row_means, weight, dx, dres, dw_partial, db_partial, dweight, dbias, sync,
             n_rows, n_cols, cdiv(n_cols, plan.block_n), rows_per_group,
             stride_dy, stride_dsum, stride_s, n_cols, n_cols),
            gradients, plan.num_warps,
        )
    return dx, dres, dweight, dbias
