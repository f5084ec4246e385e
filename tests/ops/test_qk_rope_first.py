"""The RoPE before the q/k norms (``hf_rmsnorm.ops.qk_rope_norm``, the op's ``rope_first``) and the rotation by the
opposite angle (``negate_sin``) against the transformers functions themselves (NanoChat's and HunYuan's
``apply_rotary_pos_emb`` and norm modules, and the other families' norms composed after a RoPE) and against fp64
maths, forward and backward, in Triton's interpreter on the CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense
from transformers.models.nanochat import modeling_nanochat
from transformers.models.olmo2 import modeling_olmo2

from hf_rmsnorm import qk_norm_rope, qk_rope_norm
from hf_rmsnorm.ops import library, qk_launch, reference
from hf_rmsnorm.ops.backend import kernels_interpreted

pytestmark = pytest.mark.skipif(
    not kernels_interpreted() and not torch.cuda.is_available(), reason="kernels need a GPU or Triton's interpreter"
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-6


@dataclass(frozen=True)
class Order:
    """An attention that rotates its heads, then normalises them: its RoPE function and norm module (None: a norm
    without weight, NanoChat's), the norm's casting mode, whether a row is a head, and the kernel's angle."""

    rope: Callable
    norm: type | None
    mode: str
    per_head: bool = True
    negate_sin: bool = False
    weight_centre: float = 1.0


ORDERS = {
    # The two families of this order in transformers: NanoChat (no weight, the opposite angle) and HunYuan.
    "nanochat": Order(modeling_nanochat.apply_rotary_pos_emb, None, "llama", negate_sin=True),
    "hunyuan": Order(modeling_hunyuan_v1_dense.apply_rotary_pos_emb, modeling_hunyuan_v1_dense.HunYuanDenseV1RMSNorm,
                     "llama"),
    # The other casting modes, layouts and partial rotary, composed of real modules in this order.
    "gemma": Order(modeling_gemma3.apply_rotary_pos_emb, modeling_gemma3.Gemma3RMSNorm, "gemma", weight_centre=0.0),
    "olmo2_whole": Order(modeling_olmo2.apply_rotary_pos_emb, modeling_olmo2.Olmo2RMSNorm, "fp32_affine",
                         per_head=False),
    "glm4_partial": Order(modeling_glm4_moe.apply_rotary_pos_emb, modeling_glm4_moe.Glm4MoeRMSNorm, "llama"),
}


def _randn(*shape, dtype=torch.float32, scale=1.0, centre=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + centre).to(device=DEVICE, dtype=dtype)


def _inputs(order, dtype, batch, tokens, q_heads, k_heads, head_dim, rotary_dim, seed, cos_dtype=None):
    """q and k as views of one projection's output (strided), trained-like weights (None without a norm weight),
    random cos/sin (in ``cos_dtype``, the model dtype by default)."""
    fused = _randn(batch, tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype, scale=2.0, seed=seed)
    q = fused[..., : q_heads * head_dim].view(batch, tokens, q_heads, head_dim)
    k = fused[..., q_heads * head_dim: (q_heads + k_heads) * head_dim].view(batch, tokens, k_heads, head_dim)
    q_width, k_width = (head_dim, head_dim) if order.per_head else (q_heads * head_dim, k_heads * head_dim)
    weights = [None, None] if order.norm is None else [
        _randn(width, dtype=dtype, scale=0.3, centre=order.weight_centre, seed=seed + i)
        for i, width in ((1, q_width), (2, k_width))]
    cos = _randn(batch, tokens, rotary_dim, dtype=cos_dtype or dtype, seed=seed + 3)
    sin = _randn(batch, tokens, rotary_dim, dtype=cos_dtype or dtype, seed=seed + 4)
    return q, k, *weights, cos, sin


def _norm_module(order, weight):
    if order.norm is None:
        return modeling_nanochat.NanoChatRMSNorm(eps=EPS)
    module = order.norm(weight.shape[0], eps=EPS).to(device=DEVICE, dtype=weight.dtype)
    module.weight.data.copy_(weight)
    return module


def _eager(order, q, k, q_weight, k_weight, cos, sin):
    """The family's functions: its RoPE on ``[batch, heads, tokens, head_dim]``, then its norm modules."""
    q_norm, k_norm = _norm_module(order, q_weight), _norm_module(order, k_weight)
    q_rot, k_rot = order.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    if order.per_head:
        return q_norm(q_rot), k_norm(k_rot)
    return tuple(norm(x.transpose(1, 2).flatten(2)).view(x.transpose(1, 2).shape).transpose(1, 2)
                 for norm, x in ((q_norm, q_rot), (k_norm, k_rot)))


def _fp64(order, q, k, q_weight, k_weight, cos, sin):
    """The exact maths in fp64."""
    def one(x, w):
        x = x.double()
        r = cos.shape[-1]
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2) * (-1 if order.negate_sin else 1)
        x = torch.cat([x[..., :r] * c + reference.rotate_half(x[..., :r]) * s, x[..., r:]], dim=-1)
        rows = x if order.per_head else x.reshape(*x.shape[:2], -1)
        n = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + EPS)
        if w is not None:
            n = n * (w.double() + (1.0 if order.mode == "gemma" else 0.0))
        return n.view(x.shape).transpose(1, 2)
    return one(q, q_weight), one(k, k_weight)


