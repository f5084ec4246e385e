"""patch_model with what else touches a model: checkpointing, hidden-state recorders, hooks, caches,
accelerate, PEFT, serialisation, and Phi3's residual dropouts."""

import collections
import copy

import pytest
import torch
from family_cases import CASES
from patch_models import clone, count_ops, input_ids, reachable_modules, tiny_model, unfused_copy

from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.ops import library
from hf_rmsnorm.patch import patcher


def _patched(model):
    copy_ = clone(model)
    patch_model(copy_)
    return copy_


def _grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


# None: transformers' default, non-reentrant checkpointing.
@pytest.mark.parametrize("use_reentrant", [None, True])
def test_gradient_checkpointing_gives_identical_gradients(use_reentrant):
    model = tiny_model("llama").train()
    ids = input_ids()
    patched = _patched(model)
    expected = _grads(patched, ids)
    eager = _grads(model, ids)

    kwargs = {} if use_reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    patched.gradient_checkpointing_enable(**kwargs)
    assert patched.model.layers[0].gradient_checkpointing
    calls = []
    patched.model.layers[0]._gradient_checkpointing_func = _recording(patched.model.layers[0], calls)
    actual = _grads(patched, ids)

    assert calls, "the patched layer did not go through gradient checkpointing"
    for name, grad in expected.items():
        assert torch.equal(actual[name], grad), name
        torch.testing.assert_close(grad, eager[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_some_layers_gives_identical_gradients(use_reentrant):
    """Layers checkpointed next to layers that are not: the MLP add of a layer is fused into the next layer's
    norm across every boundary, the normed sum passing as a positional argument (a checkpoint's input, whose
    gradient reentrant checkpointing returns) and each layer's recomputation deciding from its arguments alone."""
    model = tiny_model("llama", layers=3).train()
    ids = input_ids()
    patched = _patched(model)
    assert any(" mlp residual -> " in line for line in patch_model(patched).fused_adds)
    expected = _grads(patched, ids)
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    for checkpointed in ([0, 2], [1]):
        for i, layer in enumerate(patched.model.layers):
            layer.gradient_checkpointing = i in checkpointed
        actual = _grads(patched, ids)
        for name, grad in expected.items():
            assert torch.equal(actual[name], grad), (checkpointed, name)


def _recording(layer, calls):
    checkpoint = layer._gradient_checkpointing_func

    def recorded(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    return recorded


def test_output_hidden_states_are_the_unpatched_ones(monkeypatch):
    model = tiny_model("qwen3", torch.bfloat16)
    ids = input_ids()
    unfused = unfused_copy(model, monkeypatch)
    patched = _patched(model)
    with torch.no_grad():
        eager = model(ids, output_hidden_states=True).hidden_states
        expected = unfused(ids, output_hidden_states=True).hidden_states
        actual = patched(ids, output_hidden_states=True).hidden_states
    assert len(actual) == len(eager) == 3
    for a, b, e in zip(actual, expected, eager):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, e, rtol=2 ** -6, atol=2 ** -6)
    # transformers' recorder hooks are now installed for good; they only read, so the MLP adds stay fused.
    assert count_ops(patched, ids, monkeypatch)["hf_rmsnorm.kernel"] == 1 + 2 * 4


def _double_output(module, args, output):
    return output * 2


def _double_output_in_place(module, args, output):
    output.mul_(2)


@pytest.mark.parametrize("hook", [None, _double_output, _double_output_in_place])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_hooks_that_change_a_layer_output_are_respected(hook, grad_mode, monkeypatch):
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    outputs = []
    for m in (model, unfused_copy(model, monkeypatch), _patched(model)):
        if hook is not None:
            m.model.layers[0].register_forward_hook(hook)
        with grad_mode():
            outputs.append(m(ids).logits)
    eager, unfused, patched = outputs
    assert torch.equal(patched, unfused)
    torch.testing.assert_close(patched, eager, rtol=0, atol=2 ** -6 * eager.abs().max().item())


def _first_layer_inputs(model):
    """The hidden states, position ids and rotary (cos, sin) the first decoder layer gets for ``input_ids()``."""
    hidden = model.model.embed_tokens(input_ids())
    position_ids = torch.arange(hidden.shape[1])[None]
    return hidden, position_ids, model.model.rotary_emb(hidden, position_ids)


def test_a_layer_called_directly_with_positional_arguments(monkeypatch):
    model = tiny_model("llama", torch.bfloat16)
    hidden, position_ids, cos_sin = _first_layer_inputs(model)
    args = (hidden, None, position_ids, None, False, cos_sin)
    expected = unfused_copy(model, monkeypatch).model.layers[0](*args)
    patched = _patched(model)
    assert torch.equal(patched.model.layers[0](*args), expected)
    with pytest.raises(TypeError, match="positional arguments"):
        patched.model.layers[0](*args, None)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_batched_left_padded_generation(cache_implementation):
    model = tiny_model("llama")
    ids = input_ids(batch=3, seq=6)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 4)):
        ids[row, :pad] = model.config.pad_token_id
        mask[row, :pad] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    expected = model.generate(ids, **kwargs)
    assert torch.equal(_patched(model).generate(ids, **kwargs), expected)


