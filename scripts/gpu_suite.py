"""Runs the project's GPU measurements, a plan of one lease at a time, and writes the figures into a folder.

    python scripts/prepare_gpu.py                                                  # first, on the CPU machine
    python scripts/gpu_suite.py --plan first --wheels .gpu-wheels --out DIR        # on the GPU machine
    python scripts/gpu_suite.py --plan first --dry-run --out DIR                   # toy sizes, anywhere (CPU too)
    python scripts/gpu_suite.py --plan first --estimate                            # each section's estimate

Plans (harness/gpu_suite.py, PLANS), each estimated to fit one lease (8.5 minutes of measuring on an H100):
first: the kernel tests on the card, the kernels from hidden 2048 to 65536 with the A/B of the single-tile
backward at 16384, decode-sized calls and host time per call, generate() on the Llama-3.2-1B shape (unpatched,
patched and norm-free), and training steps patched, unpatched and norm-free; second: the tuning sweep,
generate() on the Llama-3-8B shape and compiled generation on the 1B shape; third: FSDP2 training, RMSNorm against
LayerNorm (kernels, and a Pythia-1B-shaped decoder's generate()), a BERT-base-shaped encoder's embedding forward
(issue 30's goal), prefill at 2048 tokens and the q/k norms fused with the RoPE (kernels, Qwen3-8B-shaped
generate()); fourth: compiled generation on the 8B shape, the profile, fp16 kernels, the kernels against
torch.compile and the offline install.
Each section is a subprocess under its own time limit; --only picks sections by name. DIR gets summary.md (which
plan ran, the figures as tables, the changes still awaiting a GPU measurement), results.json, log.txt,
kernels.png, and the files to commit: tuned_plans.json, gpu_pending.json and gpu_section_costs.json. The wheels
are installed into a scratch folder, never into the environment.

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
    parser.add_argument("--out", type=Path, help="folder for summary.md, results.json, log.txt, kernels.png and "
                        "the files to commit (created; files of an earlier run are replaced); required unless "
                        "--estimate")
    parser.add_argument("--plan", nargs="+", choices=gpu_suite.PLANS, default=["first"],
                        help="the plans to run, in their order (default: first)")
    names = [s.name for s in gpu_suite.SECTIONS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="SECTION",
                        help=f"run these sections instead of a plan's: {', '.join(names)}")
    parser.add_argument("--wheels", type=Path, help="install the wheels of this folder first, offline, for the "
                        "sections (scripts/prepare_gpu.py fills .gpu-wheels/)")
    parser.add_argument("--dry-run", action="store_true", help="the same commands at toy sizes (runs on CPU too)")
    parser.add_argument("--time-limit", type=cli.at_least(1), help="seconds for the whole run (default "
                        f"{gpu_suite.PLAN_BUDGET_S} per plan): no section starts after that, and each section is "
                        "stopped at its own limit or at this one")
    parser.add_argument("--estimate", action="store_true",
                        help="print each section's estimated time and where it comes from, and run nothing")
    args = parser.parse_args(argv)
    if args.out is None and not args.estimate:
        raise cli.InputError("--out is required (the folder the run writes into)")
    if args.wheels is not None and not any(args.wheels.glob("*.whl")):
        raise cli.InputError(f"--wheels {args.wheels}: no wheel there; run python scripts/prepare_gpu.py on the CPU "
                             "machine and carry the folder with the device call")
    return args


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    plans = [] if args.only else args.plan
    sections = [s for s in gpu_suite.SECTIONS if s.name in args.only] if args.only else gpu_suite.plan_sections(plans)
    run = gpu_suite.suite_run(sections, plans, args.dry_run, args.time_limit)
    if args.estimate:
        costs = run.costs["sections"]
        for name in ("wheels", *run.sections):
            print(f"{name:<24} {costs[name]['seconds']:>5.0f} s  {costs[name]['source']}")
        print(f"{'total':<24} {run.estimate_s:>5.0f} s on an {run.costs['card']}; time limit {run.time_limit_s:.0f} s")
        return cli.EXIT_OK
    outcomes = gpu_suite.run_suite(args.out, sections, run, args.wheels)
    print((args.out / "summary.md").read_text())
    print(f"Files written to {args.out.absolute()}")
    return cli.EXIT_OK if all(o.status == "ok" for o in outcomes) else cli.EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Runs the suite; returns the exit status."""
    return cli.run("gpu_suite.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
