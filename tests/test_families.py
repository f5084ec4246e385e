"""The families the kernels reach through recognition (``hf_rmsnorm.patch.recognition``) and the newer registry
entries: every Llama, Mistral and Qwen generation, NanoChat, Gemma, OLMo, GPT-OSS, Exaone4, each a tiny random
model of transformers' own classes, patched and compared with its eager self and with an fp64 copy."""

import copy

import pytest
import torch
from patch_models import input_ids, tiny_model

from hf_rmsnorm import patch_model, unpatch_model

HYBRID = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# model type -> (config overrides, norms patched, residual adds fused). A tiny model has 2 layers: 4 adds when
# the layer shape is known and the stack runs the layers then the final norm, 2 when only the layer is known.
FAMILIES = {
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), 5, 4),
    "ministral3": ({}, 5, 4),
    "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128), 5, 0),
    "qwen3_next": (dict(**MOE, shared_expert_intermediate_size=32, **HYBRID), 7, 0),
    "qwen3_5_text": (HYBRID, 7, 0),
    "qwen3_5_moe_text": (dict(**MOE, shared_expert_intermediate_size=32, **HYBRID), 7, 0),
    "nanochat": ({}, 9, 4),
    "gemma": ({}, 5, 2),
    "gemma2": (dict(sliding_window=4), 9, 0),
    "gemma3_text": (dict(sliding_window=4), 13, 0),
    "olmo2": ({}, 9, 0),
    "olmo3": ({}, 9, 0),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2), 5, 4),
    "exaone4": ({}, 9, 0),
}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_recognised_families_patch_with_parity(model_type):
    overrides, n_norms, n_adds = FAMILIES[model_type]
    ids = input_ids()
    model = tiny_model(model_type, **overrides)
    truth = _logits(copy.deepcopy(model).double(), ids)
    eager32 = _logits(model, ids)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    eager16 = _logits(bf16, ids)

    report = patch_model(model)
    assert (len(report.norms), len(report.fused_adds)) == (n_norms, n_adds), str(report)
    # Every RMSNorm-like module is patched or skipped with its reason, and the unknown layers are reported.
    skipped = dict(report.skipped)
    assert all(reason for reason in skipped.values())
    if n_adds == 0:
        assert any("residual adds not fused" in reason for reason in skipped.values())
    scale = truth.abs().max().item()
    assert (_logits(model, ids) - eager32).abs().max().item() <= 1e-5 * scale

    patch_model(bf16)
    patched16 = _logits(bf16, ids)
    # No less accurate than the eager bf16 model against fp64: within an ulp of the largest logit at worst, and
    # on average within verify.py's 10%.
    assert (patched16 - truth).abs().max() <= (eager16 - truth).abs().max() + 2**-8 * scale
    assert (patched16 - truth).abs().mean() <= 1.10 * (eager16 - truth).abs().mean()

    unpatch_model(model)
    assert (_logits(model, ids) - eager32).abs().max().item() == 0


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
