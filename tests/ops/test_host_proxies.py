"""CPU proxies of the GPU costs that hold on any machine: what one fused call allocates on the host, its host time
up to the kernel's launch against an aten add's, and how many bytes the patched norms keep for the backward.
(Launches per decoder layer: test_patcher.test_dispatch_counts.)"""

from __future__ import annotations

import collections
import statistics
import time

import pytest
import torch
from patch_models import input_ids, tiny_model
from test_fast_launch import stand_in_forward_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from hf_rmsnorm import fused_add_rms_norm, patch_model, rms_norm, rms_norm_add
from hf_rmsnorm.ops import launch
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.ops.modes import STATS_SYNC_SLOTS


ROWS, HIDDEN = 3, 64
ALLOCATING_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "zeros_like"}


class _AtenOps(TorchDispatchMode):
    """Every aten op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _host_ops(monkeypatch, call, *, grad: bool) -> tuple[collections.Counter[str], int]:
    """The aten ops one call runs on the host around its kernel launch, and how many launches it makes (the
    launch itself is recorded, not run: the interpreter's own tensor work is not host work of a GPU call)."""
    launches = []
    monkeypatch.setattr(launch, "_launch", lambda *args: launches.append(args))
    counter = _AtenOps()
    with torch.set_grad_enabled(grad), counter:
        call()
    return counter.ops, len(launches)


def _inputs(requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN, generator=g, dtype=torch.bfloat16).requires_grad_(requires_grad)
    return x, residual, weight


@pytest.mark.parametrize("name, call, outputs", [
    ("rms_norm", lambda x, r, w: rms_norm(x, w), 1),
    ("fused_add_rms_norm", lambda x, r, w: fused_add_rms_norm(x, r, w), 2),
    ("rms_norm_add", lambda x, r, w: rms_norm_add(x, r, w), 1),
])
def test_an_inference_call_allocates_its_outputs_and_nothing_else(monkeypatch, name, call, outputs):
    """Decode is host-bound: in inference a call allocates only the tensors it returns (no statistics buffer,
    which only the backward reads), runs no other aten op, and makes one launch."""
    x, residual, weight = _inputs()
    with torch.no_grad():
        call(x, residual, weight)  # what is worked out once per combination of dtypes and width is not counted
    ops, launches = _host_ops(monkeypatch, lambda: call(x, residual, weight), grad=False)
    assert launches == 1
    assert ops == collections.Counter({"empty_like": outputs}), f"{name}: {dict(ops)}"


def test_with_autograd_the_statistics_are_allocated_for_the_backward(monkeypatch):
    x, residual, weight = _inputs(requires_grad=True)
    ops, launches = _host_ops(monkeypatch, lambda: fused_add_rms_norm(x, residual, weight), grad=True)
    assert launches == 1
    assert sum(ops[name] for name in ALLOCATING_OPS) == 3  # y, the sum and the per-row rstd


# The host-time proxy: a decode call (one row; 64 columns keep the add's arithmetic negligible against its host
# overhead, as a GPU's add runs asynchronously), timed over CALLS_PER_TIMING calls against as many adds, in ROUNDS
# interleaved rounds. The timings are short (about 0.1 ms) so that most rounds run undisturbed on a shared host:
# long ones are preempted now and then, and the fused call's, 8 times the add's, far more often than the add's.
DECODE_ROWS = 1
CALLS_PER_TIMING, ROUNDS = 10, 1001
# The budget of a fused call's host time up to the kernel's launch, in aten adds on the same tensors: its two
# output allocations (aten ops cheaper than an add, which allocates its output too) and Python for the rest (the
# argument checks, the plan lookup, the launcher's key, the launch's argument tuple): about 900 bytecodes, 30
# Python calls and 20 calls into C, some 6 adds' time on a 2-core CPU host with CPython 3.11 (8 adds in all
# there). The path it replaced, with one key per argument, ran 1200 bytecodes, 60 Python calls and 33 calls into
# C: 14 adds there. The budget leaves a quarter for hosts whose Python is slower against torch's dispatch.
FUSED_CALL_MAX_ADDS = 10
def _median_ratio(call, reference) -> float:
    """The median over ROUNDS of ``call``'s host time over ``reference``'s, the two timed back to back in each
    round, so that a slow spell of a shared host slows both of a ratio's timings alike."""

    def seconds(fn) -> float:
        start = time.perf_counter()
        for _ in range(CALLS_PER_TIMING):
            fn()
        return time.perf_counter() - start

    return statistics.median([seconds(call) / seconds(reference) for _ in range(ROUNDS)])


@pytest.mark.skipif(not kernels_interpreted(), reason="a CPU proxy; on a GPU host the benchmarks' launch-cost "
                    "lines measure the call itself")
def test_a_fused_decode_call_costs_a_few_aten_adds_of_host_time(monkeypatch):
    """On a GPU host a decode call is bound by host time; here the whole path up to the compiled kernel's launch
    runs (the launch itself stubbed: ``stand_in_forward_kernel``), against ``torch.add`` on the same tensors."""
    kernel = stand_in_forward_kernel(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(DECODE_ROWS, HIDDEN, generator=g, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN, generator=g, dtype=torch.bfloat16)
    with torch.no_grad():
        ratio = _median_ratio(lambda: fused_add_rms_norm(x, residual, weight), lambda: torch.add(x, residual))
    print(f"\nfused_add_rms_norm decode call, launch stubbed, CPU host: {ratio:.2f}x one aten add's host time")
    assert kernel.cached_launches >= ROUNDS * CALLS_PER_TIMING - 1  # the cached path ran, not Triton's own
    assert ratio <= FUSED_CALL_MAX_ADDS


class _SavedBytes:
    """Bytes of the activations autograd keeps for the backward (each storage once; parameters left out: they
    live anyway)."""

    def __init__(self, parameters) -> None:
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.parameter_storages:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def total(self, run) -> int:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            run()
        return sum(self.storages.values())


def _saved_bytes(module: torch.nn.Module, *args) -> int:
    return _SavedBytes(module.parameters()).total(lambda: module(*args))


def test_a_patched_norm_keeps_a_third_of_the_eager_norms_activations():
    """Per norm, eager keeps the fp32 upcast of its input (4 bytes per element), the rounded normalised row (2
    in bf16) and the fp32 rstd per row; the patched norm keeps its bf16 input (2) and the rstd (with the
    backward's counters, modes.STATS_SYNC_SLOTS): 3x fewer bytes per element."""
    model = tiny_model("llama", torch.bfloat16, layers=1)
    norm = model.model.norm
    x = torch.randn(ROWS, norm.weight.numel(), dtype=torch.bfloat16, requires_grad=True)
    eager = _saved_bytes(norm, x)
    assert eager == ROWS * HIDDEN * (4 + 2) + ROWS * 4
    patch_model(model)
    patched = _saved_bytes(norm, x)
    assert patched == ROWS * HIDDEN * 2 + (ROWS + STATS_SYNC_SLOTS) * 4


def test_a_patched_model_keeps_fewer_activations_for_the_backward():
    model = tiny_model("llama", torch.bfloat16, layers=2).train()
    ids = input_ids()
    eager = _saved_bytes(model, ids)
    patch_model(model)
    patched = _saved_bytes(model, ids)
    print(f"\ntiny bf16 Llama, activations kept for the backward: patched {patched / eager:.3f}x eager's")
    assert patched < eager
