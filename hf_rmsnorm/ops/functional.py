"""Public functional API: the RMSNorms ``rms_norm``, ``fused_add_rms_norm`` and ``rms_norm_add`` and the LayerNorms
``layer_norm``, ``fused_add_layer_norm`` and ``layer_norm_add``, differentiable and torch.compile-able.

Both families run ``norm``, ``fused_add_norm`` and ``norm_add``, which take any mode of ``modes.py``, through their
mode's ``BoundNorm`` (``bound_norm``; patched modules hold it): an eager call that records no gradient runs a launch
bound once per combination of dtypes, devices, width and op, and every other call the general path below.
``rms_norm(mode="layernorm")`` and its siblings still run the LayerNorm, with a ``DeprecationWarning`` naming the
LayerNorm function to call.

The forwards and the backward are registered twice with ``torch.library``, under one schema:

* as custom ops (``norm_fwd``...) with fake implementations: ``torch.compile(fullgraph=True)``
  traces each as one opaque node, which calls the Python implementation when the graph runs;
* as Triton ops (``norm_fwd_triton``...): ``torch.compile`` traces into them, down to the kernel
  launches (``wrap_triton`` in ``launch.py``), so inductor launches the kernels from its own generated code,
  without the custom-op dispatch and the Python around it, and captures them in CUDA graphs with the rest.

Both live in the namespace of ``library.py``, named after this package's code so that torch.compile's on-disk
caches never hand a new version a graph the old one compiled. A compiled call on a GPU uses the Triton ops;
elsewhere the custom ops, which the interpreter's kernels and the PyTorch implementation need (neither is a compiled
Triton kernel inductor could launch).

Eagerly, the custom-op dispatcher costs several times a decode-sized kernel launch on the host, so eager calls
skip it: an ``autograd.Function`` built from the same forward, context and backward functions when a gradient is
needed, and a direct call otherwise (``generate()`` runs under ``no_grad``). The backward likewise calls its
implementation directly unless a graph is being traced.

``backend.py`` decides per call which implementation runs: the Triton kernels (compiled, or in Triton's
interpreter) or the PyTorch implementation in ``reference.py``, which has identical semantics. Whichever runs,
the arguments are checked first, once per call, by ``checks.py``: in ``_forward`` and ``_norm_bwd_impl``, which
every eager, autograd and custom-op call of the general path goes through, and in the fake implementations
``torch.compile`` traces. A bound call finds its binding only where those checks passed on what its key holds, and
checks the rest itself (``BoundNorm``).

DTensor arguments (tensor- and sequence-parallel plans) are handed to ``dtensor.py`` first: it checks that the
norm is row-local on them and calls the public function of the mode (the one its errors name) again on the local
shards.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from . import reference
from .backend import runs_kernels
from .checks import check_backward, check_forward
from .dtensor import call_on_local_shards, holds_dtensor
from .launch import (
    ForwardLaunch, SandwichLaunch, forward_launch, is_traced, norm_add_norm_forward, norm_backward, norm_forward,
    sandwich_launch,
)
from .library import op, qualified_name
from .modes import MODES, dtype_of, get_mode, sum_dtype
from .tuning import device_arch, reads_tuned_plans


def _forward(x, residual, weight, bias, eps, mode, store_stats=True):
    """``(y, residual + x or None, stats)``; the kernels skip the stats when ``store_stats`` is false
    (inference: only the backward reads them), the PyTorch implementation computes them anyway."""
    check_forward(x, residual, weight, bias, eps, mode)  # before the kernels could read out of bounds
    if runs_kernels(x, residual, weight, bias):
        return norm_forward(x, residual, weight, bias, eps, mode, store_stats=store_stats)
    y, norm_input, stats = reference.forward_reference(x, residual, weight, bias, eps, mode)
    return y, (None if residual is None else norm_input), stats


def _fake_forward(x, residual, weight, bias, eps, mode):
    # The same error while torch.compile traces as when the real implementation runs.
    check_forward(x, residual, weight, bias, eps, mode)
    m = get_mode(mode)
    norm_dtype = sum_dtype(x.dtype, dtype_of(residual))
    y = x.new_empty(x.shape, dtype=m.output_dtype(norm_dtype, weight, bias))
    stats = x.new_empty(m.stats_shape(x.shape), dtype=m.compute_dtype(norm_dtype))
    return y, x.new_empty(x.shape, dtype=norm_dtype), stats


def define_ops(name: str, impl) -> Any:
    """Defines ``impl`` as the Triton op ``<name>_triton`` (whose fake implementation is ``impl`` itself: on fake
    tensors it records its launches and allocates its outputs) and as the custom op ``<name>``, which it returns for
    its fake implementation to be registered (both in ``library.NAMESPACE``)."""
    torch.library.triton_op(qualified_name(f"{name}_triton"), impl, mutates_args=())
    return torch.library.custom_op(qualified_name(name), impl, mutates_args=())


def _norm_impl(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mode: str
) -> tuple[Tensor, Tensor]:
    y, _, stats = _forward(x, None, weight, bias, eps, mode)
    return y, stats


_norm_fwd = define_ops("norm_fwd", _norm_impl)


@_norm_fwd.register_fake
def _(x, weight, bias, eps, mode):
    y, _, stats = _fake_forward(x, None, weight, bias, eps, mode)
    return y, stats


def _add_norm_impl(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mode: str
) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(x, residual, weight, bias, eps, mode)


_add_norm_fwd = define_ops("add_norm_fwd", _add_norm_impl)


@_add_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, mode):
    return _fake_forward(x, residual, weight, bias, eps, mode)


def _adds_in_kernel(x, residual, weight, bias, mode) -> bool:
    """Whether ``norm_add`` adds in the norm's kernel: where the norm's output has the residual's dtype (the add
    then rounds in that dtype, as torch's does) and the kernels run."""
    same_dtype = get_mode(mode).output_dtype_of(x.dtype, dtype_of(weight), dtype_of(bias)) == residual.dtype
    return same_dtype and runs_kernels(x, residual, weight, bias)


