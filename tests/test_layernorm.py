"""patch_model on pre-LN LayerNorm models: exact conversion to RMSNorm (hf_rmsnorm.conversion).

Kernels in Triton's interpreter. Logits are compared with the unpatched model and an fp64 copy of it; in
bf16 the converted model must be no less accurate than eager, up to one ulp of the largest logit (centring
rounds the writers' weights once more, an ulp-level change like the eager model's own rounding).
"""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from hf_rmsnorm import UnconvertibleModelError, UnsupportedModelError, patch_model, recentre, unpatch_model
from hf_rmsnorm.conversion import _StreamState

V = 128
FAMILIES = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neox": ("gpt_neox", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
    "gpt_neox_sequential": (
        "gpt_neox",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             use_parallel_residual=False),
    ),
    "opt": (
        "opt", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64)
    ),
    "phi": ("phi", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "gptj": ("gptj", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)),
    "stablelm": (
        "stablelm",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128),
    ),
}
# Converted LayerNorms per tiny model: two layers of (norms per layer) plus the final norm.
CONVERTED = {"gpt2": 5, "gpt_neox": 5, "gpt_neox_sequential": 5, "opt": 5, "phi": 3, "falcon": 3, "gptj": 3,
             "stablelm": 5}


def tiny(family, dtype=torch.float32, seed=0, **overrides):
    model_type, fields = FAMILIES[family]
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
    return model.to(dtype).eval()


