"""The cross-layer handoff (``hf_rmsnorm.patch.handoff``): each layer's last residual add goes into the next
norm's kernel, and the normed sum to the next layer as an argument, in eager, compiled and checkpointed training
alike, with the gradients of the unfused adds bit for bit; the plain calls wherever foreign code watches; a custom
loop exact."""

from __future__ import annotations

import pytest
import torch
from family_cases import CASES
from patch_models import (
    clone, family_model, graph_calls, input_ids, recording_aot_eager, tiny_model, training_step, unfused_copy,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from harness import residual_census
from hf_rmsnorm import patch_model

# Llama and Qwen3 (registered sequential layers), LFM2 and Apertus (their forwards derived from their code), Gemma2
# (a sandwich layer: its output add goes into one kernel with its post-feedforward norm and the next norm).
FAMILIES = ["llama", "qwen3", "lfm2", "apertus", "gemma2"]
MODES = ["eager", "compiled", "layers compiled", "checkpointed", "checkpointed reentrant"]


def _train_step(model, mode: str, ids) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward in ``mode`` (counting the norm kernels that add) and its backward: ``(fused adds, logits,
    gradients)``."""
    if mode.startswith("checkpointed"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode.endswith("reentrant")})
    runner = model
    torch._dynamo.reset()
    if mode == "compiled":
        runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    elif mode == "layers compiled":  # each decoder layer compiled on its own, the loop run by Python
        for layer in model.modules():
            if isinstance(layer, GradientCheckpointingLayer):
                layer.compile(backend="aot_eager", fullgraph=True)
    return training_step(model, ids, runner)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_add_is_fused_in_training_with_the_unfused_gradients(family, mode, monkeypatch):
    """Compiled (the model in one graph, or each layer in its own) and checkpointed (either kind) training fuses
    every add eager training does, and the logits and every gradient are those of the same run with the adds
    apart, bit for bit."""
    model = family_model(family)
    ids = input_ids(seq=6)
    patched = clone(model)
    patch_model(patched)
    unfused = unfused_copy(model, monkeypatch)
    count, logits, grads = _train_step(patched, mode, ids)
    assert count == CASES[family].adds
    _, expected_logits, expected = _train_step(unfused, mode, ids)
    assert torch.equal(logits, expected_logits)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(grads[name], grad), name


def test_compiled_checkpointed_training_fuses_every_add_with_the_unfused_gradients(monkeypatch):
    """torch.compile(fullgraph=True) over non-reentrant checkpointing: each layer is a checkpoint region of the one
    graph, and the normed sum passes between two of them."""
    model = family_model("llama")
    ids = input_ids(seq=6)
    patched, unfused = clone(model), unfused_copy(model, monkeypatch)
    patch_model(patched)
    results = []
    for m in (patched, unfused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(m, backend=recording_aot_eager(graphs), fullgraph=True)
        m.zero_grad()
        compiled(ids, labels=ids, use_cache=False).loss.backward()
        adding = graph_calls(graphs, "add_norm_fwd", "norm_add_fwd")
        results.append((adding, {name: p.grad.clone() for name, p in m.named_parameters()}))
    (adding, grads), (unfused_adding, expected) = results
    assert (adding, unfused_adding) == (CASES["llama"].adds, 0)
    for name, grad in expected.items():
        assert torch.equal(grads[name], grad), name


def _forward_hook(module, args, output):
    return None


def _pre_hook(module, args):
    return None


def _backward_hook(module, grad_input, grad_output):
    return None


# (where, hook kind) -> the adds still fused, of Llama's four: the attention add inside each layer (fused unless a
# hook watches its norm), and the two layer outputs handed on (layer 0 into layer 1's input norm, layer 1 into the
# final norm).
HOOKED = {
    ("layer 1", "forward"): 2,  # the hook sees layer 1's arguments and output: it neither receives nor hands on
    ("layer 1", "pre"): 2,  # layer 1's arguments are seen: it receives nothing, and hands nothing on
    ("layer 1", "backward"): 2,
    ("layer 1 input norm", "pre"): 3,
    ("final norm", "forward"): 3,
    ("final norm", "backward"): 3,
    ("global", "forward"): 0,  # a global hook watches every norm: nothing is fused
    ("global", "backward"): 0,
}


@pytest.mark.parametrize("where, kind", list(HOOKED))
def test_a_hook_between_two_layers_gets_the_plain_calls(where, kind, monkeypatch):
    """Whatever hook watches a layer, the next one or the norm between them: those layers are called as the
    unpatched model calls them, the hook sees what it sees there, and the outputs and gradients stay exact."""
    model = tiny_model("llama").train()
    ids = input_ids(seq=6)
    patched, unfused = clone(model), unfused_copy(model, monkeypatch)
    patch_model(patched)
    counts, results = [], []
    for m in (patched, unfused):
        seen = []
        target = {"layer 1": m.model.layers[1], "layer 1 input norm": m.model.layers[1].input_layernorm,
                  "final norm": m.model.norm}.get(where)

        def record(module, *args):
            seen.append(tuple(a.shape if isinstance(a, torch.Tensor) else type(a).__name__
                              for arg in args for a in (arg if isinstance(arg, tuple) else (arg,))))

        if where == "global":
            register = {"forward": torch.nn.modules.module.register_module_forward_hook,
                        "backward": torch.nn.modules.module.register_module_full_backward_hook}[kind]
            handle = register(lambda *args: record(*args) if isinstance(args[0], type(m.model.layers[0])) else None)
        else:
            register = {"forward": target.register_forward_hook, "pre": target.register_forward_pre_hook,
                        "backward": target.register_full_backward_hook}[kind]
            handle = register(record)
        try:
            count, logits, grads = _train_step(m, "eager", ids)
        finally:
            handle.remove()
        counts.append(count)
        results.append((seen, logits, grads))
    (seen, logits, grads), (expected_seen, expected_logits, expected) = results
    assert counts == [HOOKED[where, kind], 0]
    assert seen == expected_seen and seen
    assert torch.equal(logits, expected_logits)
    for name, grad in expected.items():
        assert torch.equal(grads[name], grad), name


def test_output_recorders_see_the_sums_and_keep_the_handoff(monkeypatch):
    """transformers' ``output_hidden_states`` recorders (forward hooks on the layers) record ``output[0]`` of
    the tuple a handing layer returns: the sum; they read and change nothing, so every add stays fused."""
    model = tiny_model("qwen3").train()
    ids = input_ids(seq=6)
    patched, unfused = clone(model), unfused_copy(model, monkeypatch)
    patch_model(patched)
    hidden = []
    for m in (patched, unfused):
        outputs = []
        count = residual_census.fused_adds(m, lambda m: outputs.append(m(ids, output_hidden_states=True)), grad=True)
        hidden.append((count, outputs[0].hidden_states))
    (count, states), (_, expected) = hidden
    assert count == CASES["qwen3"].adds
    assert len(states) == len(expected) == 3
    assert all(torch.equal(a, b) for a, b in zip(states, expected))


def test_a_layer_called_outside_the_derived_loop_runs_its_adds_apart(monkeypatch):
    """A custom loop (or any direct call of a layer) never asks a layer to hand on: the layer returns the plain
    tensor and adds its output itself, and the next norm normalises it."""
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    patched, unfused = clone(model), unfused_copy(model, monkeypatch)
    patch_model(patched)

    def custom_loop(m):
        hidden = m.model.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1])[None]
        cos_sin = m.model.rotary_emb(hidden, position_ids)
        for layer in m.model.layers:
            hidden = layer(hidden, position_ids=position_ids, position_embeddings=cos_sin)
            assert isinstance(hidden, torch.Tensor)
        return m.lm_head(m.model.norm(hidden))

    with torch.no_grad():
        outputs = [custom_loop(m) for m in (patched, unfused)]
    assert torch.equal(*outputs)
    # Only the attention adds, inside each layer.
    assert residual_census.fused_adds(patched, custom_loop) == 2
