"""Hooks and the fused sites (``hf_rmsnorm.patch.guard``): whatever hook watches a norm, a layer, a residual
dropout or every module, registered before or after ``patch_model``, the patched model computes, shows the hook and
differentiates exactly as the same kernels with no add fused, and fuses every add no hook watches; removing the
hook fuses them all again. Registered shapes (Llama, Qwen3; OLMo2's post-norm, Phi3's dropouts) and forwards
derived from a layer's code (GraniteMoE, Apertus) alike. Every hook here also changes what it sees (a forward
hook scales the output, a pre-hook the input, a backward hook zeroes the gradients it passes on), so a fused site
that bypassed it would change the logits or the gradients."""

from __future__ import annotations

import pytest
import torch
from family_cases import CASES
from patch_models import clone, family_model, input_ids, patch_unfused, tiny_model, training_step
from transformers.utils.output_capturing import install_output_capuring_hook

from harness import residual_census
from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import guard

# A global backward hook fires on every module, the model's own call included (whose output is no tensor) and
# those no input of which needs a gradient: PyTorch warns of both.
pytestmark = pytest.mark.filterwarnings("ignore:For backward hooks to be called", "ignore:Full backward hook is firing")

FAMILIES = ["llama", "qwen3", "granitemoe", "apertus"]
# The norm layer 0's attention add goes into, by family.
INNER_NORM = {
    "llama": "model.layers.0.post_attention_layernorm",
    "qwen3": "model.layers.0.post_attention_layernorm",
    "granitemoe": "model.layers.0.post_attention_layernorm",
    "apertus": "model.layers.0.feedforward_layernorm",
}
MODULE_KINDS = ["forward", "pre", "pre with kwargs", "backward", "backward pre"]
GLOBAL_KINDS = ["forward", "pre", "backward", "backward pre"]  # torch has no global pre-hook with kwargs
GLOBAL_REGISTER = {
    "forward": torch.nn.modules.module.register_module_forward_hook,
    "pre": torch.nn.modules.module.register_module_forward_pre_hook,
    "backward": torch.nn.modules.module.register_module_full_backward_hook,
    "backward pre": torch.nn.modules.module.register_module_full_backward_pre_hook,
}


def _pairs(kinds: list[tuple[str, str]]) -> list[tuple[str, str, str, str]]:
    """``(family, scope, kind, when)``: each family with each hook kind once, registered before ``patch_model`` or
    after it in turn, so that every family and every kind meets both moments (the full product would test each
    family's fused sites against each kind twice over)."""
    return [(family, scope, kind, ("before", "after")[(i + j) % 2])
            for i, (scope, kind) in enumerate(kinds) for j, family in enumerate(FAMILIES)]


def _scaled(value):
    # A tensor, or the first item of a layer's output tuple, times 1.5.
    return value * 1.5 if isinstance(value, torch.Tensor) else (value[0] * 1.5, *value[1:])


def _zeros(grads: tuple) -> tuple:
    return tuple(None if g is None else torch.zeros_like(g) for g in grads)


def _record(*values) -> tuple:
    """What a hook saw: detached copies of its tensors, in the structure around them (tuples, dict items, type
    names)."""
    def seen(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, (tuple, list)):
            return tuple(seen(v) for v in value)
        if isinstance(value, dict):
            return tuple((key, seen(v)) for key, v in sorted(value.items()))
        return type(value).__name__
    return seen(values)


def _hook(kind: str, seen: list, target: torch.nn.Module):
    """A hook of ``kind`` that records what it sees of ``target``'s calls (a global hook sees every module's) into
    ``seen`` and changes it."""
    if kind == "forward":
        def hook(module, args, output):
            if module is target:
                seen.append(_record(args, output))
                return _scaled(output)
    elif kind == "pre":
        def hook(module, args):
            if module is target:
                seen.append(_record(args))
                return (_scaled(args[0]), *args[1:])
    elif kind == "pre with kwargs":
        def hook(module, args, kwargs):
            seen.append(_record(args, kwargs))
            return (_scaled(args[0]), *args[1:]), kwargs
    elif kind == "backward":
        def hook(module, grad_input, grad_output):
            if module is target:
                seen.append(_record(grad_input, grad_output))
                return _zeros(grad_input)
    else:
        def hook(module, grad_output):
            if module is target:
                seen.append(_record(grad_output))
                return _zeros(grad_output)
    return hook


