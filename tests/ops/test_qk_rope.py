"""The fused q/k norms + RoPE (``hf_rmsnorm.ops.qk_norm_rope``) against the transformers functions themselves (each
family's norm module and its ``apply_rotary_pos_emb``, in the model's dtype) and against fp64 maths, forward and
backward, in Triton's interpreter on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from launching import SCRIPTS, TESTS
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.qwen3 import modeling_qwen3

from harness import byte_traffic, kernel_inspect
from hf_rmsnorm import qk_norm_rope
from hf_rmsnorm.ops import library, qk_launch, reference
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.ops.kernels import unspecialised_args
from hf_rmsnorm.tools.norm_outputs import ulp_distance

pytestmark = pytest.mark.skipif(
    not kernels_interpreted() and not torch.cuda.is_available(), reason="kernels need a GPU or Triton's interpreter"
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
HALF_DTYPES = [torch.bfloat16, torch.float16]
DTYPES = [*HALF_DTYPES, torch.float32]
EPS = 1e-6


@dataclass(frozen=True)
class Family:
    """How one family's attention computes its q/k norms and RoPE, with its own functions."""

    norm: type  # the q/k norm module, constructed as norm(width, eps=...)
    rope: Callable  # its apply_rotary_pos_emb
    mode: str
    per_head: bool
    norm_after_transpose: bool = False  # Gemma 3 normalises the [batch, heads, tokens, head_dim] view
    weight_centre: float = 1.0  # trained-like weights around this (Gemma's 1 + w: around 0)


FAMILIES = {
    "qwen3": Family(modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.apply_rotary_pos_emb, "llama", per_head=True),
    "gemma3": Family(modeling_gemma3.Gemma3RMSNorm, modeling_gemma3.apply_rotary_pos_emb, "gemma", per_head=True,
                     norm_after_transpose=True, weight_centre=0.0),
    "olmo2": Family(modeling_olmo2.Olmo2RMSNorm, modeling_olmo2.apply_rotary_pos_emb, "fp32_affine",
                    per_head=False),
    # Partial rotary: GLM-4-MoE's apply_rotary_pos_emb rotates cos.shape[-1] columns of each head, passes the rest.
    "glm4_moe": Family(modeling_glm4_moe.Glm4MoeRMSNorm, modeling_glm4_moe.apply_rotary_pos_emb, "llama",
                       per_head=True),
}


def _randn(*shape, dtype=torch.float32, scale=1.0, centre=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + centre).to(device=DEVICE, dtype=dtype)


def _inputs(family, dtype, batch, tokens, q_heads, k_heads, head_dim, rotary_dim, seed, weight_dtype=None,
            cos_batch=None):
    """q and k as views of one fused projection's output (strided, as a qkv projection gives them), trained-like
    weights, random cos/sin in the model dtype (what the patcher's probe draws)."""
    fused = _randn(batch, tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype, scale=2.0, seed=seed)
    q = fused[..., : q_heads * head_dim].view(batch, tokens, q_heads, head_dim)
    k = fused[..., q_heads * head_dim: (q_heads + k_heads) * head_dim].view(batch, tokens, k_heads, head_dim)
    q_width, k_width = (head_dim, head_dim) if family.per_head else (q_heads * head_dim, k_heads * head_dim)
    weight_dtype = weight_dtype or dtype
    q_weight = _randn(q_width, dtype=weight_dtype, scale=0.3, centre=family.weight_centre, seed=seed + 1)
    k_weight = _randn(k_width, dtype=weight_dtype, scale=0.3, centre=family.weight_centre, seed=seed + 2)
    cos_batch = batch if cos_batch is None else cos_batch
    cos = _randn(cos_batch, tokens, rotary_dim, dtype=dtype, seed=seed + 3)
    sin = _randn(cos_batch, tokens, rotary_dim, dtype=dtype, seed=seed + 4)
    return q, k, q_weight, k_weight, cos, sin


def _module(family, weight):
    module = family.norm(weight.shape[0], eps=EPS).to(device=DEVICE, dtype=weight.dtype)
    module.weight.data.copy_(weight)
    return module


