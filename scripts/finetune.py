"""Causal-LM fine-tuning with hf_rmsnorm's patched norms, one process or many through accelerate launch.

usage:
  accelerate launch [accelerate options] scripts/finetune.py [--model NAME_OR_PATH] [--data PATH] \\
      --output-dir DIR [--max-steps N] [--batch-size B] [--seq-len L] [--lr LR] [--seed S] [--no-patch] \\
      [--lora] [--gradient-checkpointing] [--metrics-json PATH]
  (plain `python scripts/finetune.py ...` runs one process)

The model (a preset, a save_pretrained directory or a Hub id) is trained on a plain-text file or a directory
of .txt files, or, without --data, on the project's own README, docs and sources. Checkpoints without a
tokenizer (the presets) are trained on byte-level tokens. patch_model is applied after loading and before
accelerator.prepare; --no-patch trains Hugging Face's own norms, for comparison. The result is saved with
save_pretrained (only the adapter with --lora) and loads with plain transformers.

Without a GPU the Triton kernels run in Triton's CPU interpreter: exact but slow, so keep CPU runs tiny.
The work is done by hf_rmsnorm.tools.finetune; this file only reads the command line.

What has been tested (CPU only so far):
  one process:  python scripts/finetune.py ... (with --lora and --gradient-checkpointing too)
  CPU DDP:      accelerate launch --multi_gpu --num_processes 2 --mixed_precision no scripts/finetune.py ...
                (gloo; patched and unpatched runs give the same losses and parameters)
  FSDP on CPU:  refused with an error (accelerate shards only on GPUs and would quietly run DDP instead)
Not tested yet, pending a GPU: DDP on GPUs, --mixed_precision bf16, FSDP (--use_fsdp --fsdp_version 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.tools import cli  # noqa: E402  (defines no kernel)


def parse_args(argv: list[str]):
    """The command line as a ``FinetuneConfig``."""
    from hf_rmsnorm.tools.finetune import FULL_FINETUNE_LR, LORA_LR, FinetuneConfig
    from hf_rmsnorm.tools.presets import DEFAULT_PRESET

    parser = cli.ArgumentParser(
        prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_PRESET, help=f"preset, save_pretrained dir or Hub id (default {DEFAULT_PRESET})"
    )
    parser.add_argument(
        "--data", type=Path, help="text file or directory of .txt files (default: this project's docs and sources)"
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="where save_pretrained writes the result")
    parser.add_argument("--max-steps", type=cli.at_least(1), default=100, help="optimizer steps (default 100)")
    parser.add_argument(
        "--batch-size", type=cli.at_least(1), default=4, help="sequences per process and step (default 4)"
    )
    parser.add_argument("--seq-len", type=cli.at_least(1), default=512, help="tokens per sequence (default 512)")
    parser.add_argument(
        "--lr", type=cli.positive_float, help=f"AdamW learning rate (default {FULL_FINETUNE_LR}, {LORA_LR} with --lora)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for preset weights, LoRA init and data order")
    parser.add_argument("--no-patch", dest="patch", action="store_false", help="train with Hugging Face's own norms")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter and save only the adapter")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="enable HF gradient checkpointing")
    parser.add_argument(
        "--metrics-json", type=Path, help="write losses, tokens/s, peak GPU memory and patch counts here"
    )
    return FinetuneConfig(**vars(parser.parse_args(argv)))


def _main(argv: list[str]) -> int:
    # The GPU when there is one (accelerate picks it too), else the kernels in Triton's interpreter.
    cli.select_device("auto")
    config = parse_args(argv)
    from hf_rmsnorm.tools.finetune import finetune

    finetune(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the fine-tune on this process; returns the exit status."""
    return cli.run("finetune.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
