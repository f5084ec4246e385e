"""Every GPU measurement of the project, in plans of one lease each: what ``scripts/gpu_suite.py`` does.

A GPU is lent rarely, for 15 minutes of device time (a machine start included) and at most 10 minutes a command,
on a bare machine without network. So the suite is one command that needs nothing but the checkout and the wheels
``scripts/prepare_gpu.py`` fetched beforehand (``gpu_wheels``): it installs those offline (``--wheels``), then
runs the sections of a plan, each one of the project's own scripts in a subprocess (``PYTHONPATH`` points at the
checkout) under a hard time limit. A section that fails or runs out of time leaves the others alone, and each
section's script writes its figures as it goes, so a section stopped at its limit still leaves what it measured.

The plans (``PLANS``) split the sections, in order of value, into runs of one lease each: ``first`` is what a
session with a GPU runs before anything else (the kernel tests on the card, the kernels from hidden 2048 to 65536
with the A/B of the single-tile backward at 16384, decode host time per call, generate() on the 1B shape and the
three training states); ``second`` to ``fourth`` the rest. Each plan's time on an H100 is estimated from
``gpu_section_costs.json`` (``gpu_ledger``) and held to ``PLAN_BUDGET_S`` by the tests. Everything lands in
``--out``:

* ``summary.md``: which plan ran, the figures as Markdown tables ready for ``BENCHMARKS.md``, and the changes still
  awaiting a GPU measurement (``gpu_pending.json``) whose sections did not complete;
* ``results.json``: every section's status, time, command and the JSON its script wrote;
* ``log.txt``: every section's full output;
* ``kernels.png``: achieved bandwidth against hidden size (when matplotlib is installed and kernels were timed);
* ``tuned_plans.json``: the ``tune`` section's table, to copy over ``hf_rmsnorm/ops/tuned_plans.json``;
* ``gpu_pending.json`` and ``gpu_section_costs.json``: the files of ``harness/`` less what this run measured, and
  with the section times it measured, to copy over them once the run is recorded.

``--dry-run`` runs the very same commands at toy sizes, on the CPU when there is no GPU: each section's command is
one template (``Section``) filled with its real or its toy sizes, so the plumbing is tested anywhere in a few
minutes; it writes the same files (measuring nothing, it leaves the two data files as they are).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from . import gpu_ledger, gpu_wheels
from .gpu_suite_report import Outcome, SuiteRun, write_files

REPO = Path(__file__).resolve().parents[1]
# A lease: 15 minutes of device time, a machine start (1-2 minutes) included, and no machine starts with under 4
# minutes left. The device call's timeout leaves those 4 minutes, so a failed call can still be rerun on a fresh
# machine; a plan measures for at most PLAN_BUDGET_S of it (8.5 minutes), the rest is the suite's own start and
# its files, and a section's last seconds past the deadline.
LEASE_S = 15 * 60
MACHINE_START_S = 2 * 60
MIN_START_LEFT_S = 4 * 60
DEVICE_TIMEOUT_S = LEASE_S - MACHINE_START_S - MIN_START_LEFT_S
PLAN_BUDGET_S = 510
# A section is not started with less time than this left: it could not even load a model.
MIN_SECTION_S = 20
# The offline install of the carried wheels, before the first section.
WHEELS_LIMIT_S = 60
# Training steps timed per run (the first, which compiles and warms the allocator, is left out of the figures).
TRAIN_STEPS = 12
# The tests section loads exactly these pytest plugins (-p), with pytest's automatic plugin loading off
# (PYTEST_DISABLE_PLUGIN_AUTOLOAD in section_env): the carried pytest then meets none of the plugins the image
# may hold for another pytest release. xdist gives -n, pytest-timeout gives --timeout.
TEST_PLUGINS = ("xdist.plugin", "pytest_timeout")
# A test that hangs on the card (a driver or NCCL stall) fails alone after this, instead of holding the section.
TEST_TIMEOUT_S = 120


class Size(NamedTuple):
    """The values of one slot of a section's command: on a GPU (``real``) and in a dry run (``toy``).

    Sizes are values (rows, widths, models, steps, devices). Where a script needs an option to run on a CPU at
    all, ``why`` says so: tests/harness/test_gpu_suite.py admits an option among a slot's values only then."""

    real: tuple[str, ...]
    toy: tuple[str, ...]
    why: str = ""