def _eager(family, q, k, q_weight, k_weight, cos, sin):
    """What the family's attention computes, with its own modules and functions: ``[batch, heads, tokens, head_dim]``."""
    q_norm, k_norm = _module(family, q_weight), _module(family, k_weight)
    if not family.per_head:  # OLMo 2: the norm over the projection, then the view into heads
        q_states = q_norm(q.reshape(*q.shape[:2], -1)).view(q.shape).transpose(1, 2)
        k_states = k_norm(k.reshape(*k.shape[:2], -1)).view(k.shape).transpose(1, 2)
    elif family.norm_after_transpose:
        q_states, k_states = q_norm(q.transpose(1, 2)), k_norm(k.transpose(1, 2))
    else:
        q_states, k_states = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
    return family.rope(q_states, k_states, cos, sin)


def _fp64(family, q, k, q_weight, k_weight, cos, sin):
    """The exact maths in fp64, no intermediate rounding."""
    def one(x, w):
        x = x.double()
        rows = x if family.per_head else x.reshape(*x.shape[:2], -1)
        n = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + EPS)
        if w is not None:
            n = n * (w.double() + (1.0 if family.mode == "gemma" else 0.0))
        n = n.view(x.shape)
        r = cos.shape[-1]
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        rotated = n[..., :r] * c + reference.rotate_half(n[..., :r]) * s
        return torch.cat([rotated, n[..., r:]], dim=-1).transpose(1, 2)
    return one(q, q_weight), one(k, k_weight)


def _ours(family, q, k, q_weight, k_weight, cos, sin):
    return qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS, mode=family.mode, per_head=family.per_head)


def _layout(t):
    """The strides that matter: those of dimensions longer than 1."""
    return [stride for size, stride in zip(t.shape, t.stride()) if size > 1]


def _same_statistics(family, q, k, q_weight, k_weight, cos, sin):
    """For q's and k's outputs (``[batch, heads, tokens, head_dim]``), where the kernel's fp32 ``rstd`` of the row
    is the very value eager's norm computed. The two reduce a row in different orders, so an ``rstd`` can differ by
    an ulp (docs/numerics.md), and an output then round the other way: the rounding order is exact, the
    statistics are not."""
    _, _, stats = library.op("qk_norm_rope_fwd")(q, k, q_weight, k_weight, cos, sin, EPS, EPS, family.mode,
                                                        family.per_head)
    kernel_rstd = stats[qk_launch.STATS_SYNC_SLOTS:]
    masks, first = [], 0
    for x in (q, k):
        if not family.per_head:
            rows = x.reshape(*x.shape[:2], -1)
        else:
            rows = x.transpose(1, 2) if family.norm_after_transpose else x
        eager_rstd = torch.rsqrt(rows.float().pow(2).mean(-1) + EPS)
        ours = kernel_rstd[first: first + eager_rstd.numel()]
        first += eager_rstd.numel()
        if not family.per_head:  # [batch, tokens]
            same = (ours.view(eager_rstd.shape) == eager_rstd)[:, None, :, None]
        elif family.norm_after_transpose:  # [batch, heads, tokens]; the kernel's rows are [batch, tokens, heads]
            same = (ours.view(x.shape[:3]).transpose(1, 2) == eager_rstd)[..., None]
        else:
            same = (ours.view(eager_rstd.shape) == eager_rstd).transpose(1, 2)[..., None]
        masks.append(same.expand(x.shape[0], x.shape[2], x.shape[1], x.shape[3]))
    return masks


def _assert_matches_eager(family, args, ours, eager, same_layout=True):
    """Bitwise equal to eager on every row whose statistics are eager's, and never less accurate than eager
    against fp64; laid out as eager's unless told otherwise (partial rotary's concatenation gives a contiguous
    ``[batch, heads, tokens, head_dim]``)."""
    exact = _fp64(family, *args)
    same = _same_statistics(family, *args)
    for o, e, x, agree in zip(ours, eager, exact, same):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert _layout(o) == _layout(e) or not same_layout
        assert reference.error_beyond_bound(o, e, x) <= 0
        assert torch.equal(o[agree], e[agree]), (o.double() - e.double()).abs().max().item()


# (batch, tokens, q heads, k heads, head_dim, rotary_dim): decode, prefill, GQA, odd head_dims, partial rotary.
SHAPES = {
    "decode": (1, 1, 8, 2, 128, 128),
    "prefill": (2, 5, 4, 2, 64, 64),
    "hd80": (2, 3, 3, 1, 80, 80),
    "hd96": (1, 4, 4, 4, 96, 96),
    "hd256": (1, 3, 2, 1, 256, 256),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "olmo2"])
