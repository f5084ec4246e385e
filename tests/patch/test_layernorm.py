"""patch_model on LayerNorm decoders: the exact fused LayerNorm (default) and the explicit conversion to RMSNorm.

The models run where the kernels do: on the GPU when there is one (CPU tensors there would take the PyTorch
implementation instead, ``hf_rmsnorm.ops.backend``), otherwise on the CPU with the kernels in Triton's interpreter.
Logits are compared with the unpatched model and an fp64 copy of it. The
default path must stay exact whatever happens to the model afterwards (adapters, merges, weight edits, casts,
training with dropout, compile); the conversion (``layernorm="rmsnorm"``) changes the weights once, when asked,
and the report says which.
"""

import copy
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from family_cases import CASES, LAYERNORM, names
from patch_models import reachable_modules, tiny_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from hf_rmsnorm import (
    UnconvertibleModelError,
    UnsupportedModelError,
    fused_add_layer_norm,
    fused_add_rms_norm,
    layer_norm,
    layer_norm_add,
    patch_model,
    rms_norm,
    rms_norm_add,
    unpatch_model,
)
from hf_rmsnorm.ops import backend, functional, reference
from hf_rmsnorm.ops.modes import MODES
from hf_rmsnorm.patch import conversion

V = 128
DEVICE = "cpu" if backend.kernels_interpreted() else "cuda"
FAMILIES = names(LAYERNORM)
PARALLEL = [family for family in FAMILIES if CASES[family].parallel]


def tiny(family, dtype=torch.float32, seed=0, **overrides):
    model_type, fields = CASES[family].model_type, CASES[family].config
    fields = dict(fields, vocab_size=V, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, **overrides)
    if model_type in ("gpt2", "gptj"):
        fields.pop("max_position_embeddings")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights around 1, biases non-zero, writers with a mean: centring must matter.
            if p.dim() == 1:
                p.normal_(1.0, 0.3) if name.endswith("weight") else p.normal_(0.0, 0.1)
            else:
                p.add_(0.01)
    return model.to(DEVICE, dtype).eval()


