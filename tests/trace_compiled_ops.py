"""Traces compiled norm calls on (fake) GPU tensors and prints, as JSON, what the graphs inductor would get contain.

Run as a script by tests/ops/test_triton_ops.py, in a process of its own: the kernels must be defined for a GPU
(``wrap_triton`` traces compiled Triton kernels only), while the test session runs them in the interpreter.
No GPU is needed: the inputs are fake CUDA tensors, which carry shapes and dtypes but no data, and where no GPU
driver is present Triton is told to generate code for an H100 (sm_90), as torch's analysis of which arguments a
kernel writes compiles the kernel to Triton's IR. The graphs are captured after AOTAutograd, where a Triton op
has been traced into: what inductor compiles.

Each case prints ``{"hops": [...], "outputs": [...], "ops": [...]}``: the kernel launches recorded (kernel, the
arguments torch found it writes, its constexpr flags, its None arguments and its symbolic sizes), where each
graph output comes from (``kernel:ARG`` for a kernel's output, else the aten op that made it) and every operator
left in the graph.
"""

from __future__ import annotations

import json
import sys

import torch

from hf_rmsnorm.ops import backend

backend.configure("cuda")

from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from hf_rmsnorm import fused_add_layer_norm, fused_add_rms_norm, rms_norm, rms_norm_add  # noqa: E402
from hf_rmsnorm.ops import functional, launch, library  # noqa: E402
from hf_rmsnorm.ops.modes import MODES  # noqa: E402

HIDDEN = 64
ROWS = 5
FLAGS = ("HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "ADD_AFTER", "HAS_DSUM", "HAS_DRES", "CENTER")


def _without_a_gpu() -> None:
    """Triton's code generation for an H100, and its SM count, where no GPU driver is present."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _H100Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_benchmarker(self):  # Triton < 3.3's autotuners keep it (torch wraps num_warps in one); never run
            def benchmark(*_args, **_kwargs):
                raise RuntimeError("no GPU to benchmark on")
            return benchmark

    triton.runtime.driver.set_active(_H100Target())
    launch._sm_count = lambda _index: 132


def _describe(gm: torch.fx.GraphModule) -> dict:
    hops, ops = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
            arguments = {**node.kwargs["kwargs"], **constants}
            hops.append({
                "kernel": kernel.fn.__name__,
                "writes": sorted(node.kwargs["tensors_to_clone"]),
                "flags": {name: arguments[name] for name in FLAGS if name in arguments},
                "none": sorted(name for name, value in arguments.items() if value is None),
                "symbolic": sorted(name for name, value in arguments.items() if isinstance(value, torch.fx.Node)
                                   and not isinstance(value.meta.get("val"), torch.Tensor)),
            })
        ops.append(str(node.target))

    def origin(node) -> str:
        if node.target.__name__ == "getitem" and node.args[0].target is (
                torch.ops.higher_order.triton_kernel_wrapper_functional):
            return f"{kernel_side_table.get_kernel(node.args[0].kwargs['kernel_idx']).fn.__name__}:{node.args[1]}"
        return str(node.target)

    output, = (node for node in gm.graph.nodes if node.op == "output")
    return {"hops": hops, "outputs": [origin(arg) for arg in output.args[0]], "ops": ops}


def _trace(fn, *shapes_dtypes, dynamic: bool = False) -> dict:
    """The forward graph of ``torch.compile(fn, dynamic=dynamic)`` on fake CUDA tensors of these shapes and dtypes
    (None stays None), without gradients: fake CUDA tensors cannot take part in autograd on a CPU-only torch
    build."""
    graphs = []

    def capture(gm, _example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with FakeTensorMode():
        args = [None if spec is None else torch.empty(spec[0], dtype=spec[1], device="cuda")
                for spec in shapes_dtypes]
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True, dynamic=dynamic)(*args)
    graph, = graphs
    return _describe(graph)


class _Context:
    """What the setup and backward functions use of autograd's context (fake CUDA tensors cannot take part in
    autograd on a CPU-only torch build, so the backward is called as the autograd engine would call it)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, _value):
        pass


