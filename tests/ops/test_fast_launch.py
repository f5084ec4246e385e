"""The cached launch path (``hf_rmsnorm.ops.fast_launch``): its keys decide everything Triton's does, and on a GPU
it runs the same binary as ``kernel[grid](...)``.

Without a GPU, ``stand_in_forward_kernel`` runs the path all the way to the compiled kernel's launch: the forward
kernel as the launcher meets it on a GPU, compiled to binaries whose launch runs nothing (``test_host_proxies.py``
times the path with it)."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from hf_rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_add
from hf_rmsnorm.ops import backend, fast_launch, functional, launch
from hf_rmsnorm.ops.fast_launch import CachedLauncher, _arg_key
from hf_rmsnorm.ops.kernels import norm_fwd_kernel, unspecialised_args
from harness.kernel_inspect import capture_launch

HIDDEN = 64
# The kernels' device: on a CPU host the stand-in still runs the launch path (the interpreter's kernels skip it).
DEVICE = "cpu" if backend.kernels_interpreted() else "cuda"


def _jit_forward_kernel(kernel=norm_fwd_kernel):
    """A kernel (the forward's by default) as a GPU process defines it: under the interpreter it is an
    InterpretedFunction."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, do_not_specialize=unspecialised_args(kernel.fn))


def _triton_binder():
    """Triton's own argument binder for the forward kernel, as its launch path builds it (Triton >= 3.5)."""
    if not backend.triton_at_least(3, 5):
        pytest.skip("before Triton 3.5 the binder differs and the cached launch path is off")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = _jit_forward_kernel()
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


class StandInKernel:
    """A kernel (``norm_fwd_kernel`` by default) as the cached launcher meets it on a GPU: its parameters, and
    ``kernel[grid](...)`` compiling (counted in ``compilations``) to a binary whose launch (counted in
    ``cached_launches``) runs nothing. Once ``binder`` is set to Triton's, each binary checks every launch of it
    against the specialisation it was compiled for."""

    def __init__(self, kernel=norm_fwd_kernel) -> None:
        self.params = _jit_forward_kernel(kernel).params
        self.binder = None
        self.compilations = 0
        self.cached_launches = 0

    def specialisation(self, *args, **kwargs):
        return None if self.binder is None else repr(self.binder(*args, **kwargs)[1])

    def __getitem__(self, grid):
        def compile_and_launch(*args, num_warps, **constexprs):
            self.compilations += 1
            return _NoOpBinary(self, self.specialisation(*args, **constexprs))

        return compile_and_launch


class _NoOpBinary:
    """A compiled kernel as the cached launcher uses one; its launch only counts and checks."""

    function = packed_metadata = None

    def __init__(self, kernel: StandInKernel, specialisation) -> None:
        self.kernel, self.specialisation = kernel, specialisation

    def launch_metadata(self, *_):
        return None

    def run(self, *launch_args):
        self.kernel.cached_launches += 1
        if self.kernel.binder is not None:
            # After the grid, stream, function, packed metadata, launch metadata and the two hooks: the kernel's
            # arguments, constexprs included, in declared order.
            assert self.kernel.specialisation(*launch_args[9:]) == self.specialisation


def stand_in_forward_kernel(monkeypatch, kernel=norm_fwd_kernel) -> StandInKernel:
    """Routes a forward kernel's launches (``norm_fwd_kernel``'s by default; ``norm_add_norm_fwd_kernel``'s for the
    sandwich) through a fresh ``CachedLauncher`` over a ``StandInKernel``, down to the binary's launch, as on a GPU
    with Triton >= 3.5 and no launch hook; returns the stand-in."""
    stand_in = StandInKernel(kernel)
    launcher = CachedLauncher(stand_in)
    launcher.cacheable = True  # as for a compiled kernel: the stand-in is no JITFunction
    monkeypatch.setitem(launch._LAUNCHERS, kernel, launcher)
    # What the launch reads from Triton on each call: a CPU host has no driver, Triton before 3.5 no knobs.
    monkeypatch.setattr(fast_launch, "_KNOBS", SimpleNamespace(
        runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)))
    monkeypatch.setattr(fast_launch, "_stream_getter", lambda: lambda device: 0)
    return stand_in


