"""What the fused attention forwards (``qk_attention.py``) run at every call: the class forward choosing between
the derived forward and the original, and ``norm_rope``, which runs the q/k norms and the RoPE as one
``qk_norm_rope`` launch where that computes what the original statements compute (``qk_sites.py`` says why the
rewrite is exact under these checks), and otherwise evaluates those statements; ``norm_rope_one`` and
``rope_norm`` likewise for the one-tensor sites and the RoPE before the norms."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.modes import get_mode
from ..ops.qk import qk_norm_rope, qk_rope_norm
from ..ops.qk_launch import qk_output_dtype
from ..ops.checks import check_qk_norm_rope
from ..ops.dtensor import holds_dtensor
from . import guard
from .attributes import registered_parameter
from .families import NormKind
from .qk_sites import TRANSPOSE


def attention_forward(self, *args, **kwargs):
    """The attention's forward derived for the fused q/k site; the class forward itself where a hook watches the
    attention, its q/k norms or a module called between them and the RoPE (``guard.watched``), or where the class
    forward was replaced since patching (another library's wrapper runs, unfused)."""
    cls = type(self)
    forward = cls._hf_rmsnorm_base.forward
    if forward is not cls._hf_rmsnorm_checked_forward or _watched(self, cls._hf_rmsnorm_kind.watched_paths):
        return forward(self, *args, **kwargs)
    return cls._hf_rmsnorm_body(self, *args, **kwargs)


def _watched(attention: nn.Module, paths: tuple[tuple[str, ...], ...]) -> bool:
    if guard.watched(attention):
        return True
    for path in paths:
        module = attention
        for attr in path:
            module = getattr(module, attr, None)
        if isinstance(module, nn.Module) and guard.watched(module):
            return True
    return False


def _chain(x: Tensor, ops: tuple[str, ...], view: tuple) -> Tensor:
    """``OPS`` (``qk_sites``): the views that take a norm's output to the RoPE."""
    for op in ops:
        x = x.transpose(1, 2) if op == TRANSPOSE else x.view(*view)
    return x


def norms_apart(attention: nn.Module, q_norm: nn.Module, k_norm: nn.Module, q_in: Tensor, k_in: Tensor,
                q_view: tuple, k_view: tuple) -> tuple[Tensor, Tensor]:
    """``OPS_q(q_norm(q_in)), OPS_k(k_norm(k_in))``: the original statements of the site's norms, where the RoPE
    does not run (``qk_sites``' invariant 6) or cannot run fused."""
    site = type(attention)._hf_rmsnorm_kind.site
    return _chain(q_norm(q_in), site.q_ops, q_view), _chain(k_norm(k_in), site.k_ops, k_view)


def norm_rope(attention: nn.Module, q_norm: nn.Module, k_norm: nn.Module, rope, q_in: Tensor, k_in: Tensor,
              cos: Tensor, sin: Tensor, q_view: tuple, k_view: tuple) -> tuple[Tensor, Tensor]:
    """``rope(OPS_q(q_norm(q_in)), OPS_k(k_norm(k_in)), cos, sin)``, from one ``qk_norm_rope`` launch when it
    computes that (``_fused_arguments``)."""
    kind = type(attention)._hf_rmsnorm_kind
    site = kind.site
    fused = _fused_arguments(kind, q_norm, k_norm, rope, q_in, k_in, cos, sin, q_view, k_view)
    if fused is None:
        return rope(*norms_apart(attention, q_norm, k_norm, q_in, k_in, q_view, k_view), cos, sin)
    q, k, q_weight, k_weight, q_eps, k_eps, mode, cast = fused
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps=k_eps, mode=mode,
                                per_head=site.per_head, negate_sin=kind.negate_sin)
    if cast is not None:  # the function returns its input's dtype (qk_probe)
        q_out, k_out = q_out.to(cast), k_out.to(cast)
    return q_out, k_out


