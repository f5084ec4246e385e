"""The fused behaviour of patched modules: norms that take a residual, and one generic pre-norm layer body.

A patched module keeps its object, parameters and attribute paths; only its class changes, to a subclass of
the original made here (cached, same ``__name__``, ``__qualname__`` and ``__module__``) whose ``forward`` calls
the kernels. ``isinstance`` checks and lookups by class name (FSDP, ``_no_split_modules``, output recorders)
see the original class, and ``GradientCheckpointingLayer`` wraps the new ``forward`` like any subclass's.

Cross-layer fusion (inference only): layer ``i`` computes its MLP residual sum *and* the next norm of that
sum in one kernel, by calling the next norm module. It returns the true sum, so everything downstream
(hooks, ``output_hidden_states``) sees the unpatched hidden state, and hands the normed tensor to the next
norm through a ``Handoff``. The next norm returns it only when called with that very tensor, unmodified;
otherwise it computes as usual. ``_may_hand_off`` lists when layer ``i`` does this at all.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .families import LayerKind, NormKind
from .ops import fused_add_rms_norm, rms_norm

_FUSED: dict[tuple[type, NormKind | LayerKind], type] = {}


def fused_class(base: type, kind: NormKind | LayerKind) -> type:
    """The fused subclass of ``base`` for ``kind``, created once per pair."""
    cls = _FUSED.get((base, kind))
    if cls is None:
        namespace = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "__reduce_ex__": _reduce_ex,
            "_hf_rmsnorm_base": base,
            "_hf_rmsnorm_kind": kind,
        }
        if isinstance(kind, NormKind):
            namespace.update(forward=_norm_forward, _hf_rmsnorm_handoff=None, _hf_rmsnorm_stream=None)
        else:
            forward = _parallel_layer_forward if kind.parallel else _layer_forward
            namespace.update(forward=forward, _hf_rmsnorm_next=None)
        cls = _FUSED[(base, kind)] = type(base.__name__, (base,), namespace)
    return cls


def original_class(module: nn.Module) -> type | None:
    """The class a patched module had before patching, or ``None`` if ``module`` is not patched."""
    return type(module).__dict__.get("_hf_rmsnorm_base")


def _reduce_ex(self, protocol):
    # The fused class's qualified name is the original's, so pickle cannot find it by name: pickle the original
    # class and the kind instead and rebuild the fused class on load (also what copy.deepcopy goes through).
    cls = type(self)
    if original_class(self) is None:
        # A subclass made on top of ours (FSDP2 makes one per wrapped module) keeps the default behaviour.
        return object.__reduce_ex__(self, protocol)
    return _new_fused, (cls._hf_rmsnorm_base, cls._hf_rmsnorm_kind), self.__getstate__()


def _new_fused(base: type, kind: NormKind | LayerKind) -> nn.Module:
    cls = fused_class(base, kind)
    return cls.__new__(cls)


class Handoff:
    """Holds a norm output computed ahead of time for one exact input tensor (see the module docstring).

    The input is held by weak reference (the entry dies with it) together with its version counter, so an
    in-place change makes the entry stale. The entry is consumed by the first call, hit or miss.
    """

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref, int | None, Tensor] | None = None

    def put(self, source: Tensor, normed: Tensor) -> None:
        # One tuple, replaced whole: a concurrent reader sees either the old entry or the new one.
        self._entry = (weakref.ref(source, self._expire), _version(source), normed)

    def take(self, source: Tensor) -> Tensor | None:
        entry, self._entry = self._entry, None
        if entry is None or torch.is_grad_enabled():
            return None
        ref, version, normed = entry
        return normed if ref() is source and _version(source) == version else None

    def _expire(self, ref: weakref.ref) -> None:
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    def __reduce__(self):
        # Copies and pickles start empty: an entry refers to one live tensor of this process.
        return Handoff, ()


def _version(t: Tensor) -> int | None:
    # Inference tensors have no version counter; _may_hand_off then requires that no foreign code can run.
    return None if t.is_inference() else t._version


@dataclass
class NextNorm:
    """Where layer ``i``'s MLP residual sum goes: ``norm`` is the first module to read it, and ``consumer``
    (the next layer, or the final norm itself) is the module the model calls with it."""

    consumer: nn.Module
    norm: nn.Module


def _norm_forward(self, hidden_states: Tensor, residual: Tensor | None = None):
    """``norm(hidden_states)``, or with ``residual`` the pair ``(norm(residual + hidden_states), residual +
    hidden_states)`` from one kernel."""
    kind: NormKind = self._hf_rmsnorm_kind
    eps = getattr(self, kind.eps_attr)
    bias = None if kind.bias_attr is None else getattr(self, kind.bias_attr)
    mode = kind.mode
    stream = self._hf_rmsnorm_stream
    if stream is not None:
        # A LayerNorm converted to RMSNorm (hf_rmsnorm.conversion): the mode depends on the call.
        mode = stream.mode(self, (hidden_states, residual, self.weight, bias))
    if residual is not None:
        return fused_add_rms_norm(hidden_states, residual, self.weight, eps, bias=bias, mode=mode)
    handoff = self._hf_rmsnorm_handoff
    if handoff is not None and not torch.compiler.is_compiling():
        normed = handoff.take(hidden_states)
        if normed is not None:
            return normed
    return rms_norm(hidden_states, self.weight, eps, bias=bias, mode=mode)


def _layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """The sequential pre-norm decoder layer of ``LayerKind``, with the residual adds inside the norm kernels."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    hidden_states = _attend(self, kind, getattr(self, kind.input_norm)(hidden_states), args, kwargs)

    post_attention_norm = getattr(self, kind.post_attention_norm)
    if _dropout_active(self, kind.attention_dropout):
        residual = residual + _scaled(self, kind, getattr(self, kind.attention_dropout)(hidden_states))
        hidden_states = post_attention_norm(residual)
    else:
        hidden_states, residual = post_attention_norm(_scaled(self, kind, hidden_states), residual=residual)
    hidden_states = getattr(self, kind.mlp)(hidden_states)

    if _dropout_active(self, kind.mlp_dropout):
        return residual + _scaled(self, kind, getattr(self, kind.mlp_dropout)(hidden_states))
    return _add_residual(self, _scaled(self, kind, hidden_states), residual)


