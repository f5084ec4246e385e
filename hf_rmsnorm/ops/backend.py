"""Which implementation runs a norm, and the set-up of Triton's CPU interpreter: the one place that decides.

Three implementations share one semantics (the modes of ``modes.py``):

* the Triton kernels, compiled for the GPU, on CUDA and ROCm tensors (torch calls both devices ``cuda``);
* the same kernels in Triton's CPU interpreter, on CPU tensors, in a process set up for it with
  ``configure("cpu")``: slow (one program at a time, in numpy), but the very kernel code a GPU runs, which is
  how the tests and the scripts check the kernels on a machine without a GPU;
* otherwise the PyTorch implementation of ``reference.py``: CPU tensors in a process not set up for the
  interpreter, and dtypes the kernels do not load (fp64).

Triton chooses between compiling and interpreting when a kernel is *defined*, from the environment variable
``TRITON_INTERPRET``, so the choice must be made before ``hf_rmsnorm.ops.kernels`` is imported. Importing
``hf_rmsnorm`` defines no kernel (the package imports its parts on first use); call ``configure`` first.

The interpreter converts fp32 to bf16 by truncation, where GPUs and PyTorch round to nearest even, so every bf16
output would be up to an ulp further from the truth than on a GPU and bitwise comparisons with Hugging Face's
eager modules would mean nothing. The interpreter is therefore made to round as a GPU does whenever the kernels
are defined for it, whether ``configure("cpu")`` or the user's own ``TRITON_INTERPRET=1`` chose it. Its set-up of
every launch is made cheaper at the same time, with the same effect (``memoise_language_patching``).
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch

INTERPRETER_ENV = "TRITON_INTERPRET"
# dtypes the kernels load; anything else (fp64) takes the PyTorch path, which Hugging Face's maths also uses.
KERNEL_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
_KERNELS_MODULE = f"{__package__}.kernels"


def configure(device: str | torch.device) -> None:
    """Sets this process up so the kernels run for ``device``: compiled on a GPU (any device but ``cpu``), in
    Triton's interpreter with GPU rounding on the CPU. Call it before the first norm runs.

    Raises:
        RuntimeError: the kernels were already defined the other way (a norm ran, or ``hf_rmsnorm.ops.kernels``
            was imported, before this call).
    """
    interpret = torch.device(device).type == "cpu"
    if _KERNELS_MODULE in sys.modules and kernels_interpreted() != interpret:
        defined = "for Triton's interpreter" if kernels_interpreted() else "for a GPU"
        raise RuntimeError(
            f"hf_rmsnorm's kernels were already defined {defined}: call hf_rmsnorm.ops.backend.configure("
            f"{str(device)!r}) before the first norm runs (Triton reads {INTERPRETER_ENV} when a kernel is defined)"
        )
    if interpret:
        os.environ[INTERPRETER_ENV] = "1"
        _set_up_interpreter()
    else:
        os.environ.pop(INTERPRETER_ENV, None)


@functools.cache
def kernels_interpreted() -> bool:
    """Whether the kernels are defined for Triton's interpreter (defines them, if no norm has run yet); if so,
    the interpreter rounds bf16 as a GPU does from then on."""
    from triton.runtime.interpreter import InterpretedFunction

    from .kernels import norm_fwd_kernel

    interpreted = isinstance(norm_fwd_kernel, InterpretedFunction)
    if interpreted:
        _set_up_interpreter()
    return interpreted


def installed_interpreter_problem() -> str | None:
    """``interpreter_problem`` for the installed Triton and NumPy."""
    return interpreter_problem(_version(triton_version()), _version(np.__version__))


def _set_up_interpreter() -> None:
    problem = installed_interpreter_problem()
    if problem:
        raise RuntimeError(problem)
    if not round_bf16_to_nearest_even():
        raise RuntimeError("this Triton version's interpreter cannot be made to round bf16 to nearest even")
    memoise_language_patching()


def triton_version() -> str:
    import triton

    return triton.__version__


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def triton_at_least(major: int, minor: int) -> bool:
    """Whether the installed Triton is release ``major.minor`` or later."""
    return _version(triton_version()) >= (major, minor)


def interpreter_problem(triton: tuple[int, int], numpy: tuple[int, int]) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these versions, if it cannot: before Triton 3.7 it
    breaks on NumPy 2.4 and later in every kernel loop with a runtime bound (the kernels have several)."""
    if triton < (3, 7) and numpy >= (2, 4):
        return (
            f"Triton {triton[0]}.{triton[1]}'s CPU interpreter fails with NumPy {numpy[0]}.{numpy[1]} (NumPy >= 2.4 "
            "needs Triton >= 3.7): pip install 'numpy<2.4', or a newer triton"
        )
    return None


