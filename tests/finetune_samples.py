"""Whole ``finetune`` metrics of made-up figures, for the tests of what reads them (the GPU suite's summary) and
of their JSON form."""

from __future__ import annotations

import dataclasses

from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics, PatchCounts


def sample_metrics(**changes) -> FinetuneMetrics:
    """A patched one-GPU bf16 run's metrics, with ``changes`` (``FinetuneMetrics`` fields) applied."""
    metrics = FinetuneMetrics(
        model="m", patched=True, norm_free=False,
        patch=PatchCounts(norms=33, fused_adds=32, fused_qk=0, qk_apart=0, skipped=0), lora=False,
        gradient_checkpointing=False, mixed_precision="bf16", distributed_type="NO", num_processes=1, fsdp=None,
        max_steps=3, batch_size=1, seq_len=2048, tokenizer="PreTrainedTokenizerFast", losses=[3.0, 2.0, 1.0],
        final_loss=1.0, step_times_s=[9.0, 0.5, 0.5], tokens_per_s=1000.0, peak_memory_bytes=2**31,
    )
    return dataclasses.replace(metrics, **changes)