def test_forward_matches_the_families_own_functions(name, shape, dtype):
    family = FAMILIES[name]
    batch, tokens, q_heads, k_heads, head_dim, rotary_dim = SHAPES[shape]
    args = _inputs(family, dtype, batch, tokens, q_heads, k_heads, head_dim, rotary_dim, seed=len(shape) + 7)
    _assert_matches_eager(family, args, _ours(family, *args), _eager(family, *args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (80, 40), (96, 48), (64, 32)])
def test_partial_rotary_passes_the_rest_of_each_head_through(head_dim, rotary_dim, dtype):
    family = FAMILIES["glm4_moe"]
    args = _inputs(family, dtype, 2, 3, 4, 2, head_dim, rotary_dim, seed=head_dim)
    _assert_matches_eager(family, args, _ours(family, *args), _eager(family, *args), same_layout=False)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_fp32_weights_promote_as_eager_does(name, dtype):
    """An fp32 weight with half-precision activations (mixed-precision training): Llama's ``w * n.to(x.dtype)``
    returns fp32 and the RoPE runs in fp32; OLMo 2's returns the activation dtype."""
    family = FAMILIES[name]
    args = _inputs(family, dtype, 2, 3, 4, 2, 64, 64, seed=3, weight_dtype=torch.float32)
    ours, eager = _ours(family, *args), _eager(family, *args)
    assert ours[0].dtype == eager[0].dtype == (torch.float32 if family.mode == "llama" else dtype)
    _assert_matches_eager(family, args, ours, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cos_shared_across_the_batch_and_rotary_module_outputs(dtype):
    """cos/sin of batch 1 for a batch of 3 (broadcast), and the values the rotary module itself returns."""
    family = FAMILIES["qwen3"]
    q, k, q_weight, k_weight, _, _ = _inputs(family, dtype, 3, 6, 4, 2, 128, 128, seed=11)
    config = modeling_qwen3.Qwen3Config(head_dim=128, hidden_size=512, num_attention_heads=4)
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(config).to(DEVICE)
    cos, sin = rotary(q, torch.arange(100, 106, device=DEVICE)[None])
    assert cos.shape == (1, 6, 128) and cos.dtype == dtype
    args = (q, k, q_weight, k_weight, cos, sin)
    _assert_matches_eager(family, args, _ours(family, *args), _eager(family, *args))


def test_strided_heads_and_norms_without_weights():
    """Qwen3-Next's q is one half of each head of a wider projection (head stride 2 * head_dim); norms without a
    weight (NanoChat's kind) are ``n.to(x.dtype)``."""
    q, _gate = torch.chunk(_randn(2, 3, 4, 2 * 64, dtype=torch.bfloat16, seed=5), 2, dim=-1)
    k = _randn(2, 3, 2, 64, dtype=torch.bfloat16, seed=6)
    cos, sin = _randn(2, 3, 64, dtype=torch.bfloat16, seed=7), _randn(2, 3, 64, dtype=torch.bfloat16, seed=8)
    args = (q, k, None, None, cos, sin)

    def normed(x):
        n = x.float()
        return (n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype).transpose(1, 2)

    eager = modeling_qwen3.apply_rotary_pos_emb(normed(q), normed(k), cos, sin)
    _assert_matches_eager(FAMILIES["qwen3"], args, qk_norm_rope(*args, EPS), eager)


def test_most_rows_share_eagers_statistics():
    """The bitwise comparisons above are not vacuous: most rows' ``rstd`` are eager's very values."""
    family = FAMILIES["qwen3"]
    args = _inputs(family, torch.bfloat16, 2, 16, 8, 2, 128, 128, seed=17)
    for agree in _same_statistics(family, *args):
        assert agree.float().mean() >= 0.5


def test_fp64_runs_the_pytorch_implementation_as_eager_computes():
    family = FAMILIES["qwen3"]
    args = _inputs(family, torch.float64, 2, 3, 4, 2, 64, 64, seed=9)
    for o, e in zip(_ours(family, *args), _eager(family, *args)):
        assert o.dtype == torch.float64 and torch.equal(o, e)


def test_a_token_computes_the_same_whatever_its_batch():
    """Batch invariance: a token's outputs alone are bitwise those it has in a batch of 7 (decode and prefill)."""
    family = FAMILIES["qwen3"]
    q, k, q_weight, k_weight, cos, sin = _inputs(family, torch.bfloat16, 7, 5, 4, 2, 128, 128, seed=13)
    q_all, k_all = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS)
    q_one, k_one = qk_norm_rope(q[3:4, 2:3], k[3:4, 2:3], q_weight, k_weight, cos[3:4, 2:3], sin[3:4, 2:3], EPS)
    assert torch.equal(q_one, q_all[3:4, :, 2:3]) and torch.equal(k_one, k_all[3:4, :, 2:3])


