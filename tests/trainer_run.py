"""Trains tiny models with transformers' ``Trainer`` and TRL's ``SFTTrainer``, unpatched and patched, in one
launch; launched by tests/patch/test_trainers.py as
``accelerate launch --multi_gpu --num_processes 2 tests/trainer_run.py OUT.json``.

Each run of ``RUNS`` builds the same model, patches it (or not) before constructing its trainer, and trains a
few fp32 steps on the same in-memory dataset. Every process counts the norm-kernel calls it made, so
the test can tell that each rank really ran the patched norms. Process 0 writes, per run: the logged losses (the
mean over processes), how the trainer distributed the model, the per-process kernel-call counts, the number of
norms patched and the final norm weights. tests/patch/test_trainers.py also imports the pieces below for its
one-process runs.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable

from hf_rmsnorm.ops import backend

if __name__ == "__main__":  # launched: the kernels run in Triton's interpreter, set up before any is defined
    backend.configure("cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patch_models import VOCAB, tiny_model  # noqa: E402

from hf_rmsnorm import patch_model  # noqa: E402
from hf_rmsnorm.ops.functional import BoundNorm  # noqa: E402
from hf_rmsnorm.patch import qk_runtime  # noqa: E402

# Run name -> (model family, trainer class).
RUNS = {"llama": ("llama", Trainer), "qwen3": ("qwen3", Trainer), "llama-sft": ("llama", SFTTrainer)}
# Per process and step: 2 sequences of 16 tokens; 3 steps at a learning rate that moves every weight.
STEPS, BATCH, SEQ_LEN, LR = 3, 2, 16, 1e-3
KERNEL_ENTRY_POINTS = ("norm", "fused_add_norm", "norm_add")


def count_kernel_calls(set_attr: Callable[[object, str, object], None] = setattr) -> collections.Counter[str]:
    """Counts the calls patched norms make into the kernels, by op (the methods of their class's ``BoundNorm``
    that ``fused.py`` calls); ``set_attr`` installs the counting wrappers (pytest's ``monkeypatch.setattr`` in a
    test process)."""
    counts: collections.Counter[str] = collections.Counter()
    # The norms' entry points, and the fused q/k norms + RoPE launch the attention modules make (``qk_runtime``).
    for owner, name in [(BoundNorm, name) for name in KERNEL_ENTRY_POINTS] + [(qk_runtime, "qk_norm_rope")]:
        op = getattr(owner, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            counts[_name] += 1
            return _op(*args, **kwargs)

        set_attr(owner, name, counted)
    return counts


def token_dataset(n_sequences: int) -> Dataset:
    """Random token ids (labels = inputs) of one length: no padding, no tokenizer."""
    ids = torch.randint(3, VOCAB, (n_sequences, SEQ_LEN), generator=torch.Generator().manual_seed(5)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_args(output_dir: str) -> TrainingArguments:
    """fp32 on the CPU (DDP over gloo when launched with several processes), a loss logged every step."""
    return TrainingArguments(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )


# Short sentences of different lengths: the collator pads, so the loss masks padding.
TEXTS = [f"the {c} fox jumps over {n} lazy dogs" + " and runs" * (n % 3) for c in ("red", "brown", "grey")
         for n in range(1, 6)]
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of TEXTS built in memory, with patch_models' special token ids (pad 0, bos 1,
    eos 2): SFTTrainer needs a real tokenizer, and the tests run offline."""
    words = sorted({word for text in TEXTS for word in text.split()})
    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3, **{word: i + 4 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK)


def sft_trainer(model, output_dir: str) -> SFTTrainer:
    """SFTTrainer with its defaults but fp32 on the CPU (its default is bf16) and ``training_args``' sizes; its
    default gradient checkpointing stays on. ``model``: a model, or a name SFTTrainer loads."""
    args = SFTConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=LR, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        max_length=32,
    )
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                      processing_class=word_tokenizer())


def logged_losses(trainer: Trainer) -> list[float]:
    """The training loss the Trainer logged at each step (its mean over processes)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def train(run: str, patched: bool, counts: collections.Counter[str], output_dir: str) -> dict:
    """One run of ``RUNS``, the model patched (or not) before the trainer is constructed; returns its record."""
    family, trainer_class = RUNS[run]
    model = tiny_model(family, seed=0).train()
    report = patch_model(model) if patched else None
    if trainer_class is SFTTrainer:
        trainer = sft_trainer(model, output_dir)
    else:
        args = training_args(output_dir)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(STEPS * BATCH * args.world_size))
    args = trainer.args
    counts.clear()
    trainer.train()
    calls = [None] * args.world_size
    dist.all_gather_object(calls, dict(counts))
    return {
        "losses": logged_losses(trainer),
        "world_size": args.world_size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "wrapped": type(trainer.model_wrapped).__name__,
        "kernel_calls": calls,
        "patched_norms": None if report is None else len(report.norms),
        "fused_qk": None if report is None else len(report.fused_qk),
        "norm_weights": {
            name: param.detach().flatten().tolist() for name, param in model.named_parameters() if "norm" in name
        },
    }


def main(out: Path) -> None:
    counts = count_kernel_calls()
    runs = {}
    with tempfile.TemporaryDirectory() as output_dir:
        for run in RUNS:
            for patched in (False, True):
                runs[f"{run}-{'patched' if patched else 'unpatched'}"] = train(run, patched, counts, output_dir)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
