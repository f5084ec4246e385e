"""Every norm the patcher runs is in the casting mode its own class computes, with trained-like weights.

The registry (``families.py``) names a mode for each norm class it knows, and recognition (``recognition.py``)
probes the others; both must agree with the class's ``forward`` bit for bit once the weight is no longer all ones
(a fresh model's weight of ones hides the order of the roundings). The kernels run in Triton's interpreter here,
rounding bf16 as a GPU does (``conftest.py``), so the patched norms are compared with the eager ones bitwise.
"""

import copy
import importlib

import pytest
import torch
from family_cases import CASES
from patch_models import tiny_model
from torch import nn

from hf_rmsnorm import patch_model
from hf_rmsnorm.ops import reference
from hf_rmsnorm.patch import families, recognition
from hf_rmsnorm.patch.families import LAYERNORM, FAMILIES

HALF = (torch.bfloat16, torch.float16)
WIDTH = 64


def _registered_kinds():
    return [pytest.param(kind, id=kind.class_path.rpartition(".")[2]) for family in FAMILIES for kind in family.norms]


def _installed(kind):
    module, _, name = kind.class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        cls = None
    if cls is None:
        pytest.skip(f"{kind.class_path} is not in this transformers release")
    return cls


def _trained_like(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` with its weight ~ N(1, 0.3) and its bias ~ N(0, 0.3), as a trained checkpoint's."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if name == "weight" else 0.0))
    return module


@pytest.mark.parametrize("kind", _registered_kinds())
def test_every_registered_norm_computes_its_registry_mode(kind):
    """A wrong entry (GPT-OSS's was ``llama``) fails here: each installed class is probed as recognition probes an
    unknown one, in every weight dtype and in the bf16 model that keeps its norms in fp32."""
    cls = _installed(kind)
    for weight_dtype, model_dtype in [(d, d) for d in (torch.float32, *HALF)] + [(torch.float32, torch.bfloat16)]:
        norm = _trained_like(cls(WIDTH)).to(weight_dtype)
        problem = recognition.NormRecogniser().registry_problem(norm, kind, model_dtype)
        assert problem is None, f"{weight_dtype} weight, {model_dtype} model: {problem}"


@pytest.mark.parametrize("dtype", HALF)
def test_the_layernorm_kind_computes_nn_layernorm(dtype):
    """nn.LayerNorm with a random bias, in half precision. (In fp32 aten's layer_norm reduces in another order
    than the reference, an ulp apart, so no bitwise probe applies there; LAYERNORM_AS_RMSNORM equals a LayerNorm
    only on the zero-mean rows the conversion makes, which tests/patch/test_layernorm.py checks.)"""
    norm = _trained_like(nn.LayerNorm(WIDTH)).to(dtype)
    mode, reason = recognition.probe_mode(norm, LAYERNORM.eps_attr, LAYERNORM.weight_attr, LAYERNORM.bias_attr,
                                          dtype, (LAYERNORM.mode,), input_dtypes=(dtype,))
    assert mode == LAYERNORM.mode, reason


def test_the_probe_never_uses_unit_weights(monkeypatch):
    """With a weight of ones the llama and fp32_affine modes round alike, so the probe must use another weight."""
    seen = []
    real = reference.stepwise_output

    def spy(x, weight, bias, eps, mode):
        seen.append((weight, bias))
        return real(x, weight, bias, eps, mode)

    monkeypatch.setattr(recognition.reference, "stepwise_output", spy)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    recognition.NormRecogniser().verdict(LlamaRMSNorm(WIDTH).to(torch.bfloat16), torch.bfloat16)  # weight of ones
    recognition.probe_mode(nn.LayerNorm(WIDTH), "eps", "weight", "bias", torch.float32, ("layernorm",))
    assert seen and all(w is not None and w.float().std() > 0.3 for w, _ in seen)
    assert all(b.float().abs().mean() > 0.1 for _, b in seen if b is not None)

    rows = recognition.probe_rows(WIDTH).to(torch.bfloat16)
    ones = torch.ones(WIDTH, dtype=torch.bfloat16)
    probe_weight, _ = recognition.probe_parameters(WIDTH, torch.bfloat16, None)
    same = [torch.equal(real(rows, w, None, 1e-6, "llama"), real(rows, w, None, 1e-6, "fp32_affine"))
            for w in (ones, probe_weight)]
    assert same == [True, False]


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_norm_reproduces_eager_bitwise(weight_dtype):
    """GPT-OSS multiplies by its weight in fp32 and rounds once; its checkpoints keep the norms in fp32 with bf16
    activations. The patched norm (kernels in the interpreter) equals the eager module bit for bit, alone and
    with the residual add fused, where the llama order would not."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    norm = _trained_like(GptOssRMSNorm(WIDTH)).to(weight_dtype)
    eager = copy.deepcopy(norm)
    report = patch_model(norm)
    assert report.norms == [""] and type(norm)._hf_rmsnorm_kind.mode == "fp32_affine"
    gen = torch.Generator().manual_seed(3)
    x, r = (torch.randn(4, 16, WIDTH, generator=gen).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        expected = eager(x)
        assert expected.dtype == torch.bfloat16 and torch.equal(norm(x), expected)
        y, s = norm(x, residual=r)
        assert torch.equal(s, r + x) and torch.equal(y, eager(r + x))
        llama = reference.forward_reference(x, None, eager.weight, None, eager.variance_epsilon, "llama")[0]
    assert not torch.equal(llama.to(expected.dtype), expected)


def test_a_registry_entry_that_disagrees_with_its_class_is_skipped_with_the_reason(monkeypatch):
    """As if a transformers release had changed Qwen3's norm: its instances are left alone, with a one-line
    reason, and the other norms are still patched."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    wrong = tuple(
        families.Family(f.name, norms=tuple(families.dataclasses.replace(k, mode="fp32_affine") for k in f.norms),
                        layers=f.layers, stacks=f.stacks) if f.name == "Qwen3" else f
        for f in FAMILIES
    )
    monkeypatch.setattr(families, "FAMILIES", wrong)
    model = nn.ModuleDict({"llama": LlamaRMSNorm(WIDTH), "qwen3": Qwen3RMSNorm(WIDTH)})
    report = patch_model(_trained_like(model))
    assert report.norms == ["llama"]
    (name, reason), = report.skipped
    assert name == "qwen3" and "\n" not in reason
    assert "computes the llama mode, not the fp32_affine mode" in reason


def _outcome(report):
    return report.norms, report.fused_adds, report.skipped


@pytest.mark.parametrize("model_type", ["llama", "nanochat", "gemma2", "olmo2", "qwen3_next", "gpt_oss"])
def test_the_verdicts_do_not_depend_on_the_device_context(model_type):
    """A model built on the meta device (transformers' skeleton-first loading) and a CPU model patched inside a
    meta device context get the report of the CPU model patched outside it: the probe runs on the CPU and reads
    only the dtype, shape and presence of a weight."""
    overrides = CASES[model_type].config
    expected = _outcome(patch_model(tiny_model(model_type, **overrides)))
    with torch.device("meta"):
        skeleton = tiny_model(model_type, **overrides)
        assert all(p.is_meta for p in skeleton.parameters())
        assert _outcome(patch_model(skeleton)) == expected
    model = tiny_model(model_type, **overrides)
    with torch.device("meta"):
        assert _outcome(patch_model(model)) == expected
    assert expected[0]


class _MaybeGroupedRMSNorm(nn.Module):
    """One class, two computations: with ``group_size`` it normalises each group of channels apart (Qwen4-Exp's
    hyper-connection norms), without it the whole row, as Gemma's norm."""

    def __init__(self, dim, group_size=None):
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group_size = group_size

    def forward(self, x):
        h = x.float()
        if self.group_size is not None:
            h = h.reshape(*h.shape[:-1], -1, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h.flatten(-2) if self.group_size is not None else h).mul(1.0 + self.weight.float()).type_as(x)


def test_instances_with_other_settings_are_probed_apart():
    """The grouped instance, probed first, is left alone; the plain one of the same class is still recognised."""
    model = nn.ModuleDict({"grouped": _MaybeGroupedRMSNorm(WIDTH, group_size=16), "plain": _MaybeGroupedRMSNorm(WIDTH)})
    report = patch_model(_trained_like(model))
    assert report.norms == ["plain"] and type(model["plain"])._hf_rmsnorm_kind.mode == "gemma"
    assert [name for name, _ in report.skipped] == ["grouped"] and "match none" in report.skipped[0][1]


# Norm classes that cast the normalised row to the weight's dtype before the multiply (T5's body), by module.
T5_STYLE_NORMS = [
    ("t5", "T5LayerNorm"), ("mt5", "MT5LayerNorm"), ("umt5", "UMT5LayerNorm"), ("longt5", "LongT5LayerNorm"),
    ("switch_transformers", "SwitchTransformersLayerNorm"), ("pop2piano", "Pop2PianoLayerNorm"),
    ("udop", "UdopLayerNorm"), ("pix2struct", "Pix2StructLayerNorm"), ("kosmos2_5", "Kosmos2_5LayerNorm"),
    ("idefics", "IdeficsRMSNorm"),
]


@pytest.mark.parametrize("module, name", T5_STYLE_NORMS, ids=[name for _, name in T5_STYLE_NORMS])
def test_t5_style_norms_are_recognised_in_the_t5_mode(module, name):
    """Each T5-style class, with a trained-like weight, is recognised in the t5 mode in every weight dtype and in a
    bf16 model that keeps the weight in fp32 (its output then fp32, the row unrounded): the mode's reference
    returns the class's output bit for bit on the probe's rows in each input dtype such a model feeds it."""
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this transformers release")
    for weight_dtype, model_dtype in [(d, d) for d in (torch.float32, *HALF)] + [(torch.float32, torch.bfloat16)]:
        norm = _trained_like(cls(WIDTH)).to(weight_dtype)
        verdict = recognition.NormRecogniser().verdict(norm, model_dtype)
        assert verdict.kind is not None and verdict.kind.mode == "t5", (weight_dtype, model_dtype, verdict.reason)
        for input_dtype in dict.fromkeys((weight_dtype, model_dtype, torch.float32)):
            x = recognition.probe_rows(WIDTH).to(input_dtype)
            expected = cls.forward(norm, x)
            got = reference.forward_reference(x, None, norm.weight, None, norm.variance_epsilon, "t5")[0]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (weight_dtype, input_dtype)


class _DebertaLikeMultiplyingLayerNorm(nn.Module):
    """DeBERTa's LayerNorm but for one thing: it multiplies by ``rsqrt(var + eps)`` where DeBERTa divides by
    ``sqrt(var + eps)``."""

    def __init__(self, size, eps=1e-7):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_type = hidden_states.dtype
        hidden_states = hidden_states.float()
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_type) + self.bias


def test_deberta_layer_norm_is_recognised_in_the_deberta_mode_and_a_multiplying_look_alike_is_not():
    """DeBERTa's LayerNorm, with a trained-like weight and bias, is recognised in the deberta mode in every weight
    dtype and in a bf16 model keeping it in fp32, its output the mode's reference bit for bit in each input dtype
    such a model feeds it; the same body multiplying by rsqrt (which rounds otherwise in fp32) matches no mode."""
    from transformers.models.deberta.modeling_deberta import DebertaLayerNorm

    for weight_dtype, model_dtype in [(d, d) for d in (torch.float32, *HALF)] + [(torch.float32, torch.bfloat16)]:
        norm = _trained_like(DebertaLayerNorm(WIDTH)).to(weight_dtype)
        verdict = recognition.NormRecogniser().verdict(norm, model_dtype)
        assert verdict.kind is not None and verdict.kind.mode == "deberta", (weight_dtype, model_dtype, verdict.reason)
        assert verdict.kind.bias_attr == "bias" and verdict.kind.eps_attr == "variance_epsilon"
        for input_dtype in dict.fromkeys((weight_dtype, model_dtype, torch.float32)):
            x = recognition.probe_rows(WIDTH).to(input_dtype)
            expected = norm(x)
            got = reference.forward_reference(x, None, norm.weight, norm.bias, norm.variance_epsilon, "deberta")[0]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (weight_dtype, input_dtype)
        look_alike = _trained_like(_DebertaLikeMultiplyingLayerNorm(WIDTH)).to(weight_dtype)
        verdict = recognition.NormRecogniser().verdict(look_alike, model_dtype)
        assert verdict.kind is None and "match none" in verdict.reason, (weight_dtype, model_dtype)
