"""T5 and its relatives (mT5, UMT5, LongT5, SwitchTransformers): their norm casts the normalised row to the
weight's dtype before the multiply, the ``t5`` mode (``hf_rmsnorm.ops.modes``). Each is a tiny random
encoder-decoder of transformers' own classes (and T5's encoder alone), patched, and compared with its eager self
and with an fp64 copy, forward and backward.

Their residual adds (``hidden_states + dropout(layer_output)`` ending each ``T5Layer*`` sublayer) go into the next
sublayer's input norm, the next block's first one or the stack's final norm: the block's forward hands each
sublayer's normed output sum to the next (``hf_rmsnorm.patch.derived_blocks``), and the stack's loop hands the
block's on (``hf_rmsnorm.patch.handoff``). Every fused run is held bitwise to the same kernels with the adds apart.
"""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, T5EncoderModel
from transformers.modeling_layers import GradientCheckpointingLayer

from harness import residual_census
from hf_rmsnorm import patch_model, unpatch_model
from patch_models import Parity, input_ids, patch_unfused

# The tiny config of every case: 2 encoder and 2 decoder blocks of width 64.
TINY = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# Per type: its own config fields, and its norms (each block: one per sublayer, 2 in the encoder, 3 in the decoder;
# plus a final norm each side).
CASES = {
    "t5": ({}, 12),
    "mt5": ({}, 12),
    "umt5": ({}, 12),
    "longt5": ({}, 12),
    "switch_transformers": (dict(num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1,
                                 num_sparse_decoder_layers=1), 12),
}


def _tiny(model_type: str, config: dict, cls=AutoModelForSeq2SeqLM):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **config)
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    with torch.no_grad():  # trained-like norm weights: a weight of ones hides the order of the roundings
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.normal_(1.0, 0.3)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, decoder_input_ids=ids[:, :5]).logits.double()


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids[:, :5].contiguous()).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_t5_family_patches_with_parity(model_type):
    """Every norm patched in the t5 mode; fp32 logits equal to eager's, bf16 no less accurate than eager bf16
    against fp64 (``Parity``); unpatching restores the eager model."""
    config, norms = CASES[model_type]
    ids = input_ids()
    model = _tiny(model_type, config)
    parity = Parity(model, lambda m: _logits(m, ids))
    report = patch_model(model)
    assert len(report.norms) == norms, str(report)
    assert {type(m)._hf_rmsnorm_kind.mode for name, m in model.named_modules() if name in report.norms} == {"t5"}
    parity.check_patched()


@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_t5_family_trains_like_eager(model_type):
    """A training step (dropout off) gives eager's loss and gradients, to fp32's reduction order."""
    config, _ = CASES[model_type]
    ids = input_ids()
    model = _tiny(model_type, dict(config, dropout_rate=0.0)).train()
    eager = copy.deepcopy(model)
    patch_model(model)
    loss, grads = _loss_and_grads(model, ids)
    eager_loss, eager_grads = _loss_and_grads(eager, ids)
    assert abs(loss.item() - eager_loss.item()) <= 1e-6 * abs(eager_loss.item())
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        scale = eager_grads[name].abs().max().item()
        assert (grad - eager_grads[name]).abs().max().item() <= 1e-5 * max(scale, 1e-6), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_t5_encoder_keeps_eager_outputs(dtype):
    """A half-precision T5 encoder (norm weights of its dtype: the row is rounded to it before the multiply) gives
    eager's hidden states to within a rounding of the half dtype (fp32 reductions in another order can move a
    normalised value to the neighbouring half number)."""
    ids = input_ids()
    model = _tiny("t5", {}, T5EncoderModel).to(dtype)
    with torch.no_grad():
        eager = model(ids).last_hidden_state
        report = patch_model(model)
        patched = model(ids).last_hidden_state
    assert len(report.norms) == 5 and patched.dtype == eager.dtype
    scale = eager.abs().max().item()
    assert (patched.double() - eager.double()).abs().max().item() <= 2 * torch.finfo(dtype).eps * scale


