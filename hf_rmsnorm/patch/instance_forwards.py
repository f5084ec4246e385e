"""Forwards that other libraries set on a module instance, and which of them a patched module can live with.

A class swap changes what ``type(module).forward`` is, but several libraries call a forward they keep on the
instance instead, bound before patching. Each is recognised here, and ``instance_problem`` judges them one line
each:

* accelerate's hooks call ``module._old_forward`` (and leave ``module.forward`` bound after
  ``remove_hook_from_module``): the patcher re-points both at the patched class's forward.
* ``kernels.kernelize`` (transformers' hub kernels, ``use_kernels=True``) binds a hub layer's ``forward`` to each
  module whose class names a hub layer: patching sets it aside while patched, and unpatching puts it back.
* transformers' tensor-parallel plans wrap the forward bound when the plan was applied in a ``tp_forward``
  closure: a wrapper that only hooks gradients calls the patched forward once its cell is re-pointed; one that
  transforms the arguments (sequence parallel) keeps the module from being patched, with the reason.

Anything else on the instance is unknown code: the module is left alone and the report names the function.
"""

from __future__ import annotations

import types

from torch import nn


def is_bound(method: object, module: nn.Module, function: object) -> bool:
    return isinstance(method, types.MethodType) and method.__self__ is module and method.__func__ is function


def instance_problem(module: nn.Module) -> str | None:
    """Why a forward set on the instance keeps ``module`` from being patched, if one does. Each known case is
    judged by one line below: the class's own forward bound to it (``_swap_class`` re-points it), accelerate's
    hook (which calls ``_old_forward``), a hub layer's forward (``hub_forward``: set aside while patched), a
    tensor-parallel plan's wrapper (``_tensor_parallel_problem``)."""
    class_forward = type(module).forward
    forward = module.__dict__.get("forward")
    if forward is None or is_bound(forward, module, class_forward):
        return None
    if "_hf_hook" in module.__dict__ and is_bound(module.__dict__.get("_old_forward"), module, class_forward):
        return None
    if hub_forward(module) is not None:
        return None
    if _tensor_parallel_forward_cell(module) is not None:
        return _tensor_parallel_problem(module)
    return (
        f"its forward was replaced on the instance by {function_path(forward)}; "
        "call patch_model before wrapping it"
    )


def tensor_parallel_planned(module: nn.Module) -> bool:
    """Whether a transformers tensor-parallel plan wrapped ``module``'s forward (a style of the plan applies to it)."""
    return _tensor_parallel_forward_cell(module) is not None


def hub_forward(module: nn.Module) -> types.MethodType | None:
    """The hub layer's forward ``kernels.kernelize`` set on ``module`` itself, if it did: kernelize binds a hub
    layer's ``forward`` to each module whose class names a hub layer (``kernel_layer_name``, set by transformers'
    ``use_kernel_forward_from_hub``). Patching takes it off the instance, so the fused class forward runs (the
    hub layer computes the same norm but takes no residual), and ``unpatch_model`` puts it back."""
    forward = module.__dict__.get("forward")
    if (
        hasattr(type(module), "kernel_layer_name") and isinstance(forward, types.MethodType)
        and forward.__self__ is module and forward.__func__ is not type(module).forward
    ):
        return forward
    return None


def function_path(function: object) -> str:
    """Where ``function`` (or a bound method's) really comes from: its code's qualified name in its globals' module
    (``functools.wraps`` copies ``__module__`` and ``__qualname__``, not these); a callable object's class."""
    function = getattr(function, "__func__", function)
    if isinstance(function, types.FunctionType):
        return f"{function.__globals__.get('__name__')}.{function.__code__.co_qualname}"
    return f"{type(function).__module__}.{type(function).__qualname__}"


# transformers' tensor-parallel plans (``from_pretrained(tp_plan=...)``) give a planned module a style of
# ``transformers.distributed.tensor_parallel`` whose ``install_forward`` replaces ``module.forward`` on the
# instance by a closure ``tp_forward`` around the forward bound at that time (its variable ``original_forward``).
# Wrappers of these qualified names only hook the parameters' gradients (ReplicatedWithGradAllReduce, Qwen3's
# q_norm/k_norm in "auto" plans: an all-reduce of each gradient) and call the wrapped forward with the arguments
# and output unchanged (transformers 5.17's ReplicatedWithGradAllReduce adds a module backward hook instead, which
# needs no rule). The base style's wrapper does the same when the style keeps the base transforms.
_GRADIENT_HOOK_TP_WRAPPERS = frozenset({"ReplicatedWithGradAllReduce.install_forward.<locals>.tp_forward"})
_BASE_TP_WRAPPER = "TensorParallelLayer.install_forward.<locals>.tp_forward"
_TP_TRANSFORMS = (
    "transform_inputs_pre_forward", "context_around_forward", "should_use_local_tensors",
    "transform_output_post_forward",
)


def _tensor_parallel_forward_cell(module: nn.Module) -> types.CellType | None:
    """The closure cell through which a transformers tensor-parallel wrapper on ``module`` calls the forward it
    wrapped; None when ``module``'s instance forward is no such wrapper."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, types.FunctionType) or forward.__name__ != "tp_forward":
        return None
    if not forward.__module__.startswith("transformers."):
        return None
    return _closure_cells(forward).get("original_forward")


def _closure_cells(function: types.FunctionType) -> dict[str, types.CellType]:
    return dict(zip(function.__code__.co_freevars, function.__closure__ or ()))


def _tensor_parallel_problem(module: nn.Module) -> str | None:
    """Why the tensor-parallel wrapper on ``module`` keeps it from being patched; None when the patched forward
    can run inside it: the wrapper calls ``module``'s class forward (``rebind_tensor_parallel_forward`` points
    it at the patched one) with the arguments and output as they are."""
    forward = module.__dict__["forward"]
    cells = _closure_cells(forward)
    style = cells["self"].cell_contents if "self" in cells else None
    style_name = type(style).__name__ if style is not None else forward.__qualname__.split(".")[0]
    if not is_bound(cells["original_forward"].cell_contents, module, type(module).forward):
        return (
            f"transformers' tensor-parallel style {style_name} wraps a forward other than {type(module).__name__}'s "
            "own; call patch_model before replacing it"
        )
    if forward.__qualname__ in _GRADIENT_HOOK_TP_WRAPPERS:
        return None
    base = next((c for c in type(style).__mro__ if c.__name__ == "TensorParallelLayer"), None)
    if (
        forward.__qualname__ == _BASE_TP_WRAPPER and base is not None
        and all(getattr(type(style), name) is getattr(base, name) for name in _TP_TRANSFORMS)
    ):
        return None
    return (
        f"transformers' tensor-parallel style {style_name} transforms its arguments and output around its forward, "
        "and a fused residual add would pass the residual around that transform; hf_rmsnorm patches norms under "
        "styles that pass them through unchanged: leave the norms out of the tp_plan to patch them"
    )


def rebind_tensor_parallel_forward(module: nn.Module, old_forward: object, new_cls: type) -> None:
    """Points the forward that a tensor-parallel wrapper on ``module`` calls at ``new_cls``'s forward, if it
    called ``old_forward``: the wrapper holds the forward bound when the plan was applied, which a class swap
    alone would leave running (``_swap_class`` calls this both ways, patching and restoring)."""
    cell = _tensor_parallel_forward_cell(module)
    if cell is not None and is_bound(cell.cell_contents, module, old_forward):
        cell.cell_contents = types.MethodType(new_cls.forward, module)