def ids(batch=2, seq=8, seed=1):
    return torch.randint(3, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, x, **kwargs):
    with torch.no_grad():
        return model(x, **kwargs).logits


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def layernorms(model):
    return [n for n, m in model.named_modules() if type(m) is nn.LayerNorm]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_unpatched_and_fp64(family, dtype):
    model = tiny(family, dtype)
    x = ids()
    truth = logits(copy.deepcopy(model).double(), x)
    eager = logits(model, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lns = layernorms(model)

    report = patch_model(model)
    patched = logits(model, x)
    scale = truth.abs().max().item()
    assert len(report.converted) == CONVERTED[family] and set(report.converted) <= set(lns)
    assert list(model.state_dict()) == list(state)
    if dtype == torch.float32:
        assert report.centred and "(centred at run time)" in report.centred[0]
        assert err(patched, eager) <= 1e-4 * scale
        assert err(patched, truth) <= 1e-5 * scale
    else:
        # Half precision: no weight is touched (centring would re-round them); the fused LayerNorm mode runs.
        assert "nothing (fp16/bf16 writers" in report.centred[0]
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert err(patched, truth) <= err(eager, truth) + torch.finfo(dtype).eps * scale
        # The mean error is what scripts/verify.py judges (it allows 1.10x).
        assert (patched.double() - truth).abs().mean() <= 1.05 * (eager.double() - truth).abs().mean()

    unpatch_model(model)
    assert layernorms(model) == lns and list(model.state_dict()) == list(state)
    # The centred weights give the same outputs in the original LayerNorm model.
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert err(logits(model, x), truth) <= err(eager, truth) + tol * scale


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_identical_in_fp32(family):
    model = tiny(family)
    x = ids(batch=1, seq=5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(x, **kwargs)
    patch_model(model)
    assert torch.equal(model.generate(x, **kwargs), expected)


def test_tied_embeddings_stay_tied_and_untouched():
    model = tiny("gpt2")
    table = model.transformer.wte.weight.detach().clone()
    assert model.lm_head.weight is model.transformer.wte.weight
    report = patch_model(model)
    logits(model, ids())  # the first inference forward centres the writers
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, table) and "lm_head" not in " ".join(report.centred)
    assert report.centred[1:] == [
        "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_proj",
        "transformer.h.1.mlp.c_proj",
    ]
    for layer in model.transformer.h:
        for writer in (layer.attn.c_proj, layer.mlp.c_proj):  # Conv1D: weight [in, out]
            assert writer.weight.double().mean(1).abs().max() < 1e-6 and abs(writer.bias.double().mean()) < 1e-6


def test_inputs_embeds_from_outside_are_exact():
    model = tiny("phi")
    x = ids()
    embeds = torch.randn(2, 8, 64) + 0.5  # not centred, not from the model's table
    expected = logits(model, None, inputs_embeds=embeds)
    patch_model(model)
    assert err(logits(model, None, inputs_embeds=embeds), expected) <= 1e-5 * expected.abs().max().item()
    assert err(logits(model, x), logits(model, None, inputs_embeds=model.get_input_embeddings()(x))) == 0


def _train(model, steps=4):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x = ids(seed=10 + step)
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "gpt_neox_sequential"])
def test_training_matches_the_unpatched_model_then_inference_stays_exact(family, monkeypatch):
    # Dropout off: the exactness claim is about the maths, not about matching random masks.
    model = tiny(family, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if family == "gpt2" else tiny(family)
    reference = copy.deepcopy(model)
    patch_model(model)
    expected = _train(reference.train())
    got = _train(model.train())
    assert max(abs(a - b) / abs(b) for a, b in zip(got, expected)) < 1e-5, (got, expected)

    model.eval(), reference.eval()
    modes = []
    original_mode = _StreamState.mode
    monkeypatch.setattr(_StreamState, "mode", lambda self, *a: modes.append(original_mode(self, *a)) or modes[-1])
    x = ids(seed=3)
    truth = logits(reference, x)
    # The optimizer moved the writers off centre: inference falls back to the exact LayerNorm mode ...
    assert err(logits(model, x), truth) <= 1e-4 * truth.abs().max().item()
    assert set(modes) == {"layernorm"}
    # ... until recentre() centres them again.
    modes.clear()
    recentre(model)
    assert err(logits(model, x), truth) <= 1e-4 * truth.abs().max().item()
    assert set(modes) == {"fp32_affine"}


def test_loading_weights_falls_back_to_the_layernorm_mode():
    model = tiny("opt")
    original = copy.deepcopy(model)
    patch_model(model)
    model.load_state_dict(original.state_dict())  # uncentred writers again
    x = ids()
    assert err(logits(model, x), logits(original, x)) <= 1e-5 * logits(original, x).abs().max().item()


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def _assert_untouched(model, snapshot):
    state, classes = snapshot
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [type(m) for m in model.modules()] == classes
    assert not any("_hf_rmsnorm" in k for m in model.modules() for k in m.__dict__)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_bert_is_refused_and_left_untouched():
    from transformers import BertConfig, BertLMHeadModel

    model = BertLMHeadModel(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True))
    before = _snapshot(model)
    with pytest.raises(UnconvertibleModelError, match=r"BertLMHeadModel .*post-LN.*GPT-2") as error:
        patch_model(model)
    assert isinstance(error.value, UnsupportedModelError) and isinstance(error.value, ValueError)
    _assert_untouched(model, before)


def test_post_ln_opt_is_refused_and_left_untouched():
    model = tiny("opt", do_layer_norm_before=False)
    before = _snapshot(model)
    with pytest.raises(UnconvertibleModelError, match=r"post-LN \(do_layer_norm_before=False"):
        patch_model(model)
    _assert_untouched(model, before)


def test_layernorm_skip_leaves_layernorms_alone():
    model = tiny("gpt2")
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError) as error:
        patch_model(model, layernorm="skip")
    assert not isinstance(error.value, UnconvertibleModelError)
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="layernorm must be"):
        patch_model(model, layernorm="yes")


def test_a_failure_midway_restores_weights_classes_and_hooks(monkeypatch):
    model = tiny("gpt_neox")
    before = _snapshot(model)

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(nn.Module, "register_forward_pre_hook", fail)
    with pytest.raises(RuntimeError, match="boom"):
        patch_model(model)
    _assert_untouched(model, before)


