"""Argument checks of the norm ops: one clear error, the same whichever implementation would have run.

The Triton kernels trust their arguments: a weight shorter than the row is read past its end, a residual of
another shape is read with ``x``'s row stride, a tensor on another device is a pointer the kernel cannot use.
The PyTorch implementation fails instead, but with a broadcasting error that names no argument (or, for a
broadcastable residual, not at all). ``functional.py`` therefore calls these checks in the functions every
call goes through before anything is launched: the real forward and backward (eager calls, the
``autograd.Function`` path, the custom ops when called or run from a compiled graph) and the fake
implementations of the custom ops, so that ``torch.compile`` fails while tracing, with this message inside its
own error. An eager call whose launch is bound (``functional.BoundNorm``) skips the checks its binding proves and
takes the path above, which raises them, whenever one of the rest fails.

Errors, always one line naming the op, the argument, its actual value and what is expected:

* ``TypeError``: a tensor whose dtype is not fp16, bf16, fp32 or fp64 (fp64 runs the PyTorch implementation);
* ``ValueError``: everything else (shapes, devices, ``eps``).

Decode calls are bound by host time, so the checks are attribute reads and comparisons only (no tensor op, no
device sync) and a message is only formatted once a check has failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .backend import KERNEL_DTYPES
from .modes import get_mode

# The kernels load fp16, bf16 and fp32; fp64 takes the PyTorch implementation (backend.runs_kernels).
FLOAT_DTYPES = KERNEL_DTYPES | {torch.float64}
_FLOAT_NAMES = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"

# Argument names, in the order the tensors are passed to _check_dtypes_and_devices; the first one's device is the
# one the others must be on (the first tensor decides the implementation in backend.runs_kernels as well).
_FORWARD_NAMES = ("x", "residual", "weight", "bias")
_BACKWARD_NAMES = ("dy", "dsum", "norm_input", "stats", "weight")
# The public function a forward's errors name, by whether the mode centres (LayerNorm) and whether a residual is
# added first.
_FORWARD_OPS = {False: ("rms_norm", "fused_add_rms_norm"), True: ("layer_norm", "fused_add_layer_norm")}


def check_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mode: str,
) -> None:
    """Checks the arguments of ``rms_norm`` / ``fused_add_rms_norm`` (``residual`` given), of ``layer_norm`` /
    ``fused_add_layer_norm`` in the centring ``mode``, and of their custom ops.

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: ``x`` is 0-dimensional; ``weight`` or ``bias`` is not 1-D of ``x``'s last dimension;
            ``residual`` does not have exactly ``x``'s shape (the kernels do not broadcast); a tensor is not on
            ``x``'s device; ``eps`` is negative, infinite or NaN; ``mode`` is unknown.
    """
    # Errors name the public function, also when its custom op was called (or traced) directly.
    op = _FORWARD_OPS[get_mode(mode).centre][residual is not None]
    _check_dtypes_and_devices(op, _FORWARD_NAMES, (x, residual, weight, bias))
    shape = x.shape  # read once: each read builds a torch.Size
    if not shape:
        raise ValueError(f"{op}: x is 0-dimensional; x must have at least 1 dimension (the normalised one)")
    n_cols = shape[-1]
    # Comparing whole shapes with a 1-tuple also rejects a 2-D weight whose first dimension happens to match.
    if weight is not None and weight.shape != (n_cols,):
        raise _row_vector_error(op, "weight", weight, "x", n_cols)
    if bias is not None and bias.shape != (n_cols,):
        raise _row_vector_error(op, "bias", bias, "x", n_cols)
    if residual is not None and residual.shape != shape:
        raise _same_shape_error(op, "residual", residual, "x", x)
    # One chained comparison rejects NaN, inf and negatives; math.isfinite cannot be traced by torch.compile,
    # which may hand eps over as a symbolic float.
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"{op}: eps is {eps}; eps must be a finite number >= 0")


def check_backward(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    norm_input: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor | None,
    mode: str,
) -> None:
    """Checks the tensor arguments of the ``norm_bwd`` custom op against the forward's input.

    Autograd always passes consistent tensors; this guards direct calls of ``torch.ops.hf_rmsnorm.norm_bwd``,
    which the kernels would otherwise read out of bounds.

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: ``dy`` or ``dsum`` does not have exactly ``norm_input``'s shape; ``stats`` is not the shape
            the forward saves in ``mode``; ``weight`` is not 1-D of ``norm_input``'s last dimension; a tensor is
            not on ``dy``'s device; ``mode`` is unknown.
    """
    op = "norm_bwd"
    _check_dtypes_and_devices(op, _BACKWARD_NAMES, (dy, dsum, norm_input, stats, weight))
    if norm_input.dim() == 0:
        raise ValueError(f"{op}: norm_input is 0-dimensional; norm_input must have at least 1 dimension")
    if dy.shape != norm_input.shape:
        raise _same_shape_error(op, "dy", dy, "norm_input", norm_input)
    if dsum is not None and dsum.shape != norm_input.shape:
        raise _same_shape_error(op, "dsum", dsum, "norm_input", norm_input)
    stats_shape = get_mode(mode).stats_shape(norm_input.shape)
    if stats.shape != stats_shape:
        raise ValueError(
            f"{op}: stats has shape {_sizes(stats.shape)} but mode {mode!r} saves {_sizes(stats_shape)} for norm_input "
            f"of shape {_sizes(norm_input.shape)}"
        )
    n_cols = norm_input.shape[-1]
    if weight is not None and weight.shape != (n_cols,):
        raise _row_vector_error(op, "weight", weight, "norm_input", n_cols)


def _check_dtypes_and_devices(op: str, names: tuple[str, ...], tensors: tuple[torch.Tensor | None, ...]) -> None:
    """Every tensor given (``None`` is an absent optional one) has a dtype the norms take and is on the first
    tensor's device."""
    first = tensors[0]
    device = first.device
    for name, t in zip(names, tensors):
        if t is None:
            continue
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; the norms take {_FLOAT_NAMES}")
        if t is not first and t.device != device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {names[0]} is on {device}; all tensors must be on one device"
            )


def _row_vector_error(op: str, name: str, t: torch.Tensor, ref_name: str, n_cols: int) -> ValueError:
    """The error for a weight or bias that is not 1-D with one element per column of ``ref_name``'s rows."""
    return ValueError(
        f"{op}: {name} has shape {_sizes(t.shape)} but {ref_name}'s last dimension is {int(n_cols)}; "
        f"{name} must be 1-D of size {int(n_cols)}"
    )


def _same_shape_error(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> ValueError:
    """The error for a tensor the kernels read with ``ref``'s row count and strides (no broadcasting)."""
    return ValueError(
        f"{op}: {name} has shape {_sizes(t.shape)} but {ref_name} has shape {_sizes(ref.shape)}; "
        f"{name} must have exactly {ref_name}'s shape"
    )


def _sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """A shape as a tuple of ints for a message. While torch.compile traces, sizes may be symbolic (``s0``):
    ``int`` gives the example's actual size instead (the guard it adds is moot, the error ends the tracing)."""
    return tuple(int(size) for size in sizes)
