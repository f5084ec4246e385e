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
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_rmsnorm import fused_add_rms_norm, patch_model, rms_norm, rms_norm_add
from hf_rmsnorm.ops import functional, launch
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.ops.kernels import norm_add_norm_fwd_kernel
from hf_rmsnorm.ops.modes import STATS_SYNC_SLOTS
from hf_rmsnorm.patch import derived_runtime, guard, sandwich


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
    ("norm_add_norm", lambda x, r, w: functional.norm_add_norm(x, r, w, 1e-6, bias=None, weight2=w, eps2=1e-6,
                                                               bias2=None, mode="gemma"), 2),
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


# The host-time proxy: one decode call (1 x 2048 bf16, no gradient), timed over CALLS_PER_TIMING calls against as many
# aten adds of the same tensors (``torch.add(x, r)``), in ROUNDS interleaved rounds. The timings are short (about
# 0.1 ms) so that most rounds run undisturbed on a shared host: long ones are preempted now and then, and the fused
# call's, several times the add's, far more often than the add's.
DECODE_ROWS, DECODE_HIDDEN = 1, 2048
CALLS_PER_TIMING, ROUNDS = 10, 1001
# A patched norm's call as a registered layer shape makes it: the layer asks the guard, which hands it the norm's
# bound forward (``guard.unwatched_call``, skipping ``nn.Module.__call__``'s dispatch), and calls that with the
# residual. What it runs, timed apart on the project's 2-core CPU host (CPython 3.11, torch 2.13), in adds: the guard
# 0.3; the forward's reads of eps and the weight 0.3 (the weight read from the module's parameters,
# ``attributes.registered_parameter``: through ``nn.Module.__getattr__`` it cost 0.35 more); the bound launch's key,
# lookup and per-call checks 1.1 (the key reads eight tensor attributes: 0.6); the launch's arguments (contiguity, row
# count, the alignment of five pointers: 0.4, the argument tuple) 1.2; its two output allocations (``empty_like``)
# 1.0; the launch through the cached launcher 0.7 (0.2 of it the stand-in binary's own Python). Together 4.6; the
# interleaved ratio below measures 4.9-5.1 (5.1-5.4 before the weight read, the flat key and the launcher's trims,
# measured alike on the same host). A derived layer's ``norm_of_sum`` also compares the two tensors' shapes and
# devices (5.2-5.5); ``nn.Module.__call__`` adds about 0.4 to a direct call of the module (``norm(x, residual=r)``
# 5.3-5.6, ``norm(x)`` 4.1-4.4). Issue 28 asked for 2.5, less than the allocations, the launch, the guard and the
# parameter reads take together (2.3) before the key's reads of the tensors (0.6) and the pointers' alignment (0.4),
# which no bound launch can skip: 3.3. Each budget leaves a quarter on the Python part (all but the allocations) for
# hosts whose Python is slower against torch's dispatch.
FUSED_SITE_MAX_ADDS = 6.5
CALL_MAX_ADDS = 7


def _median_ratio(call, reference) -> float:
    """The median over ROUNDS of ``call``'s host time over ``reference``'s, the two timed back to back in each
    round, so that a slow spell of a shared host slows both of a ratio's timings alike."""

    def seconds(fn) -> float:
        start = time.perf_counter()
        for _ in range(CALLS_PER_TIMING):
            fn()
        return time.perf_counter() - start

    return statistics.median([seconds(call) / seconds(reference) for _ in range(ROUNDS)])