# --------------------------------------------------------------------------------------------------- backward


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs)


def _backward_case(name, dtype, shape, seed):
    family = FAMILIES[name]
    q, k, q_weight, k_weight, cos, sin = _inputs(family, dtype, *shape, seed=seed)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, q_weight, k_weight)]
    # The gradients as SDPA's backward gives them: contiguous [batch, heads, tokens, head_dim], so the op reads
    # its output's gradient transposed.
    dq = _randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=dtype, seed=seed + 20)
    dk = _randn(k.shape[0], k.shape[2], k.shape[1], k.shape[3], dtype=dtype, seed=seed + 21)
    return family, leaves, cos, sin, (dq, dk)


def _eager_grads(family, leaves, cos, sin, grad_outputs):
    inputs = [t.detach().clone().requires_grad_() for t in leaves]
    q_norm, k_norm = _module(family, inputs[2].detach()), _module(family, inputs[3].detach())
    q, k = inputs[0], inputs[1]
    if not family.per_head:
        q_states = q_norm(q.reshape(*q.shape[:2], -1)).view(q.shape).transpose(1, 2)
        k_states = k_norm(k.reshape(*k.shape[:2], -1)).view(k.shape).transpose(1, 2)
    elif family.norm_after_transpose:
        q_states, k_states = q_norm(q.transpose(1, 2)), k_norm(k.transpose(1, 2))
    else:
        q_states, k_states = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
    out = family.rope(q_states, k_states, cos, sin)
    return _grads(out, (q, k, q_norm.weight, k_norm.weight), grad_outputs)


def _exact_grads(family, leaves, cos, sin, grad_outputs):
    inputs = [t.detach().double().requires_grad_() for t in leaves]
    out = _fp64(family, *inputs, cos, sin)
    return _grads(out, inputs, tuple(g.double() for g in grad_outputs))


def _assert_no_less_accurate(ours, eager, exact):
    """Each gradient at least as close to fp64 as eager autograd's (``reference.error_beyond_bound``, the rule of
    the norm kernels' tests)."""
    for o, e, x in zip(ours, eager, exact):
        assert o.dtype == e.dtype and o.shape == e.shape
        excess = reference.error_beyond_bound(o, e, x)
        assert excess <= 0, (o.shape, (o.double() - x).abs().max().item(), (e.double() - x).abs().max().item())


BACKWARD_SHAPES = {name: SHAPES[name] for name in ("decode", "prefill", "hd96")} | {"partial": (2, 3, 4, 2, 80, 48)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BACKWARD_SHAPES)
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "olmo2", "glm4_moe"])
def test_backward_is_no_less_accurate_than_eager_autograd(name, shape, dtype):
    if name == "glm4_moe" and shape != "partial" or name != "glm4_moe" and shape == "partial":
        pytest.skip("partial rotary is GLM-4-MoE's function's")
    family, leaves, cos, sin, grad_outputs = _backward_case(name, dtype, BACKWARD_SHAPES[shape], seed=31)
    ours = _grads(_ours(family, *leaves, cos, sin), leaves, grad_outputs)
    _assert_no_less_accurate(ours, _eager_grads(family, leaves, cos, sin, grad_outputs),
                             _exact_grads(family, leaves, cos, sin, grad_outputs))