def _norm_add_forward(x, residual, weight, bias, eps, mode, store_stats=True):
    """``(residual + norm(x), stats)``: one kernel where ``_adds_in_kernel``, else the norm's kernel and torch's
    add."""
    check_forward(x, residual, weight, bias, eps, mode)  # the residual's shape too: the add must not broadcast
    if _adds_in_kernel(x, residual, weight, bias, mode):
        out, _, stats = norm_forward(x, None, weight, bias, eps, mode, residual_after=residual,
                                     store_stats=store_stats)
        return out, stats
    y, _, stats = _forward(x, None, weight, bias, eps, mode, store_stats)
    return residual + y, stats


def _norm_add_impl(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mode: str
) -> tuple[Tensor, Tensor]:
    return _norm_add_forward(x, residual, weight, bias, eps, mode)


_norm_add_fwd = define_ops("norm_add_fwd", _norm_add_impl)


@_norm_add_fwd.register_fake
def _(x, residual, weight, bias, eps, mode):
    y, _, stats = _fake_forward(x, None, weight, bias, eps, mode)
    return residual.new_empty(x.shape, dtype=torch.promote_types(residual.dtype, y.dtype)), stats


def _chains_in_kernel(x, residual, weight, bias, weight2, bias2, mode) -> bool:
    """Whether ``norm_add_norm`` runs its kernel (``launch.norm_add_norm_forward``): the first norm adds in its
    kernel (``_adds_in_kernel``) and the second norm's parameters load there too."""
    return _adds_in_kernel(x, residual, weight, bias, mode) and runs_kernels(x, weight2, bias2)


def _norm_add_norm_forward(x, residual, weight, bias, eps, weight2, bias2, eps2, mode, store_stats=True):
    """``(norm2(total), total, stats, stats2)`` with ``total = residual + norm(x)``: one kernel where
    ``_chains_in_kernel``, else ``_norm_add_forward`` then ``_forward``, or the PyTorch implementation where the
    kernels do not run. ``norm2`` reads the sum, which has the residual's shape and device: its arguments are
    checked against the residual's."""
    check_forward(x, residual, weight, bias, eps, mode)
    check_forward(residual, None, weight2, bias2, eps2, mode)
    if _chains_in_kernel(x, residual, weight, bias, weight2, bias2, mode):
        return norm_add_norm_forward(x, residual, weight, bias, eps, weight2, bias2, eps2, mode, store_stats)
    if not runs_kernels(x, residual, weight, bias, weight2, bias2):
        return reference.norm_add_norm_reference(x, residual, weight, bias, eps, weight2, bias2, eps2, mode)
    total, stats = _norm_add_forward(x, residual, weight, bias, eps, mode, store_stats)
    y, _, stats2 = _forward(total, None, weight2, bias2, eps2, mode, store_stats)
    return y, total, stats, stats2


def _norm_add_norm_impl(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
    weight2: Tensor | None, bias2: Tensor | None, eps2: float, mode: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _norm_add_norm_forward(x, residual, weight, bias, eps, weight2, bias2, eps2, mode)


_norm_add_norm_fwd = define_ops("norm_add_norm_fwd", _norm_add_norm_impl)


@_norm_add_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, weight2, bias2, eps2, mode):
    check_forward(residual, None, weight2, bias2, eps2, mode)
    normed, _, stats = _fake_forward(x, None, weight, bias, eps, mode)
    total = residual.new_empty(x.shape, dtype=torch.promote_types(residual.dtype, normed.dtype))
    y, _, stats2 = _fake_forward(total, None, weight2, bias2, eps2, mode)
    return y, total, stats, stats2


def _norm_bwd_impl(
    dy: Tensor,
    dsum: Tensor | None,
    norm_input: Tensor,
    stats: Tensor,
    weight: Tensor | None,
    bias_dtype: torch.dtype | None,
    mode: str,
    dx_dtype: torch.dtype,
    dres_dtype: torch.dtype | None,
    round_before_dsum: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx, dresidual, dweight, dbias)``; outputs that are not needed (or that do not exist: no
    weight) are empty tensors (custom ops cannot return None, nor one tensor twice). ``round_before_dsum``: as
    ``launch.norm_backward``'s."""
    check_backward(dy, dsum, norm_input, stats, weight, mode)
    if runs_kernels(dy, dsum, norm_input, weight):
        dx, dres, dweight, dbias = norm_backward(
            dy, dsum, norm_input, stats, weight, bias_dtype, mode, dx_dtype, dres_dtype, round_before_dsum
        )
    else:
        rounded_first = round_before_dsum and dsum is not None
        grad, dweight, dbias = reference.backward_reference(
            dy, None if rounded_first else dsum, norm_input, stats, weight, bias_dtype is not None, mode
        )
        if rounded_first:
            grad = grad.to(dx_dtype).to(grad.dtype) + dsum.to(grad.dtype)
        dx = grad.to(dx_dtype)
        dres = None if dres_dtype is None else grad.to(dres_dtype)
        dweight = None if dweight is None else dweight.to(weight.dtype)
        dbias = None if dbias is None else dbias.to(bias_dtype)
    # A fresh empty tensor for each absent output: custom-op outputs may not alias one another.
    return tuple(dx.new_empty(0) if t is None else t for t in (dx, dres, dweight, dbias))


