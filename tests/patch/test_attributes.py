"""``registered_parameter`` reads what ``getattr`` reads, in every case Python's attribute lookup distinguishes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_rmsnorm import patch_model
from hf_rmsnorm.patch.attributes import registered_parameter


def _norm() -> nn.Module:
    return LlamaRMSNorm(8)


class _WithWeightProperty(LlamaRMSNorm):
    @property
    def weight(self):  # a data descriptor: wins over the parameter __getattr__ would return
        return self._parameters["weight"] * 2


def _with_weight_property() -> nn.Module:
    norm = _norm()
    norm.__class__ = _WithWeightProperty  # (registering the parameter past the property would be refused)
    return norm


def _with_weight_in_instance_dict() -> nn.Module:
    norm = _norm()
    object.__setattr__(norm, "weight", torch.zeros(8))  # past nn.Module.__setattr__: the instance dict wins
    return norm


def _with_class_attribute_added_later() -> nn.Module:
    class Later(LlamaRMSNorm):
        pass

    norm = Later(8)
    registered_parameter(norm, "weight")  # read once before the class changes
    Later.weight = torch.full((8,), 3.0)  # a plain class attribute also comes before __getattr__
    return norm


def _with_weight_none() -> nn.Module:
    norm = nn.LayerNorm(8, elementwise_affine=False)  # registers weight and bias as None
    return norm


def _with_weight_buffer() -> nn.Module:
    norm = nn.Module()
    norm.register_buffer("weight", torch.ones(8))
    return norm


def _patched() -> nn.Module:
    norm = _norm()
    patch_model(norm)
    return norm


@pytest.mark.parametrize("build", [_norm, _with_weight_property, _with_weight_in_instance_dict,
                                   _with_class_attribute_added_later, _with_weight_none, _with_weight_buffer,
                                   _patched])
def test_registered_parameter_is_getattr(build):
    norm = build()
    expected = getattr(norm, "weight")
    found = registered_parameter(norm, "weight")
    if isinstance(norm, _WithWeightProperty):
        assert torch.equal(found, expected) and torch.equal(found, norm._parameters["weight"] * 2)
    else:
        assert found is expected


def test_a_missing_attribute_raises_or_gives_the_default_as_getattr():
    norm = _norm()
    assert registered_parameter(norm, "bias", None) is None
    with pytest.raises(AttributeError, match="bias"):
        registered_parameter(norm, "bias")
