"""Times the fused query/key norms + RoPE (``qk_norm_rope``) on a GPU against an unpatched Qwen3 attention's norms
and RoPE, forward and backward, as achieved bandwidth and as a fraction of the card's copy bandwidth.

    python scripts/bench_qk.py --json qk.json
    python scripts/bench_qk.py --tokens 16384 --phases bwd --ops hf_qk_rope hf_eager_qk
    python scripts/bench_qk.py --tokens 8 --dry-run     # without a GPU: the harness on the CPU

Exit status: 0 (also without a GPU, after saying so), 2 bad input (one line on stderr, no traceback).
The work is done by harness.qk_bench, which also explains the method; this file only reads the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hf_rmsnorm.ops import backend  # noqa: E402
from harness import kernel_bench, qk_bench  # noqa: E402  (define no kernel)
from hf_rmsnorm.tools import cli  # noqa: E402


def parse_args(argv: list[str]) -> qk_bench.QKBenchConfig:
    """The command line as a ``QKBenchConfig``."""
    parser = cli.ArgumentParser(prog="bench_qk.py", description=qk_bench.__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=cli.at_least(1), nargs="+", default=list(qk_bench.DEFAULT_TOKENS))
    parser.add_argument("--head-dim", type=cli.at_least(2), nargs="+", default=list(qk_bench.DEFAULT_HEAD_DIM))
    parser.add_argument("--ops", choices=qk_bench.IMPLS, nargs="+", default=list(qk_bench.IMPLS))
    parser.add_argument("--phases", choices=qk_bench.PHASES, nargs="+", default=list(qk_bench.PHASES))
    parser.add_argument("--dtype", choices=sorted(kernel_bench.DTYPES), default="bf16")
    parser.add_argument("--warmup", type=cli.at_least(0), default=5)
    parser.add_argument("--repeats", type=cli.at_least(1), default=30)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU, run the harness on the CPU (kernels in Triton's interpreter, plain calls "
                        "for CUDA graphs, the host clock): checks the plumbing, the figures mean nothing")
    return qk_bench.QKBenchConfig(**vars(parser.parse_args(argv)))


def _main(argv: list[str]) -> int:
    config = parse_args(argv)
    if not torch.cuda.is_available() and not config.dry_run:
        print("bench_qk.py needs a CUDA (or ROCm) GPU and none is available: nothing to time "
              "(--dry-run runs the harness on the CPU).")
        return cli.EXIT_OK
    # Set the backend up before hf_rmsnorm defines the kernels: compiled on a GPU, interpreted in a CPU dry run.
    backend.configure("cuda" if torch.cuda.is_available() else "cpu")
    qk_bench.run_benchmark(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status: 0, also without a GPU (nothing to time), 2 bad input."""
    return cli.run("bench_qk.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
