"""scripts/verify.py and the modules behind it: presets, loading, parity metrics and the verdict.

The command-line tests launch the script as users do (a subprocess, CPU, Triton's interpreter) with small
prompts so each run takes seconds; the metric tests call ``hf_rmsnorm.tools.parity`` on hand-made logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from verify_samples import sample_report
from launching import SCRIPTS

from hf_rmsnorm import check_model, patch_model, unpatch_model
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.tools import parity, workload
from hf_rmsnorm.tools.loading import ModelLoadError, looks_like_path, parse_dtype
from hf_rmsnorm.tools.presets import DEFAULT_PRESET, PRESETS, build_preset
from hf_rmsnorm.tools.verify_report import GeneratedText

# In-process runs of verify.py must ask for the device this test process set the kernels up for (conftest.py).
IN_PROCESS_DEVICE = "cpu" if kernels_interpreted() else "cuda"

SCRIPT = SCRIPTS / "verify.py"
# Small enough that one run is a few seconds on two cores, large enough for padding and several decode steps.
QUICK = ["--device", "cpu", "--batch-size", "2", "--prompt-len", "12", "--max-new-tokens", "4"]


def run_verify(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


def assert_bad_input(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2, no traceback, and the error is the last stderr line, the only one of its kind."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("verify.py: error:")]
    assert len(errors) == 1 and result.stderr.splitlines()[-1] == errors[0], result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert result.stdout == ""


# --- command line -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p.startswith("tiny-")))
def test_cli_passes_on_each_preset(preset, tmp_path):
    report_path = tmp_path / "report.json"
    result = run_verify("--model", preset, "--dtype", "fp32", "--json", str(report_path), *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Verdict: PASS" in result.stdout
    assert "Triton's CPU interpreter" in result.stdout and "needs a GPU" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["speed"] is None
    assert report["environment"]["triton_interpreter"] is True
    assert report["patch"]["norms"] > 0 and report["patch"]["fused_adds"] > 0
    figures = report["parity"]
    for key in ("max_abs_diff", "mean_abs_diff", "top1_agreement", "kl_mean", "kl_max", "unpatched_max_err",
                "unpatched_mean_err", "patched_max_err", "patched_mean_err", "greedy_match"):
        assert key in figures
    assert figures["reference_dtype"] == "float64"
    assert figures["positions"] < 2 * 12  # the second row is left-padded
    assert figures["new_tokens"] == 4


@pytest.mark.slow
def test_compiled_generation_compares_compiled_unpatched_with_compiled_patched(monkeypatch):
    """--compile: both models generate through transformers' compiled generation (static cache, torch.compile
    of each decoding step); the patched one's compiled steps run the kernels (its compiled call is not the
    unpatched model's, reused), the unpatched one's none."""
    from hf_rmsnorm.ops import launch
    from hf_rmsnorm.tools import verify
    from hf_rmsnorm.tools.verify_settings import VerifyConfig

    launches, per_generation = [], []
    real_launch, real_greedy = launch._launch, workload.greedy_tokens
    monkeypatch.setattr(launch, "_launch", lambda *args: (launches.append(args), real_launch(*args))[1])

    def counted_greedy(*args, **kwargs):
        assert kwargs["compile_on"] == "cpu"
        before = len(launches)
        generation = real_greedy(*args, **kwargs)
        per_generation.append(len(launches) - before)
        return generation

    monkeypatch.setattr(workload, "greedy_tokens", counted_greedy)
    new_tokens = 4
    config = VerifyConfig(model="tiny-llama", dtype="bf16", batch_size=2, prompt_len=12,
                          max_new_tokens=new_tokens, repeats=1, compile=True)
    report = verify.run(config, torch.device(IN_PROCESS_DEVICE))
    assert report.passed and report.settings.compile == "default"
    assert report.parity.greedy_match == 1.0
    eager_launches, patched_launches = per_generation
    assert eager_launches == 0
    # Each compiled decoding step runs one kernel per norm (the residual adds inside them).
    assert patched_launches >= (new_tokens - 1) * report.patch.norms
    assert "greedy generation (compiled)" in verify.render(report)


@pytest.mark.slow
def test_cli_loads_a_save_pretrained_directory(tmp_path):
    """A Qwen3 directory: the summary and the JSON count the attention modules whose q/k norms and RoPE run as one
    launch (every layer's)."""
    model = build_preset("tiny-qwen3", seed=3)
    model.save_pretrained(tmp_path / "model")
    layers = model.config.num_hidden_layers
    result = run_verify("--model", str(tmp_path / "model"), "--dtype", "bf16", "--json", str(tmp_path / "r.json"),
                        *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Qwen3ForCausalLM" in result.stdout
    patch_line = next(line for line in result.stdout.splitlines() if line.startswith("Patch: "))
    assert patch_line.endswith(f"0 skipped; q/k norms fused with the RoPE in {layers} attention modules "
                               "(0 left apart)"), patch_line
    patch = json.loads((tmp_path / "r.json").read_text())["patch"]
    assert (patch["fused_qk"], patch["qk_apart"]) == (layers, 0)


def _load_script():
    spec = importlib.util.spec_from_file_location("verify_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--model", "./no/such/model"], ["no such file or directory"]),
        (["--dtype", "fp8"], ["unknown dtype 'fp8'", "bf16, fp16, fp32"]),
        (["--model", "org/not-cached-model"], ["HF_HUB_OFFLINE", "save_pretrained", "preset"]),
        (["--prompt-len", "1"], ["--prompt-len"]),
    ],
    ids=["missing-path", "unknown-dtype", "hub-offline", "bad-number"],
)
def test_main_bad_input(args, fragments, capsys, monkeypatch):
    # In-process (one interpreter start per check would cost seconds each); the subprocess tests below cover
    # the real exit path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert _load_script().main([*args, "--device", IN_PROCESS_DEVICE]) == 2
    captured = capsys.readouterr()
    assert_bad_input(subprocess.CompletedProcess(args, 2, captured.out, captured.err), *fragments)


