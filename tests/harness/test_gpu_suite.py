"""scripts/gpu_suite.py: the dry run runs the real run's commands at toy sizes and writes every file on any machine,
the plans fit a lease, and the summary reports the figures the sections' own scripts wrote and what is still
unmeasured."""

import json
import re
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from finetune_samples import sample_metrics
from verify_samples import sample_encoder_report, sample_report, speed_report
from launching import ROOT, SCRIPTS

from harness import gpu_ledger, gpu_suite, gpu_wheels
from harness.gpu_suite_report import GOALS, Outcome, SpeedGoal, SuiteRun, ledger_files, summary
from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics
from hf_rmsnorm.tools.verify_report import SpeedFigures

pytestmark = pytest.mark.harness  # the newest-releases leg only (pyproject.toml, markers)

SCRIPT = SCRIPTS / "gpu_suite.py"
PATHS = {"py": "PY", "work": "WORK", "repo": "REPO"}


def toy_wheel(folder: Path) -> Path:
    """A wheel of one empty module, ``gpu_suite_probe``, as pip installs it offline."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpu_suite_probe-1.0-py3-none-any.whl"
    info = "gpu_suite_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("gpu_suite_probe.py", "")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpu-suite-probe\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.slow
def test_dry_run_runs_every_plan_and_writes_the_files(tmp_path):
    out = tmp_path / "suite"
    wheels = toy_wheel(tmp_path / "wheels").parent
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run", "--wheels", str(wheels),
                             "--plan", *gpu_suite.PLANS], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} >= {"summary.md", "results.json", "log.txt", "tuned_plans.json",
                                               "gpu_pending.json", "gpu_section_costs.json"}
    sections = json.loads((out / "results.json").read_text())["sections"]
    assert [s["name"] for s in sections] == ["wheels", *(s.name for s in gpu_suite.plan_sections(gpu_suite.PLANS))]
    assert all(s["status"] == "ok" for s in sections)
    text = (out / "summary.md").read_text()
    assert f"Plan {', '.join(gpu_suite.PLANS)}: {len(gpu_suite.SECTIONS)} sections" in text
    # The generate sections ran verify.py for real (parity on a tiny model) and the summary says so.
    assert "Parity: PASS" in text
    # The training oracle trained with its norms returning their input, and nothing patched.
    free = next(s for s in sections if s["name"] == "train-1b-norm-free")["data"]["train-1b-norm-free"]
    free = FinetuneMetrics.from_dict(free)
    assert free.norm_free and not free.patched and free.patch is None
    # The A/B's other sides ran their backward through the wide kernels and the pipelined widest tile (an override
    # that changed no plan is an error row).
    ab = next(s for s in sections if s["name"] == "kernels-bwd-ab")["data"]["kernels-bwd-ab"]["results"]
    assert {(r["impl"], r["status"]) for r in ab} == {
        (impl, "ok") for impl in ("hf_rmsnorm", "hf_rmsnorm_wide", "hf_rmsnorm_pipelined")}
    # The sandwich section timed its three implementations (hf_sandwich's norm_add_norm in the interpreter).
    sandwich = next(s for s in sections if s["name"] == "kernels-sandwich")["data"]["kernels-sandwich"]["results"]
    assert {(r["impl"], r["status"]) for r in sandwich} == {
        (impl, "ok") for impl in ("hf_sandwich", "hf_sandwich_2launch", "hf_eager_sandwich")}
    # The embedding workload's section ran verify.py's encoder path, whose report the summary read.
    embed = next(s for s in sections if s["name"] == "embed-bert-base")["data"]["embed-bert-base"]
    assert embed["kind"] == "encoder" and embed["passed"] is True
    assert "### embed-bert-base: tiny-bert (" in text
    # A dry run measures nothing: the ledger's files come back as committed.
    assert json.loads((out / "gpu_pending.json").read_text()) == json.loads(gpu_ledger.PENDING_PATH.read_text())
    assert json.loads((out / "gpu_section_costs.json").read_text()) == gpu_ledger.read_costs()


def _masked(argv: list[str], values: set[str]) -> list[str]:
    """``argv`` with every run of items that are size values replaced by one ``<size>``."""
    masked: list[str] = []
    for item in argv:
        item = "<size>" if item in values else item
        if not (item == "<size>" and masked[-1:] == ["<size>"]):
            masked.append(item)
    return masked


@pytest.mark.parametrize("section", gpu_suite.SECTIONS, ids=lambda s: s.name)
def test_the_dry_run_runs_the_real_command_at_toy_sizes(section):
    """The real and the toy command are one: equal once the size values are masked. Sizes are values, never
    options, but for a script's own CPU switch that the dry run alone passes (a slot that says why it is needed)."""
    switches = {slot: size for slot, size in section.sizes.items() if size.why}
    for size in switches.values():
        assert size in (gpu_suite.SCRIPT_DRY_RUN, gpu_suite.TWO_CPU_PROCESSES) and not size.real
    values = {v for slot, size in section.sizes.items() if slot not in switches for v in (*size.real, *size.toy)}
    assert not any(v.startswith("-") for v in values), section.name
    real, toy = section.argv(False, **PATHS), section.argv(True, **PATHS)
    toy = [item for item in toy if item not in {v for size in switches.values() for v in size.toy}]
    assert _masked(real, values) == _masked(toy, values)
    for slot in section.sizes:
        assert f"{{{slot}}}" in section.command, f"{section.name}: slot {slot} is never used"


