"""Times fused add + RMSNorm (forward, backward, forward+backward), and a sandwich layer's norm, add and next norm,
on a GPU against the alternatives a Hugging Face model could use, as achieved bandwidth and as a fraction of the
card's copy bandwidth.

    python scripts/bench_kernels.py --json bench.json --plot bench.png
    python scripts/bench_kernels.py --rows 16384 --hidden 4096 --ops hf_rmsnorm hf_eager --phases fwd
    python scripts/bench_kernels.py --rows 16384 --hidden 5376 --ops hf_sandwich hf_sandwich_2launch \
        hf_eager_sandwich --phases fwd        # a sandwich layer's norm, add and next norm (norm_add_norm)
    python scripts/bench_kernels.py --rows 64 --hidden 256 --dry-run     # without a GPU: the harness on the CPU

Exit status: 0 (also without a GPU, after saying so), 2 bad input (one line on stderr, no traceback).
The work is done by harness.kernel_bench, which also explains the method; this file only reads the
command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hf_rmsnorm.ops import backend  # noqa: E402
from harness import kernel_bench  # noqa: E402  (define no kernel)
from hf_rmsnorm.tools import cli  # noqa: E402


def parse_args(argv: list[str]) -> kernel_bench.BenchConfig:
    """The command line as a ``BenchConfig``."""
    parser = cli.ArgumentParser(prog="bench_kernels.py", description=kernel_bench.__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=cli.at_least(1), nargs="+", default=list(kernel_bench.DEFAULT_ROWS))
    parser.add_argument("--hidden", type=cli.at_least(1), nargs="+", default=list(kernel_bench.DEFAULT_HIDDEN))
    parser.add_argument("--ops", choices=kernel_bench.IMPLS, nargs="+", default=list(kernel_bench.IMPLS))
    parser.add_argument("--phases", choices=kernel_bench.PHASES, nargs="+", default=list(kernel_bench.PHASES))
    parser.add_argument("--dtype", choices=sorted(kernel_bench.DTYPES), default="bf16")
    parser.add_argument("--warmup", type=cli.at_least(0), default=5)
    parser.add_argument("--repeats", type=cli.at_least(1), default=30)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU, run the harness on the CPU (kernels in Triton's interpreter, plain calls "
                        "for CUDA graphs, the host clock): checks the plumbing, the figures mean nothing")
    return kernel_bench.BenchConfig(**vars(parser.parse_args(argv)))


def _main(argv: list[str]) -> int:
    config = parse_args(argv)
    if not torch.cuda.is_available() and not config.dry_run:
        print("bench_kernels.py needs a CUDA (or ROCm) GPU and none is available: nothing to time "
              "(--dry-run runs the harness on the CPU).")
        return cli.EXIT_OK
    # Set the backend up before hf_rmsnorm defines the kernels: compiled on a GPU, interpreted in a CPU dry run.
    backend.configure("cuda" if torch.cuda.is_available() else "cpu")
    kernel_bench.run_benchmark(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status: 0, also without a GPU (nothing to time), 2 bad input."""
    return cli.run("bench_kernels.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
