"""T5 and its relatives (mT5, UMT5, LongT5, SwitchTransformers): their norm casts the normalised row to the
weight's dtype before the multiply, the ``t5`` mode (``hf_rmsnorm.ops.modes``). Each is a tiny random
encoder-decoder of transformers' own classes (and T5's encoder alone), patched, and compared with its eager self
and with an fp64 copy, forward and backward.

Their residual adds (``hidden_states + dropout(layer_output)`` in each ``T5Layer*`` sublayer) stay unfused: the add
ends one sublayer module and the norm it feeds begins the next, a handoff between sibling modules that neither the
registered shapes nor the derived forwards plan.
"""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, T5EncoderModel

from hf_rmsnorm import patch_model
from patch_models import Parity, input_ids

# The tiny config of every case: 2 encoder and 2 decoder blocks of width 64.
TINY = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# Per type: its own config fields, and its norms (each block: one per sublayer, 2 in the encoder, 3 in the decoder;
# plus a final norm each side).
CASES = {
    "t5": ({}, 12),
    "mt5": ({}, 12),
    "umt5": ({}, 12),
    "longt5": ({}, 12),
    "switch_transformers": (dict(num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1,
                                 num_sparse_decoder_layers=1), 12),
}


def _tiny(model_type: str, config: dict, cls=AutoModelForSeq2SeqLM):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **config)
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    with torch.no_grad():  # trained-like norm weights: a weight of ones hides the order of the roundings
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.normal_(1.0, 0.3)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, decoder_input_ids=ids[:, :5]).logits.double()


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids[:, :5].contiguous()).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_t5_family_patches_with_parity(model_type):
    """Every norm patched in the t5 mode; fp32 logits equal to eager's, bf16 no less accurate than eager bf16
    against fp64 (``Parity``); unpatching restores the eager model."""
    config, norms = CASES[model_type]
    ids = input_ids()
    model = _tiny(model_type, config)
    parity = Parity(model, lambda m: _logits(m, ids))
    report = patch_model(model)
    assert len(report.norms) == norms, str(report)
    assert {type(m)._hf_rmsnorm_kind.mode for name, m in model.named_modules() if name in report.norms} == {"t5"}
    parity.check_patched()


@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_t5_family_trains_like_eager(model_type):
    """A training step (dropout off) gives eager's loss and gradients, to fp32's reduction order."""
    config, _ = CASES[model_type]
    ids = input_ids()
    model = _tiny(model_type, dict(config, dropout_rate=0.0)).train()
    eager = copy.deepcopy(model)
    patch_model(model)
    loss, grads = _loss_and_grads(model, ids)
    eager_loss, eager_grads = _loss_and_grads(eager, ids)
    assert abs(loss.item() - eager_loss.item()) <= 1e-6 * abs(eager_loss.item())
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        scale = eager_grads[name].abs().max().item()
        assert (grad - eager_grads[name]).abs().max().item() <= 1e-5 * max(scale, 1e-6), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_t5_encoder_keeps_eager_outputs(dtype):
    """A half-precision T5 encoder (norm weights of its dtype: the row is rounded to it before the multiply) gives
    eager's hidden states to within a rounding of the half dtype (fp32 reductions in another order can move a
    normalised value to the neighbouring half number)."""
    ids = input_ids()
    model = _tiny("t5", {}, T5EncoderModel).to(dtype)
    with torch.no_grad():
        eager = model(ids).last_hidden_state
        report = patch_model(model)
        patched = model(ids).last_hidden_state
    assert len(report.norms) == 5 and patched.dtype == eager.dtype
    scale = eager.abs().max().item()
    assert (patched.double() - eager.double()).abs().max().item() <= 2 * torch.finfo(dtype).eps * scale


def test_auto_model_of_t5_patches_encoder_and_decoder():
    """``AutoModel`` (T5Model, no LM head) gets its 12 norms patched too, with eager's fp32 hidden states."""
    ids = input_ids()
    model = _tiny("t5", {}, AutoModel)
    with torch.no_grad():
        eager = model(ids, decoder_input_ids=ids[:, :5]).last_hidden_state
        report = patch_model(model)
        patched = model(ids, decoder_input_ids=ids[:, :5]).last_hidden_state
    assert len(report.norms) == 12
    torch.testing.assert_close(patched, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
