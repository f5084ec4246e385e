"""Fetches, on this machine, every wheel a GPU run of the suite carries (the GPU machine reaches no network).

    python scripts/prepare_gpu.py                  # into .gpu-wheels/ (git-ignored), which the device call carries

Run it before a GPU session's device call; it is idempotent (a complete folder is left as it is) and keeps one
version of each wheel. CONTRIBUTING.md ("Run the GPU suite") gives the device call.

Exit status: 0 when the folder holds every pinned wheel, 1 when one could not be downloaded (one line on
stderr), 2 bad input. The wheels and the download are harness.gpu_wheels'; this file only reads the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import gpu_wheels  # noqa: E402  (imports no torch)
from hf_rmsnorm.tools import cli  # noqa: E402


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(prog="prepare_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=gpu_wheels.WHEEL_DIR,
                        help=f"folder for the wheels (default {gpu_wheels.WHEEL_DIR.name}/ in the checkout)")
    args = parser.parse_args(argv)
    try:
        lines = gpu_wheels.prepare(args.dest)
    except gpu_wheels.PrepareError as exc:
        print(f"prepare_gpu.py: error: {exc}", file=sys.stderr)
        return cli.EXIT_FAILED
    print("\n".join(lines))
    print(f"{len(gpu_wheels.WHEELS)} wheels in {args.dest}: carry it with the device call")
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Prepares the wheel folder; returns the exit status."""
    return cli.run("prepare_gpu.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
