"""Causal-LM fine-tuning with hf_rmsnorm's patched norms, one process or many through accelerate launch.

launch:
  accelerate launch [accelerate options] scripts/finetune.py --output-dir DIR [options below]
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
    from hf_rmsnorm.tools.finetune_settings import FinetuneConfig

    parser = cli.ArgumentParser(
        prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_options(parser, FinetuneConfig)  # every option is declared once, on its FinetuneConfig field
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