def _ours(order, q, k, q_weight, k_weight, cos, sin):
    return qk_rope_norm(q, k, q_weight, k_weight, cos, sin, EPS, mode=order.mode, per_head=order.per_head,
                        negate_sin=order.negate_sin)


def _rotated_rstd(order, q, k, cos, sin):
    """Eager's fp32 ``rstd`` of each norm row of the rotated q and k, as the kernel lays them out."""
    rstd = []
    for x in (q, k):
        rotated = order.rope(x.transpose(1, 2), x.transpose(1, 2), cos, sin)[0].transpose(1, 2)
        rows = rotated if order.per_head else rotated.reshape(*rotated.shape[:2], -1)
        rstd.append(torch.rsqrt(rows.float().pow(2).mean(-1) + EPS).reshape(-1))
    return torch.cat(rstd)


def _assert_matches_eager(order, args, ours, eager):
    """Of eager's dtype and layout; never less accurate than eager against fp64; bitwise equal to eager wherever
    the kernel's fp32 ``rstd`` is eager's (all rows, or the comparison is of the rows that do)."""
    _, _, stats = library.op("qk_norm_rope_fwd")(*args, EPS, EPS, order.mode, order.per_head, True, order.negate_sin)
    same_rows = stats[qk_launch.STATS_SYNC_SLOTS:] == _rotated_rstd(order, args[0], args[1], args[4], args[5])
    assert same_rows.float().mean() >= 0.5  # the bitwise comparison below is not vacuous
    q_rows = same_rows[: qk_launch.qk_rows(args[0], order.per_head)]
    for o, e, x, t, agree in zip(ours, eager, _fp64(order, *args), args[:2],
                                 (q_rows, same_rows[q_rows.numel():])):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert reference.error_beyond_bound(o, e, x) <= 0
        mask = agree.view(t.shape[:3] if order.per_head else t.shape[:2])
        mask = (mask if order.per_head else mask[..., None]).transpose(1, 2)[..., None].expand(o.shape)
        assert torch.equal(o[mask], e[mask])


# (batch, tokens, q heads, k heads, head_dim, rotary_dim)
SHAPES = {"decode": (1, 1, 8, 2, 128, 128), "prefill": (2, 5, 4, 2, 64, 64), "hd96": (1, 4, 4, 4, 96, 96)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["nanochat", "hunyuan", "gemma", "olmo2_whole"])
def test_forward_matches_the_families_own_functions(name, shape, dtype):
    order = ORDERS[name]
    args = _inputs(order, dtype, *SHAPES[shape], seed=len(shape) + 3)
    _assert_matches_eager(order, args, _ours(order, *args), _eager(order, *args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (80, 48)])