def test_equal_keys_mean_equal_triton_specialisations():
    """Over launches that differ in dtypes, alignment and integer values, whenever two get the same key, Triton
    specialises them identically: a cached kernel is the one Triton would pick."""
    binder = _triton_binder()
    base = torch.empty(4096 + 64, dtype=torch.bfloat16)
    # The constexprs launch.py passes for a fused add at width 4096 (captured, so the test follows the kernel).
    _, _, flags = capture_launch("fwd+res", torch.bfloat16, 4096, 1, "llama", sm_count=132)
    flags = {name: value for name, value in flags.items() if name != "num_warps"}
    seen: dict[tuple, object] = {}
    for offset, dtype, n_rows, stride, eps, store_stats in itertools.product(
        (0, 1, 8, 16), (torch.bfloat16, torch.float16), (1, 2, 16, 17, 2**31 + 16, 2**63 + 16), (4096, 4104),
        (1e-6, 1e-5), (0, 1)
    ):
        x = base[offset:offset + 4096].view(dtype)
        args = (x, x, x, None, x, x, x.float(), n_rows, 4096, stride, stride, 4096, 4096, eps, store_stats)
        key = tuple(map(_arg_key, args))
        _, specialization, _ = binder(*args, **flags)
        spec = repr(specialization)
        assert seen.setdefault(key, spec) == spec, f"one key, two specialisations: {key}"
    assert len(set(seen.values())) > 1  # the launches really did specialise differently


def test_the_row_count_and_the_stats_flag_specialise_nothing_but_the_integer_width():
    """Batch invariance: launches of 1, 2, 16, 17 and 4095 rows bind to one specialisation (Triton would make a
    row count of 1 a constant and note one divisible by 16), so every batch size runs the same compiled kernel;
    past 2**31 rows only the integer's width changes. Storing the statistics or not binds the same one too
    (kernels.RUNTIME_FLAG_ARGS)."""
    binder = _triton_binder()
    x = torch.empty(4096, dtype=torch.bfloat16)
    _, _, flags = capture_launch("fwd+res", torch.bfloat16, 4096, 1, "llama", sm_count=132)
    flags = {name: value for name, value in flags.items() if name != "num_warps"}

    def specialisation(n_rows: int, store_stats: int = 1) -> str:
        return repr(binder(x, x, x, None, x, x, x.float(), n_rows, 4096, 4096, 4096, 4096, 4096, 1e-6, store_stats,
                           **flags)[1])

    assert len({specialisation(n_rows, store) for n_rows in (1, 2, 16, 17, 4095) for store in (0, 1)}) == 1
    assert specialisation(2**31 + 1) != specialisation(1)


@pytest.mark.gpu
def test_cached_launches_equal_tritons_own():
    """Misses go through kernel[grid](...), hits through the cached launcher: both give the same bits, for
    aligned and unaligned inputs and decode- and prefill-sized calls."""
    for launcher in launch._LAUNCHERS.values():
        launcher.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64 * 4096 + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    for rows, offset in ((1, 0), (1, 1), (3, 0), (64, 8)):
        x = base[offset:offset + rows * 4096].view(rows, 4096)
        residual = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            outputs = [fused_add_rms_norm(x, residual, weight) for _ in range(3)]  # a miss, then two hits
        for y, s in outputs[1:]:
            assert torch.equal(y, outputs[0][0]) and torch.equal(s, outputs[0][1])
    launcher = launch._LAUNCHERS[launch.norm_fwd_kernel]
    assert len(launcher.by_plan) >= 3  # 1, 3 and 64 rows aligned: different specialisations of one plan
    assert len(launcher.by_arguments) >= 1  # 1 row unaligned


@pytest.mark.gpu
def test_the_launch_reads_the_current_gpu_as_torch_does():
    """``launch._current_gpu`` is ``torch.cuda.current_device()`` less its lazy initialisation: the same index,
    also inside ``torch.cuda.device(...)``."""
    assert launch._current_gpu() == torch.cuda.current_device()
    last = torch.cuda.device_count() - 1
    with torch.cuda.device(last):
        assert launch._current_gpu() == torch.cuda.current_device() == last


