"""The q/k norm + RoPE benchmark's harness (harness/qk_bench.py): its implementations compute the same thing, and
a dry run on the CPU writes kernel_bench's JSON (what the GPU suite's kernels-qk section reads)."""

from __future__ import annotations

import json

import pytest
import torch

from harness import kernel_bench, qk_bench
from hf_rmsnorm.ops.backend import kernels_interpreted

pytestmark = pytest.mark.harness  # the newest-releases leg only (pyproject.toml, markers)


@pytest.mark.skipif(not kernels_interpreted(), reason="runs the kernels in Triton's interpreter")
def test_the_implementations_timed_compute_the_same_outputs_and_gradients():
    torch.manual_seed(0)
    inputs = {"q": torch.randn(1, 3, qk_bench.QK_Q_HEADS, 64), "k": torch.randn(1, 3, qk_bench.QK_K_HEADS, 64),
              "cos": torch.randn(1, 3, 64), "sin": torch.randn(1, 3, 64),
              "dq": torch.randn(1, qk_bench.QK_Q_HEADS, 3, 64), "dk": torch.randn(1, qk_bench.QK_K_HEADS, 3, 64)}
    runs = {}
    for name in qk_bench.IMPLS:
        torch.manual_seed(1)  # the same trained-like weights for each
        impl = qk_bench.build_impl(name, 64, torch.float32, torch.device("cpu"))
        runs[name] = [qk_bench.phase_callable(impl, phase, inputs)() for phase in qk_bench.PHASES]
    ours = runs.pop("hf_qk_rope")
    for other in runs.values():
        for a, b in zip((*ours[0], *ours[1]), (*other[0], *other[1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dry run")
def test_a_dry_run_writes_the_benchmarks_json(tmp_path):
    out = tmp_path / "qk.json"
    results = qk_bench.run_benchmark(qk_bench.QKBenchConfig(
        tokens=[2], head_dim=[64], ops=list(qk_bench.IMPLS), phases=list(qk_bench.PHASES), dtype="bf16", warmup=0,
        repeats=1, json=out, dry_run=True))
    written = json.loads(out.read_text())
    assert [r["status"] for r in written["results"]] == ["ok"] * 6 == [r.status for r in results]
    r = written["results"][0]
    assert (r["impl"], r["phase"], r["rows"], r["hidden"]) == ("hf_qk_rope", "fwd", 2, 64)
    assert r["traffic_bytes"] == kernel_bench.qk_min_traffic_bytes("fwd", 2, 40, 64, 64, 2, 2)
