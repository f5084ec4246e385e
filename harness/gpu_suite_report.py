"""The files ``gpu_suite`` writes: a Markdown summary of the figures, the full results as JSON, the log, a plot,
and the ledger's two data files brought up to date (``gpu_ledger``).

Every figure in the summary is read from the JSON that the section's own script wrote (``bench_kernels.py``,
``verify.py``, ``finetune.py``), never recomputed here, so the summary says what the scripts measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics
from hf_rmsnorm.tools.norm_free import ORACLE_NOTE, format_share, gain_share
from hf_rmsnorm.tools.verify_report import EncoderVerifyReport, PatchSummary, VerifyReport

from . import gpu_ledger


@dataclass
class Outcome:
    """How one section of the suite went (``gpu_suite.run_section``); what this module reports."""

    name: str
    what: str
    status: str  # "ok", "failed (exit N)", "timed out after N s", "not run: ..."
    seconds: float = 0.0
    command: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    output: str = ""
    limit_s: float = 0.0  # the time it was given (0: not run)


@dataclass(frozen=True)
class SuiteRun:
    """What a suite run was asked to do (``gpu_suite.suite_run``), and the ledger it reports against."""

    plans: tuple[str, ...]  # empty when the sections were picked by name (--only)
    sections: tuple[str, ...]
    toy: bool
    time_limit_s: float
    estimate_s: float  # the sections' time on ``costs["card"]``, the wheels' install included
    costs: Mapping[str, Any]  # gpu_section_costs.json as committed
    pending: tuple[gpu_ledger.PendingChange, ...]  # gpu_pending.json as committed
    date: str  # UTC, YYYY-MM-DD


# hf_rmsnorm_wide and hf_rmsnorm_pipelined are the A/B's other sides: the speedup over them is the single-tile
# backward's, and the unpipelined widest tile's. hf_sandwich_2launch is the sandwich's other side: the speedup over
# it is the one launch's.
KERNEL_BASELINES = ("hf_rmsnorm_wide", "hf_rmsnorm_pipelined", "hf_eager", "torch_rms_norm", "torch_compile",
                    "liger", "torch_layer_norm", "hf_eager_qk", "torch_rms_norm_qk", "hf_sandwich_2launch",
                    "hf_eager_sandwich")
# This package's implementations, each reported in rows of its own.
OURS = ("hf_rmsnorm", "hf_layernorm", "hf_qk_rope", "hf_sandwich")
# The lines of the kernel benchmark's output that report host and GPU time per decode-sized call.
LAUNCH_LINE_PREFIXES = ("launch cost", "  rows", "host us per decode call")
# Training sections come in pairs, "<pair>-patched" and "<pair>-unpatched", compared with each other, and
# optionally "<pair>-norm-free" (the oracle: the most any norm kernel could save).
TRAIN_PAIRS = ("train-1b", "train-1b-fsdp")
TRAIN_RUNS = ("patched", "unpatched", "norm-free")  # train_lines' arguments, in order
# The columns of a verify.py section's speed table.
SPEED_HEADER = ("", "unpatched", "patched", "speedup", "norm-free", "norm-free speedup",
                "share of the norm-free gain")
# Sections that run verify.py, whose JSON is its report (an encoder's says so in its "kind").
VERIFY_SECTIONS = ("generate", "prefill", "embed")
# Sections whose JSON is a file of the checkout, copied into the output folder as written, ready to commit:
# "tune" writes tuned_plans.json (hf_rmsnorm/ops/tuned_plans.json).
COMMITTED_SECTIONS = ("tune",)


@dataclass(frozen=True)
class SpeedGoal:
    """An open issue's speed goal for one section's workload: the patched model's speedup over the unpatched one,
    and the share of the norm-free model's gain it delivers (``norm_free.gain_share``)."""

    issue: int
    min_speedup: float
    min_gain_share: float

    def line(self, speedup: float, share: float | None) -> str:
        """What the figures say against the goal, in one line."""
        def verdict(met: bool) -> str:
            return "met" if met else "not met"

        return (f"Goal (issue {self.issue}): at least {self.min_speedup:.2f}x unpatched and "
                f"{format_share(self.min_gain_share)} of the norm-free gain: {speedup:.3f}x "
                f"({verdict(speedup >= self.min_speedup)}), {format_share(share)} "
                f"({verdict(share is not None and share >= self.min_gain_share)}).")


