"""What each module is to the patcher (``hf_rmsnorm.patch.classify``), on transformers' own classes and torch's,
and what patch_model then makes of the classes named after the norms they hold."""

import copy

import pytest
import torch
from patch_models import tiny_model
from torch import nn
from transformers import DbrxConfig, DbrxForCausalLM, Wav2Vec2Config, Wav2Vec2Model
from transformers.models.bit.modeling_bit import BitGroupNormActivation
from transformers.models.dbrx.modeling_dbrx import DbrxNormAttentionNorm
from transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm import (
    RobertaPreLayerNormLayer,
    RobertaPreLayerNormModel,
)
from transformers.models.wav2vec2.modeling_wav2vec2 import (
    Wav2Vec2EncoderLayerStableLayerNorm,
    Wav2Vec2EncoderStableLayerNorm,
    Wav2Vec2LayerNormConvLayer,
)
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm
from transformers.models.mamba.modeling_mamba import MambaBlock, MambaModel

from harness import coverage
from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.patch import fused
from hf_rmsnorm.patch.classify import Role, holds_norms, norm_role, role_of
from hf_rmsnorm.patch.families import registry


class GatedRMSNorm(nn.Module):  # a name that says RMSNorm is looked at, and left alone with a reason if not one
    pass


@pytest.mark.parametrize("cls, role", [
    (LlamaRMSNorm, Role.REGISTERED_NORM),
    (nn.RMSNorm, Role.RMS_NORM_LIKE),
    (GatedRMSNorm, Role.RMS_NORM_LIKE),
    (nn.LayerNorm, Role.TORCH_LAYER_NORM),
    (CohereLayerNorm, Role.OWN_LAYER_NORM),
    (nn.GroupNorm, Role.OTHER_NORM),
    (nn.BatchNorm2d, Role.OTHER_NORM),
    (LlamaDecoderLayer, Role.REGISTERED_LAYER),
    (GPT2Block, Role.REGISTERED_LAYER),
    (MambaBlock, Role.DECODER_LAYER),
    (LlamaModel, Role.REGISTERED_STACK),
    (GPT2Model, Role.REGISTERED_STACK),
    (MambaModel, Role.STACK),
    (nn.Linear, Role.OTHER),
])
def test_each_class_has_the_role_its_registry_entry_type_or_name_gives(cls, role):
    assert role_of(cls, registry()) is role


def test_norm_roles_need_no_registry_and_the_registry_comes_first():
    assert norm_role(LlamaRMSNorm) is Role.RMS_NORM_LIKE  # by its name, where no registry is asked
    assert norm_role(nn.Linear) is None and norm_role(LlamaDecoderLayer) is None
    assert {r for r in Role if r.is_norm} == {Role.REGISTERED_NORM, Role.TORCH_LAYER_NORM, Role.RMS_NORM_LIKE,
                                              Role.OWN_LAYER_NORM, Role.OTHER_NORM}
    assert {r for r in Role if r.is_recognisable_norm} == {Role.RMS_NORM_LIKE, Role.OWN_LAYER_NORM}


def test_a_patched_module_is_patched_whatever_it_was():
    model = tiny_model("llama")
    patch_model(model)
    reg = registry()
    for module in (model.model.norm, model.model.layers[0], model.model):
        assert fused.original_class(module) is not None and role_of(type(module), reg) is Role.PATCHED
    assert role_of(type(model.lm_head), reg) is Role.OTHER
    assert role_of(torch.nn.Module, reg) is Role.OTHER


@pytest.mark.parametrize("cls, role", [
    # Holding modules, a class whose name says Norm before its last word is judged by that word: RoBERTa-
    # PreLayerNorm's layer and model, Wav2Vec2's convolution with a LayerNorm.
    (RobertaPreLayerNormLayer, Role.DECODER_LAYER),
    (RobertaPreLayerNormModel, Role.STACK),
    (Wav2Vec2LayerNormConvLayer, Role.DECODER_LAYER),
    (BitGroupNormActivation, Role.OTHER_NORM),  # a subclass of torch's GroupNorm is a norm whatever it holds
])
def test_a_class_holding_modules_and_saying_norm_before_its_last_word_is_judged_by_that_word(cls, role):
    assert role_of(cls, registry(), holds_modules=True) is role
    assert role_of(cls, registry()) is norm_role(cls) is Role.OTHER_NORM  # a leaf so named is a norm