def norm_rope_one(norm: nn.Module, x_in: Tensor, rope, cos: Tensor, sin: Tensor, attention: nn.Module) -> Tensor:
    """``rope(norm(x_in), cos, sin, unsqueeze_dim=2)`` (``qk_sites``' "One tensor at a time"), from one
    ``qk_norm_rope`` launch of ``x_in`` with no key heads where it computes that (``_one_tensor_arguments``)."""
    fused = _one_tensor_arguments(type(attention)._hf_rmsnorm_kind, norm, rope, x_in, cos, sin)
    if fused is None:
        return rope(norm(x_in), cos, sin, unsqueeze_dim=2)
    weight, eps, mode, cast = fused
    out, _ = qk_norm_rope(x_in, _no_heads(x_in), weight, None, cos, sin, eps, k_eps=eps, mode=mode, per_head=True,
                          negate_sin=type(attention)._hf_rmsnorm_kind.negate_sin)
    out = out.transpose(1, 2)  # back to x_in's [batch, tokens, heads, head_dim], as the function returns it
    return out if cast is None else out.to(cast)


def rope_norm(attention: nn.Module, q_norm: nn.Module, k_norm: nn.Module, rope, q: Tensor, k: Tensor, cos: Tensor,
              sin: Tensor) -> tuple[Tensor, Tensor]:
    """``q_norm(Q), k_norm(K)`` of ``Q, K = rope(q, k, cos, sin)`` (``qk_sites``' "The RoPE before the norms"), from
    one ``qk_rope_norm`` launch where it computes that (``_rope_first_arguments``)."""
    kind = type(attention)._hf_rmsnorm_kind
    fused = _rope_first_arguments(kind, q_norm, k_norm, rope, q, k, cos, sin)
    if fused is None:  # the statements as written, the norms in their order
        q, k = rope(q, k, cos, sin)
        if kind.site.q_first:
            q = q_norm(q)
            return q, k_norm(k)
        k = k_norm(k)
        return q_norm(q), k
    q_weight, k_weight, q_eps, k_eps, mode = fused
    return qk_rope_norm(q.transpose(1, 2), k.transpose(1, 2), q_weight, k_weight, cos, sin, q_eps, k_eps=k_eps,
                        mode=mode, per_head=True, negate_sin=kind.negate_sin)


def _rope_first_arguments(kind, q_norm, k_norm, rope, q, k, cos, sin):
    """``qk_rope_norm``'s weights, eps and mode where one launch computes what ``rope_norm``'s statements do: the
    function, the norms and the tensors as ``_probed_rope_and_norms`` wants them; q and k ``[batch, heads, tokens,
    head_dim]`` (the norms per head); for each, the probe's verdict on its (dtype, cos's dtype) pair, the RoPE
    returning the promoted dtype, or casting back to q's or k's own dtype where that is the promoted one; the
    operator's own argument checks passed. None otherwise."""
    parameters = _probed_rope_and_norms(kind, rope, (q_norm, k_norm), (q, k, cos, sin))
    if parameters is None or q.dim() != 4 or k.dim() != 4:
        return None
    (q_kind, q_weight, q_eps), (_, k_weight, k_eps) = parameters
    for x in (q, k):
        cast = _probed_cast(kind, x.dtype, x, cos, sin)
        if cast is None or cast[0] not in (None, qk_output_dtype(x.dtype, cos.dtype)):
            return None
    try:
        check_qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), q_weight, k_weight, cos, sin, q_eps, k_eps,
                           q_kind.mode, True, True)
    except (TypeError, ValueError):
        return None
    return q_weight, k_weight, q_eps, k_eps, q_kind.mode


def _no_heads(x: Tensor) -> Tensor:
    """``x`` with no heads: the absent key of a one-tensor launch."""
    return x[:, :, :0]


def _one_tensor_arguments(kind, norm, rope, x_in, cos, sin):
    """``(weight, eps, mode, cast)`` for ``norm_rope_one`` where one launch computes what its statements do: the
    checks of ``_fused_arguments`` on one norm, ``x_in`` ``[batch, tokens, heads, head_dim]``. None otherwise."""
    parameters = _probed_rope_and_norms(kind, rope, (norm,), (x_in, cos, sin))
    if parameters is None or x_in.dim() != 4:
        return None
    ((norm_kind, weight, eps),) = parameters
    cast = _probed_cast(kind, get_mode(norm_kind.mode).output_dtype(x_in.dtype, weight, None), x_in, cos, sin)
    if cast is None:
        return None
    try:
        check_qk_norm_rope(x_in, _no_heads(x_in), weight, None, cos, sin, eps, eps, norm_kind.mode, True)
    except (TypeError, ValueError):
        return None
    return weight, eps, norm_kind.mode, cast[0]