def size(real: str | tuple[str, ...], toy: str | tuple[str, ...]) -> Size:
    """A slot of one value each (a string) or of several (a tuple)."""
    return Size(real if isinstance(real, tuple) else (real,), toy if isinstance(toy, tuple) else (toy,))


# The benchmark and the tuner say "no GPU" and time nothing on a CPU unless asked for their dry run.
SCRIPT_DRY_RUN = Size((), ("--dry-run",), "the script times nothing on a CPU without its own --dry-run")
# FSDP2 on a CPU needs two processes (one has nothing to shard), which accelerate starts only as --multi_gpu; on
# a GPU the run is one process on its one GPU.
TWO_CPU_PROCESSES = Size((), ("--multi_gpu",), "FSDP2 on a CPU needs two processes, launched as --multi_gpu")


@dataclass(frozen=True)
class Section:
    """One measurement: a command of the project's scripts, its plan, time limit and the JSON files it writes.

    ``command`` is one template for the real run and the dry run alike. ``{py}`` (this interpreter), ``{work}`` (a
    scratch folder) and ``{repo}`` (the checkout) inside an item are filled the same in both; an item that is
    exactly ``{slot}``, a key of ``sizes``, becomes that slot's real values, or in a dry run its toy ones."""

    name: str
    plan: str
    what: str
    limit_s: int
    command: tuple[str, ...]
    sizes: Mapping[str, Size] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()

    def argv(self, toy: bool, **paths: object) -> list[str]:
        """The command with its slots filled for a dry run (``toy``) or a GPU run, and ``paths`` filled in."""
        argv: list[str] = []
        for item in self.command:
            slot = self.sizes.get(item[1:-1]) if item.startswith("{") and item.endswith("}") else None
            if slot is not None:
                argv += slot.toy if toy else slot.real
            else:
                argv.append(item.format(**paths))
        return argv


def _bench(name: str, plan: str, what: str, limit_s: int, dtype: str, rows: str, hidden: str, ops: str,
           phases: str, toy_rows: str = "64", toy_hidden: str = "256") -> Section:
    return Section(
        name, plan, what, limit_s,
        ("{py}", "scripts/bench_kernels.py", "--dtype", dtype, "--json", f"{{work}}/{name}.json", "--rows", "{rows}",
         "--hidden", "{hidden}", "--ops", *ops.split(), "--phases", *phases.split(), "--warmup", "{warmup}",
         "--repeats", "{repeats}", "{dry_run}"),
        {"rows": size(tuple(rows.split()), toy_rows), "hidden": size(tuple(hidden.split()), toy_hidden),
         "warmup": size("5", "1"), "repeats": size("20", "2"), "dry_run": SCRIPT_DRY_RUN},
        (f"{name}.json",),
    )


def _generate(name: str, plan: str, what: str, limit_s: int, model: str, *, prompt_len: int = 128,
              new_tokens: int = 256, repeats: int = 5, compiled: bool = False,
              toy_model: str = "tiny-llama") -> Section:
    return Section(
        name, plan, what, limit_s,
        ("{py}", "scripts/verify.py", "--dtype", "bf16", "--json", f"{{work}}/{name}.json",
         *(("--compile",) if compiled else ()), "--model", "{model}", "--device", "{device}", "--batch-size", "1",
         "--prompt-len", "{prompt_len}", "--max-new-tokens", "{new_tokens}", "--repeats", "{repeats}"),
        {"model": size(model, toy_model), "device": size("cuda", "cpu"), "prompt_len": size(str(prompt_len), "8"),
         "new_tokens": size(str(new_tokens), "3"), "repeats": size(str(repeats), "1")},
        (f"{name}.json",),
    )