# The sections whose figures the summary holds against an issue's goal.
GOALS = {"embed-bert-base": SpeedGoal(issue=30, min_speedup=1.15, min_gain_share=0.75)}


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def kernel_lines(name: str, bench: dict) -> list[str]:
    """hf_rmsnorm's kernel time (CUDA graph replay), bandwidth and fraction of copy bandwidth per shape, the same
    for its eager call (host included), and its kernels' speedup over each baseline's."""
    results = [r for r in bench["results"] if r["status"] == "ok"]
    failed = [r for r in bench["results"] if r["status"] != "ok"]
    by_key = {(r["impl"], r["phase"], r["rows"], r["hidden"]): r for r in results}
    baselines = [b for b in KERNEL_BASELINES if any(r["impl"] == b for r in bench["results"])]
    ours = [o for o in OURS if any(r["impl"] == o for r in results)]
    rows = []
    for (impl, phase, n_rows, hidden), r in by_key.items():
        if impl not in ours:
            continue
        speedups = []
        for b in baselines:
            base = by_key.get((b, phase, n_rows, hidden))
            speedups.append(f"{base['seconds'] / r['seconds']:.2f}x" if base else "-")
        named = (impl,) if len(ours) > 1 else ()
        rows.append((*named, phase, n_rows, hidden, f"{r['seconds'] * 1e6:.1f}", f"{r['gbps']:.0f}",
                     f"{100 * r['copy_fraction']:.1f}%", f"{r['call_seconds'] * 1e6:.1f}", f"{r['call_gbps']:.0f}",
                     f"{100 * r['call_copy_fraction']:.1f}%", *speedups))
    graphs = ("kernels under CUDA graph replay" if all(r["cuda_graph"] for r in results)
              else "kernels timed without CUDA graphs")
    lines = [f"### {name} ({bench['device']}, {r0['dtype'] if (r0 := next(iter(results), None)) else ''}; "
             f"copy bandwidth {bench['copy_gbps']:.0f} GB/s; {graphs})", ""]
    lines += _table((("impl",) if len(ours) > 1 else ()) + ("phase", "rows", "hidden", "kernel us", "GB/s", "% of copy", "call us", "call GB/s",
                     "call % of copy", *(f"vs {b}" for b in baselines)), rows)
    if failed:
        lines += [f"Not measured: {len(failed)} runs, e.g. {failed[0]['impl']} {failed[0]['phase']} "
                  f"{failed[0]['rows']}x{failed[0]['hidden']}: {failed[0]['status']}", ""]
    return lines


def patch_counts(patch: PatchSummary) -> str:
    """What the patch replaced, counted: norms, fused adds and, for a model with q/k norms, the attention modules
    whose q/k norms run fused with the RoPE and those left apart."""
    counts = f"{patch.norms} norms, {patch.fused_adds} fused adds"
    if patch.fused_qk or patch.qk_apart:
        counts += (f", q/k norms fused with the RoPE in {patch.fused_qk} attention modules ({patch.qk_apart} left "
                   "apart)")
    return counts


