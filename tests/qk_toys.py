"""Toy attention modules for the fused q/k norms + RoPE tests (``tests/patch/test_qk_attention.py``): the three
layouts of the real families (Qwen3's norm per head before the transpose, Gemma 3's after it, OLMo 2's over the
whole projection; GLM-4.5's norms and OLMoE's clamps under an ``if``), look-alikes breaking each invariant of
``hf_rmsnorm.patch.qk_sites``, and RoPE functions the probe must accept or refuse. Each toy model is one attention
between an input and a final norm, so patch_model has its usual norms to patch."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 48, 4, 2, 12


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's RoPE, as Qwen3 and Gemma 3 write it."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def opposite_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """NanoChat's RoPE: its rotate_half returns (x2, -x1), the rotation by the opposite angle."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    def rotate_back(x):
        return torch.cat((x[..., x.shape[-1] // 2:], -x[..., : x.shape[-1] // 2]), dim=-1)

    return (q * cos) + (rotate_back(q) * sin), (k * cos) + (rotate_back(k) * sin)


def rotary_one(x, cos, sin, unsqueeze_dim=1):
    """Hugging Face's RoPE of one tensor, as Gemma 3n and Gemma 4 write it."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (rotate_half(x) * sin)


def partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Partial rotary, as GLM and Qwen3-Next write it: the first cos.shape[-1] columns rotated."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def interleaved_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Pairs (2j, 2j + 1) rotated (GPT-J's layout): not the kernel's."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return (q * cos) + (rotate_every_two(q) * sin), (k * cos) + (rotate_every_two(k) * sin)


def fp32_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """The products and sum in fp32, rounded once (other roundings than eager's): not the kernel's in bf16."""
    cos, sin = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()
    q_embed = q.float() * cos + rotate_half(q.float()) * sin
    k_embed = k.float() * cos + rotate_half(k.float()) * sin
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def rotary_tables(tokens: int, rotary_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32):
    """cos and sin ``[1, tokens, rotary_dim]`` as a rotary embedding returns them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(tokens).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class QwenAttention(nn.Module):
    """Qwen3's layout: a norm per head on the projection viewed into heads, then the transpose."""

    def __init__(self, whole: bool = False) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        width = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM) if whole else (HEAD_DIM, HEAD_DIM)
        self.q_norm = LlamaRMSNorm(width[0], eps=1e-6)
        self.k_norm = LlamaRMSNorm(width[1], eps=1e-6)

    def attend(self, query_states, key_states, value_states):
        key_states = key_states.repeat_interleave(HEADS // KV_HEADS, dim=1)
        value_states = value_states.repeat_interleave(HEADS // KV_HEADS, dim=1)
        output = torch.nn.functional.scaled_dot_product_attention(query_states, key_states, value_states,
                                                                  is_causal=True)
        return self.o_proj(output.transpose(1, 2).flatten(2))

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class GemmaAttention(QwenAttention):
    """Gemma 3's layout: the heads transposed first, then normalised."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class OneTensorAttention(QwenAttention):
    """Gemma 4's layout: the queries and the keys each normalised and rotated on their own, before the transpose."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        query_states = self.q_norm(query_states)
        query_states = rotary_one(query_states, cos, sin, unsqueeze_dim=2)
        query_states = query_states.transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        key_states = self.k_norm(key_states)
        key_states = rotary_one(key_states, cos, sin, unsqueeze_dim=2)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        return self.attend(query_states, key_states, value_states)


class OlmoAttention(QwenAttention):
    """OLMo 2's layout: one norm over the whole projection, then the view into heads."""

    def __init__(self) -> None:
        super().__init__(whole=True)

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class RopeFirstAttention(QwenAttention):
    """HunYuan's order: the heads rotated, then normalised."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        return self.attend(query_states, key_states, value_states)


class OppositeAngleAttention(QwenAttention):
    """NanoChat's order and angle: rotated by the opposite angle, then normalised (the keys' norm first)."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = opposite_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = self.k_norm(key_states)
        query_states = self.q_norm(query_states)
        return self.attend(query_states, key_states, value_states)


class PartialRotaryAttention(QwenAttention):
    """Qwen3's layout with a RoPE function that rotates the first cos.shape[-1] columns."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = partial_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class NormsUnderIfAttention(QwenAttention):
    """GLM-4.5's layout: the norms per head under ``if self.use_qk_norm:``, the transposes and the RoPE after it."""

    use_qk_norm = True

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        if self.use_qk_norm:
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class ClampIfAttention(QwenAttention):
    """OLMoE's layout: OLMo 2's whole-projection norms, then ``if self.clip_qkv is not None:`` clamping the normed
    values in place, then the views and the RoPE."""

    clip_qkv = None

    def __init__(self) -> None:
        super().__init__(whole=True)

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        if self.clip_qkv is not None:
            query_states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
            key_states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
            value_states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class ToyAttentionModel(nn.Module):
    """An input norm, one attention of class ``attention``, a final norm."""

    def __init__(self, attention: type) -> None:
        super().__init__()
        self.input_norm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.attention = attention()
        self.norm = LlamaRMSNorm(HIDDEN, eps=1e-6)

    def forward(self, hidden_states, position_embeddings):
        return self.norm(self.attention(self.input_norm(hidden_states), position_embeddings))


def toy_attention_model(attention: type, dtype: torch.dtype = torch.float32) -> ToyAttentionModel:
    """A ``ToyAttentionModel`` with trained-like norm weights (drawn around 1), in eval mode."""
    torch.manual_seed(0)
    model = ToyAttentionModel(attention)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
    return model.to(dtype).eval()


def toy_inputs(dtype: torch.dtype = torch.float32, tokens: int = 5, rotary_dim: int = HEAD_DIM):
    """``(hidden_states [2, tokens, HIDDEN], (cos, sin))``."""
    hidden = torch.randn(2, tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    return hidden, rotary_tables(tokens, rotary_dim, dtype)
