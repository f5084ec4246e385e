"""Counts the global-memory bytes each RMSNorm kernel variant moves, in Triton's CPU interpreter (no GPU needed),
against the minimum bytes of the call: a proxy for how close to copy bandwidth a kernel can get.

    python scripts/byte_traffic.py
    python scripts/byte_traffic.py --hidden 16384 --variant bwd+dsum --json traffic.json

Exit status: 0 done, 2 bad input (one line on stderr).
The work is done by harness.byte_traffic, which also explains the method; this file only reads the
command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.ops import backend  # noqa: E402
from hf_rmsnorm.ops.modes import MODES  # noqa: E402
from harness import byte_traffic  # noqa: E402  (define no kernel)
from hf_rmsnorm.tools import cli  # noqa: E402


def parse_args(argv: list[str]) -> byte_traffic.TrafficConfig:
    """The command line as a ``TrafficConfig``."""
    parser = cli.ArgumentParser(prog="byte_traffic.py", description=byte_traffic.__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=cli.at_least(1), nargs="+", default=list(byte_traffic.DEFAULT_HIDDEN))
    parser.add_argument("--variant", choices=byte_traffic.VARIANTS, nargs="+",
                        default=list(byte_traffic.DEFAULT_VARIANTS))
    parser.add_argument("--dtype", choices=sorted(byte_traffic.DTYPES), default="bf16")
    parser.add_argument("--mode", default="llama", help="casting order, as in hf_rmsnorm.ops.modes.MODES")
    parser.add_argument("--rows", type=cli.at_least(1),
                        help="rows of the smaller of the two runs per variant (default: about "
                        f"{byte_traffic.TARGET_ELEMENTS} elements, at least {byte_traffic.MIN_ROWS} rows)")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = vars(parser.parse_args(argv))
    if args["mode"] not in MODES:
        raise cli.InputError(f"unknown --mode {args['mode']!r}: use one of {', '.join(MODES)}")
    return byte_traffic.TrafficConfig(**args)


def _main(argv: list[str]) -> int:
    config = parse_args(argv)
    # The counter wraps the interpreter: the kernels must be defined for it before any exists.
    backend.configure("cpu")
    byte_traffic.run_byte_traffic(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the count; returns the exit status: 0 done, 2 bad input."""
    return cli.run("byte_traffic.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