def test_backward_is_deterministic_and_leaves_the_statistics_as_it_found_them():
    """Twice the same gradients, bit for bit, from one forward (retain_graph): the weight gradients' partial sums
    are added in a fixed order, and the counters the backward's programs count on are zero again after each."""
    family, leaves, cos, sin, grad_outputs = _backward_case("qwen3", torch.bfloat16, (2, 9, 4, 2, 64, 64), seed=41)
    out = _ours(family, *leaves, cos, sin)
    first = torch.autograd.grad(out, leaves, grad_outputs, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad_outputs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_programs_share_the_rows_and_sum_their_partials(monkeypatch):
    """The persistent backward with more row blocks than programs (5 of q, one of k: two programs without k rows,
    which write zero partial rows) gives the gradients of one program per row block: the input gradients bitwise
    (a row's maths does not depend on its program), the weight gradients within fp32 summation order; and as
    accurate as eager autograd."""
    from hf_rmsnorm.ops import launch

    family, leaves, cos, sin, grad_outputs = _backward_case("qwen3", torch.bfloat16, (1, 5, 32, 2, 128, 128), seed=47)
    few = _grads(_ours(family, *leaves, cos, sin), leaves, grad_outputs)  # launch.INTERPRET_PROGRAMS: 3
    monkeypatch.setattr(launch, "INTERPRET_PROGRAMS", 1000)
    many = _grads(_ours(family, *leaves, cos, sin), leaves, grad_outputs)
    assert torch.equal(few[0], many[0]) and torch.equal(few[1], many[1])
    for a, b in zip(few[2:], many[2:]):  # fp32 sums in another order, rounded once to bf16: an ulp apart at most
        assert ulp_distance(a, b).max() <= 1
    _assert_no_less_accurate(few, _eager_grads(family, leaves, cos, sin, grad_outputs),
                             _exact_grads(family, leaves, cos, sin, grad_outputs))


def test_backward_with_one_output_unused():
    """Only q's output reaches the loss: k's gradient is zero, its weight's too."""
    family, leaves, cos, sin, grad_outputs = _backward_case("qwen3", torch.float32, (1, 3, 2, 2, 64, 64), seed=43)
    q_out, _ = _ours(family, *leaves, cos, sin)
    dq, dk, dqw, dkw = torch.autograd.grad(q_out, leaves, grad_outputs[0])
    assert not dk.any() and not dkw.any() and dq.any() and dqw.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_launch_without_key_heads_gives_the_queries_of_one_with_keys(dtype):
    """Gemma 3n's and Gemma 4's one-tensor sites launch the queries (or the keys) alone, with no key heads and no
    key weight: the outputs and the gradients of the tensor and its weight are bitwise those of the same tensor
    launched beside keys."""
    family, leaves, cos, sin, grad_outputs = _backward_case("gemma3", dtype, (2, 5, 4, 2, 64, 64), seed=47)
    q, k, q_weight, k_weight = leaves
    q_out, _ = _ours(family, q, k, q_weight, k_weight, cos, sin)
    with_keys = torch.autograd.grad(q_out, (q, q_weight), grad_outputs[0])
    alone, no_keys = qk_norm_rope(q, q[:, :, :0], q_weight, None, cos, sin, EPS, mode=family.mode, per_head=True)
    assert no_keys.shape == (2, 0, 5, 64) and torch.equal(alone, q_out)
    for got, want in zip(torch.autograd.grad(alone, (q, q_weight), grad_outputs[0]), with_keys):
        assert torch.equal(got, want)


def test_gradients_flow_without_weights():
    family, leaves, cos, sin, grad_outputs = _backward_case("qwen3", torch.float32, (1, 2, 2, 1, 64, 64), seed=45)
    q, k = leaves[:2]
    out = qk_norm_rope(q, k, None, None, cos, sin, EPS)
    ours = _grads(out, (q, k), grad_outputs)
    ones = [torch.ones_like(w) for w in leaves[2:]]
    exact = _exact_grads(family, [q, k, *ones], cos, sin, grad_outputs)[:2]
    for o, x in zip(ours, exact):
        assert (o.double() - x).abs().max().item() <= 1e-5 * x.abs().max().item()


# -------------------------------------------------------------------------------- compile, ops, arguments


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_matches_eager(backend):
    family, leaves, cos, sin, grad_outputs = _backward_case("olmo2", torch.bfloat16, (2, 3, 4, 2, 64, 64), seed=51)

    def attention_inputs(q, k, q_weight, k_weight):
        q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS, mode="fp32_affine", per_head=False)
        return q_out * 2, k_out

    compiled = torch.compile(attention_inputs, fullgraph=True, backend=backend)
    eager_out, compiled_out = attention_inputs(*leaves), compiled(*leaves)
    for a, b in zip(compiled_out, eager_out):
        assert torch.equal(a, b)
    for a, b in zip(_grads(compiled_out, leaves, grad_outputs), _grads(eager_out, leaves, grad_outputs)):
        assert torch.equal(a, b)


