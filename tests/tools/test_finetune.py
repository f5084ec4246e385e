"""scripts/finetune.py: data pipeline, bad input, and patched-vs-unpatched training runs on tiny presets.

The training runs are real launches (``accelerate launch`` for DDP over gloo, ``python`` for one process) with
the kernels in Triton's interpreter; each pair differs only in ``--no-patch`` and must give the same per-step
losses and final parameters. The LoRA save tests train for two steps in this process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from finetune_samples import sample_metrics
from launching import ROOT, SCRIPTS, accelerate_ddp, accelerate_launch, once_per_session, run_checked
from peft import AutoPeftModelForCausalLM, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM, IBertConfig, IBertModel, MobileBertConfig, MobileBertModel, PreTrainedModel,
)

from hf_rmsnorm import patch_model
from hf_rmsnorm.tools.finetune import (
    BASE_MODEL_DIR,
    TrainResult,
    add_lora,
    base_model_reference,
    check_output_paths,
    enable_gradient_checkpointing,
    write_metrics,
)
from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics, PatchCounts, ShardSizes
from hf_rmsnorm.tools.finetune_settings import DEFAULTS, with_device_defaults
from hf_rmsnorm.tools.finetune_data import (
    ByteTokenizer,
    FinetuneInputError,
    corpus_files,
    label_documents,
    pack,
    project_text_files,
    read_documents,
    tokenize,
)
from hf_rmsnorm.tools.presets import build_preset

SCRIPT = SCRIPTS / "finetune.py"
# Tiny runs: 2 sequences of 32 tokens per process and step, a learning rate large enough to move every weight.
RUN_ARGS = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "4", "--lr", "1e-3", "--seed", "3"]
# Two LoRA steps with a learning rate large enough that the adapter visibly changes the logits.
LORA_ARGS = ["--lora", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--lr", "1e-2", "--seed", "3"]
FP32_LOSS_RTOL = 1e-4
BF16_LOSS_RTOL = 2.0**-8  # half a bf16 ulp
UPDATE_RTOL = 1e-3  # of the norm of a tensor's change during training


def _corpus_text() -> str:
    lines = [f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs; norms fuse with adds." for i in range(60)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(_corpus_text())
    return path


# --- data pipeline ----------------------------------------------------------------------------------------


def test_directory_corpus_is_its_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.txt", "a.txt", "sub/c.txt", "notes.md"):
        (tmp_path / name).write_text(name)
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == ["a.txt", "b.txt", "sub/c.txt"]


def test_default_corpus_is_the_project_itself():
    files = project_text_files()
    assert corpus_files(None) == files
    assert ROOT / "hf_rmsnorm" / "tools" / "finetune_data.py" in files
    assert sum(len(text) for text in read_documents(files)) > 10_000


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", "no such file or directory"),
        (lambda d: d, "holds no .txt files"),
    ],
)
def test_bad_data_paths(tmp_path, make, message):
    with pytest.raises(FinetuneInputError, match=message):
        corpus_files(make(tmp_path))


def test_blank_files_are_an_empty_corpus(tmp_path):
    (tmp_path / "a.txt").write_text(" \n\t\n")
    with pytest.raises(FinetuneInputError, match="empty corpus"):
        read_documents(corpus_files(tmp_path / "a.txt"))


@pytest.mark.parametrize("vocab_size", [512, 256, 100])
def test_byte_tokens_fit_the_vocabulary(vocab_size):
    text = "naïve 🙂 text"
    ids = ByteTokenizer(vocab_size).encode(text)
    assert max(ids) < vocab_size
    assert ids == [b % vocab_size for b in text.encode()]  # the bytes themselves when the vocabulary has room


class _WordTokenizer:
    """The two things ``tokenize`` uses of a Hugging Face tokenizer."""

    eos_token_id = 99

    def __call__(self, texts, add_special_tokens, verbose):
        return {"input_ids": [[len(word) for word in text.split()] for text in texts]}


def test_model_tokenizer_separates_documents_with_eos():
    assert tokenize(["a bb", "ccc"], _WordTokenizer(), vocab_size=128) == [1, 2, 99, 3, 99]


def test_classification_labels_each_documents_rows_alternately():
    """Each document is cut alone (no row spans two documents), its incomplete tail dropped, and all its rows get
    its index modulo the number of labels."""
    rows, labels = label_documents(["a" * 10, "b" * 7, "c" * 3, "d" * 8], None, 256, 4, 2)
    assert rows.tolist() == [[ord("a")] * 4] * 2 + [[ord("b")] * 4] + [[ord("d")] * 4] * 2
    assert labels.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(FinetuneInputError, match="gives 5 sequence"):
        label_documents(["a" * 10, "b" * 7, "c" * 3, "d" * 8], None, 256, 4, 2, min_sequences=6)


def test_pack_cuts_full_rows_and_drops_the_tail():
    rows = pack(list(range(10)), seq_len=4)
    assert rows.dtype == torch.long
    assert rows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "n_tokens, min_sequences, message",
    [(31, 1, "shorter than one sequence"), (64, 4, "one step needs 4")],
)
def test_pack_rejects_too_little_text(n_tokens, min_sequences, message):
    with pytest.raises(FinetuneInputError, match=message):
        pack([0] * n_tokens, seq_len=32, min_sequences=min_sequences)


# --- bad input through the CLI ----------------------------------------------------------------------------


def _load_script():
    spec = importlib.util.spec_from_file_location("finetune_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("missing, extra", [("accelerate", []), ("peft", ["--lora"])])
def test_fine_tuning_without_its_extra_says_which_to_install(missing, extra, monkeypatch, capsys, tmp_path):
    """The package needs neither accelerate nor PEFT; the fine-tuning entry point names the extra that brings
    them, in one line, before any work."""
    script = _load_script()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    assert script.main(["--output-dir", str(tmp_path / "out"), *extra]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"fine-tuning needs {missing}: pip install 'hf-rmsnorm[finetune]'")
    assert not (tmp_path / "out").exists()


def test_sizes_default_per_device_and_help_says_so(capsys):
    script = _load_script()
    config = script.parse_args(["--output-dir", "out", "--seq-len", "32"])
    assert (config.max_steps, config.batch_size, config.seq_len) == (None, None, 32)  # left to the device
    for device_type, defaults in [("cpu", DEFAULTS["cpu"]), ("cuda", DEFAULTS["cuda"]), ("mps", DEFAULTS["cuda"])]:
        resolved = with_device_defaults(config, device_type)
        assert (resolved.max_steps, resolved.batch_size, resolved.seq_len) == (
            defaults["max_steps"], defaults["batch_size"], 32
        ), device_type
    # The CPU runs the kernels in Triton's interpreter (~1 s per step of 256 tokens): its default is a demo.
    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]
    assert cpu["max_steps"] * cpu["batch_size"] * cpu["seq_len"] < gpu["max_steps"] * gpu["batch_size"] * gpu["seq_len"]
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for key, flag in [("max_steps", "--max-steps"), ("batch_size", "--batch-size"), ("seq_len", "--seq-len")]:
        assert f"(default {gpu[key]} on GPU, {cpu[key]} on CPU)" in help_text, flag


def test_overwrite_lets_a_run_reuse_an_earlier_runs_paths(tmp_path):
    (tmp_path / "out").mkdir()
    _write(tmp_path / "out" / "config.json", "{}")
    metrics = _write(tmp_path / "metrics.json", "{}")
    with pytest.raises(FinetuneInputError, match="is not empty"):
        check_output_paths(tmp_path / "out", None)
    check_output_paths(tmp_path / "out", metrics, overwrite=True)
    check_output_paths(tmp_path / "empty", None)  # a directory that does not exist yet is fine


def test_base_model_reference_follows_how_the_model_was_loaded(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert base_model_reference("tiny-qwen3") is None  # random weights: saved beside the adapter
    assert base_model_reference("smollm2-135m") is None  # real weights, but maybe dequantized from a GGUF copy
    assert base_model_reference("ckpt") == base_model_reference("./ckpt") == str(tmp_path.resolve() / "ckpt")
    assert base_model_reference("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def _unsupported_checkpoint(directory: Path) -> Path:
    """A MobileBERT encoder: its norms are ``NoNorm`` (an elementwise affine map, no normalisation), which no kernel
    computes, so patching it is refused."""
    config = MobileBertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, embedding_size=16, intra_bottleneck_size=16)
    MobileBertModel(config).save_pretrained(directory)
    return directory


def _quantized_checkpoint(directory: Path) -> Path:
    """An I-BERT encoder: its embedding is a ``QuantEmbedding`` (no ``num_embeddings``) and its norms
    ``IntLayerNorm``s, whose forward also takes a scaling factor: refused like any unsupported model, not an
    internal error on the way."""
    config = IBertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)
    IBertModel(config).save_pretrained(directory)
    return directory


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# case -> (extra arguments, given a scratch directory and a good corpus; what the error line must say)
BAD_INPUTS = {
    "missing data": (lambda d, corpus: ["--data", str(d / "nope.txt")], "no such file or directory"),
    "empty corpus": (lambda d, corpus: ["--data", str(_write(d / "empty.txt", ""))], "empty corpus"),
    "corpus shorter than one sequence": (
        lambda d, corpus: ["--data", str(_write(d / "short.txt", "too short"))],
        "shorter than one sequence",
    ),
    "output dir is a file": (
        lambda d, corpus: ["--data", str(corpus), "--output-dir", str(_write(d / "f", "x"))],
        "is a file",
    ),
    "output dir of an earlier run": (
        lambda d, corpus: ["--data", str(corpus), "--output-dir", str(_write(d / "config.json", "{}").parent)],
        "is not empty",
    ),
    "metrics file of an earlier run": (
        lambda d, corpus: ["--data", str(corpus), "--metrics-json", str(_write(d / "old.json", "{}"))],
        "already exists",
    ),
    "unsupported model": (
        lambda d, corpus: ["--data", str(corpus), "--task", "sequence-classification",
                           "--model", str(_unsupported_checkpoint(d / "mobilebert"))],
        "has no norm hf_rmsnorm can patch",
    ),
    "quantized model": (
        lambda d, corpus: ["--data", str(corpus), "--task", "sequence-classification",
                           "--model", str(_quantized_checkpoint(d / "ibert"))],
        "IntLayerNorm.forward takes more than the hidden states",
    ),
    "model that does not exist": (
        lambda d, corpus: ["--data", str(corpus), "--model", str(d / "nomodel")],
        "nomodel",
    ),
    "unknown task": (
        lambda d, corpus: ["--data", str(corpus), "--task", "translation"],
        "'translation': use one of causal-lm, sequence-classification",
    ),
    "a causal LM to classify with": (
        lambda d, corpus: ["--data", str(corpus), "--task", "sequence-classification", "--model", "tiny-llama"],
        "tiny-llama is a causal-LM preset: sequence classification takes an encoder preset",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, corpus, capsys, fresh_accelerate_state):
    make_args, message = BAD_INPUTS[case]
    output_dir, metrics = tmp_path / "out", tmp_path / "metrics.json"
    argv = ["--output-dir", str(output_dir), "--metrics-json", str(metrics), *RUN_ARGS, *make_args(tmp_path, corpus)]
    capsys.readouterr()  # drop what making the inputs printed
    assert _load_script().main(argv) == 2
    err = capsys.readouterr().err
    # transformers' loading progress bar may come first; the error is the last line, alone, with no traceback.
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("finetune.py: error: ") and "Traceback" not in err, err
    assert message in errors[0] and err.rstrip().endswith(errors[0])
    assert not output_dir.exists() and not metrics.exists()


# --- the metrics and their file -----------------------------------------------------------------------------


def test_metrics_file_is_the_record_and_reads_back_whole(tmp_path):
    """``write_metrics`` writes ``FinetuneMetrics.to_dict`` (the --metrics-json file: one key per field, in the
    record's order) and ``from_dict`` reads it back, nested records included."""
    metrics = sample_metrics(
        distributed_type="FSDP", num_processes=2,
        patch=PatchCounts(norms=5, fused_adds=4, fused_qk=2, qk_apart=1, skipped=1),
        fsdp=ShardSizes(decoder_layers=2, decoder_params=1000, decoder_params_per_process=[500, 500]),
    )
    path = tmp_path / "out" / "metrics.json"
    write_metrics(path, metrics)
    document = json.loads(path.read_text())
    assert list(document) == [field.name for field in dataclasses.fields(FinetuneMetrics)]
    assert document["fsdp"]["decoder_params_per_process"] == [500, 500] and document["patch"]["skipped"] == 1
    assert FinetuneMetrics.from_dict(document) == metrics
    unpatched = sample_metrics(patched=False, patch=None)
    assert FinetuneMetrics.from_dict(json.loads(json.dumps(unpatched.to_dict()))) == unpatched


def test_throughput_and_step_time_leave_the_first_step_out():
    # The first step's 9 s of one-off work would swamp the steady steps' 0.5 to 0.7 s.
    assert TrainResult(losses=[], step_times_s=[9.0, 0.5, 0.5], tokens_per_step=100).tokens_per_s == 200.0
    assert sample_metrics(step_times_s=[9.0, 0.5, 0.7, 0.6]).median_step_s == 0.6
    # A one-step run has only the first step to measure.
    assert TrainResult(losses=[], step_times_s=[2.0], tokens_per_step=100).tokens_per_s == 50.0
    assert sample_metrics(step_times_s=[2.0]).median_step_s == 2.0


# --- training runs ----------------------------------------------------------------------------------------


def _finetune(launcher: list[str], out: Path, extra: list[str]) -> tuple[FinetuneMetrics, str]:
    """Runs the script into ``out``; returns the metrics it wrote and its stdout (``_finished``)."""
    metrics = out.with_suffix(".json")
    proc = run_checked([*launcher, str(SCRIPT), "--output-dir", str(out), "--metrics-json", str(metrics), *extra], ROOT)
    out.with_suffix(".stdout").write_text(proc.stdout)
    return _finished(out)


def _finished(out: Path) -> tuple[FinetuneMetrics, str]:
    """What ``_finetune``'s run into ``out`` left: its metrics (read back from --metrics-json) and its stdout."""
    metrics = FinetuneMetrics.from_dict(json.loads(out.with_suffix(".json").read_text()))
    return metrics, out.with_suffix(".stdout").read_text()


def _assert_same_losses(patched: FinetuneMetrics, unpatched: FinetuneMetrics, rtol: float = FP32_LOSS_RTOL) -> None:
    assert len(patched.losses) == len(unpatched.losses) == int(RUN_ARGS[RUN_ARGS.index("--max-steps") + 1])
    for step, (a, b) in enumerate(zip(patched.losses, unpatched.losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: patched {a} vs unpatched {b}"


def _assert_same_training(
    a_dir: Path, b_dir: Path, filename: str, initial: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The two saved results made the same training updates from ``initial``, tensor by tensor; returns ``a``.

    Adam divides each update by the gradient's running RMS, so an entry whose gradient is ~0 can move by up
    to the learning rate on rounding noise alone: compare whole tensors (L2), not entries.
    """
    a, b = load_file(a_dir / filename), load_file(b_dir / filename)
    assert a.keys() == b.keys() == initial.keys()
    for name in a:
        diff = torch.linalg.norm(a[name] - b[name]).item()
        update = torch.linalg.norm(b[name] - initial[name]).item()
        assert diff <= UPDATE_RTOL * update, f"{name}: |patched - unpatched| = {diff:.3g}, |update| = {update:.3g}"
    return a


def ddp_tiny_llama(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The folder of the same 2-process CPU DDP fine-tune of tiny-llama, ``patched`` and ``unpatched``, run once
    in a session (the FSDP tests compare their runs with the patched one too)."""

    def fill(out: Path) -> None:
        extra = ["--model", "tiny-llama", "--data", str(corpus), *RUN_ARGS]
        _finetune(accelerate_ddp(), out / "patched", extra)
        _finetune(accelerate_ddp(), out / "unpatched", [*extra, "--no-patch"])

    return once_per_session(tmp_path_factory, "ddp-tiny-llama", fill)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, corpus):
    out = ddp_tiny_llama(tmp_path_factory, corpus)
    return out, _finished(out / "patched"), _finished(out / "unpatched")


@pytest.mark.slow
def test_ddp_patched_run_matches_unpatched(ddp_runs):
    out, (patched, stdout), (unpatched, _) = ddp_runs
    for metrics in (patched, unpatched):
        assert metrics.num_processes == 2 and metrics.distributed_type == "MULTI_CPU"
        assert metrics.tokens_per_s > 0 and metrics.peak_memory_bytes is None
    assert patched.patched and patched.patch.norms > 0 and patched.patch.fused_adds > 0
    assert unpatched.patch is None
    # The report and the notes come from the main process only; the first line says what the run costs.
    assert stdout.count("byte-level tokens") == 1
    assert stdout.splitlines()[0].startswith(
        "fine-tuning tiny-llama: 4 steps x 2 sequences x 32 tokens x 2 processes = 512 tokens on cpu; norms: "
    ), stdout
    _assert_same_losses(patched, unpatched)
    initial = build_preset("tiny-llama", seed=3).state_dict()
    final = _assert_same_training(out / "patched", out / "unpatched", "model.safetensors", initial)
    # Norm weights actually trained: every one moved away from the preset's initial values.
    norm_names = [name for name in final if name.endswith("norm.weight")]
    assert len(norm_names) == 2 * 2 + 1
    for name in norm_names:
        assert not torch.allclose(final[name], initial[name]), f"{name} did not train"


# Patched and unpatched BERT classification losses agree to this relative tolerance (issue 30's goal). Each
# patched LayerNorm reduces its rows in another order than aten's, so its fp32 outputs (and gradients) differ
# from eager's by a few ulps (2^-23 ~ 1.2e-7 relative each); the loss, a smooth function of them, moves by a few
# such ulps, and AdamW at the default learning rate (2e-5) turns a rounding difference in a gradient entry into a
# weight difference of at most that rate, which moves the next losses by well under 1e-6 over a few steps. (At
# 1e-3 that last bound is 50 times looser, so the run uses the default rate.)
CLASSIFICATION_LOSS_RTOL = 1e-6
CLASSIFICATION_ARGS = ["--task", "sequence-classification", "--model", "tiny-bert", "--seq-len", "32",
                       "--batch-size", "2", "--max-steps", "4", "--seed", "3"]


@pytest.fixture(scope="module")
def classification_runs(tmp_path_factory, corpus):
    """The same 2-process CPU DDP sequence-classification fine-tune of tiny-bert, patched and unpatched. The
    corpus has 3 documents (2 labels) for its 8 sequences a step."""
    data = tmp_path_factory.mktemp("classification-corpus")
    for i in range(3):
        (data / f"doc{i}.txt").write_text(_corpus_text().replace("fox", f"fox{i}"))
    out = tmp_path_factory.mktemp("classification")
    extra = ["--data", str(data), *CLASSIFICATION_ARGS]
    patched = _finetune(accelerate_ddp(), out / "patched", extra)
    unpatched = _finetune(accelerate_ddp(), out / "unpatched", [*extra, "--no-patch"])
    return out, patched, unpatched


@pytest.mark.slow
def test_ddp_sequence_classification_matches_unpatched(classification_runs):
    """A BERT-family classifier fine-tuned under accelerate launch (2 processes, DDP over gloo): every LayerNorm
    patched, the per-step losses within 1e-6 relative of the unpatched run's, the head trained and saved."""
    out, (patched, stdout), (unpatched, _) = classification_runs
    for metrics in (patched, unpatched):
        assert metrics.task == "sequence-classification" and metrics.num_processes == 2
        assert metrics.distributed_type == "MULTI_CPU" and len(metrics.losses) == 4
    assert patched.patched and patched.patch.norms == 5 and unpatched.patch is None
    assert stdout.splitlines()[0].startswith("fine-tuning tiny-bert for sequence classification: 4 steps x 2 "
                                             "sequences x 32 tokens x 2 processes"), stdout
    for step, (a, b) in enumerate(zip(patched.losses, unpatched.losses)):
        assert abs(a - b) <= CLASSIFICATION_LOSS_RTOL * abs(b), f"step {step}: patched {a} vs unpatched {b}"
    saved = load_file(out / "patched" / "model.safetensors")
    initial = build_preset("tiny-bert", seed=3, num_labels=2).state_dict()
    assert saved.keys() == initial.keys() and "classifier.weight" in saved
    for name in ("classifier.weight", "bert.encoder.layer.0.output.LayerNorm.weight"):
        assert not torch.equal(saved[name], initial[name]), f"{name} did not train"


@pytest.mark.slow
def test_saved_checkpoint_loads_without_hf_rmsnorm(ddp_runs, tmp_path):
    out, _, _ = ddp_runs
    check = (
        "import json, sys, torch\n"
        "sys.modules['hf_rmsnorm'] = None  # any import of it now fails, as if it were not installed\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model, info = AutoModelForCausalLM.from_pretrained({str(out / 'patched')!r}, output_loading_info=True)\n"
        "logits = model(torch.arange(8)[None]).logits\n"
        "print(json.dumps({'info': {k: list(v) for k, v in info.items()}, 'finite': bool(logits.isfinite().all()),\n"
        "    'norms': sorted({type(m).__name__ for m in model.modules() if 'Norm' in type(m).__name__}),\n"
        "    'modules': sorted(n for n in sys.modules if n.startswith('hf_rmsnorm') and sys.modules[n])}))\n"
    )
    result = json.loads(run_checked([sys.executable, "-c", check], tmp_path).stdout.strip().splitlines()[-1])
    assert all(not v for v in result["info"].values()), result["info"]  # no missing or unexpected weights
    assert result["finite"] and result["norms"] == ["LlamaRMSNorm"] and result["modules"] == []


@pytest.mark.slow
def test_lora_with_gradient_checkpointing_matches_unpatched(tmp_path, corpus):
    extra = ["--model", "tiny-qwen3", "--data", str(corpus), "--lora", "--gradient-checkpointing", *RUN_ARGS]
    patched, stdout = _finetune([sys.executable], tmp_path / "patched", extra)
    unpatched, _ = _finetune([sys.executable], tmp_path / "unpatched", [*extra, "--no-patch"])
    assert patched.num_processes == 1 and patched.lora and patched.gradient_checkpointing
    assert patched.patch.norms > 0
    # Every attention runs its q/k norms and RoPE as one launch, LoRA on the projections or not: the summary and
    # the metrics count them.
    layers = build_preset("tiny-qwen3").config.num_hidden_layers
    assert (patched.patch.fused_qk, patched.patch.qk_apart) == (layers, 0)
    assert f"; q/k norms fused with the RoPE in {layers} attention modules (0 left apart)" in stdout, stdout
    _assert_same_losses(patched, unpatched)
    # The adapter the script started from: the same seed gives the same LoRA initialisation.
    initial = get_peft_model_state_dict(add_lora(build_preset("tiny-qwen3", seed=3), seed=3))
    adapter = _assert_same_training(tmp_path / "patched", tmp_path / "unpatched", "adapter_model.safetensors", initial)
    assert adapter and all("lora_" in name for name in adapter)
    assert not (tmp_path / "patched" / "model.safetensors").exists()


@pytest.mark.slow
def test_bf16_autocast_matches_unpatched_within_bf16_noise(tmp_path, corpus):
    # Under autocast the kernels meet bf16 activations with fp32 weights and residuals, as under GPU bf16.
    launcher = [*accelerate_launch(), "--cpu", "--num_processes", "1", "--mixed_precision", "bf16"]
    extra = ["--model", "tiny-mistral", "--data", str(corpus), *RUN_ARGS]
    patched, _ = _finetune(launcher, tmp_path / "patched", extra)
    unpatched, _ = _finetune(launcher, tmp_path / "unpatched", [*extra, "--no-patch"])
    assert patched.mixed_precision == "bf16" and patched.patch.norms > 0
    _assert_same_losses(patched, unpatched, rtol=BF16_LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_norm_weight_gradients_match_unpatched(gradient_checkpointing):
    batch = pack(ByteTokenizer(512).encode(_corpus_text()), seq_len=32)[:2]
    grads = []
    for patch in (True, False):
        model = build_preset("tiny-qwen3", seed=1).train()
        if patch:
            patch_model(model)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if n.endswith("norm.weight")})
    patched, unpatched = grads
    assert patched.keys() == unpatched.keys() and len(patched) == 2 * 4 + 1  # q/k norms per layer too
    for name, grad in unpatched.items():
        assert grad is not None and grad.abs().sum() > 0
        torch.testing.assert_close(patched[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# --- LoRA adapters load on their own ------------------------------------------------------------------------


def _with_trained_adapter(base: PreTrainedModel, output_dir: Path) -> torch.nn.Module:
    """``base`` with the adapter the run saved: the fine-tuned model, rebuilt without the run's base copy."""
    model = add_lora(base, seed=0)  # the initialisation is overwritten by the trained weights
    set_peft_model_state_dict(model, load_file(output_dir / "adapter_model.safetensors"))
    return model.eval()


def _assert_adapter_loads_alone(output_dir: Path, base: PreTrainedModel) -> None:
    """``AutoPeftModelForCausalLM.from_pretrained(output_dir)`` gives the fine-tuned model's logits, which the
    trained adapter moved away from ``base``'s."""
    tokens = torch.arange(3, 35)[None]
    with torch.no_grad():
        base_logits = base.eval()(tokens).logits
        expected = _with_trained_adapter(base, output_dir)(tokens).logits
        loaded = AutoPeftModelForCausalLM.from_pretrained(output_dir).eval()(tokens).logits
    torch.testing.assert_close(loaded, expected)
    assert (expected - base_logits).abs().max() > 0.1  # the adapter was trained and is applied


@pytest.mark.slow
def test_lora_adapter_of_a_preset_loads_with_its_saved_base(tmp_path, corpus, monkeypatch, fresh_accelerate_state):
    monkeypatch.chdir(tmp_path)  # a relative --output-dir: the adapter must still record an absolute path
    argv = ["--model", "tiny-qwen3", "--data", str(corpus), "--output-dir", "out", *LORA_ARGS]
    assert _load_script().main(argv) == 0
    out = tmp_path / "out"
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((out / BASE_MODEL_DIR).resolve())
    # The saved base is the preset itself, tied embeddings included.
    preset = build_preset("tiny-qwen3", seed=3)
    saved = AutoModelForCausalLM.from_pretrained(out / BASE_MODEL_DIR).state_dict()
    assert saved.keys() == preset.state_dict().keys()
    assert all(torch.equal(saved[name], tensor) for name, tensor in preset.state_dict().items())
    monkeypatch.chdir(corpus.parent)  # loads from anywhere
    _assert_adapter_loads_alone(out, preset)


@pytest.mark.slow
def test_lora_adapter_of_a_saved_model_names_its_directory(tmp_path, corpus, monkeypatch, fresh_accelerate_state):
    build_preset("tiny-llama", seed=5).save_pretrained(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "ckpt", "--data", str(corpus), "--output-dir", str(tmp_path / "out"), *LORA_ARGS]
    assert _load_script().main(argv) == 0
    adapter_config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "ckpt").resolve())
    assert not (tmp_path / "out" / BASE_MODEL_DIR).exists()  # the directory itself is the base
    monkeypatch.chdir(corpus.parent)
    _assert_adapter_loads_alone(tmp_path / "out", build_preset("tiny-llama", seed=5))
