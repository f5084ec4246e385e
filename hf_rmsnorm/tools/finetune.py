"""Fine-tuning with accelerate, behind ``scripts/finetune.py``: a causal LM on its next-token loss, or (``--task
sequence-classification``) an encoder with a sequence-classification head (``finetune_data.label_documents``).

:func:`finetune` runs the whole job in an order that keeps bad input harmless: everything that can fail on
the user's input (paths, corpus, model loading, tokenisation, packing, patching) happens before training, and
nothing is written until training has finished. ``patch_model`` is applied after loading and before
``accelerator.prepare``, so DDP and FSDP wrap the patched modules. With ``--fsdp`` the model is sharded with FSDP2
(``finetune_fsdp``: by accelerate on GPUs, by torch's ``fully_shard`` on CPU) and saved unsharded.

Patched and unpatched runs with the same seed see the same model, the same LoRA initialisation and the same
batches in the same order, so their per-step losses and final parameters can be compared directly.

The sizes of a run (steps, batch, sequence length) default per device (``finetune_settings.DEFAULTS``): on the
CPU the kernels run in Triton's interpreter, so a CPU run defaults to a demo that finishes in seconds. A LoRA
run saves only the adapter, and its ``adapter_config.json`` names a base model that loads on its own
(``base_model_reference``).
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
from ..patch import PatchReport, UnsupportedModelError, patch_model, unpatch_model
from . import finetune_fsdp
from .finetune_settings import (
    LORA_RANK,
    NUM_LABELS,
    SEQUENCE_CLASSIFICATION,
    FinetuneConfig,
    with_device_defaults,
)
from .finetune_data import (
    ByteTokenizer,
    FinetuneInputError,
    corpus_files,
    label_documents,
    pack,
    read_documents,
    tokenize,
)
from .finetune_metrics import FinetuneMetrics, PatchCounts, steady_step_times
from .loading import load_classifier, load_model, looks_like_path
from .norm_free import ORACLE_NOTE, fused_ropes, norm_free
from .presets import preset_names

# Where a LoRA run from a preset saves the base model, inside --output-dir: a preset's weights cannot be loaded
# by name, so the adapter needs a copy to point at.
BASE_MODEL_DIR = "base_model"


@dataclass
class TrainResult:
    """Per-step losses (averaged over processes), wall times and peak GPU memory of one training run."""

    losses: list[float]
    step_times_s: list[float]
    tokens_per_step: int
    # Read when training ends, before the evaluation and the save (which gathers the full model) add theirs.
    peak_memory_bytes: int | None = None

    @property
    def tokens_per_s(self) -> float:
        times = steady_step_times(self.step_times_s)
        return self.tokens_per_step * len(times) / sum(times)


def describe_run(config: FinetuneConfig, accelerator: Accelerator) -> str:
    """The line printed first: how much work the run is and what runs the norms, so its cost is plain."""
    n = accelerator.num_processes
    tokens = config.max_steps * config.batch_size * n * config.seq_len
    processes = f"{n} process{'es' if n > 1 else ''}"
    precision = "" if accelerator.mixed_precision == "no" else f", {accelerator.mixed_precision} mixed precision"
    sharding = f", FSDP2 by {'accelerate' if accelerate_shards(accelerator) else 'torch fully_shard'}"
    if config.norm_free:
        norms = f"none ({ORACLE_NOTE})"
    else:
        norms = backend.describe(accelerator.device) if config.patch else "Hugging Face's own (--no-patch)"
    task = " for sequence classification" if config.task == SEQUENCE_CLASSIFICATION else ""
    return (
        f"fine-tuning {config.model}{task}{' with LoRA' if config.lora else ''}: {config.max_steps} steps x "
        f"{config.batch_size} sequences x {config.seq_len} tokens x {processes} = {tokens} tokens "
        f"on {accelerator.device.type}{precision}{sharding if config.fsdp else ''}; norms: {norms}"
    )


def finetune(config: FinetuneConfig) -> FinetuneMetrics:
    """Runs one fine-tuning job on every process of the current launch; returns the metrics."""
    check_output_paths(config.output_dir, config.metrics_json, config.overwrite)
    documents = read_documents(corpus_files(config.data))
    accelerator = make_accelerator(config.fsdp)
    config = with_device_defaults(config, accelerator.device.type)
    accelerator.print(describe_run(config, accelerator))
    set_seed(config.seed)

    classifying = config.task == SEQUENCE_CLASSIFICATION
    if classifying and config.fsdp:
        raise FinetuneInputError("--fsdp shards a causal LM's decoder layers: run --task sequence-classification "
                                 "without it (DDP)")
    # accelerate's FSDP shards from CPU; everything else is loaded straight onto its device.
    device = "cpu" if accelerate_shards(accelerator) else accelerator.device
    if classifying:
        model, tokenizer = load_classifier(config.model, num_labels=NUM_LABELS, dtype=torch.float32, device=device,
                                           seed=config.seed)
    else:
        model, tokenizer = load_model(config.model, dtype=torch.float32, device=device, seed=config.seed)
    # The embedding matrix's rows, not ``num_embeddings``, which quantized embeddings (I-BERT's) do not have.
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if tokenizer is None:
        accelerator.print(f"{config.model} has no tokenizer: training on {ByteTokenizer(vocab_size).describe()}")
    min_sequences = config.batch_size * accelerator.num_processes
    if classifying:
        dataset = torch.utils.data.TensorDataset(*label_documents(
            documents, tokenizer, vocab_size, config.seq_len, NUM_LABELS, min_sequences))
    else:
        dataset = pack(tokenize(documents, tokenizer, vocab_size), config.seq_len, min_sequences=min_sequences)
    accelerator.print(f"corpus: {len(documents)} documents -> {len(dataset)} sequences of {config.seq_len} tokens"
                      + (f", {NUM_LABELS} labels" if classifying else ""))

    if config.norm_free and accelerator.num_processes > 1:
        # The stand-ins leave the norms' weights without gradients, which DDP and FSDP refuse.
        raise FinetuneInputError("--norm-free is a one-process timing oracle: launch it with --num_processes 1")
    try:
        report = patch_model(model) if config.patch and not config.norm_free else None
        norm_names, ropes = _oracle_targets(model) if config.norm_free else ([], [])
    except UnsupportedModelError as exc:
        raise FinetuneInputError(str(exc)) from exc
    if config.norm_free:
        # Installed for the rest of the run (a process of its own): the weights it trains mean nothing.
        norm_free(model, norm_names, ropes).__enter__()
        accelerator.print(f"--norm-free: {ORACLE_NOTE}; {len(norm_names)} norms")
    else:
        accelerator.print(report if report is not None else "--no-patch: Hugging Face's own norms")
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.lora:
        model = add_lora(model, config.seed, "SEQ_CLS" if classifying else "CAUSAL_LM")

    dataloader = make_dataloader(dataset, config.batch_size, config.seed)
    model, optimizer, dataloader = prepare(accelerator, model, dataloader, config)
    tokens_per_step = config.batch_size * accelerator.num_processes * config.seq_len
    result = train(accelerator, model, optimizer, dataloader, config.max_steps, tokens_per_step)
    final_loss = evaluate(model, [t.to(accelerator.device) for t in _as_tuple(dataset[:1])])

    metrics = FinetuneMetrics(
        model=config.model,
        patched=report is not None,
        norm_free=config.norm_free,
        patch=None if report is None else patch_counts(report),
        lora=config.lora,
        gradient_checkpointing=config.gradient_checkpointing,
        mixed_precision=accelerator.mixed_precision,
        distributed_type=accelerator.distributed_type.value,
        num_processes=accelerator.num_processes,
        fsdp=finetune_fsdp.shard_sizes(accelerator, model) if config.fsdp else None,
        max_steps=config.max_steps,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        tokenizer="byte-level" if tokenizer is None else type(tokenizer).__name__,
        losses=result.losses,
        final_loss=final_loss,
        step_times_s=result.step_times_s,
        tokens_per_s=result.tokens_per_s,
        peak_memory_bytes=result.peak_memory_bytes,
        task=config.task,
    )
    # Written before the save, which measures nothing (and writes the full model: seconds at the 1B shape), so a
    # run stopped by a time limit while saving (the GPU suite's training sections) still leaves its figures.
    if config.metrics_json is not None and accelerator.is_main_process:
        write_metrics(config.metrics_json, metrics)
    base_model = save(accelerator, model, tokenizer, config)
    adapter = "" if base_model is None else f" (LoRA adapter on base model {base_model})"
    accelerator.print(f"saved to {config.output_dir}{adapter}; {result.tokens_per_s:.0f} tokens/s")
    # Teardown in order, every process together: first the model, optimizer and dataloader (and their reference
    # cycles), which hold the process group through FSDP2's device mesh, then the group. A group left to die during
    # interpreter exit takes gloo's worker threads down with it, and a CPU FSDP2 rank was seen to abort there now
    # and then ("terminate called without an active exception") after a run that had saved everything.
    accelerator.wait_for_everyone()
    del model, optimizer, dataloader
    accelerator.free_memory()
    accelerator.end_training()
    return metrics


def _oracle_targets(model) -> tuple[list[str], list[tuple[dict, str]]]:
    """What the norm-free oracle replaces: the norms patch_model would patch, and the RoPE functions it would fuse
    with q/k norms (``norm_free.fused_ropes``: read from the model patched for the moment, then unpatched)."""
    report = patch_model(model)
    try:
        return report.norms, fused_ropes(model)
    finally:
        unpatch_model(model)


def make_accelerator(fsdp: bool) -> Accelerator:
    """The accelerator for this launch: multi-process CPU runs as real DDP over gloo, ``fsdp`` as FSDP2.

    ``accelerate launch --multi_gpu`` on a machine without a GPU starts the processes with torchrun, but
    accelerate sets up distributed CPU training only when asked for the CPU explicitly; otherwise every process
    would silently train alone on all of the data. On GPUs ``fsdp`` hands accelerate an FSDP2 plugin; on CPU
    accelerate cannot shard, and ``prepare`` shards the model itself.
    """
    # accelerate's own FSDP flags would configure a second, different sharding (and on CPU quietly run DDP).
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        raise FinetuneInputError(
            "accelerate launch --use_fsdp (or an accelerate config with FSDP) is not supported: launch without it "
            "and pass --fsdp to finetune.py, which sets up FSDP2 itself"
        )
    gpu = torch.cuda.is_available()
    if fsdp and gpu:
        finetune_fsdp.use_one_process_group()
    accelerator = Accelerator(cpu=not gpu, fsdp_plugin=finetune_fsdp.accelerate_plugin() if fsdp and gpu else None)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"launched {world_size} processes but accelerate set up {accelerator.num_processes}")
    if fsdp and not gpu and accelerator.num_processes < 2:
        raise FinetuneInputError(
            "--fsdp on CPU needs at least 2 processes (accelerate launch --multi_gpu --num_processes N): one "
            "process has nothing to shard"
        )
    return accelerator


def accelerate_shards(accelerator: Accelerator) -> bool:
    """Whether accelerate shards the model (FSDP2 on GPUs); otherwise ``--fsdp`` runs are sharded by ``prepare``."""
    return accelerator.distributed_type == DistributedType.FSDP


def check_output_paths(output_dir: Path, metrics_json: Path | None, overwrite: bool = False) -> None:
    """Rejects output paths that cannot be written as the kind of thing they must be, and, unless
    ``overwrite``, output an earlier run left: a second run into the same folder would silently replace the
    first one's result, or mix its files with them (a full model beside an adapter)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FinetuneInputError(f"--output-dir {output_dir} is a file, not a directory")
    if metrics_json is not None and metrics_json.is_dir():
        raise FinetuneInputError(f"--metrics-json {metrics_json} is a directory, not a file")
    if overwrite:
        return
    if output_dir.is_dir() and any(output_dir.iterdir()):
        raise FinetuneInputError(
            f"--output-dir {output_dir} is not empty (an earlier run?): give each run its own directory, or pass "
            "--overwrite to write into it"
        )
    if metrics_json is not None and metrics_json.exists():
        raise FinetuneInputError(
            f"--metrics-json {metrics_json} already exists: give each run its own file, or pass --overwrite"
        )


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing of every decoder layer, non-reentrant.

    Non-reentrant checkpointing needs no inputs that require grad, so it also works with LoRA's frozen
    embeddings, and it is the variant DDP and FSDP support.
    """
    # transformers 5.x renamed the method; the old name still works but warns.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def add_lora(model: torch.nn.Module, seed: int, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """Wraps ``model`` with a PEFT LoRA adapter on every linear layer but the output head (PEFT's ``task_type``:
    ``"SEQ_CLS"`` also trains a classification head in full)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise FinetuneInputError("--lora needs the peft package: pip install peft") from err
    # The adapter's random A matrices must not depend on how much randomness loading consumed.
    torch.manual_seed(seed)
    lora_config = LoraConfig(
        task_type=task_type, r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear"
    )
    return get_peft_model(model, lora_config)


