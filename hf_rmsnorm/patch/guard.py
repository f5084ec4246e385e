"""The one guard of every fused site: a fused add or handoff runs only where no hook would see it.

A fused site calls modules otherwise than the unpatched code does:

* an add inside a layer (a shape's body, ``shapes.py``, or a derived forward's ``norm_of_sum`` and
  ``norm_then_add``) calls the norm next to it as ``norm(branch, residual=residual)``, returning ``(normed,
  sum)``, or as ``norm(x, add_to=residual)``, returning the sum: where the original calls ``norm(sum)`` and adds
  ``residual + norm(x)`` itself;
* a handoff (``handoff.py``) calls layer ``i`` with a private keyword and gets the normed sum appended to its
  output, calls layer ``i + 1`` with that normed sum appended to its arguments, and never calls that layer's input
  norm (or the final norm).

Whatever a hook would see of such a call must be what it sees unpatched, so every fused site asks ``watched``
of the modules it calls otherwise, on every call, and runs the original computation (the plain add, the norm
called on the sum, the plain layer calls) when one is watched. What watches a module:

* a forward hook or pre-hook (with or without kwargs) sees the module's arguments and output, and may replace
  them: a pre-hook of a norm would see ``(branch, residual=...)`` instead of the sum, and its edit of the input
  would miss the residual;
* a full backward hook or backward pre-hook sees the gradients of the module's tensor outputs (and a full one of
  its tensor inputs), captured around the call: a fused norm call has two tensor inputs and two outputs, so a hook
  of the norm would get two gradients where it gets one, the branch's with the residual's mixed in; a non-full
  (legacy) backward hook sees its module's last autograd node, which the fused kernel replaces;
* a global hook (``torch.nn.modules.module.register_module_*``) is all of these for every module.

Which modules each site calls otherwise:

* An add inside a layer: the norm, only. The layer itself is called with the same arguments and returns the same
  output whether its inner adds are fused or not, so its hooks see the same either way: a forward hook sees the
  layer's output (the sum), a pre-hook its inputs (and what it edits reaches the fused body as it reaches the
  original), a full backward hook and a backward pre-hook the gradients of its inputs and outputs, which the fused
  kernel's backward computes as the unfused add's (bit for bit: tests/patch/test_hooks.py). The other modules
  inside the layer (the attention, the MLP) are called with the same arguments too; a residual dropout a shape's
  body leaves out while it is inactive is called, unfused, when watched. So hooks of the layer leave its inner
  adds fused; any hook of the norm, forward or backward, turns its add off; a global hook turns every add off.
  One exception is not guarded: a legacy non-full backward hook of the layer (deprecated by PyTorch) sees the
  layer's last autograd node, which is the fused kernel's where a layer's last statement is a fused ``residual +
  norm(x)`` (post-norm layers).
* A handoff: the two layers and the norm (``handoff.foreign_code``): every hook of the norm; every hook of the
  layers but transformers' output recorders (forward hooks that append ``output[0]``, the sum, to a list, and
  change nothing: ``is_output_recorder``) and the LayerNorm conversion's centring pre-hook of a stack's first
  layer, which only hands on.

The test is the condition ``nn.Module.__call__`` itself tests before running hooks, read at every call (the
module's hook dictionaries and ``torch.nn.modules.module``'s global ones, through that module object): a hook
registered before or after ``patch_model``, or removed, decides the very next call, and nothing is kept.

A site that found its norm unwatched calls it through ``unwatched_call``, which asks the same question and then
skips ``nn.Module.__call__``'s dispatch where that dispatch would call the module's forward and nothing else (a
decode call is bound by host time, and the dispatch costs about as much as an aten op on the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.modules.module as _torch_module
from torch import nn

# What nn.Module's call runs, as torch defines it (read when this module is imported): ``__call__`` is
# ``_wrapped_call_impl``, which calls the compiled module (``nn.Module.compile``) or ``self._call_impl``.
_MODULE_CALL = nn.Module._wrapped_call_impl
_MODULE_CALL_IMPL = nn.Module._call_impl


def _never(hook: Callable) -> bool:
    return False


def watched(module: nn.Module, read_only: Callable[[Callable], bool] = _never) -> bool:
    """Whether a hook would see a call of ``module`` or its backward (module docstring): any backward hook or
    backward pre-hook of ``module``, any global hook, any forward hook or pre-hook of ``module`` but those
    ``read_only`` accepts (hooks that see the same either way)."""
    # nn.Module keeps its hook dictionaries in its __dict__: read there, they skip the slower attribute lookup
    # nn.Module.__getattr__ imposes (this runs at every fused site of every call).
    hooks = module.__dict__
    if (hooks["_backward_hooks"] or hooks["_backward_pre_hooks"]
            or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
            or _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks):
        return True
    forward, pre = hooks["_forward_hooks"], hooks["_forward_pre_hooks"]
    if not (forward or pre):  # the common case, decided without a scan
        return False
    return not (all(map(read_only, forward.values())) and all(map(read_only, pre.values())))


def is_output_recorder(hook: Callable) -> bool:
    """Whether ``hook`` is one of transformers' output recorders (``output_hidden_states`` and the like) taking
    ``output[0]``: a forward hook that appends its module's output, or the first item of a tuple, to a list, and
    changes nothing. (One taking another item would take the normed sum a handing layer appends.)"""
    if not (getattr(hook, "__name__", None) == "output_capturing_hook"
            and getattr(hook, "__module__", None) == "transformers.utils.output_capturing"):
        return False
    index = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ())).get("index")
    return index is not None and index.cell_contents == 0


def calls_forward_alone(module: nn.Module) -> bool:
    """Whether calling ``module`` would run its ``forward`` and nothing else: no hook watches it (``watched``, no
    hook exempted) and ``nn.Module.__call__`` dispatches straight to ``forward`` (``_dispatches_to_forward``). A site
    that runs a module's fused work without calling it (``sandwich.fused_pair`` takes two norms' parameters) asks
    this."""
    return not watched(module) and _dispatches_to_forward(module)


def unwatched_call(module: nn.Module) -> Callable | None:
    """None where a hook would see a call of ``module`` (``watched``, no hook exempted); otherwise what calling
    ``module`` runs: its bound ``forward`` itself where ``nn.Module.__call__`` would call just that
    (``_dispatches_to_forward``), else ``module``."""
    if watched(module):
        return None
    return module.forward if _dispatches_to_forward(module) else module


def _dispatches_to_forward(module: nn.Module) -> bool:
    """Without hooks (``watched`` tests ``_call_impl``'s condition for running any), ``nn.Module.__call__`` calls
    ``self.forward`` (an instance's own ``forward`` included) and nothing else, provided that: the class neither
    overrides ``__call__`` nor ``_call_impl`` and no instance attribute shadows ``_call_impl``, and both are still
    torch's (a profiler may wrap them); the module was not compiled on its own (``nn.Module.compile`` sets
    ``_compiled_call_impl``); and no ``torch.jit.trace`` is running (which calls ``_slow_forward``). Each is read
    here at every call, right before the call."""
    cls, state = type(module), module.__dict__
    return (cls.__call__ is _MODULE_CALL and cls._call_impl is _MODULE_CALL_IMPL and "_call_impl" not in state
            and state.get("_compiled_call_impl") is None and not torch._C._get_tracing_state())