def _train(name: str, plan: str, limit_s: int, *extra: str) -> Section:
    fsdp = "--fsdp" in extra
    return Section(
        name, plan, f"training steps, llama-3.2-1b-shape, bf16 mixed precision, 1 x 2048 tokens"
        f"{' ' if extra else ''}{' '.join(extra)}", limit_s,
        ("{py}", "-m", "accelerate.commands.launch", *(("{launcher}",) if fsdp else ()), "--num_processes",
         "{processes}", "--num_machines", "1", "--mixed_precision", "{precision}", "--dynamo_backend", "no",
         "scripts/finetune.py", "--model", "{model}", "--seq-len", "{seq_len}", "--batch-size", "1", "--max-steps",
         "{steps}", "--output-dir", f"{{work}}/{name}", "--metrics-json", f"{{work}}/{name}.json", *extra),
        {**({"launcher": TWO_CPU_PROCESSES} if fsdp else {}), "processes": size("1", "2" if fsdp else "1"),
         "precision": size("bf16", "no"), "model": size("llama-3.2-1b-shape", "tiny-llama"),
         "seq_len": size("2048", "16"), "steps": size(str(TRAIN_STEPS), "2")},
        (f"{name}.json",),
    )


# Liger runs where its wheel is installed (the procedure carries it); elsewhere the benchmark skips it.
BASELINES = "hf_rmsnorm hf_eager torch_rms_norm liger"
# The test files of the tests section: the kernels' and the launches' tests, LayerNorm, and every file with a
# gpu-marked test (tests/harness/test_gpu_suite.py checks that none is missing).
TEST_FILES = ("tests/ops/test_kernels.py", "tests/patch/test_layernorm.py", "tests/ops/test_op_validation.py",
              "tests/ops/test_fast_launch.py", "tests/ops/test_triton_ops.py", "tests/tools/test_verify.py",
              "tests/patch/test_qk_offloaded_caches.py")

