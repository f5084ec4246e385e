"""Cross-layer fusion: layer ``i``'s MLP residual add computed together with the next norm.

Layer ``i`` of a stack calls the next norm module (layer ``i + 1``'s input norm, or the final norm) on its MLP
output and residual: one kernel writes the sum and the normed sum. The layer returns the true sum, so everything
downstream (hooks, ``output_hidden_states``) sees the unpatched hidden state, and it hands the normed tensor to
the next norm, which returns it when it is called with that very sum.

A handed-off value must never be stale, so the handoff lives only inside one call of the stack's own forward
(a ``HandoffScope``, entered by the fused stack class, per thread and per task through a context variable), and
only when nothing but that forward can run between the two modules:

* the stack's forward is the one transformers defines (checked when patching and on every call), whose loop
  passes each layer's output straight to the next layer and the last one to the final norm;
* no hook that could see or change the hidden state in between (``_foreign_code_between``), and no accelerate
  hook, which moves or offloads weights;
* not under ``torch.compile`` (the scope is Python state);
* where autograd records, no saved-tensor hooks (non-reentrant activation checkpointing and activation offloading
  install them): a checkpointed layer is recomputed in the backward outside any scope, so a handoff in its first
  run would make it save other tensors than its recomputation does. Reentrant checkpointing runs the first pass
  under ``no_grad``; an entry is taken only in the grad mode it was made in, so a value computed without a graph
  never reaches a layer that records one.

In training the handed-off norm's output is an output of the fused kernel's autograd node, so its gradient, and
the norm weight's, flow through that node's backward (the sum's gradient is its other input).

A custom layer loop, a stack whose forward another library replaced, a hook editing the hidden state in place
(under ``torch.inference_mode`` tensors have no version counter to reveal it): none of them runs inside a scope
or passes the checks, so the add stays a separate op and the output is exact. Within a scope, an entry is still
returned only for the identical tensor, unmodified (its version counter, where it has one, unchanged). Entries
die with the scope: nothing is left for a later call.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class NextNorm:
    """Where layer ``i``'s MLP residual sum goes: ``norm`` is the first module to read it, and ``consumer``
    (the next layer, or the final norm itself) is the module the stack calls with it. The consumer reaches the
    norm as ``parent.<attribute>`` (the next layer's input norm, or the stack's final norm): a wrapper put there
    after patching (PEFT's ``modules_to_save``) calls another module, so the handoff checks it is still ``norm``."""

    consumer: nn.Module
    norm: nn.Module
    parent: nn.Module
    attribute: str


class HandoffScope:
    """The handoffs of one call of a stack's forward: ``links`` maps each layer to its ``NextNorm`` (set on the
    stack when patching), ``entries`` maps a norm to ``(sum, its version, grad mode, normed sum)``."""

    __slots__ = ("links", "entries")

    def __init__(self, links: dict[nn.Module, NextNorm]) -> None:
        self.links = links
        self.entries: dict[nn.Module, tuple[Tensor, int | None, bool, Tensor]] = {}


_SCOPE: ContextVar[HandoffScope | None] = ContextVar("hf_rmsnorm_handoff_scope", default=None)


def enter(links: dict[nn.Module, NextNorm]):
    """Opens a scope for one call of a stack's forward; returns the token for ``leave``."""
    return _SCOPE.set(HandoffScope(links))


def leave(token) -> None:
    _SCOPE.reset(token)


def handoff_possible() -> bool:
    """Whether a handoff may happen at all now: outside ``torch.compile``, and, where autograd records, with no
    saved-tensor hooks installed (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    # No public API says whether saved-tensor hooks are on; this is what torch.autograd.graph's own hooks read.
    return not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def target_of(layer: nn.Module, hidden_states: Tensor) -> NextNorm | None:
    """The norm layer ``layer`` may compute ahead of time for ``hidden_states``, or None (module docstring)."""
    scope = _SCOPE.get() if handoff_possible() else None
    if scope is None:
        return None
    target = scope.links.get(layer)
    if target is None or target.parent._modules.get(target.attribute) is not target.norm:
        return None
    weight = getattr(target.norm, "weight", None)
    if isinstance(weight, Tensor) and weight.device != hidden_states.device:
        return None
    return None if _foreign_code_between(layer, target) else target


def add_residual(layer: nn.Module, branch: Tensor, residual: Tensor) -> Tensor:
    """``residual + branch``, ``layer``'s output; inside a scope, when allowed, from the next norm's kernel, which
    also computes that norm of it and hands it over (module docstring)."""
    target = target_of(layer, branch)
    if target is None:
        return residual + branch
    normed, hidden_states = target.norm(branch, residual=residual)
    put(target.norm, hidden_states, normed)
    return hidden_states


def hooked(module: nn.Module) -> bool:
    """Whether a forward hook or pre-hook, of ``module`` or global, would see ``module``'s call: a fused call
    passes it other arguments than the original's."""
    return bool(module._forward_pre_hooks or module._forward_hooks) or _global_forward_hooks()


def put(norm: nn.Module, hidden_states: Tensor, normed: Tensor) -> None:
    """Hands ``normed`` to ``norm`` for its next call with ``hidden_states`` (inside the current scope)."""
    _SCOPE.get().entries[norm] = (hidden_states, _version(hidden_states), torch.is_grad_enabled(), normed)


def take(norm: nn.Module, hidden_states: Tensor) -> Tensor | None:
    """What was handed to ``norm`` for exactly ``hidden_states``, unmodified, in the current grad mode; None
    otherwise. Consumes the entry."""
    # No scope is ever entered under torch.compile; checking first keeps the context variable out of the trace.
    scope = _SCOPE.get() if handoff_possible() else None
    if scope is None:
        return None
    entry = scope.entries.pop(norm, None)
    if entry is None or entry[0] is not hidden_states or entry[1] != _version(hidden_states):
        return None
    return entry[3] if entry[2] == torch.is_grad_enabled() else None


def _version(t: Tensor) -> int | None:
    # Inference tensors have no version counter; the scope and the hook checks are what rule out edits then.
    return None if t.is_inference() else t._version


def _foreign_code_between(layer: nn.Module, target: NextNorm) -> bool:
    """Hooks that may see or change the hidden state between ``layer`` and the next norm, or that the next
    norm's extra call from inside ``layer`` would surprise: forward hooks on ``layer`` other than transformers'
    read-only output recorders, pre-hooks on the next layer, any hook on the next norm, global module hooks,
    and accelerate's hooks (they move and offload weights)."""
    norm = target.norm
    if hooked(norm) or target.consumer._forward_pre_hooks:
        return True
    if any(not _is_output_recorder(hook) for hook in layer._forward_hooks.values()):
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
