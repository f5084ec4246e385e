"""Sweeps the kernels' tiling constants on a GPU and writes the winners as the tuned-plan table
(``hf_rmsnorm/ops/tuned_plans.json``, format in ``hf_rmsnorm.ops.tuning``) for this GPU's architecture.

What is swept: for each kernel (``backward``, ``forward``), activation dtype (bf16, fp32) and width bucket, the
constants of ``launch.py``'s plan that the table may override (``tuning.TUNABLE``), one at a time around the
best so far, starting from the default plan (coordinate descent: a full cross product would compile a hundred
variants per bucket), then each constant changed alone from the default plan: block rows halved and doubled, warps
halved and doubled, pipeline stages 1 to ``BWD_MAX_STAGES`` (the single-tile backward, whose widest tiles read their
row again whatever the stages: the looped kernel has no pipelined loop) and programs per SM 1 to
``BWD_MAX_PROGRAMS_PER_SM`` (no recompile: only the grid changes). The buckets are every power of two the plan
distinguishes from ``MIN_SWEPT_WIDTH`` up to the first looped one (``plan_widths``), widest first: wider rows move
the most bytes per row, and the looped kernels are where the defaults are furthest from copy bandwidth.

How a candidate is run and judged: it is put in use as a one-entry table (``tuning.plans_in_use``), so it runs
through the library's own launch path, on ``TUNE_ELEMENTS`` elements (a training batch: bandwidth decides, not
launch latency), the fused add + RMSNorm of ``kernel_bench`` (its forward without autograd, or its backward
alone). Before it is timed its outputs are checked against the fp64 truth (``exact_outputs``): the residual sum
must be the default plan's bit for bit (torch's rounding of ``residual + x``, which no plan changes), and the
output (forward) or the gradients of the input, the residual and the weight (backward) no less accurate than
the default plan's, by the rule the kernel tests apply against the model's own module
(``reference.error_beyond_bound``). Bitwise equality with the default plan would reject nearly every candidate:
block rows and warps reshape the row reductions' trees, programs per SM the weight gradient's sum. A candidate
whose binaries spill more than the offline inspection allows the default plans (``spill_problem``: 64 bytes a
thread) loses too: the widest backward tile pipelined spills 80-88 bytes on sm_80 with Triton 3.9. A tuned plan
is keyed by the width bucket alone, never the row count, so a row's result stays independent of the batch it
is in (docs/numerics.md). Times are ``kernel_bench``'s kernel-only figure: the median of CUDA graph
replays timed with CUDA events, L2 flushed before each. A winner is timed again against the default, back to
back, and written only if it beats the default by more than ``MIN_GAIN``.

``--time-limit`` bounds the whole run: no candidate starts after it, the bucket under way keeps its best so far,
and the table written holds what was swept. The table is rewritten after every bucket, so a run killed from
outside keeps what it measured. The output is the installed table with this architecture's section replaced
(card, date, command, Triton and torch versions, the buckets swept, the winning entries): write it over
``hf_rmsnorm/ops/tuned_plans.json`` and commit it.

``--dry-run`` runs the same code on the CPU, kernels in Triton's interpreter, at toy sizes (``DRY_RUN_ELEMENTS``),
on the narrowest bucket with ``DRY_RUN_TRIALS`` candidates, with the host clock and no graphs: it checks the
plumbing (candidates in use, correctness checks, table writing). Its times are not measurements: none is
printed, its winners are named as not written, and the table it writes is the installed one, unchanged.

Usage::

    python scripts/tune_kernels.py --json hf_rmsnorm/ops/tuned_plans.json
    python scripts/tune_kernels.py --kernels backward --dtypes bf16 --widths 4096 8192 --json tuned.json
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hf_rmsnorm.ops import launch, tuning
from hf_rmsnorm.ops.reference import error_beyond_bound
from . import kernel_bench
from .kernel_inspect import MAX_SPILL_BYTES

KERNELS = ("backward", "forward")
DTYPES = ("bf16", "fp32")
PHASES = {"forward": "fwd", "backward": "bwd"}
# Narrower rows than a 64-wide attention head are normalised by no model the package patches: their plans stay
# the defaults.
MIN_SWEPT_WIDTH = 64
# Elements per timed problem: 16384 tokens of width 4096, a training batch, where bandwidth decides. Decode-sized
# calls are launch-bound, and no tiling changes that.
TUNE_ELEMENTS = 2**26
DRY_RUN_ELEMENTS = 2**10
DRY_RUN_TRIALS = 2
# A winner must beat the default by more than the run-to-run spread of medians of graph replays (about a
# percent on an H100) to replace it: a table entry for noise would pin a plan that is no faster.
MIN_GAIN = 0.03
DRY_RUN_NOTE = ("dry run on the CPU: kernels in Triton's interpreter, toy sizes, the host clock; the times are not "
                "measurements and no winner is written (the table written is the installed one, unchanged)")


def plan_function(kernel: str) -> Callable[..., Any]:
    """``launch.forward_plan`` or ``launch.backward_plan``: ``(n_cols, elem_bytes, arch) -> TilingPlan``."""
    from hf_rmsnorm.ops import launch

    return {"forward": launch.forward_plan, "backward": launch.backward_plan}[kernel]


def plan_widths(kernel: str, elem_bytes: int) -> list[int]:
    """Every width bucket the kernel's plan has: the powers of two from 1 to the first one past the single tile
    (wider rows take the looped kernel, whose plan does not depend on the width). The default plan can change
    only between two of these widths, from ``b // 2`` to ``b // 2 + 1`` elements."""
    plan = plan_function(kernel)
    widths = [1]
    while plan(widths[-1], elem_bytes, None).single_tile:
        widths.append(2 * widths[-1])
    return widths