def test_every_file_with_a_gpu_test_is_in_the_tests_section():
    gpu_test = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.M)
    marked = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
              if gpu_test.search(path.read_text())}
    assert "tests/ops/test_kernels.py" in marked
    tests = next(s for s in gpu_suite.SECTIONS if s.name == "tests")
    assert marked <= set(tests.command)


def test_every_section_is_in_one_plan_and_every_plan_fits_a_lease():
    names = [s.name for s in gpu_suite.SECTIONS]
    assert len(set(names)) == len(names)
    # Sections run plan by plan: SECTIONS lists them in that order.
    assert [s.plan for s in gpu_suite.SECTIONS] == sorted((s.plan for s in gpu_suite.SECTIONS),
                                                          key=gpu_suite.PLANS.index)
    costs = gpu_ledger.read_costs()
    assert set(costs["sections"]) == {gpu_ledger.WHEELS, *names}
    for section in gpu_suite.SECTIONS:  # a section estimated past its limit would be cut every time
        assert costs["sections"][section.name]["seconds"] <= section.limit_s, section.name
    for plan in gpu_suite.PLANS:
        seconds = gpu_ledger.plan_seconds(costs, (s.name for s in gpu_suite.plan_sections([plan])))
        assert seconds <= gpu_suite.PLAN_BUDGET_S, (plan, seconds)
    # The device call leaves a machine start and the 4 minutes a rerun on a fresh machine needs.
    assert gpu_suite.PLAN_BUDGET_S < gpu_suite.DEVICE_TIMEOUT_S
    assert gpu_suite.MACHINE_START_S + gpu_suite.DEVICE_TIMEOUT_S + gpu_suite.MIN_START_LEFT_S <= 15 * 60


def test_the_first_plan_covers_what_the_open_decisions_wait_on():
    first = {s.name: s for s in gpu_suite.plan_sections(["first"])}
    assert {"tests", "kernels-decode", "generate-1b", "train-1b-patched", "train-1b-unpatched",
            "train-1b-norm-free"} <= set(first)
    widths = first["kernels-bf16"].sizes["hidden"].real
    assert {"2048", "16384", "32768", "65536"} <= set(widths)
    ab = first["kernels-bwd-ab"]
    assert ab.sizes["hidden"].real == ("16384",) and {"hf_rmsnorm", "hf_rmsnorm_wide"} <= set(ab.command)
    assert "bwd" in ab.command


def test_every_pending_change_names_sections_of_the_suite():
    names = {s.name for s in gpu_suite.SECTIONS}
    changes = gpu_ledger.read_pending()
    assert changes and all(c.sections and set(c.sections) <= names for c in changes)