def prepare(
    accelerator: Accelerator, model: torch.nn.Module, dataloader: DataLoader, config: FinetuneConfig
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    """The model (wrapped for DDP, or sharded with FSDP2 under ``--fsdp``), its AdamW optimizer over the
    trainable parameters, and the dataloader sharded over the processes."""
    if config.fsdp and not accelerate_shards(accelerator):
        # accelerate would wrap the model in DDP: shard it here instead and prepare only the rest. The optimizer
        # is made after sharding, over the DTensor shards.
        model = finetune_fsdp.shard(model, accelerator.mixed_precision)
        optimizer, dataloader = accelerator.prepare(make_optimizer(model, config.learning_rate), dataloader)
        return model, optimizer, dataloader
    # accelerate swaps the optimizer over to the parameters it wraps or shards.
    model, optimizer, dataloader = accelerator.prepare(model, make_optimizer(model, config.learning_rate), dataloader)
    if config.fsdp:
        finetune_fsdp.check_sharded(model)
    return model, optimizer, dataloader


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (LoRA freezes the base model's)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def make_dataloader(dataset: torch.utils.data.Dataset, batch_size: int, seed: int) -> DataLoader:
    """Shuffled full batches (of sequences, or of ``(sequences, labels)``); the seeded generator makes the order the
    same in every run with this seed."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)


def _as_tuple(batch: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A batch as ``(input_ids,)`` (a causal LM's) or ``(input_ids, labels)`` (sequence classification's)."""
    return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)


def model_inputs(batch: tuple[torch.Tensor, ...]) -> dict[str, object]:
    """The forward's arguments for a batch (``_as_tuple``): the next-token loss of the ids themselves, or the
    classification loss of their labels."""
    if len(batch) == 1:
        return {"input_ids": batch[0], "labels": batch[0], "use_cache": False}
    input_ids, labels = batch
    return {"input_ids": input_ids, "labels": labels}


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
            batch = _as_tuple(next(batches))
            start = time.perf_counter()
            loss = model(**model_inputs(batch)).loss
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
    result.peak_memory_bytes = peak_memory_bytes(accelerator.device)
    return result


@torch.no_grad()
def evaluate(model: torch.nn.Module, batch: list[torch.Tensor] | torch.Tensor) -> float:
    """The trained model's mean loss on ``batch`` (``_as_tuple``; the same on every process: under FSDP all of them
    must run the forward), in eval mode; recorded so that a reloaded checkpoint can be checked against it."""
    model.eval()
    loss = model(**model_inputs(_as_tuple(batch))).loss.item()
    model.train()
    return loss


def _cycle(dataloader: DataLoader) -> Iterator[torch.Tensor]:
    # Each pass re-shuffles from the seeded generator, so later epochs are reproducible too.
    return itertools.chain.from_iterable(itertools.repeat(dataloader))


def save(accelerator: Accelerator, model: torch.nn.Module, tokenizer, config: FinetuneConfig) -> str | None:
    """``save_pretrained`` of the model (the adapter alone under LoRA) and of the tokenizer, if any, into
    ``config.output_dir``, by the main process; returns the LoRA adapter's base model (None without LoRA).

    The saved files hold only the config and the state dict, which patching does not change, so plain
    transformers loads them without hf_rmsnorm. Under LoRA, ``adapter_config.json`` names the base model so that
    ``peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)`` works on its own: see ``base_model_reference``;
    a base model with no such name (a preset) is saved, with the tokenizer, to ``output_dir/base_model``.
    """
    accelerator.wait_for_everyone()
    # A collective under FSDP (it gathers the shards onto the main process): every process must call it.
    state_dict = finetune_fsdp.full_state_dict(model) if config.fsdp else accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    # (model, directory, state dict) for each save_pretrained, the base model first: PEFT reads its config
    # when it saves the adapter.
    saves = []
    base_model = None
    if config.lora:
        base_model = base_model_reference(config.model)
        if base_model is None:
            base_dir = config.output_dir / BASE_MODEL_DIR
            saves.append((unwrapped.get_base_model(), base_dir, base_model_state_dict(state_dict)))
            base_model = str(base_dir.resolve())
        unwrapped.peft_config[unwrapped.active_adapter].base_model_name_or_path = base_model
    saves.append((unwrapped, config.output_dir, state_dict))
    if accelerator.is_main_process:
        for saved_model, directory, weights in saves:
            saved_model.save_pretrained(directory, state_dict=weights)
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
    accelerator.wait_for_everyone()
    return base_model


def base_model_reference(name_or_path: str) -> str | None:
    """What a LoRA adapter's ``base_model_name_or_path`` says for the ``--model`` it was trained on.

    Follows ``load_model``'s reading of the name: a preset gives None, and ``save`` stores a copy of the base
    model (a random preset's weights are built, not loaded, and a real-weights preset may come from a
    dequantized GGUF file rather than its Hub id: no name loads exactly the weights trained on); a directory
    gives its absolute path (the adapter then loads from any working directory); anything else is a Hub id,
    recorded as given (transformers finds it in the cache or downloads it).
    """
    if name_or_path in preset_names():
        return None
    if looks_like_path(name_or_path):
        return str(Path(name_or_path).expanduser().resolve())
    return name_or_path


def base_model_state_dict(peft_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights out of a PEFT LoRA model's full state dict, under the base model's own names.

    PEFT holds the base model under ``base_model.model.`` and moves each layer it wraps to
    ``<layer>.base_layer``, beside the adapter's ``<layer>.lora_A``/``lora_B``; undoing both gives the state
    dict the model had before ``get_peft_model``. LoRA freezes the base weights, so these are the loaded ones.
    """
    return {
        key.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
        for key, tensor in peft_state_dict.items()
        if ".lora_" not in key
    }


def patch_counts(report: PatchReport) -> PatchCounts:
    """How many norms were patched, residual adds and q/k norms + RoPE fused and modules skipped, for the
    metrics."""
    return PatchCounts(norms=len(report.norms), fused_adds=len(report.fused_adds), fused_qk=len(report.fused_qk),
                       qk_apart=len(report.qk_apart), skipped=len(report.skipped))


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak GPU memory allocated during training on this process; None off the GPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def write_metrics(path: Path, metrics: FinetuneMetrics) -> None:
    """Writes ``metrics`` as indented JSON (``FinetuneMetrics.to_dict``), creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics.to_dict(), indent=2) + "\n")