def ids(batch=2, seq=8, seed=1):
    return torch.randint(3, V, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def logits(model, x, **kwargs):
    with torch.no_grad():
        return model(x, **kwargs).logits


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def layernorms(model):
    return [n for n, m in model.named_modules() if type(m) is nn.LayerNorm]


def _assert_no_worse_than_eager(patched, eager, truth, dtype):
    """Not less accurate than eager against fp64: up to one ulp of the largest logit, and a mean error within
    5% of eager's (what scripts/verify.py judges, with 10%)."""
    scale = truth.abs().max().item()
    assert err(patched, truth) <= err(eager, truth) + torch.finfo(dtype).eps * scale
    assert (patched.double() - truth).abs().mean() <= 1.05 * (eager.double() - truth).abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layernorms_match_unpatched_and_fp64_and_touch_no_weight(family, dtype):
    model = tiny(family, dtype)
    x = ids()
    truth = logits(copy.deepcopy(model).double(), x)
    eager = logits(model, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lns = layernorms(model)

    report = patch_model(model)
    patched = logits(model, x)
    assert len(report.norms) == CASES[family].norms and set(report.norms) <= set(lns)
    assert not report.converted and not report.centred and not report.centred_inputs
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    if dtype == torch.float32:
        assert err(patched, eager) <= 1e-5 * truth.abs().max().item()
    _assert_no_worse_than_eager(patched, eager, truth, dtype)

    unpatch_model(model)
    assert layernorms(model) == lns
    assert torch.equal(logits(model, x), eager)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_to_rmsnorm_is_exact_and_reports_every_changed_weight(family):
    model = tiny(family)
    x = ids()
    truth = logits(copy.deepcopy(model).double(), x)
    eager = logits(model, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    report = patch_model(model, layernorm="rmsnorm")
    changed = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, state[k]))
    # Exactly the listed parameters changed, once, when patching; every writer of both layers is listed.
    assert changed == sorted(report.centred) and len(report.centred) >= 4
    assert len(report.converted) == CASES[family].norms and report.converted == report.norms
    assert len(report.centred_inputs) == 1 and report.centred_inputs[0].endswith(".0")
    scale = truth.abs().max().item()
    assert err(logits(model, x), eager) <= 1e-4 * scale and err(logits(model, x), truth) <= 1e-5 * scale
    centred = {k: v.clone() for k, v in model.state_dict().items()}
    logits(model, x)
    assert all(torch.equal(v, centred[k]) for k, v in model.state_dict().items())  # inference changes nothing

    unpatch_model(model)
    assert not any(m._forward_pre_hooks for m in model.modules())
    # The centred weights give the same outputs in the original LayerNorm model.
    assert err(logits(model, x), truth) <= 1e-5 * scale


@pytest.mark.parametrize("layernorm", ["fuse", "rmsnorm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp64_models_are_exact(family, layernorm):
    """fp64 runs the PyTorch implementation (as CPU tensors do where the kernels are compiled for a GPU), whose
    LayerNorm is torch's own: the fused LayerNorm model gives the model's logits bit for bit, its adds rounded as
    the model rounds them; the conversion reproduces them to rounding (its exactness, measured)."""
    model = tiny(family, torch.float64)
    x = ids()
    expected = logits(model, x)
    patch_model(model, layernorm=layernorm)
    if layernorm == "fuse":
        assert torch.equal(logits(model, x), expected)
    else:
        assert err(logits(model, x), expected) <= 1e-14 * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pytorch_implementation_is_nn_layernorm_with_fp32_parameters_and_half_inputs(dtype):
    """LayerNorms kept in fp32 in a half-precision model: where the kernels do not run, the fused add + LayerNorm
    is ``nn.LayerNorm`` of the rounded sum bit for bit (torch's kernel takes fp32 parameters with a half input; the
    steps spelt out in fp32 landed an fp32 ulp away: an ulp of the output on 1 element in about 5 * 10^4 in bf16,
    6 * 10^3 in fp16)."""
    g = torch.Generator().manual_seed(0)
    x, residual = ((3 * torch.randn(256, 1024, generator=g) + 0.5).to(dtype) for _ in range(2))
    norm = nn.LayerNorm(1024)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=g)
        norm.bias.normal_(0.0, 0.1, generator=g)
        y, total, _ = reference.forward_reference(x, residual, norm.weight, norm.bias, norm.eps, "layernorm")
        assert torch.equal(total, residual + x)
        assert y.dtype == dtype and torch.equal(y, norm(residual + x))


def test_cpu_tensors_on_a_gpu_host_give_the_models_logits_bit_for_bit():
    """In a process whose kernels are compiled for a GPU (a GPU host; here a CPU process configured as one), CPU
    tensors take the PyTorch implementation: every LayerNorm family, patched in fp32 and bf16, gives the model's
    logits bit for bit (torch's own LayerNorm of the same rounded sums), bf16 models with their LayerNorms kept in
    fp32 too, and so do Cohere and Cohere 2, whose own LayerNorm classes spell the maths out (the
    ``layernorm_fp32`` mode, rounded step by step)."""
    script = f"""
import sys
sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}
from hf_rmsnorm.ops import backend
backend.configure("cuda")
import torch
import test_layernorm as cases
from hf_rmsnorm import patch_model
assert not backend.kernels_interpreted()
cases.DEVICE = "cpu"
from patch_models import tiny_model
own_classes = dict(cohere=dict(), cohere2=dict(sliding_window=4))
for family in [*cases.FAMILIES, *own_classes]:
    for dtype, fp32_norms in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        if fp32_norms and family in own_classes:
            continue
        model = tiny_model(family, dtype, **own_classes[family]) if family in own_classes else cases.tiny(family, dtype)
        for module in model.modules():
            if fp32_norms and isinstance(module, torch.nn.LayerNorm):
                module.float()
        x = cases.ids()
        expected = cases.logits(model, x)
        assert patch_model(model).fused_adds, family
        assert torch.equal(cases.logits(model, x), expected), (family, dtype, fp32_norms)
"""
    env = {k: v for k, v in os.environ.items() if k != backend.INTERPRETER_ENV}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("layernorm", ["fuse", "rmsnorm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_identical_in_fp32(family, layernorm):
    model = tiny(family)
    x = ids(batch=1, seq=5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(x, **kwargs)
    patch_model(model, layernorm=layernorm)
    assert torch.equal(model.generate(x, **kwargs), expected)


def test_conversion_leaves_tied_embeddings_tied_and_untouched():
    model = tiny("gpt2")
    table = model.transformer.wte.weight.detach().clone()
    assert model.lm_head.weight is model.transformer.wte.weight
    report = patch_model(model, layernorm="rmsnorm")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, table) and "lm_head" not in " ".join(report.centred)
    assert report.centred_inputs == ["transformer.h.0"]
    assert report.centred == [
        f"transformer.h.{i}.{writer}.{p}" for i in range(2) for writer in ("attn.c_proj", "mlp.c_proj")
        for p in ("weight", "bias")
    ]
    for layer in model.transformer.h:
        for writer in (layer.attn.c_proj, layer.mlp.c_proj):  # Conv1D: weight [in, out]
            assert writer.weight.double().mean(1).abs().max() < 1e-6 and abs(writer.bias.double().mean()) < 1e-6


@pytest.mark.parametrize("layernorm", ["fuse", "rmsnorm"])
def test_inputs_embeds_from_outside_are_exact(layernorm):
    model = tiny("phi")
    x = ids()
    embeds = torch.randn(2, 8, 64, device=DEVICE) + 0.5  # not centred, not from the model's table
    expected = logits(model, None, inputs_embeds=embeds)
    patch_model(model, layernorm=layernorm)
    assert err(logits(model, None, inputs_embeds=embeds), expected) <= 1e-5 * expected.abs().max().item()
    assert err(logits(model, x), logits(model, None, inputs_embeds=model.get_input_embeddings()(x))) == 0


def _train(model, steps=4, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x = ids(seed=10 + step)
        torch.manual_seed(100 + step)  # the same dropout masks for both models
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_losses(got, expected):
    assert max(abs(a - b) / abs(b) for a, b in zip(got, expected)) < 1e-5, (got, expected)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "gpt_neox_sequential"])
def test_training_matches_the_unpatched_model_then_inference_and_conversion_stay_exact(family):
    # Dropout off: the exactness claim is about the maths, not about matching random masks.
    model = tiny(family, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else tiny(family)
    reference = copy.deepcopy(model)
    patch_model(model)
    _assert_same_losses(_train(model.train()), _train(reference.train()))

    model.eval(), reference.eval()
    x = ids(seed=3)
    truth = logits(reference, x)
    assert err(logits(model, x), truth) <= 1e-4 * truth.abs().max().item()
    # Once training is done, the trained model converts exactly.
    unpatch_model(model)
    report = patch_model(model, layernorm="rmsnorm")
    assert report.converted and all(type(model.get_submodule(n))._hf_rmsnorm_kind.mode == "layernorm_as_rmsnorm"
                                    for n in report.converted)
    assert err(logits(model, x), truth) <= 1e-4 * truth.abs().max().item()


def test_eval_then_train_with_gpt2_default_dropout_is_the_unpatched_model():
    """GPT-2's default dropouts (0.1) active, after an inference forward: per-step losses equal the unpatched
    model's, and the writers are never changed behind the user's back."""
    model = tiny("gpt2")  # resid_pdrop = embd_pdrop = attn_pdrop = 0.1
    reference = copy.deepcopy(model)
    writer = model.transformer.h[0].mlp.c_proj.weight
    before = writer.detach().clone()
    patch_model(model)
    x = ids(seed=5)
    assert err(logits(model, x), logits(reference, x)) <= 1e-5 * logits(reference, x).abs().max().item()
    assert torch.equal(writer, before)
    _assert_same_losses(_train(model.train(), steps=3), _train(reference.train(), steps=3))


def _lora(model, seed=3):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["dense_4h_to_h"], init_lora_weights=False))


@pytest.mark.parametrize("lora_after_first_inference", [False, True])
def test_lora_on_a_residual_writer_stays_exact(lora_after_first_inference):
    base = tiny("gpt_neox")
    x = ids(seed=6)
    expected_model = _lora(copy.deepcopy(base))
    expected = logits(expected_model, x)
    model = copy.deepcopy(base)
    patch_model(model)
    if lora_after_first_inference:
        logits(model, x)
    model = _lora(model)
    scale = expected.abs().max().item()
    assert err(logits(model, x), expected) <= 1e-5 * scale
    assert err(logits(model, x), expected) <= 1e-5 * scale  # a second forward changes nothing either
    # Merging the adapter into the writers after inference: still the unpatched model's merge.
    merged = model.merge_and_unload()
    assert err(logits(merged, x), logits(expected_model.merge_and_unload(), x)) <= 1e-5 * scale


def test_weight_edits_and_casts_after_patching_stay_exact():
    model = tiny("gpt_neox")
    reference = copy.deepcopy(model)
    x = ids(seed=7)
    patch_model(model)
    logits(model, x)
    # A .data update of a writer (EMA, vector_to_parameters), then a whole-model parameter load.
    for m in (model, reference):
        m.gpt_neox.layers[0].mlp.dense_4h_to_h.weight.data.add_(0.05)
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(m.parameters()) * 1.01,
                                            m.parameters())
    truth = logits(reference, x)
    assert err(logits(model, x), truth) <= 1e-5 * truth.abs().max().item()
    # A cast after patching: as accurate as the unpatched model in that dtype.
    fp64 = logits(copy.deepcopy(reference).double(), x)
    model.to(torch.bfloat16), reference.to(torch.bfloat16)
    _assert_no_worse_than_eager(logits(model, x), logits(reference, x), fp64, torch.bfloat16)


def test_loading_weights_stays_exact():
    model = tiny("opt")
    original = tiny("opt", seed=1)
    patch_model(model)
    model.load_state_dict(original.state_dict())
    x = ids()
    assert err(logits(model, x), logits(original, x)) <= 1e-5 * logits(original, x).abs().max().item()


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_torch_compile_fullgraph_of_a_layernorm_model(family):
    model = tiny(family)
    x = ids()
    expected = logits(model, x)
    patch_model(model)
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert err(compiled(x).logits, expected) <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("layernorm", ["fuse", "rmsnorm"])
def test_copying_one_norm_or_one_layer_copies_that_subtree_only(layernorm):
    model = tiny("gpt_neox")
    x = torch.randn(2, 5, 64, device=DEVICE)
    patch_model(model, layernorm=layernorm)
    layer = model.gpt_neox.layers[0]
    for original in (layer.input_layernorm, layer):
        copied = copy.deepcopy(original)
        assert reachable_modules(copied) == {id(m) for m in copied.modules()}
    norm = copy.deepcopy(layer.input_layernorm)
    expected = layer.input_layernorm(x)
    assert torch.equal(norm(x), expected)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def _assert_untouched(model, snapshot):
    state, classes = snapshot
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [type(m) for m in model.modules()] == classes
    assert not any("_hf_rmsnorm" in k for m in model.modules() for k in m.__dict__)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_bert_runs_exact_layernorms_but_is_not_converted():
    from transformers import BertConfig, BertLMHeadModel

    model = BertLMHeadModel(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True)).to(DEVICE).eval()
    before = _snapshot(model)
    with pytest.raises(UnconvertibleModelError, match=r"BertLMHeadModel .*not a pre-LN decoder.*post-LN.*"
                                                      r"without layernorm='rmsnorm'"):
        patch_model(model, layernorm="rmsnorm")
    _assert_untouched(model, before)
    x = ids()
    expected = logits(model, x)
    every_layernorm = layernorms(model)
    report = patch_model(model)
    assert set(report.norms) == set(every_layernorm) and report.families == ["LayerNorm"]
    assert err(logits(model, x), expected) <= 1e-5 * expected.abs().max().item()