def _probed_rope_and_norms(kind, rope, norms: tuple[nn.Module, ...], tensors: tuple) -> list | None:
    """Each norm's ``(kind, weight, eps)`` where ``rope`` is the function probed when patching (``qk_probe``), with
    the module-level functions it read then, the norms are patched norms of one casting mode, without a bias, with
    a weight that is no DTensor and a numeric eps, and ``tensors`` are plain tensors (no DTensor, no subclass); None
    otherwise."""
    if not (rope is kind.rope and rope.__code__ is kind.rope_code and rope.__defaults__ == kind.rope_defaults):
        return None
    module_globals = rope.__globals__
    for name, value in kind.rope_globals:
        if module_globals.get(name) is not value:
            return None
    if any(type(t) is not Tensor for t in tensors):
        return None
    found = []
    for norm in norms:
        norm_kind = getattr(type(norm), "_hf_rmsnorm_kind", None)
        if not isinstance(norm_kind, NormKind) or (found and norm_kind.mode != found[0][0].mode):
            return None
        if norm_kind.bias_attr is not None and registered_parameter(norm, norm_kind.bias_attr) is not None:
            return None
        weight = None if norm_kind.weight_attr is None else registered_parameter(norm, norm_kind.weight_attr)
        eps = getattr(norm, norm_kind.eps_attr)
        if holds_dtensor(weight) or not isinstance(eps, (int, float)):
            return None
        found.append((norm_kind, weight, float(eps)))
    return found


def _probed_cast(kind, norm_dtype: torch.dtype, x: Tensor, cos: Tensor,
                 sin: Tensor) -> tuple[torch.dtype | None] | None:
    """``(the dtype the function casts its result to, or None)`` where the probe found the function to compute the
    kernel's RoPE for ``(norm_dtype, cos.dtype)``, ``cos`` is ``[batch or 1, tokens, rotary_dim]`` of a rotary width
    probed (the head's, or less where the function rotates part of it) and no gradient reaches the tables; None
    otherwise."""
    if cos.dim() != 3 or (cos.shape[-1] != x.shape[-1] and not kind.partial):
        return None
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return None
    casts = [cast for pair, cast in kind.dtypes if pair == (norm_dtype, cos.dtype)]
    return (norm_dtype if casts[0] else None,) if casts else None


def _fused_arguments(kind, q_norm, k_norm, rope, q_in, k_in, cos, sin, q_view, k_view):
    """``qk_norm_rope``'s arguments (q and k ``[batch, tokens, heads, head_dim]``, weights, eps, mode) and the dtype to
    cast its outputs to (None: none), where it computes what the original statements do: the function, the norms and
    the tensors as ``_probed_rope_and_norms`` wants them; the layouts of ``qk_sites``' invariant 4; ``cos``'s rotary
    width and the (norm output, cos) dtype pair probed (``_probed_cast``); the operator's own argument checks passed.
    None otherwise."""
    parameters = _probed_rope_and_norms(kind, rope, (q_norm, k_norm), (q_in, k_in, cos, sin))
    if parameters is None:
        return None
    (q_kind, q_weight, q_eps), (_, k_weight, k_eps) = parameters
    site = kind.site
    q_states, k_states = _chain(q_in, site.q_ops, q_view), _chain(k_in, site.k_ops, k_view)
    dims = 4 if site.per_head else 3
    if q_in.dim() != dims or k_in.dim() != dims or q_states.dim() != 4 or k_states.dim() != 4:
        return None
    q, k = q_states.transpose(1, 2), k_states.transpose(1, 2)
    if not site.per_head and (q.shape[:2] != q_in.shape[:2] or k.shape[:2] != k_in.shape[:2]):
        return None
    mode = get_mode(q_kind.mode)
    norm_dtype = mode.output_dtype(q.dtype, q_weight, None)
    if mode.output_dtype(k.dtype, k_weight, None) != norm_dtype:
        return None
    cast = _probed_cast(kind, norm_dtype, q, cos, sin)
    if cast is None:
        return None
    try:
        check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, q_kind.mode, site.per_head)
    except (TypeError, ValueError):
        return None
    return q, k, q_weight, k_weight, q_eps, k_eps, q_kind.mode, cast[0]
