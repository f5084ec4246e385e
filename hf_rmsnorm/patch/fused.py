"""The fused behaviour of patched modules: norms that take a residual, decoder layers that run the fused body of
their shape (``shapes.py``) or the forward derived from their code (``derived_rewrite.py``), and stacks whose derived
forward lets each layer hand the next norm's output on (``handoff.py``).

A patched module keeps its object, parameters and attribute paths; only its class changes, to a subclass of
the original made here (cached, same ``__name__``, ``__qualname__`` and ``__module__``) whose ``forward`` calls
the kernels. ``isinstance`` checks and lookups by class name (FSDP, ``_no_split_modules``, output recorders)
see the original class, and ``GradientCheckpointingLayer`` wraps the new ``forward`` like any subclass's. That
``forward`` has the original's signature and docstring (a norm's adds ``residual`` and ``add_to``), and the class
names no hub layer, so ``kernels.kernelize`` leaves it alone.
A patched module holds no reference to any other module, so copying one copies nothing else; the links from
each layer to the next norm live on the stack that owns both.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

from torch import Tensor, nn

from ..ops.functional import BoundNorm, bound_norm
from . import derived_rewrite, handoff, qk_attention, qk_runtime
from .derived_blocks import DerivedBlockKind
from .derived_sites import DerivedLayerKind
from .families import LayerKind, NormKind, StackKind
from .qk_attention import QKAttentionKind

# Every kind a module is patched by.
Kind = NormKind | LayerKind | DerivedLayerKind | DerivedBlockKind | StackKind | QKAttentionKind
_FUSED: dict[tuple[type, Kind], type] = {}


def fused_class(base: type, kind: Kind) -> type:
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
            "kernel_layer_name": _NO_HUB_LAYER,
        }
        if isinstance(kind, NormKind):
            bound, arguments = bound_norm(kind.mode), kind.argument_reader()
            norm_forward = _norm_forward(bound, arguments)
            # What ``sandwich.fused_pair`` reads of a patched norm to run its kernel without calling the norm: the
            # very objects its forward holds.
            namespace.update(_hf_rmsnorm_norm=bound, _hf_rmsnorm_arguments=staticmethod(arguments))
            namespace["forward"] = _forward_like(norm_forward, base.forward, _norm_signature(base.forward))
            namespace["forward"].__doc__ = norm_forward.__doc__  # it says what the fused forward adds
        elif isinstance(kind, QKAttentionKind):
            # An attention module whose q/k norms and RoPE run as one launch (``qk_attention.py``).
            namespace.update(qk_attention.class_namespace(base, kind),
                             forward=_forward_like(qk_runtime.attention_forward, base.forward))
        elif isinstance(kind, StackKind):
            # The forward derived when patching, from the forward then checked: a stack whose class forward is
            # replaced later runs the replacement, unfused.
            namespace.update(
                forward=_forward_like(_stack_forward, base.forward),
                _hf_rmsnorm_checked_forward=staticmethod(base.forward),
                _hf_rmsnorm_derived_forward=staticmethod(
                    derived_rewrite.fused_stack_forward(base, kind.layers, kind.final_norm)),
            )
        else:
            # GradientCheckpointingLayer wraps this forward, so what it passes the body is a checkpoint's input. The
            # body was made for the class forward then checked: one replaced later runs instead, unfused.
            namespace["forward"] = _forward_like(_layer_forward, base.forward)
            namespace["_hf_rmsnorm_checked_forward"] = staticmethod(base.forward)
            if isinstance(kind, DerivedLayerKind):
                namespace["_hf_rmsnorm_body"] = staticmethod(derived_rewrite.fused_forward(base, kind))
            elif isinstance(kind, DerivedBlockKind):
                namespace["_hf_rmsnorm_body"] = staticmethod(derived_rewrite.fused_block_forward(base, kind))
            else:
                namespace["_hf_rmsnorm_body"] = staticmethod(kind.shape.body)
                # The original's own argument names (the cache one changed across transformers releases):
                # positional arguments go on to the attention under these, as the original passes them.
                namespace["_hf_rmsnorm_arg_names"] = layer_arg_names(base)[1:]
        cls = _FUSED[(base, kind)] = type(base.__name__, (base,), namespace)
        # The forward as installed (transformers may wrap it when the class is made): one another library sets on
        # the class later is not this one (``handoff`` then makes the plain calls).
        cls._hf_rmsnorm_forward = cls.__dict__["forward"]
    return cls


def layer_arg_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional-or-keyword parameters after ``self``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


def original_class(module: nn.Module) -> type | None:
    """The class a patched module had before patching, or ``None`` if ``module`` is not patched."""
    return base_class(type(module))


def base_class(cls: type) -> type | None:
    """The class a fused class was made from, or ``None`` if ``cls`` is no fused class."""
    return cls.__dict__.get("_hf_rmsnorm_base")


class _HiddenHubLayerName:
    """Hides the ``kernel_layer_name`` a fused class would inherit (transformers' ``use_kernel_forward_from_hub``
    sets it on the norm classes): ``kernels.kernelize``, run again by a ``use_kernels`` model on every
    ``train()``/``eval()``, replaces the instance forward of every module whose class has one by a hub layer's,
    which takes no ``residual`` and fuses nothing. Reading it raises ``AttributeError``, so ``hasattr`` is false
    and kernelize leaves patched modules, and their kernels, alone."""

    def __get__(self, instance: object, owner: type | None = None):
        raise AttributeError("kernel_layer_name: a module patched by hf_rmsnorm runs its own fused forward")


_NO_HUB_LAYER = _HiddenHubLayerName()


def _forward_like(body, original, signature: inspect.Signature | None = None):
    """``body`` (one of the forwards below) as a function of its own under ``original``'s name, qualified name,
    docstring and signature (``signature``, by default ``original``'s), with its first argument named as
    ``original`` names it. ``inspect.signature`` (Trainer's column selection, transformers' generation and tests)
    then sees the parameters the patched module accepts, at no cost per call. Its ``__module__`` stays this
    module's, so the patcher never takes it for the forward transformers defines."""
    signature = signature or inspect.signature(original)
    code = body.__code__
    if code.co_argcount >= 2:
        # Gemma's norms take ``x``, nn.LayerNorm ``input``: a call passing it by that name must still work.
        varnames = list(code.co_varnames)
        varnames[1] = list(signature.parameters)[1]
        code = code.replace(co_varnames=tuple(varnames))
    forward = types.FunctionType(code, body.__globals__, original.__name__, body.__defaults__, body.__closure__)
    forward.__kwdefaults__ = body.__kwdefaults__
    forward.__qualname__ = original.__qualname__
    forward.__doc__ = original.__doc__
    forward.__signature__ = signature
    return forward


def _norm_signature(original) -> inspect.Signature:
    """``original``'s signature (``self`` and the input) plus what a fused norm adds: ``residual`` and
    ``add_to``."""
    signature = inspect.signature(original)
    added = [
        inspect.Parameter("residual", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Tensor | None),
        inspect.Parameter("add_to", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Tensor | None),
    ]
    return signature.replace(parameters=list(signature.parameters.values())[:2] + added)


def _reduce_ex(self, protocol):
    # The fused class's qualified name is the original's, so pickle cannot find it by name: pickle the original
    # class and the kind instead and rebuild the fused class on load (also what copy.deepcopy goes through).
    cls = type(self)
    if original_class(self) is None:
        # A subclass made on top of ours (FSDP2 makes one per wrapped module) keeps the default behaviour.
        return object.__reduce_ex__(self, protocol)
    return _new_fused, (cls._hf_rmsnorm_base, cls._hf_rmsnorm_kind), self.__getstate__()


def _new_fused(base: type, kind: Kind) -> nn.Module:
    cls = fused_class(base, kind)
    return cls.__new__(cls)


def _norm_forward(bound: BoundNorm, arguments: Callable[[nn.Module], tuple]):
    """The fused forward of a norm whose kind's argument reader is ``arguments`` and whose mode's ``BoundNorm``
    (launches bound once) is ``bound``, both held by the function rather than looked up at every call: a decode
    call is bound by host time."""

    def norm_forward(self, hidden_states: Tensor, residual: Tensor | None = None, *, add_to: Tensor | None = None):
        """``norm(hidden_states)``; with ``residual`` the pair ``(norm(residual + hidden_states), residual +
        hidden_states)`` from one kernel; with ``add_to`` (post-norm layers) ``add_to + norm(hidden_states)``."""
        weight, eps, bias = arguments(self)
        if add_to is not None:
            return bound.norm_add(hidden_states, add_to, weight, eps, bias)
        if residual is not None:
            return bound.fused_add_norm(hidden_states, residual, weight, eps, bias)
        return bound.norm(hidden_states, weight, eps, bias)

    return norm_forward


def _layer_forward(self, *args, **kwargs):
    """The layer's fused body (its shape's, or the forward derived from its code), given what the derived stack
    loop hands it and asks of it (``handoff.run_layer``); the layer class's forward itself, unfused, if it was
    replaced since patching (another library's wrapper: it runs, as on the unpatched layer)."""
    cls = type(self)
    forward = cls._hf_rmsnorm_base.forward
    if forward is not cls._hf_rmsnorm_checked_forward:
        return handoff.run_layer(functools.partial(_unfused_body, forward), self, args, kwargs)
    return handoff.run_layer(cls._hf_rmsnorm_body, self, args, kwargs)


def _unfused_body(forward, layer, *args, _hf_rmsnorm_call: handoff.LayerCall | None = None, **kwargs):
    """``forward`` as a body: the normed input the loop hands it is not used (its input norm runs) and it hands
    nothing on (``handoff.run_layer`` returns no normed output then)."""
    return forward(layer, *args, **kwargs)


def _stack_forward(self, *args, **kwargs):
    """The stack's forward derived from its own (``derived_rewrite.fused_stack_forward``), whose loop hands each layer's
    normed output on; the stack class's forward itself, unfused, if it was replaced since patching."""
    cls = type(self)
    forward = cls._hf_rmsnorm_base.forward
    if forward is not cls._hf_rmsnorm_checked_forward:
        return forward(self, *args, **kwargs)
    return cls._hf_rmsnorm_derived_forward(self, *args, **kwargs)