def _verify_head(title: str, report: VerifyReport | EncoderVerifyReport, repeats: int | None) -> list[str]:
    """The lines of a verify.py section before its speed table: the heading (``title``), parity's verdict with the
    patch's counts, and how far the timing of ``repeats`` rounds went (all of a section without speed figures)."""
    speed = report.speed
    lines = [title, "", f"Parity: {'PASS' if report.passed else 'FAIL'}; {patch_counts(report.patch)}.", ""]
    if not speed:
        stopped = "the run ended before its first timed round" if report.environment.device == "cuda" else "no GPU"
        return lines + [f"No speed figures ({stopped}).", ""]
    if speed.partial:
        lines += [f"Partial: the run was stopped after {speed.rounds} of {repeats} timed rounds.", ""]
    return lines[:-1] + [f"States timed interleaved; {speed.norm_free_note}.", ""]


def generate_lines(name: str, report: VerifyReport) -> list[str]:
    """Prefill and decode throughput, unpatched and patched, with parity's verdict."""
    speed, settings = report.speed, report.settings
    rounds = speed.rounds if speed else settings.repeats
    lines = _verify_head(f"### {name}: {report.model} ({report.parameters / 1e9:.2f}B parameters, {report.dtype}, "
                         f"batch {settings.batch_size}, prompt {settings.prompt_len}, {settings.max_new_tokens} new "
                         f"tokens, median of {rounds}; {report.environment.device_name})", report, settings.repeats)
    if not speed:
        return lines
    unpatched, patched, free, oracle = speed.unpatched, speed.patched, speed.norm_free, speed.norm_free_speedups
    rows = [
        ("prefill tokens/s", f"{unpatched.prefill_tokens_per_s:.1f}", f"{patched.prefill_tokens_per_s:.1f}",
         f"{speed.prefill_speedup:.3f}x", f"{free.prefill_tokens_per_s:.1f}", f"{oracle.prefill_speedup:.3f}x",
         format_share(speed.prefill_gain_share)),
        ("decode tokens/s", f"{unpatched.decode_tokens_per_s:.1f}", f"{patched.decode_tokens_per_s:.1f}",
         f"{speed.decode_speedup:.3f}x", f"{free.decode_tokens_per_s:.1f}", f"{oracle.decode_speedup:.3f}x",
         format_share(speed.decode_gain_share)),
        ("peak memory GiB beyond weights", f"{unpatched.peak_memory_bytes / 2**30:.2f}",
         f"{patched.peak_memory_bytes / 2**30:.2f}", "", f"{free.peak_memory_bytes / 2**30:.2f}", "", ""),
    ]
    return lines + _table(SPEED_HEADER, rows)


def encoder_lines(name: str, report: EncoderVerifyReport) -> list[str]:
    """The embedding workload's tokens/s, unpatched, patched and norm-free, with parity's verdict (hidden states
    and sentence embeddings) and, for a section of ``GOALS``, what the figures say against its goal."""
    speed, settings = report.speed, report.settings
    rounds = speed.rounds if speed else settings.repeats
    lines = _verify_head(f"### {name}: {report.model} ({report.parameters / 1e6:.1f}M parameters, {report.dtype}, "
                         f"embedding forward of {settings.speed_batch_size} x {settings.speed_tokens} tokens, median "
                         f"of {rounds}; {report.environment.device_name})", report, settings.repeats)
    if not speed:
        return lines
    lines += _table(SPEED_HEADER, [
        ("tokens/s", f"{speed.unpatched_tokens_per_s:.0f}", f"{speed.patched_tokens_per_s:.0f}",
         f"{speed.speedup:.3f}x", f"{speed.norm_free_tokens_per_s:.0f}", f"{speed.norm_free_speedup:.3f}x",
         format_share(speed.gain_share))])
    goal = GOALS.get(name)
    return lines + ([goal.line(speed.speedup, speed.gain_share), ""] if goal else [])


