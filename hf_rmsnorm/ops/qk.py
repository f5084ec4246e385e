"""Public functional API of the fused query/key norms and rotary embedding: ``qk_norm_rope`` (the norms, then the
RoPE) and ``qk_rope_norm`` (the RoPE, then the norms), differentiable and torch.compile-able, in one launch forward
and one backward.

It computes what an attention module of the Qwen3, Gemma 3 or OLMo 2 kind does between its projections and its
attention call::

    query_states = apply_rotary_pos_emb(q_norm(q).transpose(1, 2), ...)   # and the same for k

and what NanoChat and HunYuan compute in the other order (``qk_rope_norm``, the op's ``rope_first``)::

    query_states = q_norm(apply_rotary_pos_emb(q.transpose(1, 2), ...))

Registered as ``functional.py``'s norms are (``functional.define_ops``: a custom op and a Triton op,
``qk_norm_rope_fwd`` and ``qk_norm_rope_bwd`` in ``library.NAMESPACE``, with fake implementations); eager calls skip
the dispatcher (an ``autograd.Function`` of the same functions where a gradient is needed, a direct call
otherwise), and ``backend.runs_kernels`` picks the kernels or the PyTorch implementation
(``reference.qk_norm_rope_reference``). The arguments are checked first (``checks.check_qk_norm_rope``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .backend import runs_kernels
from .checks import check_qk_norm_rope, check_qk_norm_rope_backward
from .dtensor import holds_dtensor
from .functional import autograd_function, define_ops, needs_autograd, records_triton_ops, register_autograd_of
from .launch import is_traced
from .library import op
from .modes import dtype_of
from .qk_launch import qk_norm_rope_backward, qk_norm_rope_forward, qk_result_dtype, qk_stats_shape


def _forward(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first, negate_sin,
             store_stats=True):
    """``(q_out, k_out, stats)``, outputs ``[batch, tokens, heads, head_dim]``; the kernels skip the statistics
    (None) without ``store_stats`` (only the backward reads them)."""
    check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first)
    if runs_kernels(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_forward(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, store_stats,
                                    rope_first, negate_sin)
    return reference.qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head,
                                            rope_first, negate_sin)


def _fwd_impl(
    q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor, sin: Tensor, q_eps: float,
    k_eps: float, mode: str, per_head: bool, rope_first: bool = False, negate_sin: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first, negate_sin)


_qk_fwd = define_ops("qk_norm_rope_fwd", _fwd_impl)


@_qk_fwd.register_fake
def _(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first=False, negate_sin=False):
    check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first)
    q_out = q.new_empty(q.shape, dtype=qk_result_dtype(mode, q.dtype, dtype_of(q_weight), cos.dtype, rope_first))
    k_out = k.new_empty(k.shape, dtype=qk_result_dtype(mode, k.dtype, dtype_of(k_weight), cos.dtype, rope_first))
    return q_out, k_out, q.new_empty(qk_stats_shape(q, k, per_head), dtype=torch.float32)


def _bwd_impl(
    dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
    cos: Tensor, sin: Tensor, stats: Tensor, mode: str, per_head: bool, rope_first: bool = False,
    negate_sin: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, d q_weight, d k_weight)``; an absent weight's gradient is an empty tensor (custom ops cannot
    return None)."""
    check_qk_norm_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats, mode, per_head,
                                rope_first)
    if runs_kernels(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin):
        dq, dk, dqw, dkw = qk_norm_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats, mode,
                                                 per_head, rope_first, negate_sin)
    else:
        dq, dk, dqw, dkw = reference.qk_norm_rope_backward_reference(dq_out, dk_out, q, k, q_weight, k_weight, cos,
                                                                     sin, stats, mode, per_head, rope_first,
                                                                     negate_sin)
        dq, dk = dq.to(q.dtype), dk.to(k.dtype)
        dqw = None if dqw is None else dqw.to(q_weight.dtype)
        dkw = None if dkw is None else dkw.to(k_weight.dtype)
    return tuple(dq.new_empty(0) if t is None else t for t in (dq, dk, dqw, dkw))


_qk_bwd = define_ops("qk_norm_rope_bwd", _bwd_impl)


