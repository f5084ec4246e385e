"""Blocks of sibling sublayers (``hf_rmsnorm.patch.derived_blocks``): a toy block calling two pre-norm sublayers
hands each sublayer's normed output sum to the next, and is a layer of its model's loop; the forms it reads, and
toys breaking each, which keep their adds apart and compute as the unfused patch does."""

from __future__ import annotations


import pytest
import torch
from derived_toys import HIDDEN, states, toy_model
from patch_models import assert_outputs_and_gradients_alike, fused_and_unfused
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from harness import residual_census
from hf_rmsnorm.patch import derived_blocks


class ToySublayer(nn.Module):
    """A sublayer beginning with its norm and ending with its output add (T5's ``T5LayerFF``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_norm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.layer_norm(hidden_states)
        return hidden_states + self.dense(normed)


class ToyBlock(nn.Module):
    """Two sublayers called one after the other, with T5's fp16 clamp between them and after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([ToySublayer(), ToySublayer()])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.layer[0](hidden_states)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clamp(-1000, 1000)
        hidden_states = self.layer[-1](hidden_states)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clamp(-1000, 1000)
        return hidden_states


class ToyBlockModel(nn.Module):
    """Two blocks and a final norm, in a loop the derived stack forward reads."""

    def __init__(self, block: type) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block(), block()])
        self.norm = LlamaRMSNorm(HIDDEN, eps=1e-6)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            outputs = layer(hidden_states)
            hidden_states = outputs[0] if isinstance(outputs, tuple) else outputs
        return self.norm(hidden_states)


class ChangingBetween(ToyBlock):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.layer[0](hidden_states)
        hidden_states = hidden_states * 2
        hidden_states = self.layer[-1](hidden_states)
        return hidden_states


class LastInAnIf(ToyBlock):
    def forward(self, hidden_states: torch.Tensor, twice: bool = True) -> torch.Tensor:
        hidden_states = self.layer[0](hidden_states)
        if twice:
            hidden_states = self.layer[-1](hidden_states)
        return hidden_states


class ReturningOtherwise(ToyBlock):
    def forward(self, hidden_states: torch.Tensor, zero: bool = False) -> torch.Tensor:
        hidden_states = self.layer[0](hidden_states)
        hidden_states = self.layer[-1](hidden_states)
        if zero:
            return torch.zeros(1)
        return hidden_states


class _Replacing:
    """A tuple's right operand whose ``__radd__`` puts another tensor first."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def __radd__(self, left: tuple) -> tuple:
        return (self.other, *left[1:])


class ReturningAnotherFirst(ToyBlock):
    def forward(self, hidden_states: torch.Tensor) -> tuple:
        hidden_states = self.layer[0](hidden_states)
        hidden_states = self.layer[-1](hidden_states)
        return (hidden_states,) + _Replacing(hidden_states * 2)


# Each toy breaking a form the blocks are read in, and the reason the report gives.
REFUSED = {
    ChangingBetween: "names hidden_states otherwise than the forms read",
    LastInAnIf: "the last sublayer call (line",
    ReturningOtherwise: "returns after the last sublayer call",
}


def _fused_and_unfused(block: type, monkeypatch, dtype: torch.dtype = torch.float32):
    return fused_and_unfused(toy_model(block, dtype, ToyBlockModel), monkeypatch)


def test_a_block_reads_its_sublayer_calls():
    code = derived_blocks.block_code(ToyBlock)
    assert [site.path for site in code.sites] == [("layer", 0), ("layer", -1)] and not code.returns_tuple


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_hands_each_sublayer_sum_on_with_the_unfused_results(dtype, monkeypatch):
    """Each sublayer's add goes into the next sublayer's norm, each block's last into the next block's first norm
    or the final norm: 4 adds, the values and gradients of the adds apart, bit for bit (fp32: gradients too)."""
    report, fused, unfused = _fused_and_unfused(ToyBlock, monkeypatch, dtype)
    assert report.fused_adds == [
        "layers.0.layer.0: layer output -> layers.0.layer.1.layer_norm",
        "layers.1.layer.0: layer output -> layers.1.layer.1.layer_norm",
        "layers.0: output of self.layer[-1] -> layers.1.layer.0.layer_norm",
        "layers.1: output of self.layer[-1] -> norm",
    ]
    x = states(dtype)
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 4
    assert_outputs_and_gradients_alike(fused, unfused, x, gradients=dtype == torch.float32)


def test_a_hook_on_a_sublayer_makes_the_plain_calls_around_it(monkeypatch):
    report, fused, unfused = _fused_and_unfused(ToyBlock, monkeypatch)
    x = states()
    handle = fused.layers[0].layer[1].register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad():
        # layers.0's inner handoff (into the hooked sublayer) and its last add (made by the hooked sublayer) apart.
        assert residual_census.fused_adds(fused, lambda m: m(x)) == 2
        assert torch.equal(fused(x), unfused(x))
    handle.remove()
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 4


def test_fp16_clamp_between_and_after_the_sublayers_withdraws_the_handoffs(monkeypatch):
    """In fp16 the clamp branches run: nothing is handed on, and the sums the branches clamp are normed."""
    _, fused, unfused = _fused_and_unfused(ToyBlock, monkeypatch, torch.float16)
    x = states(torch.float16) * 3000  # sums beyond the clamp: a handed-on norm of the unclamped sum would differ
    with torch.no_grad():
        assert torch.equal(fused(x), unfused(x))


@pytest.mark.parametrize("block", list(REFUSED), ids=lambda b: b.__name__)
def test_a_block_breaking_a_form_keeps_its_adds_apart_with_the_reason(block, monkeypatch):
    report, fused, unfused = _fused_and_unfused(block, monkeypatch)
    reasons = dict(report.skipped)
    assert REFUSED[block] in reasons["layers.0"], reasons
    assert REFUSED[block] in derived_blocks.block_code(block).problem
    x = states()
    with torch.no_grad():
        assert torch.equal(fused(x), unfused(x))


def test_a_block_returning_another_tensor_first_hands_nothing_on(monkeypatch):
    """``(h,) + rest`` reads as a tuple beginning with the sum, but ``rest``'s ``__radd__`` puts another tensor
    first: the identity check at the call hands nothing on, and the next block normalises what it gets."""
    report, fused, unfused = _fused_and_unfused(ReturningAnotherFirst, monkeypatch)
    assert "layers.0: output of self.layer[-1] -> layers.1.layer.0.layer_norm" in report.fused_adds
    x = states()
    with torch.no_grad():
        assert torch.equal(fused(x), unfused(x))
