"""scripts/gpu_suite.py: the dry run writes every file on any machine, and the summary reports the figures the
sections' own scripts wrote."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from finetune_samples import sample_metrics
from verify_samples import sample_report, speed_report
from launching import SCRIPTS

from harness import gpu_suite
from harness.gpu_suite_report import Outcome, summary
from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics
from hf_rmsnorm.tools.verify_report import SpeedFigures

SCRIPT = SCRIPTS / "gpu_suite.py"


@pytest.mark.slow
def test_dry_run_runs_every_section_and_writes_the_files(tmp_path):
    out = tmp_path / "suite"
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} >= {"summary.md", "results.json", "log.txt"}
    sections = json.loads((out / "results.json").read_text())["sections"]
    assert [s["name"] for s in sections] == [s.name for s in gpu_suite.SECTIONS]
    assert all(s["status"] == "ok" for s in sections)
    # The generate sections ran verify.py for real (parity on a tiny model) and the summary says so.
    assert "Parity: PASS" in (out / "summary.md").read_text()
    # The training oracle trained with its norms returning their input, and nothing patched.
    free = next(s for s in sections if s["name"] == "train-1b-norm-free")["data"]["train-1b-norm-free"]
    free = FinetuneMetrics.from_dict(free)
    assert free.norm_free and not free.patched and free.patch is None


def test_a_section_past_its_limit_is_stopped_and_reported(tmp_path):
    section = gpu_suite.Section("sleep", "sleeps", 1, ("{py}", "-c", "import time; time.sleep(30)"),
                                ("{py}", "-c", "import time; time.sleep(30)"))
    outcome = gpu_suite.run_section(section, 1, tmp_path, toy=True, env=gpu_suite.section_env())
    assert outcome.status == "timed out after 1 s" and outcome.seconds < 10


def _bench(impl_seconds: dict[str, float]) -> dict:
    return {"device": "GPU X", "torch": "2", "copy_gbps": 4000.0, "results": [
        {"impl": impl, "phase": "fwd", "rows": 4096, "hidden": 4096, "dtype": "bf16", "status": "ok",
         "seconds": seconds, "traffic_bytes": 134217728, "gbps": 134217728 / seconds / 1e9,
         "copy_fraction": 134217728 / seconds / 1e9 / 4000.0, "cuda_graph": True,
         "call_seconds": 2 * seconds, "call_gbps": 134217728 / seconds / 2e9,
         "call_copy_fraction": 134217728 / seconds / 2e9 / 4000.0}
        for impl, seconds in impl_seconds.items()]}


def test_summary_reports_the_scripts_figures():
    generate = sample_report(
        model="llama-3.2-1b-shape", parameters=1_240_000_000,
        settings=replace(sample_report().settings, batch_size=1, prompt_len=128, max_new_tokens=256, repeats=5),
        environment=replace(sample_report().environment, device_name="GPU X"),
        patch=replace(sample_report().patch, norms=33, fused_adds=32),
        speed=speed_report(SpeedFigures(1000.0, 80.0, 2**30), SpeedFigures(1100.0, 100.0, 2**30),
                           SpeedFigures(1250.0, 120.0, 2**30)),
    ).to_dict()
    outcomes = [
        Outcome("tests", "t", "ok", output="... 10 passed in 3.0s\n"),
        Outcome("kernels-bf16", "k", "ok", data={"kernels-bf16": _bench({"hf_rmsnorm": 35e-6, "hf_eager": 70e-6})},
                output="launch cost, hidden 4096: empty Triton kernel 9.00 us\n  rows   1: hf_rmsnorm fwd 9.1 us\n"
                       "host us per decode call, 1 row, hidden 4096, by launch path: cached launcher 20.00\n"),
        Outcome("generate-1b", "g", "ok", data={"generate-1b": generate}),
        Outcome("train-1b-patched", "p", "ok",
                data={"train-1b-patched": sample_metrics(step_times_s=[9.0, 0.5, 0.5]).to_dict()}),
        Outcome("train-1b-unpatched", "u", "ok",
                data={"train-1b-unpatched": sample_metrics(patched=False, patch=None,
                                                           step_times_s=[9.0, 0.6, 0.6]).to_dict()}),
        Outcome("train-1b-norm-free", "f", "ok",
                data={"train-1b-norm-free": sample_metrics(patched=False, patch=None, norm_free=True,
                                                           step_times_s=[9.0, 0.45, 0.45]).to_dict()}),
        Outcome("prefill-1b", "p", "timed out after 80 s"),
    ]
    text = summary(outcomes, toy=False)
    assert "Tests on the card: ... 10 passed in 3.0s" in text
    # 134 MB in 35 us: 3835 GB/s, 95.9% of 4000 GB/s, twice as fast as the eager baseline; the eager call
    # took twice as long as the kernels.
    assert "copy bandwidth 4000 GB/s; kernels under CUDA graph replay)" in text
    assert "| fwd | 4096 | 4096 | 35.0 | 3835 | 95.9% | 70.0 | 1917 | 47.9% | 2.00x |" in text
    assert "rows   1: hf_rmsnorm fwd 9.1 us" in text
    assert "by launch path: cached launcher 20.00" in text
    # Per token: 12.5 ms unpatched, 10 ms patched, 8.33 ms norm-free: 60% of the norm-free gain.
    assert "| decode tokens/s | 80.0 | 100.0 | 1.250x | 120.0 | 1.500x | 60% |" in text
    assert "| prefill tokens/s | 1000.0 | 1100.0 | 1.100x | 1250.0 | 1.250x | 45% |" in text
    # Steps of 0.6 s unpatched, 0.5 s patched, 0.45 s norm-free: two thirds of the norm-free gain.
    assert "Norm-free step speedup: 1.333x; the patch delivers 67% of that gain" in text
    assert "### train-1b: m, 1 x 2048 tokens, bf16 mixed precision, 3 steps" in text
    assert "Patched step speedup: 1.200x" in text
    assert "| prefill-1b | timed out after 80 s |" in text