def test_post_ln_opt_runs_fused_layernorms_but_is_not_converted():
    model = tiny("opt", do_layer_norm_before=False)
    before = _snapshot(model)
    with pytest.raises(UnconvertibleModelError, match=r"post-LN \(do_layer_norm_before=False"):
        patch_model(model, layernorm="rmsnorm")
    _assert_untouched(model, before)
    # The exact fused LayerNorm needs no pre-LN structure.
    x = ids()
    expected = logits(model, x)
    assert len(patch_model(model).norms) == 4
    assert err(logits(model, x), expected) <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_conversion_refuses_half_precision_writers(dtype):
    model = tiny("gpt2", dtype)
    before = _snapshot(model)
    with pytest.raises(UnconvertibleModelError, match=r"stored in (b)?float16.*load the model in float32"):
        patch_model(model, layernorm="rmsnorm")
    _assert_untouched(model, before)


@pytest.mark.parametrize("option, error", [("skip", UnsupportedModelError), ("rmsnorm", UnconvertibleModelError)])
def test_the_layernorm_option_covers_a_models_own_layernorm_class(option, error):
    """Cohere normalises with its own ``CohereLayerNorm`` (recognised in the ``layernorm`` mode): ``"skip"`` leaves
    it alone (nothing is left to patch), ``"rmsnorm"`` refuses it (the conversion covers ``nn.LayerNorm`` readers
    of a known stream); the model untouched."""
    model = tiny_model("cohere")
    before = _snapshot(model)
    with pytest.raises(error) as raised:
        patch_model(model, layernorm=option)
    assert type(raised.value) is error
    assert ("CohereLayerNorm, a LayerNorm of the model's own class" if option == "rmsnorm"
            else "LayerNorm left alone on request") in str(raised.value)
    _assert_untouched(model, before)
    assert patch_model(tiny_model("cohere")).norms  # patched exactly by default


