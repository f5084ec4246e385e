"""Causal-LM fine-tuning with accelerate, behind ``scripts/finetune.py``.

:func:`finetune` runs the whole job in an order that keeps bad input harmless: everything that can fail on
the user's input (paths, corpus, model loading, tokenisation, packing, patching) happens before training, and
nothing is written until training has finished. ``patch_model`` is applied after loading and before
``accelerator.prepare``, so DDP and FSDP wrap the patched modules.

Patched and unpatched runs with the same seed see the same model, the same LoRA initialisation and the same
batches in the same order, so their per-step losses and final parameters can be compared directly.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..ops import backend
from ..patch import PatchReport, UnsupportedModelError, patch_model
from .finetune_data import ByteTokenizer, FinetuneInputError, corpus_files, pack, read_documents, tokenize
from .loading import load_model

# Learning rates when --lr is not given: common choices for full fine-tuning and for LoRA adapters.
FULL_FINETUNE_LR = 2e-5
LORA_LR = 2e-4
LORA_RANK = 8


@dataclass(frozen=True)
class FinetuneConfig:
    """The command line of ``scripts/finetune.py``; see its ``--help`` for each field."""

    model: str
    output_dir: Path
    data: Path | None = None
    max_steps: int = 100
    batch_size: int = 4
    seq_len: int = 512
    lr: float | None = None
    seed: int = 0
    patch: bool = True
    lora: bool = False
    gradient_checkpointing: bool = False
    metrics_json: Path | None = None

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for a full fine-tune or a LoRA adapter."""
        if self.lr is not None:
            return self.lr
        return LORA_LR if self.lora else FULL_FINETUNE_LR


@dataclass
class TrainResult:
    """Per-step losses (averaged over processes) and wall times of one training run."""

    losses: list[float]
    step_times_s: list[float]
    tokens_per_step: int

    @property
    def tokens_per_s(self) -> float:
        # The first step pays for one-off work (allocator warm-up, kernel compilation): leave it out when
        # there is anything else to measure.
        times = self.step_times_s[1:] or self.step_times_s
        return self.tokens_per_step * len(times) / sum(times)


def finetune(config: FinetuneConfig) -> dict:
    """Runs one fine-tuning job on every process of the current launch; returns the metrics."""
    check_output_paths(config.output_dir, config.metrics_json)
    documents = read_documents(corpus_files(config.data))
    accelerator = make_accelerator()
    accelerator.print(f"hf_rmsnorm: {backend.describe(accelerator.device)}")
    set_seed(config.seed)

    # FSDP shards from CPU; everything else is loaded straight onto its device.
    device = "cpu" if accelerator.distributed_type == DistributedType.FSDP else accelerator.device
    model, tokenizer = load_model(config.model, dtype=torch.float32, device=device, seed=config.seed)
    vocab_size = model.get_input_embeddings().num_embeddings
    if tokenizer is None:
        accelerator.print(f"{config.model} has no tokenizer: training on {ByteTokenizer(vocab_size).describe()}")
    sequences = pack(
        tokenize(documents, tokenizer, vocab_size),
        config.seq_len,
        min_sequences=config.batch_size * accelerator.num_processes,
    )
    accelerator.print(f"corpus: {len(documents)} documents -> {len(sequences)} sequences of {config.seq_len} tokens")

    try:
        report = patch_model(model) if config.patch else None
    except UnsupportedModelError as exc:
        raise FinetuneInputError(str(exc)) from exc
    accelerator.print(report if report is not None else "--no-patch: Hugging Face's own norms")
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.lora:
        model = add_lora(model, config.seed)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    dataloader = make_dataloader(sequences, config.batch_size, config.seed)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    tokens_per_step = config.batch_size * accelerator.num_processes * config.seq_len
    result = train(accelerator, model, optimizer, dataloader, config.max_steps, tokens_per_step)

    save(accelerator, model, tokenizer, config.output_dir)
    metrics = {
        "model": config.model,
        "patched": report is not None,
        "patch": None if report is None else patch_counts(report),
        "lora": config.lora,
        "gradient_checkpointing": config.gradient_checkpointing,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "tokenizer": "byte-level" if tokenizer is None else type(tokenizer).__name__,
        "losses": result.losses,
        "step_times_s": result.step_times_s,
        "tokens_per_s": result.tokens_per_s,
        "peak_memory_bytes": peak_memory_bytes(accelerator.device),
    }
    if config.metrics_json is not None and accelerator.is_main_process:
        write_metrics(config.metrics_json, metrics)
    accelerator.print(f"saved to {config.output_dir}; {result.tokens_per_s:.0f} tokens/s")
    accelerator.end_training()
    return metrics


