"""Compiles every launch variant of the RMSNorm kernels for a GPU architecture, offline (no GPU needed), and
reports registers per thread, spilled bytes and the widest global load of each.

    python scripts/inspect_kernels.py --arch sm_90 --json inspect_sm90.json
    python scripts/inspect_kernels.py --arch sm_80 --hidden 4096 --dtype bf16 --strict

Exit status: 0 done, 1 --strict found a problem, 2 a variant failed to compile or bad input (one line on
stderr), 3 cuobjdump/nvdisasm missing or Triton too old
(>= 3.5 needed).
The work is done by harness.kernel_inspect, which also explains the method; this file only reads the
command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.ops import backend  # noqa: E402
from hf_rmsnorm.ops.modes import MODES  # noqa: E402
from harness import kernel_inspect  # noqa: E402  (define no kernel)
from hf_rmsnorm.tools import cli  # noqa: E402

EXIT_COMPILATION_FAILED, EXIT_NO_TOOLS = 2, 3


def parse_args(argv: list[str]) -> tuple[kernel_inspect.InspectConfig, bool]:
    """The command line as an ``InspectConfig``, and whether ``--strict`` was given."""
    parser = cli.ArgumentParser(prog="inspect_kernels.py", description=kernel_inspect.__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(kernel_inspect.SM_COUNTS), default="sm_90")
    parser.add_argument("--hidden", type=cli.at_least(1), nargs="+", default=list(kernel_inspect.DEFAULT_HIDDEN))
    parser.add_argument("--dtype", choices=kernel_inspect.DTYPES, nargs="+", default=list(kernel_inspect.DTYPES))
    parser.add_argument("--variant", choices=kernel_inspect.VARIANTS, nargs="+",
                        default=list(kernel_inspect.VARIANTS))
    parser.add_argument("--mode", default="llama", help="casting order, as in hf_rmsnorm.ops.modes.MODES")
    parser.add_argument("--rows", type=cli.at_least(1), default=kernel_inspect.DEFAULT_ROWS,
                        help="rows of the launch being specialised")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a variant spills more than kernel_inspect.MAX_SPILL_BYTES, its widest "
                             "global load is under 128 bits, or a pipelined loop has no asynchronous copies")
    args = vars(parser.parse_args(argv))
    if args["mode"] not in MODES:
        raise cli.InputError(f"unknown --mode {args['mode']!r}: use one of {', '.join(MODES)}")
    strict = args.pop("strict")
    return kernel_inspect.InspectConfig(**args), strict


def _main(argv: list[str]) -> int:
    config, strict = parse_args(argv)
    # Kernels defined for the interpreter cannot be compiled for a GPU: set the backend up before they exist.
    backend.configure("cuda")
    unavailable = kernel_inspect.unavailable_reason()
    if unavailable:
        print(unavailable, file=sys.stderr)
        return EXIT_NO_TOOLS
    tools = kernel_inspect.find_tools()
    try:
        records = kernel_inspect.run_inspection(config, tools)
    except kernel_inspect.CompilationFailed as exc:
        print(exc, file=sys.stderr)
        return EXIT_COMPILATION_FAILED
    return cli.EXIT_FAILED if strict and any(kernel_inspect.problems(r) for r in records) else cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the inspection; returns the exit status: 0 done, 1 ``--strict`` found a problem, 2 a variant failed
    to compile (or bad input, such as an unknown ``--mode``), 3 tools missing or Triton too old."""
    return cli.run("inspect_kernels.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