def test_layernorm_skip_leaves_layernorms_alone():
    model = tiny("gpt2")
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError) as error:
        patch_model(model, layernorm="skip")
    assert not isinstance(error.value, UnconvertibleModelError)
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="layernorm must be one of 'fuse', 'rmsnorm', 'skip'"):
        patch_model(model, layernorm="convert")


@pytest.mark.parametrize("failing", ["hook", "centring"])
def test_a_failure_midway_restores_weights_classes_and_hooks(failing, monkeypatch):
    model = tiny("gpt_neox")
    before = _snapshot(model)
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        if failing == "hook" or len(calls) == 3:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    target = (nn.Module, "register_forward_pre_hook") if failing == "hook" else (conversion, "_writer_means")
    original = getattr(*target)
    monkeypatch.setattr(*target, fail)
    with pytest.raises(RuntimeError, match="boom"):
        patch_model(model, layernorm="rmsnorm")
    _assert_untouched(model, before)


def test_qk_layernorms_run_exactly_and_stay_so_when_the_stream_is_converted():
    model = tiny("phi", qk_layernorm=True)
    x = ids()
    expected = logits(model, x)
    report = patch_model(model)
    assert "model.layers.0.self_attn.q_layernorm" in report.norms
    # Only the attention modules are skipped: Phi's partial-rotary code keeps its q/k norms and RoPE apart.
    assert [name for name, _ in report.skipped] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(reason.startswith("q/k norms and RoPE not fused") for _, reason in report.skipped)
    assert str(report).splitlines()[0] == ("hf_rmsnorm: 7 norms patched (Phi), 2 residual adds fused, 2 skipped; "
                                           "q/k norms fused with the RoPE in 0 attention modules (2 left apart)")
    assert err(logits(model, x), expected) <= 1e-5 * expected.abs().max().item()
    unpatch_model(model)
    report = patch_model(model, layernorm="rmsnorm")
    text = str(report)
    # The q/k norms read no residual stream: they stay exact LayerNorms (LN(Ch) = LN(h) is not needed of them).
    assert "model.layers.0.self_attn.q_layernorm" not in report.converted
    assert text.splitlines()[0] == ("hf_rmsnorm: 7 norms patched (Phi), 2 residual adds fused, 2 skipped; "
                                    "3 LayerNorms converted to RMSNorm; q/k norms fused with the RoPE in 0 attention "
                                    "modules (2 left apart)")
    assert ("  parameters centred (once, by the conversion):\n    model.layers.0.self_attn.dense.weight\n"
            "    model.layers.0.self_attn.dense.bias\n") in text
    assert "  inputs centred on every forward (by the conversion):\n    model.layers.0\n" in text
    assert err(logits(model, x), expected) <= 1e-4 * expected.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_sequential_blocks_fuse_their_residual_adds(family):
    model = tiny(family)
    x = ids(seed=4)
    truth = logits(model, x)
    report = patch_model(model)
    case = CASES[family]
    assert len(report.fused_adds) == case.adds, report.fused_adds
    if case.parallel and case.derived_forward:  # one add per layer, handed on: Falcon; GPT-J before transformers 5.24
        if family == "gptj":
            assert dict(report.skipped)["transformer.h.0"].startswith("its forward is derived: no registered shape fits")
        assert all(" layer output -> " in line for line in report.fused_adds)
    elif case.parallel:
        assert all(" parallel residual -> " in line for line in report.fused_adds)
    elif case.derived_forward:  # OPT's: "... (into final_layer_norm where a test holds, else layer output) -> ..."
        assert sum("layer output" in line for line in report.fused_adds) == case.adds // 2
    elif case.adds:
        assert sum(" mlp residual -> " in line for line in report.fused_adds) == case.adds // 2
    # Without and with autograd (the handoff between layers runs in both, LayerNorm mode) exact.
    assert err(logits(model, x), truth) <= 1e-5 * truth.abs().max().item()
    assert err(model(x).logits, truth) <= 1e-5 * truth.abs().max().item()


