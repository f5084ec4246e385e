"""patch_model on encoders and encoder-decoders with a task head (``encoder_cases.CASES``): every LayerNorm runs
the exact fused LayerNorm, the adds next to them are fused through the derived forwards, outputs keep parity in
fp32 and bf16 against fp64 (judged as the coverage page judges), and training gradients are eager's.

Kernels in Triton's interpreter; the tiny models and their inputs are harness.coverage's.
"""

import copy

import pytest
import torch
import transformers
from encoder_cases import CASES
from torch import nn

from harness import coverage
from hf_rmsnorm import UnconvertibleModelError, UnsupportedModelError, patch_model, unpatch_model


def build(model_type: str) -> nn.Module:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = coverage._tiny_config(model_type, coverage.ENCODER)
    torch.manual_seed(0)
    model = getattr(transformers, CASES[model_type].head)._from_config(config)
    coverage.randomise_norms(model)
    return model.eval()


def layer_norms(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)
            or type(m).__name__.endswith("LayerNorm")}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_every_layernorm_patched_adds_fused_and_parity_in_fp32_and_bf16(model_type):
    model = build(model_type)
    inputs = coverage._inputs(model, coverage.ENCODER)
    truth = coverage._logits(copy.deepcopy(model).double(), inputs)
    eager32 = coverage._logits(model, inputs)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    eager16 = coverage._logits(bf16, inputs)
    every = layer_norms(model)
    report = patch_model(model)
    assert set(report.norms) == every and len(every) == CASES[model_type].norms, report
    assert len(report.fused_adds) == CASES[model_type].adds, report
    patch_model(bf16)
    result = coverage.Coverage(model_type, CASES[model_type].head, "", fused_adds=len(report.fused_adds))
    verdict, reason = coverage._judge(result, truth, eager32, coverage._logits(model, inputs), eager16,
                                      coverage._logits(bf16, inputs))
    assert verdict == "fused", reason
    # No pre-LN decoder stream to convert: the conversion to RMSNorm is refused, with the reason (DeBERTa's, a
    # LayerNorm of its own class, which the conversion does not cover).
    reason = "own class" if model_type == "deberta" else "not a pre-LN decoder"
    with pytest.raises(UnconvertibleModelError, match=reason):
        patch_model(build(model_type), layernorm="rmsnorm")


def test_a_pre_ln_bert_patches_its_norms_with_parity_and_says_why_its_adds_stay_apart():
    """ESM (XLM-RoBERTa-XL's, RoBERTa-PreLayerNorm's and Megatron-BERT's layout): each add sits in a ``*Output``
    module, and the norm reading the sum in the layer's ``feed_forward_chunk`` method or the next layer's attention;
    every LayerNorm is patched with parity (the coverage page's judgement), each add stays apart with its reason."""
    model = coverage._build("esm", coverage.ENCODER, "EsmModel")
    truth = coverage._logits(copy.deepcopy(model).double(), inputs := coverage._inputs(model, coverage.ENCODER))
    eager32 = coverage._logits(model, inputs)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    eager16 = coverage._logits(bf16, inputs)
    report = patch_model(model)
    patch_model(bf16)
    assert len(report.norms) == 5 and not report.fused_adds, report
    result = coverage.Coverage("esm", "EsmModel", "")
    verdict, reason = coverage._judge(result, truth, eager32, coverage._logits(model, inputs), eager16,
                                      coverage._logits(bf16, inputs))
    assert verdict == "norms only", reason
    reasons = dict(report.skipped)
    assert "EsmLayer.forward calls none of its patched norms itself" in reasons["encoder.layer.0"]
    assert "its output's add can only go into the next norm's kernel" in reasons["encoder.layer.0.attention"]


def test_a_layernorm_of_the_models_own_class_follows_the_layernorm_option():
    """DeBERTa's ``DebertaLayerNorm`` (the ``deberta`` mode, recognised by its numerics): left alone with
    ``layernorm="skip"`` (then nothing is left to patch), refused with ``layernorm="rmsnorm"``; the model untouched
    either way."""
    model = build("deberta")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    for option, error, reason in (("skip", UnsupportedModelError, "has no norm hf_rmsnorm can patch"),
                                  ("rmsnorm", UnconvertibleModelError, "a LayerNorm of the model's own class")):
        with pytest.raises(error, match=reason) as raised:
            patch_model(model, layernorm=option)
        assert type(raised.value) is error
        assert "LayerNorm left alone on request" in str(raised.value) or option == "rmsnorm"
        assert [type(m) for m in model.modules()] == [type(m) for m in build("deberta").modules()]
        assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())


def _gradients(model: nn.Module, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad()
    kwargs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    output = model(**kwargs)[0]
    (output.float() * torch.linspace(-1, 1, output.shape[-1])).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["bert", "deberta", "bart", "vit", "whisper"])
def test_training_gradients_are_eagers(model_type):
    """Gradients of every parameter through the fused adds and LayerNorms, dropout off (the claim is about the
    maths), in fp32: eager's up to the reduction order of the LayerNorm backward (1e-5 of the largest)."""
    model = build(model_type)
    reference = copy.deepcopy(model)
    inputs = coverage._inputs(model, coverage.ENCODER)
    assert patch_model(model).fused_adds
    expected, got = _gradients(reference, inputs), _gradients(model, inputs)
    assert got.keys() == expected.keys()
    # Relative to the largest gradient: some are zero up to rounding (a key bias, which softmax ignores).
    scale = max(grad.abs().max().item() for grad in expected.values())
    for name, grad in expected.items():
        assert (got[name] - grad).abs().max().item() <= 1e-5 * scale, name
    unpatch_model(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]


def test_post_ln_sublayers_draw_the_same_dropout_masks_in_training():
    """BERT's ``LayerNorm(dropout(dense(h)) + input)``: the dropout is part of the add's operand, evaluated before
    the fused add as before the plain one, so training with active dropout draws the same masks in the same order."""
    model = build("bert").train()
    assert model.config.hidden_dropout_prob > 0
    reference = copy.deepcopy(model)
    ids = coverage._inputs(model, coverage.ENCODER)["input_ids"]
    report = patch_model(model)
    assert any("attention.output: residual add" in add for add in report.fused_adds)
    outputs = []
    for m in (reference, model):
        torch.manual_seed(7)
        outputs.append(m(input_ids=ids)[0])
    assert (outputs[0] - outputs[1]).abs().max().item() <= 1e-5 * outputs[0].abs().max().item()