def train_lines(name: str, patched: FinetuneMetrics | None, unpatched: FinetuneMetrics | None,
                free: FinetuneMetrics | None = None) -> list[str]:
    """Median step time (first step left out), tokens/s and peak memory, patched against ``--no-patch``, and the
    share of the norm-free run's gain that the patch delivers."""
    runs = [(label, m) for label, m in (("patched", patched), ("unpatched", unpatched), ("norm-free", free)) if m]
    if not runs:
        return []
    first = runs[0][1]
    sharding = ", FSDP2" if first.fsdp else ""
    lines = [f"### {name}: {first.model}, {first.batch_size} x {first.seq_len} tokens, "
             f"{first.mixed_precision} mixed precision{sharding}, {first.max_steps} steps", ""]
    rows = [(label, f"{m.median_step_s * 1e3:.1f}", f"{m.tokens_per_s:.0f}",
             f"{(m.peak_memory_bytes or 0) / 2**30:.2f}", f"{m.losses[0]:.4f} -> {m.losses[-1]:.4f}")
            for label, m in runs]
    lines += _table(("", "median step ms", "tokens/s", "peak memory GiB", "loss first -> last"), rows)
    if patched and unpatched:
        lines += [f"Patched step speedup: {unpatched.median_step_s / patched.median_step_s:.3f}x; peak memory "
                  f"{(patched.peak_memory_bytes or 0) / max(unpatched.peak_memory_bytes or 1, 1):.3f}x "
                  "of unpatched.", ""]
    if patched and unpatched and free:
        share = gain_share(1 / unpatched.median_step_s, 1 / patched.median_step_s, 1 / free.median_step_s)
        lines += [f"Norm-free step speedup: {unpatched.median_step_s / free.median_step_s:.3f}x; the patch "
                  f"delivers {format_share(share)} of that gain ({ORACLE_NOTE}).", ""]
    return lines


def _train_metrics(data: dict[str, dict], name: str) -> FinetuneMetrics | None:
    """The metrics section ``name`` wrote (``finetune.py --metrics-json``); None if it wrote none."""
    metrics = data.get(name, {}).get(name)
    return FinetuneMetrics.from_dict(metrics) if metrics else None


def completed(outcomes: list[Outcome], run: SuiteRun) -> set[str]:
    """The sections (and wheels' install) this run completed on a GPU: none in a dry run, which measures nothing."""
    return set() if run.toy else {o.name for o in outcomes if o.status == "ok"}


def plan_line(run: SuiteRun) -> str:
    """Which plan ran, what it was estimated to take and the time it was given."""
    what = (f"Plan {', '.join(run.plans)}" if run.plans else "Sections picked by name (--only)")
    return (f"{what}: {len(run.sections)} sections, estimated {run.estimate_s:.0f} s on an {run.costs['card']} "
            f"(harness/gpu_section_costs.json); time limit {run.time_limit_s:.0f} s.")


def pending_lines(outcomes: list[Outcome], run: SuiteRun) -> list[str]:
    """The changes awaiting a GPU measurement that this run did not measure, each with how its sections went,
    and those it measured."""
    how = {o.name: f"{o.status}{', dry run' if run.toy else ''}" for o in outcomes}
    pending = gpu_ledger.still_pending(run.pending, completed(outcomes, run))
    lines = ["## Still awaiting a GPU measurement", ""]
    lines += [f"- {c.change}: " + ", ".join(f"{s} {how.get(s, 'not in this run')}" for s in c.sections)
              for c in pending]
    lines += ["" if pending else "Nothing: every change of harness/gpu_pending.json was measured.", ""]
    measured = [c for c in run.pending if c not in pending]
    if measured:
        lines += ["Measured by this run (gone from the gpu_pending.json written beside this summary):", ""]
        lines += [f"- {c.change}" for c in measured] + [""]
    return lines


