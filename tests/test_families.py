"""The families the kernels reach through recognition (``hf_rmsnorm.patch.recognition``) and the newer registry
entries (MoE, post-norm and hybrid layers): every Llama, Mistral and Qwen generation, NanoChat, Gemma, OLMo,
GPT-OSS, Exaone4, DeepSeek-V3, each a tiny random model of transformers' own classes, patched and compared with
its eager self and with an fp64 copy."""

import copy
import functools

import pytest
import torch
from patch_models import Parity, input_ids, tiny_model

from hf_rmsnorm import patch_model

# Before transformers 5.24 a hybrid layer renames its cache argument for the linear attention
# (cache_params=past_key_values), which the registered body would not do: those layers run their derived forward
# (their own code, renaming included), so every add is fused on both ends of the supported releases.
HYBRID_ADDS = 4
HYBRID = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# model type -> (config overrides, norms patched, residual adds fused). A tiny model has 2 layers: 4 adds when
# the layer shape is known and the stack runs the layers then the final norm, 2 when only the layer is known.
FAMILIES = {
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), 5, 4),
    "ministral3": ({}, 5, 4),
    # Every other layer an MoE (a pair of flattened tokens and router logits), the other dense.
    "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                         interleave_moe_layer_step=2), 5, 4),
    "qwen3_next": (dict(**MOE, shared_expert_intermediate_size=32, **HYBRID), 7, HYBRID_ADDS),
    "qwen3_5_text": (HYBRID, 7, HYBRID_ADDS),
    "qwen3_5_moe_text": (dict(**MOE, shared_expert_intermediate_size=32, **HYBRID), 7, HYBRID_ADDS),
    "nanochat": ({}, 9, 4),
    "gemma": ({}, 5, 4),
    "gemma2": (dict(sliding_window=4), 9, 4),
    "gemma3_text": (dict(sliding_window=4), 13, 4),
    "glm4": ({}, 9, 4),
    "olmo2": ({}, 9, 4),
    "olmo3": ({}, 9, 4),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2), 5, 4),
    "exaone4": ({}, 9, 4),
    # Cohere's own LayerNorm class (mean-centred, no bias), recognised in the layernorm mode; its parallel layer
    # adds (residual + attention) + mlp: the second add of each layer goes into the next norm's kernel.
    "cohere": ({}, 3, 2),
    "cohere2": (dict(sliding_window=4), 3, 2),
    # Multi-head latent attention: the rotary part of a head is head_dim.
    "deepseek_v3": (dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                         first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4), 9, 4),
}
# The casting mode each family's norms are recognised in (docs/numerics.md's table).
MODES = {"qwen3_next": "gemma", "qwen3_5_text": "gemma", "gemma3_text": "gemma", "olmo3": "fp32_affine",
         "nanochat": "llama", "mixtral": "llama", "deepseek_v3": "llama", "cohere": "layernorm",
         "cohere2": "layernorm"}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_recognised_families_patch_with_parity(model_type):
    overrides, n_norms, n_adds = FAMILIES[model_type]
    ids = input_ids()
    model = tiny_model(model_type, **overrides)
    parity = Parity(model, functools.partial(_logits, ids=ids))
    report = patch_model(model)
    assert (len(report.norms), len(report.fused_adds)) == (n_norms, n_adds), str(report)
    if model_type in MODES:
        modes = {type(m)._hf_rmsnorm_kind.mode for name, m in model.named_modules() if name in report.norms}
        assert modes == {MODES[model_type]}
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
    overrides = FAMILIES[model_type][0]
    model = tiny_model(model_type, **overrides)
    ids = input_ids()
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        patch_model(model)
        patched = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    assert torch.equal(patched, eager)


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_a_residual_first_parallel_layer_trains_like_the_original(model_type):
    """Cohere's (h + attention) + mlp with its second add in the next norm's kernel, with autograd on: the loss
    and every gradient as the unpatched model's, to fp32 rounding."""
    overrides = FAMILIES[model_type][0]
    model = tiny_model(model_type, **overrides).train()
    patched = copy.deepcopy(model)
    assert len(patch_model(patched).fused_adds) == 2
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
# (each attention add into the FFN norm, the first layer's output into the second's attention norm) and of
# Qwen2.5-VL's blocks (each attention add into norm2).
@pytest.mark.parametrize(
    "model_type,fused_per_layer,vision_adds",
    [("mistral3", 2, 3), ("qwen2_5_vl", 2, 2), ("qwen3_vl", 1, 0), ("gemma3", 2, 0), ("llama4", 2, 0)],
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
