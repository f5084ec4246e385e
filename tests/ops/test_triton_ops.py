"""What torch.compile records of a norm: on a GPU the Triton ops, traced down to the kernel launches (inductor then
launches the kernels from its own code and CUDA graphs capture them), elsewhere the opaque custom ops.

Without a GPU the GPU side is checked on fake CUDA tensors in a process of its own (tests/trace_compiled_ops.py):
the graphs AOTAutograd hands to inductor, with torch's own analysis of which arguments each kernel writes.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from launching import TESTS, once_per_session

from hf_rmsnorm import fused_add_rms_norm, rms_norm
from hf_rmsnorm.ops import functional, launch, library

TRACE_SCRIPT = TESTS / "trace_compiled_ops.py"
FWD, BWD = "norm_fwd_kernel", "norm_bwd_kernel"
ROW_DOT, COLUMN_BWD = "row_dot_kernel", "column_bwd_kernel"  # the backward of rows wider than one tile
SANDWICH = "norm_add_norm_fwd_kernel"

# case: (each kernel launched, in order, with the arguments it writes; where each graph output comes from)
KERNEL_CASES = {
    "rms_norm": ([(FWD, ["STATS", "Y"])], [f"{FWD}:Y"]),
    "rms_norm_weightless": ([(FWD, ["STATS", "Y"])], [f"{FWD}:Y"]),
    "rms_norm_gemma_fp32_weight": ([(FWD, ["STATS", "Y"])], [f"{FWD}:Y"]),
    "fused_add_rms_norm": ([(FWD, ["STATS", "SUM_OUT", "Y"])], [f"{FWD}:Y", f"{FWD}:SUM_OUT"]),
    "fused_add_layernorm": ([(FWD, ["STATS", "SUM_OUT", "Y"])], [f"{FWD}:Y", f"{FWD}:SUM_OUT"]),
    "fused_add_rms_norm_dynamic": ([(FWD, ["STATS", "SUM_OUT", "Y"])], [f"{FWD}:Y", f"{FWD}:SUM_OUT"]),
    "rms_norm_add": ([(FWD, ["STATS", "Y"])], [f"{FWD}:Y"]),
    # The norm's output (bf16) is not the residual's dtype: the kernel normalises, torch adds.
    "rms_norm_add_fp32_residual": ([(FWD, ["STATS", "Y"])], ["aten.add.Tensor"]),
    # A sandwich's norm, add and next norm: one launch writing the sum, the output and both norms' statistics.
    "norm_add_norm": ([(SANDWICH, ["STATS", "STATS2", "SUM_OUT", "Y"])], [f"{SANDWICH}:Y", f"{SANDWICH}:SUM_OUT"]),
    # One launch, which also sums the programs' weight-gradient partial rows, counting on SYNC: fresh zeros in a
    # traced graph, so that the statistics, an input of the backward graph, are only read.
    "rms_norm_backward": ([(BWD, ["DW", "DW_PARTIAL", "DX", "SYNC"])], [f"{BWD}:DX", f"{BWD}:DW"]),
    "fused_add_backward": ([(BWD, ["DRES", "DW", "DW_PARTIAL", "DX", "SYNC"])],
                           [f"{BWD}:DX", f"{BWD}:DRES", f"{BWD}:DW"]),
    "fused_add_backward_dynamic": ([(BWD, ["DRES", "DW", "DW_PARTIAL", "DX", "SYNC"])],
                                   [f"{BWD}:DX", f"{BWD}:DRES", f"{BWD}:DW"]),
}


def _trace(out: Path) -> None:
    result = subprocess.run([sys.executable, str(TRACE_SCRIPT)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (out / "traced.json").write_text(result.stdout)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    """What trace_compiled_ops.py printed, traced once in a session."""
    return json.loads((once_per_session(tmp_path_factory, "traced-ops", _trace) / "traced.json").read_text())


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_compiled_calls_on_a_gpu_trace_into_the_kernel_launch(traced, case):
    """The kernel launches in the graph inductor gets, no custom op left; torch's analysis finds that each
    kernel writes its outputs and nothing else (an input it thought written would be cloned and copied back),
    and each output of the graph is the kernel argument it should be."""
    launches, outputs = KERNEL_CASES[case]
    graph = traced["cases"][case]
    assert [(hop["kernel"], hop["writes"]) for hop in graph["hops"]] == launches
    assert graph["outputs"] == outputs
    assert not [op for op in graph["ops"] if "hf_rmsnorm" in op]


def test_unused_kernel_pointers_are_none_so_no_tensor_is_passed_twice(traced):
    """Two arguments naming one tensor, one of them written, would leave it to torch which clone the graph reads."""
    assert traced["cases"]["rms_norm"]["hops"][0]["none"] == ["B", "RESIDUAL", "SUM_OUT"]
    assert traced["cases"]["rms_norm_add"]["hops"][0]["none"] == ["B", "SUM_OUT"]
    assert traced["cases"]["rms_norm_backward"]["hops"][0]["none"] == ["DB", "DB_PARTIAL", "DRES", "DSUM"]


def test_the_kernels_flags_follow_the_call(traced):
    flags = {case: traced["cases"][case]["hops"][0]["flags"] for case in KERNEL_CASES}
    assert flags["fused_add_rms_norm"]["HAS_RESIDUAL"] and not flags["rms_norm"]["HAS_RESIDUAL"]
    assert not flags["rms_norm_weightless"]["HAS_WEIGHT"]
    assert flags["fused_add_layernorm"]["CENTER"] and flags["fused_add_layernorm"]["HAS_BIAS"]
    assert flags["rms_norm_add"]["ADD_AFTER"] and not flags["rms_norm_add_fp32_residual"]["ADD_AFTER"]
    assert flags["fused_add_backward"]["HAS_DSUM"] and flags["fused_add_backward"]["HAS_DRES"]


def test_dynamic_shapes_keep_the_rows_symbolic_and_specialise_the_width(traced):
    """``dynamic=True``: the width sets the kernel's tiling, so the graph is specialised on it (another width
    recompiles); the row count stays symbolic, so other batch and sequence sizes reuse the graph."""
    assert traced["cases"]["fused_add_rms_norm"]["hops"][0]["symbolic"] == []
    assert traced["cases"]["fused_add_rms_norm_dynamic"]["hops"][0]["symbolic"] == ["n_rows"]
    assert traced["cases"]["fused_add_backward_dynamic"]["hops"][0]["symbolic"] == ["n_row_blocks", "n_rows"]


def test_dtypes_the_kernels_do_not_load_trace_to_aten_ops(traced):
    """fp64 runs the PyTorch implementation, which the Triton op traces into like any other torch code."""
    graph = traced["cases"]["rms_norm_fp64"]
    assert graph["hops"] == [] and "aten.rsqrt.default" in graph["ops"]
    assert not [op for op in graph["ops"] if "hf_rmsnorm" in op]


def test_torch_finds_the_kernels_of_each_triton_op(traced):
    """torch keys its compile caches on the source of a Triton op's kernels, which it finds by reading the op's
    code: a kernel it missed would let a cache compiled with an older kernel be reused."""
    assert traced["kernels_of_ops"] == {
        "norm_fwd_triton": [FWD], "add_norm_fwd_triton": [FWD], "norm_add_fwd_triton": [FWD],
        # Rows wider than one tile: the two ops' launches.
        "norm_add_norm_fwd_triton": [SANDWICH, FWD],
        "norm_bwd_triton": [BWD, ROW_DOT, COLUMN_BWD],
    }


@pytest.mark.parametrize("name", functional._OP_NAMES)
def test_both_registrations_have_one_schema(name):
    def signature(op_name: str) -> str:  # the schema after the operator's name
        return str(library.op(op_name).default._schema).split("(", 1)[1]

    assert signature(name) == signature(f"{name}_triton")


def _compiled_ops(fn, *args) -> list[str]:
    """The operators in the graphs AOTAutograd makes of ``torch.compile(fn)``, forward and backward."""
    ops = []

    def capture(gm, _example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    compiled(*args).float().sum().backward()
    return ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side")
def test_compiled_calls_on_the_cpu_use_the_custom_ops():
    """The interpreter's kernels and the PyTorch implementation cannot be launched by inductor: on the CPU a
    compiled call is the opaque custom op, forward and backward."""
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(3, 16, dtype=torch.bfloat16)
    weight = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    ops = _compiled_ops(lambda a, r, w: fused_add_rms_norm(a, r, w)[0], x, residual, weight)
    assert str(library.op("add_norm_fwd").default) in ops and str(library.op("norm_bwd").default) in ops
    assert not [op for op in ops if "_triton" in op or "triton_kernel_wrapper" in op]


@pytest.mark.gpu
def test_inductor_launches_the_kernels_itself_with_the_eager_results(monkeypatch):
    """Compiled with inductor, forward and backward give eager's bits (the same kernels with the same flags and
    grids), and once compiled a call runs none of launch.py's Python: inductor's code launches the kernels."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(37, 1024, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    weight = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=g)
    dy, dsum = (torch.randn(37, 1024, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
        y, new_residual = fn(*leaves)
        grads = torch.autograd.grad((y, new_residual), leaves, (dy, dsum))
        return (y, new_residual, *grads)

    def block(a, r, w):
        return fused_add_rms_norm(a, r, w)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    eager, first = run(block), run(compiled)
    for got, expected in zip(first, eager):
        assert torch.equal(got, expected)

    launches = []
    original = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda *args: launches.append(args) or original(*args))
    again = run(compiled)
    assert launches == [] and all(torch.equal(a, b) for a, b in zip(again, first))
    run(block)
    # The eager forward and backward (which sums the weight gradient too) do launch through it.
    assert [args[0] for args in launches] == [launch.norm_fwd_kernel, launch.norm_bwd_kernel]


@pytest.mark.gpu
def test_cuda_graphs_capture_the_compiled_norm():
    """mode="reduce-overhead": the compiled call is replayed from a CUDA graph and still gives eager's bits."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, w: rms_norm(a, w) * 1, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        expected = rms_norm(x, weight)
        for _ in range(3):  # recorded, then replayed
            got = compiled(x, weight)
    assert torch.equal(got, expected)


def _opcheck_args(device: str):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(3, 40, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
    weight = torch.randn(40, generator=g).to(device, torch.float32).requires_grad_()
    return {
        "norm_fwd": (x, weight, None, 1e-6, "gemma"),
        "add_norm_fwd": (x, residual, weight, None, 1e-6, "llama"),
        "norm_add_fwd": (x, residual.detach().to(torch.float32).requires_grad_(), weight, None, 1e-6, "llama"),
        "norm_add_norm_fwd": (x, residual, weight, None, 1e-6, weight.detach().flip(0).requires_grad_(), None, 1e-5,
                              "gemma"),
    }


@pytest.mark.parametrize("name", ["norm_fwd", "add_norm_fwd", "norm_add_fwd", "norm_add_norm_fwd"])
def test_triton_ops_schema_and_autograd_registration(name):
    """The Triton ops carry the custom ops' autograd formula (run eagerly here; their fake implementation is the
    real one traced, which needs kernels compiled for a GPU: the GPU test below checks it)."""
    op = library.op(f"{name}_triton")
    torch.library.opcheck(op, _opcheck_args("cuda" if torch.cuda.is_available() else "cpu")[name],
                          test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["norm_fwd", "add_norm_fwd", "norm_add_fwd", "norm_add_norm_fwd"])
def test_triton_ops_pass_torch_library_opcheck_on_a_gpu(name):
    torch.library.opcheck(library.op(f"{name}_triton"), _opcheck_args("cuda")[name])