@pytest.mark.parametrize("order", ["patch_then_offload", "offload_then_patch"])
def test_accelerate_cpu_offload(order, monkeypatch):
    from accelerate import cpu_offload

    model = tiny_model("llama")
    ids = input_ids()
    expected = unfused_copy(model, monkeypatch)(ids).logits.detach()
    if order == "patch_then_offload":
        patch_model(model)
        cpu_offload(model, execution_device="cpu")
    else:
        cpu_offload(model, execution_device="cpu")
        patch_model(model)
    assert model.model.norm.weight.device.type == "meta"
    counts = count_ops(model, ids, monkeypatch)
    assert counts["pow"] == 0 and counts["hf_rmsnorm.kernel"] > 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    unpatch_model(model)
    assert count_ops(model, ids, monkeypatch)["hf_rmsnorm.kernel"] == 0


def test_accelerate_dispatch_with_disk_offload(tmp_path, monkeypatch):
    from accelerate import dispatch_model

    model = tiny_model("llama")
    ids = input_ids()
    expected = unfused_copy(model, monkeypatch)(ids).logits.detach()
    eager = model(ids).logits.detach()
    device_map = {
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
        "model.layers.1": "disk", "model.norm": "disk", "lm_head": "cpu",
    }
    dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path), main_device="cpu")
    report = patch_model(model)
    assert len(report.norms) == CASES["llama"].norms and not report.skipped
    layer = model.model.layers[1]
    # accelerate's hook calls `_old_forward`, which must now be the fused forward.
    assert layer._old_forward.__func__ is type(layer).forward is not type(layer).__mro__[1].forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    unpatch_model(model)
    assert layer._old_forward.__func__ is type(layer).forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager)


def test_peft_lora(monkeypatch):
    from peft import LoraConfig, get_peft_model

    def lora(model):
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        torch.manual_seed(3)
        return get_peft_model(model, config)

    base = tiny_model("llama").train()
    ids = input_ids()
    eager = lora(clone(base))
    expected = _grads(eager, ids)
    patched_after = lora(clone(base))
    report = patch_model(patched_after)
    patched_before = clone(base)
    patch_model(patched_before)
    patched_before = lora(patched_before)

    assert (len(report.norms), len(report.fused_adds)) == (CASES["llama"].norms, CASES["llama"].adds)
    assert patch_model(patched_after.get_base_model()) is report
    for model in (patched_after, patched_before):
        assert count_ops(model, ids, monkeypatch, grad=True)["pow"] == 0
        grads = _grads(model, ids)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)
    unpatch_model(patched_after)
    assert count_ops(patched_after, ids, monkeypatch)["pow"] > 0


def test_phi3_residual_dropout_is_fused_only_when_inactive(monkeypatch):
    model = tiny_model("phi3", resid_pdrop=0.5).train()
    ids = input_ids()
    patched = _patched(model)
    report = patch_model(patched)
    assert any("(while resid_attn_dropout is inactive)" in line for line in report.fused_adds)
    assert any("(while resid_mlp_dropout is inactive)" in line for line in report.fused_adds)

    outputs = []
    for m in (model, patched):
        torch.manual_seed(0)
        outputs.append(m(ids, labels=ids).logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    # Active dropout: both residual adds of each layer stay aten adds, even without autograd.
    training = count_ops(patched, ids, monkeypatch)
    patched.eval()
    inference = count_ops(patched, ids, monkeypatch)
    assert training["add"] - inference["add"] == 2 * 2
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_parameters_state_dict_and_save_pretrained_are_unchanged(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3", torch.bfloat16)
    ids = input_ids()
    before = {name: (p.shape, p.dtype, p.device, p.requires_grad) for name, p in model.named_parameters()}
    state = {name: t.clone() for name, t in model.state_dict().items()}
    model.save_pretrained(tmp_path / "eager")

    patch_model(model)
    assert {name: (p.shape, p.dtype, p.device, p.requires_grad) for name, p in model.named_parameters()} == before
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())
    model.save_pretrained(tmp_path / "patched")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "patched" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "patched", dtype=torch.bfloat16)
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(t, state[name]) for name, t in loaded.state_dict().items())


def test_copies_and_pickles_stay_patched(tmp_path):
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    report = patch_model(model)
    with torch.no_grad():
        expected = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for copy_ in (clone(model), loaded):
        assert type(copy_.model.norm) is type(model.model.norm)
        assert copy_.model._hf_rmsnorm_links[copy_.model.layers[0]].norm is copy_.model.layers[1].input_layernorm
        assert patch_model(copy_).norms == report.norms
        with torch.no_grad():
            assert torch.equal(copy_(ids).logits, expected)
        unpatch_model(copy_)
        assert type(copy_.model.norm).__dict__.get("_hf_rmsnorm_base") is None