def test_qk_layernorms_are_left_alone_and_report_reads_well():
    model = tiny("phi", qk_layernorm=True)
    report = patch_model(model)
    skipped = dict(report.skipped)
    assert type(model.model.layers[0].self_attn.q_layernorm) is nn.LayerNorm
    assert "does not read the residual stream" in skipped["model.layers.0.self_attn.q_layernorm"]
    text = str(report)
    assert text.splitlines()[0].startswith("hf_rmsnorm: 3 norms patched (Phi), 2 residual adds fused, 4 skipped; "
                                           "3 LayerNorms converted to RMSNorm")
    assert ("  centred (exact conversion):\n    model input (centred at run time); the writers below at the first "
            "inference forward, unless the model trains first\n    model.layers.0.self_attn.dense") in text


# Residual adds fused per tiny model (2 layers): the sequential pre-LN blocks fit the generic layer body (the
# attention add always, the MLP add in inference), the parallel blocks the generic parallel body (their one
# add, in inference); Falcon's, StableLM's and OPT's layers keep their forward.
FUSED_ADDS = {"gpt2": 4, "gpt_neox": 2, "gpt_neox_sequential": 4, "opt": 0, "phi": 2, "falcon": 0, "gptj": 2,
              "stablelm": 0}
PARALLEL = ("gpt_neox", "phi", "gptj")


@pytest.mark.parametrize("family", FAMILIES)
def test_sequential_blocks_fuse_their_residual_adds(family):
    model = tiny(family)
    x = ids(seed=4)
    truth = logits(model, x)
    report = patch_model(model)
    assert len(report.fused_adds) == FUSED_ADDS[family], report.fused_adds
    if family in PARALLEL:
        assert all(" parallel residual -> " in line and line.endswith("(inference)") for line in report.fused_adds)
    elif FUSED_ADDS[family]:
        assert sum("(inference)" in line for line in report.fused_adds) == FUSED_ADDS[family] // 2
    # Inference (the handoff between layers) and autograd (attention adds only, LayerNorm mode) both exact.
    assert err(logits(model, x), truth) <= 1e-5 * truth.abs().max().item()
    assert err(model(x).logits, truth) <= 1e-5 * truth.abs().max().item()


def test_gpt2_with_cross_attention_keeps_its_block_forward():
    model = tiny("gpt2", add_cross_attention=True)
    report = patch_model(model)
    assert report.fused_adds == []
    assert "crossattention" in dict(report.skipped)["transformer.h.0"]


@pytest.mark.parametrize("family", PARALLEL)
def test_parallel_blocks_draw_dropout_masks_in_the_original_order(family):
    # Every dropout active in train mode: the patched body must call them in HF's order (same random masks).
    drop = {"gpt_neox": dict(hidden_dropout=0.3, attention_dropout=0.2),
            "phi": dict(resid_pdrop=0.3, attention_dropout=0.2, embd_pdrop=0.1),
            "gptj": dict(resid_pdrop=0.3, attn_pdrop=0.2, embd_pdrop=0.1)}[family]
    model = tiny(family, **drop)
    reference = copy.deepcopy(model)
    report = patch_model(model)
    assert len(report.fused_adds) == 2
    # Uncentred writers again, so the norms run the exact LayerNorm mode: a dropout mask uncentres a centred
    # writer's output, which the pure RMSNorm mode of the conversion does not account for.
    model.load_state_dict(reference.state_dict())
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
    """GPT-2's default dropouts (0.1) active: a model that trains before any inference keeps its writers as
    they are, so every dropout mask falls on the original outputs; later inference is not centred either."""
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
            assert torch.equal(writer, before)  # not centred behind the training's back
            for m in (model, reference):
                m.train()


def test_recentre_leaves_half_precision_writers_alone():
    model = tiny("gpt2", torch.bfloat16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = ids(seed=6)
    eager = logits(model, x)
    patch_model(model)
    recentre(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, x), eager)
