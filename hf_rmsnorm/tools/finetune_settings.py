"""What a fine-tuning run is asked to do: its settings (each one a command-line option of
``scripts/finetune.py``) and their per-device defaults.

Kept apart from ``finetune.py`` and free of torch, accelerate and transformers, so ``scripts/finetune.py
--help`` (which shows all of it) starts in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from . import cli
from .presets import DEFAULT_PRESET

# What a run trains: a causal LM on its next-token loss, or an encoder with a sequence-classification head (with
# NUM_LABELS labels, ``finetune_data.label_documents``).
CAUSAL_LM = "causal-lm"
SEQUENCE_CLASSIFICATION = "sequence-classification"
TASKS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION)
NUM_LABELS = 2

# Learning rates when --lr is not given: common choices for full fine-tuning and for LoRA adapters.
FULL_FINETUNE_LR = 2e-5
LORA_LR = 2e-4
LORA_RANK = 8

# Sizes of a run when the command line leaves them out, per device type (any accelerator other than the CPU
# takes the "cuda" row). On the CPU the kernels run in Triton's interpreter at about a second per step of a tiny
# preset, so the CPU row is a demo of ~10-20 s; the GPU row is a short real fine-tune.
DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"max_steps": 10, "batch_size": 4, "seq_len": 64},
    "cuda": {"max_steps": 100, "batch_size": 4, "seq_len": 512},
}
_CPU, _GPU = DEFAULTS["cpu"], DEFAULTS["cuda"]


# Keyword-only, so a field with a default may come before one without: the fields' order is the options' order
# in --help.
@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """What a ``scripts/finetune.py`` run does: one field per command-line option (``cli.option``)."""

    model: str = cli.option(f"preset, save_pretrained dir or Hub id (default {DEFAULT_PRESET})",
                            default=DEFAULT_PRESET)
    task: str = cli.option(
        f"what to train: {CAUSAL_LM} (next-token loss) or {SEQUENCE_CLASSIFICATION} (an encoder, e.g. --model "
        f"tiny-bert or a BERT-family save_pretrained dir, with a {NUM_LABELS}-label head on labels made from the "
        "corpus: each document's sequences labelled by its position in the corpus, alternately)",
        default=CAUSAL_LM, type=cli.one_of(*TASKS), metavar="{" + ",".join(TASKS) + "}")
    data: Path | None = cli.option(
        "text file or directory of .txt files (default: this project's docs and sources)", default=None, type=Path)
    output_dir: Path = cli.option(
        "where save_pretrained writes the result (required: give each run its own directory)", type=Path,
        required=True)
    overwrite: bool = cli.option(
        "write into a non-empty --output-dir (same-named files are replaced, others kept) and replace "
        "--metrics-json", default=False, flag=True)
    # None: the device's default from DEFAULTS, filled in by with_device_defaults once the device is known.
    max_steps: int | None = cli.option(
        f"optimizer steps (default {_GPU['max_steps']} on GPU, {_CPU['max_steps']} on CPU)", default=None,
        type=cli.at_least(1))
    batch_size: int | None = cli.option(
        f"sequences per process and step (default {_GPU['batch_size']} on GPU, {_CPU['batch_size']} on CPU)",
        default=None, type=cli.at_least(1))
    seq_len: int | None = cli.option(
        f"tokens per sequence (default {_GPU['seq_len']} on GPU, {_CPU['seq_len']} on CPU)", default=None,
        type=cli.at_least(1))
    lr: float | None = cli.option(
        f"AdamW learning rate (default {FULL_FINETUNE_LR}, {LORA_LR} with --lora)", default=None,
        type=cli.positive_float)
    seed: int = cli.option("seed for preset weights, LoRA init and data order", default=0, type=int)
    patch: bool = cli.option("train with Hugging Face's own norms", default=True, flag=True)  # --no-patch
    # Timing only: every norm returns its input (norm_free.py); implies no patch.
    norm_free: bool = cli.option(
        "timing oracle, one process: every norm returns its input (no norm cost at all; the model trained is "
        "meaningless); the most any norm kernel could save is the step time against --no-patch",
        default=False, flag=True)
    lora: bool = cli.option("train a PEFT LoRA adapter and save only the adapter", default=False, flag=True)
    gradient_checkpointing: bool = cli.option("enable HF gradient checkpointing", default=False, flag=True)
    fsdp: bool = cli.option(
        "shard with FSDP2, one unit per decoder layer (by accelerate on GPUs, by torch's fully_shard over gloo on "
        "CPU, which needs 2+ processes); saved unsharded", default=False, flag=True)
    metrics_json: Path | None = cli.option(
        "write losses, tokens/s, peak GPU memory and patch counts here", default=None, type=Path)

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for a full fine-tune or a LoRA adapter."""
        if self.lr is not None:
            return self.lr
        return LORA_LR if self.lora else FULL_FINETUNE_LR


def with_device_defaults(config: FinetuneConfig, device_type: str) -> FinetuneConfig:
    """``config`` with each size it leaves unset (``None``) taken from ``DEFAULTS`` for ``device_type``."""
    defaults = DEFAULTS["cpu" if device_type == "cpu" else "cuda"]
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})