def _patched_norm(hidden: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A patched Llama norm whose weight is drawn around 1."""
    norm = LlamaRMSNorm(hidden).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(0))
    patch_model(norm)
    return norm


# Each call with its budget in adds.
DECODE_CALLS = {
    "a layer shape's fused add": (lambda norm, x, r: guard.unwatched_call(norm)(x, residual=r), FUSED_SITE_MAX_ADDS),
    "a derived layer's norm_of_sum": (lambda norm, x, r: derived_runtime.norm_of_sum(norm, r, x), CALL_MAX_ADDS),
    "norm(x)": (lambda norm, x, r: norm(x), CALL_MAX_ADDS),
    "norm(x, residual=r)": (lambda norm, x, r: norm(x, residual=r), CALL_MAX_ADDS),
    "norm(x, add_to=r)": (lambda norm, x, r: norm(x, add_to=r), CALL_MAX_ADDS),
    "fused_add_rms_norm": (lambda norm, x, r: fused_add_rms_norm(x, r, norm.weight, norm.variance_epsilon),
                           CALL_MAX_ADDS),
}


@pytest.mark.skipif(not kernels_interpreted(), reason="a CPU proxy; on a GPU host the benchmarks' launch-path line "
                    "measures the call itself")
@pytest.mark.parametrize("name", list(DECODE_CALLS))
def test_a_patched_norms_decode_call_costs_a_few_aten_adds_of_host_time(monkeypatch, name):
    """On a GPU host a decode call is bound by host time; here the whole path up to the compiled kernel's launch
    runs (the launch itself stubbed: ``stand_in_forward_kernel``), against ``torch.add`` on the same tensors. Once
    bound, no call takes the general path (which works the launch out again)."""
    kernel = stand_in_forward_kernel(monkeypatch)
    norm = _patched_norm(DECODE_HIDDEN)
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(DECODE_ROWS, DECODE_HIDDEN, generator=g, dtype=torch.bfloat16) for _ in range(2))
    call, budget = DECODE_CALLS[name]
    general_calls = []
    with torch.no_grad():
        call(norm, x, residual)  # binds the launch
        for general in ("_norm", "_fused_add_norm", "_norm_add"):
            monkeypatch.setattr(functional, general, lambda *args, general=general: general_calls.append(general))
        ratio = _median_ratio(lambda: call(norm, x, residual), lambda: torch.add(x, residual))
    print(f"\n{name}, bf16 {DECODE_ROWS} x {DECODE_HIDDEN}, launch stubbed, CPU host: {ratio:.2f}x one aten add's "
          "host time")
    assert not general_calls
    assert kernel.cached_launches >= ROUNDS * CALLS_PER_TIMING  # the cached path ran, not Triton's own
    assert ratio <= budget


# A patched sandwich layer's post-attention norm, add and pre-feedforward norm in one call, as its body makes it
# (``sandwich.chains``, then ``sandwich.fused_pair``): the fused add site's work less the guard (5.2), plus the second
# norm's reads of eps and the weight (0.6), ``chains``' checks of both norms (each one's class attributes, instance
# dict and the guard's question: ~0.9) and the key's two more tensors (0.15): 6.9; measured 6.75-7.1. A quarter on
# the Python part, as above: 8.5. Against the two calls it replaces (the fused add site, then the pre-feedforward
# norm's ``norm(x)``), timed interleaved: the pair saves a launch (1.0), its arguments (1.2) and a binding's key and
# lookup (1.2) and pays the checks and reads above (1.65): about 1.8 of the two calls' ~9, measured 0.76-0.78 of
# their time. Both sides are the same kind of work (Python and torch's dispatch), so the share moves little from
# host to host: held to 0.9.
SANDWICH_MAX_ADDS = 8.5
SANDWICH_MAX_SHARE_OF_TWO_CALLS = 0.9


@pytest.mark.skipif(not kernels_interpreted(), reason="a CPU proxy; on a GPU host the kernel benchmark's "
                    "kernels-sandwich section times the call at 1 row")
def test_a_sandwich_pairs_decode_call_costs_less_host_time_than_the_two_calls(monkeypatch):
    """A patched Gemma 3 layer's sandwich pair called as its body calls it, the launches stubbed
    (``stand_in_forward_kernel`` over ``norm_add_norm_fwd_kernel`` and ``norm_fwd_kernel``): one bound launch, within
    ``SANDWICH_MAX_ADDS`` aten adds and ``SANDWICH_MAX_SHARE_OF_TWO_CALLS`` of the two calls it replaces (the post
    norm's fused add through the guard, then the pre norm's call), timed interleaved."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    pair_kernel = stand_in_forward_kernel(monkeypatch, norm_add_norm_fwd_kernel)
    stand_in_forward_kernel(monkeypatch)
    post, pre = (Gemma3RMSNorm(DECODE_HIDDEN).to(torch.bfloat16) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    for norm in (post, pre):
        with torch.no_grad():
            norm.weight.normal_(0.0, 0.3, generator=g)
        patch_model(norm)
    x, residual = (torch.randn(DECODE_ROWS, DECODE_HIDDEN, generator=g, dtype=torch.bfloat16) for _ in range(2))

    def pair_call():
        assert sandwich.chains(post, pre)
        return sandwich.fused_pair(post, x, residual, pre)

    def two_calls():
        return pre(guard.unwatched_call(post)(x, add_to=residual))

    general_calls = []
    with torch.no_grad():
        pair_call(), two_calls()  # bind the launches
        for general in ("_norm", "_norm_add", "_norm_add_norm"):
            monkeypatch.setattr(functional, general, lambda *args, general=general: general_calls.append(general))
        adds = _median_ratio(pair_call, lambda: torch.add(x, residual))
        share = _median_ratio(pair_call, two_calls)
    print(f"\nsandwich pair, bf16 {DECODE_ROWS} x {DECODE_HIDDEN}, launches stubbed, CPU host: {adds:.2f}x one aten "
          f"add's host time, {share:.2f} of the two calls'")
    assert not general_calls
    assert pair_kernel.cached_launches >= 2 * ROUNDS * CALLS_PER_TIMING  # the cached path ran, not Triton's own
    assert adds <= SANDWICH_MAX_ADDS
    assert share <= SANDWICH_MAX_SHARE_OF_TWO_CALLS


def test_the_public_functions_are_imported_once():
    """``hf_rmsnorm.ops.<function>`` (and ``hf_rmsnorm.<function>``) imports the functional API on first use and
    keeps what it imported in the module: later lookups are attribute reads, not imports (tens of microseconds)."""
    import hf_rmsnorm
    import hf_rmsnorm.ops as ops

    for module in (ops, hf_rmsnorm):
        for name in ops._FUNCTIONAL:
            assert getattr(module, name) is getattr(functional, name)
            assert vars(module)[name] is getattr(functional, name)


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
