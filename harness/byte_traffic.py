"""Counts the global-memory bytes each kernel variant moves, without a GPU: a proxy for the bandwidth a kernel can
reach, since these kernels are memory-bound and a GPU run can only get close to copy bandwidth when the kernel
moves close to the minimum bytes.

The kernels run in Triton's CPU interpreter (``hf_rmsnorm.ops.backend.configure("cpu")`` first), called through
the functional ops as a patched model calls them, with two of the interpreter's internals wrapped for the duration:

* ``GridExecutor.__call__`` (one kernel launch): records the launch's tensor arguments by parameter name, so every
  access can be attributed to the tensor it falls in;
* ``InterpreterBuilder.create_masked_load`` / ``create_masked_store``, through which every ``tl.load`` and
  ``tl.store`` goes (unmasked ones and block pointers too, and atomic loads and stores where the interpreter has
  them), and ``create_atomic_rmw`` / ``create_atomic_cas`` (a read and a write each): the elements under the
  mask times the element size.

Both have this shape from Triton 3.2 to 3.9 (a release without them gets a one-line error, not a wrong count).
What is counted is *accesses*: a row read twice counts twice even where the second read hits L2 on a GPU, which is
the traffic the kernel asks the memory system for. The weight and bias are the exception: hidden-sized, read by
every row, they stay in L1/L2, so each is counted once per call, by the bytes of it that were touched
(``cached_reads`` says how many times they were read).

Each variant runs at ``rows`` and ``2 * rows`` rows. The **per-row ratio** (``(bytes(2R) - bytes(R))`` over the
same difference of the minimum) is what a kernel costs in the steady state of a large launch: per-launch costs
(the weight, the backward's per-program weight-gradient partial rows, written once and summed once) cancel, so it
does not depend on the interpreter running 3 backward programs where a GPU runs hundreds. The **call ratio** is
the whole call at ``2 * rows`` rows, per-launch costs included. The minimum is ``kernel_bench.min_traffic_bytes``,
shared with the GPU benchmark (the per-row fp32 ``rstd``, 4 bytes per row, is left out of it there too).

``run_byte_traffic`` is what ``scripts/byte_traffic.py`` runs.

Usage::

    python scripts/byte_traffic.py
    python scripts/byte_traffic.py --hidden 16384 --variant bwd+dsum --json traffic.json
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from hf_rmsnorm.ops import backend
from . import kernel_bench
from .kernel_inspect import QK_K_HEADS, QK_Q_HEADS

# Calls whose kernels are counted, named as kernel_inspect names the launches they make: "infer" a forward without
# autograd, "fwd" with it (it also writes the statistics), "bwd" the backward alone; "+res" with the residual add,
# "+dsum" the backward of a fused add, "+bias" with a bias.
# The q/k norms fused with the RoPE (qk_norm_rope), as kernel_inspect names them: per-head norms over heads of
# ``hidden`` with Qwen3-8B's query and key head counts, ``cos``/``sin`` of ``hidden`` columns; their rows are tokens,
# their bytes per element per element of a token's q and k.
QK_VARIANTS = ("qk-infer", "qk-fwd", "qk-bwd")
# A sandwich norm's norm, add and next norm (norm_add_norm: ``s = residual + norm(x); y = norm2(s)``), as a Gemma 2-4
# layer calls it: one launch for rows of one tile, the two existing launches wider. Its backward chains the two
# norms' backward kernels, the second of which also adds the gradient from the sum's other readers.
SANDWICH_VARIANTS = ("sandwich-infer", "sandwich-fwd", "sandwich-bwd")
VARIANTS = ("infer", "infer+res", "fwd", "fwd+res", "fwd+bias", "fwd+res+bias", "bwd", "bwd+dsum", "bwd+dsum+bias",
            *QK_VARIANTS, *SANDWICH_VARIANTS)
DEFAULT_VARIANTS = ("infer", "infer+res", "bwd", "bwd+dsum")
DEFAULT_HIDDEN = (1024, 4096, 8192, 16384, 65536)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# About this many elements per run keeps each variant to seconds in the interpreter; at least MIN_ROWS rows, so
# that even one-row tiles give the backward as many programs at ``rows`` as at ``2 * rows`` (the interpreter
# launches up to 3): the per-launch costs then cancel in the per-row figure.
TARGET_ELEMENTS = 16384
MIN_ROWS = 4
EPS = 1e-6


# The interpreter's memory operations the counter wraps (every tl.load/tl.store, and the atomics).
_WRAPPED = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")


class UncountedAccess(RuntimeError):
    """A kernel touched memory outside its tensor arguments: the count would be wrong, so none is given."""


# ------------------------------------------------------------------------------------------------ counting


@dataclass
class _Launch:
    """One launch's tensor arguments as sorted address ranges, and the bytes counted against each."""

    kernel: str
    grid: tuple
    names: list[str]
    starts: np.ndarray
    ends: np.ndarray
    cached: list[bool]
    loaded: Counter = field(default_factory=Counter)
    stored: Counter = field(default_factory=Counter)
    touched: dict[str, np.ndarray] = field(default_factory=dict)

    def size_bytes(self, name: str) -> int:
        i = self.names.index(name)
        return int(self.ends[i] - self.starts[i])

    def touched_bytes(self, name: str) -> int:
        touched = self.touched[name]
        return self.size_bytes(name) // touched.size * int(touched.sum())


