"""Bad arguments fail with one clear error, the same on every path, before a kernel could read out of bounds.

Every bad case runs through every way into the ops: the public functions without and with autograd, a call whose
launch an earlier valid one bound (``BoundNorm``, what a patched norm's repeated calls find), the custom ops called
directly, their fake implementations (what ``torch.compile`` traces) and a ``torch.compile(fullgraph=True)`` call;
and on both implementations: fp32 tensors run the Triton kernels (in Triton's interpreter on CPU), fp64 tensors the
PyTorch implementation. The message is asserted whole, so it is the same whichever runs.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_rmsnorm import fused_add_layer_norm, fused_add_rms_norm, layer_norm, rms_norm
from hf_rmsnorm.ops import library, reference
from hf_rmsnorm.ops.functional import BoundNorm, fused_add_norm, norm
from hf_rmsnorm.ops.modes import MODES
from hf_rmsnorm.ops.backend import kernels_interpreted, runs_kernels

pytestmark = pytest.mark.skipif(
    not kernels_interpreted() and not torch.cuda.is_available(), reason="kernels need a GPU or Triton's interpreter"
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
DEVICE_NAME = str(torch.empty(0, device=DEVICE).device)  # "cuda:0", as messages print a tensor's device
# On DEVICE the dtype decides the implementation: the kernels load fp32, fp64 runs the PyTorch implementation.
BACKENDS = {"kernels": torch.float32, "pytorch": torch.float64}
ROWS, HIDDEN, EPS = 4, 64, 1e-6
FLOATS = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"


def _t(*shape: int, dtype: torch.dtype, device: str = DEVICE, seed: int = 0) -> torch.Tensor:
    if not dtype.is_floating_point:
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Case:
    """A bad call: valid arguments with ``changes(dtype)`` applied, and the error it must raise. ``message`` may
    use ``{op}`` (the public function's name) and ``{device}`` (the device of the valid tensors)."""

    id: str
    changes: Callable[[torch.dtype], dict] = field(repr=False)
    error: type[Exception]
    message: str
    fused_only: bool = False  # a case about the residual

    def expected(self, op: str) -> str:
        return self.message.format(op=op, device=DEVICE_NAME)


FORWARD_CASES = [
    Case("weight[32]", lambda d: {"weight": _t(32, dtype=d)}, ValueError,
         "{op}: weight has shape (32,) but x's last dimension is 64; weight must be 1-D of size 64"),
    Case("weight[128]", lambda d: {"weight": _t(128, dtype=d)}, ValueError,
         "{op}: weight has shape (128,) but x's last dimension is 64; weight must be 1-D of size 64"),
    Case("weight[64,2]", lambda d: {"weight": _t(64, 2, dtype=d)}, ValueError,
         "{op}: weight has shape (64, 2) but x's last dimension is 64; weight must be 1-D of size 64"),
    Case("weight[]", lambda d: {"weight": _t(dtype=d)}, ValueError,
         "{op}: weight has shape () but x's last dimension is 64; weight must be 1-D of size 64"),
    Case("bias[32]", lambda d: {"bias": _t(32, dtype=d)}, ValueError,
         "{op}: bias has shape (32,) but x's last dimension is 64; bias must be 1-D of size 64"),
    Case("residual[4,32]", lambda d: {"residual": _t(4, 32, dtype=d)}, ValueError,
         "{op}: residual has shape (4, 32) but x has shape (4, 64); residual must have exactly x's shape",
         fused_only=True),
    # Broadcastable, which the PyTorch implementation used to accept and the kernels read out of bounds.
    Case("residual[64]", lambda d: {"residual": _t(64, dtype=d)}, ValueError,
         "{op}: residual has shape (64,) but x has shape (4, 64); residual must have exactly x's shape",
         fused_only=True),
    Case("x[] (0-d)", lambda d: {"x": _t(dtype=d)}, ValueError,
         "{op}: x is 0-dimensional; x must have at least 1 dimension (the normalised one)"),
    Case("weight on meta", lambda d: {"weight": _t(HIDDEN, dtype=d, device="meta")}, ValueError,
         "{op}: weight is on meta but x is on {device}; all tensors must be on one device"),
    Case("bias on meta", lambda d: {"bias": _t(HIDDEN, dtype=d, device="meta")}, ValueError,
         "{op}: bias is on meta but x is on {device}; all tensors must be on one device"),
    Case("residual on meta", lambda d: {"residual": _t(ROWS, HIDDEN, dtype=d, device="meta")}, ValueError,
         "{op}: residual is on meta but x is on {device}; all tensors must be on one device", fused_only=True),
    # The residual moves too, so both ops report the weight as the first tensor off x's device.
    Case("x, residual on meta", lambda d: {"x": _t(ROWS, HIDDEN, dtype=d, device="meta"),
                                           "residual": _t(ROWS, HIDDEN, dtype=d, device="meta")}, ValueError,
         "{op}: weight is on {device} but x is on meta; all tensors must be on one device"),
    Case("int64 weight", lambda d: {"weight": _t(HIDDEN, dtype=torch.int64)}, TypeError,
         "{op}: weight has dtype torch.int64; the norms take " + FLOATS),
    Case("int32 x", lambda d: {"x": _t(ROWS, HIDDEN, dtype=torch.int32)}, TypeError,
         "{op}: x has dtype torch.int32; the norms take " + FLOATS),
    Case("bool residual", lambda d: {"residual": _t(ROWS, HIDDEN, dtype=torch.bool)}, TypeError,
         "{op}: residual has dtype torch.bool; the norms take " + FLOATS, fused_only=True),
    Case("eps=-1", lambda d: {"eps": -1.0}, ValueError, "{op}: eps is -1.0; eps must be a finite number >= 0"),
    Case("eps=nan", lambda d: {"eps": math.nan}, ValueError, "{op}: eps is nan; eps must be a finite number >= 0"),
    Case("eps=inf", lambda d: {"eps": math.inf}, ValueError, "{op}: eps is inf; eps must be a finite number >= 0"),
]


def _forward_args(dtype: torch.dtype, case: Case | None = None) -> dict:
    args = {"x": _t(ROWS, HIDDEN, dtype=dtype, seed=1), "residual": _t(ROWS, HIDDEN, dtype=dtype, seed=2),
            "weight": _t(HIDDEN, dtype=dtype, seed=3), "bias": None, "eps": EPS}
    return args if case is None else {**args, **case.changes(dtype)}


def _public(op: str, a: dict):
    if op == "rms_norm":
        return rms_norm(a["x"], a["weight"], a["eps"], bias=a["bias"])
    if op == "layer_norm":
        return layer_norm(a["x"], a["weight"], a["bias"], a["eps"])
    if op == "fused_add_layer_norm":
        return fused_add_layer_norm(a["x"], a["residual"], a["weight"], a["bias"], a["eps"])
    return fused_add_rms_norm(a["x"], a["residual"], a["weight"], a["eps"], bias=a["bias"])


def _custom_op(op: str, a: dict):
    # The LayerNorm functions run the same custom ops in the LayerNorm mode, whose errors name them.
    mode = "layernorm" if op.endswith("layer_norm") else "llama"
    if op in ("rms_norm", "layer_norm"):
        return library.op("norm_fwd")(a["x"], a["weight"], a["bias"], a["eps"], mode)
    return library.op("add_norm_fwd")(a["x"], a["residual"], a["weight"], a["bias"], a["eps"], mode)


def _with_grad(a: dict) -> dict:
    """The arguments with the first floating one of ``x`` and ``weight`` requiring grad (the autograd path)."""
    a = dict(a)
    key = "x" if a["x"].is_floating_point() else "weight"
    a[key] = a[key].detach().requires_grad_()
    return a


def _faked(a: dict) -> tuple[dict, FakeTensorMode]:
    """The arguments as fake tensors, and the mode to call the op in: it then runs its fake implementation."""
    mode = FakeTensorMode()
    return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}, mode