def _forward_call(op: str = "fused_add_rms_norm", rows: int = 1, dtype: torch.dtype = torch.bfloat16,
                  offset: int = 0, mode: str = "llama", weight: bool = True, eps: float = 1e-6, grad: bool = False):
    """A forward call of ``op`` whose input and residual start ``offset`` elements into their buffers (1: not
    16-byte aligned; 8 of 2-byte elements: aligned); with ``grad``, the weight requires grad (so the statistics
    are stored)."""
    g = torch.Generator().manual_seed(rows)

    def rows_at_offset() -> torch.Tensor:
        buffer = torch.randn(rows * HIDDEN + offset, generator=g).to(DEVICE, dtype)
        return buffer[offset:].view(rows, HIDDEN)

    x, residual = rows_at_offset(), rows_at_offset()
    w = torch.randn(HIDDEN, generator=g).to(DEVICE, dtype).requires_grad_(grad) if weight else None
    calls = {
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, residual, w, eps, mode=mode),
        "rms_norm": lambda: rms_norm(x, w, eps, mode=mode),
        "rms_norm_add": lambda: rms_norm_add(x, residual, w, eps, mode=mode),
    }
    return calls[op]


def test_every_cached_launch_runs_a_binary_of_its_own_specialisation(monkeypatch):
    """Forward calls that differ in everything Triton specialises on (alignment, row count, dtypes, constexprs:
    op, mode, weight, statistics), each made twice: every launch from the cache, by plan or by arguments, runs a
    binary Triton compiled for exactly its specialisation."""
    kernel = stand_in_forward_kernel(monkeypatch)
    kernel.binder = _triton_binder()
    combinations = list(itertools.product(
        ("fused_add_rms_norm", "rms_norm", "rms_norm_add"), (1, 2, 3, 16, 17), (torch.bfloat16, torch.float16),
        (0, 1, 8), ("llama", "gemma"), (True, False), (False, True)))
    for op, rows, dtype, offset, mode, weight, grad in combinations:
        call = _forward_call(op, rows, dtype, offset, mode, weight, grad=grad)
        with torch.set_grad_enabled(grad):
            call()
            call()
    assert kernel.cached_launches >= len(combinations)  # every second call at least
    assert kernel.compilations < len(combinations)  # specialisations shared by several calls were compiled once


@pytest.mark.parametrize("before, after, specialises", [
    ({}, {"offset": 1}, True),
    ({}, {"offset": 8}, False),  # 16 bytes in: still aligned
    ({"rows": 1}, {"rows": 2}, True),  # 1 is a constant
    ({"rows": 2}, {"rows": 3}, False),
    ({"rows": 16}, {"rows": 17}, True),  # divisible by 16, or not
    ({"rows": 16}, {"rows": 32}, False),
    ({}, {"dtype": torch.float16}, True),
    ({}, {"mode": "gemma"}, True),  # a constexpr (the weight's offset)
    ({}, {"weight": False}, True),  # a None pointer and a constexpr
    ({}, {"op": "rms_norm"}, True),  # no residual: None pointers and constexprs
    ({}, {"grad": True}, True),  # the statistics are stored: a pointer and a constexpr
    ({}, {"eps": 1e-5}, False),  # floats are not specialised
], ids=lambda value: repr(value) if isinstance(value, dict) else None)
def test_the_key_tells_apart_every_change_triton_specialises_on(monkeypatch, before, after, specialises):
    """A call that changes what Triton specialises on misses the launcher's cache (and compiles, through
    Triton's own path); one that changes nothing Triton sees runs the cached binary."""
    kernel = stand_in_forward_kernel(monkeypatch)
    grad = after.get("grad", False)
    first, second = _forward_call(**before), _forward_call(**{**before, **after})
    with torch.set_grad_enabled(grad):
        first()
        compiled = kernel.compilations
        second()
    assert (kernel.compilations > compiled) == specialises


def test_a_launch_whose_first_argument_is_absent_runs_on_the_first_tensors_device():
    """A norm with a bias and no weight launches its weight-gradient reduction with no weight partials (the first
    argument None): the launch takes the device of the first tensor given, and the bias gradient of a sum is
    the row count, exactly."""
    rows = 3
    x = torch.randn(rows, HIDDEN, device=DEVICE, requires_grad=True)
    bias = torch.randn(HIDDEN, device=DEVICE, requires_grad=True)
    rms_norm(x, None, bias=bias).sum().backward()
    assert torch.equal(bias.grad, torch.full_like(bias, rows))