def _register(kind: str, scope: str, target: torch.nn.Module, seen: list):
    hook = _hook(kind, seen, target)
    if scope == "global":
        return GLOBAL_REGISTER[kind](hook)
    if kind == "pre with kwargs":
        return target.register_forward_pre_hook(hook, with_kwargs=True)
    return {"forward": target.register_forward_hook, "pre": target.register_forward_pre_hook,
            "backward": target.register_full_backward_hook,
            "backward pre": target.register_full_backward_pre_hook}[kind](hook)


class _RegisteredWhileRunning:
    """A hook registered by a forward pre-hook of ``trigger`` at its first call, during the model's forward (code a
    layer runs); ``remove()`` removes both."""

    def __init__(self, kind: str, scope: str, target: torch.nn.Module, seen: list, trigger: torch.nn.Module):
        self.handles = []

        def register(module, args):
            if len(self.handles) == 1:
                self.handles.append(_register(kind, scope, target, seen))

        self.handles.append(trigger.register_forward_pre_hook(register))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _hooked_runs(family: str, target: str, kind: str, scope: str, when: str, monkeypatch,
                 trigger: str | None = None) -> dict:
    """One training step of ``family``'s model unpatched, patched with no add fused and patched, each with the hook
    registered on its module ``target`` ``when`` ("before" or "after") it is patched (``trigger``: by the module of
    that name, when the forward first calls it: ``_RegisteredWhileRunning``): per variant, ``(fused adds, logits,
    gradients, what the hook saw)``; and ``"restored"``, the patched model's step once the hook is gone."""
    model = family_model(family)
    ids = input_ids(seq=6)
    runs = {}
    for variant, patch in (("unpatched", lambda m: None), ("unfused", lambda m: patch_unfused(m, monkeypatch)),
                           ("patched", patch_model)):
        m, seen = clone(model), []
        if when == "after":
            patch(m)
        if trigger is None:
            handle = _register(kind, scope, m.get_submodule(target), seen)
        else:
            handle = _RegisteredWhileRunning(kind, scope, m.get_submodule(target), seen, m.get_submodule(trigger))
        try:
            if when == "before":
                patch(m)
            runs[variant] = (*training_step(m, ids), seen)
        finally:
            handle.remove()
    runs["restored"] = training_step(m, ids)  # m: the patched model
    return runs


def _structure(value):
    """A hook's record with each tensor replaced by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    return tuple(_structure(v) for v in value) if isinstance(value, tuple) else value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_as_unfused(runs: dict, family: str, fused_while_hooked: int) -> None:
    """The patched run fuses ``fused_while_hooked`` adds; its logits, gradients and what its hook saw are the
    unfused run's bit for bit, and the hook saw what it sees unpatched (the same calls, tensors of the same shapes
    and dtypes); without the hook every add is fused again."""
    count, logits, grads, seen = runs["patched"]
    _, unfused_logits, unfused_grads, unfused_seen = runs["unfused"]
    *_, unpatched_seen = runs["unpatched"]
    assert count == fused_while_hooked
    assert seen and _same(tuple(seen), tuple(unfused_seen))
    assert _structure(tuple(seen)) == _structure(tuple(unpatched_seen))
    assert torch.equal(logits, unfused_logits)
    assert grads.keys() == unfused_grads.keys()
    for name, grad in unfused_grads.items():
        assert torch.equal(grads[name], grad), name
    assert runs["restored"][0] == CASES[family].adds


@pytest.mark.parametrize("family, scope, kind, when",
                         _pairs([("module", k) for k in MODULE_KINDS] + [("global", k) for k in GLOBAL_KINDS]))
def test_a_hook_on_a_norm_sees_the_unpatched_calls(family, scope, kind, when, monkeypatch):
    """A hook of the norm an inner add goes into (or a global one) turns that add off (every add, for a global
    hook): the norm is called on the sum, as unpatched."""
    runs = _hooked_runs(family, INNER_NORM[family], kind, scope, when, monkeypatch)
    _assert_as_unfused(runs, family, CASES[family].adds - 1 if scope == "module" else 0)


@pytest.mark.parametrize("family, scope, kind, when", _pairs([("module", k) for k in MODULE_KINDS]))
def test_a_hook_on_a_layer_keeps_its_inner_adds_fused(family, scope, kind, when, monkeypatch):
    """A hook of a layer sees the layer's arguments, output and gradients, which its fused inner adds do not
    change: they stay fused. Only the layer's output add, which the loop would hand to the next norm, stays apart
    (the hook would see the private arguments)."""
    runs = _hooked_runs(family, "model.layers.0", kind, scope, when, monkeypatch)
    _assert_as_unfused(runs, family, CASES[family].adds - 1)


@pytest.mark.parametrize("family, target, kind", [
    ("olmo2", "model.layers.0.post_attention_layernorm", "pre"),  # post-norm: r + norm(h) from the norm's kernel
    ("olmo2", "model.layers.1.post_feedforward_layernorm", "backward"),
    ("phi3", "model.layers.0.resid_attn_dropout", "forward"),  # inactive: the fused body would not call it
    ("phi3", "model.layers.0.resid_mlp_dropout", "backward pre"),
])
def test_a_hook_on_a_post_norm_or_a_residual_dropout_sees_the_unpatched_calls(family, target, kind, monkeypatch):
    runs = _hooked_runs(family, target, kind, "module", "after", monkeypatch)
    _assert_as_unfused(runs, family, CASES[family].adds - 1)


@pytest.mark.parametrize("index, fused", [(0, 4), (1, 3)])
def test_an_output_recorder_keeps_the_handoff_only_when_it_records_the_sum(index, fused):
    """transformers' output recorders read ``output[index]`` of a layer returning a tuple: the first item is the
    sum either way; another would be the normed sum a handing layer appends."""
    model = tiny_model("llama")
    patch_model(model)
    install_output_capuring_hook(model.model.layers[0], "hidden_states", index)
    assert residual_census.fused_adds(model, lambda m: m(input_ids())) == fused


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_a_hook_registered_on_the_next_norm_while_the_layer_runs_sees_the_unpatched_call(kind, monkeypatch):
    """The loop asks before a layer runs whether it may hand its output add to the next norm; code the layer runs
    (here a pre-hook of its MLP) may hook that norm since. The add asks again (``guard.unwatched_call``) and makes
    the plain add: the next layer's norm is called on the sum, as unpatched."""
    runs = _hooked_runs("llama", "model.layers.1.input_layernorm", kind, "module", "after", monkeypatch,
                        trigger="model.layers.0.mlp")
    _assert_as_unfused(runs, "llama", CASES["llama"].adds - 1)


