"""Sweeps the kernels' tiling constants on this GPU and writes the winners as the tuned-plan table for its
architecture, ready to commit as hf_rmsnorm/ops/tuned_plans.json.

    python scripts/tune_kernels.py --json hf_rmsnorm/ops/tuned_plans.json
    python scripts/tune_kernels.py --kernels backward --dtypes bf16 --widths 4096 --time-limit 60 --json t.json
    python scripts/tune_kernels.py --dry-run --json t.json     # without a GPU: the plumbing on the CPU

Exit status: 0 (also without a GPU, after saying so), 2 bad input (one line on stderr, no traceback).
The work is done by harness.kernel_tuning, which also explains the method; this file only reads the
command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hf_rmsnorm.ops import backend  # noqa: E402
from harness import kernel_tuning  # noqa: E402  (define no kernel)
from hf_rmsnorm.tools import cli  # noqa: E402


def _power_of_two(text: str) -> int:
    value = cli.at_least(1)(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"a width bucket is a power of two, got {value}")
    return value


def parse_args(argv: list[str]) -> kernel_tuning.TuneConfig:
    """The command line as a ``TuneConfig``, with the command itself recorded for the table."""
    parser = cli.ArgumentParser(prog="tune_kernels.py", description=kernel_tuning.__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=kernel_tuning.KERNELS, nargs="+", default=list(kernel_tuning.KERNELS))
    parser.add_argument("--dtypes", choices=kernel_tuning.DTYPES, nargs="+", default=list(kernel_tuning.DTYPES))
    parser.add_argument("--widths", type=_power_of_two, nargs="+",
                        help="sweep only these width buckets, where a kernel has them (default: every bucket "
                        f"from {kernel_tuning.MIN_SWEPT_WIDTH} to the looped one)")
    parser.add_argument("--warmup", type=cli.at_least(0), default=3)
    parser.add_argument("--repeats", type=cli.at_least(1), default=15)
    parser.add_argument("--time-limit", type=cli.positive_float,
                        help="seconds: no candidate starts after this; the table holds what was swept")
    parser.add_argument("--json", type=Path, help="write the table here (the installed one with this GPU's "
                        "architecture replaced)")
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU, run the sweep on the CPU at toy sizes (kernels in Triton's "
                        "interpreter): checks the plumbing, writes no winner")
    args = vars(parser.parse_args(argv))
    return kernel_tuning.TuneConfig(**args, command=" ".join(["scripts/tune_kernels.py", *argv]))


def _main(argv: list[str]) -> int:
    config = parse_args(argv)
    if not torch.cuda.is_available() and not config.dry_run:
        print("tune_kernels.py needs a CUDA (or ROCm) GPU and none is available: nothing to tune "
              "(--dry-run runs the sweep on the CPU).")
        return cli.EXIT_OK
    # Set the backend up before hf_rmsnorm defines the kernels: compiled on a GPU, interpreted in a CPU dry run.
    backend.configure("cuda" if torch.cuda.is_available() else "cpu")
    kernel_tuning.run_tuning(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep; returns the exit status: 0, also without a GPU (nothing to tune), 2 bad input."""
    return cli.run("tune_kernels.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