def test_contributing_gives_the_device_call_of_the_code():
    """CONTRIBUTING.md's device call runs plan first with the wheels, carries their folder and has the timeout
    that leaves a rerun room."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    call = re.search(r"run\(command=\"(?P<command>[^\"]+)\",\s*carry=\[\"(?P<carry>[^\"]+)\"\],\s*"
                     r"timeout_s=(?P<timeout>\d+)\)", text)
    assert call, "CONTRIBUTING.md has no device call"
    assert int(call["timeout"]) == gpu_suite.DEVICE_TIMEOUT_S
    assert call["carry"] == gpu_wheels.WHEEL_DIR.name
    assert f"--wheels {gpu_wheels.WHEEL_DIR.name}" in call["command"] and "--plan first" in call["command"]


def test_a_section_past_its_limit_is_stopped_and_reported(tmp_path):
    section = gpu_suite.Section("sleep", "first", "sleeps", 1, ("{py}", "-c", "import time; time.sleep(30)"))
    outcome = gpu_suite.run_section(section, 1, tmp_path, toy=True, env=gpu_suite.section_env())
    assert outcome.status == "timed out after 1 s" and outcome.seconds < 10 and outcome.limit_s == 1


def test_a_json_file_cut_off_mid_write_is_left_out_and_said(tmp_path):
    (tmp_path / "half.json").write_text('{"results": [')
    outcome = gpu_suite.run_command("half", "h", [sys.executable, "-c", "pass"], 10, gpu_suite.section_env(),
                                    tmp_path, ("half.json",))
    assert outcome.status == "ok" and outcome.data == {} and "half.json is not valid JSON" in outcome.output


def test_the_wheels_are_installed_beside_the_environment_and_the_sections_find_them(tmp_path):
    toy_wheel(tmp_path / "wheels")
    site = tmp_path / "site"
    outcome = gpu_suite.install_wheels(tmp_path / "wheels", site, 60, gpu_suite.section_env())
    assert outcome.status == "ok", outcome.output
    assert "gpu_suite_probe 1.0" in outcome.what and (site / "gpu_suite_probe.py").is_file()
    found = subprocess.run([sys.executable, "-c", "import gpu_suite_probe"], env=gpu_suite.section_env(site))
    assert found.returncode == 0


def test_the_script_refuses_a_wheel_folder_without_wheels(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "o"), "--wheels", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no wheel there; run python scripts/prepare_gpu.py" in result.stderr


def test_the_script_estimates_a_plan_without_running_it():
    result = subprocess.run([sys.executable, str(SCRIPT), "--plan", "first", "--estimate"], capture_output=True,
                            text=True, timeout=60)
    costs = gpu_ledger.read_costs()
    total = gpu_ledger.plan_seconds(costs, (s.name for s in gpu_suite.plan_sections(["first"])))
    assert result.returncode == 0
    assert re.search(rf"^total +{total:.0f} s on an {costs['card']}; time limit 510 s$", result.stdout, re.M)


# --- the ledger ---------------------------------------------------------------------------------------------


COSTS = {"card": "GPU X", "sections": {"wheels": {"seconds": 5, "source": "e"}, "a": {"seconds": 10, "source": "e"},
                                       "b": {"seconds": 20, "source": "e"}, "c": {"seconds": 30, "source": "e"}}}
PENDING = (gpu_ledger.PendingChange("change A", ("a",)), gpu_ledger.PendingChange("change AB", ("a", "b")),
           gpu_ledger.PendingChange("change C", ("c",)))


def _run(toy: bool = False) -> SuiteRun:
    return SuiteRun(("first",), ("a", "b", "c"), toy, 510, 65, COSTS, PENDING, "2026-11-28")


def test_a_change_is_measured_when_all_its_sections_completed():
    assert gpu_ledger.still_pending(PENDING, {"a", "c"}) == [PENDING[1]]
    assert gpu_ledger.still_pending(PENDING, set()) == list(PENDING)


def test_measured_costs_take_completed_times_and_lower_bounds_of_timeouts():
    costs = gpu_ledger.measured_costs(COSTS, {"a": ("ok", 12.34, 100), "b": ("timed out after 25 s", 25.2, 25),
                                              "c": ("failed (exit 1)", 3.0, 100)}, "GPU Y", "2026-11-28")
    assert costs["sections"]["a"] == {"seconds": 12.3, "source": "measured on GPU Y, 2026-11-28"}
    assert costs["sections"]["b"]["seconds"] == 25 and "at least that" in costs["sections"]["b"]["source"]
    assert costs["sections"]["c"] == COSTS["sections"]["c"]  # a failure measures nothing
    assert costs["card"] == "GPU X" and COSTS["sections"]["a"]["seconds"] == 10  # the input is left alone


def test_the_summary_lists_what_is_still_unmeasured_and_the_files_drop_what_was_measured():
    bench = {"device": "GPU Y", "copy_gbps": 1.0, "results": []}
    outcomes = [Outcome("a", "a", "ok", 11.0, data={"a": bench}, limit_s=50),
                Outcome("b", "b", "timed out after 25 s", 25.0, limit_s=25), Outcome("c", "c", "not run: ...")]
    text = summary(outcomes, _run())
    assert "Plan first: 3 sections, estimated 65 s on an GPU X (harness/gpu_section_costs.json); time limit 510 s." \
        in text
    assert "- change AB: a ok, b timed out after 25 s" in text and "- change C: c not run: ..." in text
    assert "Measured by this run (gone from the gpu_pending.json written beside this summary):\n\n- change A" in text
    files = ledger_files(outcomes, _run())
    assert files["gpu_pending.json"] == gpu_ledger.pending_document(PENDING[1:])
    assert files["gpu_section_costs.json"]["sections"]["a"]["source"] == "measured on GPU Y, 2026-11-28"
    # A dry run measures nothing and says so.
    assert ledger_files(outcomes, _run(toy=True)) == {"gpu_pending.json": gpu_ledger.pending_document(PENDING),
                                                      "gpu_section_costs.json": COSTS}
    assert "- change A: a ok, dry run" in summary(outcomes, _run(toy=True))


# --- the figures --------------------------------------------------------------------------------------------


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
    )
    stopped = replace(generate, speed=replace(generate.speed, rounds=2, partial=True))
    outcomes = [
        Outcome("tests", "t", "ok", output="... 10 passed in 3.0s\n"),
        Outcome("kernels-bf16", "k", "ok", data={"kernels-bf16": _bench({"hf_rmsnorm": 35e-6, "hf_eager": 70e-6})},
                output="launch cost, hidden 4096: empty Triton kernel 9.00 us\n  rows   1: hf_rmsnorm fwd 9.1 us\n"
                       "host us per decode call, 1 row, hidden 4096, by launch path: cached launcher 20.00\n"),
        Outcome("kernels-bwd-ab", "ab", "ok",
                data={"kernels-bwd-ab": _bench({"hf_rmsnorm": 30e-6, "hf_rmsnorm_wide": 45e-6})}),
        Outcome("generate-1b", "g", "ok", data={"generate-1b": generate.to_dict()}),
        Outcome("generate-8b", "g", "timed out after 150 s", data={"generate-8b": stopped.to_dict()}),
        Outcome("generate-pythia-1b", "g", "timed out after 150 s",
                data={"generate-pythia-1b": replace(generate, speed=None).to_dict()}),
        Outcome("train-1b-patched", "p", "ok",
                data={"train-1b-patched": sample_metrics(step_times_s=[9.0, 0.5, 0.5]).to_dict()}),
        Outcome("train-1b-unpatched", "u", "ok",
                data={"train-1b-unpatched": sample_metrics(patched=False, patch=None,
                                                           step_times_s=[9.0, 0.6, 0.6]).to_dict()}),
        Outcome("train-1b-norm-free", "f", "ok",
                data={"train-1b-norm-free": sample_metrics(patched=False, patch=None, norm_free=True,
                                                           step_times_s=[9.0, 0.45, 0.45]).to_dict()}),
        Outcome("prefill-1b", "p", "timed out after 80 s"),
        Outcome("generate-qwen3-8b", "g", "ok", data={"generate-qwen3-8b": replace(
            generate, model="qwen3-8b-shape", patch=replace(generate.patch, norms=145, fused_adds=72, fused_qk=36,
                                                            qk_apart=0)).to_dict()}),
        Outcome("kernels-sandwich", "s", "ok", data={"kernels-sandwich": _bench(
            {"hf_sandwich": 40e-6, "hf_sandwich_2launch": 50e-6, "hf_eager_sandwich": 160e-6})}),
        Outcome("embed-bert-base", "e", "ok", data={"embed-bert-base": sample_encoder_report(
            model="bert-base-shape", parameters=109_482_240, patch=replace(generate.patch, norms=25,
                                                                           fused_adds=25)).to_dict()}),
    ]
    text = summary(outcomes, _run())
    assert "Tests on the card: ... 10 passed in 3.0s" in text
    # 134 MB in 35 us: 3835 GB/s, 95.9% of 4000 GB/s, twice as fast as the eager baseline; the eager call
    # took twice as long as the kernels.
    assert "copy bandwidth 4000 GB/s; kernels under CUDA graph replay)" in text
    assert "| fwd | 4096 | 4096 | 35.0 | 3835 | 95.9% | 70.0 | 1917 | 47.9% | 2.00x |" in text
    # The A/B: the single tile's speedup over the wide kernels.
    assert "| vs hf_rmsnorm_wide |" in text and "| 60.0 | 2237 | 55.9% | 1.50x |" in text
    # The sandwich's one launch against the two launches before it and Gemma's eager modules.
    assert "| vs hf_sandwich_2launch | vs hf_eager_sandwich |" in text
    assert "| 80.0 | 1678 | 41.9% | 1.25x | 4.00x |" in text
    assert "rows   1: hf_rmsnorm fwd 9.1 us" in text
    assert "by launch path: cached launcher 20.00" in text
    # Per token: 12.5 ms unpatched, 10 ms patched, 8.33 ms norm-free: 60% of the norm-free gain.
    assert "| decode tokens/s | 80.0 | 100.0 | 1.250x | 120.0 | 1.500x | 60% |" in text
    assert "| prefill tokens/s | 1000.0 | 1100.0 | 1.100x | 1250.0 | 1.250x | 45% |" in text
    # A verify run stopped while timing: the figures of the rounds it finished, said to be partial; one stopped
    # before its first round: its parity, and why there is no speed.
    assert "median of 2; GPU X)" in text and "Partial: the run was stopped after 2 of 5 timed rounds." in text
    assert "No speed figures (the run ended before its first timed round)." in text
    # Steps of 0.6 s unpatched, 0.5 s patched, 0.45 s norm-free: two thirds of the norm-free gain.
    assert "Norm-free step speedup: 1.333x; the patch delivers 67% of that gain" in text
    assert "### train-1b: m, 1 x 2048 tokens, bf16 mixed precision, 3 steps" in text
    assert "Patched step speedup: 1.200x" in text
    assert "| prefill-1b | timed out after 80 s |" in text
    # The patch's counts, the q/k norms fused with the RoPE among them where the model has q/k norms.
    assert "Parity: PASS; 33 norms, 32 fused adds.\n" in text
    assert ("Parity: PASS; 145 norms, 72 fused adds, q/k norms fused with the RoPE in 36 attention modules (0 left "
            "apart).") in text
    # The embedding workload: an encoder's report, its tokens/s in the three states, and against issue 30's goal
    # (per token 1 ms unpatched, 0.833 ms patched, 0.8 ms norm-free: 83% of the norm-free gain).
    assert ("### embed-bert-base: bert-base-shape (109.5M parameters, bf16, embedding forward of 32 x 128 tokens, "
            "median of 2; GPU)") in text
    assert "| tokens/s | 1000 | 1200 | 1.200x | 1250 | 1.250x | 83% |" in text
    assert ("Goal (issue 30): at least 1.15x unpatched and 75% of the norm-free gain: 1.200x (met), 83% (met)."
            in text)


def test_a_goal_is_met_only_by_both_figures():
    goal = SpeedGoal(issue=30, min_speedup=1.15, min_gain_share=0.75)
    assert goal.line(1.15, 0.75).endswith(": 1.150x (met), 75% (met).")
    assert goal.line(1.149, 0.9).endswith(": 1.149x (not met), 90% (met).")
    assert goal.line(1.2, 0.5).endswith(": 1.200x (met), 50% (not met).")
    # No norm-free gain to share (the oracle was not faster): the share is not met.
    assert goal.line(1.2, None).endswith(": 1.200x (met), n/a (not met).")
    # Every goal is of a section of the suite, and issue 30's embedding goal is held.
    assert set(GOALS) <= {s.name for s in gpu_suite.SECTIONS}
    assert GOALS["embed-bert-base"] == goal
