"""The kernel benchmark's A/B of the single-tile backward: ``hf_rmsnorm_wide`` runs the same operator with its
backward on the wide kernels (``kernel_bench.wide_backward``), and says so when the override stops reaching the
launches."""

import contextlib

import pytest
import torch

from harness import kernel_bench
from hf_rmsnorm.ops import fused_add_rms_norm, launch

pytestmark = pytest.mark.harness  # the newest-releases leg only (pyproject.toml, markers)


def _inputs(rows: int, hidden: int) -> list[torch.Tensor]:
    """x, residual, weight (trained-like: not all ones), dy, dsum, fp32."""
    gen = torch.Generator().manual_seed(0)
    x, residual, dy, dsum = (torch.randn(rows, hidden, generator=gen) for _ in range(4))
    return [x, residual, 1 + 0.5 * torch.randn(hidden, generator=gen), dy, dsum]


def _gradients(x, residual, weight, dy, dsum, norm) -> tuple[torch.Tensor, ...]:
    x, residual, weight = (t.detach().requires_grad_() for t in (x, residual, weight))
    y, s = norm(x, residual, weight)
    return torch.autograd.grad((y, s), (x, residual, weight), (dy, dsum))


def _fused(x, residual, weight):
    return fused_add_rms_norm(x, residual, weight, kernel_bench.EPS)


def _fp64(x, residual, weight):
    s = residual + x
    return weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + kernel_bench.EPS), s


def test_wide_backward_sends_a_single_tile_width_to_the_wide_kernels():
    hidden = 256
    assert launch.backward_plan(hidden, 4).single_tile  # the width the A/B is about: one tile by default
    inputs = _inputs(8, hidden)
    single_tile = _gradients(*inputs, _fused)
    with kernel_bench.wide_backward() as override:
        wide = _gradients(*inputs, _fused)
    assert override.answered == 1  # norm_backward asked the override, which answered with the wide plan
    assert launch.backward_plan(hidden, 4).single_tile  # and nothing of it stays behind
    # The same gradients by other reduction orders: no less accurate against fp64 than the single tile's, within
    # the kernel tests' allowance of 4 fp32 ulps of the largest value.
    for a, b, truth in zip(single_tile, wide, _gradients(*(t.double() for t in inputs), _fp64)):
        allowance = 4 * torch.finfo(torch.float32).eps * truth.abs().max().item()
        assert (b.double() - truth).abs().max() <= (a.double() - truth).abs().max() + allowance


def test_bench_impl_reports_an_override_that_never_reached_the_backward(monkeypatch):
    """A backward timed under an override the launches never consulted is an error row, not a figure of the
    default plan passed off as the override's."""
    impl = kernel_bench.build_impl("torch_rms_norm", 32, torch.float32, torch.device("cpu"))
    impl.context = lambda: contextlib.nullcontext(kernel_bench.PlanOverride())  # never asked for a plan
    monkeypatch.setattr(kernel_bench, "build_impl", lambda *args: impl)
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(4, 32, generator=gen) for k in ("x", "residual", "dy", "dsum")}
    forward, backward = kernel_bench.bench_impl("torch_rms_norm", ["fwd", "bwd"], inputs,
                                                kernel_bench.dry_run_settings("fp32", 0, 1))
    assert forward.status == "ok"
    assert backward.status == kernel_bench.OVERRIDE_UNUSED and backward.seconds is None


def test_pipelined_backward_pipelines_the_widest_tile_alone_and_changes_no_bit():
    """``hf_rmsnorm_pipelined``'s override gives the widest single tile (bf16 rows of 16384: re-read, not pipelined
    by default) two stages and leaves narrower tiles as they are; pipelining changes when rows are loaded, not
    what is computed, so the gradients are the default plan's bit for bit (in the interpreter, which runs the
    same kernel code)."""
    widest = launch.bwd_max_tile_n(2)
    default = launch.backward_plan(widest, 2)
    assert default.single_tile and default.num_stages == 1 and launch.bwd_rereads_row(default, 2)
    inputs = [t.to(torch.bfloat16) for t in _inputs(2, widest)]
    expected = _gradients(*inputs, _fused)
    with kernel_bench.pipelined_backward() as override:
        assert launch.backward_plan(widest, 2).num_stages == kernel_bench.PIPELINED_WIDEST_STAGES
        pipelined = _gradients(*inputs, _fused)
    assert override.answered == 2  # the plan asked above and the backward's own
    for a, b in zip(expected, pipelined):
        assert torch.equal(a, b)
    with kernel_bench.pipelined_backward() as override:
        _gradients(*(t.to(torch.bfloat16) for t in _inputs(2, 256)), _fused)
    assert override.answered == 0  # a narrower tile is left as the package plans it