def test_auto_model_of_t5_patches_encoder_and_decoder():
    """``AutoModel`` (T5Model, no LM head) gets its 12 norms patched too, with eager's fp32 hidden states."""
    ids = input_ids()
    model = _tiny("t5", {}, AutoModel)
    with torch.no_grad():
        eager = model(ids, decoder_input_ids=ids[:, :5]).last_hidden_state
        report = patch_model(model)
        patched = model(ids, decoder_input_ids=ids[:, :5]).last_hidden_state
    assert len(report.norms) == 12
    torch.testing.assert_close(patched, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


# The residual adds of a tiny encoder-decoder's forward (2 encoder blocks of 2 sublayers, 2 decoder blocks of 3),
# every one of them next to a norm: the next sublayer's, the next block's first or the final norm.
ADDS = 2 * 2 + 2 * 3


def _seq2seq_run(ids):
    return lambda m: m(ids, labels=ids[:, :5].contiguous())


def _fused_and_unfused(model_type: str, dtype: torch.dtype, monkeypatch, cls=AutoModelForSeq2SeqLM):
    model = _tiny(model_type, dict(CASES[model_type][0], dropout_rate=0.0), cls).to(dtype).train()
    fused, unfused = copy.deepcopy(model), copy.deepcopy(model)
    patch_model(fused)
    patch_unfused(unfused, monkeypatch)
    return model, fused, unfused


def _step(model, run, runner=None) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward of ``runner`` (``model`` or a compiled form of it), counting the adding kernels, and
    its backward: ``(fused adds, logits, gradients)``."""
    outputs = []
    torch.manual_seed(0)  # SwitchTransformers' router draws its jitter noise in training
    count = residual_census.fused_adds(model if runner is None else runner, lambda m: outputs.append(run(m)),
                                       grad=True)
    model.zero_grad()
    outputs[0].loss.backward()
    return count, outputs[0].logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}


def _assert_same(result, expected) -> None:
    (_, logits, grads), (_, expected_logits, expected_grads) = result, expected
    assert torch.equal(logits, expected_logits)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", sorted(CASES))
def test_every_add_goes_into_the_next_norm_with_the_unfused_results(model_type, dtype, monkeypatch):
    """In fp32 and bf16 every residual add next to a norm (the census of the unpatched model) runs in a norm
    kernel, with the logits of the same kernels with the adds apart, bit for bit; in fp32 every gradient too (in
    bf16 the fused kernel's backward adds the sum's two gradients in fp32 and rounds once, where autograd rounds
    the norm's gradient to bf16 before adding: the same as every fused add's, ``test_handoff.py``)."""
    ids = input_ids()
    model, fused, unfused = _fused_and_unfused(model_type, dtype, monkeypatch)
    norms = {m for m in model.modules() if type(m).__name__.endswith("LayerNorm")}
    with torch.no_grad():
        census = residual_census.adds_next_to_norms(model, _seq2seq_run(ids), norms, model.config.d_model)
    result = _step(fused, _seq2seq_run(ids))
    expected = _step(unfused, _seq2seq_run(ids))
    assert len(census) == ADDS and result[0] == ADDS and expected[0] == 0
    if dtype == torch.float32:
        _assert_same(result, expected)
    assert torch.equal(result[1], expected[1])


@pytest.mark.parametrize("mode", ["compiled", "blocks compiled", "checkpointed", "checkpointed reentrant"])
def test_compiled_and_checkpointed_t5_fuse_every_add_with_the_unfused_gradients(mode, monkeypatch):
    """torch.compile (the model in one graph, or each block in its own) and activation checkpointing (either
    kind: the normed sum a block receives is one of its checkpoint's inputs) fuse every add eager does, with the
    logits of the adds apart bit for bit, and their gradients bit for bit too but under reentrant checkpointing:
    there T5's gradients are not eager's bit for bit even unpatched (its recomputation in the backward sums them
    in another order), so the fused run's are held to the unfused run's to fp32's reduction order, as
    ``test_t5_family_trains_like_eager`` holds a patched run to eager's."""
    ids = input_ids(seq=6)
    _, fused, unfused = _fused_and_unfused("t5", torch.float32, monkeypatch)
    results = []
    for m in (fused, unfused):
        if mode.startswith("checkpointed"):
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": mode.endswith("reentrant")})
        torch._dynamo.reset()
        runner = None
        if mode == "compiled":
            runner = torch.compile(m, backend="aot_eager", fullgraph=True)
        elif mode == "blocks compiled":
            for block in m.modules():
                if isinstance(block, GradientCheckpointingLayer):
                    block.compile(backend="aot_eager", fullgraph=True)
        results.append(_step(m, lambda r: r(ids, labels=ids[:, :5].contiguous(), use_cache=False), runner))
    (count, logits, grads), (unfused_count, expected_logits, expected) = results
    assert (count, unfused_count) == (ADDS, 0) and torch.equal(logits, expected_logits)
    if mode != "checkpointed reentrant":
        _assert_same(*results)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        scale = grad.abs().max().item()
        assert (grads[name] - grad).abs().max().item() <= 1e-5 * max(scale, 1e-6), name


@pytest.mark.parametrize("model_type", ["t5", "longt5"])  # the clamp's test: a comparison; one ``and`` a call
def test_fp16_clamp_withdraws_every_handoff_and_stays_exact(model_type, monkeypatch):
    """In fp16 the block's clamp branch runs after every sublayer and may change the sum (here it does: the
    embeddings sit at fp16's largest value and the first attention's output is large, so its sum overflows), so
    each handoff is withdrawn and the next norm normalises the clamped sum itself: the unfused patch's logits, no
    NaN, bit for bit."""
    ids = input_ids()
    model, fused, unfused = _fused_and_unfused(model_type, torch.float16, monkeypatch)
    for m in (model, fused, unfused):
        with torch.no_grad():
            m.shared.weight.copy_(torch.finfo(torch.float16).max * torch.sign(m.shared.weight.float()).half())
            attention_output = next(p for n, p in m.encoder.block[0].layer[0].named_parameters() if ".o." in n)
            attention_output.mul_(1000)
    overflowed = []
    handle = model.encoder.block[0].layer[0].register_forward_hook(
        lambda module, args, output: overflowed.append(torch.isinf(output[0]).any().item()))
    with torch.no_grad():
        _seq2seq_run(ids)(model)
        handle.remove()
        logits = _seq2seq_run(ids)(fused).logits
        assert torch.equal(logits, _seq2seq_run(ids)(unfused).logits)
    assert overflowed == [True] and not torch.isnan(logits).any()  # an overflowed sum normed would be NaN


@pytest.mark.parametrize("where", ["decoder.block.0.layer.1", "decoder.block.0.layer.2.layer_norm",
                                   "decoder.block.1", "encoder.block.1.layer.0"])
def test_a_hook_on_a_block_sublayer_or_norm_gets_the_plain_calls(where, monkeypatch):
    """A forward hook on a sublayer, a norm or a block sees its plain call: the handoffs touching it are not made
    (the others are), with the unfused results; removed, every add is fused again."""
    ids = input_ids()
    _, fused, unfused = _fused_and_unfused("t5", torch.float32, monkeypatch)
    seen = []
    handle = fused.get_submodule(where).register_forward_hook(lambda module, args, output: seen.append(args))
    with torch.no_grad():
        count = residual_census.fused_adds(fused, _seq2seq_run(ids))
        assert torch.equal(_seq2seq_run(ids)(fused).logits, _seq2seq_run(ids)(unfused).logits)
    assert 0 < count < ADDS and seen and all(len(args) == len(seen[0]) for args in seen)
    assert not any(isinstance(a, torch.Tensor) and a.shape == seen[0][0].shape for a in seen[0][1:])
    handle.remove()
    assert residual_census.fused_adds(fused, _seq2seq_run(ids)) == ADDS


def test_t5_encoder_alone_fuses_its_adds(monkeypatch):
    """T5EncoderModel: each block's self-attention add goes into its feed-forward's norm, each feed-forward's into
    the next block's first norm or the final norm; the hidden states are the unfused patch's."""
    ids = input_ids()
    _, fused, unfused = _fused_and_unfused("t5", torch.float32, monkeypatch, T5EncoderModel)
    report = patch_model(fused)
    assert len(report.fused_adds) == 4
    with torch.no_grad():
        assert residual_census.fused_adds(fused, lambda m: m(ids)) == 4
        assert torch.equal(fused(ids).last_hidden_state, unfused(ids).last_hidden_state)


def test_generate_with_cache_and_unpatch_restore_t5():
    """generate() with its cache (the decoder's cross-attention on every step) gives eager's tokens; unpatching
    restores every class and leaves no attribute behind, the state dict unchanged."""
    ids = input_ids()
    model = _tiny("t5", {})
    eager = copy.deepcopy(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {name: type(m) for name, m in model.named_modules()}
    report = patch_model(model)
    assert len(report.fused_adds) == ADDS
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    unpatch_model(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert not [name for name, m in model.named_modules() if any(k.startswith("_hf_rmsnorm") for k in vars(m))]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_sublayer_norm_replaced_after_patching_gets_the_plain_calls(monkeypatch):
    """A norm put in a sublayer after patching (PEFT's ``modules_to_save`` wraps one so): the handoff into it is
    not made, the others are, and the results are those of the unfused patch with the same replacement."""
    ids = input_ids()
    _, fused, unfused = _fused_and_unfused("t5", torch.float32, monkeypatch)
    for m in (fused, unfused):
        sublayer = m.encoder.block[0].layer[1]
        replacement = type(sublayer.layer_norm).__mro__[1](m.config.d_model)  # the original class
        replacement.load_state_dict(sublayer.layer_norm.state_dict())
        sublayer.layer_norm = replacement
    with torch.no_grad():
        assert residual_census.fused_adds(fused, _seq2seq_run(ids)) == ADDS - 1
        assert torch.equal(_seq2seq_run(ids)(fused).logits, _seq2seq_run(ids)(unfused).logits)
