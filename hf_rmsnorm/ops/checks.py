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
from .modes import MODES, get_mode
from .qk_launch import QK_MAX_ROW_ELEMENTS, qk_output_dtype, qk_row_tile, qk_stats_shape

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

    Autograd always passes consistent tensors; this guards direct calls of the operator (``library.op("norm_bwd")``),
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


_QK_NAMES = ("q", "k", "q_weight", "k_weight", "cos", "sin")
_QK_OP = "qk_norm_rope"


def check_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_eps: float,
    k_eps: float,
    mode: str,
    per_head: bool,
    rope_first: bool = False,
) -> None:
    """Checks the arguments of ``qk_norm_rope`` and of its custom op (and of ``qk_rope_norm``: ``rope_first``).

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: ``q`` or ``k`` is not ``[batch, tokens, heads, head_dim]``, or they differ in batch, tokens or
            head_dim; ``cos`` is 4-D (multimodal RoPE's sections) or otherwise not ``[batch or 1, tokens,
            rotary_dim]``; ``sin`` not of ``cos``'s shape and dtype; ``rotary_dim`` odd or above ``head_dim``; a
            weight not 1-D of its norm's width (``head_dim``, or ``heads * head_dim`` without ``per_head``); a norm
            row wider than the kernels' tile; a tensor not on ``q``'s device; an eps negative, infinite or NaN;
            ``mode`` unknown, centring (LayerNorm) or rounding to the weight's dtype (T5); rotating first, q's
            and k's dtypes such that the RoPE's dtype (their promotion with ``cos``'s) is not, for both, their own
            or, for both, ``cos``'s (the kernels round the rotated rows to one of the two).
    """
    op = "qk_rope_norm" if rope_first else _QK_OP
    _check_dtypes_and_devices(op, _QK_NAMES, (q, k, q_weight, k_weight, cos, sin))
    m = MODES.get(mode)
    if m is None or m.centre or m.rounds_to_weight_dtype:
        what = ("is unknown" if m is None else "centres the rows (a LayerNorm)" if m.centre
                else "rounds to the weight's dtype (T5's norm, which has no q/k norms)")
        valid = ", ".join(name for name, mode_ in MODES.items() if not (mode_.centre or mode_.rounds_to_weight_dtype))
        raise ValueError(f"{op}: mode {mode!r} {what}; {op} takes the RMSNorm modes: {valid}")
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} has shape {_sizes(t.shape)}; {name} must be [batch, tokens, heads, "
                             "head_dim] (the projection's view into heads)")
    batch, tokens, q_heads, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, tokens, head_dim):
        raise ValueError(f"{op}: k has shape {_sizes(k.shape)} but q has shape {_sizes(q.shape)}; they must agree in "
                         "batch, tokens and head_dim")
    if cos.dim() == 4:
        raise ValueError(f"{op}: cos has shape {_sizes(cos.shape)}: multimodal RoPE (a cos per position section) is "
                         "not supported; apply the norms and the model's own RoPE")
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != tokens:
        raise ValueError(f"{op}: cos has shape {_sizes(cos.shape)}; cos must be [{int(batch)} or 1, {int(tokens)}, "
                         "rotary_dim], as the rotary embedding returns it for q and k")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"{op}: sin is {sin.dtype} of shape {_sizes(sin.shape)} but cos is {cos.dtype} of shape "
                         f"{_sizes(cos.shape)}; they must have the same shape and dtype")
    rotary_dim = cos.shape[2]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{op}: cos's last dimension is {int(rotary_dim)}; the rotary dimension must be even, "
                         f"positive and at most head_dim ({int(head_dim)})")
    for name, weight, heads in (("q_weight", q_weight, q_heads), ("k_weight", k_weight, k.shape[2])):
        width = head_dim if per_head else heads * head_dim
        if weight is not None and weight.shape != (width,):
            over = "head_dim" if per_head else "heads * head_dim (a norm over the whole projection)"
            raise ValueError(f"{op}: {name} has shape {_sizes(weight.shape)}; {name} must be 1-D of {over}: "
                             f"{int(width)}")
        heads_in_row = 1 if per_head else int(heads)
        elements = qk_row_tile(int(head_dim), int(rotary_dim), heads_in_row).elements
        if elements > QK_MAX_ROW_ELEMENTS:
            raise ValueError(f"{op}: a norm row of {heads_in_row} heads of {int(head_dim)} takes {elements} elements "
                             f"in the kernels' tile, above their {QK_MAX_ROW_ELEMENTS}; apply the norms and the RoPE "
                             "apart")
    for name, eps in (("q_eps", q_eps), ("k_eps", k_eps)):
        if not 0.0 <= eps < math.inf:
            raise ValueError(f"{op}: {name} is {eps}; {name} must be a finite number >= 0")
    if rope_first:
        rope_dtypes = [qk_output_dtype(t.dtype, cos.dtype) for t in (q, k)]
        if not (rope_dtypes == [q.dtype, k.dtype] or rope_dtypes == [cos.dtype, cos.dtype]):
            raise ValueError(f"{op}: q is {q.dtype}, k {k.dtype} and cos {cos.dtype}: the RoPE would compute in "
                             f"{rope_dtypes[0]} and {rope_dtypes[1]}; the kernels take q and k rotated in their own "
                             "dtypes or both in cos's (cast cos to q's dtype, as the rotary embeddings return it)")


def check_qk_norm_rope_backward(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    stats: torch.Tensor,
    mode: str,
    per_head: bool,
    rope_first: bool = False,
) -> None:
    """Checks the arguments of the ``qk_norm_rope_bwd`` custom op: those of the forward, the output gradients of
    the inputs' shapes and the statistics of the shape the forward saves (autograd passes them so; a direct call
    might not, and the kernel would read out of bounds).

    Raises:
        TypeError, ValueError: as ``check_qk_norm_rope``; also a ValueError for a gradient or statistics of
            another shape.
    """
    check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, 0.0, 0.0, mode, per_head, rope_first)
    op = "qk_norm_rope_bwd"
    _check_dtypes_and_devices(op, ("q", "dq_out", "dk_out", "stats"), (q, dq_out, dk_out, stats))
    if dq_out.shape != q.shape:
        raise _same_shape_error(op, "dq_out", dq_out, "q", q)
    if dk_out.shape != k.shape:
        raise _same_shape_error(op, "dk_out", dk_out, "k", k)
    stats_shape = qk_stats_shape(q, k, per_head)
    if stats.shape != stats_shape:
        raise ValueError(f"{op}: stats has shape {_sizes(stats.shape)} but the forward saves {_sizes(stats_shape)} "
                         f"for q of shape {_sizes(q.shape)} and k of shape {_sizes(k.shape)}")