class TrafficCounter:
    """Counts the bytes every interpreted kernel launch loads and stores while ``counting()`` is active.

    ``cached_ptrs`` are the addresses of the tensors counted once per call by their touched bytes (weight, bias)."""

    def __init__(self, cached_ptrs: frozenset[int] = frozenset()) -> None:
        self.cached_ptrs = cached_ptrs
        self.launches: list[_Launch] = []
        self._current: _Launch | None = None

    def _begin(self, executor: Any, args: tuple, kwargs: dict) -> None:
        named = [*zip(executor.arg_names, args), *kwargs.items()]
        # A tensor passed twice (the backward's statistics, which hold its counters too) is counted under the name
        # of its first argument.
        first_names = {}
        for name, t in named:
            if isinstance(t, torch.Tensor) and t.numel():
                first_names.setdefault(t.data_ptr(), (name, t))
        tensors = sorted((ptr, name, t) for ptr, (name, t) in first_names.items())
        self._current = _Launch(
            kernel=getattr(executor.fn, "__name__", str(executor.fn)),
            grid=tuple(executor.grid) if not callable(executor.grid) else (),
            names=[name for _, name, _ in tensors],
            starts=np.array([ptr for ptr, _, _ in tensors], dtype=np.uint64),
            ends=np.array([ptr + t.numel() * t.element_size() for ptr, _, t in tensors], dtype=np.uint64),
            cached=[ptr in self.cached_ptrs for ptr, _, _ in tensors],
        )
        self.launches.append(self._current)

    def _count(self, ptrs: Any, mask: Any, into: str) -> None:
        launch = self._current
        if launch is None:
            return
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        addresses = addresses.ravel()
        if not addresses.size:
            return
        element_bytes = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        index = np.searchsorted(launch.starts, addresses, side="right").astype(np.int64) - 1
        outside = (index < 0) | (addresses >= launch.ends[np.maximum(index, 0)])
        if outside.any():
            raise UncountedAccess(f"{launch.kernel} accessed {int(outside.sum())} elements outside its tensor "
                                  "arguments: the byte count would be wrong")
        for i, n in zip(*np.unique(index, return_counts=True)):
            name = launch.names[i]
            if launch.cached[i]:
                offsets = (addresses[index == i] - launch.starts[i]) // np.uint64(element_bytes)
                size = int((launch.ends[i] - launch.starts[i]) // np.uint64(element_bytes))
                launch.touched.setdefault(name, np.zeros(size, dtype=bool))[offsets.astype(np.int64)] = True
            getattr(launch, into)[name] += int(n) * element_bytes

    @contextlib.contextmanager
    def counting(self) -> Iterator[TrafficCounter]:
        """Wraps the interpreter's launch and memory operations while the block runs; restores them after."""
        from triton.runtime import interpreter

        builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
        missing = [name for name in _WRAPPED if not hasattr(builder, name)]
        if missing:
            raise RuntimeError(f"Triton {backend.triton_version()}'s interpreter has no InterpreterBuilder."
                               f"{missing[0]}: the byte count knows the interpreters of Triton 3.2 to 3.9")
        originals = {name: getattr(builder, name) for name in _WRAPPED}
        original_call = executor.__call__
        counter = self

        def call(executor_self, *args, **kwargs):
            counter._begin(executor_self, args, kwargs)
            try:
                return original_call(executor_self, *args, **kwargs)
            finally:
                counter._current = None

        def masked_load(builder_self, ptrs, mask, *rest):
            counter._count(ptrs, mask, "loaded")
            return originals["create_masked_load"](builder_self, ptrs, mask, *rest)

        def masked_store(builder_self, ptrs, value, mask, *rest):
            counter._count(ptrs, mask, "stored")
            return originals["create_masked_store"](builder_self, ptrs, value, mask, *rest)

        def atomic_rmw(builder_self, op, ptr, val, mask, *rest):
            counter._count(ptr, mask, "loaded")
            counter._count(ptr, mask, "stored")
            return originals["create_atomic_rmw"](builder_self, op, ptr, val, mask, *rest)

        def atomic_cas(builder_self, ptr, *rest):
            counter._count(ptr, None, "loaded")
            counter._count(ptr, None, "stored")
            return originals["create_atomic_cas"](builder_self, ptr, *rest)

        wrappers = {"create_masked_load": masked_load, "create_masked_store": masked_store,
                    "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas}
        try:
            for name, wrapper in wrappers.items():
                setattr(builder, name, wrapper)
            executor.__call__ = call
            yield self
        finally:
            for name, original in originals.items():
                setattr(builder, name, original)
            executor.__call__ = original_call

    def bytes_by_tensor(self, with_kernel: bool = False) -> dict[str, int]:
        """Bytes per kernel argument over every launch (keyed ``kernel:ARG`` with ``with_kernel``, else ``ARG``),
        cached tensors by their touched bytes."""
        totals: Counter = Counter()
        for launch in self.launches:
            for name in set(launch.loaded) | set(launch.stored):
                key = f"{launch.kernel}:{name}" if with_kernel else name
                if name in launch.touched:  # once per call, however many launches read it
                    totals[key] = max(totals[key], launch.touched_bytes(name))
                else:
                    totals[key] += launch.loaded[name] + launch.stored[name]
        return dict(totals)

    def cached_reads(self) -> dict[str, float]:
        """How many times over each cached tensor was read, across all launches."""
        reads: Counter = Counter()
        for launch in self.launches:
            for name in launch.touched:
                reads[name] += launch.loaded[name] / launch.size_bytes(name)
        return dict(reads)


# ------------------------------------------------------------------------------------------------ variants


def _inputs(variant: str, rows: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    has_residual = "res" in variant or "dsum" in variant
    return {"x": randn(rows, hidden), "residual": randn(rows, hidden) if has_residual else None,
            # trained-like weights, never all ones
            "weight": 1.0 + 0.1 * randn(hidden), "bias": 0.1 * randn(hidden) if "bias" in variant else None,
            "dy": randn(rows, hidden), "dsum": randn(rows, hidden) if has_residual else None}


def _count_qk_call(variant: str, tokens: int, head_dim: int, dtype: torch.dtype, mode: str) -> TrafficCounter:
    """``count_call`` for the q/k variants (``QK_VARIANTS``): ``qk_norm_rope`` on ``tokens`` tokens. The weights
    and ``cos``/``sin`` (a token's, read by each of its heads: from the caches on a GPU) are counted once per call by
    their touched bytes."""
    from hf_rmsnorm.ops.qk import qk_norm_rope

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k = randn(1, tokens, QK_Q_HEADS, head_dim), randn(1, tokens, QK_K_HEADS, head_dim)
    q_weight, k_weight = 1.0 + 0.1 * randn(head_dim), 1.0 + 0.1 * randn(head_dim)  # trained-like, never all ones
    cos, sin = randn(1, tokens, head_dim), randn(1, tokens, head_dim)
    counter = TrafficCounter(frozenset(t.data_ptr() for t in (q_weight, k_weight, cos, sin)))
    training = variant != "qk-infer"
    leaves = [t.requires_grad_(training) for t in (q, k, q_weight, k_weight)]

    def forward() -> tuple[torch.Tensor, ...]:
        return qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS, mode=mode)

    if variant != "qk-bwd":
        with torch.set_grad_enabled(training), counter.counting():
            forward()
        return counter
    outputs = forward()
    grads = tuple(randn(*t.shape) for t in outputs)
    with counter.counting():
        torch.autograd.grad(outputs, leaves, grads)
    return counter


def _count_sandwich_call(variant: str, rows: int, hidden: int, dtype: torch.dtype, mode: str) -> TrafficCounter:
    """``count_call`` for the sandwich variants (``SANDWICH_VARIANTS``): ``norm_add_norm`` on ``rows x hidden``,
    both norms' weights trained-like and counted once per call by their touched bytes; the backward's incoming
    gradients are ``y``'s and the sum's (the sum's other reader, the layer's next residual add)."""
    from hf_rmsnorm.ops.functional import norm_add_norm

    t = _inputs("res", rows, hidden, dtype)
    x, residual, weight, dy, dsum = t["x"], t["residual"], t["weight"], t["dy"], t["dsum"]
    weight2 = 1.0 - 0.1 * weight
    counter = TrafficCounter(frozenset(p.data_ptr() for p in (weight, weight2)))
    training = variant != "sandwich-infer"
    leaves = [p.requires_grad_(training) for p in (x, residual, weight, weight2)]

    def forward() -> tuple[torch.Tensor, ...]:
        return norm_add_norm(x, residual, weight, EPS, bias=None, weight2=weight2, eps2=EPS, bias2=None, mode=mode)

    if variant != "sandwich-bwd":
        with torch.set_grad_enabled(training), counter.counting():
            forward()
        return counter
    outputs = forward()
    with counter.counting():
        torch.autograd.grad(outputs, leaves, (dy, dsum))
    return counter


def count_call(variant: str, rows: int, hidden: int, dtype: torch.dtype, mode: str) -> TrafficCounter:
    """Runs one call of ``variant`` (one of ``VARIANTS``) on ``rows x hidden`` and returns the
    counter of its kernels' traffic: the forward's (``infer*`` without autograd, ``fwd*`` with it) or, for
    ``bwd*``, the backward's alone (its forward runs first, uncounted)."""
    from hf_rmsnorm.ops.functional import fused_add_norm, norm  # any mode, the LayerNorm one included

    if variant in QK_VARIANTS:
        return _count_qk_call(variant, rows, hidden, dtype, mode)
    if variant in SANDWICH_VARIANTS:
        return _count_sandwich_call(variant, rows, hidden, dtype, mode)
    t = _inputs(variant, rows, hidden, dtype)
    x, residual, weight, bias = t["x"], t["residual"], t["weight"], t["bias"]
    counter = TrafficCounter(frozenset(p.data_ptr() for p in (weight, bias) if p is not None))
    training = not variant.startswith("infer")
    leaves = [p for p in (x, residual, weight, bias) if p is not None]
    for leaf in leaves:
        leaf.requires_grad_(training)

    def forward() -> tuple[torch.Tensor, ...]:
        if residual is None:
            return (norm(x, weight, EPS, bias=bias, mode=mode),)
        return fused_add_norm(x, residual, weight, EPS, bias=bias, mode=mode)

    if not variant.startswith("bwd"):
        with torch.set_grad_enabled(training), counter.counting():
            forward()
        return counter
    outputs = forward()
    grads = (t["dy"],) if residual is None else (t["dy"], t["dsum"])
    with counter.counting():
        torch.autograd.grad(outputs, leaves, grads)
    return counter


# ------------------------------------------------------------------------------------------------- records


@dataclass
class TrafficRecord:
    """What one variant moves at one width. ``per_row_ratio``: steady-state bytes per row over the minimum's
    per-row bytes; ``call_ratio``: the whole call at ``2 * rows`` rows over its minimum; ``bytes_per_element``:
    each kernel argument's bytes per row per element of the row in the steady state (rows re-read or partial
    rows rewritten per row show up here), cached tensors (weight, bias) contributing none."""

    variant: str
    dtype: str
    mode: str
    hidden: int
    rows: int
    kernels: list[str]
    per_row_ratio: float
    call_ratio: float
    call_bytes: int
    call_min_bytes: int
    bytes_per_element: dict[str, float]
    min_bytes_per_element: float
    cached_reads: dict[str, float]


def row_elements(variant: str, hidden: int) -> int:
    """Elements of one row of ``variant`` at this width: ``hidden``; a token's q and k heads for the q/k variants."""
    return (QK_Q_HEADS + QK_K_HEADS) * hidden if variant in QK_VARIANTS else hidden


def default_rows(hidden: int, variant: str = "fwd") -> int:
    """Rows of the smaller of the two runs of a variant at this width."""
    return max(MIN_ROWS, TARGET_ELEMENTS // row_elements(variant, hidden))


def _min_bytes(variant: str, rows: int, hidden: int, dtype: torch.dtype) -> int:
    phase = "bwd" if variant.startswith("bwd") or variant.endswith("-bwd") else "fwd"
    if variant in SANDWICH_VARIANTS:
        return kernel_bench.sandwich_min_traffic_bytes(phase, rows, hidden, dtype.itemsize, dtype.itemsize)
    if variant in QK_VARIANTS:
        return kernel_bench.qk_min_traffic_bytes(phase, rows, QK_Q_HEADS + QK_K_HEADS, hidden, hidden, dtype.itemsize,
                                                 dtype.itemsize)
    has_residual = "res" in variant or "dsum" in variant
    return kernel_bench.min_traffic_bytes(phase, rows, hidden, dtype.itemsize, dtype.itemsize, residual=has_residual)


def measure_variant(variant: str, hidden: int, dtype_name: str, mode: str = "llama",
                    rows: int | None = None) -> TrafficRecord:
    """Counts ``variant`` at ``rows`` and ``2 * rows`` rows (``default_rows(hidden)`` unless given) and derives
    the per-row and call figures.

    Raises:
        UncountedAccess: a kernel touched memory outside its tensor arguments.
    """
    dtype = DTYPES[dtype_name]
    rows = default_rows(hidden, variant) if rows is None else rows
    elements = row_elements(variant, hidden)
    small, large = (count_call(variant, n, hidden, dtype, mode) for n in (rows, 2 * rows))
    kernels = sorted({launch.kernel for launch in (*small.launches, *large.launches)})
    # Arguments named with their kernel where several ran (the wide backward's row reductions, then its columns).
    small_bytes, large_bytes = (counter.bytes_by_tensor(len(kernels) > 1) for counter in (small, large))
    min_small, min_large = (_min_bytes(variant, n, hidden, dtype) for n in (rows, 2 * rows))
    per_row = {name: (large_bytes.get(name, 0) - small_bytes.get(name, 0)) / rows / elements
               for name in sorted(set(small_bytes) | set(large_bytes))}
    min_per_element = (min_large - min_small) / rows / elements
    call_bytes = sum(large_bytes.values())
    if call_bytes < min_large:
        raise UncountedAccess(f"{variant} at hidden {hidden}: counted {call_bytes} bytes, under the minimum "
                              f"{min_large}: the kernels moved memory through a path this counter does not wrap")
    return TrafficRecord(
        variant=variant, dtype=dtype_name, mode=mode, hidden=hidden, rows=rows,
        kernels=kernels,
        per_row_ratio=sum(per_row.values()) / min_per_element, call_ratio=call_bytes / min_large,
        call_bytes=call_bytes, call_min_bytes=min_large,
        bytes_per_element={name: round(v, 4) for name, v in per_row.items() if round(v, 4)},
        min_bytes_per_element=min_per_element, cached_reads=large.cached_reads(),
    )


def format_table(records: list[TrafficRecord]) -> str:
    """One line per record: the two ratios, then each argument's steady-state bytes per element."""
    lines = [f"{'variant':<14} {'dtype':<5} {'hidden':>7} {'rows':>9} {'per-row':>8} {'call':>6}  "
             "bytes per element of a row by kernel argument (minimum)"]
    for r in records:
        parts = " ".join(f"{name} {v:g}" for name, v in r.bytes_per_element.items())
        lines.append(f"{r.variant:<14} {r.dtype:<5} {r.hidden:>7} {f'{r.rows},{2 * r.rows}':>9} "
                     f"{r.per_row_ratio:>7.3f}x {r.call_ratio:>5.2f}x  {parts} ({r.min_bytes_per_element:g})")
    return "\n".join(lines)


@dataclass(frozen=True)
class TrafficConfig:
    """The command line of ``scripts/byte_traffic.py``, one field per option; see its ``--help``."""

    hidden: list[int]
    variant: list[str]
    dtype: str
    mode: str
    rows: int | None = None
    json: Path | None = None


def run_byte_traffic(config: TrafficConfig) -> list[TrafficRecord]:
    """Measures every variant and width of ``config``, prints the table, writes the records to ``config.json``
    when given and returns them. The kernels must be defined for the interpreter (``backend.configure("cpu")``)."""
    unknown = sorted(set(config.variant) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}: use those of byte_traffic.VARIANTS")
    records = [measure_variant(v, h, config.dtype, config.mode, config.rows)
               for v in config.variant for h in config.hidden]
    print(format_table(records))
    if config.json:
        config.json.write_text(json.dumps([asdict(r) for r in records], indent=1))
    return records
