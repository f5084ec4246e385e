"""The Triton kernels (run in Triton's interpreter on CPU) against fp64 maths and Hugging Face's own modules."""

import math
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from hf_rmsnorm import fused_add_layer_norm, fused_add_rms_norm, rms_norm, rms_norm_add
from hf_rmsnorm.ops import backend, launch, library, reference
from hf_rmsnorm.ops.functional import fused_add_norm, norm, norm_add
from hf_rmsnorm.ops.modes import MODES
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.tools.norm_outputs import ulp_distance

pytestmark = pytest.mark.skipif(
    not kernels_interpreted() and not torch.cuda.is_available(), reason="kernels need a GPU or Triton's interpreter"
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDTHS = [1, 7, 127, 896, 4097, 20000]
EPS = 1e-6


def _rows_for(n_cols: int) -> int:
    # Enough rows for several programs and a ragged last row block, few enough for the interpreter.
    return 2 if n_cols > 4096 else 13


def _randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _fp64_reference(x, residual, weight, bias=None, mode="llama"):
    """Exact maths in fp64, ignoring every intermediate rounding."""
    s = x.double() if residual is None else residual.double() + x.double()
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    w = weight.double() + (1.0 if mode == "gemma" else 0.0)
    y = n * w
    return y if bias is None else y + bias.double()


def _hf_module(cls, weight):
    module = cls(weight.shape[0], eps=EPS).to(device=DEVICE, dtype=weight.dtype)
    module.weight.data.copy_(weight)
    return module


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs)


def _assert_no_less_accurate(ours, hf, exact):
    """Each of our gradients is at least as close to the fp64 truth as Hugging Face's eager autograd, up to
    one ulp of its dtype at the largest gradient (``reference.error_beyond_bound``, which the tuner applies too)."""
    for g_ours, g_hf, g_exact in zip(ours, hf, exact):
        assert g_ours.dtype == g_hf.dtype and g_ours.shape == g_hf.shape
        excess = reference.error_beyond_bound(g_ours, g_hf, g_exact)
        assert excess <= 0, (g_ours.shape, _max_err(g_ours, g_exact), _max_err(g_hf, g_exact), excess)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", WIDTHS)