def rms_norm_backward(dy, x, weight, rstd):
    ctx = _Context()
    functional._norm_setup(ctx, (x, weight, None, 1e-6, "llama"), (None, rstd))
    return [g for g in functional._norm_backward(ctx, dy, None) if g is not None]


def fused_add_backward(dy, dsum, x, residual, weight, new_residual, rstd):
    ctx = _Context()
    functional._add_norm_setup(ctx, (x, residual, weight, None, 1e-6, "llama"), (None, new_residual, rstd))
    return [g for g in functional._add_norm_backward(ctx, dy, dsum, None) if g is not None]


def main() -> None:
    if not torch.cuda.is_available():
        _without_a_gpu()
    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    rows, row = (ROWS, HIDDEN), (HIDDEN,)
    stats = MODES["llama"].stats_shape(torch.Size(rows))
    cases = {
        "rms_norm": _trace(lambda x, w: rms_norm(x, w), (rows, bf16), (row, bf16)),
        "rms_norm_weightless": _trace(lambda x: rms_norm(x, None), (rows, bf16)),
        "rms_norm_gemma_fp32_weight": _trace(lambda x, w: rms_norm(x, w, mode="gemma"), (rows, bf16), (row, fp32)),
        "fused_add_rms_norm": _trace(lambda x, r, w: fused_add_rms_norm(x, r, w), (rows, bf16), (rows, bf16),
                                     (row, bf16)),
        "fused_add_layernorm": _trace(fused_add_layer_norm, (rows, fp16), (rows, fp32), (row, fp32), (row, fp32)),
        "rms_norm_add": _trace(lambda x, r, w: rms_norm_add(x, r, w), (rows, bf16), (rows, bf16), (row, bf16)),
        "rms_norm_add_fp32_residual": _trace(lambda x, r, w: rms_norm_add(x, r, w), (rows, bf16), (rows, fp32),
                                             (row, bf16)),
        # Every size symbolic: the graph is specialised on the width (the tiling depends on it), not on the rows.
        "fused_add_rms_norm_dynamic": _trace(lambda x, r, w: fused_add_rms_norm(x, r, w), (rows, bf16),
                                             (rows, bf16), (row, bf16), dynamic=True),
        # A sandwich norm's two norms and the add between them: one launch.
        "norm_add_norm": _trace(lambda x, r, w, w2: functional.norm_add_norm(
            x, r, w, 1e-6, bias=None, weight2=w2, eps2=1e-5, bias2=None, mode="gemma"), (rows, bf16), (rows, bf16),
            (row, fp32), (row, fp32)),
        "rms_norm_fp64": _trace(lambda x, w: rms_norm(x, w), (rows, fp64), (row, fp64)),
        "rms_norm_backward": _trace(rms_norm_backward, (rows, bf16), (rows, bf16), (row, bf16), (stats, fp32)),
        # A bf16 input added to an fp32 residual: the residual's gradient (fp32) is written apart from x's (bf16).
        "fused_add_backward": _trace(fused_add_backward, (rows, fp32), (rows, fp32), (rows, bf16), (rows, fp32),
                                     (row, fp32), (rows, fp32), (stats, fp32)),
        "fused_add_backward_dynamic": _trace(fused_add_backward, (rows, fp32), (rows, fp32), (rows, bf16),
                                             (rows, fp32), (row, fp32), (rows, fp32), (stats, fp32), dynamic=True),
    }
    kernels = {name: [k.fn.__name__ for k in torch._library.triton.get_triton_kernels_for_op(library.qualified_name(name))]
               for name in ("norm_fwd_triton", "add_norm_fwd_triton", "norm_add_fwd_triton",
                            "norm_add_norm_fwd_triton", "norm_bwd_triton")}
    json.dump({"cases": cases, "kernels_of_ops": kernels}, sys.stdout)


if __name__ == "__main__":
    main()