def _parallel_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """The parallel pre-norm block of ``LayerKind`` (both branches read the same input): the original's calls
    in the original's order (the dropouts draw random numbers), then ``(attention + mlp) + residual``, whose
    add goes into the next norm's kernel in inference (the branch sum is computed first, as the original does;
    NeoX's ``mlp + attention`` is the same IEEE sum)."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    normed = getattr(self, kind.input_norm)(hidden_states)
    attention = _dropped(self, kind.attention_dropout, _attend(self, kind, normed, args, kwargs))
    if kind.post_attention_norm is not None:
        normed = getattr(self, kind.post_attention_norm)(residual)
    mlp = _dropped(self, kind.mlp_dropout, getattr(self, kind.mlp)(normed))
    return _add_residual(self, attention + mlp, residual)


def _attend(layer: nn.Module, kind: LayerKind, normed: Tensor, args: tuple, kwargs: dict) -> Tensor:
    """The attention branch: every layer argument but the hidden states goes to the attention by name, as the
    original forward passes it; the normed states by ``kind.attention_input`` (or positionally)."""
    if args:
        names = kind.forward_params[1:]
        if len(args) > len(names):
            raise TypeError(f"{type(layer).__name__}.forward takes at most {len(names) + 1} positional arguments")
        kwargs.update(zip(names, args))
    attention = getattr(layer, kind.attention)
    if kind.attention_input is None:
        output, _ = attention(normed, **kwargs)
    else:
        output, _ = attention(**{kind.attention_input: normed}, **kwargs)
    return output


def _add_residual(layer: nn.Module, branch: Tensor, residual: Tensor) -> Tensor:
    """``residual + branch``, the layer's output; in inference, when allowed, from the next norm's kernel, which
    also computes that norm of it and hands it over (module docstring)."""
    target: NextNorm | None = layer._hf_rmsnorm_next
    if target is not None and _may_hand_off(layer, target, branch):
        normed, hidden_states = target.norm(branch, residual=residual)
        target.norm._hf_rmsnorm_handoff.put(hidden_states, normed)
        return hidden_states
    return residual + branch


def _dropped(layer: nn.Module, name: str | None, branch: Tensor) -> Tensor:
    # Called whenever the original calls it (active or not), so the random stream is the original's.
    return branch if name is None else getattr(layer, name)(branch)


def _scaled(layer: nn.Module, kind: LayerKind, branch: Tensor) -> Tensor:
    # Rounded to the branch's dtype before the add, exactly as `residual + h * multiplier` rounds.
    return branch if kind.residual_scale is None else branch * getattr(layer, kind.residual_scale)


def _dropout_active(layer: nn.Module, name: str | None) -> bool:
    """A residual dropout that would change its input (a fused add is exact only when it would not)."""
    if name is None:
        return False
    dropout = getattr(layer, name)
    return dropout.training and dropout.p > 0


def _may_hand_off(layer: nn.Module, target: NextNorm, hidden_states: Tensor) -> bool:
    """Whether layer ``i`` may compute the next norm ahead of time. Only in inference (no autograd graph to
    keep, and nothing for gradient checkpointing to replay), outside ``torch.compile`` (the handoff is Python
    state), with the next norm's weight where the activations are (not offloaded, not on another device), and
    when no code but the model's own can run between the two modules (``_foreign_code_between``)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if target.norm.weight.device != hidden_states.device:
        return False
    return not _foreign_code_between(layer, target)


def _foreign_code_between(layer: nn.Module, target: NextNorm) -> bool:
    """Hooks that may see or change the hidden state between ``layer`` and the next norm, or that the next
    norm's extra call from inside ``layer`` would surprise: forward hooks on ``layer`` other than transformers'
    read-only output recorders, pre-hooks on the next layer, any hook on the next norm, global module hooks,
    and accelerate's hooks (they move and offload weights). The version check of ``Handoff`` alone cannot
    catch in-place edits of inference tensors, hence this stricter rule for every mode."""
    norm = target.norm
    if norm._forward_pre_hooks or norm._forward_hooks or target.consumer._forward_pre_hooks:
        return True
    if any(not _is_output_recorder(hook) for hook in layer._forward_hooks.values()):
        return True
    if _global_forward_hooks():
        return True
    return any("_hf_hook" in m.__dict__ for m in (layer, target.consumer, norm))


def _is_output_recorder(hook) -> bool:
    # transformers' `output_hidden_states` / `output_attentions` recorders only append outputs to a list.
    return (
        getattr(hook, "__name__", None) == "output_capturing_hook"
        and getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
    )


def _global_forward_hooks() -> bool:
    module = torch.nn.modules.module
    return bool(getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None))
