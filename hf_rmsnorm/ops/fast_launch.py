"""Launching a Triton kernel for a fraction of ``kernel[grid](...)``'s host time, running the very binary Triton
would run.

Every ``kernel[grid](*args)`` call re-derives what the compiled kernel depends on: it binds the arguments, works
out each one's specialisation, builds a cache key string and looks the kernel up, before it calls the compiled
kernel's launcher. On a GPU host that costs 10 us for a kernel with one argument and more with the norms' 15,
several times a decode-sized kernel's own run time. A decoder calls each norm with the same shapes over and over,
so ``CachedLauncher`` remembers the compiled kernel that Triton returned, under a key that decides everything
Triton specialises a launch on (each tensor's dtype and 16-byte alignment, each integer's ``int_class``, ``None``
arguments, the constexpr values, ``num_warps`` and the device; floats are never specialised). The key comes in
two kinds:

* by arguments: built from every argument, as above; any caller;
* by plan: a caller that derived the dtypes, the ``None`` arguments, the constexprs and ``num_warps`` from one
  cached plan object passes that plan and what still varies per call (the alignment of all pointers at once, its
  integers' classes); the key is the plan's identity with those, a few attribute reads instead of one key per
  argument (the plan is kept alive with its entry, so its identity names it for as long as the entry exists).

Either key is at least as fine as Triton's own, so every call with a known key runs the binary that Triton would
have picked for it, launched through the same launcher call with the same hooks; any other call (a new key, the
CPU interpreter, a Triton release before 3.5) takes ``kernel[grid](...)``. The cache only ever holds what
Triton's own cache holds, so its answer never depends on what ran before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from .backend import triton_at_least

# The launcher interface (CompiledKernel.run/function/packed_metadata/launch_metadata, hooks in triton.knobs)
# and the specialisation rules the key copies are those of Triton 3.5 and later, where tests/ops/test_fast_launch.py
# checks the key against Triton's own binder; older releases always take Triton's own path.
_KNOBS = triton.knobs if triton_at_least(3, 5) else None
# Triton types an integer argument i32 in [-2**31, 2**31), u64 from 2**63, i64 in between.
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1
_U64_MIN = 2**63


def int_class(n: int) -> tuple[bool, bool, int]:
    """What Triton specialises an integer argument on: equal to 1 (then a constant), divisible by 16, and its
    type (0: i32, 1: i64, 2: u64)."""
    return n == 1, n % 16 == 0, (n > _INT32_MAX or n < _INT32_MIN) + (n >= _U64_MIN)


def all_aligned(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (None: an absent one) starts at a 16-byte aligned address, the alignment Triton
    specialises pointers on: one test of all addresses OR-ed together."""
    addresses = 0
    for t in tensors:
        if t is not None:
            addresses |= t.data_ptr()
    return addresses % 16 == 0


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if type(arg) is int:
        return int_class(arg)
    if arg is None or type(arg) is float:
        return arg is None
    return arg  # anything else Triton sees by value


def _stream_getter() -> Callable[[int], int]:
    """The function Triton's own launch path fetches a device's raw current stream with, resolved when a cache entry
    is stored (the driver is a lazy proxy: resolving it costs a lookup per cached launch otherwise)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _installed(hook: Any) -> Any:
    """A launch hook as the launcher takes it: None where it would call nothing. Later Triton releases keep the
    launch hooks in a ``HookChain`` that is there even when empty: Triton then builds the launch metadata and calls
    the empty chain twice on every launch, where None makes the launcher skip both (it calls a hook only when it is
    not None)."""
    return hook if getattr(hook, "calls", hook) else None


class CachedLauncher:
    """``launcher(grid, device, args, constexprs, num_warps)`` does what ``kernel[(grid,)](*args, **constexprs,
    num_warps=num_warps)`` does on the current GPU ``device`` (an index), with Triton's per-call work skipped once
    the specialisation is known.

    ``args`` are the kernel's runtime arguments in order and ``constexprs`` its constexpr arguments, which the
    kernel must declare after all runtime ones and which are passed on in the kernel's declared order. A caller
    that derived the constexprs, ``num_warps``, every tensor's dtype and which arguments are None from one cached
    ``plan`` object may pass it, with ``varying``: the rest of what the launch specialises on, as finely as
    Triton (the tensors' alignment, unless the caller passes a plan only when ``all_aligned``; the ``int_class``
    of every integer the plan does not fix, or the integer itself). Calls with the same plan and equal
    ``varying`` must specialise identically (module docstring)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.constexpr_names = tuple(p.name for p in getattr(kernel, "params", ()) if p.is_constexpr)
        # The interpreter's kernels (InterpretedFunction) have no compiled binary to keep.
        self.cacheable = isinstance(kernel, triton.runtime.JITFunction)
        # key -> (compiled kernel, its launcher, its function handle and packed metadata, constexpr values in declared
        # order, the function giving a device's current stream, the plan keyed by identity or None), read once when
        # the entry is stored rather than on every launch.
        # Reading ``run`` loads the binary if Triton has not (``CompiledKernel.run`` is a property that does), after
        # which its handle does not change: that is why ``run`` is read first.
        self.by_arguments: dict[tuple, tuple] = {}
        self.by_plan: dict[tuple, tuple] = {}

    def binaries(self) -> list[Any]:
        """The compiled kernels of the launches cached so far (each entry's first item)."""
        return [entry[0] for cache in (self.by_plan, self.by_arguments) for entry in cache.values()]

    def clear(self) -> None:
        """Forgets every cached launch: the next of each goes through ``kernel[grid](...)`` again, whose own cache
        keeps the binaries compiled."""
        self.by_plan.clear()
        self.by_arguments.clear()

    def __call__(self, grid: int, device: int, args: tuple, constexprs: dict[str, Any], num_warps: int,
                 plan: object = None, varying: tuple = ()) -> None:
        if _KNOBS is None or not self.cacheable:
            self.kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
            return
        if plan is None:
            cache = self.by_arguments
            key = (device, num_warps, *map(_arg_key, args), *(constexprs[name] for name in self.constexpr_names))
        else:
            cache = self.by_plan
            key = (id(plan), device, varying)
        entry = cache.get(key)
        if entry is None:
            compiled = self.kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
            if all(hasattr(compiled, attr) for attr in ("run", "function", "packed_metadata", "launch_metadata")):
                cache[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata,
                              tuple(constexprs[name] for name in self.constexpr_names), _stream_getter(), plan)
            return
        compiled, run, function, packed_metadata, constants, current_stream, _ = entry
        stream = current_stream(device)
        runtime = _KNOBS.runtime
        enter_hook, exit_hook = _installed(runtime.launch_enter_hook), _installed(runtime.launch_exit_hook)
        # The metadata is for the hooks (a profiler's): skip building it when none is installed.
        metadata = None if enter_hook is None and exit_hook is None else compiled.launch_metadata(
            (grid, 1, 1), stream, *args, *constants)
        run(grid, 1, 1, stream, function, packed_metadata, metadata, enter_hook, exit_hook, *args, *constants)