def make_accelerator() -> Accelerator:
    """The accelerator for this launch, with multi-process CPU runs turned into real DDP over gloo.

    ``accelerate launch --multi_gpu`` on a machine without a GPU starts the processes with torchrun, but
    accelerate sets up distributed CPU training only when asked for the CPU explicitly; otherwise every process
    would silently train alone on all of the data.
    """
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"launched {world_size} processes but accelerate set up {accelerator.num_processes}")
    # accelerate ignores --use_fsdp where it cannot shard (on CPU it quietly runs DDP): say so instead.
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and accelerator.distributed_type != DistributedType.FSDP:
        raise FinetuneInputError(
            f"--use_fsdp asked for, but accelerate set up {accelerator.distributed_type.value}: it runs FSDP only "
            "on GPUs; without one, launch with --multi_gpu (DDP over gloo)"
        )
    return accelerator


def check_output_paths(output_dir: Path, metrics_json: Path | None) -> None:
    """Rejects output paths that cannot be written as the kind of thing they must be."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FinetuneInputError(f"--output-dir {output_dir} is a file, not a directory")
    if metrics_json is not None and metrics_json.is_dir():
        raise FinetuneInputError(f"--metrics-json {metrics_json} is a directory, not a file")


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing of every decoder layer, non-reentrant.

    Non-reentrant checkpointing needs no inputs that require grad, so it also works with LoRA's frozen
    embeddings, and it is the variant DDP and FSDP support.
    """
    # transformers 5.x renamed the method; the old name still works but warns.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def add_lora(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Wraps ``model`` with a PEFT LoRA adapter on every linear layer but the LM head."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise FinetuneInputError("--lora needs the peft package: pip install peft") from err
    # The adapter's random A matrices must not depend on how much randomness loading consumed.
    torch.manual_seed(seed)
    lora_config = LoraConfig(
        task_type="CAUSAL_LM", r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear"
    )
    return get_peft_model(model, lora_config)


def make_dataloader(sequences: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """Shuffled full batches; the seeded generator makes the order the same in every run with this seed."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(sequences, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)


def train(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: DataLoader,
    max_steps: int,
    tokens_per_step: int,
) -> TrainResult:
    """``max_steps`` optimizer steps, cycling through the data; shows loss and tokens/s on the main process.

    ``tokens_per_step`` counts the tokens of all processes, so tokens/s is the throughput of the whole job.
    """
    result = TrainResult(losses=[], step_times_s=[], tokens_per_step=tokens_per_step)
    batches = _cycle(dataloader)
    model.train()
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    with tqdm(total=max_steps, desc="fine-tuning", disable=not accelerator.is_main_process) as bar:
        for _ in range(max_steps):
            input_ids = next(batches)
            start = time.perf_counter()
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # Every process holds the same number of tokens, so the mean of the means is the global mean;
            # .item() also waits for the GPU, which makes the step time honest.
            result.losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
            result.step_times_s.append(time.perf_counter() - start)
            tokens_per_s = tokens_per_step / result.step_times_s[-1]
            bar.set_postfix(loss=f"{result.losses[-1]:.4f}", tok_s=f"{tokens_per_s:.0f}")
            bar.update()
    return result


def _cycle(dataloader: DataLoader) -> Iterator[torch.Tensor]:
    # Each pass re-shuffles from the seeded generator, so later epochs are reproducible too.
    return itertools.chain.from_iterable(itertools.repeat(dataloader))


def save(accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: Path) -> None:
    """``save_pretrained`` of the model (the adapter alone under LoRA) and of the tokenizer, if any.

    The saved files hold only the config and the state dict, which patching does not change, so plain
    transformers loads them without hf_rmsnorm.
    """
    accelerator.wait_for_everyone()
    # A collective under FSDP (it gathers the shards): every process must call it.
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    if tokenizer is not None and accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def patch_counts(report: PatchReport) -> dict[str, int]:
    """How many norms were patched, residual adds fused and modules skipped, for the metrics."""
    return {"norms": len(report.norms), "fused_adds": len(report.fused_adds), "skipped": len(report.skipped)}


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak GPU memory allocated during training on this process; None off the GPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def write_metrics(path: Path, metrics: dict) -> None:
    """Writes ``metrics`` as indented JSON, creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2) + "\n")
