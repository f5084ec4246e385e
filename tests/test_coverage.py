"""scripts/coverage.py: verdicts per model type, and the page it writes (merged across chunked runs)."""

import subprocess
import sys
from pathlib import Path

from hf_rmsnorm.tools import coverage

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "coverage.py"


def test_verdicts_of_known_model_types():
    types = coverage.causal_lm_types()
    fused = coverage.check_model_type("nanochat", types["nanochat"], 60)
    assert (fused.verdict, fused.uses_rmsnorm) == ("fused", True) and fused.norms and fused.fused_adds
    assert fused.fp32_max_err <= coverage.FP32_TOLERANCE and fused.bf16_mean_err_ratio <= coverage.BF16_MEAN_SLACK
    norms_only = coverage.check_model_type("stablelm", types["stablelm"], 60)  # its layers: no known shape
    assert norms_only.verdict == "norms only" and norms_only.norms and not norms_only.fused_adds
    skipped = coverage.check_model_type("bert", types["bert"], 60)
    assert skipped.verdict == "skipped" and "no norm hf_rmsnorm can patch" in skipped.reason
    assert skipped.uses_rmsnorm is False


def test_a_parity_failure_is_reported_as_failed(monkeypatch):
    """A patched model that drifts from its eager self is a failure, never a pass."""
    import hf_rmsnorm.ops.functional as functional

    real = functional.rms_norm

    def drifting(x, weight, eps=1e-6, **kwargs):
        return real(x, weight, eps, **kwargs) * 1.01

    monkeypatch.setattr("hf_rmsnorm.patch.fused.rms_norm", drifting)
    result = coverage.check_model_type("gemma2", coverage.causal_lm_types()["gemma2"], 60)
    assert result.verdict == "failed" and "fp32 logits" in result.reason


def test_runs_in_chunks_build_one_page(tmp_path):
    out = tmp_path / "coverage.md"
    for chunk in (["llama"], ["bert", "llama"]):
        result = subprocess.run([sys.executable, str(SCRIPT), "--only", *chunk, "--out", str(out)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    page = out.read_text()
    assert "| llama | LlamaForCausalLM | fused |" in page and "| bert | BertLMHeadModel | skipped |" in page
    assert page.count("| llama |") == 1
    assert len(coverage.read(out)) == 2
