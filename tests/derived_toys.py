"""Toy decoder layers and stacks for the derived forwards' tests (``tests/patch/test_derived*.py``): a pre-norm
layer of no registered shape, a loop over two of them with a final norm, and what the analyses find in them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_rmsnorm.patch import derived_loops, derived_sites, derived_source
from hf_rmsnorm.patch.derived_sites import AddSite

HIDDEN = 48


class ToyDecoderLayer(nn.Module):
    """A pre-norm layer of no registered shape: its second norm nested in the MLP call, a scaled branch."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.post_attention_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.mixer = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.mixer(hidden_states) * scale
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states


class ToyModel(nn.Module):
    """Two layers of one class and a final norm, in a loop the derived stack forward reads."""

    def __init__(self, layer: type, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(n_layers))
        self.norm = LlamaRMSNorm(HIDDEN, eps=1e-6)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states = self.norm(hidden_states)
        return hidden_states


def toy_model(layer: type = ToyDecoderLayer, dtype: torch.dtype = torch.float32, stack: type = ToyModel) -> ToyModel:
    """A ``stack`` of two ``layer``s, its norms' weights drawn around 1, in eval mode."""
    torch.manual_seed(0)
    model = stack(layer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)  # trained-like: a wrong casting order would show, as ones would not
    return model.to(dtype).eval()


def states(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The hidden states a toy model is run on."""
    return torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)


def sites(cls: type, norms=("input_layernorm", "post_attention_layernorm")) -> tuple[AddSite, ...]:
    """The add sites ``derived_sites`` finds in ``cls``'s forward, given its patched norms."""
    code = derived_sites.layer_code(cls, frozenset((n,) for n in norms))
    assert not isinstance(code, str), code
    return code.sites


def stack_layout(cls: type) -> tuple[str, str | None] | None:
    """``(layers, final norm)`` that ``derived_loops`` reads in ``cls``'s forward."""
    forward = derived_source.class_forward(cls)
    return derived_loops.stack_layout(derived_loops.stack_loops(forward, forward.node))


class AddingSublayer(nn.Module):
    """A sublayer whose one residual add is its output (BLOOM's attention and MLP, without ``dropout_add``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.proj(hidden_states)
        return residual + out


class SublayerDecoderLayer(nn.Module):
    """A layer whose adds sit in its sublayers (BLOOM's block): the attention's sum read by the layer's norm, the
    MLP's returned."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.post_attention_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.attention = AddingSublayer()
        self.feed_forward = AddingSublayer()

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attention_output = self.attention(normed, hidden_states)
        normed = self.post_attention_layernorm(attention_output)
        output = self.feed_forward(normed, attention_output)
        return output