def test_torch_compile_traces_a_patched_model_without_graph_breaks():
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    patch_model(model)
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert torch.equal(compiled(ids).logits, expected)


def test_torch_export_saves_and_loads_a_patched_model_with_its_fused_kernels(tmp_path):
    """A program exported from a patched model calls the package's operators (the fused adds included), and once
    saved and loaded gives the patched model's logits. It names the operators by this version's namespace
    (``library.NAMESPACE``): another version of the package cannot load it (README, torch.compile paragraph)."""
    model = tiny_model("llama", torch.bfloat16).eval()
    ids = input_ids()
    report = patch_model(model)
    with torch.no_grad():
        expected = model(ids).logits
    program = torch.export.export(model, (ids,), kwargs={"use_cache": False}, strict=False)
    called = collections.Counter(node.target.name().partition("::")[2] for node in program.graph.nodes
                                 if getattr(node.target, "namespace", None) == library.NAMESPACE)
    assert called == {"norm_fwd": len(report.norms) - len(report.fused_adds), "add_norm_fwd": len(report.fused_adds)}
    torch.export.save(program, tmp_path / "patched.pt2")
    with torch.no_grad():
        assert torch.equal(torch.export.load(tmp_path / "patched.pt2").module()(ids, use_cache=False).logits,
                           expected)


def _steered_forward(self, input_ids, **kwargs):
    """A stack forward of the kind steering and early-exit code writes: its own layer loop, editing the hidden
    state in place between layers."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    hidden = self.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1])[None]
    cos_sin = self.rotary_emb(hidden, position_ids)
    for layer in self.layers:
        hidden = layer(hidden, position_ids=position_ids, position_embeddings=cos_sin)
        hidden.mul_(1.5)
    return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_a_custom_layer_loop_editing_in_place_gets_exact_outputs(grad_mode, monkeypatch):
    """A loop of its own calls each layer plainly: nothing is handed on, so the edit between two layers reaches
    the next norm (under inference_mode too)."""
    from transformers.models.llama.modeling_llama import LlamaModel

    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    unfused, patched = unfused_copy(model, monkeypatch), _patched(model)
    outputs = []
    for m in (model, unfused, patched):
        with grad_mode():
            outputs.append(m.lm_head(_steered_forward(m.model, ids).last_hidden_state))
    eager, expected, actual = outputs
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual, eager, rtol=0, atol=2 ** -6 * eager.abs().max().item())
    assert isinstance(patched.model, LlamaModel)


@pytest.mark.parametrize("replaced", ["before_patching", "after_patching"])
def test_a_stack_whose_forward_was_replaced_keeps_its_adds_unfused(replaced, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaModel

    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    unfused = unfused_copy(model, monkeypatch)
    if replaced == "before_patching":
        monkeypatch.setattr(LlamaModel, "forward", _steered_forward)
        report = patch_model(model)
        assert "residual adds across layers not fused: LlamaModel.forward was replaced" in dict(report.skipped)[
            "model"]
        assert len(report.fused_adds) == 2  # the attention adds, inside each layer
    else:
        patch_model(model)
        monkeypatch.setattr(LlamaModel, "forward", _steered_forward)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, unfused(ids).logits)
    monkeypatch.undo()
    with torch.inference_mode():  # the stack's own forward again
        assert torch.equal(model(ids).logits, unfused(ids).logits)


def test_copying_one_layer_copies_that_layer_only():
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    patch_model(model)
    layer = model.model.layers[0]
    copied = copy.deepcopy(layer)
    # No path through instance state leads from the copy to a module it does not own (the stack, the next layer).
    assert reachable_modules(copied) == {id(m) for m in copied.modules()}
    hidden = model.model.embed_tokens(ids)
    position_ids = torch.arange(ids.shape[1])[None]
    cos_sin = model.model.rotary_emb(hidden, position_ids)
    with torch.inference_mode():
        assert torch.equal(copied(hidden, position_embeddings=cos_sin), layer(hidden, position_embeddings=cos_sin))


def test_a_positional_cache_reaches_the_attention_under_the_installed_name(monkeypatch):
    # The cache argument is `cache` from transformers 5.24 and `past_key_values` before: a positional cache
    # must reach the attention under the installed layer's own name, or it would be dropped silently.
    from transformers import DynamicCache

    model = tiny_model("llama", torch.bfloat16)
    hidden, position_ids, cos_sin = _first_layer_inputs(model)

    def run(layer):
        cache = DynamicCache(config=model.config)
        return layer(hidden, None, position_ids, cache, True, cos_sin), cache.layers[0].keys

    expected, expected_keys = run(unfused_copy(model, monkeypatch).model.layers[0])
    output, keys = run(_patched(model).model.layers[0])
    assert expected_keys is not None and expected_keys.shape[-2] == hidden.shape[1]
    assert torch.equal(output, expected) and torch.equal(keys, expected_keys)
