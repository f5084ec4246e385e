"""The kernel tooling scripts: offline inspection of the compiled kernels, and the benchmark's harness and maths.

The helpers are tested from the modules that hold them, harness.kernel_inspect and kernel_bench. The
scripts are run as subprocesses: the inspection must compile real GPU kernels, which it cannot do in this
process, where conftest.py has defined them for Triton's interpreter. The subprocesses inherit this process's
environment (TRITON_INTERPRET=1 included): each script sets its own backend up.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from launching import SCRIPTS

from harness import kernel_bench, kernel_inspect

pytestmark = pytest.mark.harness  # the newest-releases leg only (pyproject.toml, markers)

SCRIPTS = SCRIPTS


def _run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------------------ inspect_kernels


def test_access_bits_from_sass_modifiers():
    assert kernel_inspect.access_bits(".E.128") == 128
    assert kernel_inspect.access_bits(".E.64.CONSTANT") == 64
    assert kernel_inspect.access_bits(".E.U16") == 16
    assert kernel_inspect.access_bits(".E") == 32
    # A cache-policy modifier that merely contains digits is not a width.
    assert kernel_inspect.access_bits(".E.LTC128B") == 32


def test_global_access_widths_counts_loads_and_stores_apart():
    sass = """
        /*02c0*/               @P2 LDG.E.128 R8, desc[UR12][R22.64] ;
        /*02d0*/               @P2 LDG.E.U16 R4, desc[UR12][R24.64] ;
        /*02e0*/                   LDGSTS.E.128 [R3], desc[UR12][R22.64] ;
        /*0640*/               @P0 STG.E.128 desc[UR12][R24.64+0x1000], R8 ;
        /*0df0*/                   STG.E desc[UR12][R2.64], R16 ;
    """
    loads, stores = kernel_inspect.global_access_widths(sass)
    assert loads == {128: 2, 16: 1}
    assert stores == {128: 1, 32: 1}


def test_async_copies_are_counted_and_required_of_a_pipelined_loop():
    sass = """
        /*02e0*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR12][R22.64] ;
        /*02f0*/               @P1 LDGSTS.E.BYPASS.LTC128B.128 [R3+0x800], desc[UR12][R24.64] ;
        /*0300*/                   LDG.E.128 R8, desc[UR12][R22.64] ;
        /*0310*/                   LDGDEPBAR ;
    """
    assert kernel_inspect.count_async_copies(sass) == 2
    record = kernel_inspect.Record(
        arch="sm_90", kernel="norm_bwd_kernel", variant="bwd", dtype="bf16", hidden=4096, rows=4095, mode="llama",
        block_m=1, block_n=4096, single_tile=True, num_warps=8, num_stages=2, registers=100, spill_bytes=0,
        local_mem_ops=0, shared_bytes=0, vector_bits=128, store_vector_bits=128, async_copies=0)
    assert kernel_inspect.problems(record) == ["2 stages but no async copies"]
    record.async_copies = 2
    assert kernel_inspect.problems(record) == []


def test_spills_are_a_problem_beyond_the_budget_only():
    record = kernel_inspect.Record(
        arch="sm_90", kernel="norm_bwd_kernel", variant="bwd", dtype="bf16", hidden=16384, rows=4095, mode="llama",
        block_m=1, block_n=16384, single_tile=True, num_warps=16, num_stages=1, registers=128,
        spill_bytes=kernel_inspect.MAX_SPILL_BYTES, local_mem_ops=16, shared_bytes=0, vector_bits=128,
        store_vector_bits=128, async_copies=0)
    assert kernel_inspect.problems(record) == []
    record.spill_bytes += 8
    assert kernel_inspect.problems(record) == [f"spills {kernel_inspect.MAX_SPILL_BYTES + 8} B (16 local ops)"]


def test_parse_resource_usage_counts_stack_as_spill():
    text = (" Function norm_fwd_kernel:\n"
            "  REG:64 STACK:1064 SHARED:1024 LOCAL:8 CONSTANT[0]:624 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert kernel_inspect.parse_resource_usage(text) == {"registers": 64, "spill_bytes": 1072, "shared_bytes": 1024}
    with pytest.raises(ValueError):
        kernel_inspect.parse_resource_usage("no usage here")


def test_inspection_names_the_triton_it_needs(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.2.0")
    assert kernel_inspect.unavailable_reason() == (
        "the kernel inspection needs triton >= 3.5 (installed 3.2.0): pip install 'triton>=3.5'")



@pytest.mark.skipif(kernel_inspect.unavailable_reason() is not None,
                    reason=str(kernel_inspect.unavailable_reason()))
def test_inspect_kernels_spills_within_the_budget_and_128_bit_bf16_loads(tmp_path):
    # The fused-add forward and its backward, one hidden size kept whole in registers and one wider (the forward
    # loops over column blocks; the backward is the row reductions, then the column-blocked kernel).
    out = tmp_path / "inspect.json"
    proc = _run_script("inspect_kernels", "--arch", "sm_90", "--hidden", "4096", "65536", "--dtype", "bf16",
                       "--variant", "fwd+res", "bwd+dsum", "bwd-dot", "--strict", "--json", str(out),
                       timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    assert {(r["kernel"], r["variant"], r["hidden"], r["single_tile"]) for r in records} == {
        ("norm_fwd_kernel", "fwd+res", 4096, True), ("norm_fwd_kernel", "fwd+res", 65536, False),
        ("norm_bwd_kernel", "bwd+dsum", 4096, True), ("column_bwd_kernel", "bwd+dsum", 65536, False),
        ("row_dot_kernel", "bwd-dot", 65536, False)}  # no row reductions apart for rows of one tile
    # Both backward row loops are pipelined: their loads are asynchronous copies into shared memory.
    for r in records:
        if r["variant"] == "bwd+dsum":
            assert r["num_stages"] > 1 and r["async_copies"] > 0, r
        assert r["dtype"] == "bf16"
        assert r["spill_bytes"] <= kernel_inspect.MAX_SPILL_BYTES, r
        assert r["vector_bits"] == 128, r
        assert 0 < r["registers"] <= 255


# ------------------------------------------------------------------------------------------ bench_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")
def test_bench_without_gpu_says_so_and_exits_0():
    proc = _run_script("bench_kernels", "--rows", "1", "--hidden", "896", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dry run")
def test_bench_dry_run_runs_the_harness_on_the_cpu_and_says_so(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run_script("bench_kernels", "--rows", "8", "--hidden", "64", "--ops", "hf_rmsnorm", "hf_eager",
                       "--phases", "fwd", "bwd", "--repeats", "1", "--warmup", "1", "--dry-run", "--json", str(out),
                       timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(kernel_bench.DRY_RUN_NOTE)
    bench = json.loads(out.read_text())
    assert bench["device"] == "cpu (dry run)"
    assert [(r["impl"], r["phase"], r["status"], r["cuda_graph"]) for r in bench["results"]] == [
        (impl, phase, "ok", False) for impl in ("hf_rmsnorm", "hf_eager") for phase in ("fwd", "bwd")]
    assert all(r["seconds"] > 0 and r["call_seconds"] > 0 for r in bench["results"])


def test_min_traffic_matches_the_reference_anchor():
    # Published anchor: fused add + RMSNorm forward, N=4096, M=16384, bf16: 537 MB -> 179 us at 3.0 TB/s.
    nbytes = kernel_bench.min_traffic_bytes("fwd", 16384, 4096, 2, 2)
    assert nbytes == 4 * 16384 * 4096 * 2 + 4096 * 2
    assert round(nbytes / 1e6) == 537
    assert kernel_bench.gbps(nbytes, 179e-6) == pytest.approx(3000, rel=1e-3)


def test_min_traffic_backward_and_total():
    act = 4 * 16 * 896 * 2
    assert kernel_bench.min_traffic_bytes("bwd", 16, 896, 2, 2) == act + 2 * 896 * 2
    assert kernel_bench.min_traffic_bytes("fwd+bwd", 16, 896, 2, 4) == (act + 896 * 4) + (act + 2 * 896 * 4)


def test_sandwich_min_traffic_counts_both_norms_tensors_once():
    # Forward: x, residual, the sum and y, and two weights; backward: dy, the sum's other gradient, x, the sum, dx
    # and dresidual, two weights read and two gradients written.
    act = 16384 * 5376 * 2
    assert kernel_bench.sandwich_min_traffic_bytes("fwd", 16384, 5376, 2, 2) == 4 * act + 2 * 5376 * 2
    assert kernel_bench.sandwich_min_traffic_bytes("bwd", 16384, 5376, 2, 2) == 6 * act + 4 * 5376 * 2
    assert kernel_bench.sandwich_min_traffic_bytes("fwd+bwd", 16, 896, 2, 4) == (
        4 * 16 * 896 * 2 + 2 * 896 * 4) + (6 * 16 * 896 * 2 + 4 * 896 * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_sandwich_implementations_compute_one_function(dtype):
    """``hf_sandwich`` (one launch) gives bitwise the values and gradients of ``hf_sandwich_2launch`` (the operator's
    promise), and both those of Gemma 3's eager modules (in fp32, within fp32 rounding); the sum is
    ``residual + post_norm(x)``, and the gradients are those of x, residual and both weights."""
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(3, 64, generator=gen).to(dtype) for k in ("x", "residual", "dy", "dsum")}
    runs = {}
    for name in kernel_bench.SANDWICH_IMPLS:
        torch.manual_seed(1)  # the same trained-like weights for each
        impl = kernel_bench.build_impl(name, 64, dtype, torch.device("cpu"))
        assert impl.traffic is kernel_bench.sandwich_min_traffic_bytes and len(impl.weights) == 2
        assert impl.weights[0].abs().max() > 0  # not Gemma's zero init: both norms' weights matter
        runs[name] = [kernel_bench.phase_callable(impl, phase, inputs)() for phase in ("fwd", "bwd")]
    (y, s), grads = runs["hf_sandwich"]
    assert [tuple(g.shape) for g in grads] == [(3, 64), (3, 64), (64,), (64,)]
    assert not torch.equal(grads[0], grads[1])  # the post norm's backward lies between dx and dresidual
    for a, b in zip((y, s, *grads), (*runs["hf_sandwich_2launch"][0], *runs["hf_sandwich_2launch"][1])):
        assert torch.equal(a, b)
    if dtype == torch.float32:
        for a, b in zip((y, s, *grads), (*runs["hf_eager_sandwich"][0], *runs["hf_eager_sandwich"][1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_make_result_bandwidth_and_copy_fraction():
    r = kernel_bench.make_result("hf_rmsnorm", "fwd", 1024, 1024, "bf16", seconds=1e-3, call_seconds=4e-3,
                                 act_bytes=2, weight_bytes=2, copy_gbps=10.0, cuda_graph=True)
    assert r.status == "ok" and r.cuda_graph
    assert r.traffic_bytes == 4 * 1024 * 1024 * 2 + 1024 * 2
    assert r.gbps == pytest.approx(r.traffic_bytes / 1e-3 / 1e9)
    assert r.copy_fraction == pytest.approx(r.gbps / 10.0)
    assert r.call_gbps == pytest.approx(r.gbps / 4)
    assert r.call_copy_fraction == pytest.approx(r.copy_fraction / 4)
    assert kernel_bench.copy_traffic_bytes(100) == 200


def test_fits_in_memory():
    free = 80 * 2**30
    assert kernel_bench.fits_in_memory(65536, 16384, 2, free)
    assert not kernel_bench.fits_in_memory(65536, 65536, 2, free)


def test_time_callable_warms_up_flushes_each_run_and_takes_the_median():
    events = []
    durations = iter([5.0, 1.0, 3.0])

    def clock(fn):
        fn()
        return next(durations)

    seconds = kernel_bench.time_callable(lambda: events.append("run"), clock=clock,
                                         flush=lambda: events.append("flush"), warmup=2, repeats=3)
    assert seconds == 3.0
    assert events == ["run", "run", "flush", "run", "flush", "run", "flush", "run"]


def test_format_table_reports_both_figures_speedup_over_eager_and_failures():
    common = dict(rows=16, hidden=896, dtype="bf16", act_bytes=2, weight_bytes=2, copy_gbps=1000.0)
    results = [
        kernel_bench.make_result("hf_eager", "fwd", seconds=4e-5, call_seconds=9e-5, cuda_graph=True, **common),
        kernel_bench.make_result("hf_rmsnorm", "fwd", seconds=1e-5, call_seconds=3e-5, cuda_graph=True, **common),
        kernel_bench.Result("liger", "fwd", 16, 896, "bf16", "kernels (CUDA graph): error: RuntimeError: x"),
    ]
    lines = kernel_bench.format_table(results).splitlines()
    assert lines[0].split() == ["impl", "phase", "rows", "hidden", "kernel_us", "GB/s", "%copy", "call_us",
                                "call_GB/s", "%copy", "x", "eager", "graph"]
    r = results[1]
    assert lines[2].split()[4:] == ["10.0", f"{r.gbps:.0f}", f"{100 * r.copy_fraction:.1f}", "30.0",
                                    f"{r.call_gbps:.0f}", f"{100 * r.call_copy_fraction:.1f}", "4.00", "yes"]
    assert lines[3].endswith("kernels (CUDA graph): error: RuntimeError: x")



def test_format_table_compares_the_sandwich_with_its_own_eager_chain():
    common = dict(rows=16, hidden=896, dtype="bf16", act_bytes=2, weight_bytes=2, copy_gbps=1000.0, cuda_graph=True)
    results = [kernel_bench.make_result(impl, "fwd", seconds=seconds, call_seconds=seconds, **common)
               for impl, seconds in (("hf_eager", 1e-5), ("hf_eager_sandwich", 6e-5), ("hf_sandwich", 2e-5))]
    x_eager = [line.split()[-2] for line in kernel_bench.format_table(results).splitlines()[1:]]
    assert x_eager == ["1.00", "1.00", "3.00"]


def test_time_phase_times_the_call_and_the_captured_kernels_apart():
    """On the CPU, with a capture that records what it is given: the eager call is timed on ``make_fn()`` and
    the kernels on the capture of ``make_fn`` (the forward run once, outside, for the backward)."""
    captured = []

    def capture(make_fn):
        captured.append(make_fn)
        return make_fn()

    settings = kernel_bench.Settings(torch.device("cpu"), "fp32", 0, 1, 1.0, lambda: None, kernel_bench.wall_clock,
                                     capture, lambda: None, 1)
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(4, 32, generator=gen) for k in ("x", "residual", "dy", "dsum")}
    impl = kernel_bench.build_impl("torch_rms_norm", 32, torch.float32, torch.device("cpu"))
    result = kernel_bench.time_phase("torch_rms_norm", impl, "bwd", inputs, settings)
    assert result.status == "ok" and not result.cuda_graph
    assert result.seconds > 0 and result.call_seconds > 0
    assert len(captured) == 1
    assert kernel_bench.dry_run_settings("bf16", 0, 1).capture is kernel_bench.as_plain_call

    def failing(make_fn):
        raise RuntimeError("not capturable")

    settings.capture = failing
    result = kernel_bench.time_phase("torch_rms_norm", impl, "fwd", inputs, settings)
    assert result.status == "kernels: error: RuntimeError: not capturable"


@pytest.mark.parametrize("name", ["hf_rmsnorm", "hf_eager", "torch_rms_norm"])
def test_phase_callables_time_the_right_work(name):
    """The backward callable repeats the backward alone (retain_graph) and gives the same gradients as the
    forward+backward callable; the forward returns ``(y, residual + x)``."""
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(3, 64, generator=gen) for k in ("x", "residual", "dy", "dsum")}
    impl = kernel_bench.build_impl(name, 64, torch.float32, torch.device("cpu"))
    y, s = kernel_bench.phase_callable(impl, "fwd", inputs)()
    torch.testing.assert_close(s, inputs["residual"] + inputs["x"])
    assert not y.requires_grad
    backward = kernel_bench.phase_callable(impl, "bwd", inputs)
    first, second = backward(), backward()
    both = kernel_bench.phase_callable(impl, "fwd+bwd", inputs)()
    for a, b, c in zip(first, second, both):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
    assert [tuple(g.shape) for g in first] == [(3, 64), (3, 64), (64,)]


def test_launch_path_line_times_each_path_of_one_decode_call():
    """Run on the CPU (synchronising is a no-op there): each path runs and gets its figure."""
    settings = kernel_bench.dry_run_settings("bf16", 1, 1)
    line = kernel_bench.launch_path_line(32, settings)
    assert re.fullmatch(r"host us per decode call, 1 row, hidden 32, by launch path: cached launcher [\d.]+, "
                        r"Triton's kernel\[grid\] [\d.]+; compiled \(no CUDA graph\) through the Triton op [\d.]+, "
                        r"through the custom op [\d.]+; a patched norm module's norm\(x, residual=r\) [\d.]+ = "
                        r"[\d.]+x a cached empty Triton launch's [\d.]+ \(goal <= 1.3x\)", line), line
