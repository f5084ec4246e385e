"""scripts/finetune.py --fsdp on CPU: FSDP2 over gloo (torch's fully_shard, kernels in Triton's interpreter).

Real 2-process launches of tiny presets: sharded runs train exactly as DDP does, patched or not, with gradient
checkpointing and LoRA too, and as 2 "machines" of one process on this host; the saved checkpoint is unsharded.
The fast tests check which modules become FSDP units (on CPU and in accelerate's GPU policy) and the refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from peft import AutoPeftModelForCausalLM, get_peft_model_state_dict
from safetensors.torch import load_file
from launching import (
    LAUNCH_TIMEOUT_S, ROOT, accelerate_ddp, accelerate_launch, free_port, once_per_session, run_checked,
)
from test_finetune import (  # the same folder: pytest puts it on sys.path
    BF16_LOSS_RTOL,
    RUN_ARGS,
    SCRIPT,
    _assert_same_losses,
    _assert_same_training,
    _finetune,
    _finished,
    _load_script,
    corpus,  # noqa: F401  (a fixture)
    ddp_tiny_llama,
)

from hf_rmsnorm import patch_model
from hf_rmsnorm.tools.finetune import add_lora
from hf_rmsnorm.patch.fused import original_class
from hf_rmsnorm.tools.finetune_fsdp import accelerate_plugin, check_sharded, decoder_layers
from hf_rmsnorm.tools.finetune_metrics import FinetuneMetrics
from hf_rmsnorm.tools.presets import build_preset

FSDP = ["--fsdp"]
# fp32 noise: the same sums as DDP's in another order (reduce-scatter instead of all-reduce), or patched.
FSDP_LOSS_RTOL = 1e-5


# --- which modules are sharded, and refusals ----------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_decoder_layers_are_the_units_on_cpu_and_in_accelerates_gpu_policy(lora):
    # patch_model gives every layer a same-named subclass; a PEFT model answers for the model it wraps.
    model = build_preset("tiny-qwen3", seed=0)
    patch_model(model)
    if lora:
        model = add_lora(model, seed=0)
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["Qwen3DecoderLayer"] * 2
    # What accelerate wraps on GPUs: the first module of that class name, then isinstance of it.
    policy = fsdp2_prepare_auto_wrap_policy(accelerate_plugin(), model)
    assert [m for m in model.modules() if policy(m)] == layers


def test_a_layer_accelerates_policy_would_miss_is_an_error():
    # accelerate wraps instances of the first layer's class: an unpatched layer beside patched ones is missed
    # (the GPU path checks after prepare; on CPU decoder_layers finds every layer by name).
    model = build_preset("tiny-llama", seed=0)
    patch_model(model)
    unpatched = model.model.layers[1]
    unpatched.__class__ = original_class(unpatched)
    policy = fsdp2_prepare_auto_wrap_policy(accelerate_plugin(), model)
    assert [m for m in model.modules() if policy(m)] == [model.model.layers[0]]
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(RuntimeError, match=r"2 decoder layer\(s\) \(LlamaDecoderLayer\) were not made FSDP units"):
        check_sharded(model)  # nothing is sharded here


def _assert_refused(argv: list[str], message: str, capsys, out: Path) -> None:
    assert _load_script().main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("finetune.py: error: ") and "Traceback" not in err, err
    assert message in errors[0]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="one GPU process is a group of one")
def test_fsdp_with_one_cpu_process_is_refused(tmp_path, corpus, capsys, fresh_accelerate_state):
    argv = ["--output-dir", str(tmp_path / "out"), "--data", str(corpus), *RUN_ARGS, *FSDP]
    _assert_refused(argv, "--fsdp on CPU needs at least 2 processes", capsys, tmp_path / "out")


@pytest.mark.parametrize("fsdp", [[], FSDP])
def test_accelerates_own_fsdp_is_refused(
    fsdp, tmp_path, corpus, capsys, monkeypatch, fresh_accelerate_state
):
    # What `accelerate launch --use_fsdp` (or an FSDP accelerate config) sets; on CPU accelerate would quietly
    # run DDP, and on GPUs it would shard by a configuration other than --fsdp's.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    argv = ["--output-dir", str(tmp_path / "out"), "--data", str(corpus), *RUN_ARGS, *fsdp]
    _assert_refused(argv, "pass --fsdp to finetune.py", capsys, tmp_path / "out")


# --- training runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    """2-process CPU runs of tiny-llama on the same data, each made once in a session: FSDP2 patched and unpatched,
    and DDP patched (test_finetune's). Returns their output folders and their metrics, by run."""

    def fill(out: Path) -> None:
        extra = ["--model", "tiny-llama", "--data", str(corpus), *RUN_ARGS, *FSDP]
        _finetune(accelerate_ddp(), out / "fsdp", extra)
        _finetune(accelerate_ddp(), out / "fsdp-unpatched", [*extra, "--no-patch"])

    out = once_per_session(tmp_path_factory, "fsdp-tiny-llama", fill)
    folders = {"fsdp": out / "fsdp", "fsdp-unpatched": out / "fsdp-unpatched",
               "ddp": ddp_tiny_llama(tmp_path_factory, corpus) / "patched"}
    finished = {name: _finished(folder) for name, folder in folders.items()}
    # The first line says how the run is sharded.
    stdout = finished["fsdp"][1]
    assert stdout.splitlines()[0].startswith(
        "fine-tuning tiny-llama: 4 steps x 2 sequences x 32 tokens x 2 processes = 512 tokens on cpu, "
        "FSDP2 by torch fully_shard; norms: "
    ), stdout
    return folders, {name: metrics for name, (metrics, _) in finished.items()}


def _assert_close_losses(a: FinetuneMetrics, b: FinetuneMetrics) -> None:
    _assert_same_losses(a, b, rtol=FSDP_LOSS_RTOL)


@pytest.mark.slow
def test_each_process_holds_half_of_the_decoder(runs):
    _, metrics = runs
    for name in ("fsdp", "fsdp-unpatched"):
        shards = metrics[name].fsdp
        assert shards.decoder_layers == 2 and shards.decoder_params > 0, name
        assert shards.decoder_params_per_process == [shards.decoder_params // 2] * 2, name
    assert metrics["ddp"].fsdp is None


@pytest.mark.slow
def test_fsdp_trains_as_ddp_patched_or_not(runs):
    folders, metrics = runs
    assert metrics["fsdp"].patch.norms > 0 and metrics["fsdp-unpatched"].patch is None
    _assert_close_losses(metrics["fsdp"], metrics["fsdp-unpatched"])
    _assert_close_losses(metrics["fsdp"], metrics["ddp"])
    # The same updates as DDP, tensor by tensor: every norm weight gradient reached the optimizer.
    initial = build_preset("tiny-llama", seed=3).state_dict()
    final = _assert_same_training(folders["fsdp"], folders["ddp"], "model.safetensors", initial)
    _assert_same_training(folders["fsdp"], folders["fsdp-unpatched"], "model.safetensors", initial)
    norm_names = [name for name in final if name.endswith("norm.weight")]
    assert len(norm_names) == 2 * 2 + 1
    for name in norm_names:
        assert not torch.allclose(final[name], initial[name]), f"{name} did not train"


@pytest.mark.slow
def test_saved_checkpoint_is_the_trained_model_for_plain_transformers(runs, tmp_path, corpus):  # noqa: F811
    folders, metrics = runs
    # The first packed sequence: the corpus's first 32 bytes, as byte-level tokens.
    first_sequence = list(corpus.read_bytes()[:32])
    # The trained (sharded) model's loss on it, recomputed from the saved files with hf_rmsnorm unimportable;
    # and the logits of the FSDP and DDP checkpoints side by side.
    check = (
        "import json, sys, torch\n"
        "sys.modules['hf_rmsnorm'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"ids = torch.tensor([{first_sequence}])\n"
        "result = {}\n"
        f"for name, folder in {({name: str(folders[name]) for name in ('fsdp', 'ddp')})!r}.items():\n"
        "    model = AutoModelForCausalLM.from_pretrained(folder).eval()\n"
        "    with torch.no_grad():\n"
        "        output = model(input_ids=ids, labels=ids)\n"
        "    result[name] = {'loss': output.loss.item(), 'logits': output.logits.flatten().tolist(),\n"
        "                    'architectures': model.config.architectures}\n"
        "print(json.dumps(result))\n"
    )
    result = json.loads(run_checked([sys.executable, "-c", check], tmp_path).stdout.strip().splitlines()[-1])
    fsdp, ddp = result["fsdp"], result["ddp"]
    assert fsdp["architectures"] == ["LlamaForCausalLM"]  # not FSDPLlamaForCausalLM
    assert fsdp["loss"] == pytest.approx(metrics["fsdp"].final_loss, rel=1e-6)
    torch.testing.assert_close(torch.tensor(fsdp["logits"]), torch.tensor(ddp["logits"]), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_fsdp_with_gradient_checkpointing_trains_the_same(runs, tmp_path, corpus):  # noqa: F811
    _, metrics = runs
    extra = ["--model", "tiny-llama", "--data", str(corpus), *RUN_ARGS, *FSDP, "--gradient-checkpointing"]
    checkpointed, _ = _finetune(accelerate_ddp(), tmp_path / "out", extra)
    assert checkpointed.gradient_checkpointing and checkpointed.fsdp.decoder_layers == 2
    _assert_close_losses(checkpointed, metrics["fsdp"])


@pytest.mark.slow
def test_fsdp_lora_matches_unpatched(tmp_path, corpus):  # noqa: F811
    # tiny-qwen3: tied embeddings (one parameter in the root unit twice) and per-head q/k norms.
    extra = ["--model", "tiny-qwen3", "--data", str(corpus), "--lora", "--gradient-checkpointing", *RUN_ARGS, *FSDP]
    patched, _ = _finetune(accelerate_ddp(), tmp_path / "patched", extra)
    unpatched, _ = _finetune(accelerate_ddp(), tmp_path / "unpatched", [*extra, "--no-patch"])
    assert patched.lora and patched.fsdp.decoder_params_per_process[0] > 0
    _assert_close_losses(patched, unpatched)
    initial = get_peft_model_state_dict(add_lora(build_preset("tiny-qwen3", seed=3), seed=3))
    adapter = _assert_same_training(tmp_path / "patched", tmp_path / "unpatched", "adapter_model.safetensors", initial)
    assert adapter and all("lora_" in name for name in adapter)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "patched").eval()
    assert type(loaded.get_base_model()).__name__ == "Qwen3ForCausalLM"


@pytest.mark.slow
def test_fsdp_bf16_policy_matches_unpatched_within_bf16_noise(tmp_path, corpus):  # noqa: F811
    # FSDP2's mixed-precision policy (accelerate's on GPUs): the kernels get bf16 weights, activations and
    # residuals, and the fp32 master weights stay sharded.
    extra = ["--model", "tiny-mistral", "--data", str(corpus), *RUN_ARGS, *FSDP]
    patched, _ = _finetune(accelerate_ddp("bf16"), tmp_path / "patched", extra)
    unpatched, _ = _finetune(accelerate_ddp("bf16"), tmp_path / "unpatched", [*extra, "--no-patch"])
    assert patched.mixed_precision == "bf16" and patched.patch.norms > 0
    _assert_same_losses(patched, unpatched, rtol=BF16_LOSS_RTOL)
    assert load_file(tmp_path / "patched" / "model.safetensors")["model.norm.weight"].dtype == torch.float32


def _launch_machines(out: Path, extra: list[str], n_machines: int = 2) -> FinetuneMetrics:
    """``n_machines`` launches of one process each on this host, as separate machines would run them; returns
    the metrics (written by machine 0's process)."""
    port = str(free_port())
    procs = []
    for rank in range(n_machines):
        launcher = [
            *accelerate_launch()[:2], "--multi_gpu", "--num_machines", str(n_machines),
            "--num_processes", str(n_machines),
            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "--mixed_precision", "no", "--dynamo_backend", "no",
        ]
        cmd = [*launcher, str(SCRIPT), "--output-dir", str(out), "--metrics-json", str(out.with_suffix(".json")),
               *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        output = proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
        assert proc.returncode == 0, f"machine {rank}:\n{output[-5000:]}"
    return FinetuneMetrics.from_dict(json.loads(out.with_suffix(".json").read_text()))


@pytest.mark.slow
def test_two_machines_of_one_process_train_as_one_machine_of_two(runs, tmp_path, corpus):  # noqa: F811
    _, metrics = runs
    extra = ["--model", "tiny-llama", "--data", str(corpus), *RUN_ARGS, *FSDP]
    two_machines = _launch_machines(tmp_path / "out", extra)
    assert two_machines.num_processes == 2 and two_machines.fsdp == metrics["fsdp"].fsdp
    _assert_close_losses(two_machines, metrics["ddp"])
    _assert_close_losses(two_machines, metrics["fsdp"])
