"""The metrics of a ``finetune`` run as typed records, and their JSON form (``scripts/finetune.py --metrics-json``).

``finetune.finetune`` returns a ``FinetuneMetrics``, ``finetune.write_metrics`` writes its ``to_dict`` and
``from_dict`` reads one back (the GPU suite's summary reads its training sections so). The fields are the file's
keys, in the file's order, so its shape is written once: here.

Plain data, no torch or accelerate: the GPU suite's summary, which runs without them, reads the records too.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .records import Record


def steady_step_times(step_times_s: list[float]) -> list[float]:
    """The step times that measure steady training: all but the first, which pays for one-off work (allocator
    warm-up, kernel compilation), unless there is nothing else to measure."""
    return step_times_s[1:] or step_times_s


@dataclass
class PatchCounts(Record):
    """What ``patch_model`` changed, counted."""

    norms: int
    fused_adds: int
    fused_qk: int  # attention modules whose q/k norms and RoPE run as one launch (``PatchReport.fused_qk``)
    qk_apart: int  # attention modules whose q/k norms and RoPE stay apart (``PatchReport.qk_apart``), in ``skipped``
    skipped: int


@dataclass
class ShardSizes(Record):
    """How ``--fsdp`` spread the decoder parameters over the processes (``finetune_fsdp.shard_sizes``)."""

    decoder_layers: int
    decoder_params: int  # elements of all decoder layers
    decoder_params_per_process: list[int]  # elements each process holds, by rank


@dataclass
class FinetuneMetrics(Record):
    """What a fine-tuning run was (its settings after the device's defaults) and what it measured."""

    model: str  # --model as given
    patched: bool
    norm_free: bool  # the timing oracle ran: norms that return their input (``norm_free.ORACLE_NOTE``)
    patch: PatchCounts | None  # None when nothing was patched
    lora: bool
    gradient_checkpointing: bool
    mixed_precision: str  # accelerate's: "no", "bf16", ...
    distributed_type: str  # accelerate's ``DistributedType`` value: "NO", "MULTI_CPU", "FSDP", ...
    num_processes: int
    fsdp: ShardSizes | None  # None without --fsdp
    max_steps: int
    batch_size: int  # sequences per process and step
    seq_len: int
    tokenizer: str  # the tokenizer's class name, or "byte-level" for a checkpoint without one
    losses: list[float]  # per step, averaged over the processes
    final_loss: float  # the trained model's loss on the first sequence: a reloaded checkpoint must give it too
    step_times_s: list[float]
    tokens_per_s: float  # of the whole job (every process's tokens) over ``steady_step_times``
    peak_memory_bytes: int | None  # the main process's peak GPU memory during training; None off the GPU
    task: str = "causal-lm"  # ``finetune_settings.TASKS``; absent from files written before it existed

    @property
    def median_step_s(self) -> float:
        """The median of ``steady_step_times``: the run's step time, robust to a stray slow step."""
        return statistics.median(steady_step_times(self.step_times_s))