def test_partial_rotary_normalises_the_passed_columns_with_the_rotated(head_dim, rotary_dim, dtype):
    order = ORDERS["glm4_partial"]
    args = _inputs(order, dtype, 2, 3, 4, 2, head_dim, rotary_dim, seed=head_dim)
    _assert_matches_eager(order, args, _ours(order, *args), _eager(order, *args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_tables_rotate_in_fp32_and_the_norm_reads_fp32(dtype):
    """Half-precision heads with fp32 cos/sin: eager's RoPE promotes to fp32, and the norm reads fp32 rows
    (``ROPE_IN_COS_DTYPE``)."""
    order = ORDERS["hunyuan"]
    args = _inputs(order, dtype, 2, 3, 4, 2, 64, 64, seed=5, cos_dtype=torch.float32)
    ours, eager = _ours(order, *args), _eager(order, *args)
    assert ours[0].dtype == eager[0].dtype == torch.float32  # HunYuan's weight (half) times fp32 rows
    _assert_matches_eager(order, args, ours, eager)


def test_the_opposite_angle_is_the_usual_one_with_sin_negated():
    """``negate_sin`` computes bit for bit what the usual angle computes from ``-sin`` (negation is exact), in
    either order."""
    order = ORDERS["hunyuan"]
    q, k, q_weight, k_weight, cos, sin = _inputs(order, torch.bfloat16, 2, 5, 4, 2, 64, 64, seed=8)
    for function in (qk_norm_rope, qk_rope_norm):
        opposite = function(q, k, q_weight, k_weight, cos, sin, EPS, negate_sin=True)
        usual = function(q, k, q_weight, k_weight, cos, -sin, EPS)
        assert all(torch.equal(a, b) for a, b in zip(opposite, usual))


def test_fp64_runs_the_pytorch_implementation_as_eager_computes():
    order = ORDERS["nanochat"]
    args = _inputs(order, torch.float64, 2, 3, 4, 2, 64, 64, seed=9)
    for o, e in zip(_ours(order, *args), _eager(order, *args)):
        assert o.dtype == torch.float64 and torch.equal(o, e)


# --------------------------------------------------------------------------------------------------- backward


def _leaves(args):
    return [None if t is None else t.detach().clone().requires_grad_() for t in args[:4]]


def _grads(outputs, leaves, grad_outputs):
    present = [t for t in leaves if t is not None]
    return torch.autograd.grad(outputs, present, grad_outputs)


def _eager_grads(order, leaves, cos, sin, grad_outputs):
    inputs = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    q_norm, k_norm = (_norm_module(order, None if w is None else w.detach()) for w in inputs[2:])
    q_rot, k_rot = order.rope(inputs[0].transpose(1, 2), inputs[1].transpose(1, 2), cos, sin)
    out = (q_norm(q_rot), k_norm(k_rot))
    weights = [] if order.norm is None else [q_norm.weight, k_norm.weight]
    return torch.autograd.grad(out, [inputs[0], inputs[1], *weights], grad_outputs)


def _exact_grads(order, leaves, cos, sin, grad_outputs):
    inputs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    out = _fp64(order, *inputs, cos, sin)
    return _grads(out, inputs, tuple(g.double() for g in grad_outputs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["nanochat", "hunyuan", "gemma"])
def test_backward_is_no_less_accurate_than_eager_autograd(name, dtype):
    """Each gradient at least as close to fp64 as eager autograd's (``reference.error_beyond_bound``)."""
    order = ORDERS[name]
    args = _inputs(order, dtype, 2, 3, 4, 2, 64, 64, seed=31)
    leaves = _leaves(args)
    grad_outputs = (_randn(2, 4, 3, 64, dtype=dtype, seed=51), _randn(2, 2, 3, 64, dtype=dtype, seed=52))
    ours = _grads(_ours(order, *leaves, *args[4:]), leaves, grad_outputs)
    eager = _eager_grads(order, leaves, *args[4:], grad_outputs)
    for o, e, x in zip(ours, eager, _exact_grads(order, leaves, *args[4:], grad_outputs)):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert reference.error_beyond_bound(o, e, x) <= 0


def test_backward_is_deterministic_and_the_kernels_give_the_references_gradients():
    """Twice the same gradients from one forward; the PyTorch implementation's within the rounding of its fp32
    sums (the kernels add their weight-gradient partials in another order)."""
    order = ORDERS["hunyuan"]
    args = _inputs(order, torch.float32, 2, 9, 4, 2, 64, 48, seed=41)
    leaves = _leaves(args)
    grad_outputs = (_randn(2, 4, 9, 64, seed=53), _randn(2, 2, 9, 64, seed=54))
    out = _ours(order, *leaves, *args[4:])
    first = torch.autograd.grad(out, leaves, grad_outputs, retain_graph=True)
    second = torch.autograd.grad(out, leaves, grad_outputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    _, _, stats = library.op("qk_norm_rope_fwd")(*args, EPS, EPS, "llama", True, True, False)
    expected = reference.qk_norm_rope_backward_reference(*(g.transpose(1, 2) for g in grad_outputs), *args, stats,
                                                         "llama", True, True)
    for got, want in zip(first, expected):
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_torch_compile_fullgraph_matches_eager():
    order = ORDERS["nanochat"]
    args = _inputs(order, torch.bfloat16, 1, 3, 2, 1, 64, 64, seed=61)
    leaves = _leaves(args)
    grad_outputs = (_randn(1, 2, 3, 64, dtype=torch.bfloat16, seed=62), _randn(1, 1, 3, 64, dtype=torch.bfloat16,
                                                                                seed=63))

    def run(q, k, cos, sin):
        return qk_rope_norm(q, k, None, None, cos, sin, EPS, negate_sin=True)

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    got, want = compiled(leaves[0], leaves[1], *args[4:]), run(leaves[0], leaves[1], *args[4:])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for a, b in zip(_grads(got, leaves, grad_outputs), _grads(want, leaves, grad_outputs)):
        assert torch.equal(a, b)


def test_custom_ops_pass_torch_library_opcheck():
    """Schema, fake implementations and autograd registration with the order and angle arguments."""
    order = ORDERS["hunyuan"]
    q, k, q_weight, k_weight, cos, sin = _inputs(order, torch.bfloat16, 1, 3, 2, 1, 64, 64, seed=71)
    args = (q.requires_grad_(), k, q_weight.requires_grad_(), k_weight, cos, sin, EPS, EPS, "llama", True, True, True)
    torch.library.opcheck(library.op("qk_norm_rope_fwd"), args)
    q_out, k_out, stats = library.op("qk_norm_rope_fwd")(*args)
    torch.library.opcheck(library.op("qk_norm_rope_bwd"),
                          (torch.randn_like(q_out), torch.randn_like(k_out), q.detach(), k, q_weight.detach(),
                           k_weight, cos, sin, stats.detach(), "llama", True, True, True))


def test_a_rope_dtype_the_kernels_cannot_hold_is_refused():
    """bf16 q with fp16 tables would rotate in fp32 while k (fp16) rotates in fp16: one line naming the fix."""
    order = ORDERS["hunyuan"]
    q, k, q_weight, k_weight, cos, sin = _inputs(order, torch.bfloat16, 1, 3, 2, 1, 64, 64, seed=72)
    with pytest.raises(ValueError, match=r"^qk_rope_norm: q is torch.bfloat16, k torch.float16 and cos "
                                         r"torch.float16: .* \(cast cos to q's dtype") as raised:
        qk_rope_norm(q, k.half(), None, None, cos.half(), sin.half())
    assert "\n" not in str(raised.value)
