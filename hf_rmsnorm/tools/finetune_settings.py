"""What a fine-tuning run is asked to do: its settings and their per-device defaults.

Kept apart from ``finetune.py`` and free of torch, accelerate and transformers, so ``scripts/finetune.py
--help`` (which shows the defaults) starts in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

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

@dataclass(frozen=True)
class FinetuneConfig:
    """The command line of ``scripts/finetune.py``; see its ``--help`` for each field."""

    model: str
    output_dir: Path
    data: Path | None = None
    # None: the device's default from DEFAULTS, filled in by with_device_defaults once the device is known.
    max_steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    seed: int = 0
    patch: bool = True
    # Timing only: every norm returns its input (norm_free.py); implies no patch.
    norm_free: bool = False
    lora: bool = False
    gradient_checkpointing: bool = False
    fsdp: bool = False
    metrics_json: Path | None = None
    overwrite: bool = False

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
