"""The cached launch path (``hf_rmsnorm.ops.fast_launch``): its key decides everything Triton's does, and on a GPU
it runs the same binary as ``kernel[grid](...)``."""

import itertools

import pytest
import torch

from hf_rmsnorm import fused_add_rms_norm
from hf_rmsnorm.ops import backend, launch
from hf_rmsnorm.ops.fast_launch import _arg_key
from hf_rmsnorm.ops.kernels import norm_fwd_kernel
from hf_rmsnorm.tools.kernel_inspect import capture_launch


def _triton_binder():
    """Triton's own argument binder for the forward kernel, as its launch path builds it (Triton >= 3.5)."""
    if not backend.triton_at_least(3, 5):
        pytest.skip("before Triton 3.5 the binder differs and the cached launch path is off")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton.runtime.jit import JITFunction

    # Under the interpreter the kernel is an InterpretedFunction: build the JITFunction a GPU process would have.
    kernel = norm_fwd_kernel if isinstance(norm_fwd_kernel, JITFunction) else JITFunction(norm_fwd_kernel.fn)
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def test_equal_keys_mean_equal_triton_specialisations():
    """Over launches that differ in dtypes, alignment and integer values, whenever two get the same key, Triton
    specialises them identically: a cached kernel is the one Triton would pick."""
    binder = _triton_binder()
    base = torch.empty(4096 + 64, dtype=torch.bfloat16)
    # The constexprs launch.py passes for a fused add at width 4096 (captured, so the test follows the kernel).
    _, _, flags = capture_launch("fwd+res", torch.bfloat16, 4096, 1, "llama", sm_count=132)
    flags = {name: value for name, value in flags.items() if name != "num_warps"}
    seen: dict[tuple, object] = {}
    for offset, dtype, n_rows, stride, eps in itertools.product(
        (0, 1, 8, 16), (torch.bfloat16, torch.float16), (1, 2, 16, 17, 2**31 + 16), (4096, 4104), (1e-6, 1e-5)
    ):
        x = base[offset:offset + 4096].view(dtype)
        args = (x, x, x, None, x, x, x.float(), n_rows, 4096, stride, stride, 4096, 4096, eps)
        key = tuple(map(_arg_key, args))
        _, specialization, _ = binder(*args, **flags)
        spec = repr(specialization)
        assert seen.setdefault(key, spec) == spec, f"one key, two specialisations: {key}"
    assert len(set(seen.values())) > 1  # the launches really did specialise differently


@pytest.mark.gpu
def test_cached_launches_equal_tritons_own():
    """Misses go through kernel[grid](...), hits through the cached launcher: both give the same bits, for
    aligned and unaligned inputs and decode- and prefill-sized calls."""
    for launcher in launch._LAUNCHERS.values():
        launcher.compiled.clear()
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
    cached = launch._LAUNCHERS[launch.norm_fwd_kernel].compiled
    assert len(cached) >= 3  # rows 1 aligned and unaligned, 3 and 64 rows: different specialisations
