"""Patches a tiny random model of every causal-LM, encoder and encoder-decoder type of the installed transformers
and checks its parity.

    python scripts/coverage.py                                  # all types, both tables
    python scripts/coverage.py --only nanochat gemma3_text      # some types, merged into the existing page
    python scripts/coverage.py --start 100 --count 50           # in chunks
    python scripts/coverage.py --table encoder                  # the encoder table only

Results are merged into --out (default docs/coverage.md) and the JSON beside it, so runs in chunks build one
page. On CPU the kernels run in Triton's interpreter. Exit status: 0 when no model type failed its parity
check, 1 when one did, 2 bad input. The work is done by harness.coverage.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.tools import cli  # noqa: E402  (imports no torch)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(prog="coverage.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these model types only")
    parser.add_argument("--start", type=cli.at_least(0), default=0, help="index of the first model type")
    parser.add_argument("--count", type=cli.at_least(1), default=None, help="how many model types")
    parser.add_argument("--time-limit", type=cli.at_least(1), default=3600,
                        help="no model type is started after this many seconds (default 3600)")
    parser.add_argument("--per-model-limit", type=cli.at_least(1), default=60,
                        help="seconds one model type may take (default 60)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown page (JSON written beside it)")
    parser.add_argument("--table", choices=("causal", "encoder", "both"), default="both",
                        help="the causal LMs, the encoders and encoder-decoders (base models), or both (default)")
    args = parser.parse_args(argv)

    from hf_rmsnorm.ops import backend

    backend.configure("cpu")
    import transformers

    from harness import coverage

    transformers.logging.set_verbosity_error()
    tables = {"causal": [coverage.CAUSAL_LM], "encoder": [coverage.ENCODER]}.get(
        args.table, [coverage.CAUSAL_LM, coverage.ENCODER])
    types = {table: coverage.causal_lm_types() if table == coverage.CAUSAL_LM else coverage.encoder_types()
             for table in tables}
    if args.only:
        unknown = sorted(set(args.only) - {t for of_table in types.values() for t in of_table})
        if unknown:
            raise cli.InputError(f"--only: no model type {', '.join(unknown)} in the tables of transformers "
                                 f"{transformers.__version__}")
    names = []
    for table, of_table in types.items():
        chosen = [t for t in of_table if t in args.only] if args.only else list(of_table)
        names += [(table, t) for t in chosen]
    if not args.only:
        names = names[args.start:None if args.count is None else args.start + args.count]
    deadline = time.monotonic() + args.time_limit
    results = []
    for table, name in names:
        if time.monotonic() > deadline:
            print(f"time limit reached: {len(names) - len(results)} model types not run")
            break
        result = coverage.check_model_type(name, types[table][name], args.per_model_limit, table)
        print(f"{table:<10} {name:<28} {result.verdict:<10} {result.seconds:5.1f} s  {result.reason}", flush=True)
        results.append(result)
    everything = coverage.merged(coverage.read(args.out), results)
    coverage.write(everything, args.out, transformers.__version__)
    print(f"{len(results)} model types checked; page written to {args.out}")
    return cli.EXIT_FAILED if any(r.verdict == "failed" for r in results) else cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep; returns the exit status."""
    return cli.run("coverage.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