# The bound launch (functional.BoundNorm): a call whose launch was bound by an earlier one computes bit for bit what
# the general path computes on the same arguments, whatever ran before.

# op -> (the bound call, the general path's), on (x, residual, weight, eps, bias, mode).
BOUND_OPS = {
    "norm": (lambda x, r, w, eps, b, mode: functional.bound_norm(mode).norm(x, w, eps, b),
             lambda x, r, w, eps, b, mode: functional._norm(x, w, eps, b, mode)),
    "fused_add_norm": (lambda x, r, w, eps, b, mode: functional.bound_norm(mode).fused_add_norm(x, r, w, eps, b),
                       lambda x, r, w, eps, b, mode: functional._fused_add_norm(x, r, w, eps, b, mode)),
    "norm_add": (lambda x, r, w, eps, b, mode: functional.bound_norm(mode).norm_add(x, r, w, eps, b),
                 lambda x, r, w, eps, b, mode: functional._norm_add(x, r, w, eps, b, mode)),
}


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _assert_same_bits(out, expected) -> None:
    for a, b in zip(_as_tuple(out), _as_tuple(expected), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _bound_and_general(op: str, args: tuple) -> None:
    """Calls ``op`` bound twice (the first call may bind) and asserts both give the general path's bits."""
    bound, general = BOUND_OPS[op]
    with torch.no_grad():
        expected = general(*args)
        for _ in range(2):
            _assert_same_bits(bound(*args), expected)


def test_a_bound_call_gives_the_general_paths_bits(monkeypatch):
    """Over ops, modes, dtypes, row counts, alignment, strides, biases and mixed dtypes: the second call of each
    runs bound (the general path would fail) and gives the general path's bits."""
    g = torch.Generator().manual_seed(0)

    def rows(n: int, dtype: torch.dtype, offset: int = 0, strided: bool = False) -> torch.Tensor:
        width = 2 * HIDDEN if strided else HIDDEN
        buffer = torch.randn(n * width + offset, generator=g).to(DEVICE, dtype)
        return buffer[offset:].view(n, width)[:, :HIDDEN]

    for op, mode, dtype, n, variant in itertools.product(
        BOUND_OPS, ("llama", "gemma", "layernorm"), (torch.bfloat16, torch.float32), (1, 3),
        ("aligned", "unaligned", "strided", "bias", "fp32 residual", "no weight"),
    ):
        x = rows(n, dtype, offset=1 if variant == "unaligned" else 0, strided=variant == "strided")
        residual = rows(n, torch.float32 if variant == "fp32 residual" else dtype)
        weight = None if variant == "no weight" else torch.randn(HIDDEN, generator=g).to(DEVICE, dtype)
        bias = torch.randn(HIDDEN, generator=g).to(DEVICE, dtype) if variant == "bias" else None
        args = (x, residual, weight, 1e-5, bias, mode)
        _bound_and_general(op, args)
        if op == "norm_add" and not functional._adds_in_kernel(x, residual, weight, bias, mode):
            continue  # the norm's output is not of the residual's dtype: the norm's kernel and torch's add
        with monkeypatch.context() as patch, torch.no_grad():
            for name in ("_norm", "_fused_add_norm", "_norm_add"):
                patch.setattr(functional, name, _general_path_ran)
            BOUND_OPS[op][0](*args)


def _general_path_ran(*args):
    raise AssertionError("a bound call took the general path")


def test_a_patched_norm_reads_its_weight_and_eps_on_every_call():
    """Whatever the user does to a patched norm between calls, the next call computes what the general path
    computes with the norm's weight and eps as they are then, and bad ones fail with the checks' errors."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_rmsnorm import patch_model

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=g)  # on the CPU: g is a CPU generator
    norm = norm.to(DEVICE, torch.bfloat16)
    patch_model(norm)
    x, residual = (torch.randn(3, HIDDEN, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))

    def check() -> None:
        with torch.no_grad():
            out = norm(x, residual=residual)
            _assert_same_bits(out, functional._fused_add_norm(x, residual, norm.weight, norm.variance_epsilon,
                                                              None, "llama"))
        return out

    first = check()
    with torch.no_grad():
        norm.weight.mul_(2)  # edited in place
    assert not torch.equal(check()[0], first[0])
    norm.weight.data = norm.weight.data.float()  # recast under the same Parameter: Llama's output promotes
    assert check()[0].dtype == torch.float32
    norm.weight = torch.nn.Parameter(torch.randn(HIDDEN, generator=g).to(DEVICE, torch.bfloat16))  # a new one
    check()
    norm.load_state_dict({"weight": torch.randn(HIDDEN, generator=g)})  # copied in, cast to the weight's dtype
    check()
    norm.variance_epsilon = 0.5
    check()
    norm.to(torch.float16)  # x stays bf16: Llama's weight * n promotes the two to fp32
    assert norm.weight.dtype == torch.float16 and check()[0].dtype == torch.float32
    with torch.no_grad():
        norm.variance_epsilon = -1.0
        with pytest.raises(ValueError, match="fused_add_rms_norm: eps is -1.0"):
            norm(x, residual=residual)
        norm.variance_epsilon = 1e-6
        norm.weight.data = torch.ones(HIDDEN + 1, device=DEVICE, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"weight has shape \(65,\) but x's last dimension is 64"):
            norm(x, residual=residual)
        norm.weight = torch.nn.Parameter(torch.ones(HIDDEN, device="meta", dtype=torch.float16))
        with pytest.raises(ValueError, match="weight is on meta"):
            norm(x, residual=residual)


def test_bound_launches_follow_the_tuned_plan_table_in_use(monkeypatch):
    """A tuned table put in use (``tuning.plans_in_use``) drops the bound launches with the plans: a bound call
    runs the table's plan inside, the default one again after."""
    from hf_rmsnorm.ops import tuning

    launches = []
    monkeypatch.setattr(launch, "_launch", lambda kernel, grid, args, constexprs, *rest: launches.append(constexprs))
    x, residual = (torch.randn(3, HIDDEN).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN).to(DEVICE, torch.bfloat16)
    bound = functional.bound_norm("llama")

    def block_m() -> int:
        with torch.no_grad():
            bound.fused_add_norm(x, residual, weight, 1e-6, None)
            bound.fused_add_norm(x, residual, weight, 1e-6, None)
        return launches[-1]["BLOCK_M"]

    default = block_m()
    # The table is keyed by the GPU's architecture (None: CPU tensors, the interpreter).
    arch = tuning.device_arch(x.get_device())
    key = tuning.PlanKey(arch, "forward", 2, tuning.width_bucket(HIDDEN, launch.fwd_max_tile_n(2)))
    with tuning.plans_in_use({key: {"block_m": default // 2}}):
        assert block_m() == default // 2
    assert block_m() == default


def test_a_bound_norm_records_the_graph_where_autograd_does():
    """With gradients enabled the call takes the autograd path, whatever was bound without them."""
    x, residual = (torch.randn(3, HIDDEN).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN).to(DEVICE, torch.bfloat16).requires_grad_()
    bound = functional.bound_norm("llama")
    with torch.no_grad():
        bound.fused_add_norm(x, residual, weight, 1e-6, None)
        y, _ = bound.fused_add_norm(x, residual, weight, 1e-6, None)
    assert y.grad_fn is None
    y, _ = bound.fused_add_norm(x, residual, weight, 1e-6, None)
    y.float().sum().backward()
    assert weight.grad is not None


def test_a_cleared_launcher_holds_no_binary_and_launches_through_triton_again(monkeypatch):
    """``binaries`` lists what the cache holds (the tuner reads their spills); after ``clear`` the next call takes
    ``kernel[grid](...)`` once more and is then cached again."""
    kernel = stand_in_forward_kernel(monkeypatch)
    launcher = launch._LAUNCHERS[launch.norm_fwd_kernel]
    call = _forward_call()
    with torch.no_grad():
        call()
        call()
    assert kernel.compilations == 1 and len(launcher.binaries()) == 1
    launcher.clear()
    assert launcher.binaries() == []
    with torch.no_grad():
        call()
    assert kernel.compilations == 2 and len(launcher.binaries()) == 1