_norm_bwd = define_ops("norm_bwd", _norm_bwd_impl)


@_norm_bwd.register_fake
def _(dy, dsum, norm_input, stats, weight, bias_dtype, mode, dx_dtype, dres_dtype, round_before_dsum):
    check_backward(dy, dsum, norm_input, stats, weight, mode)
    dx = norm_input.new_empty(norm_input.shape, dtype=dx_dtype)
    dres = dx.new_empty(norm_input.shape if dres_dtype is not None else (0,), dtype=dres_dtype or dx_dtype)
    dbias = dx.new_empty((norm_input.shape[-1],) if bias_dtype is not None else (0,), dtype=bias_dtype or dx_dtype)
    return dx, dres, dx.new_empty(0) if weight is None else torch.empty_like(weight), dbias


def _save_common(ctx, norm_input: Tensor, stats: Tensor, weight: Tensor, bias: Tensor | None, mode: str) -> None:
    ctx.save_for_backward(norm_input, stats, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mode = mode
    # Unused outputs (the statistics, often the residual sum) then arrive as None instead of materialised zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy: Tensor | None, dsum: Tensor | None, dx_dtype: torch.dtype, dres_dtype: torch.dtype | None):
    norm_input, stats, weight = ctx.saved_tensors
    return _backward_of(dy, dsum, norm_input, stats, weight, ctx.bias_dtype, ctx.mode, dx_dtype, dres_dtype)


def _backward_of(dy: Tensor | None, dsum: Tensor | None, norm_input: Tensor, stats: Tensor, weight: Tensor | None,
                 bias_dtype: torch.dtype | None, mode: str, dx_dtype: torch.dtype, dres_dtype: torch.dtype | None,
                 *, round_before_dsum: bool = False):
    """One norm's backward (``_norm_bwd_impl``'s outputs, None where absent) through the implementation the call
    needs (below)."""
    if dy is None:
        y_dtype = get_mode(mode).output_dtype(norm_input.dtype, weight, None)
        dy = norm_input.new_zeros(norm_input.shape, dtype=y_dtype)
    # An operator only where one is needed: while a graph is traced (torch.compile, whose backward may be traced
    # outside Dynamo, on fake or functional tensors) and for other tensor subclasses, which the custom op's
    # dispatch unwraps (DTensors never get here: ``dtensor.py`` runs the ops on their local shards). Otherwise
    # its dispatch costs about 250 us of host time per call (measured on an H200 host), several times the kernel
    # itself at training sizes.
    plain = type(dy) is Tensor and type(norm_input) is Tensor and (dsum is None or type(dsum) is Tensor)
    if torch.compiler.is_compiling() or is_traced(norm_input):
        backward = _traced_ops(norm_input).backward
    else:
        backward = _norm_bwd_impl if plain else _CUSTOM_OPS.backward
    dx, dres, dweight, dbias = backward(
        dy, dsum, norm_input, stats, weight, bias_dtype, mode, dx_dtype, dres_dtype, round_before_dsum
    )
    return dx, dres, (dweight if weight is not None else None), (dbias if bias_dtype is not None else None)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _eps, mode = inputs
    _save_common(ctx, x, output[1], weight, bias, mode)
    # Kept apart from the saved tensors: non-reentrant checkpointing lets the backward unpack those once.
    ctx.x_dtype = x.dtype


def _norm_backward(ctx, dy, _drstd):
    dx, _, dweight, dbias = _backward(ctx, dy, None, ctx.x_dtype, None)
    return dx, dweight, dbias, None, None


def _add_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, _eps, mode = inputs
    _save_common(ctx, output[1], output[2], weight, bias, mode)
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype


def _add_norm_backward(ctx, dy, dsum, _drstd):
    # One gradient serves x and the residual (the sum's gradient); a second copy only if the dtypes differ.
    dres_dtype = None if ctx.res_dtype == ctx.x_dtype else ctx.res_dtype
    dx, dres, dweight, dbias = _backward(ctx, dy, dsum, ctx.x_dtype, dres_dtype)
    return dx, (dx if dres_dtype is None else dres), dweight, dbias, None, None


def _norm_add_setup(ctx, inputs, output):
    x, residual, weight, bias, _eps, mode = inputs
    _save_common(ctx, x, output[1], weight, bias, mode)
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype


def _norm_add_backward(ctx, dout, _dstats):
    # The residual's gradient is the output's; the norm's output gradient is the output's too.
    dx, _, dweight, dbias = _backward(ctx, dout, None, ctx.x_dtype, None)
    dres = None if dout is None else dout.to(ctx.res_dtype)
    return dx, dres, dweight, dbias, None, None


def _norm_add_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, _eps, weight2, bias2, _eps2, mode = inputs
    _y, total, stats, stats2 = output
    # Both norms' inputs, statistics and weights: the sum is an output, so nothing is saved twice.
    ctx.save_for_backward(x, stats, weight, total, stats2, weight2)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.bias2_dtype = None if bias2 is None else bias2.dtype
    ctx.mode = mode
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype
    ctx.set_materialize_grads(False)


def _norm_add_norm_backward(ctx, dy, dtotal, _dstats, _dstats2):
    # The second norm's backward, then the first's norm_add backward: the two ops' own, in the order autograd runs
    # them for ``norm_add`` then ``norm``. The sum's gradient is what autograd accumulates there: the second norm's
    # input gradient, rounded to the sum's dtype, plus the gradient from the sum's other readers, added in that
    # dtype. The second norm's kernel does that add itself (``round_before_dsum``: its input gradient rounded, then
    # added in fp32 and rounded again, as aten's add of the two rounds), saving a launch and its traffic: the
    # gradients are bitwise the two ops'.
    x, stats, weight, total, stats2, weight2 = ctx.saved_tensors
    dweight2 = dbias2 = None
    if dy is not None:
        dtotal, _, dweight2, dbias2 = _backward_of(dy, dtotal, total, stats2, weight2, ctx.bias2_dtype, ctx.mode,
                                                   total.dtype, None, round_before_dsum=True)
    dx, _, dweight, dbias = _backward_of(dtotal, None, x, stats, weight, ctx.bias_dtype, ctx.mode, ctx.x_dtype, None)
    dres = None if dtotal is None else dtotal.to(ctx.res_dtype)
    return dx, dres, dweight, dbias, None, dweight2, dbias2, None, None


def register_autograd_of(name: str, backward, setup) -> None:
    """The same autograd formula for both of ``define_ops``'s operators."""
    for op_name in (name, f"{name}_triton"):
        torch.library.register_autograd(qualified_name(op_name), backward, setup_context=setup)


register_autograd_of("norm_fwd", _norm_backward, _norm_setup)
register_autograd_of("norm_add_fwd", _norm_add_backward, _norm_add_setup)
register_autograd_of("add_norm_fwd", _add_norm_backward, _add_norm_setup)
register_autograd_of("norm_add_norm_fwd", _norm_add_norm_backward, _norm_add_norm_setup)


class _Ops(NamedTuple):
    """The operators of one registration that compiled calls record."""

    norm: Any
    add_norm: Any
    norm_add: Any
    norm_add_norm: Any
    backward: Any


_OP_NAMES = ("norm_fwd", "add_norm_fwd", "norm_add_fwd", "norm_add_norm_fwd", "norm_bwd")
_CUSTOM_OPS = _Ops(*(op(name) for name in _OP_NAMES))
_TRITON_OPS = _Ops(*(op(f"{name}_triton") for name in _OP_NAMES))


def records_triton_ops(t: Tensor) -> bool:
    """Whether a traced call on ``t`` records the Triton ops of ``define_ops`` (on a GPU, where inductor can launch
    the compiled kernels itself) rather than the opaque custom ops (elsewhere: interpreted kernels, the PyTorch
    implementation)."""
    return t.is_cuda


def _traced_ops(t: Tensor) -> _Ops:
    """The operators a traced call on ``t`` records (``records_triton_ops``)."""
    return _TRITON_OPS if records_triton_ops(t) else _CUSTOM_OPS


def autograd_function(name: str, impl, setup, backward) -> type:
    """An ``autograd.Function`` made of a custom op's functions, called without the custom-op dispatcher.

    Its ``forward`` takes ``ctx`` and runs the setup itself: ``Function.apply`` calls ``inspect.signature`` on every
    call of a class that defines ``setup_context`` separately, about 100 us of host time (measured on an H200
    host). torch.func transforms need ``setup_context`` and are not supported: the kernels cannot read their
    wrapped tensors.
    """

    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "__doc__": "Eager autograd path of the custom op: the same functions, called directly.",
        "forward": staticmethod(forward), "backward": staticmethod(backward),
    })