def _patched_norm() -> torch.nn.Module:
    norm = tiny_model("llama", layers=1).model.norm
    patch_model(norm)
    return norm


def test_an_unwatched_norm_is_called_through_its_forward():
    """With no hook, a fused site calls the norm's bound ``forward`` itself (what ``nn.Module.__call__`` would
    call), an instance's own ``forward`` included; with any, nothing (the site makes the plain calls)."""
    norm = _patched_norm()
    call = guard.unwatched_call(norm)
    assert call.__self__ is norm and call.__func__ is type(norm).forward
    x, residual = torch.randn(2, 3, norm.weight.numel()), torch.randn(2, 3, norm.weight.numel())
    for y, expected in zip(call(x, residual=residual), norm(x, residual=residual)):
        assert torch.equal(y, expected)
    seen = []
    norm.forward = lambda *args, **kwargs: seen.append(args) or type(norm).forward(norm, *args, **kwargs)
    guard.unwatched_call(norm)(x)
    assert len(seen) == 1
    del norm.forward
    handle = norm.register_forward_hook(lambda *args: None)
    assert guard.unwatched_call(norm) is None
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    assert guard.unwatched_call(norm) is None
    handle.remove()


def test_a_norm_whose_call_does_more_than_its_forward_is_called_as_a_module(monkeypatch):
    """Where ``nn.Module.__call__`` would do more than call ``forward``, the site calls the module: compiled on its
    own, traced by ``torch.jit.trace``, ``__call__`` or ``_call_impl`` overridden by its class or wrapped by a
    profiler, ``_call_impl`` shadowed on the instance."""
    norm = _patched_norm()
    norm.compile()
    assert guard.unwatched_call(norm) is norm
    norm = _patched_norm()
    with monkeypatch.context() as patch:
        patch.setattr(torch._C, "_get_tracing_state", lambda: object())
        assert guard.unwatched_call(norm) is norm
    norm.__dict__["_call_impl"] = lambda *args, **kwargs: None
    assert guard.unwatched_call(norm) is norm
    del norm.__dict__["_call_impl"]
    for attribute in ("__call__", "_call_impl"):
        with monkeypatch.context() as patch:
            wrapped = getattr(torch.nn.Module, attribute)
            patch.setattr(torch.nn.Module, attribute, lambda self, *args, **kwargs: wrapped(self, *args, **kwargs))
            assert guard.unwatched_call(norm) is norm
        overriding = _patched_norm()
        overriding.__class__ = type("Overriding", (type(norm),), {attribute: lambda self, *args, **kwargs: None})
        assert guard.unwatched_call(overriding) is overriding
    assert guard.unwatched_call(norm).__self__ is norm
