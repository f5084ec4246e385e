"""The families the kernels reach through recognition (``hf_rmsnorm.patch.recognition``) and the newer registry
entries (MoE, post-norm and hybrid layers): every Llama, Mistral and Qwen generation, NanoChat, Gemma, OLMo,
GPT-OSS, Exaone4, DeepSeek-V3, each a tiny random model of transformers' own classes, patched and compared with
its eager self and with an fp64 copy."""

import copy
import functools

import pytest
import torch
from family_cases import CASES, RECOGNISED, names
from patch_models import Parity, assert_patch_keeps_greedy_tokens, input_ids, tiny_model

from hf_rmsnorm import patch_model

def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("model_type", sorted(names(RECOGNISED)))
def test_recognised_families_patch_with_parity(model_type):
    case = CASES[model_type]
    ids = input_ids()
    model = tiny_model(model_type, **case.config)
    parity = Parity(model, functools.partial(_logits, ids=ids))
    report = patch_model(model)
    assert (len(report.norms), len(report.fused_adds)) == (case.norms, case.adds), str(report)
    if case.mode is not None:
        modes = {type(m)._hf_rmsnorm_kind.mode for name, m in model.named_modules() if name in report.norms}
        assert modes == {case.mode}
    # Every RMSNorm-like module is patched or skipped with its reason, and the unknown layers are reported.
    skipped = dict(report.skipped)
    assert all(reason for reason in skipped.values())
    if not report.fused_adds:
        assert any("residual adds not fused" in reason for reason in skipped.values())
    parity.check_patched()


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_next", "qwen3_5_text", "olmo2", "gemma2", "gemma3_text", "glm4", "nanochat", "mixtral", "gpt_oss",
     "llama4_text", "cohere"],
)
def test_generation_with_a_cache_is_unchanged(model_type):
    """Greedy generate() with the KV (and, for hybrid layers, the linear-attention) cache: the fused layer bodies
    pass every argument on as the originals do, prefill and decode; fp32 tokens identical to the eager model's."""
    assert_patch_keeps_greedy_tokens(tiny_model(model_type, **CASES[model_type].config), input_ids(), new_tokens=6)


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_a_residual_first_parallel_layer_trains_like_the_original(model_type):
    """Cohere's (h + attention) + mlp with its second add in the next norm's kernel, with autograd on: the loss
    and every gradient as the unpatched model's, to fp32 rounding."""
    case = CASES[model_type]
    model = tiny_model(model_type, **case.config).train()
    patched = copy.deepcopy(model)
    assert len(patch_model(patched).fused_adds) == case.adds
    ids = input_ids()
    losses, grads = [], []
    for m in (model, patched):
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in m.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_weightless_norm_keeps_the_state_dict_and_trains():
    """NanoChat's norms have no weight: nothing is added to the model, and gradients flow through them."""
    model = tiny_model("nanochat")
    keys = list(model.state_dict())
    ids = input_ids()
    reference = copy.deepcopy(model)
    patch_model(model)
    assert list(model.state_dict()) == keys
    model.train()
    reference.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    reference(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _tiny_multimodal(model_type: str):
    from transformers import AutoModelForImageTextToText

    from harness.coverage import _tiny_config

    config = _tiny_config(model_type)
    if model_type == "qwen2_5_vl":  # its multimodal rotary sections must add up to half a (shrunk) head
        config.text_config.rope_parameters["mrope_section"] = [2, 3, 3]
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).eval()


# Residual adds fused per text layer, and in the vision tower, through the derived forwards of Pixtral's layers
# (each attention add into the FFN norm, the first layer's output into the second's attention norm), of Qwen2.5-VL's
# and Qwen3-VL's blocks (each attention add into norm2), and of the LayerNorm towers: SigLIP's in Gemma 3 (each
# attention add into layer_norm2, the first layer's output into the second's norm), Llama 4's (each attention add).
@pytest.mark.parametrize(
    "model_type,fused_per_layer,vision_adds",
    [("mistral3", 2, 3), ("qwen2_5_vl", 2, 2), ("qwen3_vl", 1, 2), ("gemma3", 2, 3), ("llama4", 2, 2)],
)
def test_multimodal_models_get_their_language_model_patched(model_type, fused_per_layer, vision_adds):
    """The language model inside a vision-language model is patched with parity; the vision tower's norms are
    patched where recognised and otherwise skipped with the reason, never an error. (Llama4's text-only forward
    fails in transformers 5.24 itself, unpatched: its language model is run directly.)"""
    model = _tiny_multimodal(model_type)
    text_model = model.language_model if model_type == "llama4" else model
    ids = input_ids()
    eager = _logits(text_model, ids)
    report = patch_model(model)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(report.fused_adds) == fused_per_layer * layers + vision_adds, str(report)
    assert any("language_model" in name for name in report.norms)
    vision = [(name, reason) for name, reason in report.skipped if "vision" in name or "visual" in name]
    assert all(reason for _, reason in vision)
    assert (_logits(text_model, ids) - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()
