"""Runs every GPU measurement of the project in one command and writes the figures into a folder.

    python scripts/gpu_suite.py --out DIR              # on a GPU machine: about 8 minutes on an H100
    python scripts/gpu_suite.py --out DIR --dry-run    # toy sizes, anywhere (CPU too): a minute or two

Sections, in order (each a subprocess under its own time limit; --only picks some): offline install check, the
kernel tests on the card, kernel bandwidth and host time per call (bf16), generate() on the Llama-3.2-1B shape,
training steps patched, unpatched and norm-free, generate() on the Llama-3-8B shape, fp16 and decode-sized
kernels, prefill at 2048 tokens, the kernels against torch.compile, FSDP2 training, compiled generation on the 8B
shape, and RMSNorm against LayerNorm (kernels, and a Pythia-1B-shaped LayerNorm decoder's generate()). DIR gets summary.md (the figures as tables),
results.json, log.txt and kernels.png. Nothing is installed into the environment unless the install section
succeeds in installing this checkout (editable, offline).

Exit status: 0 when every section that ran succeeded, 1 when one failed or timed out, 2 bad input.
The work is done by harness.gpu_suite; this file only reads the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import gpu_suite  # noqa: E402  (imports no torch)
from hf_rmsnorm.tools import cli  # noqa: E402


def parse_args(argv: list[str]):
    parser = cli.ArgumentParser(prog="gpu_suite.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.md, results.json, log.txt, "
                        "kernels.png (created; files of an earlier run are replaced)")
    parser.add_argument("--dry-run", action="store_true", help="every section at toy sizes (runs on CPU too)")
    parser.add_argument("--time-limit", type=cli.at_least(1), default=gpu_suite.DEFAULT_TIME_LIMIT_S,
                        help=f"seconds for the whole suite (default {gpu_suite.DEFAULT_TIME_LIMIT_S}): no section "
                        "starts after that, and each section is stopped at its own limit or at this one")
    names = [s.name for s in gpu_suite.SECTIONS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="SECTION",
                        help=f"run only these sections: {', '.join(names)}")
    return parser.parse_args(argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    outcomes = gpu_suite.run_suite(args.out, args.time_limit, args.dry_run, args.only)
    print((args.out / "summary.md").read_text())
    print(f"Files written to {args.out.absolute()}")
    return cli.EXIT_OK if all(o.status == "ok" for o in outcomes) else cli.EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Runs the suite; returns the exit status."""
    return cli.run("gpu_suite.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
