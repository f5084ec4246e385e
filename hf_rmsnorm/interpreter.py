"""Makes Triton's CPU interpreter round fp32 -> bf16 like GPUs and PyTorch do.

The interpreter (``TRITON_INTERPRET=1``) converts fp32 to bf16 by truncation, while GPUs and PyTorch round to
nearest even (REFERENCE.md section 5). Left alone, every bf16 output of a kernel run on CPU would be up to one
ulp further from the truth than the same kernel on a GPU, and bitwise comparisons with Hugging Face's eager
modules would be meaningless. The test suite and ``scripts/verify.py`` call this before running kernels on CPU.
"""

from __future__ import annotations

import numpy as np
import torch


def round_bf16_to_nearest_even() -> bool:
    """Patches the interpreter's fp32 -> bf16 conversion to PyTorch's rounding. Idempotent.

    Returns False (and changes nothing) when the installed Triton has no interpreter builder to patch.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
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