@_qk_bwd.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats, mode, per_head, rope_first=False, negate_sin=False):
    check_qk_norm_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats, mode, per_head,
                                rope_first)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            q.new_empty(0) if q_weight is None else torch.empty_like(q_weight),
            k.new_empty(0) if k_weight is None else torch.empty_like(k_weight))


def _setup(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, _q_eps, _k_eps, mode, per_head, *rotation = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, output[2])
    ctx.mode, ctx.per_head = mode, per_head
    # The op's defaults where a caller leaves them out (eager dispatch fills them in, a compiled graph's trace does
    # not: tests/trace_qk_ops.py): the norms first, the angle as given.
    ctx.rope_first, ctx.negate_sin = (*rotation, False, False)[:2]
    # The statistics' gradient (never used) then arrives as None instead of materialised zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, dq_out, dk_out, _dstats):
    q, k, q_weight, k_weight, cos, sin, stats = ctx.saved_tensors
    dq_out = _zero_gradient(q, q_weight, cos, ctx.mode, ctx.rope_first) if dq_out is None else dq_out
    dk_out = _zero_gradient(k, k_weight, cos, ctx.mode, ctx.rope_first) if dk_out is None else dk_out
    # The operator only while a graph is traced (its dispatch costs host time: functional._backward).
    if torch.compiler.is_compiling() or is_traced(q):
        backward = _QK_TRITON_BWD if records_triton_ops(q) else _QK_CUSTOM_BWD
    else:
        backward = _bwd_impl
    dq, dk, dqw, dkw = backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats, ctx.mode, ctx.per_head,
                                ctx.rope_first, ctx.negate_sin)
    return (dq, dk, dqw if q_weight is not None else None, dkw if k_weight is not None else None,
            None, None, None, None, None, None, None, None)


def _zero_gradient(x: Tensor, weight: Tensor | None, cos: Tensor, mode: str, rope_first: bool) -> Tensor:
    """The gradient of an output nothing used: zeros of its shape and dtype."""
    return x.new_zeros(x.shape, dtype=qk_result_dtype(mode, x.dtype, dtype_of(weight), cos.dtype, rope_first))


register_autograd_of("qk_norm_rope_fwd", _backward, _setup)
_QK_CUSTOM_FWD, _QK_TRITON_FWD = op("qk_norm_rope_fwd"), op("qk_norm_rope_fwd_triton")
_QK_CUSTOM_BWD, _QK_TRITON_BWD = op("qk_norm_rope_bwd"), op("qk_norm_rope_bwd_triton")
_QKFunction = autograd_function("_QKFunction", _fwd_impl, _setup, _backward)


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    *,
    k_eps: float | None = None,
    mode: str = "llama",
    per_head: bool = True,
    negate_sin: bool = False,
) -> tuple[Tensor, Tensor]:
    """The query and key norms, then the rotary embedding, as an attention module computes them: for each of q and
    k, ``n = norm(x)`` in the norm family's casting ``mode``, then ``n * cos + rotate_half(n) * sin`` over the first
    ``cos.shape[-1]`` columns of each head (the rest passes through: partial rotary), with the roundings of
    Hugging Face's ``apply_rotary_pos_emb``. Outputs are equal bit for bit to the model's own in bf16 and fp16
    where the norms' fp32 statistics are (``docs/numerics.md``).

    Args:
        q, k: the projections viewed into heads, ``[batch, tokens, heads, head_dim]``, as ``q_proj(h).view(batch,
            tokens, -1, head_dim)`` gives them (any strides; the last dimension is copied unless contiguous); k may
            have fewer heads (GQA).
        q_weight, k_weight: the norms' weights, or None for norms without one. ``per_head`` (Qwen3, Gemma 3): a
            norm over each head, weights ``[head_dim]``; otherwise (OLMo 2) a norm over all of a token's heads
            together, weights ``[heads * head_dim]``.
        cos, sin: as the rotary embedding returns them, ``[batch or 1, tokens, rotary_dim]``, ``rotary_dim`` even and
            at most ``head_dim``; the pairs rotated are columns ``j`` and ``j + rotary_dim / 2`` of each head
            (``rotate_half``; interleaved pairs are not this function's).
        eps: q's norm's eps, and k's unless ``k_eps`` is given.
        mode: the norms' casting order: ``"llama"`` (Qwen3, Qwen3-MoE, GLM-4-MoE), ``"gemma"`` (Gemma 3, Qwen3-Next),
            ``"fp32_affine"`` (OLMo 2 and 3) or ``"layernorm_as_rmsnorm"``; see ``hf_rmsnorm.ops.modes``.
        negate_sin: rotate by the opposite angle, ``n * cos - rotate_half(n) * sin``, bit for bit as a
            ``rotate_half`` returning ``(x2, -x1)`` (NanoChat's) computes it.

    Returns:
        ``(q_out, k_out)``, ``[batch, heads, tokens, head_dim]``: the layout the attention takes (eager's
        ``.transpose(1, 2)`` of a contiguous ``[batch, tokens, heads, head_dim]``, which is what these are), in the
        dtype eager's RoPE returns (the norm's output dtype promoted with ``cos``'s).

    Raises:
        TypeError: a tensor is not fp16, bf16, fp32 or fp64.
        ValueError: the shapes above not met; a norm row wider than the kernels take; a tensor on another device;
            an eps negative, infinite or NaN; an unknown or centring mode (``checks.check_qk_norm_rope``); ``cos``
            or ``sin`` requiring a gradient (none is computed for them); DTensor arguments.
    """
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, k_eps, mode, per_head, False, negate_sin)


