"""``norm_add_norm``: a sandwich norm's ``residual + norm(x)`` and the next norm of that sum in one launch (rows of
one tile), against the two ops it replaces (``norm_add`` then ``norm``: bitwise, values and gradients), fp64
maths and Hugging Face's own modules."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_rmsnorm.ops import launch, library
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.ops.functional import norm, norm_add, norm_add_norm

pytestmark = pytest.mark.skipif(
    not kernels_interpreted() and not torch.cuda.is_available(), reason="kernels need a GPU or Triton's interpreter"
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS, EPS2 = 1e-6, 1e-5
# Single tiles (one launch) in every dtype; at 20000, fp32 rows are looped (the two ops' launches: fp32 tiles stop
# at 16384) and bf16 rows one wide tile. Each 20000-wide case takes about 10 s in the interpreter, so the wide
# width runs in those two dtypes only.
SHAPES = [(n_cols, dtype) for n_cols in (7, 896) for dtype in DTYPES]
SHAPES += [(20000, torch.float32), (20000, torch.bfloat16)]


def _randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _rows_for(n_cols: int) -> int:
    return 2 if n_cols > 4096 else 13


def _parameters(mode: str, n_cols: int, dtype: torch.dtype):
    """Trained-like weights (never all ones) of two norms, and biases for LayerNorm: the weights in the dtype the
    family keeps them in (Llama's in the activations', the others' fp32)."""
    weight_dtype = dtype if mode == "llama" else torch.float32
    offset = 0.0 if mode == "gemma" else 1.0  # Gemma's weights are centred on 0 (it scales by 1 + w)
    w1 = _randn(n_cols, dtype=weight_dtype, scale=0.3, seed=1) + offset
    w2 = _randn(n_cols, dtype=weight_dtype, scale=0.3, seed=2) + offset
    biases = (_randn(n_cols, scale=0.1, seed=3), _randn(n_cols, scale=0.1, seed=4)) if mode == "layernorm" \
        else (None, None)
    return w1, w2, *biases


def _two_ops(x, r, w1, b1, w2, b2, mode):
    total = norm_add(x, r, w1, EPS, bias=b1, mode=mode)
    return norm(total, w2, EPS2, bias=b2, mode=mode), total


def _fused(x, r, w1, b1, w2, b2, mode):
    return norm_add_norm(x, r, w1, EPS, bias=b1, weight2=w2, eps2=EPS2, bias2=b2, mode=mode)


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("n_cols, dtype", SHAPES)
@pytest.mark.parametrize("mode", ["gemma", "llama", "fp32_affine", "layernorm"])
def test_values_and_gradients_are_bitwise_those_of_the_two_ops(mode, n_cols, dtype):
    """Forward and backward equal ``norm_add`` then ``norm`` bit for bit, with and without a gradient reaching the
    sum from elsewhere (a sandwich layer's sum is also the next add's residual): each rounds where the other
    does, and the sum's gradient is accumulated as autograd accumulates it."""
    rows = _rows_for(n_cols)
    x, r = _randn(rows, n_cols, dtype=dtype, seed=5), _randn(rows, n_cols, dtype=dtype, seed=6)
    params = _parameters(mode, n_cols, dtype)
    dy, dtotal = _randn(rows, n_cols, dtype=dtype, seed=7), _randn(rows, n_cols, dtype=dtype, seed=8)
    for total_read in (True, False):
        results = []
        for op in (_fused, _two_ops):
            leaves = _leaves(x, r, *params)
            y, total = op(*leaves[:3], leaves[4], leaves[3], leaves[5], mode)
            outputs, grads = ((y, total), (dy.to(y.dtype), dtotal)) if total_read else ((y,), (dy.to(y.dtype),))
            inputs = [t for t in leaves if t is not None]
            results.append((y, total, *torch.autograd.grad(outputs, inputs, grads)))
        for ours, theirs in zip(*results):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_inputs(dtype):
    """Rows of a non-contiguous view (every other column of a wider tensor, a transposed batch) read as the two
    ops read them."""
    n_cols = 96
    x = _randn(2 * n_cols, 9, dtype=dtype, seed=9).t()[:, ::2]
    r = _randn(9, 3, n_cols, dtype=dtype, seed=10).transpose(0, 1)[0]
    w1, w2, _, _ = _parameters("gemma", n_cols, dtype)
    ours = _fused(x, r, w1, None, w2, None, "gemma")
    theirs = _two_ops(x, r, w1, None, w2, None, "gemma")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _launches(monkeypatch, call) -> int:
    count = []
    real = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda *args, **kwargs: count.append(1) or real(*args, **kwargs))
    with torch.no_grad():
        call()
    return len(count)


@pytest.mark.parametrize("n_cols, launches", [(896, 1), (20000, 1), (40000, 2)])
def test_one_launch_for_rows_of_one_tile(monkeypatch, n_cols, launches):
    x, r = _randn(4, n_cols, dtype=torch.bfloat16, seed=11), _randn(4, n_cols, dtype=torch.bfloat16, seed=12)
    w1, w2, _, _ = _parameters("gemma", n_cols, torch.bfloat16)
    assert launch.forward_plan(n_cols, 2).single_tile == (launches == 1)
    assert _launches(monkeypatch, lambda: _fused(x, r, w1, None, w2, None, "gemma")) == launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, hf_class", [("gemma", GemmaRMSNorm), ("llama", LlamaRMSNorm)])
