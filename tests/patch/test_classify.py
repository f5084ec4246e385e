"""What each module is to the patcher (``hf_rmsnorm.patch.classify``), on transformers' own classes and torch's."""

import pytest
import torch
from patch_models import tiny_model
from torch import nn
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm
from transformers.models.mamba.modeling_mamba import MambaBlock, MambaModel

from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import fused
from hf_rmsnorm.patch.classify import Role, norm_role, role_of
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