def test_fused_add_forward_matches_hf_llama_bitwise(dtype, n_cols):
    m = _rows_for(n_cols)
    x, r = _randn(m, n_cols, dtype=dtype, seed=1), _randn(m, n_cols, dtype=dtype, scale=4, seed=2)
    weight = _randn(n_cols, dtype=dtype, seed=3)
    y, new_residual = fused_add_rms_norm(x, r, weight, EPS)

    hf_sum = r + x
    hf_y = _hf_module(LlamaRMSNorm, weight)(hf_sum)
    assert new_residual.dtype == hf_sum.dtype and y.dtype == hf_y.dtype
    assert torch.equal(new_residual, hf_sum)
    if dtype == torch.float32:
        # fp32: only the order of the mean's summation differs from torch's.
        torch.testing.assert_close(y, hf_y, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(y, hf_y)
    assert _max_err(y, _fp64_reference(x, r, weight)) <= _max_err(hf_y, _fp64_reference(x, r, weight)) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", WIDTHS)
def test_backward_is_no_less_accurate_than_hf(dtype, n_cols):
    m = _rows_for(n_cols)
    x = _randn(m, n_cols, dtype=dtype, seed=4).requires_grad_()
    r = _randn(m, n_cols, dtype=dtype, scale=3, seed=5).requires_grad_()
    weight = _randn(n_cols, dtype=dtype, seed=6).requires_grad_()
    dy, dsum = _randn(m, n_cols, dtype=dtype, seed=7), _randn(m, n_cols, dtype=dtype, seed=8)
    dy_before, dsum_before = dy.clone(), dsum.clone()

    ours = _grads(fused_add_rms_norm(x, r, weight, EPS), (x, r, weight), (dy, dsum))
    # The backward must never write into the incoming gradient buffers.
    assert torch.equal(dy, dy_before) and torch.equal(dsum, dsum_before)

    module = _hf_module(LlamaRMSNorm, weight.detach())
    hf_sum = r + x
    hf = _grads((module(hf_sum), hf_sum), (x, r, module.weight), (dy, dsum))

    inputs64 = [t.detach().double().requires_grad_() for t in (x, r, weight)]
    s64 = inputs64[1] + inputs64[0]
    exact = _grads((_fp64_reference(inputs64[0], inputs64[1], inputs64[2]), s64), inputs64, (dy.double(), dsum.double()))

    _assert_no_less_accurate(ours, hf, exact)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_matches_hf_llama(dtype):
    x = _randn(3, 5, 96, dtype=dtype, seed=9)  # 3-D input
    weight = _randn(96, dtype=dtype, seed=10)
    y = rms_norm(x, weight, EPS)
    hf_y = _hf_module(LlamaRMSNorm, weight)(x)
    assert y.shape == x.shape and y.dtype == hf_y.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, hf_y, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(y, hf_y)


def test_qwen3_style_4d_head_norm():
    """q_norm / k_norm run over head_dim on [batch, seq, heads, head_dim] views of a projection."""
    proj = _randn(2, 5, 6 * 32, dtype=torch.bfloat16, seed=11).requires_grad_()
    weight = _randn(32, dtype=torch.bfloat16, seed=12).requires_grad_()
    q = proj.view(2, 5, 6, 32)
    module = _hf_module(LlamaRMSNorm, weight.detach())
    assert torch.equal(rms_norm(q, weight, EPS), module(q))
    dy = _randn(2, 5, 6, 32, dtype=torch.bfloat16, seed=13)
    (d_ours,) = _grads(rms_norm(q, weight, EPS), (proj,), (dy,))
    (d_hf,) = _grads(module(q), (proj,), (dy,))
    torch.testing.assert_close(d_ours, d_hf, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n_cols", [96, 20000])
def test_strided_rows_and_non_collapsible_views(n_cols):
    base = _randn(4, n_cols + 40, dtype=torch.bfloat16, seed=14)
    x = base[:, 8:8 + n_cols]  # row stride != n_cols
    r = _randn(4, n_cols, dtype=torch.bfloat16, seed=15).t().contiguous().t()  # column-major: copied
    weight = _randn(n_cols, dtype=torch.bfloat16, seed=16)
    y, s = fused_add_rms_norm(x, r, weight, EPS)
    assert torch.equal(s, r + x)
    # Strides change nothing: the same rows laid out contiguously give the same bits.
    y_contiguous, _ = fused_add_rms_norm(x.contiguous(), r.contiguous(), weight, EPS)
    assert torch.equal(y, y_contiguous)
    _assert_within_a_rounding_of_eager(y, _hf_module(LlamaRMSNorm, weight)(r + x))

    x3 = _randn(5, 3, n_cols, dtype=torch.float16, seed=17).transpose(0, 1)  # [3, 5, n] not viewable as rows
    w16 = weight.to(torch.float16)
    y3 = rms_norm(x3, w16, EPS)
    assert torch.equal(y3, rms_norm(x3.contiguous(), w16, EPS))
    _assert_within_a_rounding_of_eager(y3, _hf_module(LlamaRMSNorm, w16)(x3))


def _assert_within_a_rounding_of_eager(ours, eager):
    """Equal to Hugging Face's module but for rare outputs at most two ulps away: a wide row's sum of squares is
    reduced in another order than torch's, an rstd one fp32 ulp away can round a normalised value to the
    neighbouring half-precision number, and the weight (|w| < 2 ulps of the output per ulp of the normalised
    value) carries that to the output. Seen on an H200: 6 of 300000 fp16 outputs at width 20000."""
    distance = ulp_distance(ours, eager.detach())
    assert distance.max().item() <= 2
    assert (distance > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize(
    "x_dtype,res_dtype,w_dtype",
    [
        (torch.bfloat16, torch.float32, torch.float32),  # DDP + autocast: fp32 residual stream
        (torch.bfloat16, torch.bfloat16, torch.float32),  # norms kept in fp32 (PEFT k-bit training)
        (torch.float16, torch.bfloat16, torch.bfloat16),  # promotes to fp32
        (torch.float32, torch.bfloat16, torch.bfloat16),
    ],
)
def test_mixed_dtypes_follow_torch_promotion(x_dtype, res_dtype, w_dtype):
    x = _randn(6, 200, dtype=x_dtype, seed=18).requires_grad_()
    r = _randn(6, 200, dtype=res_dtype, seed=19).requires_grad_()
    weight = _randn(200, dtype=w_dtype, seed=20).requires_grad_()
    y, s = fused_add_rms_norm(x, r, weight, EPS)
    hf_sum = r + x
    hf_y = _hf_module(LlamaRMSNorm, weight.detach())(hf_sum)
    assert s.dtype == hf_sum.dtype and y.dtype == hf_y.dtype
    assert torch.equal(s, hf_sum)
    torch.testing.assert_close(y, hf_y, rtol=2e-6, atol=2e-6)

    dy = _randn(6, 200, dtype=y.dtype, seed=21)
    ours = _grads(y, (x, r, weight), (dy,))
    assert [g.dtype for g in ours] == [x_dtype, res_dtype, w_dtype]
    module = _hf_module(LlamaRMSNorm, weight.detach())
    hf = _grads(module(r + x), (x, r, module.weight), (dy,))
    inputs64 = [t.detach().double().requires_grad_() for t in (x, r, weight)]
    exact = _grads(_fp64_reference(*inputs64), inputs64, (dy.double(),))
    _assert_no_less_accurate(ours, hf, exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode,hf_class", [("gemma", GemmaRMSNorm), ("fp32_affine", Olmo2RMSNorm)])
def test_other_casting_orders_match_their_hf_modules(mode, hf_class, dtype):
    x = _randn(7, 160, dtype=dtype, seed=22)
    weight = _randn(160, dtype=dtype, scale=0.5, seed=23)
    module = _hf_module(hf_class, weight)
    y = rms_norm(x, weight, EPS, mode=mode)
    hf_y = module(x)
    assert y.dtype == hf_y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, hf_y, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(y, hf_y)

    x = x.detach().requires_grad_()
    dy = _randn(7, 160, dtype=dtype, seed=24)
    ours = _grads(rms_norm(x, module.weight, EPS, mode=mode), (x, module.weight), (dy,))
    hf = _grads(module(x), (x, module.weight), (dy,))
    for a, b in zip(ours, hf):
        torch.testing.assert_close(a, b, rtol=3e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("n_cols", [64, 20000])
def test_bias_on_a_zero_mean_stream_equals_layer_norm(n_cols):
    """The fp32_affine mode with a bias is LayerNorm once the input has zero mean (the LayerNorm conversion)."""
    h = _randn(5, n_cols, dtype=torch.float64, seed=25)
    h = (h - h.mean(-1, keepdim=True)).float().requires_grad_()
    weight = _randn(n_cols, seed=26).requires_grad_()
    bias = _randn(n_cols, seed=27).requires_grad_()
    y = rms_norm(h, weight, EPS, bias=bias, mode="fp32_affine")
    ln = torch.nn.functional.layer_norm(h.double(), (n_cols,), weight.double(), bias.double(), EPS)
    assert _max_err(y, ln) < 1e-5

    dy = _randn(5, n_cols, seed=28)
    ours = _grads(y, (h, weight, bias), (dy,))
    inputs64 = [t.detach().double().requires_grad_() for t in (h, weight, bias)]
    exact = _grads(_fp64_reference(inputs64[0], None, inputs64[1], inputs64[2], "fp32_affine"), inputs64, (dy.double(),))
    for a, b in zip(ours, exact):
        assert _max_err(a, b) <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_pytorch_fallback_has_the_kernels_semantics(mode, dtype):
    """reference.py is what runs where the kernels do not (CPU without the interpreter, fp64): the same modes
    table drives it, so it returns the kernels' dtypes and sums bitwise and their outputs and gradients up to
    the reduction order (an ulp of the output dtype)."""
    x, r = _randn(9, 96, dtype=dtype, seed=40), _randn(9, 96, dtype=dtype, seed=41) + 0.5
    weight, bias = _randn(96, dtype=dtype, scale=0.5, seed=42), _randn(96, dtype=dtype, seed=43)
    x, r, weight, bias = (t.requires_grad_() for t in (x, r, weight, bias))
    y, s = fused_add_norm(x, r, weight, EPS, bias=bias, mode=mode)
    y_ref, s_ref, stats = reference.forward_reference(x.detach(), r.detach(), weight.detach(), bias.detach(), EPS,
                                                      mode)
    assert torch.equal(s, s_ref) and y.dtype == y_ref.dtype
    assert _max_err(y, y_ref) <= torch.finfo(y.dtype).eps * y_ref.abs().max().item()

    dy, dsum = _randn(9, 96, dtype=y.dtype, seed=44), _randn(9, 96, dtype=dtype, seed=45)
    dx, dr, dw, db = _grads((y, s), (x, r, weight, bias), (dy, dsum))
    dx_ref, dw_ref, db_ref = reference.backward_reference(dy, dsum, s_ref, stats, weight.detach(), True, mode)
    assert torch.equal(dx, dr)
    for ours, ref in ((dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert _max_err(ours, ref) <= 4 * torch.finfo(ours.dtype).eps * ref.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [7, 896, 20000])
@pytest.mark.parametrize("mode", ["llama", "fp32_affine"])
def test_a_norm_without_weight_matches_nanochat_and_fp64(mode, n_cols, dtype):
    """weight=None (NanoChat's parameter-free RMSNorm): the output is the normalised row in every mode, equal to
    NanoChat's module where the reduction order cannot matter (half precision), and forward and backward no less
    accurate than it against fp64 (a looped row at 20000)."""
    from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm

    rows = _rows_for(n_cols)
    x = _randn(rows, n_cols, dtype=dtype, seed=60).requires_grad_()
    r = _randn(rows, n_cols, dtype=dtype, seed=61).requires_grad_()
    y, s = fused_add_rms_norm(x, r, None, EPS, mode=mode)
    assert torch.equal(s, r + x) and y.dtype == dtype
    eager_x, eager_r = x.detach().requires_grad_(), r.detach().requires_grad_()
    eager = NanoChatRMSNorm(eps=EPS)(eager_r + eager_x)
    x64, r64 = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    s64 = r64 + x64
    truth = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
    if dtype != torch.float32:
        _assert_within_a_rounding_of_eager(y, eager)
    assert _max_err(y, truth) <= _max_err(eager, truth) + torch.finfo(dtype).eps * truth.abs().max().item()

    dy = _randn(rows, n_cols, dtype=dtype, seed=62)
    dsum = _randn(rows, n_cols, dtype=dtype, seed=63)
    dx, dr = _grads((y, s), (x, r), (dy, dsum))
    ex, er = _grads((eager, eager_r + eager_x), (eager_x, eager_r), (dy, dsum))
    tx, tr = _grads((truth, s64), (x64, r64), (dy.double(), dsum.double()))
    assert torch.equal(dx, dr)
    tolerance = 4 * torch.finfo(dtype).eps * tx.abs().max().item()
    assert _max_err(dx, tx) <= _max_err(ex, tx) + tolerance


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype at each value of ``t`` (in fp32; normal numbers)."""
    _, exponent = torch.frexp(t.float().abs())  # |t| = m * 2**exponent, 0.5 <= m < 1
    eps = torch.finfo(t.dtype).eps  # the spacing at 1 = 0.5 * 2**1
    return eps * torch.pow(2.0, (exponent - 1).float())


def _assert_sum_within_a_rounding_of_eager(ours, eager, eager_norm):
    """``addend + norm(x)`` against eager's, the addend a residual (``residual + norm(x)``) or a bias added after
    the weight (DeBERTa's ``w * n + b``, ``eager_norm`` then eager's rounded product ``w * n``): the norm parts may
    differ as ``_assert_within_a_rounding_of_eager`` allows (at most 2 ulps of the norm's output; up to twice
    that in the ulps of the smaller of two neighbouring binades), and each sum rounds once more (half an ulp of
    the sum each). Counted in ulps of the sum, the distance is unbounded where the addend cancels the norm's
    output (seen on an H100: 32 ulps of a sum near zero, fp16, width 896; on an H200: 8 ulps of a DeBERTa output
    near zero, bf16, width 40000), so the bound is on the difference itself."""
    allowed = 4 * _ulp(eager_norm) + _ulp(torch.maximum(ours.detach().abs(), eager.detach().abs()).to(eager.dtype))
    assert ((ours.detach().float() - eager.detach().float()).abs() <= allowed).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [7, 896, 20000])
@pytest.mark.parametrize("mode,hf_class", [("fp32_affine", Olmo2RMSNorm), ("llama", LlamaRMSNorm)])
def test_post_norm_add_matches_eager_and_fp64(mode, hf_class, n_cols, dtype):
    """rms_norm_add = residual + norm(x) (OLMo2's post-norm layers) in one kernel: the norm's output rounded to
    its dtype, then the add rounded as torch rounds it; gradients no less accurate than eager's against fp64."""
    rows = _rows_for(n_cols)
    weight = _randn(n_cols, dtype=dtype, scale=0.3, seed=70) + 1
    x = _randn(rows, n_cols, dtype=dtype, seed=71).requires_grad_()
    r = _randn(rows, n_cols, dtype=dtype, seed=72).requires_grad_()
    w = weight.clone().requires_grad_()
    out = rms_norm_add(x, r, w, EPS, mode=mode)
    module = _hf_module(hf_class, weight)
    ex, er = x.detach().requires_grad_(), r.detach().requires_grad_()
    eager = er + module(ex)
    assert out.dtype == eager.dtype
    if dtype != torch.float32:
        _assert_sum_within_a_rounding_of_eager(out, eager, module(ex).detach())
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, weight))
    truth = r64 + _fp64_reference(x64, None, w64)
    assert _max_err(out, truth) <= _max_err(eager, truth) + torch.finfo(dtype).eps * truth.abs().max().item()

    d = _randn(rows, n_cols, dtype=dtype, seed=73)
    ours = _grads(out, (x, r, w), (d,))
    theirs = _grads(eager, (ex, er, module.weight), (d,))
    exact = _grads(truth, (x64, r64, w64), (d.double(),))
    assert torch.equal(ours[1], d)  # the residual's gradient is the output's
    for a, b, t in zip(ours, theirs, exact):
        assert _max_err(a, t) <= _max_err(b, t) + 4 * torch.finfo(dtype).eps * t.abs().max().item()


def test_post_norm_add_op_passes_opcheck():
    x, r = _randn(3, 40, seed=74).requires_grad_(), _randn(3, 40, seed=75).requires_grad_()
    weight = _randn(40, seed=76).requires_grad_()
    torch.library.opcheck(library.op("norm_add_fwd"), (x, r, weight, None, EPS, "fp32_affine"))


def test_llama_mode_with_bias_rounds_like_eager():
    x = _randn(4, 48, dtype=torch.bfloat16, seed=29)
    weight, bias = _randn(48, dtype=torch.bfloat16, seed=30), _randn(48, dtype=torch.bfloat16, seed=31)
    expected = _hf_module(LlamaRMSNorm, weight)(x) + bias
    assert torch.equal(rms_norm(x, weight, EPS, bias=bias), expected)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 1)])
def test_empty_and_degenerate_inputs(shape):
    x = _randn(*shape, seed=32).requires_grad_()
    r = _randn(*shape, seed=33).requires_grad_()
    weight = _randn(shape[-1], seed=34).requires_grad_()
    y, s = fused_add_rms_norm(x, r, weight, EPS)
    assert y.shape == s.shape == x.shape
    dx, dr, dw = _grads((y, s), (x, r, weight), (torch.ones_like(y), torch.ones_like(s)))
    assert dx.shape == x.shape and dw.shape == weight.shape
    if x.numel() == 0:
        assert torch.equal(dw, torch.zeros_like(dw))
    else:
        exact = _fp64_reference(x, r, weight)
        assert _max_err(y, exact) < 1e-6


def test_every_output_is_written_and_idle_programs_write_their_partials(monkeypatch):
    """Fill fresh allocations with NaN: any output element or weight-gradient partial a program forgot to
    write would surface. With 7 rows of width 4100 (looped), the interpreter's 3 backward programs get
    3, 3 and 1 rows; 4 row blocks of 4 narrow rows give the third program none."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    for n_rows, n_cols in ((7, 4100), (13, 1024)):
        x = _randn(n_rows, n_cols, seed=35).requires_grad_()
        r = _randn(n_rows, n_cols, seed=36).requires_grad_()
        weight = _randn(n_cols, seed=37).requires_grad_()
        bias = _randn(n_cols, seed=38).requires_grad_()
        y, s = fused_add_rms_norm(x, r, weight, EPS, bias=bias, mode="fp32_affine")
        grads = _grads((y, s), (x, r, weight, bias), (torch.ones_like(y), torch.ones_like(s)))
        for t in (y, s, *grads):
            assert not t.isnan().any()
        assert _max_err(grads[3], torch.full_like(bias, n_rows)) < 1e-5


def _assert_one_bf16_rounding_from_fp64(y, s, weight, bias, mode):
    """``y`` is the norm of the (rounded) sum ``s`` in fp64 but for one rounding of the normalised row (bf16 in
    "llama" mode, the output in "layernorm" mode)."""
    s64 = s.detach().double()
    if mode == "layernorm":
        s64 = s64 - s64.mean(-1, keepdim=True)
    exact = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * weight.detach().double()
    exact = exact if bias is None else exact + bias.detach().double()
    assert _max_err(y, exact) <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item()


@pytest.mark.parametrize("mode", ["llama", "layernorm"])
def test_widest_supported_row(mode):
    """Hidden 65536: the looped path (16 column blocks per pass) forward and backward, against fp64."""
    n_cols = 65536
    x = _randn(2, n_cols, dtype=torch.bfloat16, seed=61).requires_grad_()
    r = _randn(2, n_cols, dtype=torch.bfloat16, seed=62).requires_grad_()
    weight = _randn(n_cols, dtype=torch.float32, seed=63).requires_grad_()
    bias = _randn(n_cols, dtype=torch.float32, seed=64).requires_grad_() if mode == "layernorm" else None
    y, s = fused_add_norm(x, r, weight, EPS, bias=bias, mode=mode)
    assert torch.equal(s, r + x)
    _assert_one_bf16_rounding_from_fp64(y, s, weight, bias, mode)
    dy = _randn(2, n_cols, dtype=y.dtype, seed=65)
    inputs = (x, r, weight) if bias is None else (x, r, weight, bias)
    ours = _grads(y, inputs, (dy,))
    again = _grads(fused_add_norm(x, r, weight, EPS, bias=bias, mode=mode)[0], inputs, (dy,))
    for a, b in zip(ours, again):
        assert torch.equal(a, b) and not a.isnan().any()
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    s_exact = inputs64[1] + inputs64[0]
    if mode == "layernorm":
        y64 = torch.nn.functional.layer_norm(s_exact, (n_cols,), inputs64[2], inputs64[3], EPS)
    else:
        y64 = _fp64_reference(inputs64[0], inputs64[1], inputs64[2])
    exact = _grads(y64, inputs64, (dy.double(),))
    for g, g64 in zip(ours, exact):
        assert _max_err(g, g64) <= 1e-2 * g64.abs().max().item()


def test_the_looped_forward_keeps_its_rows_in_flight_within_half_the_l2(monkeypatch):
    """Rows wider than the forward's tile: as many programs as keep FWD_REREAD_L2_SHARE of the L2 in rows to
    re-read, at least one per SM, at most one per row; one program per row block for single tiles."""
    monkeypatch.setattr(launch, "_l2_bytes", lambda _index: 50 * 2**20)
    monkeypatch.setattr(launch, "_sm_count", lambda _index: 132)
    looped, single = launch.forward_plan(65536, 2), launch.forward_plan(4096, 2)
    assert not looped.single_tile and looped.num_stages == launch.FWD_LOOP_STAGES
    assert launch.forward_grid(looped, 16384, 65536, 2, 0) == int(launch.FWD_REREAD_L2_SHARE * 50 * 2**20) // 2**17
    assert launch.forward_grid(looped, 100, 65536, 2, 0) == 100
    assert launch.forward_grid(launch.forward_plan(65536, 4), 16384, 65536, 4, 0) == 132  # fewer fit than SMs
    assert launch.forward_grid(single, 16384, 4096, 2, 0) == 16384 // single.block_m
    assert launch.forward_grid(looped, 16384, 65536, 2, -1) == launch.INTERPRET_PROGRAMS  # the interpreter


@pytest.mark.parametrize("mode", ["llama", "layernorm"])
def test_looped_forward_programs_stride_over_more_rows_than_there_are_programs(mode):
    """7 rows of 40000 (looped) on the interpreter's 3 programs: each program normalises rows p, p + 3, ...; every
    row's sum, output and statistics are those of the row normalised alone, and within a rounding of fp64."""
    n_rows, n_cols = 7, 40000
    x = _randn(n_rows, n_cols, dtype=torch.bfloat16, seed=80).requires_grad_()
    r = _randn(n_rows, n_cols, dtype=torch.bfloat16, scale=3, seed=81) + 1
    weight = _randn(n_cols, dtype=torch.bfloat16, scale=0.2, seed=82) + 1
    bias = _randn(n_cols, dtype=torch.bfloat16, seed=83) if mode == "layernorm" else None
    assert launch.forward_grid(launch.forward_plan(n_cols, 2), n_rows, n_cols, 2, -1) < n_rows
    y, s, stats = launch.norm_forward(x.detach(), r, weight, bias, EPS, mode)
    assert torch.equal(s, r + x.detach())
    for row in range(n_rows):
        y1, _, stats1 = launch.norm_forward(x.detach()[row:row + 1], r[row:row + 1], weight, bias, EPS, mode)
        assert torch.equal(y[row], y1[0])
        unpack = MODES[mode].unpack_stats
        for values, values1 in zip(unpack(stats, x.shape), unpack(stats1, y1.shape)):
            assert values is None or torch.equal(values[row], values1[0])
    _assert_one_bf16_rounding_from_fp64(y, s, weight, bias, mode)


# ---------------------------------------------------------------------------------------- batch invariance
# A row's output and input gradient are bitwise independent of how many other rows share the call
# (docs/numerics.md): no plan constant that shapes a row's reductions depends on the row count.

BATCH_ROWS = (1, 2, 3, 16, 17, 4095, 4096, 2**20)


@pytest.mark.parametrize("variant", ["fwd+res", "infer", "bwd+dsum", "bwd-dot"])
@pytest.mark.parametrize("n_cols", [7, 128, 4096, 16384, 65536])
def test_the_launch_constants_do_not_depend_on_the_row_count(variant, n_cols):
    """launch.py's own host code (captured on meta tensors) passes the same constexprs and warps at every row
    count: only runtime integers and the grid change, and the kernels do not specialise on the row count
    (test_fast_launch)."""
    from harness.kernel_inspect import capture_launch

    launches = {rows: capture_launch(variant, torch.bfloat16, n_cols, rows, "llama", sm_count=132, arch="sm_90")
                for rows in BATCH_ROWS}
    if all(launch_ is None for launch_ in launches.values()):
        return  # the row reductions of the wide backward only run for rows wider than one tile
    constants = {rows: (kernel, kwargs) for rows, (kernel, _, kwargs) in launches.items()}
    assert len({repr(c) for c in constants.values()}) == 1, constants


@pytest.mark.parametrize("mode", ["llama", "layernorm"])
@pytest.mark.parametrize("n_cols, dtype", [(1, torch.bfloat16), (7, torch.float16), (1000, torch.bfloat16),
                                           (20000, torch.float32), (40000, torch.bfloat16)])
def test_a_rows_output_and_input_gradient_do_not_depend_on_the_batch(mode, n_cols, dtype):
    """Bitwise, in the interpreter, the first rows of a batch of 9 run alone and in batches of 2, 4 and 9: odd
    widths, fp32 rows past the forward's tile (looped, a persistent grid of 3 programs over 9 rows), bf16 rows
    past both tiles (looped forward, wide backward)."""
    rows = 9
    x = _randn(rows, n_cols, dtype=dtype, seed=90)
    r = _randn(rows, n_cols, dtype=dtype, scale=2, seed=91)
    weight = (_randn(n_cols, scale=0.2, seed=92) + 1).to(dtype)
    bias = _randn(n_cols, dtype=dtype, scale=0.1, seed=93) if mode == "layernorm" else None
    dy, dsum = _randn(rows, n_cols, dtype=dtype, seed=94), _randn(rows, n_cols, dtype=dtype, seed=95)

    def run(batch):
        xb, rb = x[:batch].clone().requires_grad_(), r[:batch].clone().requires_grad_()
        y, s = fused_add_norm(xb, rb, weight, EPS, bias=bias, mode=mode)
        dx, = _grads((y, s), (xb,), (dy[:batch], dsum[:batch]))
        return y, s, dx

    everything = run(rows)
    for batch in (1, 2, 4):
        for alone, together in zip(run(batch), everything):
            assert torch.equal(alone, together[:batch])


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [128, 2048, 4096, 8192, 16384, 32768, 65536])
def test_batch_invariance_on_a_gpu(n_cols):
    """Bitwise on the card: every row's output and input gradient in batches of 1 to 4096 rows equal those of the
    same rows in the batch of 4096, at widths of every plan (narrow tiles, the widest tiles, the looped forward,
    the wide backward)."""
    rows = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r, dy, dsum = (torch.randn(rows, n_cols, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    weight = (1 + 0.2 * torch.randn(n_cols, device="cuda", generator=g)).to(torch.bfloat16)

    def run(batch):
        xb, rb = x[:batch].clone().requires_grad_(), r[:batch].clone().requires_grad_()
        y, s = fused_add_rms_norm(xb, rb, weight, EPS)
        dx, = _grads((y, s), (xb,), (dy[:batch], dsum[:batch]))
        return y, dx

    everything = run(rows)
    for batch in (1, 2, 3, 7, 16, 17, 100, 255, 1024, 2047, 4095):
        for alone, together in zip(run(batch), everything):
            assert torch.equal(alone, together[:batch]), (n_cols, batch)


# Inference forwards (no statistics) and training or compiled ones (statistics stored) must round alike. On an H200
# (Triton 3.6) two binaries differing only in the statistics' stores did not: ptxas fused different multiply-add
# pairs into FMAs (an ulp apart on a sixth of a 37-wide LayerNorm's outputs). Storing them is now a run-time flag
# (kernels.RUNTIME_FLAG_ARGS), so both run one compiled kernel.
FORWARD_PAIRS = [("fwd", "infer"), ("fwd+res", "infer+res"), ("sandwich", "sandwich-infer"), ("qk-fwd", "qk-infer")]


@pytest.mark.parametrize("training, inference", FORWARD_PAIRS)
@pytest.mark.parametrize("mode, n_cols, dtype", [("layernorm", 37, torch.float32), ("llama", 4096, torch.bfloat16),
                                                 ("llama", 65536, torch.bfloat16)])
def test_inference_and_training_forwards_bind_one_compiled_kernel(training, inference, mode, n_cols, dtype):
    """launch.py's own host code (captured on meta tensors, sm_90's plans) passes the same constexprs and warps with
    and without the statistics, and Triton's binder specialises the two argument lists alike: one binary."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from harness.kernel_inspect import capture_launch, capture_qk_launch
    from hf_rmsnorm.ops.kernels import unspecialised_args

    if not backend.triton_at_least(3, 5):
        pytest.skip("before Triton 3.5 the binder differs")
    if training == "qk-fwd" and (mode, n_cols) != ("llama", 4096):
        pytest.skip("the q/k kernel: one case, RMSNorm heads of 128 (32 of them: the width 4096)")
    if training == "sandwich" and n_cols > 4096:
        pytest.skip("the sandwich operator takes rows of one tile")

    def bound(variant):
        if variant.startswith("qk"):
            kernel, args, kwargs = capture_qk_launch(variant, dtype, 128, 64, mode)
        else:
            kernel, args, kwargs = capture_launch(variant, dtype, n_cols, 64, mode, sm_count=132, arch="sm_90")
        jit = JITFunction(kernel.fn, do_not_specialize=unspecialised_args(kernel.fn))
        binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
        return kwargs, repr(binder(*args, **kwargs)[1])

    assert bound(training) == bound(inference)


@pytest.mark.parametrize("mode", ["llama", "layernorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_cols", [37, 64, 2048])
def test_storing_the_statistics_leaves_the_output_alone(n_cols, dtype, mode):
    """The same, run: a forward storing its statistics and one that does not give the same output bit for bit."""
    x = _randn(64, n_cols, dtype=dtype, seed=96)
    weight = (_randn(n_cols, scale=0.5, seed=97) + 1).to(dtype)
    bias = _randn(n_cols, dtype=dtype, scale=0.5, seed=98) if mode == "layernorm" else None
    inference, _, none = launch.norm_forward(x, None, weight, bias, EPS, mode, store_stats=False)
    training, _, stats = launch.norm_forward(x, None, weight, bias, EPS, mode, store_stats=True)
    assert torch.equal(inference, training) and none is None and stats is not None


def test_weight_gradient_is_deterministic():
    x = _randn(37, 300, dtype=torch.bfloat16, seed=39).requires_grad_()
    weight = _randn(300, dtype=torch.bfloat16, seed=40).requires_grad_()
    dy = _randn(37, 300, dtype=torch.bfloat16, seed=41)
    first = _grads(rms_norm(x, weight, EPS), (weight,), (dy,))[0]
    second = _grads(rms_norm(x, weight, EPS), (weight,), (dy,))[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("n_cols", [1, 127, 4095, 4096, 8191, 8192, 8193, 12289, 16383, 16384, 16385, 65536])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_backward_plan_at_every_threshold(n_cols, elem_bytes):
    """One tile per row up to bwd_max_tile_n (16384 bf16 elements, 8192 fp32 ones); the two wide kernels over
    column blocks above. Either row loop is pipelined where its staging buffers fit."""
    plan = launch.backward_plan(n_cols, elem_bytes)
    assert launch.bwd_max_tile_n(elem_bytes) == {2: 16384, 4: 8192}[elem_bytes]
    assert plan.single_tile == (n_cols <= launch.bwd_max_tile_n(elem_bytes))
    assert 1 <= plan.programs_per_sm <= launch.BWD_MAX_PROGRAMS_PER_SM and 4 <= plan.num_warps <= 16
    if plan.single_tile:
        assert plan.block_n >= n_cols
        assert plan.block_m * plan.block_n <= max(launch.TARGET_TILE_ELEMENTS, plan.block_n)
    else:
        assert (plan.block_m, plan.block_n) == (1, launch.LOOP_BLOCK_N) and plan.num_stages > 1
    staged = launch.BWD_LOADED_TENSORS * plan.block_m * plan.block_n * elem_bytes * plan.num_stages
    assert plan.num_stages == 1 or staged <= launch.BWD_PIPELINE_SMEM_BYTES
    if elem_bytes == 2 and n_cols <= 8192:  # bf16/fp16 rows up to 8192 are pipelined
        assert plan.num_stages > 1


@pytest.mark.parametrize("mode, has_bias, single_tile_at_16384", [
    ("llama", False, True), ("fp32_affine", False, True), ("layernorm_as_rmsnorm", False, True), ("gemma", False, True),
    ("llama", True, False), ("fp32_affine", True, False), ("layernorm", False, False), ("layernorm", True, False),
])
def test_backward_variants_that_would_spill_take_the_wide_kernels(mode, has_bias, single_tile_at_16384):
    """The bf16 single tile reaches 16384 only for the variants that keep two fp32 values live per element across
    the row reductions (g, the weight gradient): a third (a bias gradient, centring) would spill, so those rows take
    the wide kernels, while every variant keeps the tiles of 8192 (bf16 and fp32)."""
    live = launch.bwd_live_tiles(True, has_bias, MODES[mode])
    assert launch.backward_plan(16384, 2, None, live).single_tile == single_tile_at_16384
    assert all(launch.backward_plan(8192, elem_bytes, None, live).single_tile for elem_bytes in (2, 4))
    if not single_tile_at_16384:
        assert launch.backward_plan(16384, 2, None, live) == launch.backward_plan(32768, 2)


@pytest.mark.parametrize("n_cols", [8191, 8192, 8193, 16384, 16385])
def test_backward_at_the_tile_thresholds(n_cols):
    """Just below, at and above the single-tile limit and the next power of two, against eager and fp64."""
    x = _randn(3, n_cols, dtype=torch.bfloat16, seed=70).requires_grad_()
    r = _randn(3, n_cols, dtype=torch.bfloat16, scale=3, seed=71).requires_grad_()
    weight = _randn(n_cols, dtype=torch.bfloat16, seed=72).requires_grad_()
    dy, dsum = _randn(3, n_cols, dtype=torch.bfloat16, seed=73), _randn(3, n_cols, dtype=torch.bfloat16, seed=74)
    ours = _grads(fused_add_rms_norm(x, r, weight, EPS), (x, r, weight), (dy, dsum))
    module = _hf_module(LlamaRMSNorm, weight.detach())
    hf_sum = r + x
    hf = _grads((module(hf_sum), hf_sum), (x, r, module.weight), (dy, dsum))
    inputs64 = [t.detach().double().requires_grad_() for t in (x, r, weight)]
    exact = _grads((_fp64_reference(*inputs64), inputs64[1] + inputs64[0]), inputs64, (dy.double(), dsum.double()))
    _assert_no_less_accurate(ours, hf, exact)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_folded_weight_gradient_sum_over_as_many_programs_as_a_gpu_runs(monkeypatch, out_dtype):
    """333 backward programs (a GPU's count), each one row block, of an odd width (several REDUCE_BLOCK_N pieces, a
    ragged last one): the weight and bias gradients summed by the launch's last program(s) are bitwise the same
    twice, and within the bound of the summation order of fp64.

    The bound: each term dy * n carries a few roundings (n = s * rstd, rstd, the product: at most 5u, u the fp32
    unit roundoff); every column's sum is a tree at most 4 deep within a program (tl.sum of its 16 rows), then 11
    additions along one of REDUCE_BLOCK_P chains and 5 levels folding them: 20 roundings of partial sums, so the
    error is at most (5 + 20) u times the sum of the terms' magnitudes (to first order; 32u allows for the second),
    plus the cast to the gradient's dtype."""
    monkeypatch.setattr(launch, "INTERPRET_PROGRAMS", 333)
    n_cols = 203
    n_rows = 333 * launch.backward_plan(n_cols, 4).block_m
    x = _randn(n_rows, n_cols, seed=75) * torch.logspace(-2, 2, n_rows, device=DEVICE)[:, None]
    weight = _randn(n_cols, seed=76).to(out_dtype).requires_grad_()
    bias = _randn(n_cols, seed=77).to(out_dtype).requires_grad_()
    dy = _randn(n_rows, n_cols, seed=78)

    def grads():
        return _grads(rms_norm(x, weight, EPS, bias=bias, mode="fp32_affine"), (weight, bias), (dy,))

    (dw, db), (dw_again, db_again) = grads(), grads()
    assert torch.equal(dw, dw_again) and torch.equal(db, db_again)
    s64 = x.double()
    terms = {"dw": dy.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS), "db": dy.double()}
    u = torch.finfo(torch.float32).eps / 2
    for ours, parts in ((dw, terms["dw"]), (db, terms["db"])):
        exact = parts.sum(0)
        bound = 32 * u * parts.abs().sum(0) + torch.finfo(out_dtype).eps * exact.abs()
        assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("n_cols", [300, 20000])
def test_backward_programs_without_rows_contribute_zeros(monkeypatch, n_cols):
    """A launch of more programs than row blocks (single tile) or row groups (the wide kernels): the programs
    without rows write zero partial rows and take part in the count, and the gradients are those of the usual
    grid, bitwise (the extra rows come after the others and add exact zeros)."""
    x = _randn(7, n_cols, dtype=torch.bfloat16, seed=84).requires_grad_()
    weight = _randn(n_cols, dtype=torch.bfloat16, seed=85).requires_grad_()
    bias = _randn(n_cols, dtype=torch.bfloat16, seed=86).requires_grad_()
    dy = _randn(7, n_cols, dtype=torch.bfloat16, seed=87)

    def grads():
        return _grads(rms_norm(x, weight, EPS, bias=bias, mode="fp32_affine"), (x, weight, bias), (dy,))

    usual = grads()
    real_grid = launch.backward_grid

    def wider(tiling, n_rows, width, device_index):
        grid, n_partials, rows_per_group = real_grid(tiling, n_rows, width, device_index)
        n_col_blocks = grid // n_partials
        return grid + 2 * n_col_blocks, n_partials + 2, rows_per_group

    monkeypatch.setattr(launch, "backward_grid", wider)
    for got, expected in zip(grads(), usual):
        assert torch.equal(got, expected)


def test_weight_gradient_with_many_backward_programs(monkeypatch):
    """As many backward programs as row blocks (each writes one partial row, the reduction adds them all):
    the same gradients as with few programs, up to the order of the fp32 additions."""
    x = _randn(40, 96, seed=77).requires_grad_()
    weight = _randn(96, seed=78).requires_grad_()
    dy = _randn(40, 96, seed=79)
    few = _grads(rms_norm(x, weight, EPS), (x, weight), (dy,))
    monkeypatch.setattr(launch, "INTERPRET_PROGRAMS", 1000)
    many = _grads(rms_norm(x, weight, EPS), (x, weight), (dy,))
    assert torch.equal(few[0], many[0])
    torch.testing.assert_close(many[1], few[1], rtol=1e-6, atol=1e-6)


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mode 'olmo'"):
        rms_norm(torch.ones(2, 4), torch.ones(4), mode="olmo")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_matches_eager(backend):
    def block(x, residual, w1, w2):
        h = rms_norm(x, w1, EPS)
        y, new_residual = fused_add_rms_norm(h * 2, residual, w2, EPS)
        return y.sum() + new_residual.float().square().sum()

    x, r = _randn(4, 64, seed=42).requires_grad_(), _randn(4, 64, seed=43).requires_grad_()
    w1, w2 = _randn(64, seed=44).requires_grad_(), _randn(64, seed=45).requires_grad_()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    eager_out = block(x, r, w1, w2)
    compiled_out = compiled(x, r, w1, w2)
    torch.testing.assert_close(compiled_out, eager_out)
    for a, b in zip(_grads(compiled_out, (x, r, w1, w2), None), _grads(block(x, r, w1, w2), (x, r, w1, w2), None)):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_64bit_row_offsets_on_gpu():
    """Rows x stride past 2**31 elements: int32 offsets would wrap and corrupt the last rows."""
    n_cols = 8192
    n_rows = 2**31 // n_cols + 3
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    weight = torch.randn(n_cols, device="cuda", dtype=torch.bfloat16)
    y, s = fused_add_rms_norm(x, r, weight, EPS)
    tail = slice(n_rows - 4, n_rows)
    assert torch.equal(s[tail], r[tail] + x[tail])
    assert torch.equal(y[tail], _hf_module(LlamaRMSNorm, weight)(r[tail] + x[tail]))


@pytest.mark.parametrize("with_residual", [False, True])
def test_custom_ops_pass_torch_library_opcheck(with_residual):
    """Schema, fake (meta) implementations and autograd registration of the ops torch.compile sees."""
    x = _randn(3, 40, dtype=torch.bfloat16, seed=46).requires_grad_()
    weight = _randn(40, dtype=torch.float32, seed=47).requires_grad_()
    if with_residual:
        r = _randn(3, 40, dtype=torch.float32, seed=48).requires_grad_()
        torch.library.opcheck(library.op("add_norm_fwd"), (x, r, weight, None, EPS, "llama"))
    else:
        torch.library.opcheck(library.op("norm_fwd"), (x, weight, None, EPS, "gemma"))
    s = _randn(3, 40, dtype=torch.bfloat16, seed=49)
    stats = MODES["llama"].pack_stats(torch.rand(3, device=DEVICE) + 0.5, None)  # as a forward saves them
    dy = _randn(3, 40, dtype=torch.float32, seed=50)
    dsum = _randn(3, 40, dtype=torch.bfloat16, seed=55) if with_residual else None
    torch.library.opcheck(
        library.op("norm_bwd"),
        (dy, dsum, s, stats, weight.detach(), torch.float32, "llama", torch.bfloat16, torch.float32, with_residual),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [7, 896, 4100])
def test_fused_add_layer_norm_matches_nn_layer_norm(dtype, n_cols):
    """fused_add_layer_norm is nn.LayerNorm (mean subtracted), with the residual add fused, forward and backward,
    also for rows with a large mean (where E[x^2] - mean^2 would cancel)."""
    x = (_randn(5, n_cols, seed=51) + 30).to(dtype).requires_grad_()
    r = _randn(5, n_cols, dtype=dtype, seed=52).requires_grad_()
    ln = torch.nn.LayerNorm(n_cols, eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        ln.weight.copy_(_randn(n_cols, seed=53))
        ln.bias.copy_(_randn(n_cols, seed=54))
    y, s = fused_add_layer_norm(x, r, ln.weight, ln.bias, 1e-5)
    hf_sum = r + x
    hf_y = ln(hf_sum)
    assert y.dtype == hf_y.dtype and torch.equal(s, hf_sum)

    dy, dsum = _randn(5, n_cols, dtype=dtype, seed=55), _randn(5, n_cols, dtype=dtype, seed=56)
    params = (x, r, ln.weight, ln.bias)
    ours = _grads((y, s), params, (dy, dsum))
    hf = _grads((hf_y, hf_sum), params, (dy, dsum))
    inputs64 = [t.detach().double().requires_grad_() for t in params]
    s64 = inputs64[1] + inputs64[0]
    y64 = torch.nn.functional.layer_norm(s64, (n_cols,), inputs64[2], inputs64[3], 1e-5)
    exact = _grads((y64, s64), inputs64, (dy.double(), dsum.double()))
    # Both round the same fp32/bf16 sum; allow two ulps at the largest output for the order of reductions.
    assert _max_err(y, y64) <= _max_err(hf_y, y64) + 2 * torch.finfo(dtype).eps * y64.abs().max().item()
    _assert_no_less_accurate(ours, hf, exact)


def test_non_reentrant_checkpointing_recomputes_both_ops():
    """Gradient checkpointing (HF's default is non-reentrant) lets a backward unpack saved tensors once."""
    from torch.utils.checkpoint import checkpoint

    x = _randn(4, 32, seed=57).requires_grad_()
    r = _randn(4, 32, seed=58).requires_grad_()
    w1, w2 = _randn(32, seed=59).requires_grad_(), _randn(32, seed=60).requires_grad_()

    def block(x, r, w1, w2):
        y, s = fused_add_rms_norm(rms_norm(x, w1, EPS), r, w2, EPS)
        return y * s

    params = (x, r, w1, w2)
    plain = _grads(block(*params).sum(), params, None)
    checkpointed = _grads(checkpoint(block, *params, use_reentrant=False).sum(), params, None)
    for a, b in zip(checkpointed, plain):
        assert torch.equal(a, b)


def test_strided_and_expanded_weights_are_read_as_their_values():
    # The kernels index weight and bias with unit stride; a strided view must not be read as a contiguous one
    # (nor an expanded one past its storage).
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=generator)
    wide = torch.randn(64, generator=generator)
    for weight, bias in ((wide[::2], wide[1::2]), (torch.tensor(1.5).expand(32), torch.tensor(0.25).expand(32))):
        expected = rms_norm(x, weight.contiguous(), 1e-6, bias=bias.contiguous(), mode="fp32_affine")
        assert torch.equal(rms_norm(x, weight, 1e-6, bias=bias, mode="fp32_affine"), expected)


@pytest.mark.skipif(not kernels_interpreted(), reason="sets up Triton's interpreter, which a GPU host does not run")
def test_the_interpreters_language_patching_is_memoised_with_the_same_effect(monkeypatch):
    """``backend.memoise_language_patching``, installed with the interpreter: on every package the interpreter
    patches, before a launch and in the middle of one (some builtins patched already), the memoised function patches
    exactly what Triton's own does, in the same order."""
    import triton.language as tl
    from triton.runtime import interpreter

    memoised = interpreter._patch_builtin
    assert getattr(memoised, "memoises_members", False) and backend.memoise_language_patching()
    packages = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", tl.tensor)]

    def patched_by(patch_builtin) -> list[tuple]:
        calls = []
        monkeypatch.setattr(interpreter, "_patch_attr", lambda pkg, name, member, *rest: calls.append(
            (pkg, name, member, rest)))
        for pkg in packages:
            patch_builtin(pkg, "builder", *(("scope",) if memoised.original.__code__.co_argcount == 3 else ()))
        return calls

    # Between launches most builtins are unpatched where each launch restores what its own set-up patched (Triton
    # >= 3.3; what its helper calls patched stays); before that, the first launch patched everything for good, and
    # both functions patch nothing from then on.
    between_launches = patched_by(memoised.original)
    assert patched_by(memoised) == between_launches
    assert len(between_launches) > 100 or not hasattr(interpreter, "_LangPatchScope")
    # Part-way through a launch: builtins already patched (a lambda, as Triton's _patch_attr installs) are left.
    for pkg, name, *_ in between_launches[::20]:
        monkeypatch.setattr(pkg, name, lambda *args, **kwargs: None)
    part_way = patched_by(memoised.original)
    assert patched_by(memoised) == part_way and len(part_way) == len(between_launches) - len(between_launches[::20])


def test_the_interpreter_rounds_like_a_gpu_without_configure(tmp_path):
    # A user who sets TRITON_INTERPRET=1 alone (no backend.configure) gets GPU rounding of bf16 all the same.
    problem = backend.installed_interpreter_problem()
    if problem:  # the GPU image pairs Triton 3.6 with NumPy 2.5
        pytest.skip(problem)
    script = tmp_path / "check.py"
    script.write_text(
        "import torch\n"
        "from transformers.models.llama.modeling_llama import LlamaRMSNorm\n"
        "from hf_rmsnorm import rms_norm\n"
        "from hf_rmsnorm.ops import backend\n"
        "x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)\n"
        "norm = LlamaRMSNorm(256, eps=1e-6)\n"
        "torch.nn.init.normal_(norm.weight, 1.0, 0.2)\n"
        "with torch.no_grad():\n"
        "    norm.weight.copy_(norm.weight.to(torch.bfloat16).float()); norm = norm.to(torch.bfloat16)\n"
        # Truncating instead of rounding would change about half the outputs; an rstd an ulp away from
        # PyTorch's may flip a rare one.
        "    differing = (rms_norm(x, norm.weight, 1e-6) != norm(x)).float().mean().item()\n"
        "assert differing < 0.01, differing\n"
        "assert backend.kernels_interpreted()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**env, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr


# T5's norm (and mT5's, UMT5's, LongT5's...) in every dtype pairing a model meets: its own, a bf16 stream into an
# fp32 weight (a norm kept in fp32), an fp32 stream into a half weight.
T5_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
             (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("x_dtype, w_dtype", T5_DTYPES)
@pytest.mark.parametrize("n_cols", [1, 7, 127, 896, 4097, 20000])
def test_t5_mode_matches_t5_layer_norm_and_fp64(x_dtype, w_dtype, n_cols):
    """The "t5" mode rounds the normalised row to the weight's dtype (not the input's) before the multiply: its
    output is ``T5LayerNorm``'s, of the same dtype, bitwise where the product rounds to half precision (the
    reduction order cannot show through a half rounding except at a tie) and within the reduction order in fp32;
    forward and backward are no less accurate than the module's against fp64, with the residual add fused."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    rows = _rows_for(n_cols)
    x = _randn(rows, n_cols, dtype=x_dtype, seed=70).requires_grad_()
    r = _randn(rows, n_cols, dtype=x_dtype, scale=3, seed=71).requires_grad_()
    weight = (_randn(n_cols, dtype=torch.float32, scale=0.5, seed=72) + 1).to(w_dtype).requires_grad_()
    y, s = fused_add_rms_norm(x, r, weight, EPS, mode="t5")
    module = _hf_module(T5LayerNorm, weight.detach())
    eager_x, eager_r = x.detach().requires_grad_(), r.detach().requires_grad_()
    eager_s = eager_r + eager_x
    eager = module(eager_s)
    assert torch.equal(s, eager_s) and y.dtype == eager.dtype
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, eager, rtol=2e-6, atol=2e-6)
    else:
        _assert_within_a_rounding_of_eager(y, eager)
    inputs64 = [t.detach().double().requires_grad_() for t in (x, r, weight)]
    truth = _fp64_reference(*inputs64)
    assert reference.error_beyond_bound(y, eager, truth) <= 0

    dy = _randn(rows, n_cols, dtype=y.dtype, seed=73)
    dsum = _randn(rows, n_cols, dtype=x_dtype, seed=74)
    ours = _grads((y, s), (x, r, weight), (dy, dsum))
    hf = _grads((eager, eager_s), (eager_x, eager_r, module.weight), (dy, dsum))
    exact = _grads((truth, inputs64[1] + inputs64[0]), inputs64, (dy.double(), dsum.double()))
    _assert_no_less_accurate(ours, hf, exact)


@pytest.mark.parametrize("n_cols", [96, 20000])
def test_t5_mode_on_strided_rows(n_cols):
    """A strided bf16 view into a bf16 T5 weight computes what its contiguous copy computes, forward and backward."""
    base = _randn(4, 2 * n_cols, dtype=torch.bfloat16, seed=75)
    x = base[:, ::2].requires_grad_()
    weight = (_randn(n_cols, scale=0.5, seed=76) + 1).to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, weight, EPS, mode="t5")
    x_copy = x.detach().contiguous().requires_grad_()
    assert torch.equal(y, rms_norm(x_copy, weight, EPS, mode="t5"))
    dy = _randn(4, n_cols, dtype=torch.bfloat16, seed=77)
    for a, b in zip(_grads(y, (x, weight), (dy,)), _grads(rms_norm(x_copy, weight, EPS, mode="t5"), (x_copy, weight),
                                                         (dy,))):
        assert torch.equal(a, b)


# DeBERTa's LayerNorm ("deberta" mode): centred in fp32, divided by sqrt(var + eps), rounded to the input dtype before
# the weight (Llama's order), the bias added in the promoted dtype.


def _deberta_module(weight, bias):
    from transformers.models.deberta.modeling_deberta import DebertaLayerNorm

    module = DebertaLayerNorm(weight.shape[0], eps=EPS).to(device=DEVICE, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    return module


def _deberta_fp64(s, weight, bias):
    """DeBERTa's LayerNorm of ``s`` in fp64, without any intermediate rounding."""
    d = s.double() - s.double().mean(-1, keepdim=True)
    return weight.double() * (d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + EPS)) + bias.double()


def _deberta_rounded_to_nearest(x, weight, bias):
    """``DebertaLayerNorm``'s steps on ``x``, each rounded to nearest in fp32 (the square root and the division
    taken in fp64 and rounded once, which is exact rounding for both), then the module's product and bias add in
    ``x``'s dtype: the module's output wherever torch's fp32 ``sqrt`` rounds to nearest. On GPUs it does; the
    vectorised fp32 ``sqrt`` of torch's CPU build is an ulp off for some inputs (seen on an AVX-512 host)."""
    s = x.float()
    d = s - s.mean(-1, keepdim=True)
    std = torch.sqrt((d.pow(2).mean(-1, keepdim=True) + EPS).double()).float()
    return weight * (d.double() / std.double()).float().to(x.dtype) + bias


def _deberta_inputs(rows, n_cols, dtype, seed):
    """Post-LN activations: a sublayer's output ``x`` and the residual stream ``r`` (a mean away from zero), a
    trained-like weight around 1 and bias around 0."""
    x = _randn(rows, n_cols, dtype=dtype, seed=seed)
    r = _randn(rows, n_cols, dtype=dtype, scale=3, seed=seed + 1) + 0.5
    weight = (_randn(n_cols, scale=0.3, seed=seed + 2) + 1).to(dtype)
    bias = _randn(n_cols, dtype=dtype, scale=0.3, seed=seed + 3)
    return x, r, weight, bias


@pytest.mark.parametrize("op", ["norm", "fused_add", "norm_add"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [1, 7, 127, 896, 4097, 20000, 40000])
def test_deberta_mode_matches_deberta_layer_norm_and_fp64(op, dtype, n_cols):
    """The forward kernel's every plan (one tile, the looped rows past it: fp32 at 20000, every dtype at 40000), alone,
    with the residual added first (post-LN ``LayerNorm(h + input)``) or after: the module's dtype and output, bitwise
    but where the sums' reduction order shows (fp32: within it; half precision: a rare flip of the rounded
    normalised value, carried through the product and the bias add: ``_assert_sum_within_a_rounding_of_eager``),
    and no less accurate than the module against fp64."""
    rows = _rows_for(n_cols)
    x, r, weight, bias = _deberta_inputs(rows, n_cols, dtype, seed=100)
    module = _deberta_module(weight, bias)
    normed = r + x if op == "fused_add" else x  # what the norm reads
    with torch.no_grad():
        eager, truth = module(normed), _deberta_fp64(normed, weight, bias)
        if op == "norm":
            ours = norm(x, weight, EPS, bias=bias, mode="deberta")
        elif op == "fused_add":
            ours, s = fused_add_norm(x, r, weight, EPS, bias=bias, mode="deberta")
            assert torch.equal(s, normed)
        else:
            ours, eager, truth = norm_add(x, r, weight, EPS, bias=bias, mode="deberta"), r + eager, r.double() + truth
    assert ours.dtype == eager.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours, eager, rtol=2e-6, atol=2e-6 * truth.abs().max().item())
    elif op == "norm_add":
        _assert_sum_within_a_rounding_of_eager(ours, eager, module(x).detach())
    else:
        # The bias is added to the rounded product, which a zero bias leaves exactly as eager rounds it.
        product = _deberta_module(weight, torch.zeros_like(bias))(normed).detach()
        _assert_sum_within_a_rounding_of_eager(ours, eager, product)
    assert reference.error_beyond_bound(ours, eager, truth) <= 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [7, 896, 4097, 20000])
def test_deberta_mode_backward_is_no_less_accurate_than_the_module(dtype, n_cols):
    """The gradients of ``LayerNorm(x + r)`` into x, r, the weight and the bias (one-tile backward up to 4097, the
    wide kernels at 20000), through the fused add with a gradient reaching the sum too: no less accurate than
    the module's autograd against fp64, although ours multiplies by rstd where the forward divided."""
    rows = _rows_for(n_cols)
    x, r, weight, bias = (t.requires_grad_() for t in _deberta_inputs(rows, n_cols, dtype, seed=110))
    y, s = fused_add_norm(x, r, weight, EPS, bias=bias, mode="deberta")
    module = _deberta_module(weight.detach(), bias.detach())
    eager_x, eager_r = x.detach().requires_grad_(), r.detach().requires_grad_()
    eager_s = eager_r + eager_x
    eager = module(eager_s)
    dy, dsum = _randn(rows, n_cols, dtype=dtype, seed=114), _randn(rows, n_cols, dtype=dtype, seed=115)
    ours = _grads((y, s), (x, r, weight, bias), (dy, dsum))
    hf = _grads((eager, eager_s), (eager_x, eager_r, module.weight, module.bias), (dy, dsum))
    inputs64 = [t.detach().double().requires_grad_() for t in (x, r, weight, bias)]
    s64 = inputs64[1] + inputs64[0]
    exact = _grads((_deberta_fp64(s64, inputs64[2], inputs64[3]), s64), inputs64, (dy.double(), dsum.double()))
    _assert_no_less_accurate(ours, hf, exact)


@pytest.mark.parametrize("n_cols", [96, 40000])
def test_deberta_mode_on_strided_rows(n_cols):
    """Strided rows (a row stride past the width, a column-major residual copied) compute what their contiguous
    copies compute, forward and backward."""
    x, r, weight, bias = _deberta_inputs(4, n_cols, torch.bfloat16, seed=120)
    base = _randn(4, n_cols + 40, dtype=torch.bfloat16, seed=124)
    base[:, 8:8 + n_cols] = x
    x_strided = base[:, 8:8 + n_cols].requires_grad_()
    r_strided = r.t().contiguous().t()
    x_copy = x.clone().requires_grad_()
    y, s = fused_add_norm(x_strided, r_strided, weight, EPS, bias=bias, mode="deberta")
    y_copy, s_copy = fused_add_norm(x_copy, r, weight, EPS, bias=bias, mode="deberta")
    assert torch.equal(y, y_copy) and torch.equal(s, s_copy)
    dy = _randn(4, n_cols, dtype=torch.bfloat16, seed=125)
    assert torch.equal(_grads(y, (x_strided,), (dy,))[0], _grads(y_copy, (x_copy,), (dy,))[0])


def test_deberta_mode_normalises_fp64_in_fp32_as_the_module_does():
    """DeBERTa's body calls ``.float()`` whatever the input: an fp64 input (the PyTorch implementation's) is
    normalised in fp32, rounded back to fp64 and scaled there, bit for bit as the module computes it."""
    x, _, weight, bias = (t.double() for t in _deberta_inputs(5, 96, torch.float32, seed=130))
    y = norm(x, weight, EPS, bias=bias, mode="deberta")
    expected = _deberta_module(weight, bias)(x)
    assert y.dtype == expected.dtype == torch.float64 and torch.equal(y, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [64, 32768, 65536])
def test_deberta_mode_is_the_module_bit_for_bit_where_the_statistics_are_exact(dtype, n_cols):
    """Integer rows with an integer mean: their sums, mean and variance are exact in any order of summation, so
    nothing but the roundings the module itself makes is left, and the output is the module's bit for bit in every
    dtype, fp32 included (one tile at 64, and at 32768 but for fp32, which loops there; every dtype loops at
    65536), as the module computes it with each step rounded to nearest (``_deberta_rounded_to_nearest``). A
    product by ``rsqrt`` instead of the division fails this in fp32."""
    gen = torch.Generator().manual_seed(140)
    half = torch.randint(-8, 9, (2, n_cols // 2), generator=gen).float()
    deviations = torch.cat([half, -half], dim=-1)[:, torch.randperm(n_cols, generator=gen)]  # each row's sum: 0
    rows = deviations + torch.tensor([[3.0], [-2.0]])  # means 3 and -2; squares summed below 2**24
    x = rows.to(device=DEVICE, dtype=dtype)
    _, _, weight, bias = _deberta_inputs(2, n_cols, dtype, seed=141)
    y = norm(x, weight, EPS, bias=bias, mode="deberta")
    expected = _deberta_rounded_to_nearest(x, weight, bias)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    torch.testing.assert_close(_deberta_module(weight, bias)(x).detach(), expected)  # the module, to its sqrt