def summary(outcomes: list[Outcome], run: SuiteRun) -> str:
    """The Markdown summary of a suite run."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU suite, {when}{' (dry run: toy sizes, figures mean nothing)' if run.toy else ''}", "",
             plan_line(run), ""]
    lines += _table(("section", "status", "seconds", "what"),
                    [(o.name, o.status, f"{o.seconds:.0f}", o.what) for o in outcomes])
    lines += pending_lines(outcomes, run)
    data = {o.name: o.data for o in outcomes}
    outputs = {o.name: o.output for o in outcomes}
    tests = outputs.get("tests", "").strip().splitlines()
    if tests:
        lines += [f"Tests on the card: {tests[-1]}", ""]
    for name, output in outputs.items():
        if name.startswith("kernels") and (bench := data[name].get(name)):
            lines += kernel_lines(name, bench)
            launch = [line for line in output.splitlines() if line.startswith(LAUNCH_LINE_PREFIXES)]
            if launch:
                lines += ["Host and GPU time per decode-sized call:", "", "```", *launch, "```", ""]
        if name.startswith(VERIFY_SECTIONS) and (report := data[name].get(name)):
            lines += (encoder_lines(name, EncoderVerifyReport.from_dict(report)) if report.get("kind") == "encoder"
                      else generate_lines(name, VerifyReport.from_dict(report)))
    for pair in TRAIN_PAIRS:
        lines += train_lines(pair, *(_train_metrics(data, f"{pair}-{run}") for run in TRAIN_RUNS))
    return "\n".join(lines)


def write_plot(out: Path, outcomes: list[Outcome]) -> None:
    """``kernels.png``: every kernel section's results in one plot (the benchmark's own plotting)."""
    from .kernel_bench import Result, write_plot as plot_results

    results, copy = {}, None
    for o in outcomes:
        bench = o.data.get(o.name) if o.name.startswith("kernels") else None
        if bench and bench.get("results"):
            for r in bench["results"]:  # a shape two sections measured is plotted once
                if r["dtype"] == "bf16":
                    results.setdefault((r["impl"], r["phase"], r["rows"], r["hidden"]), Result(**r))
            copy = bench["copy_gbps"]
    if results and copy:
        plot_results(list(results.values()), out / "kernels.png", copy)


def card_of(outcomes: list[Outcome]) -> str:
    """The GPU the sections ran on, as the first of their scripts to name it did ("unknown" if none did)."""
    for o in outcomes:
        for data in o.data.values():
            name = data.get("device") or data.get("environment", {}).get("device_name")
            if name:
                return name
    return "unknown"


def ledger_files(outcomes: list[Outcome], run: SuiteRun) -> dict[str, dict]:
    """gpu_pending.json less what this run measured, and gpu_section_costs.json with the times it measured (both
    as committed after a dry run)."""
    pending = gpu_ledger.still_pending(run.pending, completed(outcomes, run))
    times = {} if run.toy else {o.name: (o.status, o.seconds, o.limit_s) for o in outcomes}
    return {gpu_ledger.PENDING_PATH.name: gpu_ledger.pending_document(pending),
            gpu_ledger.COSTS_PATH.name: gpu_ledger.measured_costs(run.costs, times, card_of(outcomes), run.date)}


def write_files(out: Path, outcomes: list[Outcome], run: SuiteRun) -> None:
    """summary.md, results.json, log.txt, kernels.png, the JSON files of ``COMMITTED_SECTIONS`` and the ledger's
    files (``ledger_files``) in ``out``."""
    (out / "summary.md").write_text(summary(outcomes, run) + "\n")
    (out / "results.json").write_text(json.dumps(
        {"dry_run": run.toy, "plans": list(run.plans),
         "sections": [{k: v for k, v in dataclasses.asdict(o).items() if k != "output"} for o in outcomes]},
        indent=1) + "\n")
    (out / "log.txt").write_text("".join(
        f"===== {o.name}: {o.status} in {o.seconds:.0f} s\n$ {o.command}\n{o.output}\n" for o in outcomes))
    write_plot(out, outcomes)
    for o in outcomes:
        if o.name in COMMITTED_SECTIONS:
            for name, data in o.data.items():
                (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    for name, document in ledger_files(outcomes, run).items():
        (out / name).write_text(json.dumps(document, indent=1) + "\n")