_BOUND = {mode: BoundNorm(mode) for mode in ("llama", "layernorm")}


def _bound(op: str, a: dict, dtype: torch.dtype):
    """``op`` as a patched norm calls it (``BoundNorm``, no gradient), after a call with valid arguments of
    ``dtype`` bound its launch: a call that differs from it only where the binding cannot see finds it bound."""
    bound = _BOUND["layernorm" if op.endswith("layer_norm") else "llama"]

    def call(a: dict):
        if op in ("rms_norm", "layer_norm"):
            return bound.norm(a["x"], a["weight"], a["eps"], a["bias"])
        return bound.fused_add_norm(a["x"], a["residual"], a["weight"], a["eps"], a["bias"])

    with torch.no_grad():
        call(_forward_args(dtype))
        return call(a)


def _run_forward(path: str, op: str, a: dict, dtype: torch.dtype):
    if path == "eager":
        return _public(op, a)
    if path == "bound":
        return _bound(op, a, dtype)
    if path == "autograd":
        return _public(op, _with_grad(a))
    if path == "custom_op":
        return _custom_op(op, a)
    if path == "fake":
        fake_args, mode = _faked(a)
        with mode:
            return _custom_op(op, fake_args)
    raise AssertionError(path)


FORWARD_PATHS = ["eager", "autograd", "bound", "custom_op", "fake"]
FORWARD_OPS = ["rms_norm", "fused_add_rms_norm", "layer_norm", "fused_add_layer_norm"]