def test_gpt2_with_cross_attention_fuses_through_its_derived_forward():
    """GPT-2 with cross-attention is more than the registered block: its own forward, derived (``derived_rewrite.py``),
    runs the cross-attention as written and hands its output add to the next norm. Its attention's add is moved
    into both branches of ``if encoder_hidden_states is not None:`` (``derived_branches.py``): where the block does
    not run, it goes into ``ln_2``; where it runs, its first statement is a check, not a norm, so the add stays
    apart there, and the block's own add goes into ``ln_2``."""
    model = tiny("gpt2", add_cross_attention=True)
    x = ids(seed=4)
    g = torch.Generator().manual_seed(5)
    encoder_states = torch.randn(x.shape[0], 5, model.config.n_embd, generator=g).to(DEVICE)
    with torch.no_grad():
        truth = model(x, encoder_hidden_states=encoder_states).logits
    report = patch_model(model)
    lines, start = inspect.getsourcelines(GPT2Block.forward)
    cross, attention = (next(start + k for k, text in enumerate(lines) if text.strip() == f"hidden_states = {add}")
                        for add in ("residual + cross_attn_output", "attn_output + residual"))
    assert report.fused_adds == [
        *(f"transformer.h.{i}: residual add at line {line} (into ln_2) -> transformer.h.{i}.ln_2"
          for i in range(2) for line in (cross, attention)),
        "transformer.h.0: layer output -> transformer.h.1.ln_1", "transformer.h.1: layer output -> transformer.ln_f"]
    with torch.no_grad():
        got = model(x, encoder_hidden_states=encoder_states).logits
    assert err(got, truth) <= 1e-5 * truth.abs().max().item()


@pytest.mark.parametrize("family", PARALLEL)
def test_parallel_blocks_draw_dropout_masks_in_the_original_order(family):
    # Every dropout active in train mode: the patched body must call them in HF's order (same random masks).
    drop = {"gpt_neox": dict(hidden_dropout=0.3, attention_dropout=0.2),
            "phi": dict(resid_pdrop=0.3, attention_dropout=0.2, embd_pdrop=0.1),
            "gptj": dict(resid_pdrop=0.3, attn_pdrop=0.2, embd_pdrop=0.1),
            "falcon": dict(hidden_dropout=0.3, attention_dropout=0.2)}[family]
    model = tiny(family, **drop)
    reference = copy.deepcopy(model)
    report = patch_model(model)
    assert len(report.fused_adds) == CASES[family].adds
    x = ids(seed=5)
    reference.train(), model.train()
    for grad in (False, True):  # no_grad: the handoff runs with the dropouts active; then autograd
        with torch.set_grad_enabled(grad):
            torch.manual_seed(7)
            expected = reference(x).logits
            torch.manual_seed(7)
            got = model(x).logits
        assert err(got, expected) <= 1e-5 * expected.abs().max().item()
    # The masks matter: another seed gives other outputs.
    with torch.no_grad():
        torch.manual_seed(8)
        assert err(model(x).logits, expected) > 1e-3 * expected.abs().max().item()


def test_training_with_residual_dropout_is_the_original_model():
    """GPT-2's default dropouts (0.1) active, alternating training and inference forwards: the losses and the
    logits are the unpatched model's, and the writers never change."""
    model = tiny("gpt2")  # resid_pdrop = embd_pdrop = attn_pdrop = 0.1
    reference = copy.deepcopy(model)
    writer = model.transformer.h[0].mlp.c_proj.weight
    patch_model(model)
    x = ids(seed=5)
    for m in (model, reference):
        m.train()
    for step in range(3):
        torch.manual_seed(step)
        loss = model(x, labels=x).loss
        torch.manual_seed(step)
        expected = reference(x, labels=x).loss
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        before = writer.detach().clone()
        with torch.no_grad():
            for m in (model, reference):
                m.eval()
            assert err(logits(model, x), logits(reference, x)) <= 1e-5 * logits(reference, x).abs().max().item()
            assert torch.equal(writer, before)
            for m in (model, reference):
                m.train()


# ---------------------------------------------------------------------- the functional LayerNorm API

# Each LayerNorm function and the RMSNorm-named function whose mode="layernorm" it replaces; all but the first
# take a residual after x.
LAYER_NORM_FUNCTIONS = {
    "layer_norm": (layer_norm, rms_norm),
    "fused_add_layer_norm": (fused_add_layer_norm, fused_add_rms_norm),
    "layer_norm_add": (layer_norm_add, rms_norm_add),
}
# The start of this package's DeprecationWarning (other libraries' deprecations, such as Triton 3.2's interpreter's
# of numpy, are not what these tests are about).
DEPRECATED_MODE = r"\w+\(mode='layernorm'\) computes a LayerNorm"