def test_main_hub_unreachable(capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    # A closed local port: the connection is refused at once (and no proxy stands in between).
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert _load_script().main(["--model", "org/not-cached-model", "--device", IN_PROCESS_DEVICE]) == 2
    captured = capsys.readouterr()
    assert_bad_input(subprocess.CompletedProcess([], 2, captured.out, captured.err),
                     "unreachable", "save_pretrained", "HF_HUB_OFFLINE")


@pytest.mark.slow
def test_cli_directory_without_model(tmp_path):
    assert_bad_input(run_verify("--model", str(tmp_path), "--device", "cpu"), "no config.json")


@pytest.mark.slow
def test_cli_unsupported_architecture(tmp_path):
    from transformers import ImageGPTConfig, ImageGPTModel

    # ImageGPT's LayerNorm divides an uncentred row by its RMS in the input's own dtype (no fp32 upcast): no kernel
    # mode computes that.
    config = ImageGPTConfig(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    ImageGPTModel(config).save_pretrained(tmp_path / "imagegpt")
    result = run_verify("--model", str(tmp_path / "imagegpt"), *QUICK)
    assert_bad_input(result, "(model_type 'imagegpt')", "ImageGPTLayerNorm", "match none of the kernels'",
                     "family_names()")
    # Refused right after loading, before any model run, in one line (naming the modes it was compared with).
    assert "unpatched model" not in result.stderr
    assert len(result.stderr.splitlines()[-1].replace(str(tmp_path / "imagegpt"), "")) < 350


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cli_cuda_without_gpu():
    assert_bad_input(run_verify("--device", "cuda"), "--device cuda", "no GPU")


@pytest.mark.gpu
def test_cli_measures_speed_on_gpu(tmp_path):
    report_path = tmp_path / "report.json"
    result = run_verify("--model", "tiny-llama", "--device", "cuda", "--prompt-len", "32", "--max-new-tokens", "8",
                        "--repeats", "2", "--json", str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    speed = json.loads(report_path.read_text())["speed"]
    for model in ("unpatched", "patched"):
        assert speed[model]["prefill_tokens_per_s"] > 0 and speed[model]["decode_tokens_per_s"] > 0
        assert speed[model]["peak_memory_bytes"] > 0
    assert speed["prefill_speedup"] > 0 and speed["decode_speedup"] > 0
    assert speed["rounds"] == 2 and speed["partial"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-t5-encoder"])
def test_cli_measures_the_embedding_workload_on_gpu(preset, tmp_path):
    """An encoder's speed: tokens/s of the 32 x 128-token forward in the three interleaved states."""
    report_path = tmp_path / "report.json"
    result = run_verify("--model", preset, "--device", "cuda", "--repeats", "2", "--json", str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    speed = report["speed"]
    assert report["kind"] == "encoder" and speed["rounds"] == 2 and speed["partial"] is False
    for state in ("unpatched", "patched", "norm_free"):
        assert speed[f"{state}_tokens_per_s"] > 0
    assert speed["speedup"] > 0 and "tokens/s" in result.stdout


# --- presets and loading ----------------------------------------------------------------------------------


def test_presets_are_reproducible_and_seeded():
    assert DEFAULT_PRESET in PRESETS
    a, b, c = build_preset(DEFAULT_PRESET), build_preset(DEFAULT_PRESET), build_preset(DEFAULT_PRESET, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.norm.weight, c.model.norm.weight)
    # Norm weights are drawn, not left at ones, so a kernel that drops its weight cannot pass.
    assert not torch.allclose(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


@pytest.mark.parametrize("preset,billions", [("llama-3.2-1b-shape", 1.236), ("llama-3-8b-shape", 8.030)])
def test_full_size_shapes_for_the_gpu_goals(preset, billions):
    """The speed goals' model shapes, built on the meta device (no memory): parameter counts of the real models."""
    model = build_preset(preset, dtype=torch.bfloat16, device="meta")
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 3) == billions


def test_path_or_hub_id():
    assert looks_like_path("./model") and looks_like_path("~/model") and looks_like_path("/abs/model")
    assert looks_like_path("a/b/c")
    assert not looks_like_path("Qwen/Qwen3-0.6B") and not looks_like_path("gpt2")


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        parse_dtype("int8")


# --- parity metrics and verdict ---------------------------------------------------------------------------


def _logits(seed: int = 0, positions: int = 8, vocab: int = 32) -> torch.Tensor:
    return torch.randn(positions, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def _generation(tokens: torch.Tensor, logits: torch.Tensor | None = None) -> workload.Generation:
    """A greedy generation of ``tokens`` ``[batch, steps]``; by default each step's logits favour its token by 5."""
    if logits is None:
        logits = torch.zeros(tokens.shape[1], tokens.shape[0], 32)
        logits.scatter_(-1, tokens.T.unsqueeze(-1), 5.0)
    return workload.Generation(tokens, logits)


def _compare(eager, patched, reference, dtype=torch.bfloat16, generation=None, patched_generation=None):
    generation = _generation(torch.zeros(2, 4, dtype=torch.long)) if generation is None else generation
    patched_generation = generation if patched_generation is None else patched_generation
    return parity.compare(eager, patched, reference, dtype, generation, patched_generation)


def test_identical_models_pass():
    reference = _logits()
    eager = reference + 0.01 * _logits(1)
    report = _compare(eager, eager.clone(), reference)
    assert report.passed and report.max_abs_diff == 0 and report.kl_max == 0 and report.top1_agreement == 1
    assert report.greedy_match and report.greedy_first_divergence is None


def test_less_accurate_patch_fails():
    reference = _logits()
    eager = reference + 0.01 * _logits(1)
    report = _compare(eager, reference + 0.02 * _logits(1), reference)
    assert not report.accuracy_ok and not report.passed
    # A different rounding of the same size is not worse.
    assert _compare(eager, reference + 0.01 * _logits(2), reference).accuracy_ok


def test_top1_flip_fails_only_where_reference_is_decisive():
    reference = torch.zeros(2, 4, dtype=torch.float64)
    reference[0, :2] = torch.tensor([5.0, 1.0])  # decisive: margin 4
    reference[1, :2] = torch.tensor([1.0, 0.999])  # a near tie: margin below bf16 noise
    eager = reference.clone()
    flip_decisive = reference.clone()
    flip_decisive[0, :2] = torch.tensor([1.0, 5.0])
    assert _compare(eager, flip_decisive, reference).patched_top1_misses == 1
    flip_tie = reference.clone()
    flip_tie[1, :2] = torch.tensor([0.999, 1.0])
    report = _compare(eager, flip_tie, reference)
    assert report.decisive_positions == 1 and report.top1_ok and report.top1_agreement == 0.5


def test_noise_is_the_larger_of_the_floor_and_twice_eager_error():
    reference = torch.tensor([[10.0, 0.0]], dtype=torch.float64)
    floor = parity.NOISE_EPS_FACTOR * torch.finfo(torch.bfloat16).eps * 10
    assert parity.noise(torch.bfloat16, reference, reference).item() == pytest.approx(floor)
    eager = reference + torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert parity.noise(torch.bfloat16, reference, eager).item() == pytest.approx(2.0)


def test_nan_logits_fail():
    reference = _logits()
    patched = reference.clone()
    patched[0, 0] = float("nan")
    assert not _compare(reference.clone(), patched, reference).passed


def _diverging_generations(unpatched_gap: float) -> tuple[workload.Generation, workload.Generation]:
    """Row 1 picks token 0 (unpatched) or 7 (patched) at step 2; the unpatched model's logits favour its token
    by ``unpatched_gap``, the patched model's favour token 7 by 0.01."""
    tokens = torch.zeros(2, 4, dtype=torch.long)
    other = tokens.clone()
    other[1, 2:] = 7
    eager, patched = _generation(tokens), _generation(other)
    eager.logits[2, 1, 7] = 5.0 - unpatched_gap
    patched.logits[2, 1, 0] = 5.0 - 0.01
    return eager, patched


def test_greedy_divergence_at_a_near_tie_passes_and_is_reported():
    reference = _logits()
    eager, patched = _diverging_generations(unpatched_gap=0.05)  # bf16 noise at |logit| 5: 4 * 2**-7 * 5 = 0.16
    report = _compare(reference.clone(), reference.clone(), reference, generation=eager, patched_generation=patched)
    assert not report.greedy_match and report.greedy_first_divergence == 2
    (divergence,) = report.divergences
    assert (divergence.row, divergence.step, divergence.unpatched_token, divergence.patched_token) == (1, 2, 0, 7)
    assert divergence.unpatched_gap == pytest.approx(0.05, abs=1e-6)
    assert divergence.patched_gap == pytest.approx(0.01, abs=1e-6)
    assert divergence.near_tie and report.greedy_ok and report.passed
    assert report.to_dict()["divergences"][0]["near_tie"] is True


def test_greedy_divergence_where_the_model_was_decisive_fails():
    reference = _logits()
    eager, patched = _diverging_generations(unpatched_gap=1.0)
    report = _compare(reference.clone(), reference.clone(), reference, generation=eager, patched_generation=patched)
    assert not report.divergences[0].near_tie and not report.greedy_ok and not report.passed
    # The unpatched model's own prompt error widens the noise: an error of 0.5 makes a gap of 1.0 a near-tie.
    sloppy = reference.clone()
    sloppy[0, 0] += 0.5
    report = _compare(sloppy, sloppy.clone(), reference, generation=eager, patched_generation=patched)
    assert report.divergences[0].noise == pytest.approx(1.0) and report.greedy_ok


def test_prompts_are_left_padded():
    prompts = workload.make_prompts(None, 512, 3, 10, 0, left_pad=True)
    lengths = prompts.attention_mask.sum(-1).tolist()
    assert lengths[0] == 10 and lengths == sorted(lengths, reverse=True) and lengths[-1] < 10
    assert (prompts.input_ids[prompts.attention_mask == 0] == 0).all()
    assert prompts.position_ids[2, -lengths[2]:].tolist() == list(range(lengths[2]))
    full = workload.make_prompts(None, 512, 2, 10, 0, left_pad=False)
    assert full.attention_mask.all()


def test_upcast_restores_every_tensor_exactly():
    model = build_preset(DEFAULT_PRESET, dtype=torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    with parity.upcast(model, torch.float32):
        assert all(p.dtype == torch.float32 for p in model.parameters())
    after = model.state_dict()
    assert all(after[name].dtype == t.dtype and torch.equal(after[name], t) for name, t in before.items())
    assert {name: b.dtype for name, b in model.named_buffers()} == buffers


# --- speed figures and the report layout (the GPU path, exercised on CPU) ---------------------------------


def test_speed_figures_and_report(monkeypatch):
    from hf_rmsnorm.tools.speed import ModelState, measure_states
    from hf_rmsnorm.tools.verify import _speed_report, render

    # Stand-ins for the CUDA calls, so the timing logic runs on CPU.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 23)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 123)
    model = build_preset(DEFAULT_PRESET)
    prompts = workload.make_prompts(None, 512, 1, 8, 0, left_pad=False)
    events = []
    states = [ModelState(name, lambda name=name: events.append(f"enter {name}"),
                         lambda name=name: events.append(f"leave {name}"))
              for name in ("unpatched", "patched", "norm_free")]
    rounds = []
    timed = measure_states(model, states, prompts, new_tokens=3, repeats=2, pad_id=0,
                           on_round=lambda figures, done: rounds.append((sorted(figures), done, len(events))))
    # Interleaved: every round (a warm-up and two timed) runs each state once, in turn, and leaves it.
    assert events == [f"{verb} {name}" for _ in range(3) for name in ("unpatched", "patched", "norm_free")
                      for verb in ("enter", "leave")]
    # The figures so far after each timed round (not the warm-up), every state's: what a run stopped early keeps.
    assert rounds == [(["norm_free", "patched", "unpatched"], 1, 12), (["norm_free", "patched", "unpatched"], 2, 18)]
    figures = timed["patched"]
    assert figures.prefill_tokens_per_s > 0 and figures.decode_tokens_per_s > 0
    assert figures.peak_memory_bytes == 100  # beyond what was allocated before the runs
    speed = _speed_report({name: figures for name in ("unpatched", "patched", "norm_free")}, rounds=2)
    assert speed.decode_speedup == 1.0 and speed.decode_gain_share is None  # no gain to share
    assert speed.rounds == 2 and not speed.partial

    reference = _logits()
    eager, patched = _diverging_generations(unpatched_gap=0.05)
    report = sample_report(
        parity=_compare(reference.clone(), reference.clone(), reference, generation=eager, patched_generation=patched),
        generations=[GeneratedText(prompt="Q0?", unpatched="A0", patched="A0"),
                     GeneratedText(prompt="Q1?", unpatched="A1", patched="B1")],
        speed=speed,
    )
    text = render(report)
    assert "decode tokens/s" in text and "1.000x" in text and "skipped lm_head: not a norm" in text
    assert "norm-free: every norm returns its input" in text and "n/a" in text
    assert "Verdict: PASS" in text and "interpreter" not in text
    assert "3 of 2.00M elements differ (5 norm calls), by at most 1 ulp" in text
    assert "row 1 first differs at token 2: unpatched gap 0.05" in text and "a near-tie" in text
    assert "[1] Q1?" in text and "patched:   'B1'" in text and "patched:   (identical)" in text
    assert "first differ in 1 rows, all at near-ties (ok)" in text


def test_the_patch_summary_counts_the_q_k_fusion():
    """The Patch line counts the attention modules fused and left apart; each one left apart is listed among the
    skipped, with its reason. A model without q/k norms says nothing of them."""
    from hf_rmsnorm.patch.report import QK_APART
    from hf_rmsnorm.tools.verify import render

    reason = f"{QK_APART}no statement Q, K = F(Q, K, cos, sin) follows the q/k norms"
    patch = replace(sample_report().patch, fused_qk=3, qk_apart=1, skipped=2,
                    skipped_modules=[("lm_head", "not a norm"), ("model.layers.3.self_attn", reason)])
    lines = render(sample_report(patch=patch)).splitlines()
    start = lines.index("Patch: 5 norms replaced (Llama), 4 residual adds fused, 2 skipped; q/k norms fused with "
                        "the RoPE in 3 attention modules (1 left apart)")
    assert lines[start + 2] == f"  skipped model.layers.3.self_attn: {reason}"
    assert "Patch: 5 norms replaced (Llama), 4 residual adds fused, 1 skipped" in render(sample_report()).splitlines()


def test_the_report_reads_back_from_its_json_document():
    """``VerifyReport.to_dict`` is the ``--json`` document and ``from_dict`` reads it back whole: every record,
    the skipped modules' pairs, and the derived verdicts (written for readers, recomputed on reading)."""
    from hf_rmsnorm.tools.verify_report import VerifyReport

    reference = _logits()
    eager, patched = _diverging_generations(unpatched_gap=0.05)
    report = sample_report(
        settings=replace(sample_report().settings, compile="reduce-overhead"),
        parity=_compare(reference.clone(), reference.clone(), reference, generation=eager, patched_generation=patched),
        generations=[GeneratedText(prompt="Q0?", unpatched="A0", patched="B0")],
    )
    document = json.loads(json.dumps(report.to_dict()))
    assert VerifyReport.from_dict(document) == report
    assert document["parity"]["divergences"][0]["near_tie"] is True and document["parity"]["passed"] is True
    assert document["patch"]["skipped_modules"] == [["lm_head", "not a norm"]]
    # 100 / 80 tokens/s patched, 120 / 80 norm-free.
    assert document["speed"]["decode_speedup"] == 1.25 == report.speed.decode_speedup
    assert document["speed"]["norm_free_speedups"]["decode_speedup"] == 1.5


def test_a_partial_report_says_how_many_rounds_it_holds_and_is_written_whole(tmp_path):
    """The document written after a timed round (``verify.run``'s ``on_report``) says it is partial and how many
    rounds its medians are of; a write replaces the previous document at once, never leaving half of one."""
    from hf_rmsnorm.tools.verify import write_json
    from hf_rmsnorm.tools.verify_report import VerifyReport

    complete = sample_report()
    partial = replace(complete, speed=replace(complete.speed, rounds=1, partial=True))
    path = tmp_path / "report.json"
    write_json(partial, path)
    document = json.loads(path.read_text())
    assert document["speed"]["partial"] is True and document["speed"]["rounds"] == 1
    assert VerifyReport.from_dict(document) == partial
    write_json(complete, path)
    assert json.loads(path.read_text())["speed"]["partial"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left behind


def test_norm_free_oracle_times_a_model_without_norms_and_restores_it():
    """The oracle's stand-in returns each norm's input (so the model runs without normalising) and leaves
    nothing behind; the gain share is the patched time saved over the norm-free time saved."""
    from hf_rmsnorm.tools.norm_free import gain_share, norm_free

    model = build_preset(DEFAULT_PRESET)
    norms = check_model(model).norms
    x = torch.randint(3, 500, (1, 6))
    with torch.no_grad():
        before = model(x).logits
        with norm_free(model, norms):
            norm = model.get_submodule(norms[0])
            probe = torch.randn(2, model.config.hidden_size)
            assert norm(probe) is probe
            assert not torch.equal(model(x).logits, before)
        assert torch.equal(model(x).logits, before) and "forward" not in norm.__dict__
    with pytest.raises(ValueError, match="nope is not a module"):
        with norm_free(model, ["nope"]):
            pass
    # 1 s per token unpatched, 0.9 patched, 0.8 norm-free: half the possible gain.
    assert gain_share(1.0, 1 / 0.9, 1 / 0.8) == pytest.approx(0.5)
    assert gain_share(1.0, 1.0, 1.0) is None


def test_norm_free_oracle_makes_the_rope_fused_with_q_k_norms_return_its_inputs():
    """On Qwen3, the RoPE the patch fuses with the q/k norms is part of what it removes: the oracle replaces the
    function in its modeling module while it runs, and puts it back."""
    from transformers.models.qwen3 import modeling_qwen3

    from hf_rmsnorm.tools.norm_free import fused_ropes, norm_free

    model = build_preset("tiny-qwen3")
    rope = modeling_qwen3.apply_rotary_pos_emb
    norms = patch_model(model).norms
    ropes = fused_ropes(model)
    assert [(namespace, name) for namespace, name, _ in ropes] == [(modeling_qwen3.__dict__, "apply_rotary_pos_emb")]
    unpatch_model(model)
    q, k = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32)
    with norm_free(model, norms, ropes):
        assert modeling_qwen3.apply_rotary_pos_emb(q, k, None, None) == (q, k)
    assert modeling_qwen3.apply_rotary_pos_emb is rope


def test_norm_free_oracle_makes_a_one_tensor_rope_return_its_input():
    """Gemma 4 rotates its queries and keys each with a function of one tensor: the oracle's stand-in returns it."""
    from patch_models import tiny_model
    from transformers.models.gemma4 import modeling_gemma4

    from hf_rmsnorm.tools.norm_free import fused_ropes, norm_free

    model = tiny_model("gemma4_text")
    rope = modeling_gemma4.apply_rotary_pos_emb
    norms = patch_model(model).norms
    ropes = fused_ropes(model)
    assert [(namespace, name) for namespace, name, _ in ropes] == [(modeling_gemma4.__dict__, "apply_rotary_pos_emb")]
    unpatch_model(model)
    x = torch.randn(1, 3, 2, 16)
    with norm_free(model, norms, ropes):
        assert modeling_gemma4.apply_rotary_pos_emb(x, None, None, unsqueeze_dim=2) is x
    assert modeling_gemma4.apply_rotary_pos_emb is rope


def test_norm_free_oracle_makes_a_rope_before_the_norms_return_its_inputs():
    """NanoChat rotates, then normalises (one qk_rope_norm launch): its function of q and k returns them."""
    from patch_models import tiny_model
    from transformers.models.nanochat import modeling_nanochat

    from hf_rmsnorm.tools.norm_free import fused_ropes, norm_free

    model = tiny_model("nanochat")
    rope = modeling_nanochat.apply_rotary_pos_emb
    norms = patch_model(model).norms
    ropes = fused_ropes(model)
    assert [(namespace, name) for namespace, name, _ in ropes] == [(modeling_nanochat.__dict__,
                                                                    "apply_rotary_pos_emb")]
    unpatch_model(model)
    q, k = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32)
    with norm_free(model, norms, ropes):
        assert modeling_nanochat.apply_rotary_pos_emb(q, k, None, None) == (q, k)
    assert modeling_nanochat.apply_rotary_pos_emb is rope
