"""What the fused attention forwards (``qk_attention.py``) run at every call: the class forward choosing between
the derived forward and the original, and ``norm_rope``, which runs the q/k norms and the RoPE as one
``qk_norm_rope`` launch where that computes what the original statements compute (``qk_sites.py`` says why the
rewrite is exact under these checks), and otherwise evaluates those statements."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.modes import get_mode
from ..ops.qk import qk_norm_rope
from ..ops.checks import check_qk_norm_rope
from ..ops.dtensor import holds_dtensor
from . import guard
from .families import NormKind
from .qk_sites import TRANSPOSE


def attention_forward(self, *args, **kwargs):
    """The attention's forward derived for the fused q/k site; the class forward itself where a hook watches the
    attention, its q/k norms or a module called between them and the RoPE (``guard.watched``), or where the class
    forward was replaced since patching (another library's wrapper runs, unfused)."""
    cls = type(self)
    forward = cls._hf_rmsnorm_base.forward
    if forward is not cls._hf_rmsnorm_checked_forward or _watched(self, cls._hf_rmsnorm_kind.site):
        return forward(self, *args, **kwargs)
    return cls._hf_rmsnorm_body(self, *args, **kwargs)


def _watched(attention: nn.Module, site) -> bool:
    if guard.watched(attention):
        return True
    for path in (site.q_norm, site.k_norm, *site.between):
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
                                per_head=site.per_head)
    if cast is not None:  # the function returns its input's dtype (qk_probe)
        q_out, k_out = q_out.to(cast), k_out.to(cast)
    return q_out, k_out


def _fused_arguments(kind, q_norm, k_norm, rope, q_in, k_in, cos, sin, q_view, k_view):
    """``qk_norm_rope``'s arguments (q and k ``[batch, tokens, heads, head_dim]``, weights, eps, mode) and the dtype to
    cast its outputs to (None: none), where it computes what the original statements do: ``rope`` is the function probed
    when patching (``qk_probe``), with the module-level functions it read then; both norms patched norms of one casting
    mode, without a bias; plain tensors (no DTensor, no subclass); the layouts of ``qk_sites``' invariant 4; ``cos``'s
    rotary width and the (norm output, cos) dtype pair probed; the operator's own argument checks passed. None
    otherwise."""
    if not (rope is kind.rope and rope.__code__ is kind.rope_code and rope.__defaults__ == kind.rope_defaults):
        return None
    module_globals = rope.__globals__
    for name, value in kind.rope_globals:
        if module_globals.get(name) is not value:
            return None
    q_kind = getattr(type(q_norm), "_hf_rmsnorm_kind", None)
    k_kind = getattr(type(k_norm), "_hf_rmsnorm_kind", None)
    if not (isinstance(q_kind, NormKind) and isinstance(k_kind, NormKind) and q_kind.mode == k_kind.mode):
        return None
    for norm, norm_kind in ((q_norm, q_kind), (k_norm, k_kind)):
        if norm_kind.bias_attr is not None and getattr(norm, norm_kind.bias_attr) is not None:
            return None
    for t in (q_in, k_in, cos, sin):
        if type(t) is not Tensor:
            return None
    site = kind.site
    q_states, k_states = _chain(q_in, site.q_ops, q_view), _chain(k_in, site.k_ops, k_view)
    dims = 4 if site.per_head else 3
    if q_in.dim() != dims or k_in.dim() != dims or q_states.dim() != 4 or k_states.dim() != 4:
        return None
    q, k = q_states.transpose(1, 2), k_states.transpose(1, 2)
    if not site.per_head and (q.shape[:2] != q_in.shape[:2] or k.shape[:2] != k_in.shape[:2]):
        return None
    if cos.dim() != 3 or (cos.shape[-1] != q.shape[-1] and not kind.partial):
        return None
    q_weight = None if q_kind.weight_attr is None else getattr(q_norm, q_kind.weight_attr)
    k_weight = None if k_kind.weight_attr is None else getattr(k_norm, k_kind.weight_attr)
    if holds_dtensor(q_weight, k_weight):
        return None
    mode = get_mode(q_kind.mode)
    norm_dtype = mode.output_dtype(q.dtype, q_weight, None)
    if mode.output_dtype(k.dtype, k_weight, None) != norm_dtype:
        return None
    casts = [cast for pair, cast in kind.dtypes if pair == (norm_dtype, cos.dtype)]
    if not casts:
        return None
    q_eps, k_eps = getattr(q_norm, q_kind.eps_attr), getattr(k_norm, k_kind.eps_attr)
    if not (isinstance(q_eps, (int, float)) and isinstance(k_eps, (int, float))):
        return None
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return None
    try:
        check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, float(q_eps), float(k_eps), q_kind.mode, site.per_head)
    except (TypeError, ValueError):
        return None
    return q, k, q_weight, k_weight, float(q_eps), float(k_eps), q_kind.mode, norm_dtype if casts[0] else None