def _trained_like(rows, n_cols, dtype, seed):
    """Inputs, a residual, and a weight ~ N(1, 0.5) and a bias ~ N(0, 0.5) as training leaves them (never the
    ones and zeros of a fresh module, which would hide swapped or dropped parameters)."""
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, n_cols, generator=g, dtype=torch.float64).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.5 * torch.randn(n_cols, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    bias = (0.5 * torch.randn(n_cols, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    return [t.requires_grad_() for t in (x, residual, weight, bias)]


def _call_new(name, x, residual, weight, bias):
    """The LayerNorm function ``name``, with its default eps."""
    function = LAYER_NORM_FUNCTIONS[name][0]
    return function(x, weight, bias) if name == "layer_norm" else function(x, residual, weight, bias)


def _call_deprecated(name, x, residual, weight, bias, eps):
    """What ``name`` replaces: its RMSNorm-named function with ``mode="layernorm"``."""
    function = LAYER_NORM_FUNCTIONS[name][1]
    if name == "layer_norm":
        return function(x, weight, eps, bias=bias, mode="layernorm")
    return function(x, residual, weight, eps, bias=bias, mode="layernorm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("n_cols", [37, 1031])
@pytest.mark.parametrize("name", LAYER_NORM_FUNCTIONS)
def test_layer_norm_functions_are_the_deprecated_layernorm_mode_bit_for_bit(name, n_cols, dtype):
    """The LayerNorm functions run what ``mode="layernorm"`` of the RMSNorm-named ones runs: the same outputs and
    gradients, bit for bit (fp32 and bf16 run the kernels, fp64 the PyTorch implementation), with the default
    eps of ``nn.LayerNorm`` (1e-5)."""
    inputs = _trained_like(5, n_cols, dtype, seed=n_cols)
    new = _call_new(name, *inputs)
    with pytest.warns(DeprecationWarning, match=DEPRECATED_MODE):
        old = _call_deprecated(name, *inputs, 1e-5)
    new, old = (out if isinstance(out, tuple) else (out,) for out in (new, old))
    for a, b in zip(new, old, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)

    g = torch.Generator().manual_seed(1)
    upstream = [torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype) for out in new]
    new_grads = torch.autograd.grad(new, inputs, upstream, allow_unused=True)
    old_grads = torch.autograd.grad(old, inputs, upstream, allow_unused=True)
    for a, b, leaf in zip(new_grads, old_grads, ("x", "residual", "weight", "bias")):
        assert (a is None) == (b is None) == (leaf == "residual" and name == "layer_norm")
        assert a is None or torch.equal(a, b), leaf


@pytest.mark.parametrize("name", LAYER_NORM_FUNCTIONS)
def test_the_layernorm_mode_of_the_rms_norm_functions_warns_once_naming_its_replacement(name):
    inputs = _trained_like(3, 37, torch.float32, seed=2)
    for grad in (False, True):  # the plain call and the autograd path
        with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _call_deprecated(name, *inputs, 1e-5)
        ours = [w for w in caught if w.category is DeprecationWarning and re.match(DEPRECATED_MODE, str(w.message))]
        assert len(ours) == 1
        message = str(ours[0].message)
        replaced = LAYER_NORM_FUNCTIONS[name][1].__name__
        assert message.startswith(f"{replaced}(mode='layernorm') computes a LayerNorm: call hf_rmsnorm.ops.{name} ")
        assert "\n" not in message
        assert ours[0].filename == __file__  # attributed to the caller's line, not to the package


def test_no_other_mode_and_no_layer_norm_function_warns():
    x, residual, weight, bias = _trained_like(3, 37, torch.float32, seed=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", DEPRECATED_MODE, DeprecationWarning)
        for mode in MODES:
            if mode != "layernorm":
                rms_norm(x, weight, 1e-5, bias=bias, mode=mode)
                fused_add_rms_norm(x, residual, weight, 1e-5, bias=bias, mode=mode)
                rms_norm_add(x, residual, weight, 1e-5, bias=bias, mode=mode)
        for name in LAYER_NORM_FUNCTIONS:
            _call_new(name, x, residual, weight, bias)
        # The mode-generic entries the package's own callers use, in the LayerNorm mode too.
        functional.norm(x, weight, 1e-5, bias=bias, mode="layernorm")
        functional.fused_add_norm(x, residual, weight, 1e-5, bias=bias, mode="layernorm")
        functional.norm_add(x, residual, weight, 1e-5, bias=bias, mode="layernorm")


def test_patched_layernorm_models_do_not_warn():
    """Patched LayerNorms run the LayerNorm mode through the mode-generic entries, which never warn: forward,
    backward and the fused adds of a GPT-2 block."""
    model = tiny("gpt2")
    report = patch_model(model)
    assert report.fused_adds
    with warnings.catch_warnings():
        warnings.filterwarnings("error", DEPRECATED_MODE, DeprecationWarning)
        model(ids()).logits.sum().backward()


def test_a_compiled_deprecated_call_traces_in_one_graph():
    """Dynamo cannot trace ``warnings.warn`` in a full graph: the deprecated spelling still compiles (only eager
    calls warn) and gives the LayerNorm function's result: that of an eager call without autograd too, which stores
    no statistics where the compiled forward does (on an H200 those two once ran different binaries and rounded an
    ulp apart at this width: tests/ops/test_kernels.py, ``test_inference_and_training_forwards_bind_one_...``)."""
    x, _, weight, bias = (t.detach() for t in _trained_like(3, 37, torch.float32, seed=4))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, w, b: rms_norm(a, w, 1e-5, bias=b, mode="layernorm"), fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(x, weight, bias), layer_norm(x, weight, bias))


WIDTH = 96


def _own_layernorms():
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    class NoBiasLayerNorm(nn.LayerNorm):  # a subclass of nn.LayerNorm, recognised by what it computes
        pass

    return {"nemotron_1p": NemotronLayerNorm1P(WIDTH), "olmo_weightless": OlmoLayerNorm(WIDTH),
            "subclass_without_bias": NoBiasLayerNorm(WIDTH, bias=False),
            "torch_without_affine": nn.LayerNorm(WIDTH, elementwise_affine=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(_own_layernorms()))
def test_layernorm_variants_are_patched_exactly(name, dtype):
    """Nemotron's ``weight + 1`` (rounded in the weight's dtype, as its forward does), OLMo's LayerNorm without
    parameters and a constant epsilon, a subclass without bias and a LayerNorm without affine parameters, with
    trained-like parameters: patched, no less accurate than eager against fp64, the fused add too."""
    norm = _own_layernorms()[name]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in norm.named_parameters():  # Nemotron's weight is an offset from 1: around 0
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if pname == "weight" and "1p" not in name else 0))
    norm = norm.to(DEVICE, dtype)
    container = nn.Sequential(norm)
    x = (torch.randn(4, 7, WIDTH, generator=gen) * 3).to(DEVICE, dtype)
    r = (torch.randn(4, 7, WIDTH, generator=gen) * 3).to(DEVICE, dtype)
    eager = norm(x + r)
    weight, bias = (getattr(norm, a, None) for a in ("weight", "bias"))
    truth = nn.functional.layer_norm(  # the module's maths in fp64 (OLMo's computes in fp32 whatever its input)
        (x + r).double(), (WIDTH,), None if weight is None else weight.double() + ("1p" in name),
        None if bias is None else bias.double(), getattr(norm, "eps", 1e-5))
    report = patch_model(container)
    assert report.norms == ["0"], report
    got, total = norm(x, residual=r)
    assert torch.equal(total, x + r) and got.dtype == eager.dtype
    scale = truth.abs().max().item()
    assert err(got, truth) <= err(eager, truth) + torch.finfo(dtype).eps * scale


# ----------------------------------------------------------------------------------- OPT: norms under tests


@pytest.mark.parametrize("mode", ["eager", "checkpointed", "checkpointed reentrant", "compiled"])
@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre-LN", "post-LN"])
def test_opt_fuses_every_add_with_the_logits_and_gradients_of_the_adds_apart(pre_ln, mode, monkeypatch):
    """OPT's norms read its sums under ``if self.do_layer_norm_before`` and through a flattening, its output add
    through a view (derived_sites' "Norms under tests"): all four adds fused, pre-LN (125m, 1.3b...) and post-LN
    (350m) alike, in training with dropout (its masks drawn in the original order), checkpointed either way, or
    compiled in one graph (in eval mode: before transformers 5.24 OPT draws its LayerDrop in training, which Dynamo
    cannot trace); the logits and every gradient those of the same kernels with the adds apart, bit for bit."""
    from patch_models import fused_and_unfused

    report, fused, unfused = fused_and_unfused(tiny("opt", do_layer_norm_before=pre_ln), monkeypatch)
    assert len(report.fused_adds) == 4
    _assert_trains_as_the_adds_apart(fused, unfused, mode, training_compiled=False)


def _assert_trains_as_the_adds_apart(fused, unfused, mode: str, training_compiled: bool = True) -> None:
    """One training step of ``fused`` and ``unfused`` (``fused_and_unfused``' models, four adds) in ``mode``: the
    four adds fused and none apart, logits and every gradient bit for bit. Dropout's masks are drawn from one seed;
    a compiled model runs in training mode only where ``training_compiled``."""
    from patch_models import training_step

    x = ids(seq=6)
    results = []
    for m in (fused, unfused):
        runner = m if mode == "compiled" and not training_compiled else m.train()
        if mode.startswith("checkpointed"):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode.endswith("reentrant")})
        torch._dynamo.reset()
        if mode == "compiled":
            runner = torch.compile(m, backend="aot_eager", fullgraph=True)
        torch.manual_seed(0)
        results.append(training_step(m, x, runner))
    (count, got, grads), (unfused_count, expected, expected_grads) = results
    assert (count, unfused_count) == (4, 0)
    assert torch.equal(got, expected)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre-LN", "post-LN"])
