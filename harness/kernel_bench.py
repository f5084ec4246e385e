"""Times fused add + RMSNorm (forward, backward, forward+backward), and a sandwich layer's norm, add and next norm,
on a GPU against the alternatives a Hugging Face model could use, and reports each time as achieved bandwidth and
as a fraction of the card's copy bandwidth.

Implementations (``--ops``), each computing ``s = residual + x; y = norm(s)`` and returning ``(y, s)``:

* ``hf_rmsnorm``: this package's ``fused_add_rms_norm``.
* ``hf_rmsnorm_wide``: the same with its backward on the wide path (``row_dot_kernel``, then
  ``column_bwd_kernel``) at every width (``wide_backward``): the A/B of the single-tile backward (the GPU suite's
  ``kernels-bwd-ab`` section, at 16384). Its forward is ``hf_rmsnorm``'s.
* ``hf_rmsnorm_pipelined``: the same with the widest single backward tiles, which the default plan does not
  pipeline, pipelined over two row blocks (``pipelined_backward``): the other A/B of ``kernels-bwd-ab``.
* ``hf_eager``: transformers' ``LlamaRMSNorm`` module after a separate add (what an unpatched model runs).
* ``torch_rms_norm``: ``torch.nn.functional.rms_norm`` after a separate add.
* ``torch_compile``: ``torch.compile`` of the ``hf_eager`` function, add included (recompiled per shape).
* ``liger``: Liger-Kernel's ``LigerFusedAddRMSNorm`` (skipped when ``liger_kernel`` is not installed; a release
  without it gets an error row).
* ``hf_layernorm``: this package's fused add + LayerNorm (``fused_add_layer_norm``, with a bias), and
  ``torch_layer_norm``: ``torch.nn.functional.layer_norm`` after a separate add: RMSNorm against LayerNorm, each
  fused and eager, on the same shapes.

The sandwich implementations (``SANDWICH_IMPLS``) time another operator on the same inputs: a sandwich layer's
``s = residual + post_norm(x); y = pre_norm(s)`` (Gemma 2-4's post-attention norm, the add and the pre-feedforward
norm; GLM-4's), returning ``(y, s)``, both norms Gemma's (``1 + w``), and their figures are against that chain's
own minimum traffic (``sandwich_min_traffic_bytes``) and, in ``x eager``, against ``hf_eager_sandwich``:

* ``hf_sandwich``: this package's ``norm_add_norm``, one launch;
* ``hf_sandwich_2launch``: ``rms_norm_add`` then ``rms_norm`` (the two launches a patched layer ran before it);
* ``hf_eager_sandwich``: transformers' ``Gemma3RMSNorm`` modules, the post norm, the add, the pre norm (what an
  unpatched Gemma 3 layer runs).

Method: every (implementation, phase, shape) gets two figures, each the median of the repeats after a warm-up,
timed with CUDA events with the inputs flushed from L2 before every run (small problems otherwise time L2, not
memory; the flush runs before the start event, outside the timed region):

* **kernels**: the replay of a CUDA graph of the phase, so only the device work counts: what the kernels cost,
  and what a model under CUDA graphs sees;
* **call**: the same work called eagerly (the autograd call, for the backward): host time included wherever the
  GPU waits on the host (launches, Python, the autograd engine), as a model without CUDA graphs sees it.

The backward is timed alone: its forward runs once, untimed, and each run is ``torch.autograd.grad(outputs,
inputs, grad_outputs, retain_graph=True)``; its graph captures that call, so it holds the backward's kernels
(the norm's backward and its weight-gradient reduction) and nothing of the forward. Capturing autograd's call
rather than the package's backward function directly times every implementation the same way. The forward is
the inference forward (no autograd graph); ``fwd+bwd`` the training forward and its backward.

Without a GPU, ``dry_run`` runs the same code on the CPU with the kernels in Triton's interpreter: plain calls
stand in for CUDA graphs, the host clock for CUDA events, nothing is flushed, and the figures mean nothing (the
output says so); it checks the harness, not the speed.

Launch cost (the decode regime): an empty Triton kernel's launch against ``fused_add_rms_norm`` on 1-64 rows,
as GPU time under a CUDA graph and as host time per eager call, with the goal "empty launch + 2 us"; and the
host time of one decode call by each launch path (cached launcher, Triton's own, compiled through the Triton op
or through the custom op).

``run_benchmark`` is what ``scripts/bench_kernels.py`` runs; the script only reads the command line (into a
``BenchConfig``) and, without a GPU, says so and exits 0. The full default sweep takes a long time, mostly
torch.compile recompiling for every shape: restrict it with ``--rows``, ``--hidden``, ``--ops`` and ``--phases``.
With ``--json`` the file is rewritten after every shape, so a run cut short keeps what it measured.

Usage::

    python scripts/bench_kernels.py --json bench.json --plot bench.png
    python scripts/bench_kernels.py --rows 16384 --hidden 4096 --ops hf_rmsnorm hf_eager --phases fwd
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

PHASES = ("fwd", "bwd", "fwd+bwd")
# A sandwich layer's norm, add and next norm (norm_add_norm), and what it replaces; "x eager" is against the last.
SANDWICH_IMPLS = ("hf_sandwich", "hf_sandwich_2launch", "hf_eager_sandwich")
IMPLS = ("hf_rmsnorm", "hf_rmsnorm_wide", "hf_rmsnorm_pipelined", "hf_eager", "torch_rms_norm", "torch_compile",
         "liger", "hf_layernorm", "torch_layer_norm", *SANDWICH_IMPLS)
DEFAULT_ROWS = (1, 16, 256, 4096, 16384, 65536)
DEFAULT_HIDDEN = (896, 2048, 4096, 5120, 8192, 16384, 32768, 65536)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6
# The flush buffer is at least this big even if the card does not report its L2 size (covers B200's 126 MB x2).
MIN_FLUSH_BYTES = 256 * 2**20
# Copy-bandwidth probe: big enough that L2 and launch latency do not count (on the CPU of a dry run, small).
COPY_PROBE_BYTES = 2 * 2**30
DRY_RUN_COPY_PROBE_BYTES = 2**24
# Host calls per host-time figure (decode-sized calls), and in a dry run, where the interpreter takes
# milliseconds per call.
HOST_CALLS = 2000
DRY_RUN_HOST_CALLS = 3
DRY_RUN_NOTE = ("dry run on the CPU: kernels in Triton's interpreter, plain calls instead of CUDA graphs, the host "
                "clock instead of CUDA events, no L2 flush; the figures mean nothing")
# Activation-sized tensors a shape needs (x, residual, y, sum, dy, dsum, dx, dresidual), plus the fp32
# activation-sized temporaries the eager module saves or makes in its backward: only used to skip hopeless shapes.
ACTIVATION_TENSORS = 8
FP32_TEMPORARIES = 4

# Runs a callable once and returns the seconds it took.
Clock = Callable[[Callable[[], Any]], float]


# ------------------------------------------------------------------------------------------ traffic maths


def min_traffic_bytes(phase: str, rows: int, hidden: int, act_bytes: int, weight_bytes: int, *,
                      residual: bool = True) -> int:
    """Bytes the phase must move at the least.

    Forward: read ``x`` and ``residual``, write ``y`` and the sum, read the weight. Backward: read ``dy``, the
    saved sum and the gradient reaching the sum, write the input gradient (shared by ``x`` and ``residual``),
    read the weight and write its gradient. Without ``residual`` (a plain norm): the forward reads ``x`` and
    writes ``y``, the backward reads ``dy`` and ``x`` and writes ``dx``. The per-row fp32 ``rstd`` is left out
    (under 0.1% at hidden 896)."""
    forward_tensors, backward_tensors = (4, 4) if residual else (2, 3)
    forward = forward_tensors * rows * hidden * act_bytes + hidden * weight_bytes
    backward = backward_tensors * rows * hidden * act_bytes + 2 * hidden * weight_bytes
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[phase]


def sandwich_min_traffic_bytes(phase: str, rows: int, hidden: int, act_bytes: int, weight_bytes: int) -> int:
    """Bytes a sandwich layer's ``s = residual + norm(x); y = norm2(s)`` (``norm_add_norm``) must move at the least.

    Forward: read ``x`` and ``residual``, write the sum and ``y``, read both weights. Backward: read ``dy``, the
    gradient reaching the sum from its other readers and the two norms' saved inputs (``x`` and the sum), write
    the gradients of ``x`` and of ``residual`` (which differ: the first norm's backward lies between them), read
    both weights and write their gradients. The per-row fp32 statistics are left out, as in
    ``min_traffic_bytes``."""
    forward = 4 * rows * hidden * act_bytes + 2 * hidden * weight_bytes
    backward = 6 * rows * hidden * act_bytes + 4 * hidden * weight_bytes
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[phase]


def qk_min_traffic_bytes(phase: str, tokens: int, heads: int, head_dim: int, rotary_dim: int, act_bytes: int,
                         weight_bytes: int) -> int:
    """Bytes ``qk_norm_rope`` must move at the least on ``tokens`` tokens of ``heads`` q and k heads in all, per-head
    norms. Forward: read q and k, write their outputs, read ``cos`` and ``sin`` once per token and both weights.
    Backward: read the outputs' gradients and q and k, write their gradients, read ``cos``, ``sin`` and the weights
    and write the weights' gradients. The per-row fp32 ``rstd`` is left out, as in ``min_traffic_bytes``."""
    elements = tokens * heads * head_dim
    trig = 2 * tokens * rotary_dim * act_bytes
    if phase == "fwd":
        return 2 * elements * act_bytes + trig + 2 * head_dim * weight_bytes
    return 3 * elements * act_bytes + trig + 4 * head_dim * weight_bytes


def copy_traffic_bytes(nbytes: int) -> int:
    """A device-to-device copy of ``nbytes`` reads and writes each byte once."""
    return 2 * nbytes


def gbps(nbytes: int, seconds: float) -> float:
    """Achieved bandwidth in GB/s (10^9 bytes, as datasheets count)."""
    return nbytes / seconds / 1e9


def fits_in_memory(rows: int, hidden: int, act_bytes: int, free_bytes: int) -> bool:
    """Whether a shape plausibly fits; out-of-memory errors are still caught for the shapes that pass."""
    return rows * hidden * (ACTIVATION_TENSORS * act_bytes + FP32_TEMPORARIES * 4) <= free_bytes


@dataclass
class Result:
    """One timed (implementation, phase, shape): ``seconds``, ``gbps`` and ``copy_fraction`` are the kernels'
    figures (a CUDA graph's replay when ``cuda_graph``), ``call_*`` those of the eager call, host included. The
    figures are None unless ``status`` is ``"ok"``."""

    impl: str
    phase: str
    rows: int
    hidden: int
    dtype: str
    status: str
    seconds: float | None = None
    traffic_bytes: int = 0
    gbps: float | None = None
    copy_fraction: float | None = None
    cuda_graph: bool = False
    call_seconds: float | None = None
    call_gbps: float | None = None
    call_copy_fraction: float | None = None


def make_result(impl: str, phase: str, rows: int, hidden: int, dtype: str, seconds: float, call_seconds: float,
                act_bytes: int, weight_bytes: int, copy_gbps: float, cuda_graph: bool,
                traffic_bytes: int | None = None) -> Result:
    """A successful measurement with both figures' bandwidth and fraction of the copy bandwidth, against
    ``traffic_bytes`` (default: the fused add + norm's ``min_traffic_bytes``)."""
    nbytes = min_traffic_bytes(phase, rows, hidden, act_bytes, weight_bytes) if traffic_bytes is None else traffic_bytes
    achieved, call_achieved = gbps(nbytes, seconds), gbps(nbytes, call_seconds)
    return Result(impl, phase, rows, hidden, dtype, "ok", seconds, nbytes, achieved, achieved / copy_gbps, cuda_graph,
                  call_seconds, call_achieved, call_achieved / copy_gbps)


# ------------------------------------------------------------------------------------------ timing harness


def time_callable(fn: Callable[[], Any], *, clock: Clock, flush: Callable[[], Any], warmup: int,
                  repeats: int) -> float:
    """Median seconds of ``repeats`` runs of ``fn``, each after ``flush()`` and timed by ``clock(fn)``, after
    ``warmup`` untimed runs (compilation, autotuning, allocator growth)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        flush()
        samples.append(clock(fn))
    return statistics.median(samples)


def cuda_event_clock(fn: Callable[[], Any]) -> float:
    """Seconds ``fn``'s GPU work takes, from CUDA events around it on the current stream."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def wall_clock(fn: Callable[[], Any]) -> float:
    """Seconds of host time (CPU tensors, tests)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def l2_flusher(device: torch.device) -> Callable[[], Any]:
    """A function that evicts the L2 cache by reading a buffer of at least twice its size.

    Reading rather than writing matters: a written buffer leaves dirty lines in L2 whose write-back would land
    inside the next timed run and be charged to it; read lines are clean, and the previous run's dirty output
    is written back during the flush, before the timer starts."""
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    buffer = torch.ones(max(2 * l2_bytes, MIN_FLUSH_BYTES) // 4, dtype=torch.float32, device=device)
    return buffer.sum


def as_cuda_graph(make_fn: Callable[[], Callable[[], Any]]) -> Callable[[], Any]:
    """Captures the callable ``make_fn()`` returns in a CUDA graph and returns the graph's replay.

    Everything happens on one side stream: capture needs a warm-up off the default stream, and autograd runs
    each backward op on the stream of its forward op, so a backward captured on its own needs its (untimed)
    forward to have run on the capture stream too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_fn()
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def as_plain_call(make_fn: Callable[[], Callable[[], Any]]) -> Callable[[], Any]:
    """What stands in for ``as_cuda_graph`` on the CPU of a dry run: the callable itself."""
    return make_fn()


def measure_copy_gbps(device: torch.device, clock: Clock, flush: Callable[[], Any], warmup: int,
                      repeats: int, probe_bytes: int = COPY_PROBE_BYTES) -> float:
    """This device's copy bandwidth (``dst.copy_(src)`` of a large tensor), in GB/s."""
    src = torch.ones(probe_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = time_callable(lambda: dst.copy_(src), clock=clock, flush=flush, warmup=warmup, repeats=repeats)
    return gbps(copy_traffic_bytes(probe_bytes), seconds)


# ----------------------------------------------------------------------------------------- implementations


@dataclass
class PlanOverride:
    """How many backward plans an override answered while it was in force."""

    answered: int = 0


# The least bytes a phase of an implementation's operator moves: ``(phase, rows, hidden, act_bytes, weight_bytes)``.
Traffic = Callable[[str, int, int, int, int], int]


@dataclass
class Impl:
    """``forward(x, residual) -> (y, sum)`` (the sum ``residual + x``, or a sandwich's ``residual + norm(x)``),
    the weights it differentiates, the least traffic of its operator (``min_traffic_bytes`` or
    ``sandwich_min_traffic_bytes``) and what is in force while it is timed (``wide_backward`` for
    ``hf_rmsnorm_wide``)."""

    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    weights: tuple[torch.Tensor, ...]
    traffic: Traffic = min_traffic_bytes
    context: Callable[[], contextlib.AbstractContextManager[PlanOverride | None]] = contextlib.nullcontext


# Wider than any single tile of any dtype: the backward plan of such rows is the wide kernels' plan, which is
# the same for every width beyond the widest single tile (launch.backward_plan).
WIDER_THAN_ANY_TILE = 1 << 20
OVERRIDE_UNUSED = ("error: the backward override changed no plan (kernel_bench.wide_backward and "
                   "pipelined_backward must follow launch.py)")
# The widest single backward tiles' stages in pipelined_backward: two, the most their staging buffers leave room
# for (bf16 rows of 16384 with dsum take 160 KiB of shared memory at two stages, compiled offline).
PIPELINED_WIDEST_STAGES = 2


@contextlib.contextmanager
def _backward_replanned(replan: Callable[..., Any]) -> Iterator[PlanOverride]:
    """Within the block, ``launch.backward_plan`` answers with ``replan(planned, n_cols, elem_bytes, *args,
    **kwargs)`` where that gives a plan, counted (``planned`` is the package's own plan function), and as the
    package otherwise."""
    from hf_rmsnorm.ops import launch

    planned = launch.backward_plan
    override = PlanOverride()

    def plan(n_cols: int, elem_bytes: int, *args, **kwargs) -> launch.TilingPlan:
        replanned = replan(planned, n_cols, elem_bytes, *args, **kwargs)
        if replanned is None:
            return planned(n_cols, elem_bytes, *args, **kwargs)
        override.answered += 1
        return replanned

    with mock.patch.object(launch, "backward_plan", plan):
        yield override


def wide_backward() -> contextlib.AbstractContextManager[PlanOverride]:
    """Within the block, this package's backward takes the wide kernels at every width: ``launch.backward_plan``
    answers every width with the plan of rows wider than any single tile. A harness override for the A/B of the
    single-tile backward, not a setting of the package; it yields a count of the plans it answered, so a run can
    tell that the override reached the launches (``bench_impl`` checks it)."""

    def wide_plan(planned, n_cols: int, elem_bytes: int, *args, **kwargs):
        plan = planned(WIDER_THAN_ANY_TILE, elem_bytes, *args, **kwargs)
        if plan.single_tile:
            raise RuntimeError(f"launch.backward_plan tiles rows of {WIDER_THAN_ANY_TILE} elements as one: "
                               "kernel_bench.wide_backward must follow launch.py")
        return plan

    return _backward_replanned(wide_plan)


def pipelined_backward() -> contextlib.AbstractContextManager[PlanOverride]:
    """Within the block, the widest single backward tiles (``launch.bwd_rereads_row``), which the default plan
    does not pipeline, are pipelined over ``PIPELINED_WIDEST_STAGES`` row blocks; they still read their row again
    after the reductions. A harness override for the A/B of that choice, as ``wide_backward``; it counts the plans
    it changed."""
    from hf_rmsnorm.ops import launch

    def pipelined_plan(planned, n_cols: int, elem_bytes: int, *args, **kwargs):
        plan = planned(n_cols, elem_bytes, *args, **kwargs)
        if not (plan.single_tile and launch.bwd_rereads_row(plan, elem_bytes) and plan.num_stages == 1):
            return None
        return plan._replace(num_stages=PIPELINED_WIDEST_STAGES)

    return _backward_replanned(pipelined_plan)


def _hf_module(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(hidden, eps=EPS).to(device=device, dtype=dtype)


def _eager_add_norm(norm: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """``residual + x`` as its own op, then ``norm``: how an unpatched decoder layer does it."""

    def forward(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = residual + x
        return norm(s), s

    return forward


def _sandwich_impl(name: str, hidden: int, dtype: torch.dtype, device: torch.device) -> Impl:
    """One of ``SANDWICH_IMPLS`` on the weights of two ``Gemma3RMSNorm`` modules (the post-attention and the
    pre-feedforward norm), drawn around Gemma's zero init as trained weights are."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    post, pre = (Gemma3RMSNorm(hidden, eps=EPS).to(device=device, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        for norm in (post, pre):
            norm.weight.normal_(std=0.1)
    weights = (post.weight, pre.weight)
    if name == "hf_sandwich":
        from hf_rmsnorm.ops.functional import norm_add_norm

        def forward(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return norm_add_norm(x, residual, post.weight, EPS, bias=None, weight2=pre.weight, eps2=EPS, bias2=None,
                                 mode="gemma")
    elif name == "hf_sandwich_2launch":
        from hf_rmsnorm.ops import rms_norm, rms_norm_add

        def forward(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = rms_norm_add(x, residual, post.weight, EPS, mode="gemma")
            return rms_norm(s, pre.weight, EPS, mode="gemma"), s
    else:
        def forward(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = residual + post(x)
            return pre(s), s

    return Impl(forward, weights, sandwich_min_traffic_bytes)


def build_impl(name: str, hidden: int, dtype: torch.dtype, device: torch.device) -> Impl:
    """A fresh implementation for one shape (fresh so torch.compile specialises on it without hitting its
    recompilation limit). Weights are in the activations' dtype, as in a model loaded in that dtype."""
    if name in ("hf_rmsnorm", "hf_rmsnorm_wide", "hf_rmsnorm_pipelined"):
        from hf_rmsnorm.ops import fused_add_rms_norm

        weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        context = {"hf_rmsnorm_wide": wide_backward, "hf_rmsnorm_pipelined": pipelined_backward}.get(
            name, contextlib.nullcontext)
        return Impl(lambda x, residual: fused_add_rms_norm(x, residual, weight, EPS), (weight,), context=context)
    if name == "hf_eager":
        module = _hf_module(hidden, dtype, device)
        return Impl(_eager_add_norm(module), (module.weight,))
    if name == "torch_rms_norm":
        weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        return Impl(_eager_add_norm(lambda s: torch.nn.functional.rms_norm(s, (hidden,), weight, EPS)), (weight,))
    if name == "torch_compile":
        from torch import _dynamo

        _dynamo.reset()
        module = _hf_module(hidden, dtype, device)
        return Impl(torch.compile(_eager_add_norm(module), dynamic=False), (module.weight,))
    if name in ("hf_layernorm", "torch_layer_norm"):
        from hf_rmsnorm.ops import fused_add_layer_norm

        weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        bias = torch.zeros(hidden, dtype=dtype, device=device)  # no gradient asked, as for the RMSNorms' inputs
        if name == "torch_layer_norm":
            return Impl(_eager_add_norm(lambda s: torch.nn.functional.layer_norm(s, (hidden,), weight, bias, EPS)),
                        (weight,))
        return Impl(lambda x, residual: fused_add_layer_norm(x, residual, weight, bias, EPS), (weight,))
    if name == "liger":
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

        module = LigerFusedAddRMSNorm(hidden, eps=EPS, casting_mode="llama").to(device=device, dtype=dtype)
        return Impl(module, (module.weight,))
    if name in SANDWICH_IMPLS:
        return _sandwich_impl(name, hidden, dtype, device)
    raise ValueError(f"unknown implementation {name!r}")


def phase_callable(impl: Impl, phase: str, inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """What one timed run of ``phase`` executes. ``fwd`` is the inference forward (no autograd graph); for
    ``bwd`` the training forward runs here, once, outside the timing."""
    x, residual, dy, dsum = inputs["x"], inputs["residual"], inputs["dy"], inputs["dsum"]
    if phase == "fwd":
        def run_forward():
            with torch.no_grad():
                return impl.forward(x, residual)

        return run_forward
    x = x.detach().requires_grad_()
    residual = residual.detach().requires_grad_()
    wrt = (x, residual, *impl.weights)
    if phase == "bwd":
        outputs = impl.forward(x, residual)
        return lambda: torch.autograd.grad(outputs, wrt, (dy, dsum), retain_graph=True)
    return lambda: torch.autograd.grad(impl.forward(x, residual), wrt, (dy, dsum))


# ------------------------------------------------------------------------------------------------- runner


@dataclass
class Settings:
    """What every measurement shares: on a GPU CUDA events, CUDA graphs and an L2 flush (the defaults); in a dry
    run on the CPU their stand-ins (``dry_run_settings``)."""

    device: torch.device
    dtype_name: str
    warmup: int
    repeats: int
    copy_gbps: float
    flush: Callable[[], Any]
    clock: Clock = cuda_event_clock
    capture: Callable[[Callable[[], Callable[[], Any]]], Callable[[], Any]] = as_cuda_graph
    synchronize: Callable[[], Any] = torch.cuda.synchronize
    host_calls: int = HOST_CALLS

    @property
    def cuda_graphs(self) -> bool:
        """Whether the kernels' figures are taken under CUDA graph replay."""
        return self.capture is as_cuda_graph


def gpu_settings(device: torch.device, dtype_name: str, warmup: int, repeats: int) -> Settings:
    """The settings of a run on ``device``, a GPU; measures its copy bandwidth."""
    flush = l2_flusher(device)
    copy = measure_copy_gbps(device, cuda_event_clock, flush, warmup, repeats)
    return Settings(device, dtype_name, warmup, repeats, copy, flush)


def dry_run_settings(dtype_name: str, warmup: int, repeats: int) -> Settings:
    """The settings of a dry run on the CPU: the host clock, plain calls, no flush (``DRY_RUN_NOTE``)."""
    device = torch.device("cpu")
    copy = measure_copy_gbps(device, wall_clock, lambda: None, warmup, repeats, DRY_RUN_COPY_PROBE_BYTES)
    return Settings(device, dtype_name, warmup, repeats, copy, lambda: None, wall_clock, as_plain_call,
                    lambda: None, DRY_RUN_HOST_CALLS)


def release_cached_memory(device: torch.device) -> None:
    """Hands the memory torch's allocator caches on ``device`` back to the driver (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def failure_status(exc: Exception) -> str:
    """A result status that keeps the reason of a failure, short enough for the table."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    return f"error: {type(exc).__name__}: {exc}"[:200]


def time_call_and_kernels(make_fn: Callable[[], Callable[[], Any]], settings: Settings) -> tuple[float, float] | str:
    """``(call seconds, kernel seconds)`` of the run ``make_fn()`` returns: the eager call first, then the kernels
    (graph replay); or, where one of the two fails, a result status saying which and why (one failing
    implementation must not end a long run)."""
    timing = functools.partial(time_callable, clock=settings.clock, flush=settings.flush, warmup=settings.warmup,
                               repeats=settings.repeats)
    what = "call"
    try:
        call_seconds = timing(make_fn())
        # The call's tensors are gone: a graph allocates from its own pool, which cannot reuse their cached memory.
        release_cached_memory(settings.device)
        what = "kernels (CUDA graph)" if settings.cuda_graphs else "kernels"
        return call_seconds, timing(settings.capture(make_fn))
    except Exception as exc:
        status = failure_status(exc)
        return status if status == "oom" else f"{what}: {status}"[:200]


def time_phase(name: str, impl: Impl, phase: str, inputs: dict[str, torch.Tensor], settings: Settings) -> Result:
    """Times one implementation and phase on one shape (``time_call_and_kernels``); a failure becomes the result's
    status."""
    rows, hidden = inputs["x"].shape
    timed = time_call_and_kernels(functools.partial(phase_callable, impl, phase, inputs), settings)
    if isinstance(timed, str):
        return Result(name, phase, rows, hidden, settings.dtype_name, timed)
    call_seconds, seconds = timed
    act_bytes, weight_bytes = inputs["x"].dtype.itemsize, impl.weights[0].dtype.itemsize
    return make_result(name, phase, rows, hidden, settings.dtype_name, seconds, call_seconds, act_bytes, weight_bytes,
                       settings.copy_gbps, settings.cuda_graphs,
                       impl.traffic(phase, rows, hidden, act_bytes, weight_bytes))


def bench_impl(name: str, phases: list[str], inputs: dict[str, torch.Tensor], settings: Settings) -> list[Result]:
    """Every phase of one implementation on one shape."""
    rows, hidden = inputs["x"].shape
    try:
        impl = build_impl(name, hidden, inputs["x"].dtype, settings.device)
    except Exception as exc:  # e.g. a Liger release without the fused add: report it, go on
        return [Result(name, p, rows, hidden, settings.dtype_name, failure_status(exc)) for p in phases]
    results = []
    for phase in phases:
        with impl.context() as override:
            result = time_phase(name, impl, phase, inputs, settings)
        if override is not None and phase != "fwd" and not override.answered:
            result = Result(name, phase, rows, hidden, settings.dtype_name, OVERRIDE_UNUSED)
        results.append(result)
    return results


def bench_shape(rows: int, hidden: int, impls: list[str], phases: list[str], settings: Settings) -> list[Result]:
    """All implementations and phases on one shape; skipped results when it cannot fit."""
    dtype = DTYPES[settings.dtype_name]

    def all_with(status: str) -> list[Result]:
        return [Result(i, p, rows, hidden, settings.dtype_name, status) for i in impls for p in phases]

    if settings.device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(settings.device)
        if not fits_in_memory(rows, hidden, dtype.itemsize, free_bytes):
            return all_with("skipped: too big")
    try:
        gen = torch.Generator(device=settings.device).manual_seed(0)
        inputs = {k: torch.randn(rows, hidden, dtype=dtype, device=settings.device, generator=gen)
                  for k in ("x", "residual", "dy", "dsum")}
    except torch.OutOfMemoryError:
        return all_with("oom")
    return [r for name in impls for r in bench_impl(name, phases, inputs, settings)]


# -------------------------------------------------------------------------------------------- launch cost

# Decode-sized calls are launch-bound; the goal is "no slower than an empty Triton kernel's launch + 2 us".
LAUNCH_ROWS = (1, 16, 64)
LAUNCH_GOAL_SLACK_S = 2e-6
# Eager add + norm implementations whose host time per call a fused decode call is compared with.
HOST_BASELINES = ("hf_eager", "torch_rms_norm")


def host_seconds_per_call(fn: Callable[[], Any], calls: int = HOST_CALLS,
                          synchronize: Callable[[], Any] = torch.cuda.synchronize) -> float:
    """Host time per call of ``fn`` in a tight loop, synchronised once at the end: what a decode step pays
    without CUDA graphs (Python, argument binding, the launch itself), given a GPU that keeps up."""
    for _ in range(min(10, calls)):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / calls


@functools.cache
def _empty_kernel() -> Any:
    """A Triton kernel that does nothing: its launch is the least a launch can cost."""
    import triton

    @triton.jit
    def empty_kernel(ptr):
        pass

    return empty_kernel


def launch_cost_lines(hidden: int, settings: Settings) -> list[str]:
    """Empty Triton kernel against ``fused_add_rms_norm`` forward on 1-64 rows: GPU time under a CUDA graph
    (no flush: a decode step's activations are in L2) and host time per eager call."""
    from hf_rmsnorm.ops import fused_add_rms_norm

    empty_kernel = _empty_kernel()

    def graph_seconds(fn: Callable[[], Any]) -> float:
        return time_callable(settings.capture(lambda: fn), clock=settings.clock, flush=lambda: None,
                             warmup=settings.warmup, repeats=settings.repeats)

    def host_seconds(fn: Callable[[], Any]) -> float:
        return host_seconds_per_call(fn, settings.host_calls, settings.synchronize)

    def verdict(ours: float, empty: float) -> str:
        return "ok" if ours <= empty + LAUNCH_GOAL_SLACK_S else "MISSED"

    launch_empty = functools.partial(empty_kernel[(1,)], torch.empty(1, device=settings.device))
    empty_graph, empty_host = graph_seconds(launch_empty), host_seconds(launch_empty)
    lines = [f"launch cost, hidden {hidden}: empty Triton kernel {empty_graph * 1e6:.2f} us on the GPU (graph), "
             f"{empty_host * 1e6:.2f} us on the host (eager); goal: + {LAUNCH_GOAL_SLACK_S * 1e6:.0f} us"]
    dtype = DTYPES[settings.dtype_name]
    weight = torch.ones(hidden, dtype=dtype, device=settings.device)
    for rows in LAUNCH_ROWS:
        x, residual = (torch.randn(rows, hidden, dtype=weight.dtype, device=settings.device) for _ in range(2))
        with torch.no_grad():
            call = functools.partial(fused_add_rms_norm, x, residual, weight, EPS)
            on_gpu, on_host = graph_seconds(call), host_seconds(call)
            # What an unpatched decode step pays on the host for the same work (no graph: eager generate()).
            baselines = ", ".join(
                f"{name} {host_seconds(functools.partial(impl.forward, x, residual)) * 1e6:.2f}"
                for name, impl in ((n, build_impl(n, hidden, dtype, settings.device)) for n in HOST_BASELINES)
            )
            # The goal for a fused decode call: no more host time than a single eager aten op.
            aten_add = host_seconds(functools.partial(torch.add, x, residual))
        lines.append(f"  rows {rows:>3}: hf_rmsnorm fwd {on_gpu * 1e6:.2f} us GPU ({verdict(on_gpu, empty_graph)}), "
                     f"{on_host * 1e6:.2f} us host ({verdict(on_host, empty_host)}; one aten add "
                     f"{aten_add * 1e6:.2f} us); host us per add + norm: {baselines}")
    return lines


# The goal for a patched norm module's decode call: host time at most this many empty Triton launches through the
# cached launcher (issue 28).
PATCHED_CALL_GOAL = 1.3


def launch_path_line(hidden: int, settings: Settings) -> str:
    """Host time per eager decode call (1 row) of the same fused add + norm by each way of launching it: the
    cached launcher (what runs), Triton's own ``kernel[grid](...)`` (the path before the cache), and a
    ``torch.compile``d call (inductor's default mode, no CUDA graph) through the Triton op, whose kernel inductor
    launches itself, and through the opaque custom op, which calls back into the package's Python. Then the call
    a patched layer makes, ``norm(x, residual=r)`` on a patched ``LlamaRMSNorm``, against an empty Triton kernel's
    launch through the same cached launcher (``PATCHED_CALL_GOAL``)."""
    from unittest import mock

    from hf_rmsnorm import patch_model
    from hf_rmsnorm.ops import fast_launch, fused_add_rms_norm, library

    dtype = DTYPES[settings.dtype_name]
    x, residual = (torch.randn(1, hidden, dtype=dtype, device=settings.device) for _ in range(2))
    weight = torch.ones(hidden, dtype=dtype, device=settings.device)

    def fused(a, r, w):
        return fused_add_rms_norm(a, r, w, EPS)

    def custom_op(a, r, w):
        return library.op("add_norm_fwd")(a, r, w, None, EPS, "llama")[:2]

    norm = _hf_module(hidden, dtype, settings.device)
    patch_model(norm)
    empty = fast_launch.CachedLauncher(_empty_kernel())

    def patched_module(a, r, w):
        return norm(a, residual=r)

    def cached_empty_launch(a, r, w):
        # Keyed by plan (the launcher itself stands for one), as the norms' launches are.
        empty(1, a.get_device(), (a,), {}, 4, empty, ())

    def host_us(fn: Callable[..., Any]) -> float:
        call = functools.partial(fn, x, residual, weight)
        return host_seconds_per_call(call, settings.host_calls, settings.synchronize) * 1e6

    with torch.no_grad():
        cached = host_us(fused)
        with mock.patch.object(fast_launch, "_KNOBS", None):  # the cached launcher's "take Triton's path"
            uncached = host_us(fused)
        compiled = {name: host_us(torch.compile(fn, fullgraph=True))
                    for name, fn in (("Triton op", fused), ("custom op", custom_op))}
        module, empty_launch = host_us(patched_module), host_us(cached_empty_launch)
    return (f"host us per decode call, 1 row, hidden {hidden}, by launch path: cached launcher {cached:.2f}, Triton's "
            f"kernel[grid] {uncached:.2f}; compiled (no CUDA graph) through the Triton op {compiled['Triton op']:.2f}, "
            f"through the custom op {compiled['custom op']:.2f}; a patched norm module's norm(x, residual=r) "
            f"{module:.2f} = {module / empty_launch:.2f}x a cached empty Triton launch's {empty_launch:.2f} "
            f"(goal <= {PATCHED_CALL_GOAL}x)")


# ------------------------------------------------------------------------------------------------- report


def eager_baseline(impl: str) -> str:
    """The eager implementation of ``impl``'s operator: what an unpatched model runs for it."""
    return "hf_eager_sandwich" if impl in SANDWICH_IMPLS else "hf_eager"


def speedups_over_eager(results: list[Result]) -> dict[tuple, float]:
    """The time of each result's ``eager_baseline`` on its phase and shape over its own time, keyed by ``(impl,
    phase, rows, hidden)``."""
    seconds = {(r.impl, r.phase, r.rows, r.hidden): r.seconds for r in results if r.seconds}
    speedups = {}
    for (impl, phase, rows, hidden), own in seconds.items():
        base = seconds.get((eager_baseline(impl), phase, rows, hidden))
        if base is not None:
            speedups[(impl, phase, rows, hidden)] = base / own
    return speedups


def format_table(results: list[Result], header: bool = True) -> str:
    """A fixed-width table: the kernels' time, GB/s and % of copy (``graph`` says whether under CUDA graph
    replay), then the eager call's (``call_*``, host included); ``x eager`` is the kernels' speedup over their
    operator's eager implementation (``eager_baseline``) on the same shape and phase."""
    speedup = speedups_over_eager(results)
    impl_width = max(map(len, IMPLS))
    widths = (impl_width, 8, 6, 7, 10, 8, 6, 10, 8, 6, 8, 6)
    lines = []
    if header:
        names = ("impl", "phase", "rows", "hidden", "kernel_us", "GB/s", "%copy", "call_us", "call_GB/s", "%copy",
                 "x eager", "graph")
        lines.append(" ".join(n.rjust(w) if i > 1 else n.ljust(w) for i, (n, w) in enumerate(zip(names, widths))))
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.impl:<{impl_width}} {r.phase:<8} {r.rows:>6} {r.hidden:>7}  {r.status}")
            continue
        x = speedup.get((r.impl, r.phase, r.rows, r.hidden))
        lines.append(f"{r.impl:<{impl_width}} {r.phase:<8} {r.rows:>6} {r.hidden:>7} {r.seconds * 1e6:>10.1f} "
                     f"{r.gbps:>8.0f} {100 * r.copy_fraction:>6.1f} {r.call_seconds * 1e6:>10.1f} "
                     f"{r.call_gbps:>8.0f} {100 * r.call_copy_fraction:>6.1f} {'' if x is None else f'{x:.2f}':>8} "
                     f"{'yes' if r.cuda_graph else 'no':>6}")
    return "\n".join(lines)


def write_plot(results: list[Result], path: Path, copy_gbps: float) -> None:
    """GB/s against hidden size, one panel per (rows, phase), one line per implementation: solid for the
    kernels, dotted in the same colour for the eager call where it was timed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    measured = [r for r in results if r.gbps]
    if not measured:
        print(f"nothing was measured: no plot written to {path}")
        return
    rows_list = sorted({r.rows for r in measured})
    phases = [p for p in PHASES if any(r.phase == p for r in measured)]
    fig, axes = plt.subplots(len(rows_list), len(phases), squeeze=False, sharex=True,
                             figsize=(5 * len(phases), 3 * len(rows_list)))
    for i, rows in enumerate(rows_list):
        for j, phase in enumerate(phases):
            ax = axes[i][j]
            for impl in dict.fromkeys(r.impl for r in measured):
                points = sorted((r.hidden, r.gbps) for r in measured
                                if (r.impl, r.phase, r.rows) == (impl, phase, rows))
                if points:
                    (line,) = ax.plot(*zip(*points), marker="o", label=impl)
                    calls = sorted((r.hidden, r.call_gbps) for r in measured
                                   if (r.impl, r.phase, r.rows) == (impl, phase, rows) and r.call_gbps)
                    if calls:
                        ax.plot(*zip(*calls), marker=".", linestyle=":", color=line.get_color())
            ax.axhline(copy_gbps, color="grey", linestyle="--", linewidth=1, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{phase}, {rows} rows")
            ax.set_ylabel("GB/s")
    for ax in axes[-1]:
        ax.set_xlabel("hidden")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def write_json(path: Path, results: list[Result], device_name: str, copy_gbps: float) -> None:
    """The results with the device, the torch version and the copy bandwidth they are measured against."""
    path.write_text(json.dumps({
        "device": device_name, "torch": torch.__version__, "copy_gbps": copy_gbps,
        "results": [asdict(r) for r in results],
    }, indent=1))


# ---------------------------------------------------------------------------------------------- whole run


def available_impls(requested: list[str]) -> list[str]:
    """The requested implementations that can run here (Liger only when installed)."""
    if "liger" in requested and importlib.util.find_spec("liger_kernel") is None:
        print("liger_kernel is not installed: skipping liger")
        return [i for i in requested if i != "liger"]
    return requested


@dataclass(frozen=True)
class BenchConfig:
    """The command line of ``scripts/bench_kernels.py``, one field per option; see its ``--help``."""

    rows: list[int]
    hidden: list[int]
    ops: list[str]
    phases: list[str]
    dtype: str
    warmup: int
    repeats: int
    json: Path | None = None
    plot: Path | None = None
    dry_run: bool = False


def run_benchmark(config: BenchConfig) -> list[Result]:
    """Measures the copy bandwidth, the launch cost (with ``hf_rmsnorm`` and ``fwd`` in the run) and every shape
    of ``config`` on the current GPU, printing each shape's table as it is measured, and returns the results.

    Needs a GPU, with the kernels set up for it (``hf_rmsnorm.ops.backend.configure("cuda")``) before this runs;
    with ``config.dry_run`` and no GPU, runs on the CPU instead, with the kernels set up for Triton's interpreter
    (``configure("cpu")``) and the stand-ins of ``dry_run_settings`` (``DRY_RUN_NOTE``).
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        settings = gpu_settings(device, config.dtype, config.warmup, config.repeats)
        device_name = torch.cuda.get_device_name(device)
    elif config.dry_run:
        settings = dry_run_settings(config.dtype, config.warmup, config.repeats)
        device_name = "cpu (dry run)"
        print(DRY_RUN_NOTE)
    else:
        raise RuntimeError("run_benchmark needs a GPU, or config.dry_run to run on the CPU")
    copy = settings.copy_gbps
    print(f"{device_name}: device-to-device copy {copy:.0f} GB/s")
    if "hf_rmsnorm" in config.ops and "fwd" in config.phases:
        for hidden in config.hidden:
            print("\n".join(launch_cost_lines(hidden, settings)), flush=True)
    impls = available_impls(config.ops)
    results = []
    for rows in config.rows:
        for hidden in config.hidden:
            shape_results = bench_shape(rows, hidden, impls, config.phases, settings)
            # The shape's tensors are gone now: hand their memory back before the next (maybe larger) shape.
            release_cached_memory(settings.device)
            print(format_table(shape_results, header=not results), flush=True)
            results += shape_results
            if config.json:
                # Rewritten after every shape, so a run cut short still leaves what it measured.
                write_json(config.json, results, device_name, copy)
    if config.plot:
        write_plot(results, config.plot, copy)
    if "hf_rmsnorm" in config.ops and "fwd" in config.phases:
        # Last: its two torch.compile runs take seconds, which a time-limited run spends after the bandwidths.
        print(launch_path_line(config.hidden[0], settings), flush=True)
    return results