FORWARD_PARAMS = [
    pytest.param(case, op, id=f"{op}-{case.id}")
    for case in FORWARD_CASES
    for op in FORWARD_OPS
    if op.startswith("fused_add") or not case.fused_only
]


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def dtype(request) -> torch.dtype:
    dtype = BACKENDS[request.param]
    assert runs_kernels(_t(1, dtype=dtype)) == (request.param == "kernels")
    return dtype


@pytest.mark.parametrize("path", FORWARD_PATHS)
def test_valid_arguments_pass_every_path(path, dtype):
    """The starting point of every bad case runs; only the change a case makes can fail it."""
    for op in FORWARD_OPS:
        _run_forward(path, op, _forward_args(dtype), dtype)


@pytest.mark.parametrize("path", FORWARD_PATHS)
@pytest.mark.parametrize("case, op", FORWARD_PARAMS)
def test_bad_forward_arguments_raise_one_clear_error(case, op, path, dtype):
    with pytest.raises(case.error) as excinfo:
        _run_forward(path, op, _forward_args(dtype, case), dtype)
    assert str(excinfo.value) == case.expected(op)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case, op", FORWARD_PARAMS)
def test_bad_forward_arguments_fail_torch_compile_with_the_message(case, op, dtype, fresh_dynamo):
    """The fake implementation raises while Dynamo traces; Dynamo wraps the error (a ``TorchRuntimeError``)
    but quotes it, type and message."""
    compiled = torch.compile(lambda a: _public(op, a), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as excinfo:
        compiled(_forward_args(dtype, case))
    assert f"got {case.error.__name__}(" in str(excinfo.value)
    assert case.expected(op) in str(excinfo.value)


def test_compiled_calls_with_symbolic_sizes_and_eps_still_run(fresh_dynamo):
    """With dynamic shapes the checks compare symbolic sizes and eps may be a symbolic float: valid calls still
    compile and run (the real implementation checks again, with real tensors)."""
    compiled = torch.compile(lambda x, r, w, eps: fused_add_rms_norm(x, r, w, eps), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    w = _t(16, dtype=torch.float32, seed=4)
    for rows, eps in ((3, 1e-6), (5, 1e-5)):
        x, r = _t(rows, 16, dtype=torch.float32, seed=5), _t(rows, 16, dtype=torch.float32, seed=6)
        for got, expected in zip(compiled(x, r, w, eps), fused_add_rms_norm(x, r, w, eps)):
            torch.testing.assert_close(got, expected)
    with pytest.raises(Exception, match=r"weight has shape \(8,\) but x's last dimension is 16"):
        compiled(x, r, _t(8, dtype=torch.float32), EPS)


BACKWARD_CASES = [
    Case("dy[4,32]", lambda d: {"dy": _t(4, 32, dtype=d)}, ValueError,
         "norm_bwd: dy has shape (4, 32) but norm_input has shape (4, 64); dy must have exactly norm_input's "
         "shape"),
    Case("dsum[64]", lambda d: {"dsum": _t(64, dtype=d)}, ValueError,
         "norm_bwd: dsum has shape (64,) but norm_input has shape (4, 64); dsum must have exactly norm_input's "
         "shape"),
    Case("stats[3]", lambda d: {"stats": _t(3, dtype=torch.float32)}, ValueError,
         "norm_bwd: stats has shape (3,) but mode 'llama' saves (8,) for norm_input of shape (4, 64)"),
    Case("layernorm with llama's stats", lambda d: {"mode": "layernorm"}, ValueError,
         "norm_bwd: stats has shape (8,) but mode 'layernorm' saves (12,) for norm_input of shape (4, 64)"),
    Case("weight[32]", lambda d: {"weight": _t(32, dtype=d)}, ValueError,
         "norm_bwd: weight has shape (32,) but norm_input's last dimension is 64; weight must be 1-D of size 64"),
    Case("norm_input on meta", lambda d: {"norm_input": _t(ROWS, HIDDEN, dtype=d, device="meta")}, ValueError,
         "norm_bwd: norm_input is on meta but dy is on {device}; all tensors must be on one device"),
    Case("int64 dy", lambda d: {"dy": _t(ROWS, HIDDEN, dtype=torch.int64)}, TypeError,
         "norm_bwd: dy has dtype torch.int64; the norms take " + FLOATS),
    Case("unknown mode", lambda d: {"mode": "olmo"}, ValueError, "unknown mode 'olmo': use one of llama, gemma, "
         "fp32_affine, layernorm_fp32, layernorm, layernorm_as_rmsnorm, t5, deberta"),
]


def _backward_args(dtype: torch.dtype, case: Case | None = None) -> dict:
    args = {"dy": _t(ROWS, HIDDEN, dtype=dtype, seed=7), "dsum": None,
            "norm_input": _t(ROWS, HIDDEN, dtype=dtype, seed=8),
            "stats": MODES["llama"].pack_stats(_t(ROWS, dtype=torch.float32, seed=9).abs() + 0.5, None),
            "weight": _t(HIDDEN, dtype=dtype, seed=10),
            "bias_dtype": None, "mode": "llama", "dx_dtype": dtype, "dres_dtype": None,
            "round_before_dsum": False}
    return args if case is None else {**args, **case.changes(dtype)}


def _run_backward(path: str, a: dict):
    if path == "fake":
        a, mode = _faked(a)
        with mode:
            return library.op("norm_bwd")(**a)
    return library.op("norm_bwd")(**a)


@pytest.mark.parametrize("path", ["custom_op", "fake"])
def test_valid_backward_arguments_pass(path, dtype):
    dx, _, dweight, _ = _run_backward(path, _backward_args(dtype))
    assert dx.shape == (ROWS, HIDDEN) and dweight.shape == (HIDDEN,)


@pytest.mark.parametrize("path", ["custom_op", "fake"])
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda case: case.id)
def test_bad_backward_arguments_raise_one_clear_error(case, path, dtype):
    """Autograd always hands the backward consistent tensors; a direct call of the op must not read out of
    bounds either."""
    with pytest.raises(case.error) as excinfo:
        _run_backward(path, _backward_args(dtype, case))
    assert str(excinfo.value) == case.expected("norm_bwd")


ODD_SHAPES = {
    "3-D": lambda d, seed: _t(2, 3, HIDDEN, dtype=d, seed=seed),
    "1-D": lambda d, seed: _t(HIDDEN, dtype=d, seed=seed),
    "hidden 1": lambda d, seed: _t(5, 1, dtype=d, seed=seed),
    # Row stride 128 with a contiguous last dimension: read in place.
    "strided rows": lambda d, seed: _t(ROWS, 2 * HIDDEN, dtype=d, seed=seed)[:, :HIDDEN],
    # Last dimension not contiguous: the launcher copies it.
    "transposed": lambda d, seed: _t(HIDDEN, ROWS, dtype=d, seed=seed).t(),
    "0 rows": lambda d, seed: _t(0, HIDDEN, dtype=d),
    "2x0 rows": lambda d, seed: _t(2, 0, HIDDEN, dtype=d),
}


@pytest.mark.parametrize("mode", ["llama", "layernorm"])
@pytest.mark.parametrize("shape", list(ODD_SHAPES))
def test_valid_odd_shapes_still_work(shape, mode, dtype):
    """Odd but valid layouts pass the checks on both implementations and give what the kernels' maths spelt out in
    PyTorch gives (``reference.stepwise_output``: not torch's own LayerNorm, whose ``x * scale + shift`` is far
    from exact on a row of one element), forward and backward (the layernorm mode saves the row means with
    ``rstd``, which the backward's check must accept)."""
    x = ODD_SHAPES[shape](dtype, 13).requires_grad_()
    residual = ODD_SHAPES[shape](dtype, 14).requires_grad_()
    n = x.shape[-1]
    weight = _t(n, dtype=dtype, seed=16).requires_grad_()
    bias = _t(n, dtype=dtype, seed=17).requires_grad_() if mode == "layernorm" else None
    inputs = (x, residual, weight) if bias is None else (x, residual, weight, bias)
    # The kernels and the PyTorch implementation sum in another order; llama mode normalises fp64 in fp32 too.
    tol = {"rtol": 1e-5, "atol": 1e-5}

    y, new_residual = fused_add_norm(x, residual, weight, EPS, bias=bias, mode=mode)
    sum_ref = residual + x
    y_ref = reference.stepwise_output(sum_ref, weight, bias, EPS, mode)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(new_residual, sum_ref, **tol)
    torch.testing.assert_close(norm(x, weight, EPS, bias=bias, mode=mode),
                               reference.stepwise_output(x, weight, bias, EPS, mode), **tol)

    dy = _t(*y.shape, dtype=y.dtype, seed=15)
    grads = torch.autograd.grad((y, new_residual), inputs, (dy, torch.ones_like(new_residual)), allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref, sum_ref), inputs, (dy, torch.ones_like(sum_ref)), allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref, **tol)


# eps 0 divides by zero in the interpreter's padding rows (masked off, as on a GPU), which numpy warns about.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_eps_zero_and_mixed_dtypes_are_valid():
    """The boundaries of the checks: eps 0 is allowed, and so are mixed floating dtypes (torch promotion)."""
    x = _t(ROWS, HIDDEN, dtype=torch.bfloat16, seed=18)
    residual, weight = _t(ROWS, HIDDEN, dtype=torch.float32, seed=19), _t(HIDDEN, dtype=torch.float32, seed=20)
    y, new_residual = fused_add_rms_norm(x, residual, weight, 0.0)
    y_ref, sum_ref, _ = reference.forward_reference(x, residual, weight, None, 0.0, "llama")
    assert y.dtype == y_ref.dtype and new_residual.dtype == sum_ref.dtype
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(new_residual, sum_ref)