_NormFunction = autograd_function("_NormFunction", _norm_impl, _norm_setup, _norm_backward)
_AddNormFunction = autograd_function("_AddNormFunction", _add_norm_impl, _add_norm_setup, _add_norm_backward)
_NormAddFunction = autograd_function("_NormAddFunction", _norm_add_impl, _norm_add_setup, _norm_add_backward)
_NormAddNormFunction = autograd_function("_NormAddNormFunction", _norm_add_norm_impl, _norm_add_norm_setup,
                                         _norm_add_norm_backward)


def needs_autograd(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The mode the LayerNorm functions run. The RMSNorm-named functions still take it, with a DeprecationWarning.
_LAYER_NORM_MODE = "layernorm"


def _on_local_shards(rms_op: Callable[..., Any], layer_op: Callable[..., Any], mode: str, **arguments: Any) -> Any:
    """A call on DTensor arguments, run again on their local shards (``dtensor.py``) through the public function of
    ``mode``, which its errors name: ``layer_op`` for the LayerNorm mode, else ``rms_op`` given ``mode``."""
    if mode == _LAYER_NORM_MODE:
        return call_on_local_shards(layer_op, **arguments)
    return call_on_local_shards(rms_op, **arguments, mode=mode)


def _warn_layer_norm_mode(called: str, replacement: str) -> None:
    """The DeprecationWarning of ``called(..., mode="layernorm")``, attributed to the line that called it. Not while
    torch.compile traces: Dynamo cannot trace ``warnings.warn`` in a full graph (the eager calls warn)."""
    if not torch.compiler.is_compiling():
        warnings.warn(
            f"{called}(mode={_LAYER_NORM_MODE!r}) computes a LayerNorm: call hf_rmsnorm.ops.{replacement} instead; "
            f"{called} will stop accepting mode={_LAYER_NORM_MODE!r} in a future release",
            DeprecationWarning,
            stacklevel=3,
        )


def norm(x: Tensor, weight: Tensor | None, eps: float, *, bias: Tensor | None, mode: str) -> Tensor:
    """The norm of any mode in ``MODES``, and never a warning: what ``rms_norm`` and ``layer_norm`` run, and the
    entry of the package's own callers that read the mode from data.

    Args, Returns and Raises: as ``rms_norm``; ``mode`` may be ``"layernorm"`` (``layer_norm``).
    """
    return bound_norm(mode).norm(x, weight, eps, bias)


def fused_add_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, bias: Tensor | None, mode: str
) -> tuple[Tensor, Tensor]:
    """``fused_add_rms_norm`` of any mode in ``MODES``, and never a warning (see ``norm``).

    Returns and Raises: as ``fused_add_rms_norm``.
    """
    return bound_norm(mode).fused_add_norm(x, residual, weight, eps, bias)