def tunable_values(plan: Any, kernel: str) -> dict[str, int]:
    """The constants of ``plan`` a table entry for ``kernel`` may override."""
    return {name: getattr(plan, name) for name in tuning.TUNABLE[kernel]}


def neighbours(name: str, value: int, single_tile: bool) -> list[int]:
    """The values of constant ``name`` tried next to ``value``."""
    from hf_rmsnorm.ops import launch

    if name == "block_m":
        return [v for v in (value // 2, value * 2) if v >= 1]
    if name == "num_warps":
        return [v for v in (value // 2, value * 2) if 1 <= v <= tuning.MAX_NUM_WARPS]
    if name == "num_stages":
        return [v for v in range(1, launch.BWD_MAX_STAGES + 1) if v != value] if single_tile else []
    return [v for v in range(1, launch.BWD_MAX_PROGRAMS_PER_SM + 1) if v != value]


def exact_outputs(kernel: str, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The fp64 truth of what ``kernel_bench``'s fused add + RMSNorm computes (its weight of ones): the forward's
    ``(y, residual + x)``, or the backward's gradients of ``(x, residual, weight)`` for the output gradients
    ``dy`` and ``dsum``. The sum is rounded to the activations' dtype first, as the kernels and the model round it;
    nothing else is rounded."""
    s = (inputs["residual"] + inputs["x"]).double().requires_grad_()
    weight = torch.ones(s.shape[-1], dtype=torch.float64, device=s.device, requires_grad=True)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + kernel_bench.EPS) * weight
    if kernel == "forward":
        return y.detach(), s.detach()
    ds, dweight = torch.autograd.grad(y, (s, weight), inputs["dy"].double())
    ds = ds + inputs["dsum"].double()
    return ds, ds, dweight


def output_problem(kernel: str, outputs: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...],
                   exact: tuple[torch.Tensor, ...]) -> str | None:
    """Why a candidate's outputs do not count as good as the default plan's ``reference``, or None. Forward:
    ``(y, residual + x)``; backward: the gradients of ``(x, residual, weight)``; ``exact``: their fp64 truth
    (``exact_outputs``). The sum must be bitwise the default plan's, the rest within
    ``reference.error_beyond_bound`` of it."""
    names = ("y", "sum") if kernel == "forward" else ("dx", "dresidual", "dweight")
    for name, got, want, truth in zip(names, outputs, reference, exact):
        if name == "sum":
            if not torch.equal(got, want):
                return "sum not bitwise equal to the default plan's"
            continue
        excess = error_beyond_bound(got, want, truth)
        if excess > 0:
            return f"{name} less accurate than the default plan's against fp64 (by {excess:.3g} over the bound)"
    return None


def spill_problem() -> str | None:
    """Why the binaries launched since the launchers' caches were last emptied spill more than the plans may
    (``kernel_inspect.MAX_SPILL_BYTES`` a thread, the rule the offline inspection holds the default plans to), or
    None. Triton's ``n_spills`` of a loaded binary is its local memory in 4-byte words: these kernels have no local
    arrays, so all of it is spilled registers. The interpreter caches no binary: None there."""
    spilled = max((4 * binary.n_spills for launcher in launch._LAUNCHERS.values() for binary in launcher.binaries()),
                  default=0)
    if spilled > MAX_SPILL_BYTES:
        return f"spills {spilled} B a thread (at most {MAX_SPILL_BYTES})"
    return None


def _empty_launcher_caches() -> None:
    # Each candidate's binaries are then the only ones spill_problem reads; Triton's own cache keeps them compiled.
    for launcher in launch._LAUNCHERS.values():
        launcher.clear()


@dataclass
class Trial:
    """One candidate: its constants, its median seconds (None unless ``status`` is ``"ok"``)."""

    plan: dict[str, int]
    status: str
    seconds: float | None = None


@dataclass
class BucketSweep:
    """One (kernel, dtype, width bucket): the default plan's constants and time, the best found, every trial.
    ``complete`` is False where the time limit cut the descent short."""

    kernel: str
    dtype: str
    width: int
    rows: int
    default: dict[str, int]
    default_seconds: float
    best: dict[str, int]
    best_seconds: float
    trials: list[Trial] = field(default_factory=list)
    complete: bool = True

    @property
    def elem_bytes(self) -> int:
        """The activations' element size: the table's key with the kernel and the width."""
        return kernel_bench.DTYPES[self.dtype].itemsize

    @property
    def name(self) -> str:
        """``kernel/elem_bytes/width``, as the table's ``swept`` list names a bucket."""
        return f"{self.kernel}/{self.elem_bytes}/{self.width}"

    def wins(self) -> bool:
        """Whether the best plan replaces the default: faster by more than ``MIN_GAIN``."""
        return self.best != self.default and self.best_seconds < (1 - MIN_GAIN) * self.default_seconds

    def entry(self) -> dict[str, Any]:
        """The table entry of the winner (``tuning``'s format)."""
        return {"kernel": self.kernel, "elem_bytes": self.elem_bytes, "width_bucket": self.width, "plan": self.best,
                "measured": {"rows": self.rows, "us": round(self.best_seconds * 1e6, 2),
                             "default_us": round(self.default_seconds * 1e6, 2)}}


@dataclass(frozen=True)
class TuneConfig:
    """The command line of ``scripts/tune_kernels.py``, one field per option, and the command itself (recorded
    in the table); see its ``--help``."""

    kernels: list[str]
    dtypes: list[str]
    warmup: int
    repeats: int
    command: str
    widths: list[int] | None = None
    time_limit: float | None = None
    json: Path | None = None
    dry_run: bool = False


class Sweeper:
    """Runs candidate plans of one problem through the library and times them with ``kernel_bench``'s harness."""

    def __init__(self, settings: kernel_bench.Settings, arch: str | None, deadline: float) -> None:
        self.settings = settings
        self.arch = arch
        self.deadline = deadline

    def median_seconds(self, make_fn: Callable[[], Callable[[], Any]]) -> float:
        """Median seconds of what ``make_fn()`` returns: the kernels' figure of ``kernel_bench.time_phase``."""
        return kernel_bench.time_callable(self.settings.capture(make_fn), clock=self.settings.clock,
                                          flush=self.settings.flush, warmup=self.settings.warmup,
                                          repeats=self.settings.repeats)

    def sweep(self, kernel: str, dtype_name: str, width: int, elements: int, max_trials: int | None) -> BucketSweep:
        """The coordinate descent of the module docstring on one bucket, at ``width`` (the bucket's widest row)."""
        dtype = kernel_bench.DTYPES[dtype_name]
        rows = max(1, elements // width)
        device = self.settings.device
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = {k: torch.randn(rows, width, dtype=dtype, device=device, generator=gen)
                  for k in ("x", "residual", "dy", "dsum")}
        impl = kernel_bench.build_impl("hf_rmsnorm", width, dtype, device)
        make_fn = functools.partial(kernel_bench.phase_callable, impl, PHASES[kernel], inputs)
        key = tuning.PlanKey(self.arch, kernel, dtype.itemsize, width)
        with tuning.plans_in_use({}):
            default_plan = plan_function(kernel)(width, dtype.itemsize, self.arch)
            reference = make_fn()()
            default_seconds = self.median_seconds(make_fn)
        exact = exact_outputs(kernel, inputs)
        default = tunable_values(default_plan, kernel)
        result = BucketSweep(kernel, dtype_name, width, rows, default, default_seconds, default, default_seconds)

        def run(candidate: dict[str, int]) -> Trial:
            with tuning.plans_in_use({key: candidate}):
                try:
                    _empty_launcher_caches()
                    problem = output_problem(kernel, make_fn()(), reference, exact) or spill_problem()
                    if problem:
                        return Trial(candidate, problem)
                    return Trial(candidate, "ok", self.median_seconds(make_fn))
                except Exception as exc:  # a candidate that does not compile (shared memory) loses, the rest go on
                    return Trial(candidate, kernel_bench.failure_status(exc))

        def candidates():
            # One constant at a time, each around the best so far (read when its turn comes); then each constant
            # changed alone from the default, which the descent misses once an earlier constant has moved (on the
            # H200 it went to 32 warps at bf16 16384 and never tried the default pipelined, 7% faster still).
            for name in tuning.TUNABLE[kernel]:
                for value in neighbours(name, result.best[name], default_plan.single_tile):
                    yield {**result.best, name: value}
            for name in tuning.TUNABLE[kernel]:
                for value in neighbours(name, default[name], default_plan.single_tile):
                    yield {**default, name: value}

        for candidate in candidates():
            if candidate in (trial.plan for trial in result.trials):
                continue
            if len(result.trials) == max_trials:
                break
            if time.monotonic() > self.deadline:
                result.complete = False
                break
            trial = run(candidate)
            result.trials.append(trial)
            if trial.seconds is not None and trial.seconds < result.best_seconds:
                result.best, result.best_seconds = trial.plan, trial.seconds
        return self._confirmed(result, run)

    @staticmethod
    def _confirmed(result: BucketSweep, run: Callable[[dict[str, int]], Trial]) -> BucketSweep:
        """The winner and the default timed again, back to back: the descent kept the fastest of many noisy
        medians, which favours whichever was lucky."""
        if result.best == result.default:
            return result
        default, best = run(result.default), run(result.best)
        if default.seconds is not None and best.seconds is not None:
            result.default_seconds, result.best_seconds = default.seconds, best.seconds
        return result


def _describe(plan: dict[str, int]) -> str:
    return " ".join(f"{name}={value}" for name, value in plan.items())


def sweep_line(sweep: BucketSweep, copy_gbps: float, dry_run: bool) -> str:
    """One bucket's outcome: the default's time and fraction of copy bandwidth, the winner, the trials. A dry
    run's times are not measurements: none is printed."""
    act = sweep.elem_bytes
    traffic = kernel_bench.min_traffic_bytes(PHASES[sweep.kernel], sweep.rows, sweep.width, act, act)

    def figure(seconds: float) -> str:
        if dry_run:
            return "(no time: dry run)"
        return f"{seconds * 1e6:.1f} us ({100 * kernel_bench.gbps(traffic, seconds) / copy_gbps:.0f}% of copy)"

    rejected = [t for t in sweep.trials if t.status != "ok"]
    line = (f"{sweep.kernel:<8} {sweep.dtype:<4} width {sweep.width:>5} x {sweep.rows} rows: default "
            f"{_describe(sweep.default)} {figure(sweep.default_seconds)}; {len(sweep.trials)} candidates, "
            f"{len(rejected)} rejected")
    if rejected:
        line += f" (e.g. {_describe(rejected[0].plan)}: {rejected[0].status})"
    if sweep.best != sweep.default:
        verdict = ("not written (dry run)" if dry_run else "written" if sweep.wins()
                   else f"not written: gain under {100 * MIN_GAIN:.0f}%")
        line += f"; best {_describe(sweep.best)} {figure(sweep.best_seconds)}, {verdict}"
    else:
        line += "; the default stands"
    return line + ("" if sweep.complete else " [cut short by the time limit]")


def architecture_section(sweeps: list[BucketSweep], device_name: str, command: str) -> dict[str, Any]:
    """This architecture's section of the table (``tuning``'s format): the run's metadata, the buckets swept,
    the winners."""
    import triton

    return {"card": device_name, "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "command": command, "triton": triton.__version__, "torch": torch.__version__,
            "swept": [s.name for s in sweeps], "entries": [s.entry() for s in sweeps if s.wins()]}


def merged_table(installed: dict[str, Any], arch: str, section: dict[str, Any]) -> dict[str, Any]:
    """The installed table with ``arch``'s section replaced by ``section``: the other architectures' stay."""
    return {"format": tuning.TABLE_FORMAT, "architectures": {**installed["architectures"], arch: section}}


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Validates ``table`` as the loader will, then writes it."""
    tuning.validate_table(table, str(path))
    path.write_text(json.dumps(table, indent=1) + "\n")


def work_items(config: TuneConfig) -> list[tuple[int, str, str]]:
    """``(width, dtype, kernel)`` in sweep order: widest bucket first, then the dtypes and kernels as given."""
    items = []
    for dtype in config.dtypes:
        for kernel in config.kernels:
            widths = plan_widths(kernel, kernel_bench.DTYPES[dtype].itemsize)
            if config.widths is not None:
                widths = [w for w in widths if w in config.widths]
            else:
                # A dry run takes the narrowest only: the interpreter takes seconds per call on wider rows.
                widths = [w for w in widths if w >= MIN_SWEPT_WIDTH][: 1 if config.dry_run else None]
            items += [(w, dtype, kernel) for w in widths]
    return sorted(items, key=lambda item: -item[0])  # stable: the dtypes and kernels stay in the given order


def run_tuning(config: TuneConfig) -> list[BucketSweep]:
    """Sweeps every bucket of ``config`` on the current GPU, printing each bucket's line as it ends and
    rewriting ``config.json`` after each (the installed table with this GPU's architecture section replaced),
    and returns the sweeps.

    Needs a GPU, with the kernels set up for it (``hf_rmsnorm.ops.backend.configure("cuda")``); with
    ``config.dry_run`` and no GPU, runs on the CPU with the kernels set up for Triton's interpreter
    (``configure("cpu")``), and writes the installed table unchanged (``DRY_RUN_NOTE``).
    """
    start = time.monotonic()
    deadline = start + config.time_limit if config.time_limit is not None else float("inf")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        settings = kernel_bench.gpu_settings(device, config.dtypes[0], config.warmup, config.repeats)
        device_name = torch.cuda.get_device_name(device)
        arch = tuning.device_arch(device.index)
        elements, max_trials = TUNE_ELEMENTS, None
    elif config.dry_run:
        settings = kernel_bench.dry_run_settings(config.dtypes[0], config.warmup, config.repeats)
        device_name, arch = "cpu (dry run)", None
        elements, max_trials = DRY_RUN_ELEMENTS, DRY_RUN_TRIALS
        print(DRY_RUN_NOTE)
    else:
        raise RuntimeError("run_tuning needs a GPU, or config.dry_run to run on the CPU")
    print(f"{device_name} ({arch or 'no architecture'})" + (
        "" if config.dry_run else f": device-to-device copy {settings.copy_gbps:.0f} GB/s"), flush=True)
    installed = tuning.read_table(tuning.TABLE_PATH)
    sweeper = Sweeper(settings, arch, deadline)
    sweeps: list[BucketSweep] = []
    for width, dtype, kernel in work_items(config):
        if time.monotonic() > deadline:
            print(f"time limit of {config.time_limit:.0f} s reached: {len(sweeps)} buckets swept", flush=True)
            break
        sweeps.append(sweeper.sweep(kernel, dtype, width, elements, max_trials))
        kernel_bench.release_cached_memory(settings.device)
        print(sweep_line(sweeps[-1], settings.copy_gbps, config.dry_run), flush=True)
        if config.json:
            write_table(config.json, installed if config.dry_run else merged_table(
                installed, arch, architecture_section(sweeps, device_name, config.command)))
    return sweeps
