"""hf_rmsnorm under the trainers users train with: transformers' ``Trainer`` and TRL's ``SFTTrainer`` under
``accelerate launch`` (2-process DDP over gloo, tests/trainer_run.py), Trainer's ``model_init`` route and a model
SFTTrainer loads itself (one process), and PEFT's ``modules_to_save`` wrapping norms.

Every pair of runs differs only in the patch and must log the same per-step losses, and the patched run must
really have run the kernels (counted per process). fp32 throughout: the kernels compute the norms' own fp32
maths, in another reduction order (the inverse RMS of a row can differ by an ulp or two), so a few steps of
training move the loss by a few fp32 ulps (1 ulp of a loss near 5 is 1e-7 relative); ``LOSS_RTOL`` allows ten.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer
from launching import ROOT, TESTS, accelerate_ddp, once_per_session, run_checked
from trainer_run import (
    BATCH,
    RUNS,
    STEPS,
    count_kernel_calls,
    logged_losses,
    sft_trainer,
    token_dataset,
    training_args,
)
from patch_models import input_ids, tiny_model

from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.patch.fused import original_class

LOSS_RTOL = 1e-6
UPDATE_RTOL = 1e-3  # of the norm of a weight's change during training (Adam rescales rounding noise)


def _assert_same_losses(patched: list[float], unpatched: list[float]) -> None:
    assert len(patched) == len(unpatched) == STEPS
    for step, (a, b) in enumerate(zip(patched, unpatched)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: patched {a} vs unpatched {b}"


@pytest.fixture
def kernel_calls(monkeypatch):
    return count_kernel_calls(monkeypatch.setattr)


def _expected_kernel_calls(n_norms: int, n_layers: int, checkpointing: bool, n_qk: int = 0) -> dict[str, int]:
    """The kernel calls of one process's training steps on a patched tiny model: every patched norm runs once
    per step; each layer's attention residual add runs inside its post_attention_layernorm's kernel and its MLP
    residual add inside the next norm's (the next layer's input norm, or the final norm), which the layer calls
    and the next one is handed (``hf_rmsnorm.patch.handoff``). So every norm runs inside a layer, and under
    gradient checkpointing (every layer, as transformers checkpoints by default) runs again when its layer is
    recomputed, the MLP adds fused all the same. The q and k norms of each of the ``n_qk`` attention modules fused
    with their RoPE run as one ``qk_norm_rope`` launch instead (``hf_rmsnorm.patch.qk_runtime``)."""
    runs = 2 if checkpointing else 1
    fused_adds = 2 * n_layers * STEPS * runs
    calls = {"norm": (n_norms - 2 * n_qk) * STEPS * runs - fused_adds, "fused_add_norm": fused_adds}
    return calls | ({"qk_norm_rope": n_qk * STEPS * runs} if n_qk else {})


# --- Trainer under accelerate launch: 2 processes, DDP over gloo -------------------------------------------


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict:
    """Every run of trainer_run.py (Trainer on two families, SFTTrainer), unpatched and patched, in one 2-process
    launch, made once in a session."""
    out = once_per_session(tmp_path_factory, "trainer-ddp-runs", lambda folder: run_checked(
        [*accelerate_ddp(), str(TESTS / "trainer_run.py"), str(folder / "runs.json")], ROOT))
    return json.loads((out / "runs.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_ddp_patched_matches_unpatched(ddp_runs, run):
    patched, unpatched = ddp_runs[f"{run}-patched"], ddp_runs[f"{run}-unpatched"]
    for record in (patched, unpatched):
        distributed = (record["world_size"], record["distributed_type"], record["wrapped"])
        assert distributed == (2, "MULTI_CPU", "DistributedDataParallel")
    _assert_same_losses(patched["losses"], unpatched["losses"])
    # Each process ran the patched norms (SFTTrainer checkpoints by default); the unpatched runs never did.
    n_layers = tiny_model(RUNS[run][0]).config.num_hidden_layers
    expected = _expected_kernel_calls(patched["patched_norms"], n_layers, patched["gradient_checkpointing"],
                                      patched["fused_qk"])
    assert patched["kernel_calls"] == [expected, expected]
    assert unpatched["kernel_calls"] == [{}, {}] and unpatched["patched_norms"] is None
    # The norm weights trained, and by the same updates.
    initial = {name: p.flatten() for name, p in tiny_model(RUNS[run][0]).named_parameters() if "norm" in name}
    assert patched["norm_weights"].keys() == initial.keys()
    for name, start in initial.items():
        a, b = torch.tensor(patched["norm_weights"][name]), torch.tensor(unpatched["norm_weights"][name])
        update = torch.linalg.norm(b - start).item()
        assert update > 0 and torch.linalg.norm(a - b).item() <= UPDATE_RTOL * update, name


# --- one process: Trainer's model_init, SFTTrainer loading the model ---------------------------------


def _train_with_model_init(output_dir: str, patched: bool) -> list[float]:
    def model_init():
        model = tiny_model("llama", seed=0)
        if patched:
            patch_model(model)
        return model

    args = training_args(output_dir)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=token_dataset(STEPS * BATCH))
    trainer.train()
    assert (original_class(trainer.model.model.norm) is not None) == patched  # the model Trainer trained
    return logged_losses(trainer)


@pytest.mark.slow
def test_trainer_model_init_patched_matches_unpatched(tmp_path, kernel_calls, fresh_accelerate_state):
    unpatched = _train_with_model_init(str(tmp_path), patched=False)
    assert not kernel_calls
    patched = _train_with_model_init(str(tmp_path), patched=True)
    _assert_same_losses(patched, unpatched)
    n_layers = tiny_model("llama").config.num_hidden_layers
    assert kernel_calls == _expected_kernel_calls(2 * n_layers + 1, n_layers, checkpointing=False)


@pytest.mark.slow
def test_sft_trainer_of_a_model_name_patched_after_construction(
    tmp_path, kernel_calls, fresh_accelerate_state
):
    # A model passed by name (here a saved directory) is loaded by SFTTrainer's constructor: patch trainer.model
    # after it and before train(), which is where the model gets wrapped.
    tiny_model("llama", seed=0).save_pretrained(tmp_path / "ckpt")
    trainer = sft_trainer(str(tmp_path / "ckpt"), str(tmp_path / "by-name"))
    report = patch_model(trainer.model)
    trainer.train()
    n_layers = trainer.model.config.num_hidden_layers
    assert kernel_calls == _expected_kernel_calls(len(report.norms), n_layers, trainer.args.gradient_checkpointing)
    unpatched = sft_trainer(tiny_model("llama", seed=0), str(tmp_path / "unpatched"))
    unpatched.train()
    _assert_same_losses(logged_losses(trainer), logged_losses(unpatched))


# --- PEFT modules_to_save wrapping norms -------------------------------------------------------------------

MODULES_TO_SAVE = {
    # Every layer's post_attention_layernorm: the norm the attention residual add is fused into.
    "post-attention norms": ["post_attention_layernorm"],
    # The final norm: the last layer's MLP residual add goes into it.
    "final norm": ["model.norm"],
}


def _peft(model, modules_to_save: list[str]):
    torch.manual_seed(7)  # the same LoRA initialisation for every model
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=list(modules_to_save)))


def _wrappers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"}


def _train_steps(model, ids: torch.Tensor, steps: int = 2) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("order", ["patch, then get_peft_model", "get_peft_model, then patch"])
@pytest.mark.parametrize("target", MODULES_TO_SAVE)
def test_peft_modules_to_save_norm(order, target, kernel_calls):
    modules_to_save = MODULES_TO_SAVE[target]
    ids = input_ids(batch=2, seq=12)
    n_layers = tiny_model("llama").config.num_hidden_layers
    reference = _peft(tiny_model("llama"), modules_to_save)
    if order == "patch, then get_peft_model":
        model = tiny_model("llama")
        report = patch_model(model)
        model = _peft(model, modules_to_save)
    else:
        model = _peft(tiny_model("llama"), modules_to_save)
        report = patch_model(model)
    wrappers = _wrappers(model)
    assert wrappers.keys() == _wrappers(reference).keys() and wrappers
    # Whichever copy a wrapper calls (the trained one, or the original with the adapter disabled) is patched.
    for wrapper in wrappers.values():
        assert original_class(wrapper.original_module) is not None
        assert original_class(wrapper.modules_to_save["default"]) is not None
    if order == "patch, then get_peft_model":
        # Planned on the plain model: every layer's attention add is fused, into whichever copy PEFT calls.
        assert sum("attention residual" in line for line in report.fused_adds) == n_layers
        layers_fused = True
    else:
        # Planned through the wrappers: both copies of each wrapped norm are patched, and a layer whose own norm
        # is wrapped keeps its adds unfused, saying why.
        for name in wrappers:
            stem = name.removeprefix("base_model.model.")
            assert {f"{stem}.original_module", f"{stem}.modules_to_save.default"} <= set(report.norms)
        layers_skipped = [reason for _, reason in report.skipped if "ModulesToSaveWrapper" in reason]
        layers_fused = target != "post-attention norms"
        assert len(layers_skipped) == (0 if layers_fused else n_layers), report.skipped
        if not layers_fused:  # derived from their forward instead: the MLP add still goes to the next norm
            assert all(reason.startswith("its forward is derived") for reason in layers_skipped)

    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        with model.disable_adapter(), reference.disable_adapter():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    kernel_calls.clear()
    losses, reference_losses = _train_steps(model, ids), _train_steps(reference, ids)
    # Every norm the model calls ran the kernels, wrapped or not (the wrappers call one copy each).
    n_norms = sum(1 for name, _ in tiny_model("llama").named_parameters() if "norm" in name)
    assert kernel_calls["norm"] + kernel_calls["fused_add_norm"] == n_norms * len(losses)
    # A fused layer hands its attention add to post_attention_layernorm, through the wrapper when it is wrapped
    # at patch time, and its MLP add to the next norm unless that norm is wrapped (the wrapper calls another copy:
    # the last layer's add stays apart when the final norm is wrapped). A layer whose post-attention norm was
    # wrapped before patching runs its derived forward: its attention add stays apart, its MLP add is fused.
    attention_adds = n_layers if layers_fused else 0
    mlp_adds = n_layers - (target == "final norm")
    assert kernel_calls["fused_add_norm"] == (attention_adds + mlp_adds) * len(losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=LOSS_RTOL, atol=0)
    # The saved copies trained (as the unpatched model's did); the originals stayed frozen.
    initial = tiny_model("llama").state_dict()
    for name, wrapper in wrappers.items():
        original_name = name.removeprefix("base_model.model.") + ".weight"
        trained = wrapper.modules_to_save["default"].weight
        expected = _wrappers(reference)[name].modules_to_save["default"].weight
        assert torch.equal(wrapper.original_module.weight, initial[original_name])
        update = torch.linalg.norm(expected - initial[original_name]).item()
        assert update > 0 and torch.linalg.norm(trained - expected).item() <= UPDATE_RTOL * update, name

    unpatch_model(model)
    assert [name for name, m in model.named_modules() if original_class(m) is not None] == []
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_unpatch_leaves_a_part_patched_on_its_own_alone():
    # unpatch_model also restores patched copies made since patching (above), but not a part of the model that a
    # patch_model call of its own patched.
    model = tiny_model("llama")
    patch_model(model.model)
    patch_model(model)
    unpatch_model(model)
    assert original_class(model.model.norm) is not None
    unpatch_model(model.model)
    assert [name for name, m in model.named_modules() if original_class(m) is not None] == []