def test_custom_ops_pass_torch_library_opcheck():
    """Schema, fake implementations and autograd registration of the ops torch.compile sees."""
    family = FAMILIES["qwen3"]
    q, k, q_weight, k_weight, cos, sin = _inputs(family, torch.bfloat16, 1, 3, 2, 1, 64, 64, seed=61,
                                                 weight_dtype=torch.float32)
    args = (q.requires_grad_(), k, q_weight.requires_grad_(), k_weight, cos, sin, EPS, EPS, "llama", True)
    torch.library.opcheck(library.op("qk_norm_rope_fwd"), args)
    q_out, k_out, stats = library.op("qk_norm_rope_fwd")(*args)
    torch.library.opcheck(library.op("qk_norm_rope_bwd"),
                          (torch.randn_like(q_out), torch.randn_like(k_out), q.detach(), k, q_weight.detach(),
                           k_weight, cos, sin, stats.detach(), "llama", True))


def _valid():
    return _inputs(FAMILIES["qwen3"], torch.float32, 1, 3, 4, 2, 64, 64, seed=71)


@pytest.mark.parametrize("change, error", [
    (lambda a: {**a, "q": a["q"].flatten(2)}, r"q has shape \(1, 3, 256\); q must be \[batch, tokens, heads, head_dim\]"),
    (lambda a: {**a, "k": a["k"][:, :2]}, r"k has shape \(1, 2, 2, 64\) but q has shape \(1, 3, 4, 64\)"),
    (lambda a: {**a, "cos": a["cos"][None].expand(3, -1, -1, -1)}, "multimodal RoPE"),
    (lambda a: {**a, "cos": a["cos"][:, :2], "sin": a["sin"][:, :2]}, r"cos must be \[1 or 1, 3, rotary_dim\]"),
    (lambda a: {**a, "sin": a["sin"].double()}, "they must have the same shape and dtype"),
    (lambda a: {**a, "cos": a["cos"][..., :31], "sin": a["sin"][..., :31]}, "the rotary dimension must be even"),
    (lambda a: {**a, "q_weight": a["q_weight"][:32]}, r"q_weight has shape \(32,\); q_weight must be 1-D of head_dim"),
    (lambda a: {**a, "per_head": False}, r"1-D of heads \* head_dim .*: 256"),
    (lambda a: {**a, "mode": "layernorm"}, "centres the rows"),
    (lambda a: {**a, "mode": "t5"}, "rounds to the weight's dtype"),
    (lambda a: {**a, "mode": "olmo"}, "mode 'olmo' is unknown; qk_norm_rope takes the RMSNorm modes: llama, gemma"),
    (lambda a: {**a, "eps": -1.0}, "q_eps is -1.0"),
    (lambda a: {**a, "cos": a["cos"].to("meta")}, "cos is on meta but q is on"),
])
def test_argument_errors_are_one_line(change, error):
    q, k, q_weight, k_weight, cos, sin = _valid()
    arguments = change(dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, eps=EPS, mode="llama",
                            per_head=True))
    with pytest.raises((ValueError, TypeError), match=error) as raised:
        qk_norm_rope(**arguments)
    assert "\n" not in str(raised.value) and str(raised.value).startswith("qk_norm_rope: ")


def test_integer_inputs_are_a_type_error():
    q, k, q_weight, k_weight, cos, sin = _valid()
    with pytest.raises(TypeError, match="k has dtype torch.int64"):
        qk_norm_rope(q, k.long(), q_weight, k_weight, cos, sin)


def test_rows_wider_than_a_tile_are_refused():
    width = qk_launch.QK_MAX_ROW_ELEMENTS // 128 * 2  # heads of 128 past the widest tile
    q = torch.zeros(1, 1, width, 128, device=DEVICE)
    cos = torch.zeros(1, 1, 128, device=DEVICE)
    with pytest.raises(ValueError, match="above their 8192; apply the norms and the RoPE apart"):
        qk_norm_rope(q, q, None, None, cos, cos, per_head=False)


def test_cos_requiring_a_gradient_is_refused():
    q, k, q_weight, k_weight, cos, sin = _valid()
    with pytest.raises(ValueError, match="cos or sin requires a gradient"):
        qk_norm_rope(q, k, q_weight, k_weight, cos.requires_grad_(), sin)


def test_dtensors_are_refused(mesh):
    from torch.distributed.tensor import DTensor, Replicate

    q, k, q_weight, k_weight, cos, sin = _valid()
    dq = DTensor.from_local(q, mesh, [Replicate()])
    with pytest.raises(ValueError, match="DTensor arguments are not supported"):
        qk_norm_rope(dq, k, q_weight, k_weight, cos, sin)