def norm_add(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, bias: Tensor | None, mode: str
) -> Tensor:
    """``rms_norm_add`` of any mode in ``MODES``, and never a warning (see ``norm``).

    Returns and Raises: as ``rms_norm_add``.
    """
    return bound_norm(mode).norm_add(x, residual, weight, eps, bias)


def norm_add_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, bias: Tensor | None,
    weight2: Tensor | None, eps2: float, bias2: Tensor | None, mode: str,
) -> tuple[Tensor, Tensor]:
    """``(norm2(total), total)`` with ``total = norm_add(x, residual, weight, eps, bias=bias, mode=mode)`` and
    ``norm2`` the norm of ``weight2``, ``eps2`` and ``bias2`` in the same mode: a sandwich norm's add between two
    norms (Gemma 2-4's ``residual + post_attention_layernorm(h)``, read by ``pre_feedforward_layernorm``), in one
    launch for rows of one tile (``launch.norm_add_norm_forward``), with exactly the values and gradients of
    ``norm_add`` then ``norm``.

    Raises:
        TypeError, ValueError: as ``norm_add`` for ``x``, ``residual`` and the first norm's parameters; as ``norm``
            of the sum (of the residual's shape and device) for the second's.
    """
    return bound_norm(mode).norm_add_norm(x, residual, weight, eps, bias, weight2, eps2, bias2)