@pytest.mark.parametrize("cls, role", [
    (Wav2Vec2EncoderLayerStableLayerNorm, Role.DECODER_LAYER),  # a pre-LN layer named after its norms
    (Wav2Vec2EncoderStableLayerNorm, Role.STACK),  # its stack
    (DbrxNormAttentionNorm, Role.OTHER),  # norm, attention, add, norm: a sublayer
    (nn.LayerNorm, Role.TORCH_LAYER_NORM),  # a norm class of torch's is a norm whatever it holds
])
def test_a_class_named_after_the_norms_it_holds_is_judged_by_its_other_words(cls, role):
    assert role_of(cls, registry(), holds_modules=True, composite=True) is role
    assert role_of(cls, registry()) is norm_role(cls)  # holding no norm, its name makes it a norm


def test_a_module_holds_norms_when_a_child_is_one():
    assert holds_norms(DbrxNormAttentionNorm(_dbrx_config(), layer_idx=0))
    assert not holds_norms(nn.LayerNorm(8)) and not holds_norms(nn.Sequential(nn.Linear(8, 8)))


def _dbrx_config() -> DbrxConfig:
    return DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=128, resid_pdrop=0.0,
                      emb_pdrop=0.0, attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                      ffn_config=dict(ffn_hidden_size=128, moe_num_experts=2, moe_top_k=1))


def _stable_wav2vec2() -> Wav2Vec2Model:
    """wav2vec2-large-lv60's layout (``do_stable_layer_norm``: pre-LN layers; XLS-R, HuBERT-large and WavLM-large
    have it too), tiny."""
    config = Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, do_stable_layer_norm=True, feat_extract_norm="layer")
    return Wav2Vec2Model(config)


def _judged(model: nn.Module, run) -> tuple[str, str, object]:
    """patch_model's report on ``model``, with the coverage page's verdict on its output: fp32 against its eager
    self, bf16 against an fp64 copy."""
    coverage.randomise_norms(model)
    model.eval()
    truth, eager32 = run(copy.deepcopy(model).double()), run(model)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    eager16 = run(bf16)
    report = patch_model(model)
    patch_model(bf16)
    result = coverage.Coverage(type(model).__name__, type(model).__name__, "", fused_adds=len(report.fused_adds))
    verdict, reason = coverage._judge(result, truth, eager32, run(model), eager16, run(bf16))
    return verdict, reason, report


def test_a_stable_layer_norm_wav2vec2_fuses_every_add_with_parity():
    """Its layers and stack are named after their LayerNorm; judged as a layer and a stack, each layer's attention
    add goes into its final_layer_norm and its output add into the next layer's norm (the last one's into the
    encoder's), as wav2vec2-base's post-LN layers fuse theirs."""
    torch.manual_seed(0)
    model = _stable_wav2vec2()
    reference = copy.deepcopy(model)
    audio = torch.randn(2, 4000, generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.no_grad():
            return m(audio.to(m.dtype)).last_hidden_state.double()

    verdict, reason, report = _judged(model, run)
    assert verdict == "fused", reason
    assert len(report.norms) == 8 and len(report.fused_adds) == 4, report
    assert sorted(target for _, _, target in (line.partition(" -> ") for line in report.fused_adds)) == [
        "encoder.layer_norm", "encoder.layers.0.final_layer_norm", "encoder.layers.1.final_layer_norm",
        "encoder.layers.1.layer_norm"]
    # Left alone with their reasons: the positional convolution's weight norm (a parametrization), and the feature
    # convolutions, which have no residual add (before, all of these and the layers and encoder were "not a norm").
    assert {name: reason.split(":")[0] for name, reason in report.skipped} == {
        "encoder.pos_conv_embed.conv.parametrizations.weight.0": "torch.nn.utils.parametrizations._WeightNorm is not a "
                                                                 "norm of a supported family",
        **{f"feature_extractor.conv_layers.{i}": "residual adds not fused" for i in range(2)}}, report
    unpatch_model(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]


def test_dbrxs_norm_attention_norm_fuses_its_add_and_claims_no_qk_norms():
    """DBRX's ``DbrxNormAttentionNorm`` (norm_1, attention, add, norm_2) is a sublayer whose add goes into norm_2;
    its two norms read the stream, so it is no attention with q/k norms."""
    torch.manual_seed(0)
    model = DbrxForCausalLM(_dbrx_config())
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.no_grad():
            return m(ids, use_cache=False).logits.double()

    verdict, reason, report = _judged(model, run)
    assert verdict == "fused", reason
    assert report.fused_adds == [f"transformer.blocks.{i}.norm_attn_norm: residual add at line {_add_line()} "
                                 f"(into norm_2) -> transformer.blocks.{i}.norm_attn_norm.norm_2" for i in range(2)]
    assert not report.skipped and not report.fused_qk, report


def _add_line() -> int:
    """The line of DbrxNormAttentionNorm's residual add in the installed transformers."""
    import inspect

    lines, first = inspect.getsourcelines(DbrxNormAttentionNorm.forward)
    return first + next(i for i, line in enumerate(lines) if "hidden_states + residual_states" in line)
