"""Launching a Triton kernel for a fraction of ``kernel[grid](...)``'s host time, running the very binary Triton
would run.

Every ``kernel[grid](*args)`` call re-derives what the compiled kernel depends on: it binds the arguments, works
out each one's specialisation, builds a cache key string and looks the kernel up, before it calls the compiled
kernel's launcher. On a GPU host that costs 10 us for a kernel with one argument and more with the norms' 15,
several times a decode-sized kernel's own run time. A decoder calls each norm with the same shapes over and over,
so ``CachedLauncher`` remembers the compiled kernel that Triton returned, under a key made of everything Triton
specialises a launch on:

* each tensor's dtype and whether its address is 16-byte aligned;
* each integer's class: equal to 1, divisible by 16, beyond 32 bits (the three properties Triton specialises
  integers on); ``None`` arguments; floats are never specialised;
* the constexpr values, ``num_warps`` and the device.

The key is at least as fine as Triton's own, so every call with a known key runs the binary that Triton would
have picked for it, launched through the same launcher call with the same hooks; any other call (a new key, the
CPU interpreter, a Triton release before 3.5) takes ``kernel[grid](...)``. The
cache only ever holds what Triton's own cache holds, so its answer never depends on what ran before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton

from .backend import triton_at_least

# The launcher interface (CompiledKernel.run/function/packed_metadata/launch_metadata, hooks in triton.knobs)
# and the specialisation rules the key copies are those of Triton 3.5 and later, where tests/test_fast_launch.py
# checks the key against Triton's own binder; older releases always take Triton's own path.
_KNOBS = triton.knobs if triton_at_least(3, 5) else None
_INT32_MAX = 2**31 - 1


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if type(arg) is int:
        return arg == 1, arg % 16 == 0, arg > _INT32_MAX or arg < -_INT32_MAX
    if arg is None or type(arg) is float:
        return arg is None
    return arg  # anything else Triton sees by value


@functools.cache
def _stream_getter() -> Callable[[int], int]:
    """The function Triton's own launch path fetches a device's raw current stream with (resolved once: the
    driver is a lazy proxy, and this runs on every cached launch)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


class CachedLauncher:
    """``launcher(grid, args, constexprs, num_warps)`` does what ``kernel[(grid,)](*args, **constexprs,
    num_warps=num_warps)`` does, with Triton's per-call work skipped once the specialisation is known.

    ``args`` are the kernel's runtime arguments in order and ``constexprs`` its constexpr arguments, which the
    kernel must declare after all runtime ones and which are passed on in the kernel's declared order."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.constexpr_names = tuple(p.name for p in getattr(kernel, "params", ()) if p.is_constexpr)
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: int, args: tuple, constexprs: dict[str, Any], num_warps: int) -> None:
        device = args[0].device
        if device.type != "cuda" or _KNOBS is None:
            self.kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
            return
        constants = tuple(constexprs[name] for name in self.constexpr_names)
        key = (device.index, num_warps, *map(_arg_key, args), *constants)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
            if all(hasattr(compiled, attr) for attr in ("run", "function", "packed_metadata", "launch_metadata")):
                self.compiled[key] = compiled
            return
        all_args = (*args, *constants)
        stream = _stream_getter()(device.index)
        runtime = _KNOBS.runtime
        # Triton's launch_metadata is None unless a launch hook (a profiler) is installed: skip the call then.
        metadata = None if runtime.launch_enter_hook is None else compiled.launch_metadata(
            (grid, 1, 1), stream, *all_args)
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                     runtime.launch_enter_hook, runtime.launch_exit_hook, *all_args)
