"""The numerical probe of an attention module's RoPE function: the function is accepted for the fused q/k norms +
RoPE (``qk_attention.py``) only where it computes, bit for bit, what ``qk_norm_rope`` computes after its norms.

A function rotating by the opposite angle (NanoChat's ``rotate_half`` returns ``(x2, -x1)``) is probed against the
kernel's ``negate_sin`` where it computes the usual angle in no dtype. The norms' outputs are made exactly known: rows of +-1 (mean square 1, so rstd is 1 exactly, with an eps below half an
ulp of 1) normalised with trained-like weights give ``sign * weight`` in the norm's dtype, with no rounding.
``qk_norm_rope`` then rotates those values with random ``cos``/``sin``; the function is given the same values as the
attention gives it (``[batch, heads, tokens, head_dim]``, the transposed view of the projection) and must return the
same tensors: same shape, the same bits (a function rounding its products and sum elsewhere, rotating interleaved pairs,
or applying multimodal sections differs), in the kernel's dtype or, where the function casts its result back to its
input's dtype (OLMo 2 rotates bf16 heads with fp32 tables and returns bf16), the kernel's output cast so. It is probed
for every pair of the norm's output dtype and ``cos``'s dtype the kernels take (``DTYPE_PAIRS``), with ``cos`` over the
whole head (full rotary) and over half of it (partial rotary: the kernel rotates the first ``cos.shape[-1]`` columns and
passes the others through). The probe runs on the CPU: in the tests the kernels in Triton's interpreter, elsewhere the
operator's PyTorch implementation, which the kernels equal bit for bit (``tests/ops/test_qk_rope.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.qk import qk_norm_rope

_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
# (the norm's output dtype, cos's dtype): models in one dtype, and half-precision activations with fp32 tables.
DTYPE_PAIRS = ((_FP32, _FP32), (_BF16, _BF16), (_FP16, _FP16), (_BF16, _FP32), (_FP16, _FP32))
# Below half an ulp of 1 in fp32: the mean square 1 plus eps is 1, so rstd is 1 exactly (and padded rows of the
# interpreted kernels divide by no zero).
_EPS = 2.0**-30
_BATCH, _TOKENS, _Q_HEADS, _K_HEADS, _HEAD_DIM = 2, 3, 4, 2, 16


@dataclass(frozen=True)
class RopeVerdict:
    """What the probe found a RoPE function to compute as the kernel does: for each dtype pair it does, whether it
    casts the kernel's output back to the norm's dtype (``dtypes``); whether it does so for partial rotary (``cos``
    narrower than the head) too; and whether it rotates by the opposite angle (``negate_sin``: the kernel's
    ``negate_sin``)."""

    dtypes: tuple[tuple[tuple[torch.dtype, torch.dtype], bool], ...]
    partial: bool
    negate_sin: bool = False


def probe_rope(rope: object) -> RopeVerdict | str:
    """The verdict on ``rope`` (called as ``rope(q, k, cos, sin)``), or why it is not the kernel's RoPE, of either
    angle (Hugging Face's ``rotate_half``, or NanoChat's, which returns ``(x2, -x1)``). The probe runs on the CPU
    whatever the caller's default device or ``torch.device`` context (a model built under ``torch.device("meta")``
    gets the verdict it will have once loaded)."""
    with torch.device("cpu"):
        for negate_sin in (False, True):
            generator = torch.Generator().manual_seed(0)
            full = {pair: cast for pair in DTYPE_PAIRS
                    if (cast := _agrees(rope, *pair, _HEAD_DIM, generator, negate_sin)) is not None}
            if full:
                break
        partial = all(_agrees(rope, *pair, _HEAD_DIM // 2, generator, negate_sin) == cast
                      for pair, cast in full.items())
    if not full:
        return (f"{getattr(rope, '__qualname__', rope)} does not compute the kernel's rotate_half RoPE in any dtype "
                "(interleaved pairs, multimodal sections or other roundings)")
    if (_BF16, _BF16) not in full:
        return f"{getattr(rope, '__qualname__', rope)} does not compute the kernel's RoPE bit for bit in bf16"
    return RopeVerdict(tuple(full.items()), partial, negate_sin)


def probe_one_tensor_rope(rope: object) -> RopeVerdict | str:
    """``probe_rope``'s verdict on ``rope`` called on one tensor as Gemma 3n and 4 call it (``qk_sites.one_sites``):
    ``rope(x, cos, sin, unsqueeze_dim=2)``, ``x`` ``[batch, tokens, heads, head_dim]``, on the queries and on the
    keys in turn (the layout the probe gives a function of both, transposed back)."""

    def both(q, k, cos, sin):
        return tuple(rope(x.transpose(1, 2), cos, sin, unsqueeze_dim=2).transpose(1, 2) for x in (q, k))

    both.__qualname__ = getattr(rope, "__qualname__", repr(rope))
    return probe_rope(both)


def _agrees(rope, norm_dtype: torch.dtype, cos_dtype: torch.dtype, rotary_dim: int, generator: torch.Generator,
            negate_sin: bool) -> bool | None:
    """Whether ``rope`` computes the kernel's output (of the angle ``negate_sin`` names: False) or that output cast
    to ``norm_dtype`` (True) on one random draw; None if neither."""
    def signs(heads):
        return (torch.randint(0, 2, (_BATCH, _TOKENS, heads, _HEAD_DIM), generator=generator) * 2 - 1).to(norm_dtype)

    def weight():  # trained-like: around 1, of either sign, some small
        return (torch.randn(_HEAD_DIM, generator=generator) * 0.7 + 0.5).to(norm_dtype)

    q, k, q_weight, k_weight = signs(_Q_HEADS), signs(_K_HEADS), weight(), weight()
    cos, sin = (torch.rand(_BATCH, _TOKENS, rotary_dim, generator=generator).mul(2).sub(1).to(cos_dtype)
                for _ in range(2))
    with torch.no_grad():
        expected = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, _EPS, negate_sin=negate_sin)
        try:
            got = rope((q * q_weight).transpose(1, 2), (k * k_weight).transpose(1, 2), cos, sin)
        except Exception:  # a function that cannot take this layout or rotary width is not accepted for it
            return None
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, torch.Tensor) for g in got)):
        return None
    for cast in (False, True):
        wanted = [e.to(norm_dtype) if cast else e for e in expected]
        if all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, wanted)):
            return cast
    return None