class BoundNorm:
    """``norm``, ``fused_add_norm``, ``norm_add`` and ``norm_add_norm`` of one mode (``bound_norm``), which every call
    of the norms goes through: a patched norm module's (``patch/fused.py``, which holds its mode's), and the public
    functions'. An eager call that records no gradient takes a launch bound once per combination of what decides
    it, instead of working it out again: decode calls are bound by host time.

    Such a call, on plain tensors (``_binding_key``), looks up its ``ForwardLaunch`` (the kernel's plan, flags and
    launch) under a key of everything the argument checks read except what varies from call to call: the op;
    ``x``'s dtype, device and last dimension; the residual's dtype and device; the weight's and the bias's dtype,
    device and shape. A key is stored only after the general path ran on such arguments, so it passed
    ``checks.check_forward`` (which reads nothing else of them) and ran the kernels: a key found proves every dtype
    loadable, every tensor on ``x``'s device, the weight and bias of ``x``'s width. Each call still checks what the
    key leaves out: the residual's whole shape (it must be ``x``'s, whose rows vary) and ``eps``; the launch reads
    the strides, the row count and the alignment itself.

    Every other call takes the general path, which checks, raises its one-line errors and computes as it always
    did: while torch.compile traces, where autograd records, tensor subclasses (DTensor, fake tensors), a key not
    seen yet (which the call then stores), a combination the kernels do not run (fp64, the CPU without the
    interpreter: stored as None), a call that fails a per-call check.

    The caches are pure functions of their keys, whatever ran before: a binding depends on nothing else but the
    tuned-plan table in use, and they are emptied when that changes (``tuning.plans_in_use``). No tensor is kept:
    the weight and eps are the caller's on every call (a patched module reads them per call, as the user may
    replace or edit them between calls).
    """

    def __init__(self, mode: str) -> None:
        get_mode(mode)  # a clear error for an unknown mode, once
        self.mode = mode
        # One cache per op: binding key -> ForwardLaunch, or None where the general path runs.
        self._norm = reads_tuned_plans(_LaunchCache())
        self._fused_add_norm = reads_tuned_plans(_LaunchCache())
        self._norm_add = reads_tuned_plans(_LaunchCache())
        # binding key of both norms (``_sandwich_key``) -> SandwichLaunch, or None where the general path runs.
        self._norm_add_norm = reads_tuned_plans(_LaunchCache())

    def norm(self, x: Tensor, weight: Tensor | None, eps: float, bias: Tensor | None) -> Tensor:
        """``norm(x, weight, eps, bias=bias, mode=self.mode)``."""
        key = _binding_key(x, None, weight, bias)
        launch = None if key is None else self._norm.get(key)
        if launch is not None and 0.0 <= (eps := float(eps)) < math.inf:
            return launch(x, None, weight, bias, eps)[0]
        y = _norm(x, weight, eps, bias, self.mode)
        if key is not None and key not in self._norm:
            self._norm[key] = self._bind(x, None, weight, bias, add_after=False)
        return y

    def fused_add_norm(self, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                       bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """``fused_add_norm(x, residual, weight, eps, bias=bias, mode=self.mode)``."""
        key = _binding_key(x, residual, weight, bias)
        launch = None if key is None else self._fused_add_norm.get(key)
        if launch is not None and residual.shape == x.shape and 0.0 <= (eps := float(eps)) < math.inf:
            y, new_residual, _ = launch(x, residual, weight, bias, eps)
            return y, new_residual
        out = _fused_add_norm(x, residual, weight, eps, bias, self.mode)
        if key is not None and key not in self._fused_add_norm:
            self._fused_add_norm[key] = self._bind(x, residual, weight, bias, add_after=False)
        return out

    def norm_add(self, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                 bias: Tensor | None) -> Tensor:
        """``norm_add(x, residual, weight, eps, bias=bias, mode=self.mode)``."""
        key = _binding_key(x, residual, weight, bias)
        launch = None if key is None else self._norm_add.get(key)
        if launch is not None and residual.shape == x.shape and 0.0 <= (eps := float(eps)) < math.inf:
            return launch(x, None, weight, bias, eps, residual)[0]
        out = _norm_add(x, residual, weight, eps, bias, self.mode)
        if key is not None and key not in self._norm_add:
            self._norm_add[key] = self._bind(x, residual, weight, bias, add_after=True)
        return out

    def norm_add_norm(self, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, bias: Tensor | None,
                      weight2: Tensor | None, eps2: float, bias2: Tensor | None) -> tuple[Tensor, Tensor]:
        """``norm_add_norm(..., mode=self.mode)``, bound as the other ops are under a key of both norms
        (``_sandwich_key``: the second norm's weight and bias are keyed as the first's); each call still checks the
        residual's shape and both ``eps``."""
        key = _sandwich_key(x, residual, weight, bias, weight2, bias2)
        launch = None if key is None else self._norm_add_norm.get(key)
        if (launch is not None and residual.shape == x.shape and 0.0 <= (eps := float(eps)) < math.inf
                and 0.0 <= (eps2 := float(eps2)) < math.inf):
            y, total, _, _ = launch(x, residual, weight, bias, eps, weight2, bias2, eps2)
            return y, total
        out = _norm_add_norm(x, residual, weight, eps, bias, weight2, eps2, bias2, self.mode)
        if key is not None and key not in self._norm_add_norm:
            self._norm_add_norm[key] = self._bind_sandwich(x, residual, weight, bias, weight2, bias2)
        return out

    def _bind_sandwich(self, x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                       weight2: Tensor | None, bias2: Tensor | None) -> SandwichLaunch | None:
        """The binding of a general-path ``norm_add_norm`` call that returned: the ``SandwichLaunch`` it launched, or
        None where it ran anything else (``_norm_add_norm_forward``'s other branches)."""
        if not _chains_in_kernel(x, residual, weight, bias, weight2, bias2, self.mode):
            return None
        return sandwich_launch(x.dtype, residual.dtype, dtype_of(weight), dtype_of(bias), dtype_of(weight2),
                               dtype_of(bias2), int(x.shape[-1]), self.mode, False, device_arch(x.get_device()))

    def _bind(self, x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
              add_after: bool) -> ForwardLaunch | None:
        """The binding of a general-path call that returned (so its arguments passed the checks): the
        ``ForwardLaunch`` it launched (``residual`` added after the norm where ``add_after``: ``norm_add``), or
        None where it ran anything else (``runs_kernels``, ``_adds_in_kernel``)."""
        if add_after:
            kernel_runs, residual_dtype = _adds_in_kernel(x, residual, weight, bias, self.mode), None
        else:
            kernel_runs, residual_dtype = runs_kernels(x, residual, weight, bias), dtype_of(residual)
        if not kernel_runs:
            return None
        return forward_launch(x.dtype, residual_dtype, dtype_of(weight), dtype_of(bias), int(x.shape[-1]), self.mode,
                              add_after, False, device_arch(x.get_device()))


class _LaunchCache(dict[tuple, ForwardLaunch | None]):
    """A ``BoundNorm``'s cache: binding key -> ``ForwardLaunch``, or None where the general path runs. Emptied
    with the plan caches when the tuned-plan table in use changes (``tuning.reads_tuned_plans``)."""

    cache_clear = dict.clear


_BOUND_NORMS = {mode: BoundNorm(mode) for mode in MODES}


def bound_norm(mode: str) -> BoundNorm:
    """The ``BoundNorm`` of ``mode``; a ``ValueError`` naming the valid modes for an unknown one."""
    bound = _BOUND_NORMS.get(mode)
    if bound is None:
        get_mode(mode)  # raises
    return bound


# Types of the tensors a bound call takes (None: an absent optional one); other types are subclasses with their own
# dispatch (DTensor, fake and functional tensors), which the general path handles.
_BINDABLE_TYPES = frozenset({Tensor, torch.nn.Parameter, type(None)})


def _binding_key(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None) -> tuple | None:
    """The key of ``BoundNorm``'s caches for a call on these arguments: what ``checks.check_forward`` reads of them
    but the residual's shape; None for a call the general path must run (while torch.compile traces, where
    autograd records, tensor subclasses, a 0-dimensional ``x``). One flat tuple: built and hashed at every bound
    call, it costs less than nested ones."""
    if (
        torch.compiler.is_compiling() or torch.is_grad_enabled() or type(x) is not Tensor
        or type(residual) not in _BINDABLE_TYPES or type(weight) not in _BINDABLE_TYPES
        or type(bias) not in _BINDABLE_TYPES
    ):
        return None
    shape = x.shape
    if not shape:
        return None
    return (
        x.dtype, x.device, shape[-1],
        *((None, None) if residual is None else (residual.dtype, residual.device)),
        *_parameter_key(weight), *_parameter_key(bias),
    )


_ABSENT_PARAMETER = (None, None, None)


def _parameter_key(t: Tensor | None) -> tuple:
    return _ABSENT_PARAMETER if t is None else (t.dtype, t.device, t.shape)


def _sandwich_key(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, weight2: Tensor | None,
                  bias2: Tensor | None) -> tuple | None:
    """``_binding_key`` of the first norm's arguments with the second norm's weight and bias (checked against the
    sum, which has ``x``'s last dimension and device) keyed as the first's; None where either is unbindable."""
    key = _binding_key(x, residual, weight, bias)
    if key is None or type(weight2) not in _BINDABLE_TYPES or type(bias2) not in _BINDABLE_TYPES:
        return None
    return *key, *_parameter_key(weight2), *_parameter_key(bias2)


# The general paths, which every call not served by a bound launch takes: DTensor arguments on their local shards,
# the traced ops while torch.compile traces, autograd, and the eager call otherwise.


def _norm(x, weight, eps, bias, mode) -> Tensor:
    if holds_dtensor(x, weight, bias):
        return _on_local_shards(rms_norm, layer_norm, mode, x=x, weight=weight, eps=eps, bias=bias)
    eps = float(eps)
    if torch.compiler.is_compiling():
        return _traced_ops(x).norm(x, weight, bias, eps, mode)[0]
    if needs_autograd(x, weight, bias):
        return _NormFunction.apply(x, weight, bias, eps, mode)[0]
    return _forward(x, None, weight, bias, eps, mode, store_stats=False)[0]


def _fused_add_norm(x, residual, weight, eps, bias, mode) -> tuple[Tensor, Tensor]:
    if holds_dtensor(x, residual, weight, bias):
        return _on_local_shards(fused_add_rms_norm, fused_add_layer_norm, mode, x=x, residual=residual,
                                weight=weight, eps=eps, bias=bias)
    eps = float(eps)
    if torch.compiler.is_compiling():
        y, new_residual, _ = _traced_ops(x).add_norm(x, residual, weight, bias, eps, mode)
    elif needs_autograd(x, residual, weight, bias):
        y, new_residual, _ = _AddNormFunction.apply(x, residual, weight, bias, eps, mode)
    else:
        y, new_residual, _ = _forward(x, residual, weight, bias, eps, mode, store_stats=False)
    return y, new_residual


def _norm_add(x, residual, weight, eps, bias, mode) -> Tensor:
    if holds_dtensor(x, residual, weight, bias):
        return _on_local_shards(rms_norm_add, layer_norm_add, mode, x=x, residual=residual, weight=weight, eps=eps,
                                bias=bias)
    eps = float(eps)
    if torch.compiler.is_compiling():
        return _traced_ops(x).norm_add(x, residual, weight, bias, eps, mode)[0]
    if needs_autograd(x, residual, weight, bias):
        return _NormAddFunction.apply(x, residual, weight, bias, eps, mode)[0]
    return _norm_add_forward(x, residual, weight, bias, eps, mode, store_stats=False)[0]


def _norm_add_norm(x, residual, weight, eps, bias, weight2, eps2, bias2, mode) -> tuple[Tensor, Tensor]:
    if holds_dtensor(x, residual, weight, bias, weight2, bias2):
        # The two ops, each on the local shards (``dtensor.py``): the same values.
        total = _norm_add(x, residual, weight, eps, bias, mode)
        return _norm(total, weight2, eps2, bias2, mode), total
    eps, eps2 = float(eps), float(eps2)
    arguments = (x, residual, weight, bias, eps, weight2, bias2, eps2, mode)
    if torch.compiler.is_compiling():
        y, total, _, _ = _traced_ops(x).norm_add_norm(*arguments)
    elif needs_autograd(x, residual, weight, bias, weight2, bias2):
        y, total, _, _ = _NormAddNormFunction.apply(*arguments)
    else:
        y, total, _, _ = _norm_add_norm_forward(*arguments, store_stats=False)
    return y, total


def rms_norm(
    x: Tensor, weight: Tensor | None, eps: float = 1e-6, *, bias: Tensor | None = None, mode: str = "llama"
) -> Tensor:
    """RMSNorm over the last dimension, numerically identical to Hugging Face's module of that family.

    Args:
        x: input of shape ``[..., hidden]``; the last dimension must be contiguous or it is copied.
        weight: ``[hidden]`` scale, or None for a norm without one (NanoChat's): then ``y = n.to(x.dtype)`` in
            every mode (plus ``bias``).
        eps: added to the mean square, in fp32.
        bias: optional ``[hidden]`` shift (used for LayerNorms converted to RMSNorm).
        mode: casting order, ``"llama"`` (default), ``"gemma"`` (``1 + w`` in fp32), ``"fp32_affine"`` (weight
            and bias applied in fp32, as OLMo2 and LayerNorm do), ``"t5"`` (the row rounded to the weight's dtype
            before the weight multiplies it, as T5's family does), ``"layernorm_as_rmsnorm"`` (a LayerNorm
            converted to RMSNorm), ``"deberta"`` (DeBERTa's own LayerNorm: the row centred and divided by its
            standard deviation) or ``"layernorm_fp32"`` (a model's own LayerNorm class written out in fp32,
            Cohere's: its patched norms run it). See ``hf_rmsnorm.ops.modes``. Deprecated: ``"layernorm"``, which
            subtracts the row mean (an exact ``nn.LayerNorm``), runs with a ``DeprecationWarning``: call
            ``layer_norm``.

    Returns:
        The normalised tensor, in the dtype the Hugging Face module would return.

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: an unknown mode; ``x`` is 0-dimensional; ``weight`` or ``bias`` is not 1-D of ``x``'s last
            dimension; a tensor is not on ``x``'s device; ``eps`` is negative, infinite or NaN (``checks.py``);
            DTensor arguments the norm is not row-local on: ``x`` sharded along its last dimension or ``Partial``,
            ``weight``/``bias`` not ``Replicate()``, other meshes, DTensors mixed with plain tensors (``dtensor.py``).

    DTensors: ``x`` sharded along any other dimension (the sequence) or replicated, with replicated ``weight`` and
    ``bias``, runs on each rank's local rows and returns a DTensor placed as ``x``; gradients are DTensors too.
    """
    if mode == _LAYER_NORM_MODE:
        _warn_layer_norm_mode("rms_norm", "layer_norm")
    return norm(x, weight, eps, bias=bias, mode=mode)


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float = 1e-6,
    *,
    bias: Tensor | None = None,
    mode: str = "llama",
) -> tuple[Tensor, Tensor]:
    """``new_residual = residual + x`` and ``rms_norm(new_residual)`` in one pass over memory.

    The sum is rounded to ``promote(x.dtype, residual.dtype)`` exactly as ``residual + x`` rounds, and the
    norm reads that rounded sum, as Hugging Face's decoder layers do. ``mode="layernorm"`` is deprecated, as in
    ``rms_norm``: call ``fused_add_layer_norm``.

    Returns:
        ``(y, new_residual)``.

    Raises:
        TypeError, ValueError: as ``rms_norm``; also a ValueError when ``residual`` does not have exactly
            ``x``'s shape (no broadcasting).
    """
    if mode == _LAYER_NORM_MODE:
        _warn_layer_norm_mode("fused_add_rms_norm", "fused_add_layer_norm")
    return fused_add_norm(x, residual, weight, eps, bias=bias, mode=mode)


