#!/usr/bin/env python
"""Checks that hf_rmsnorm's patched model computes what the unpatched model computes, and how fast.

    python scripts/verify.py                       # SmolLM2-135M-Instruct's real weights, works offline
    python scripts/verify.py --model Qwen/Qwen3-0.6B --dtype bf16 --json report.json

Exit status: 0 parity passed, 1 parity failed, 2 bad input (one line on stderr, no traceback), 3 internal error
(one line; --traceback shows the traceback). The work is done by hf_rmsnorm.tools.verify; this file only reads
the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Neither imports torch or transformers, so --help and argument errors answer at once.
from hf_rmsnorm.tools import cli  # noqa: E402
from hf_rmsnorm.tools.verify_settings import DEFAULTS, VERDICT_RULE, VerifyConfig  # noqa: E402

EXIT_STATUSES = "Exit status: 0 passed, 1 failed, 2 bad input, 3 internal error."


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; per-device settings the user left out are None (see ``with_defaults``)."""
    parser = cli.ArgumentParser(
        prog="verify.py",
        description="Runs a model unpatched and patched by hf_rmsnorm on the same left-padded batch (chat "
        "prompts when the model has a tokenizer) and reports logit parity (against each other and against an "
        "fp32 copy of the unpatched model, fp64 for --dtype fp32), how many norm outputs round differently, "
        "greedy-generation agreement with the generated text, the patch summary and, on a GPU, generate() "
        "prefill/decode speed and peak memory. On CPU the kernels run in Triton's interpreter (correctness "
        "only; no speed figures). The reference is the model upcast in place, so the run needs memory for the "
        "model in fp32 (fp64). An encoder (or an encoder-decoder, through its encoder) is checked on its last "
        "hidden state and mean-pooled sentence embeddings instead, and timed on an embedding forward of 32 x 128 "
        "tokens.",
        epilog=f"Verdict: {VERDICT_RULE} {EXIT_STATUSES}",
    )
    parser.add_argument("--device", default="auto", choices=cli.DEVICES, help="auto: cuda if available, else cpu")
    cli.add_options(parser, VerifyConfig)  # every other option is declared once, on its VerifyConfig field
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.expanduser().absolute().parent.is_dir():
        raise cli.InputError(f"--json {args.json}: directory {args.json.expanduser().absolute().parent} "
                             "does not exist")
    return args


def with_defaults(args: argparse.Namespace, device_type: str) -> VerifyConfig:
    """The ``VerifyConfig`` of ``args``, with the defaults of ``device_type`` filled in."""
    settings = {key: value for key, value in vars(args).items() if key != "device"}
    for key, value in DEFAULTS[device_type].items():
        if settings[key] is None:
            settings[key] = value
    return VerifyConfig(**settings)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Quiet transformers' own progress bars and advice: verify's step lines are the progress indication. Set
    # before torch is imported: tqdm reads TQDM_DISABLE (the GGUF loader's bar) when it is imported.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    # The device before anything defines a kernel: on CPU the kernels must be defined for Triton's interpreter.
    device = cli.select_device(args.device)
    from hf_rmsnorm.tools.verify import verify

    return cli.EXIT_OK if verify(with_defaults(args, device.type), device).passed else cli.EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Runs the check; returns the exit status."""
    return cli.run("verify.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