# The plans, in the order a series of leases runs them; the sections, plan by plan, in order of value.
PLANS = ("first", "second", "third", "fourth")
SECTIONS: tuple[Section, ...] = (
    # first: kernel correctness on the card first (nothing else means anything if it fails), then the figures
    # the open decisions wait on.
    Section("tests", "first", "kernel, LayerNorm and argument-check tests, and every gpu-marked test, on the card",
            200, ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  *(arg for plugin in TEST_PLUGINS for arg in ("-p", plugin)), "-n", "{workers}", "--timeout",
                  str(TEST_TIMEOUT_S), *TEST_FILES, "-m", "{marker}"),
            # The dry run collects the same files and runs their gpu tests, which skip without a GPU.
            {"workers": size("8", "2"), "marker": size("gpu or not slow", "gpu")}),
    _bench("kernels-bf16", "first", "fused add + RMSNorm bandwidth, bf16, 4096 and 16384 rows, hidden 2048-65536, "
           "and host time per decode call", 130, "bf16", "4096 16384", "2048 4096 8192 16384 32768 65536",
           BASELINES, "fwd bwd"),
    _bench("kernels-bwd-ab", "first", "A/B of the backward at hidden 16384, bf16: the single tile (hf_rmsnorm) "
           "against the wide two-kernel path (hf_rmsnorm_wide) and against itself pipelined over two row blocks "
           "(hf_rmsnorm_pipelined)", 45, "bf16", "4096 16384", "16384",
           "hf_rmsnorm hf_rmsnorm_wide hf_rmsnorm_pipelined", "bwd",
           # The dry run at the real width, on 2 rows: only there does the pipelined side change a plan.
           toy_rows="2", toy_hidden="16384"),
    _bench("kernels-decode", "first", "fused add + RMSNorm, decode rows 1-64 (CUDA graph replay), host time by "
           "launch path", 75, "bf16", "1 16 64", "2048 4096 8192", BASELINES, "fwd"),
    _generate("generate-1b", "first", "generate(), llama-3.2-1b-shape, bf16, batch 1, 128-token prompt, 256 new "
              "tokens", 150, "llama-3.2-1b-shape"),
    _train("train-1b-patched", "first", 100),
    _train("train-1b-unpatched", "first", 100, "--no-patch"),
    _train("train-1b-norm-free", "first", 100, "--norm-free"),
    # second: the tuned plans, the 8B decode goal, compiled generation.
    Section("tune", "second", "tiling-plan sweep per width bucket, bf16 and fp32, forward and backward: the "
            "winners as tuned_plans.json, ready to commit", 150,
            ("{py}", "scripts/tune_kernels.py", "--time-limit", "{time_limit}", "--warmup", "{warmup}", "--repeats",
             "{repeats}", "--json", "{work}/tuned_plans.json", "{dry_run}"),
            {"time_limit": size("120", "60"), "warmup": size("3", "0"), "repeats": size("15", "1"),
             "dry_run": SCRIPT_DRY_RUN},
            ("tuned_plans.json",)),
    # Three timed rounds: the H200 run of 2026-11-28 had timed three of five when its 180 s ran out.
    _generate("generate-8b", "second", "generate(), llama-3-8b-shape, bf16, batch 1, 128-token prompt, 256 new "
              "tokens", 180, "llama-3-8b-shape", repeats=3),
    _generate("generate-1b-compiled", "second", "generate() compiled (static cache, CUDA graphs), "
              "llama-3.2-1b-shape, bf16, batch 1, 128-token prompt, 256 new tokens", 240, "llama-3.2-1b-shape",
              compiled=True),
    # third: FSDP2, LayerNorm (kernels, a LayerNorm decoder, a BERT-base-shaped encoder), prefill, the q/k norms
    # fused with the RoPE and the sandwich norms' one launch.
    _train("train-1b-fsdp-patched", "third", 100, "--fsdp"),
    _train("train-1b-fsdp-unpatched", "third", 100, "--fsdp", "--no-patch"),
    # RMSNorm against LayerNorm: the same shapes through each fused kernel and each eager op, and a LayerNorm
    # decoder's generate() with its LayerNorms fused (parity against its own eager LayerNorms).
    _bench("kernels-layernorm", "third", "fused add + RMSNorm against fused add + LayerNorm and their eager ops, "
           "bf16, 16384 rows", 90, "bf16", "16384", "2048 4096 8192",
           "hf_rmsnorm hf_layernorm torch_rms_norm torch_layer_norm", "fwd bwd"),
    _generate("generate-pythia-1b", "third", "generate(), pythia-1b-shape (GPT-NeoX, LayerNorms), bf16, batch 1, "
              "128-token prompt, 256 new tokens", 150, "pythia-1b-shape"),
    # Issue 30's GPU goal: the embedding workload of a BERT-base-shaped encoder (post-LN layers: every add feeds a
    # LayerNorm), verify.py's encoder path. Parity on 8 right-padded rows of up to 128 tokens (hidden states and
    # sentence embeddings), then forwards of 32 x 128 tokens, the three states interleaved, the JSON rewritten after
    # every round. One forward is a few ms and a round's state changes (patch, unpatch) ~0.1 s, so 20 rounds cost
    # ~2 s and steady the median.
    Section("embed-bert-base", "third", "embedding forward, bert-base-shape (post-LN), bf16, 32 x 128 tokens, "
            "unpatched, patched and norm-free interleaved", 90,
            ("{py}", "scripts/verify.py", "--dtype", "bf16", "--json", "{work}/embed-bert-base.json", "--model",
             "{model}", "--device", "{device}", "--batch-size", "{parity_rows}", "--prompt-len", "{parity_tokens}",
             "--repeats", "{repeats}"),
            {"model": size("bert-base-shape", "tiny-bert"), "device": size("cuda", "cpu"),
             "parity_rows": size("8", "2"), "parity_tokens": size("128", "8"), "repeats": size("20", "1")},
            ("embed-bert-base.json",)),
    _generate("prefill-1b", "third", "generate(), llama-3.2-1b-shape, bf16, batch 1, 2048-token prompt, 4 new "
              "tokens", 80, "llama-3.2-1b-shape", prompt_len=2048, new_tokens=4),
    # The q/k norms fused with the RoPE (qk_norm_rope) against an unpatched Qwen3 attention's norms and RoPE.
    Section("kernels-qk", "third", "q/k norms + RoPE bandwidth (qk_norm_rope against Qwen3's eager modules and "
            "F.rms_norm, each with the eager RoPE), bf16, Qwen3-8B's 32 + 8 heads of 128, 1-16384 tokens, forward "
            "and backward", 90,
            ("{py}", "scripts/bench_qk.py", "--dtype", "bf16", "--json", "{work}/kernels-qk.json", "--tokens",
             "{tokens}", "--warmup", "{warmup}", "--repeats", "{repeats}", "{dry_run}"),
            {"tokens": size(("1", "16", "4096", "16384"), "4"), "warmup": size("5", "1"), "repeats": size("20", "2"),
             "dry_run": SCRIPT_DRY_RUN},
            ("kernels-qk.json",)),
    # A sandwich layer's norm, add and next norm in one launch (norm_add_norm) against the two launches before it and
    # Gemma 3's eager modules, at Gemma 3 4B's and 27B's widths: decode (launch-bound) and 16384 rows (bandwidth).
    # Forward only: the operator's backward is the norm backward kernel twice (the first with the sum's other
    # gradient folded in, as a fused add's backward: bwd+dsum), which kernels-bf16 already times.
    _bench("kernels-sandwich", "third", "sandwich norm + add + norm bandwidth (norm_add_norm against rms_norm_add "
           "then rms_norm and Gemma 3's eager modules), Gemma mode, bf16, 1 and 16384 rows, hidden 2560 and 5376, "
           "forward", 45, "bf16", "1 16384", "2560 5376", "hf_sandwich hf_sandwich_2launch hf_eager_sandwich", "fwd"),
    # Qwen3-8B's decode with its q/k norms and RoPE in one launch a layer (the norm-free oracle: norms and that RoPE
    # return their inputs); 128 new tokens keep the plan within a lease.
    _generate("generate-qwen3-8b", "third", "generate(), qwen3-8b-shape (q/k norms fused with the RoPE), bf16, "
              "batch 1, 128-token prompt, 128 new tokens", 120, "qwen3-8b-shape", new_tokens=128,
              toy_model="tiny-qwen3"),
    # fourth: compiled generation at 8B, the profile, and the comparisons measured before.
    _generate("generate-8b-compiled", "fourth", "generate() compiled (static cache, CUDA graphs), llama-3-8b-shape, "
              "bf16, batch 1, 128-token prompt, 256 new tokens", 300, "llama-3-8b-shape", compiled=True),
    Section("profile", "fourth", "where the time goes: a 4096 x 2048 norm forward + backward, then generate() "
            "unpatched and patched on llama-3.2-1b-shape, 2048-token prompt, 16 decode steps (tables in log.txt)",
            90, ("{py}", "scripts/profile_gpu.py", "--model", "{model}", "--prompt-len", "{prompt_len}",
                 "--decode-tokens", "{decode_tokens}"),
            {"model": size("llama-3.2-1b-shape", "tiny-llama"), "prompt_len": size("2048", "8"),
             "decode_tokens": size("16", "2")}),
    _bench("kernels-fp16", "fourth", "fused add + RMSNorm bandwidth, fp16, 16384 rows", 60,
           "fp16", "16384", "2048 4096 8192 16384", BASELINES, "fwd bwd"),
    _bench("kernels-compile", "fourth", "fused add + RMSNorm against torch.compile of HF's norm, bf16, 16384 rows",
           90, "bf16", "16384", "4096 8192", "hf_rmsnorm torch_compile", "fwd bwd"),
    # Builds and installs a wheel of the checkout offline, into a folder of its own (the image stays as it is).
    Section("install", "fourth", "offline install: pip install --no-deps --no-build-isolation --no-index of this "
            "checkout", 60, ("{py}", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", "{work}/install-check", ".")),
)


def plan_sections(plans: list[str]) -> list[Section]:
    """The sections of ``plans``, in the order the plans and their sections run."""
    return [s for plan in PLANS if plan in plans for s in SECTIONS if s.plan == plan]


def _run_with_limit(argv: list[str], limit_s: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Runs ``argv`` in the checkout; kills its whole process group (accelerate starts children) at the limit.
    Returns (exit status or None when killed, stdout and stderr together)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output


def run_command(name: str, what: str, argv: list[str], limit_s: float, env: dict[str, str], work: Path,
                outputs: tuple[str, ...] = ()) -> Outcome:
    """Runs one command of the suite under ``limit_s`` and reads the JSON files it wrote into ``work``."""
    start = time.monotonic()
    returncode, output = _run_with_limit(argv, limit_s, env)
    seconds = time.monotonic() - start
    if returncode is None:
        status = f"timed out after {limit_s:.0f} s"
    else:
        status = "ok" if returncode == 0 else f"failed (exit {returncode})"
    data = {}
    for file_name in outputs:
        path = work / file_name
        if path.is_file():  # also after a failure or a timeout: the scripts write their figures as they go
            try:
                data[file_name.removesuffix(".json")] = json.loads(path.read_text())
            except json.JSONDecodeError as exc:  # stopped while writing: what it wrote before is gone
                output += f"\n[gpu_suite] {file_name} is not valid JSON ({exc}): left out\n"
    return Outcome(name, what, status, seconds, " ".join(argv), data, output, limit_s)


def run_section(section: Section, limit_s: float, work: Path, toy: bool, env: dict[str, str]) -> Outcome:
    """Runs one section, at toy sizes when ``toy``, and reads the JSON files it wrote."""
    argv = section.argv(toy, py=sys.executable, work=work, repo=REPO)
    return run_command(section.name, section.what, argv, limit_s, env, work, section.outputs)


def install_wheels(wheel_dir: Path, site: Path, limit_s: float, env: dict[str, str]) -> Outcome:
    """Installs the wheels of ``wheel_dir`` offline into ``site`` (``gpu_wheels.install_argv``)."""
    names = ", ".join(" ".join(gpu_wheels.wheel_key(p)) for p in sorted(wheel_dir.glob("*.whl")))
    argv = gpu_wheels.install_argv(wheel_dir, site)
    return run_command(gpu_ledger.WHEELS, f"offline install of the carried wheels: {names}", argv, limit_s, env,
                       site)


def section_env(site: Path | None = None) -> dict[str, str]:
    """The sections' environment: the checkout importable without installing (then the wheels installed into
    ``site``, if any), no progress bars, no network, pytest's plugins only as named (``TEST_PLUGINS``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), site and str(site), env.get("PYTHONPATH"))))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", PYTHONUNBUFFERED="1",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


def run_suite(out: Path, sections: list[Section], run: SuiteRun, wheels: Path | None = None) -> list[Outcome]:
    """Installs the carried wheels (``wheels``, if given), then runs ``sections`` in order within the run's time
    limit, and writes the suite's files into ``out`` after each, so a run cut short keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + run.time_limit_s
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
        work = Path(scratch)
        site = None
        if wheels is not None:
            site = work / "site"
            outcomes.append(install_wheels(wheels, site, WHEELS_LIMIT_S, section_env()))
            print(f"[gpu_suite] {outcomes[-1].what}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s",
                  flush=True)
        env = section_env(site)
        for section in sections:
            left = deadline - time.monotonic()
            if left < MIN_SECTION_S:
                outcomes.append(Outcome(section.name, section.what, f"not run: the suite's {run.time_limit_s:.0f} s "
                                        "were used up"))
            else:
                limit = min(section.limit_s, left)
                print(f"[gpu_suite] {section.name}: {section.what} (limit {limit:.0f} s)", flush=True)
                outcomes.append(run_section(section, limit, work, run.toy, env))
                print(f"[gpu_suite] {section.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s",
                      flush=True)
            write_files(out, outcomes, run)
    return outcomes


def suite_run(sections: list[Section], plans: list[str], toy: bool, time_limit_s: float | None) -> SuiteRun:
    """What a run of ``sections`` (those of ``plans``, or picked by name when ``plans`` is empty) is: its time
    limit (one ``PLAN_BUDGET_S`` per plan unless given), its estimate on the costs' card, and the ledger."""
    costs = gpu_ledger.read_costs()
    limit = time_limit_s if time_limit_s is not None else PLAN_BUDGET_S * max(1, len(plans))
    return SuiteRun(tuple(plans), tuple(s.name for s in sections), toy, limit,
                    gpu_ledger.plan_seconds(costs, (s.name for s in sections)), costs,
                    tuple(gpu_ledger.read_pending()),
                    datetime.datetime.now(datetime.timezone.utc).date().isoformat())