def test_backward_op_checks_its_statistics():
    q, k, q_weight, k_weight, cos, sin = _valid()
    with pytest.raises(ValueError, match=r"qk_norm_rope_bwd: stats has shape \(5,\) but the forward saves \(22,\)"):
        library.op("qk_norm_rope_bwd")(q, k, q, k, q_weight, k_weight, cos, sin, torch.zeros(5), "llama", True)


def test_no_tokens():
    family = FAMILIES["qwen3"]
    q, k, q_weight, k_weight, cos, sin = _inputs(family, torch.float32, 2, 0, 4, 2, 64, 64, seed=81)
    q, k, q_weight, k_weight = (t.detach().clone().requires_grad_() for t in (q, k, q_weight, k_weight))
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin)
    assert q_out.shape == (2, 4, 0, 64)
    dq, dk, dqw, dkw = torch.autograd.grad((q_out, k_out), (q, k, q_weight, k_weight),
                                           (torch.ones_like(q_out), torch.ones_like(k_out)))
    assert dq.shape == q.shape and not dqw.any() and not dkw.any()


# ------------------------------------------------------------------ the compiled GPU path and the offline build


@pytest.fixture(scope="module")
def traced() -> dict:
    result = subprocess.run([sys.executable, str(TESTS / "trace_qk_ops.py")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_compiled_calls_on_a_gpu_trace_into_the_kernel_launch(traced):
    """On fake CUDA tensors the graphs inductor gets hold the kernel launches, no custom op: torch's analysis finds
    that each kernel writes its outputs and nothing else (an input it thought written would be cloned and copied
    back); the backward counts on fresh zeros (SYNC), never on the statistics, an input of its graph; the rows
    stay symbolic under dynamic shapes (one graph for every token count)."""
    cases = traced["cases"]
    for name in ("qwen3", "olmo2_dynamic", "weightless"):
        hop, = cases[name]["hops"]
        assert (hop["kernel"], hop["writes"]) == ("qk_norm_rope_fwd_kernel", ["KOUT", "QOUT", "STATS"])
        assert cases[name]["outputs"] == ["aten.transpose.int"] * 2
        assert not [op for op in cases[name]["ops"] if "hf_rmsnorm" in op]
    assert cases["weightless"]["hops"][0]["none"] == ["KW", "QW"]
    assert {"q_rows", "k_rows", "tokens"} <= set(cases["olmo2_dynamic"]["hops"][0]["symbolic"])
    hop, = cases["qwen3_backward"]["hops"]
    assert hop["kernel"] == "qk_norm_rope_bwd_kernel"
    assert hop["writes"] == ["DK", "DKW", "DKW_PARTIAL", "DQ", "DQW", "DQW_PARTIAL", "SYNC"]
    assert cases["qwen3_backward"]["outputs"] == [f"qk_norm_rope_bwd_kernel:{name}" for name in ("DQ", "DK", "DQW",
                                                                                                   "DKW")]
    # torch finds each Triton op's kernel (its compile caches key on it) by reading the op's code.
    assert traced["kernels_of_ops"] == {"qk_norm_rope_fwd_triton": ["qk_norm_rope_fwd_kernel"],
                                        "qk_norm_rope_bwd_triton": ["qk_norm_rope_bwd_kernel"]}


@pytest.mark.parametrize("variant", ["qk-fwd", "qk-infer", "qk-bwd", "qk-whole-bwd", "qk-rope-first-bwd"])
def test_the_launch_constants_do_not_depend_on_the_token_count(variant):
    """Batch invariance on a GPU: qk_launch.py's host code (captured on meta tensors) passes the same constexprs and
    warps at every token count, and the kernels do not specialise on it (kernels.ROW_COUNT_ARGS)."""
    launches = {rows: kernel_inspect.capture_qk_launch(variant, torch.bfloat16, 128 if "whole" not in variant else 4096,
                                                       rows, "llama")
                for rows in (1, 2, 16, 17, 4095)}
    assert len({repr((kernel, kwargs)) for kernel, _, kwargs in launches.values()}) == 1
    assert {"q_rows", "k_rows", "tokens"} <= set(unspecialised_args(launches[1][0].fn))


@pytest.mark.skipif(kernel_inspect.unavailable_reason() is not None, reason=str(kernel_inspect.unavailable_reason()))
def test_offline_build_spills_within_the_budget_with_128_bit_loads(tmp_path):
    """Compiled for sm_90 (scripts/inspect_kernels.py, in a process of its own: here the kernels are interpreted)."""
    out = tmp_path / "inspect.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "inspect_kernels.py"), "--arch", "sm_90", "--hidden", "80",
                           "4096", "--dtype", "bf16", "--variant", "qk-fwd", "qk-bwd", "qk-whole-bwd",
                           "qk-rope-first-fwd", "qk-rope-first-bwd", "--strict",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    # Heads of 80 and of 4096 (one head a row); projections of 32 heads of 128 (none of 80: no whole heads).
    assert {(r["kernel"], r["variant"], r["hidden"]) for r in records} == {
        ("qk_norm_rope_fwd_kernel", "qk-fwd", 80), ("qk_norm_rope_bwd_kernel", "qk-bwd", 80),
        ("qk_norm_rope_fwd_kernel", "qk-fwd", 4096), ("qk_norm_rope_bwd_kernel", "qk-bwd", 4096),
        ("qk_norm_rope_bwd_kernel", "qk-whole-bwd", 4096), ("qk_norm_rope_fwd_kernel", "qk-rope-first-fwd", 80),
        ("qk_norm_rope_bwd_kernel", "qk-rope-first-bwd", 80), ("qk_norm_rope_fwd_kernel", "qk-rope-first-fwd", 4096),
        ("qk_norm_rope_bwd_kernel", "qk-rope-first-bwd", 4096)}
    for r in records:
        assert r["spill_bytes"] <= kernel_inspect.MAX_SPILL_BYTES and r["vector_bits"] == 128, r


def test_equal_launch_keys_mean_equal_triton_specialisations(monkeypatch):
    """The cached launcher's key by plan (``QKForwardLaunch``), over calls differing in token and batch counts,
    strides (a fused projection's view, contiguous tensors), alignment and cos's batch: whenever two calls get the
    same key, Triton's own binder specialises them identically, so a cached kernel is the one Triton would pick."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from hf_rmsnorm.ops import backend, launch
    from hf_rmsnorm.ops.qk_kernels import qk_norm_rope_fwd_kernel

    if not backend.triton_at_least(3, 5):
        pytest.skip("before Triton 3.5 the binder differs and the cached launch path is off")
    kernel = JITFunction(qk_norm_rope_fwd_kernel.fn, do_not_specialize=unspecialised_args(qk_norm_rope_fwd_kernel.fn))
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    launches = []
    monkeypatch.setattr(launch, "_launch", lambda *args: launches.append(args))
    family = FAMILIES["qwen3"]
    seen: dict[tuple, str] = {}
    unaligned = False
    # head_dim 72: strides that are not multiples of 16 elements (which Triton notes), cos's too at 17 tokens.
    for batch, tokens, head_dim, fused, offset, cos_batch in [
        (b, t, d, f, o, c) for b in (1, 3) for t in (1, 16, 17) for d in (64, 72) for f in (True, False)
        for o in (0, 1, 8) for c in (1, b)
    ]:
        q, k, q_weight, k_weight, cos, sin = _inputs(family, torch.bfloat16, batch, tokens, 4, 2, head_dim, head_dim,
                                                     seed=3, cos_batch=cos_batch)
        if not fused:
            q, k = q.contiguous(), k.contiguous()
        if offset:  # 8 elements (16 bytes) into a buffer: aligned elsewhere; 1 element in: unaligned
            q = torch.empty(q.numel() + offset, dtype=q.dtype)[offset:].view(q.shape)
        with torch.no_grad():
            qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS)
        _, _, args, constexprs, _, plan, varying = launches.pop()
        if plan is None:
            unaligned = True  # unaligned pointers take the key by arguments
            continue
        spec = repr(binder(*args, **constexprs)[1])
        assert seen.setdefault((id(plan), varying), spec) == spec
    assert len(seen) > 1 and len(set(seen.values())) > 1 and unaligned


@pytest.mark.parametrize("variant", ["qk-infer", "qk-fwd", "qk-bwd"])
def test_the_kernels_move_the_minimum_bytes(variant):
    """Counted in the interpreter (harness/byte_traffic.py): each element of q and k is read once and written once
    (forward), the gradient, the input and the input gradient once each (backward); a token's cos and sin, read by
    each of its heads, come from the caches. Only the per-row fp32 rstd is over the minimum."""
    if not kernels_interpreted():
        pytest.skip("counts the interpreter's accesses")
    record = byte_traffic.measure_variant(variant, 128, "bf16")
    assert record.per_row_ratio <= 1.01, record
    assert record.kernels == ["qk_norm_rope_bwd_kernel" if variant == "qk-bwd" else "qk_norm_rope_fwd_kernel"]