def test_opt_counts_every_add_next_to_a_norm_as_fused_with_parity(pre_ln, dtype, monkeypatch):
    """The residual census sees OPT's four adds next to norms (through the flattening and the view) and the patched
    model fuses them all; logits bitwise those of the adds apart, and no less accurate than eager against fp64.
    fp64 runs the PyTorch implementation (as CPU tensors do on a GPU host), whose adds are the fused ops' own."""
    model = tiny("opt", dtype, do_layer_norm_before=pre_ln)
    _assert_census_fuses_four_adds(model, dtype, monkeypatch, accuracy=dtype != torch.float64)


def _assert_census_fuses_four_adds(model, dtype, monkeypatch, accuracy: bool = True) -> None:
    """The residual census sees four adds next to ``model``'s LayerNorms and the patched model fuses them all, its
    logits bitwise those of the adds apart and, where ``accuracy``, no less accurate than eager against fp64."""
    from patch_models import patch_unfused

    from harness import residual_census

    x = ids()
    truth = logits(copy.deepcopy(model).double(), x)
    eager = logits(model, x)
    norms = {m for m in model.modules() if type(m) is nn.LayerNorm}
    run = lambda m: m(x)  # noqa: E731
    next_to_norms = residual_census.adds_next_to_norms(model, run, norms, 64)
    unfused = copy.deepcopy(model)
    patch_unfused(unfused, monkeypatch)
    patch_model(model)
    assert residual_census.fused_adds(model, run) == len(next_to_norms) == 4
    assert residual_census.unfused_sites(model, run, next_to_norms, 64) == []
    patched = logits(model, x)
    assert torch.equal(patched, logits(unfused, x))
    if accuracy:
        _assert_no_worse_than_eager(patched, eager, truth, dtype)


# (the hooked module, the hook kind) -> the adds still fused, of four: each layer's attention add (inside it, unless
# a hook watches its norm) and the two layer outputs handed on (layer 0's to layer 1, layer 1's to the final norm).
OPT_HOOKED = {
    ("model.decoder.layers.0.final_layer_norm", "pre"): 3,
    ("model.decoder.layers.1", "pre"): 2,
    ("model.decoder.layers.1", "forward"): 2,
    ("model.decoder.final_layer_norm", "forward"): 3,
}


@pytest.mark.parametrize("target, kind", list(OPT_HOOKED))
def test_opt_hooks_on_a_norm_or_a_layer_get_the_plain_calls(target, kind, monkeypatch):
    _assert_hooked_module_sees_the_plain_calls(tiny("opt"), target, kind, OPT_HOOKED[target, kind], monkeypatch)