def rms_norm_add(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float = 1e-6,
    *,
    bias: Tensor | None = None,
    mode: str = "llama",
) -> Tensor:
    """``residual + rms_norm(x)`` in one pass over memory: the add of a post-norm layer (OLMo2's
    ``residual + post_attention_layernorm(attention)``).

    The norm's output is rounded to its dtype before the add, and the add rounds as ``residual + y`` does in
    torch. One kernel when the norm's output dtype is the residual's (the usual case); otherwise the norm's
    kernel and torch's add. ``mode="layernorm"`` is deprecated, as in ``rms_norm``: call ``layer_norm_add``.

    Raises:
        TypeError, ValueError: as ``fused_add_rms_norm``.
    """
    if mode == _LAYER_NORM_MODE:
        _warn_layer_norm_mode("rms_norm_add", "layer_norm_add")
    return norm_add(x, residual, weight, eps, bias=bias, mode=mode)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension, with the maths and dtypes of ``torch.nn.LayerNorm``:
    ``(x - mean) * rsqrt(var + eps) * weight + bias`` over each row, the variance biased, computed in fp32 (fp64
    for an fp64 input) and rounded once to ``x``'s dtype.

    Args:
        x: input of shape ``[..., hidden]``; the last dimension must be contiguous or it is copied.
        weight: ``[hidden]`` scale, or None (``elementwise_affine=False``).
        bias: ``[hidden]`` shift, or None (``bias=False``).
        eps: added to the variance.

    Returns:
        The normalised tensor, in ``x``'s dtype.

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: ``x`` is 0-dimensional; ``weight`` or ``bias`` is not 1-D of ``x``'s last dimension; a tensor
            is not on ``x``'s device; ``eps`` is negative, infinite or NaN; DTensor arguments the norm is not
            row-local on (as ``rms_norm``, whose DTensor support this shares).
    """
    return norm(x, weight, eps, bias=bias, mode=_LAYER_NORM_MODE)


def fused_add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """``new_residual = residual + x`` and ``layer_norm(new_residual)`` in one pass over memory.

    The sum is rounded to ``promote(x.dtype, residual.dtype)`` exactly as ``residual + x`` rounds, and the norm
    reads that rounded sum.

    Returns:
        ``(y, new_residual)``.

    Raises:
        TypeError, ValueError: as ``layer_norm``; also a ValueError when ``residual`` does not have exactly
            ``x``'s shape (no broadcasting).
    """
    return fused_add_norm(x, residual, weight, eps, bias=bias, mode=_LAYER_NORM_MODE)


def layer_norm_add(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5
) -> Tensor:
    """``residual + layer_norm(x)`` in one pass over memory: the add of a post-norm layer.

    The norm's output is rounded to its dtype before the add, and the add rounds as ``residual + y`` does in
    torch. One kernel when the norm's output dtype is the residual's; otherwise the norm's kernel and torch's add.

    Raises:
        TypeError, ValueError: as ``fused_add_layer_norm``.
    """
    return norm_add(x, residual, weight, eps, bias=bias, mode=_LAYER_NORM_MODE)
