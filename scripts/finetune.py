"""Causal-LM fine-tuning with hf_rmsnorm's patched norms, one process or many through accelerate launch.

usage:
  accelerate launch [accelerate options] scripts/finetune.py [--model NAME_OR_PATH] [--data PATH] \\
      --output-dir DIR [--overwrite] [--max-steps N] [--batch-size B] [--seq-len L] [--lr LR] [--seed S] \\
      [--no-patch | --norm-free] [--lora] [--gradient-checkpointing] [--fsdp] [--metrics-json PATH]
  (plain `python scripts/finetune.py ...` runs one process)

The model (a preset, a save_pretrained directory or a Hub id) is trained on a plain-text file or a directory
of .txt files, or, without --data, on the project's own README, docs and sources. Checkpoints without a
tokenizer (the presets) are trained on byte-level tokens. patch_model is applied after loading and before
accelerator.prepare; --no-patch trains Hugging Face's own norms, for comparison, and --norm-free (one process,
timing only) a model whose norms return their input: what a run without norm cost would take. The result is saved with
save_pretrained into --output-dir (required, no default; a directory an earlier run wrote to is refused
unless --overwrite) and loads with plain transformers. With --lora only the adapter is saved, and its
adapter_config.json names the base model: the --model directory (as an absolute path) or Hub id, or, for a
preset, a copy saved to OUTPUT_DIR/base_model; so peft.AutoPeftModelForCausalLM.from_pretrained(OUTPUT_DIR)
loads it on its own.

Without a GPU the Triton kernels run in Triton's CPU interpreter: exact but slow (about a second per step on a
tiny preset), so --max-steps, --batch-size and --seq-len default to a small demo on CPU and to a real run on a
GPU. The first line printed says what will run: steps x batch x sequence length x processes, on which device.

Exit status: 0 trained and saved, 2 bad input (one line on stderr, nothing written), 3 internal error (one
line; --traceback shows the traceback). The work is done by hf_rmsnorm.tools.finetune; this file only reads the
command line.

--fsdp shards the model with FSDP2: each decoder layer is one unit, so each of N processes holds 1/N of the
decoder parameters, gradients and optimizer state. On GPUs accelerate applies it (its FSDP2 plugin, a
transformer-layer wrap policy; --mixed_precision bf16 becomes an FSDP2 mixed-precision policy); one GPU works
too, as a process group of one. accelerate does not shard on CPU, so there the script applies torch's
fully_shard itself, per decoder layer and then on the whole model, over gloo, and needs at least 2 processes.
Launch it plainly (accelerate launch --multi_gpu --num_processes N, or with --num_machines, --machine_rank,
--main_process_ip and --main_process_port across machines); accelerate's own --use_fsdp is refused. The result
is saved unsharded (gathered onto the main process), exactly as without --fsdp.

What has been tested (CPU only so far):
  one process:  python scripts/finetune.py ... (with --lora and --gradient-checkpointing too)
  CPU DDP:      accelerate launch --multi_gpu --num_processes 2 --mixed_precision no scripts/finetune.py ...
                (gloo; patched and unpatched runs give the same losses and parameters)
  CPU FSDP2:    the same launch with --fsdp (also with --lora and --gradient-checkpointing, and as 2 machines
                of 1 process on one host): the same losses as DDP, patched or not
Not tested yet, pending a GPU: DDP or FSDP2 on GPUs, --mixed_precision bf16 with FSDP2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.tools import cli  # noqa: E402  (imports no torch: --help answers at once)


def parse_args(argv: list[str]):
    """The command line as a ``FinetuneConfig``."""
    from hf_rmsnorm.tools.finetune_settings import DEFAULTS, FULL_FINETUNE_LR, LORA_LR, FinetuneConfig
    from hf_rmsnorm.tools.presets import DEFAULT_PRESET

    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]
    parser = cli.ArgumentParser(
        prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_PRESET, help=f"preset, save_pretrained dir or Hub id (default {DEFAULT_PRESET})"
    )
    parser.add_argument(
        "--data", type=Path, help="text file or directory of .txt files (default: this project's docs and sources)"
    )
    parser.add_argument(
        "--output-dir", type=Path, required=True,
        help="where save_pretrained writes the result (required: give each run its own directory)",
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help="write into a non-empty --output-dir (same-named files are replaced, others kept) and replace "
        "--metrics-json",
    )
    # None: the default of the device the run ends up on, filled in by hf_rmsnorm.tools.finetune.
    parser.add_argument(
        "--max-steps", type=cli.at_least(1), default=None,
        help=f"optimizer steps (default {gpu['max_steps']} on GPU, {cpu['max_steps']} on CPU)",
    )
    parser.add_argument(
        "--batch-size", type=cli.at_least(1), default=None,
        help=f"sequences per process and step (default {gpu['batch_size']} on GPU, {cpu['batch_size']} on CPU)",
    )
    parser.add_argument(
        "--seq-len", type=cli.at_least(1), default=None,
        help=f"tokens per sequence (default {gpu['seq_len']} on GPU, {cpu['seq_len']} on CPU)",
    )
    parser.add_argument(
        "--lr", type=cli.positive_float, help=f"AdamW learning rate (default {FULL_FINETUNE_LR}, {LORA_LR} with --lora)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for preset weights, LoRA init and data order")
    parser.add_argument("--no-patch", dest="patch", action="store_false", help="train with Hugging Face's own norms")
    parser.add_argument(
        "--norm-free", action="store_true",
        help="timing oracle, one process: every norm returns its input (no norm cost at all; the model trained is "
        "meaningless); the most any norm kernel could save is the step time against --no-patch",
    )
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter and save only the adapter")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="enable HF gradient checkpointing")
    parser.add_argument(
        "--fsdp", action="store_true",
        help="shard with FSDP2, one unit per decoder layer (by accelerate on GPUs, by torch's fully_shard over "
        "gloo on CPU, which needs 2+ processes); saved unsharded",
    )
    parser.add_argument(
        "--metrics-json", type=Path, help="write losses, tokens/s, peak GPU memory and patch counts here"
    )
    # --traceback (added by cli.ArgumentParser) is read by cli.run, not by the fine-tune.
    return FinetuneConfig(**vars(parser.parse_args(argv)))


def _main(argv: list[str]) -> int:
    config = parse_args(argv)  # first: --help and usage errors answer before torch is imported
    missing = [name for name in ("accelerate", "peft" if config.lora else None)
               if name and importlib.util.find_spec(name) is None]
    if missing:  # the package itself needs neither: they come with its `finetune` extra
        raise cli.InputError(f"fine-tuning needs {' and '.join(missing)}: pip install 'hf-rmsnorm[finetune]'")
    # The GPU when there is one (accelerate picks it too), else the kernels in Triton's interpreter.
    cli.select_device("auto")
    from hf_rmsnorm.tools.finetune import finetune

    finetune(config)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the fine-tune on this process; returns the exit status."""
    return cli.run("finetune.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