def runs_kernels(*tensors: torch.Tensor | None) -> bool:
    """Whether a norm of these tensors (the first one decides the device) runs the Triton kernels, compiled or
    interpreted; if not, it runs the PyTorch implementation. Called on every norm: ``is_cuda`` and ``is_cpu`` read
    the device type without building a ``torch.device``, and a plain loop is half the cost of ``all()`` over a
    generator."""
    first = tensors[0]
    if not (first.is_cuda or (first.is_cpu and kernels_interpreted())):
        return False
    for t in tensors:
        if t is not None and t.dtype not in KERNEL_DTYPES:
            return False
    return True


def _interpreter_chosen() -> bool:
    """Whether the kernels are, or will be when first used, defined for the interpreter: like
    ``kernels_interpreted`` but without defining them, so ``configure`` can still run afterwards."""
    if _KERNELS_MODULE in sys.modules:
        return kernels_interpreted()
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton >= 3.4 parses the variable here
        return bool(knobs.runtime.interpret)
    return os.environ.get(INTERPRETER_ENV, "0").lower() in ("1", "true", "on", "yes")


def describe(device: str | torch.device) -> str:
    """One line saying what runs the norms of tensors on ``device``, for logs and reports (defines no kernel)."""
    if torch.device(device).type == "cuda":
        return "Triton kernels on the GPU"
    if torch.device(device).type == "cpu" and _interpreter_chosen():
        return "Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1): exact but slow, no speed figures"
    return f"no GPU and no interpreter: the PyTorch implementation with the kernels' semantics on {device}"


def round_bf16_to_nearest_even() -> bool:
    """Makes the interpreter's fp32 -> bf16 conversion round as PyTorch and GPUs do. Idempotent.

    Returns False (and changes nothing) when the installed Triton has no interpreter builder to patch.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or not hasattr(interpreter, "TensorHandle"):
        return False
    if getattr(original, "rounds_bf16_to_nearest_even", False):
        return True

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl.rounds_bf16_to_nearest_even = True
    builder.cast_impl = cast_impl
    return True


def memoise_language_patching() -> bool:
    """Makes the interpreter's set-up of each kernel launch and each call of a ``@triton.jit`` helper cheaper,
    with the same effect. Idempotent.

    Before running Python code as a kernel, the interpreter replaces every builtin of ``triton.language`` (and of
    ``tl.core``, ``tl.math``, the tensor classes) with a version that computes in numpy: its ``_patch_builtin(pkg,
    ...)`` lists all of ``pkg``'s members with ``inspect.getmembers`` and patches those that are builtins. It does
    this at every launch and again at every helper call inside a kernel (about 150 times per launch of the norms'
    kernels): about a quarter of the interpreter's time on the small launches of the tests and the CPU runs, more
    than half of it the listing. The names of a package's members do not change (a launch replaces members, and
    removes only what it added), so the replacement lists them once per package and then, at every call, patches
    as the original does the members whose current value is a builtin: the same members, in the same order
    (``getmembers`` sorts by name), through the same ``_patch_attr`` calls. It keeps Triton's function as its
    ``original``.

    Returns False (and changes nothing) unless the installed Triton's ``_patch_builtin`` is that function: taking
    ``(pkg, builder)`` or ``(pkg, builder, scope)``, and naming ``getmembers``, ``is_builtin`` and ``_patch_attr``.
    """
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    if getattr(original, "memoises_members", False):
        return True
    code = getattr(original, "__code__", None)
    if code is None or code.co_varnames[:2] != ("pkg", "builder") or code.co_argcount not in (2, 3) or not {
        "getmembers", "is_builtin", "_patch_attr"
    } <= set(code.co_names):
        return False
    member_names: dict[object, tuple[str, ...]] = {}

    def _patch_builtin(pkg, builder, *scope):
        names = member_names.get(pkg)
        if names is None:
            names = member_names[pkg] = tuple(name for name, _ in inspect.getmembers(pkg))
        is_builtin, patch_attr = tl.core.is_builtin, interpreter._patch_attr
        for name in names:
            member = getattr(pkg, name, None)  # None: gone since (an attribute a launch added), no builtin
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, *scope)

    _patch_builtin.memoises_members = True
    _patch_builtin.original = original
    interpreter._patch_builtin = _patch_builtin
    return True