def _assert_hooked_module_sees_the_plain_calls(model, target: str, kind: str, fused_while_hooked: int,
                                               monkeypatch) -> None:
    """A ``kind`` hook ("pre" or "forward") on ``model``'s ``target`` sees what it sees with the adds apart, the
    logits alike; ``fused_while_hooked`` of the four adds stay fused meanwhile, all four once it is removed."""
    from patch_models import fused_and_unfused

    from harness import residual_census

    _, fused, unfused = fused_and_unfused(model, monkeypatch)
    x = ids()
    seen = {}
    for name, m in (("fused", fused), ("unfused", unfused)):
        seen[name] = []
        module = m.get_submodule(target)
        if kind == "pre":
            handle = module.register_forward_pre_hook(lambda mod, args, into=seen[name]: into.append(args[0]))
        else:
            handle = module.register_forward_hook(
                lambda mod, args, out, into=seen[name]: into.append(out[0] if isinstance(out, tuple) else out))
        seen[name].append(logits(m, x))
        if name == "fused":
            assert residual_census.fused_adds(m, lambda model: model(x)) == fused_while_hooked
        handle.remove()
    assert len(seen["fused"]) == 3 and len(seen["unfused"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["fused"], seen["unfused"]))
    assert residual_census.fused_adds(fused, lambda model: model(x)) == 4


# ----------------------------------------------------------------------------------- BLOOM: sublayer outputs


def _bloom(dtype=torch.float32, post_ln=False, dropout=0.0):
    return tiny("bloom", dtype, apply_residual_connection_post_layernorm=post_ln, hidden_dropout=dropout,
                attention_dropout=dropout)


@pytest.mark.parametrize("mode", ["eager", "checkpointed", "checkpointed reentrant", "compiled"])
@pytest.mark.parametrize("post_ln", [False, True], ids=["residual-before-LN", "residual-after-LN"])
def test_bloom_fuses_every_add_with_the_logits_and_gradients_of_the_adds_apart(post_ln, mode, monkeypatch):
    """BLOOM's adds sit in its attention and MLP (``dropout_add``), whose output sums the block's
    ``post_attention_layernorm`` reads or the block returns to the next block's ``input_layernorm`` (or ``ln_f``):
    derived_sites' "Sublayer outputs". All four fused, whichever residual ``apply_residual_connection_post_layernorm``
    picks, in training with dropout (its masks drawn in the original order), checkpointed either way, or compiled in
    one graph; the logits and every gradient those of the same kernels with the adds apart, bit for bit."""
    from patch_models import fused_and_unfused

    report, fused, unfused = fused_and_unfused(_bloom(post_ln=post_ln, dropout=0.1), monkeypatch)
    assert len(report.fused_adds) == 4, str(report)
    _assert_trains_as_the_adds_apart(fused, unfused, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("post_ln", [False, True], ids=["residual-before-LN", "residual-after-LN"])
def test_bloom_counts_every_add_next_to_a_norm_as_fused_with_parity(post_ln, dtype, monkeypatch):
    """The residual census sees BLOOM's four adds next to norms and the patched model fuses them all; logits bitwise
    those of the adds apart, and (in every released BLOOM's configuration, the residual taken before the norm) no
    less accurate than eager against fp64. With the residual taken after the norm the logits are still bitwise the
    norms-only patch's (what the adds' fusion can change); that patch's own accuracy there is its norms' matter."""
    _assert_census_fuses_four_adds(_bloom(dtype, post_ln), dtype, monkeypatch, accuracy=not post_ln)


def test_bloom_generates_with_its_cache_and_unpatches_exactly():
    """Greedy generate() with the cache: the block's derived forward calls its attention with the cache as the
    original does; fp32 tokens identical. The patched block, attention and MLP keep their forwards' signatures, the
    state dict is untouched. Unpatched, the model is the original again: its classes, its logits."""
    model = _bloom()
    x = ids(batch=1, seq=5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected, eager = model.generate(x, **kwargs), logits(model, ids())
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(patch_model(model).fused_adds) == 4
    block = model.transformer.h[0]
    for module in (block, block.self_attention, block.mlp):
        original = type(module).__mro__[1]
        assert type(module) is not original and original.__module__ == "transformers.models.bloom.modeling_bloom"
        assert inspect.signature(type(module).forward) == inspect.signature(original.forward)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.generate(x, **kwargs), expected)
    unpatch_model(model)
    assert [type(m) for m in model.modules()] == classes
    assert not any(name.startswith("_hf_rmsnorm") for m in model.modules() for name in vars(m))
    assert torch.equal(logits(model, ids()), eager)


# (the hooked module, the hook kind) -> the adds still fused, of four: each block's attention add (into its
# post_attention_layernorm) and the two block outputs handed on (block 0's to block 1, block 1's to ln_f).
BLOOM_HOOKED = {
    ("transformer.h.0.post_attention_layernorm", "pre"): 3,
    ("transformer.h.0.self_attention", "forward"): 3,
    ("transformer.h.1.mlp", "forward"): 3,
    ("transformer.h.1.input_layernorm", "pre"): 3,
    ("transformer.h.1", "pre"): 2,
    ("transformer.h.1", "forward"): 2,
    ("transformer.ln_f", "forward"): 3,
}


@pytest.mark.parametrize("target, kind", list(BLOOM_HOOKED))
def test_bloom_hooks_on_a_norm_a_sublayer_or_a_block_get_the_plain_calls(target, kind, monkeypatch):
    """A hook on a norm, on the attention or MLP whose add would go into it, or on the block handing on or
    receiving, sees what it sees unpatched (the modules around it make the plain calls); the other adds stay fused,
    and all four again once the hook is removed."""
    _assert_hooked_module_sees_the_plain_calls(_bloom(), target, kind, BLOOM_HOOKED[target, kind], monkeypatch)
