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

Without a GPU the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set before
hf_rmsnorm is imported, unless the environment sets TRITON_INTERPRET itself): exact but slow, so keep CPU
runs tiny.

What has been tested (CPU only so far):
  one process:  python scripts/finetune.py ... (with --lora and --gradient-checkpointing too)
  CPU DDP:      accelerate launch --multi_gpu --num_processes 2 --mixed_precision no scripts/finetune.py ...
                (gloo; patched and unpatched runs give the same losses and parameters)
  FSDP on CPU:  refused with an error (accelerate shards only on GPUs and would quietly run DDP instead)
Not tested yet, pending a GPU: DDP on GPUs, --mixed_precision bf16, FSDP (--use_fsdp --fsdp_version 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def _select_kernel_backend() -> None:
    """Runs the real Triton kernels in the interpreter when there is no GPU.

    Must happen before hf_rmsnorm is imported: Triton reads TRITON_INTERPRET when the kernels are defined.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_select_kernel_backend()

from hf_rmsnorm.finetune_data import FinetuneInputError  # noqa: E402
from hf_rmsnorm.interpreter import round_bf16_to_nearest_even  # noqa: E402
from hf_rmsnorm.loading import ModelLoadError  # noqa: E402
from hf_rmsnorm.patcher import UnsupportedModelError  # noqa: E402
from hf_rmsnorm.presets import DEFAULT_PRESET  # noqa: E402
from hf_rmsnorm.training import FULL_FINETUNE_LR, LORA_LR, FinetuneConfig, finetune  # noqa: E402

# Errors caused by what the user passed: reported as one line, without a traceback.
_USER_ERRORS = (FinetuneInputError, ModelLoadError, UnsupportedModelError)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    parser = argparse.ArgumentParser(
        prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_PRESET, help=f"preset, save_pretrained dir or Hub id (default {DEFAULT_PRESET})"
    )
    parser.add_argument(
        "--data", type=Path, help="text file or directory of .txt files (default: this project's docs and sources)"
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="where save_pretrained writes the result")
    parser.add_argument("--max-steps", type=_positive_int, default=100, help="optimizer steps (default 100)")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=4, help="sequences per process and step (default 4)"
    )
    parser.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument(
        "--lr", type=_positive_float, help=f"AdamW learning rate (default {FULL_FINETUNE_LR}, {LORA_LR} with --lora)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for preset weights, LoRA init and data order")
    parser.add_argument("--no-patch", dest="patch", action="store_false", help="train with Hugging Face's own norms")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter and save only the adapter")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="enable HF gradient checkpointing")
    parser.add_argument(
        "--metrics-json", type=Path, help="write losses, tokens/s, peak GPU memory and patch counts here"
    )
    return FinetuneConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        round_bf16_to_nearest_even()
    try:
        finetune(config)
    except _USER_ERRORS as err:
        # Every process hits the same error; one copy of the line is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"finetune.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
