"""The tuned-plan table: the plan functions apply its entries per architecture and width bucket, the loader
refuses a malformed table in one line, and the tuner (its dry run on the CPU, its descent under a stand-in clock)
writes what the loader reads."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch
from launching import SCRIPTS

from hf_rmsnorm.ops import launch, tuning
from hf_rmsnorm.ops.tuning import PlanKey, TableError
from harness import gpu_suite, gpu_suite_report, kernel_bench, kernel_tuning
from harness.kernel_inspect import capture_launch

SCRIPT = SCRIPTS / "tune_kernels.py"
ARCH = "sm_90"


def _table(*entries: dict, arch: str = ARCH) -> dict:
    section = {"card": "GPU X", "date": "2025-01-01", "command": "scripts/tune_kernels.py", "triton": "3.4.0",
               "torch": "2.11.0", "swept": [], "entries": list(entries)}
    return {"format": tuning.TABLE_FORMAT, "architectures": {arch: section}}


def _entry(kernel: str = "backward", elem_bytes: int = 2, width: int = 4096, **plan: int) -> dict:
    return {"kernel": kernel, "elem_bytes": elem_bytes, "width_bucket": width, "plan": plan or {"num_warps": 8}}


def _in_use(*entries: dict):
    table = _table(*entries)
    tuning.validate_table(table, "test table")
    return tuning.plans_in_use(tuning.index_table(table))


PLANS = [(kernel, elem_bytes) for kernel in kernel_tuning.KERNELS for elem_bytes in tuning.ELEM_BYTES]


# ------------------------------------------------------------------------------------------------ the plan


def test_the_installed_table_is_valid():
    tuning.read_table(tuning.TABLE_PATH)


@pytest.mark.parametrize("kernel, elem_bytes", PLANS)
def test_widths_at_every_threshold_of_the_plan(kernel, elem_bytes):
    """The plan is a function of the width bucket: it can change only where a bucket ends, so widths on both
    sides of every bucket boundary (``b // 2`` and ``b // 2 + 1``, ``b`` and ``b + 1``) cover every threshold
    it has; every row past the last bucket takes the looped kernel with the last bucket's plan."""
    plan = kernel_tuning.plan_function(kernel)
    max_tile_n = (launch.fwd_max_tile_n if kernel == "forward" else launch.bwd_max_tile_n)(elem_bytes)
    widths = kernel_tuning.plan_widths(kernel, elem_bytes)
    assert widths[-1] == 2 * max_tile_n and widths == [2**k for k in range(len(widths))]
    for b in widths:
        for n_cols in {max(1, b // 2), b // 2 + 1, b, b + 1}:
            p = plan(n_cols, elem_bytes)
            assert p.single_tile == (n_cols <= max_tile_n)
            assert 1 <= p.num_warps <= tuning.MAX_NUM_WARPS and p.num_stages >= 1
            if p.single_tile:
                assert p.block_n == tuning.width_bucket(n_cols, max_tile_n) >= n_cols
                assert p.block_m * p.block_n <= max(launch.TARGET_TILE_ELEMENTS, p.block_n)
            else:
                assert (p.block_m, p.block_n) == (1, launch.LOOP_BLOCK_N)
            assert (p.programs_per_sm is None) == (kernel == "forward")
        if b > 1:
            assert plan(b // 2 + 1, elem_bytes) == plan(b, elem_bytes)
    assert plan(3 * widths[-1], elem_bytes) == plan(widths[-1], elem_bytes)


@pytest.mark.parametrize("kernel, elem_bytes", PLANS)
def test_an_entry_applies_to_its_architecture_element_size_and_bucket_only(kernel, elem_bytes):
    """At each bucket ``b``: widths ``b // 2 + 1`` to ``b`` (and all wider ones, for the looped bucket) of that
    architecture and element size take the entry; the neighbouring buckets, other architectures, the other
    element size and the CPU (no architecture) keep the defaults."""
    plan = kernel_tuning.plan_function(kernel)
    # Values no default plan has, so that an applied entry always shows.
    overrides = {name: value for name, value in
                 (("block_m", 128), ("num_warps", 32), ("num_stages", 7), ("programs_per_sm", 7))
                 if name in tuning.TUNABLE[kernel]}
    installed = plan(4096, elem_bytes, ARCH)
    for b in kernel_tuning.plan_widths(kernel, elem_bytes)[1:]:
        looped = not plan(b, elem_bytes).single_tile
        with _in_use(_entry(kernel, elem_bytes, b, **overrides)):
            for n_cols in [b // 2 + 1, b] + ([b + 1, 4 * b] if looped else []):
                assert plan(n_cols, elem_bytes, ARCH) == plan(n_cols, elem_bytes)._replace(**overrides)
            untouched = [(b // 2, elem_bytes, ARCH), (b, elem_bytes, "sm_80"), (b, 6 - elem_bytes, ARCH),
                         (b, elem_bytes, None)] + ([] if looped else [(b + 1, elem_bytes, ARCH)])
            for n_cols, size, arch in untouched:
                assert plan(n_cols, size, arch) == plan(n_cols, size)
                assert not overrides.items() & plan(n_cols, size, arch)._asdict().items()
    assert plan(4096, elem_bytes, ARCH) == installed  # the installed table is in use again


def test_rows_wider_than_their_variants_tile_share_the_wide_kernels_bucket():
    """A LayerNorm with a bias at 16384 bf16 elements takes the wide kernels (its tile would spill): it reads the
    entry of the wide kernels' bucket, not that of the single tile of the same width."""
    live = launch.bwd_live_tiles(True, True, launch.get_mode("layernorm"))
    wide = 2 * launch.bwd_max_tile_n(2)
    with _in_use(_entry("backward", 2, wide, num_warps=4), _entry("backward", 2, 16384, num_warps=32)):
        assert launch.backward_plan(16384, 2, ARCH, live).num_warps == 4
        assert launch.backward_plan(16384, 2, ARCH).num_warps == 32


def test_launches_and_the_inspection_take_the_tuned_plan():
    """launch.py's own host code, through the inspection's recorder, for the architecture being inspected."""
    forward = _entry("forward", 2, 512, block_m=2, num_warps=2)
    backward = _entry("backward", 2, 512, block_m=4, num_warps=4, num_stages=2, programs_per_sm=3)
    with _in_use(forward, backward):
        _, _, fwd = capture_launch("fwd+res", torch.bfloat16, 300, 4095, "llama", sm_count=132, arch=ARCH)
        _, _, bwd = capture_launch("bwd+dsum", torch.bfloat16, 300, 4095, "llama", sm_count=132, arch=ARCH)
        _, _, default = capture_launch("bwd+dsum", torch.bfloat16, 300, 4095, "llama", sm_count=132, arch="sm_80")
    assert (fwd["BLOCK_M"], fwd["BLOCK_N"], fwd["num_warps"]) == (2, 512, 2)
    assert (bwd["BLOCK_M"], bwd["NUM_STAGES"], bwd["num_warps"]) == (4, 2, 4)
    default_plan = launch.backward_plan(300, 2)
    assert (default["BLOCK_M"], default["NUM_STAGES"]) == (default_plan.block_m, default_plan.num_stages)


def test_the_installed_table_is_read_from_its_file_once(tmp_path, monkeypatch):
    path = tmp_path / "tuned_plans.json"
    path.write_text(json.dumps(_table(_entry("forward", 4, 1024, block_m=2))))
    reads, read_table = [], tuning.read_table
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    monkeypatch.setattr(tuning, "read_table", lambda p: reads.append(p) or read_table(p))
    tuning._installed_index.cache_clear()
    with tuning.plans_in_use({}):  # drops the plans cached from the real table...
        pass
    try:
        assert launch.forward_plan(1000, 4, ARCH).block_m == 2
        assert launch.forward_plan(1000, 2, ARCH).block_m == launch.forward_plan(1000, 2).block_m
        assert reads == [path]
    finally:
        tuning._installed_index.cache_clear()
        monkeypatch.undo()
        with tuning.plans_in_use({}):  # ...and the plans cached from the temporary one
            pass


def test_architecture_names(monkeypatch):
    """CUDA's compute capability, ROCm's gfx target without its feature flags; none for CPU and meta tensors."""
    props = type("Props", (), {"major": 9, "minor": 0, "gcnArchName": "gfx942:sramecc+:xnack-"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    try:
        for hip, name in ((None, "sm_90"), ("6.2", "gfx942")):
            monkeypatch.setattr(torch.version, "hip", hip)
            tuning.device_arch.cache_clear()
            assert tuning.device_arch(0) == name
        assert tuning.device_arch(torch.empty(1).get_device()) is None
        assert tuning.device_arch(torch.empty(1, device="meta").get_device()) is None
    finally:
        tuning.device_arch.cache_clear()


# ----------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("entry, message", [
    (_entry(block_m=3), "block_m must be a power of two, got 3"),
    (_entry(num_warps=48), "num_warps must be a power of two from 1 to 32, got 48"),
    (_entry(num_warps=0), "num_warps must be a power of two from 1 to 32, got 0"),
    (_entry(num_stages=0), "num_stages must be an integer of at least 1, got 0"),
    (_entry(programs_per_sm=True), "programs_per_sm must be an integer from 1 to 32, got True"),
    (_entry("forward", num_stages=2), "the forward has no tunable 'num_stages'"),
    (_entry("sideways"), "kernel must be one of forward, backward, got 'sideways'"),
    (_entry(elem_bytes=8), "elem_bytes must be one of 2, 4, got 8"),
    (_entry(width=3000), "width_bucket must be a power of two, got 3000"),
    ({**_entry(), "plan": {}}, "plan must be a non-empty object"),
    ({**_entry(), "bloc_m": 2}, "unknown field(s) bloc_m"),
])
def test_a_malformed_entry_is_refused_in_one_line_naming_the_file_and_entry(tmp_path, entry, message):
    path = tmp_path / "tuned_plans.json"
    path.write_text(json.dumps(_table(_entry("forward"), entry)))
    with pytest.raises(TableError) as info:
        tuning.read_table(path)
    text = str(info.value)
    assert text.startswith(f"{path}: architectures.{ARCH}.entries[1]: {message}") and "\n" not in text


@pytest.mark.parametrize("table, message", [
    ({"format": 2, "architectures": {}}, "format: this release reads format 1, got 2"),
    ({"architectures": {}}, "top level: expected an object with exactly 'format' and 'architectures'"),
    (_table(arch="hopper"), "architectures.hopper: an architecture is named sm_<major><minor>"),
    ({"format": 1, "architectures": {ARCH: {**_table()["architectures"][ARCH], "card": ""}}},
     f"architectures.{ARCH}.card: expected a non-empty string"),
    (_table(_entry(), _entry(num_warps=4)), f"architectures.{ARCH}.entries[1]: a second entry for backward/2/4096"),
])
def test_a_malformed_table_is_refused(table, message):
    with pytest.raises(TableError, match="^" + re.escape(f"t.json: {message}")):
        tuning.validate_table(table, "t.json")


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    path = tmp_path / "tuned_plans.json"
    path.write_text("{")
    with pytest.raises(TableError, match=f"^{path}: not valid JSON"):
        tuning.read_table(path)


# ---------------------------------------------------------------------------------------------------- tuner


def test_a_candidate_is_judged_against_fp64_by_the_kernel_tests_rule():
    """The backward under another plan (half the block rows: another order of the weight gradient's sum) is as
    accurate as the default plan's against fp64; a gradient off by a few ulps at its largest value, or a residual
    sum one bit off, is not."""
    width, rows = 300, 37
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(rows, width, generator=gen).to(torch.bfloat16) for k in ("x", "residual", "dy", "dsum")}
    impl = kernel_bench.build_impl("hf_rmsnorm", width, torch.bfloat16, torch.device("cpu"))

    def run(phase):
        return kernel_bench.phase_callable(impl, phase, inputs)()

    reference, reference_fwd = run("bwd"), run("fwd")
    exact, exact_fwd = kernel_tuning.exact_outputs("backward", inputs), kernel_tuning.exact_outputs("forward", inputs)
    assert kernel_tuning.output_problem("backward", reference, reference, exact) is None
    assert kernel_tuning.output_problem("forward", reference_fwd, reference_fwd, exact_fwd) is None
    default = launch.backward_plan(width, 2)
    with tuning.plans_in_use({PlanKey(None, "backward", 2, 512): {"block_m": default.block_m // 2}}):
        assert launch.backward_plan(width, 2).block_m == default.block_m // 2
        assert kernel_tuning.output_problem("backward", run("bwd"), reference, exact) is None
    dweight = reference[2]
    off = dweight + 4 * torch.finfo(torch.bfloat16).eps * dweight.abs().max()
    assert "dweight less accurate than the default plan's" in kernel_tuning.output_problem(
        "backward", (*reference[:2], off), reference, exact)
    y, total = reference_fwd
    flipped = total.clone()
    flipped.view(torch.int16)[0, 0] ^= 1
    assert kernel_tuning.output_problem("forward", (y, flipped), reference_fwd, exact_fwd) == (
        "sum not bitwise equal to the default plan's")


def _stand_in_settings(cost) -> kernel_bench.Settings:
    """The dry run's settings with a clock that charges ``cost(forward plan in use)`` seconds per run."""

    def clock(fn):
        fn()
        return cost(launch.forward_plan(64, 2))

    return dataclasses.replace(kernel_bench.dry_run_settings("bf16", 0, 1), clock=clock)


def test_the_descent_moves_one_constant_at_a_time_and_confirms_its_winner():
    # Fastest at 16 block rows and 4 warps; each constant is tried one step either side of the best so far.
    settings = _stand_in_settings(lambda p: 1 + abs(math.log2(p.block_m) - 4) + (p.num_warps != 4) / 2)
    sweep = kernel_tuning.Sweeper(settings, None, math.inf).sweep("forward", "bf16", 64, 1024, None)
    assert sweep.default == {"block_m": 64, "num_warps": 8} and sweep.default_seconds == 3.5
    assert [t.plan for t in sweep.trials] == [
        {"block_m": 32, "num_warps": 8}, {"block_m": 128, "num_warps": 8},
        {"block_m": 32, "num_warps": 4}, {"block_m": 32, "num_warps": 16},
        {"block_m": 64, "num_warps": 4}, {"block_m": 64, "num_warps": 16}]  # the default's, not yet tried
    assert all(t.status == "ok" for t in sweep.trials)  # as accurate as the default plan against fp64
    assert (sweep.best, sweep.best_seconds, sweep.complete) == ({"block_m": 32, "num_warps": 4}, 2.0, True)
    assert sweep.wins()
    assert sweep.entry() == {"kernel": "forward", "elem_bytes": 2, "width_bucket": 64,
                             "plan": {"block_m": 32, "num_warps": 4},
                             "measured": {"rows": 16, "us": 2e6, "default_us": 3.5e6}}


def test_a_constant_changed_alone_from_the_default_is_tried_after_the_descent():
    """The descent moves block_m first (slightly faster), and warps around it are slower; the default with fewer
    warps, which it never tries, is the fastest."""
    times = {(32, 8): 1.9, (64, 4): 1.5}
    settings = _stand_in_settings(lambda p: times.get((p.block_m, p.num_warps), 2.5 if p.block_m == 32 else 3.0))
    sweep = kernel_tuning.Sweeper(settings, None, math.inf).sweep("forward", "bf16", 64, 1024, None)
    assert {"block_m": 64, "num_warps": 4} in [t.plan for t in sweep.trials]
    assert (sweep.best, sweep.best_seconds) == ({"block_m": 64, "num_warps": 4}, 1.5)


def test_the_time_limit_stops_the_descent_with_the_default_kept():
    settings = _stand_in_settings(lambda p: 1.0)
    sweep = kernel_tuning.Sweeper(settings, None, time.monotonic() - 1).sweep("forward", "bf16", 64, 1024, None)
    assert (sweep.trials, sweep.best, sweep.complete) == ([], sweep.default, False)
    assert not sweep.wins()


def test_only_a_winner_by_more_than_the_noise_margin_is_written(tmp_path):
    def swept(kernel, width, seconds):
        plan = tuning.TUNABLE[kernel]
        default = {name: 4 for name in plan}
        return kernel_tuning.BucketSweep(kernel, "bf16", width, 8, default, 1.0, {**default, plan[0]: 2}, seconds)

    sweeps = [swept("backward", 4096, 0.9), swept("forward", 4096, 1 - kernel_tuning.MIN_GAIN / 2)]
    installed = _table(arch="sm_80")
    table = kernel_tuning.merged_table(installed, ARCH,
                                       kernel_tuning.architecture_section(sweeps, "GPU X", "scripts/tune_kernels.py"))
    path = tmp_path / "tuned_plans.json"
    kernel_tuning.write_table(path, table)
    read = tuning.read_table(path)
    assert set(read["architectures"]) == {"sm_80", ARCH}
    section = read["architectures"][ARCH]
    assert section["swept"] == ["backward/2/4096", "forward/2/4096"]
    assert [e["kernel"] for e in section["entries"]] == ["backward"]
    with tuning.plans_in_use(tuning.index_table(read)):
        assert launch.backward_plan(4096, 2, ARCH).block_m == 2


def test_the_dry_run_writes_the_installed_table_unchanged(tmp_path):
    out = tmp_path / "tuned.json"
    config = kernel_tuning.TuneConfig(kernels=["forward"], dtypes=["bf16"], warmup=0, repeats=1, command="test",
                                      json=out, dry_run=True)
    sweeps = kernel_tuning.run_tuning(config)
    assert [(s.kernel, s.width) for s in sweeps] == [("forward", kernel_tuning.MIN_SWEPT_WIDTH)]
    assert len(sweeps[0].trials) == kernel_tuning.DRY_RUN_TRIALS
    assert tuning.read_table(out) == tuning.read_table(tuning.TABLE_PATH)


@pytest.mark.slow
def test_the_script_dry_run_says_what_it_is_and_prints_no_time(tmp_path):
    out = tmp_path / "tuned.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--warmup", "0", "--repeats", "1", "--json",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(kernel_tuning.DRY_RUN_NOTE)
    lines = [line for line in proc.stdout.splitlines() if " width " in line]
    assert len(lines) == len(kernel_tuning.KERNELS) * len(kernel_tuning.DTYPES)
    assert not any(" us " in line or line.endswith(", written") for line in lines)
    assert tuning.read_table(out) == tuning.read_table(tuning.TABLE_PATH)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")
def test_the_script_without_a_gpu_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "needs a CUDA" in proc.stdout, proc.stdout + proc.stderr


def test_the_script_refuses_a_width_that_is_no_bucket():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--widths", "3000"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "a width bucket is a power of two, got 3000" in proc.stderr


def test_the_suite_copies_the_table_out_ready_to_commit(tmp_path):
    section, = [s for s in gpu_suite.SECTIONS if s.name == "tune"]
    assert section.outputs == (tuning.TABLE_PATH.name,)
    table = _table(_entry())
    outcome = gpu_suite_report.Outcome("tune", section.what, "ok", data={tuning.TABLE_PATH.stem: table})
    gpu_suite_report.write_files(tmp_path, [outcome], gpu_suite.suite_run([section], [], toy=False, time_limit_s=None))
    assert tuning.read_table(tmp_path / tuning.TABLE_PATH.name) == table


def test_a_candidate_whose_binaries_spill_past_the_inspection_rule_loses(monkeypatch):
    """On a GPU the launchers cache the binaries a candidate launched; one that spills more than the offline
    inspection's limit (Triton's ``n_spills``: 4-byte words of local memory) is refused, one within it passes.
    In the interpreter no binary is cached and nothing is refused."""
    from types import SimpleNamespace

    from harness.kernel_inspect import MAX_SPILL_BYTES

    def launchers(*spill_words: int) -> dict:
        return {"kernel": SimpleNamespace(binaries=lambda: [SimpleNamespace(n_spills=n) for n in spill_words])}

    monkeypatch.setattr(launch, "_LAUNCHERS", launchers(0, MAX_SPILL_BYTES // 4 + 1))
    assert kernel_tuning.spill_problem() == f"spills {MAX_SPILL_BYTES + 4} B a thread (at most {MAX_SPILL_BYTES})"
    monkeypatch.setattr(launch, "_LAUNCHERS", launchers(MAX_SPILL_BYTES // 4))
    assert kernel_tuning.spill_problem() is None
    monkeypatch.setattr(launch, "_LAUNCHERS", launchers())
    assert kernel_tuning.spill_problem() is None