def qk_rope_norm(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    *,
    k_eps: float | None = None,
    mode: str = "llama",
    per_head: bool = True,
    negate_sin: bool = False,
) -> tuple[Tensor, Tensor]:
    """``qk_norm_rope`` in the other order, as NanoChat's and HunYuan's attention modules compute it: for each of q
    and k, the rotary embedding ``r = x * cos + rotate_half(x) * sin`` over the first ``cos.shape[-1]`` columns of
    each head, with the roundings of Hugging Face's ``apply_rotary_pos_emb``, in its dtype (the promotion of x's and
    ``cos``'s), then ``norm(r)`` in the norm family's casting ``mode``. One launch forward, one backward (which
    computes the rotated rows again). Outputs are equal bit for bit to the model's own where the norms' fp32
    statistics are (``docs/numerics.md``).

    Args:
        q, k, q_weight, k_weight, cos, sin, eps, k_eps, mode, per_head, negate_sin: as ``qk_norm_rope``'s.

    Returns:
        ``(q_out, k_out)``, ``[batch, heads, tokens, head_dim]`` (the transposed view of contiguous ``[batch,
        tokens, heads, head_dim]`` tensors), in the norm's output dtype for rows of the RoPE's dtype.

    Raises:
        TypeError, ValueError: as ``qk_norm_rope``; also a ValueError where the RoPE's dtype is not, for both q and
            k, their own or, for both, ``cos``'s (``checks.check_qk_norm_rope``).
    """
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, k_eps, mode, per_head, True, negate_sin)


def _launch(q, k, q_weight, k_weight, cos, sin, eps, k_eps, mode, per_head, rope_first, negate_sin):
    """The operator's call for ``qk_norm_rope`` and ``qk_rope_norm``: the traced op while torch.compile traces, the
    autograd function where a gradient is needed, the forward itself otherwise."""
    name = "qk_rope_norm" if rope_first else "qk_norm_rope"
    k_eps = eps if k_eps is None else k_eps
    if holds_dtensor(q, k, q_weight, k_weight, cos, sin):
        raise ValueError(f"{name}: DTensor arguments are not supported; pass the local tensors (to_local()), "
                         "or apply the norms and the RoPE apart")
    q_eps, k_eps = float(eps), float(k_eps)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(f"{name}: cos or sin requires a gradient, which {name} does not compute; detach "
                         "them, or apply the norms and the RoPE apart")
    if torch.compiler.is_compiling():
        op = _QK_TRITON_FWD if records_triton_ops(q) else _QK_CUSTOM_FWD
        q_out, k_out, _ = op(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first,
                             negate_sin)
    elif needs_autograd(q, k, q_weight, k_weight):
        q_out, k_out, _ = _QKFunction.apply(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head,
                                            rope_first, negate_sin)
    else:
        q_out, k_out, _ = _forward(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, mode, per_head, rope_first,
                                   negate_sin, store_stats=False)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
