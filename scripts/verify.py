#!/usr/bin/env python
"""Checks that hf_rmsnorm's patched model computes what the unpatched model computes, and how fast.

    python scripts/verify.py                       # default preset, works offline on any machine
    python scripts/verify.py --model Qwen/Qwen3-0.6B --dtype bf16 --json report.json

Exit status: 0 parity passed, 1 parity failed, 2 bad input (one line on stderr, no traceback).
The work is done by hf_rmsnorm.tools.verify; this file only reads the command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.tools import cli  # noqa: E402  (defines no kernel)


def parse_args(argv: list[str], device_type: str):
    """The full command line as a ``VerifyConfig``, with the defaults of ``device_type`` filled in."""
    from hf_rmsnorm.tools.parity import VERDICT_RULE
    from hf_rmsnorm.tools.presets import DEFAULT_PRESET, PRESETS
    from hf_rmsnorm.tools.verify import DEFAULTS, VerifyConfig

    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]
    parser = cli.ArgumentParser(
        prog="verify.py",
        description="Runs a model unpatched and patched by hf_rmsnorm on the same left-padded batch and reports "
        "logit parity (against each other and against an fp32 copy of the unpatched model, fp64 for --dtype "
        "fp32), greedy-generation agreement, the patch summary and, on a GPU, generate() prefill/decode speed "
        "and peak memory. On CPU the kernels run in Triton's interpreter (correctness only; no speed figures). "
        "The reference is the model upcast in place, so the run needs memory for the model in fp32 (fp64).",
        epilog=f"Verdict: {VERDICT_RULE} Exit status: 0 passed, 1 failed, 2 bad input.",
    )
    parser.add_argument("--model", default=DEFAULT_PRESET, metavar="NAME_OR_PATH",
                        help=f"a preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET}, random weights, no "
                        "network), a directory written by save_pretrained, or a Hub id")
    parser.add_argument("--dtype", default="bf16", metavar="{bf16,fp16,fp32}", help="model dtype (default bf16)")
    parser.add_argument("--device", default="auto", choices=cli.DEVICES, help="auto: cuda if available, else cpu")
    parser.add_argument("--batch-size", type=cli.at_least(1), default=None,
                        help=f"rows per batch (default {gpu['batch_size']} on GPU, {cpu['batch_size']} on CPU); "
                        "the speed run uses unpadded rows, the parity batch at least 2 left-padded rows")
    parser.add_argument("--prompt-len", type=cli.at_least(2), default=None,
                        help=f"prompt tokens per row (default {gpu['prompt_len']} on GPU, {cpu['prompt_len']} "
                        "on CPU); parity rows shrink down the batch to about half this, left-padded")
    parser.add_argument("--max-new-tokens", type=cli.at_least(2), default=None,
                        help=f"greedy tokens generated per row (default {gpu['max_new_tokens']} on GPU, "
                        f"{cpu['max_new_tokens']} on CPU)")
    parser.add_argument("--repeats", type=cli.at_least(1), default=None,
                        help=f"timed runs per speed figure, median reported (default {gpu['repeats']}; GPU only)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    args = vars(parser.parse_args(argv))
    del args["device"]
    for key, value in DEFAULTS[device_type].items():
        if args[key] is None:
            args[key] = value
    if args["json"] is not None and not args["json"].expanduser().absolute().parent.is_dir():
        raise cli.InputError(f"--json {args['json']}: directory {args['json'].expanduser().absolute().parent} "
                             "does not exist")
    return VerifyConfig(**args)


def _main(argv: list[str]) -> int:
    # The device first: on CPU the kernels must be defined for Triton's interpreter.
    device = cli.select_device(cli.requested_device(argv))
    # Quiet transformers' own progress bars and advice: verify's step lines are the progress indication.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    config = parse_args(argv, device.type)
    from hf_rmsnorm.tools.verify import verify

    return cli.EXIT_OK if verify(config, device)["passed"] else cli.EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Runs the check; returns the exit status."""
    return cli.run("verify.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
