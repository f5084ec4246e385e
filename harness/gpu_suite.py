"""Every GPU measurement of the project in one run: what ``scripts/gpu_suite.py`` does.

A GPU is lent for minutes at a time, so the suite is one command that needs nothing but the checkout: each
section runs one of the project's own scripts in a subprocess (``PYTHONPATH`` points at the checkout, so nothing
needs installing; the offline install is checked as a section of its own) under a hard time limit, and a
section that fails or runs out of time leaves the others alone. Sections run in order of value, so a run cut
short by the overall limit still brings back the figures that matter most. Everything lands in ``--out``:

* ``summary.md``: the figures as Markdown tables, ready for ``BENCHMARKS.md``;
* ``results.json``: every section's status, time, command and the JSON its script wrote;
* ``log.txt``: every section's full output;
* ``kernels.png``: achieved bandwidth against hidden size (when matplotlib is installed and kernels were timed);
* ``tuned_plans.json``: the ``tune`` section's table, to copy over ``hf_rmsnorm/ops/tuned_plans.json`` and commit.

``--dry-run`` runs every section at toy sizes, on the CPU when there is no GPU (the kernel benchmark then runs
its harness with the kernels in Triton's interpreter and plain calls for CUDA graphs), so the plumbing is tested
anywhere in a few minutes; it writes the same files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .gpu_suite_report import Outcome, write_files

REPO = Path(__file__).resolve().parents[1]
# The overall limit: sections start only while this much time is left, so the suite ends inside the lease.
DEFAULT_TIME_LIMIT_S = 480
# A section is not started with less time than this left: it could not even load a model.
MIN_SECTION_S = 20
# Training steps timed per run (the first, which compiles and warms the allocator, is left out of the figures).
TRAIN_STEPS = 12


@dataclass(frozen=True)
class Section:
    """One measurement: a command of the project's scripts, its time limit and the JSON files it writes.

    ``argv`` and ``toy_argv`` (the ``--dry-run`` version) may use ``{py}`` (this interpreter), ``{work}`` (a
    scratch folder) and ``{repo}`` (the checkout)."""

    name: str
    what: str
    limit_s: int
    argv: tuple[str, ...]
    toy_argv: tuple[str, ...]
    outputs: tuple[str, ...] = ()


def _bench(name: str, what: str, limit_s: int, dtype: str, rows: str, hidden: str, ops: str, phases: str) -> Section:
    common = ("{py}", "scripts/bench_kernels.py", "--dtype", dtype, "--json", f"{{work}}/{name}.json")
    return Section(
        name, what, limit_s,
        (*common, "--rows", *rows.split(), "--hidden", *hidden.split(), "--ops", *ops.split(),
         "--phases", *phases.split(), "--repeats", "20"),
        (*common, "--rows", "64", "--hidden", "256", "--ops", *ops.split(), "--phases", *phases.split(),
         "--repeats", "2", "--warmup", "1", "--dry-run"),
        (f"{name}.json",),
    )


def _generate(name: str, what: str, limit_s: int, model: str, *extra: str, compiled: bool = False) -> Section:
    common = ("{py}", "scripts/verify.py", "--dtype", "bf16", "--json", f"{{work}}/{name}.json",
              *(("--compile",) if compiled else ()))
    return Section(
        name, what, limit_s,
        (*common, "--model", model, "--device", "cuda", *extra),
        (*common, "--model", "tiny-llama", "--batch-size", "1", "--prompt-len", "8", "--max-new-tokens", "3",
         "--repeats", "1"),
        (f"{name}.json",),
    )


def _train(name: str, limit_s: int, *extra: str) -> Section:
    fsdp = "--fsdp" in extra

    def launch(precision: str, model: str, sizes: tuple[str, ...], processes: int) -> tuple[str, ...]:
        # Several CPU processes run as DDP (or FSDP2) over gloo only when launched as --multi_gpu.
        multi = ("--multi_gpu",) if processes > 1 else ()
        return ("{py}", "-m", "accelerate.commands.launch", *multi, "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", precision, "--dynamo_backend", "no",
                "scripts/finetune.py", "--model", model, *sizes, "--output-dir", f"{{work}}/{name}",
                "--metrics-json", f"{{work}}/{name}.json", *extra)

    return Section(
        name, f"training steps, llama-3.2-1b-shape, bf16 mixed precision, 1 x 2048 tokens{' ' if extra else ''}"
        f"{' '.join(extra)}", limit_s,
        launch("bf16", "llama-3.2-1b-shape", ("--seq-len", "2048", "--batch-size", "1", "--max-steps",
                                              str(TRAIN_STEPS)), 1),
        # FSDP2 on CPU needs two processes (one has nothing to shard); on a GPU one process is a group of one.
        launch("no", "tiny-llama", ("--seq-len", "16", "--batch-size", "1", "--max-steps", "2"), 2 if fsdp else 1),
        (f"{name}.json",),
    )


# Liger runs where its wheel is installed (the GPU procedure carries it); elsewhere the benchmark skips it.
BASELINES = "hf_rmsnorm hf_eager torch_rms_norm liger"

# In order of value: kernel correctness on the card first (nothing else means anything if it fails), then the
# headline figures, then the rest.
SECTIONS: tuple[Section, ...] = (
    Section("install", "offline install: pip install --no-deps --no-build-isolation --no-index -e .", 60,
            ("{py}", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."),
            ("{py}", "-m", "pip", "--version")),
    Section("tests", "kernel, LayerNorm and argument-check tests, and every gpu-marked test, on the card", 150,
            ("{py}", "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", "tests/ops/test_kernels.py",
             "tests/patch/test_layernorm.py", "tests/ops/test_op_validation.py", "tests/ops/test_fast_launch.py",
             "tests/ops/test_triton_ops.py", "tests/tools/test_verify.py", "-m", "gpu or not slow"),
            ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/ops/test_kernels.py")),
    _bench("kernels-bf16", "fused add + RMSNorm bandwidth, bf16, >= 4096 rows, and host time per decode call", 130,
           "bf16", "4096 16384", "2048 4096 8192 16384 65536", BASELINES, "fwd bwd"),
    _bench("kernels-decode", "fused add + RMSNorm, decode rows 1-64 (CUDA graph replay), host time by launch path", 75,
           "bf16", "1 16 64", "2048 4096 8192", BASELINES, "fwd"),
    Section("tune", "tiling-plan sweep per width bucket, bf16 and fp32, forward and backward: the winners as "
            "tuned_plans.json, ready to commit", 150,
            ("{py}", "scripts/tune_kernels.py", "--time-limit", "120", "--json", "{work}/tuned_plans.json"),
            ("{py}", "scripts/tune_kernels.py", "--dry-run", "--warmup", "0", "--repeats", "1", "--json",
             "{work}/tuned_plans.json"),
            ("tuned_plans.json",)),
    _generate("generate-1b", "generate(), llama-3.2-1b-shape, bf16, batch 1, 128-token prompt, 256 new tokens", 120,
              "llama-3.2-1b-shape"),
    Section("profile", "where the time goes: a 4096 x 2048 norm forward + backward, then generate() unpatched and "
            "patched on llama-3.2-1b-shape, 2048-token prompt, 16 decode steps (tables in log.txt)", 90,
            ("{py}", "scripts/profile_gpu.py", "--model", "llama-3.2-1b-shape", "--prompt-len", "2048",
             "--decode-tokens", "16"),
            ("{py}", "scripts/profile_gpu.py", "--model", "tiny-llama", "--prompt-len", "8", "--decode-tokens",
             "2")),
    _train("train-1b-patched", 100),
    _train("train-1b-unpatched", 100, "--no-patch"),
    _train("train-1b-norm-free", 100, "--norm-free"),
    _generate("generate-1b-compiled", "generate() compiled (static cache, CUDA graphs), llama-3.2-1b-shape, bf16, "
              "batch 1, 128-token prompt, 256 new tokens", 240, "llama-3.2-1b-shape", compiled=True),
    _generate("generate-8b", "generate(), llama-3-8b-shape, bf16, batch 1, 128-token prompt, 256 new tokens", 150,
              "llama-3-8b-shape"),
    _bench("kernels-fp16", "fused add + RMSNorm bandwidth, fp16, 16384 rows", 60,
           "fp16", "16384", "2048 4096 8192 16384", BASELINES, "fwd bwd"),
    _generate("prefill-1b", "generate(), llama-3.2-1b-shape, bf16, batch 1, 2048-token prompt, 4 new tokens", 80,
              "llama-3.2-1b-shape", "--prompt-len", "2048", "--max-new-tokens", "4"),
    _bench("kernels-compile", "fused add + RMSNorm against torch.compile of HF's norm, bf16, 16384 rows", 90,
           "bf16", "16384", "4096 8192", "hf_rmsnorm torch_compile", "fwd bwd"),
    _train("train-1b-fsdp-patched", 100, "--fsdp"),
    _train("train-1b-fsdp-unpatched", 100, "--fsdp", "--no-patch"),
    _generate("generate-8b-compiled", "generate() compiled (static cache, CUDA graphs), llama-3-8b-shape, bf16, "
              "batch 1, 128-token prompt, 256 new tokens", 300, "llama-3-8b-shape", compiled=True),
    # RMSNorm against LayerNorm: the same shapes through each fused kernel and each eager op, and a LayerNorm
    # decoder's generate() with its LayerNorms fused (parity against its own eager LayerNorms).
    _bench("kernels-layernorm", "fused add + RMSNorm against fused add + LayerNorm and their eager ops, bf16, 16384 "
           "rows", 90, "bf16", "16384", "2048 4096 8192", "hf_rmsnorm hf_layernorm torch_rms_norm torch_layer_norm",
           "fwd bwd"),
    _generate("generate-pythia-1b", "generate(), pythia-1b-shape (GPT-NeoX, LayerNorms), bf16, batch 1, 128-token "
              "prompt, 256 new tokens", 150, "pythia-1b-shape"),
)


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


def run_section(section: Section, limit_s: float, work: Path, toy: bool, env: dict[str, str]) -> Outcome:
    """Runs one section and reads the JSON files it wrote."""
    template = section.toy_argv if toy else section.argv
    argv = [part.format(py=sys.executable, work=work, repo=REPO) for part in template]
    start = time.monotonic()
    returncode, output = _run_with_limit(argv, limit_s, env)
    seconds = time.monotonic() - start
    if returncode is None:
        status = f"timed out after {limit_s:.0f} s"
    else:
        status = "ok" if returncode == 0 else f"failed (exit {returncode})"
    data = {}
    for name in section.outputs:
        path = work / name
        if path.is_file():  # also after a failure or a timeout: the benchmark rewrites its JSON per shape
            data[name.removesuffix(".json")] = json.loads(path.read_text())
    return Outcome(section.name, section.what, status, seconds, " ".join(argv), data, output)


def section_env() -> dict[str, str]:
    """The sections' environment: the checkout importable without installing, no progress bars, no network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


def run_suite(out: Path, time_limit_s: float, toy: bool, only: list[str] | None = None) -> list[Outcome]:
    """Runs the sections (all, or those named in ``only``) in order within ``time_limit_s`` and writes the
    suite's files into ``out`` after every section, so a run cut short keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + time_limit_s
    env = section_env()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
        work = Path(scratch)
        for section in SECTIONS:
            if only and section.name not in only:
                continue
            left = deadline - time.monotonic()
            if left < MIN_SECTION_S:
                outcomes.append(Outcome(section.name, section.what, f"not run: the suite's {time_limit_s:.0f} s "
                                        "were used up"))
            else:
                print(f"[gpu_suite] {section.name}: {section.what} (limit {min(section.limit_s, left):.0f} s)",
                      flush=True)
                outcomes.append(run_section(section, min(section.limit_s, left), work, toy, env))
                print(f"[gpu_suite] {section.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s",
                      flush=True)
            write_files(out, outcomes, toy)
    return outcomes