def test_no_less_accurate_than_eager_against_fp64(mode, hf_class, dtype):
    """Against fp64 maths (no intermediate rounding), the output and the sum are as close as Hugging Face's eager
    ``post(x) + residual`` then ``pre(sum)``, within one rounding of each output's dtype (the kernels' fp32
    reductions sum in another order)."""
    n_cols, rows = 640, 13
    x, r = _randn(rows, n_cols, dtype=dtype, seed=13), _randn(rows, n_cols, dtype=dtype, seed=14)
    w1, w2, _, _ = _parameters(mode, n_cols, dtype)
    modules = []
    for w in (w1, w2):
        module = hf_class(n_cols, eps=EPS).to(device=DEVICE, dtype=w.dtype)
        module.weight.data.copy_(w)
        modules.append(module)
    modules[1].eps = modules[1].variance_epsilon = EPS2
    eager_total = r + modules[0](x)
    eager = modules[1](eager_total)
    y, total = _fused(x, r, w1, None, w2, None, mode)
    offset = 1.0 if mode == "gemma" else 0.0

    def exact_norm(s, w, eps):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)

    exact_total = r.double() + exact_norm(x.double(), w1, EPS)
    exact = exact_norm(exact_total, w2, EPS2)
    for ours, theirs, truth in ((total, eager_total, exact_total), (y, eager, exact)):
        assert ours.dtype == theirs.dtype
        slack = torch.finfo(dtype).eps * truth.abs().max().item()
        assert (ours.double() - truth).abs().max() <= (theirs.double() - truth).abs().max() + slack


def test_the_pytorch_implementation_equals_the_two_ops():
    """Where the kernels do not run (fp64 here), the PyTorch implementation computes what the two ops compute."""
    x, r = _randn(5, 33, dtype=torch.float64, seed=15), _randn(5, 33, dtype=torch.float64, seed=16)
    w1, w2, b1, b2 = _parameters("layernorm", 33, torch.float64)
    ours = _fused(x, r, w1, b1, w2, b2, "layernorm")
    theirs = _two_ops(x, r, w1, b1, w2, b2, "layernorm")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_operator_passes_opcheck():
    x, r = _randn(3, 40, seed=17).requires_grad_(), _randn(3, 40, seed=18).requires_grad_()
    w1, w2 = (w.requires_grad_() for w in _parameters("gemma", 40, torch.float32)[:2])
    torch.library.opcheck(library.op("norm_add_norm_fwd"), (x, r, w1, None, EPS, w2, None, EPS2, "gemma"))


def test_a_mismatched_second_weight_names_the_problem():
    x, r = _randn(2, 16, seed=19), _randn(2, 16, seed=20)
    with pytest.raises(ValueError, match="weight"):
        norm_add_norm(x, r, None, EPS, bias=None, weight2=_randn(15, seed=21), eps2=EPS2, bias2=None, mode="gemma")


def test_torch_compile_records_the_operator_and_the_two_backwards():
    """A compiled call (fullgraph) on the CPU is the opaque custom op, and its backward the two norms' backward ops:
    the values and gradients of the eager call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ops = []

    def capture(gm, _example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm)

    x, r = _randn(3, 16, dtype=torch.bfloat16, seed=22), _randn(3, 16, dtype=torch.bfloat16, seed=23)
    w1, w2, _, _ = _parameters("gemma", 16, torch.bfloat16)

    def loss(*leaves):
        y, total = _fused(*leaves[:3], None, leaves[3], None, "gemma")
        return (y.float() * 2 + total.float()).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    results = []
    for fn in (compiled, loss):
        leaves = _leaves(x, r, w1, w2)
        value = fn(*leaves)
        results.append((value, *torch.autograd.grad(value, leaves)))
    assert str(library.op("norm_add_norm_fwd").default) in ops and ops.count(str(library.op("norm_bwd").default)) == 2
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_an_eager_call_without_gradient_is_bound_once_and_computes_as_the_general_path(monkeypatch):
    """``BoundNorm.norm_add_norm``: the first call takes the general path and binds the launch; later calls with
    the same dtypes, devices and width launch it directly, with the values of the general path and each call's
    own eps; one whose residual has another shape still takes the general path, and its error."""
    from hf_rmsnorm.ops import functional

    x, r = _randn(5, 96, dtype=torch.bfloat16, seed=24), _randn(5, 96, dtype=torch.bfloat16, seed=25)
    w1, w2, _, _ = _parameters("gemma", 96, torch.bfloat16)

    def call(eps2=EPS2, residual=r):
        return norm_add_norm(x, residual, w1, EPS, bias=None, weight2=w2, eps2=eps2, bias2=None, mode="gemma")

    with torch.no_grad():
        call()  # binds
        general = []
        real = functional._norm_add_norm
        monkeypatch.setattr(functional, "_norm_add_norm", lambda *args: general.append(args) or real(*args))
        bound = [call(), call(eps2=0.5)]
        assert not general
        monkeypatch.setattr(functional, "_norm_add_norm", real)
        expected = [_two_ops(x, r, w1, None, w2, None, "gemma"),
                    (norm(norm_add(x, r, w1, EPS, bias=None, mode="gemma"), w2, 0.5, bias=None, mode="gemma"),)]
        assert all(torch.equal(a, b) for got, want in zip(bound, expected) for a, b in zip(got, want))
        with pytest.raises(ValueError, match="shape"):
            call(residual=r[:4])
