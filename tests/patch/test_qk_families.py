"""The fused q/k norms + RoPE on the real transformers classes of every family with q/k norms (``family_cases``'
``qk`` column): what the report lists, parity with the unpatched model (fp32 logits, bf16 against fp64, gradients),
every cache kind, both checkpointing kinds, PEFT LoRA on the projections, torch.compile(fullgraph=True), and the
ops a patched layer dispatches (the README's launch-savings rows)."""

from __future__ import annotations

import collections
import functools
import inspect
import types
import warnings

import pytest
import torch
from family_cases import CASES
from patch_models import OpCounter, Parity, assert_patch_keeps_greedy_tokens, input_ids, training_step
from qk_generate import CPU_CACHES, GENERATE_QK, compiled_fullgraph, counting_launches
from qk_generate import generated as _generated
from qk_generate import qk_model as _model
from torch.utils._python_dispatch import _disable_current_modes

from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.ops.functional import BoundNorm
from hf_rmsnorm.patch import handoff, qk_attention, qk_runtime
from hf_rmsnorm.patch.qk_attention import UNFUSED

QK_CASES = [name for name, case in CASES.items() if case.qk]
# One of each layout (per head before and after the transpose, over the whole projection) and an MoE.
MAIN_QK = ["qwen3", "gemma3_text", "olmo2", "qwen3_moe"]


@pytest.mark.parametrize("name", QK_CASES)
def test_the_report_lists_each_attention_fused(name):
    report = patch_model(_model(name))
    assert len(report.fused_qk) == CASES[name].qk
    assert not [reason for _, reason in report.skipped if reason.startswith(UNFUSED)] and not report.qk_apart
    modules = "attention module" if CASES[name].qk == 1 else "attention modules"
    assert str(report).splitlines()[0].endswith(
        f"; q/k norms fused with the RoPE in {CASES[name].qk} {modules} (0 left apart)")


@pytest.mark.parametrize("name, label", [
    ("nanochat", "apply_rotary_pos_emb at line {line}, then q_norm, k_norm (per head) -> one qk_rope_norm launch "
                 "(full rotary, the opposite angle)"),
    ("hunyuan_v1_dense", "apply_rotary_pos_emb at line {line}, then query_layernorm, key_layernorm (per head) -> one "
                         "qk_rope_norm launch (full rotary)"),
])
def test_the_rope_before_the_norms_is_one_launch(name, label):
    """NanoChat and HunYuan rotate, then normalise (NanoChat by the opposite angle: its rotate_half returns
    ``(x2, -x1)``): the report names the order; the fp32 logits are the unpatched model's (the parity test)."""
    model = _model(name)
    report = patch_model(model)
    attention = type(model.model.layers[0].self_attn).__mro__[1]
    source, first = inspect.getsourcelines(attention.forward)
    line = first + next(i for i, text in enumerate(source) if "= apply_rotary_pos_emb(" in text)
    assert report.fused_qk == [f"model.layers.{i}.self_attn: {label.format(line=line)}" for i in range(2)]


def _logits(model):
    with torch.no_grad():
        return model(input_ids()).logits


@pytest.mark.parametrize("name", QK_CASES)
def test_parity_with_the_unpatched_model(name, monkeypatch):
    """fp32 logits within 1e-5 of the largest; bf16 no less accurate than eager against fp64; unpatching gives the
    eager logits back; the fused launch runs in both dtypes."""
    model = _model(name)
    parity = Parity(model, _logits)
    patch_model(model)
    with counting_launches(monkeypatch) as launches:
        parity.check_patched()
    assert launches[0] >= 2 * CASES[name].qk_launches


@pytest.mark.parametrize("name", [*MAIN_QK, "exaone4", "gemma4_text_qk"])
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_gradients_match_the_unpatched_model(name, checkpointing, monkeypatch):
    """Gradients within 1e-4 of the largest, without and with either kind of activation checkpointing."""
    grads = {}
    for patched in (False, True):
        model = _model(name).train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        if patched:
            patch_model(model)
        with counting_launches(monkeypatch) as launches:
            _, _, grads[patched] = training_step(model, input_ids())
        assert (launches[0] > 0) == patched
    for key, grad in grads[False].items():
        scale = grad.abs().max().item()
        assert (grads[True][key] - grad).abs().max().item() <= 1e-4 * scale, key




@pytest.mark.parametrize("name", GENERATE_QK)
@pytest.mark.parametrize("cache", CPU_CACHES)
def test_generate_with_every_cache_kind(name, cache, monkeypatch):
    model = _model(name)
    model.generation_config.cache_implementation = None if cache == "dynamic" else cache
    with counting_launches(monkeypatch) as launches:
        assert_patch_keeps_greedy_tokens(model, input_ids(seq=6), new_tokens=4)
    assert launches[0] >= 4 * CASES[name].qk_launches


def test_generate_compiles_the_patched_model_as_on_a_gpu():
    """generate() with a static cache compiles the model's forward itself on a GPU (transformers' auto-compile,
    forced here on the CPU by its compile config, with fullgraph): the patched OLMo 2 (q/k norms with the RoPE,
    post-norm adds) gives the compiled unpatched model's greedy tokens, each step's logits within 1e-5 of the
    largest, in one graph, and torch.compile traces it without a warning from hf_rmsnorm's code."""
    from transformers import CompileConfig

    model = _model("olmo2")
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # what a GPU device gives
    model.generation_config.cache_implementation, model.generation_config.compile_config = "static", config
    ids = input_ids(seq=6)
    torch._dynamo.reset()
    expected_tokens, expected_logits = _generated(model, ids)
    patch_model(model)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, logits = _generated(model, ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled
    assert not _warnings_of_ours(caught)
    assert torch.equal(tokens, expected_tokens)
    assert (logits - expected_logits).abs().max().item() <= 1e-5 * expected_logits.abs().max().item()


@pytest.fixture
def quanto_python_unpack(monkeypatch):
    """optimum-quanto's CPU kernel of its ``quanto::unpack`` op (the 4-bit codes back to bytes) is a C++ extension
    it compiles on first use: about 80 s of compiler in each fresh environment, so in each CI leg. The op's
    default kernel, quanto's Python ``unpack``, computes the same integers with shifts and masks, so the cache
    holds the same codes either way; the unpatched and the patched run both go through it."""
    pytest.importorskip("optimum.quanto", reason="the quantized cache needs optimum-quanto")
    from optimum.quanto.library.extensions import get_extension

    default_kernel = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    unpack = functools.partial(torch.ops.quanto.unpack.default.redispatch, default_kernel)
    monkeypatch.setattr(get_extension("quanto_cpp"), "_lib", types.SimpleNamespace(unpack=unpack))


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])  # transformers refuses it for Gemma 3's sliding layers
def test_generate_with_the_quantized_cache(name, monkeypatch, quanto_python_unpack):
    """optimum-quanto's 4-bit cache, requantizing past 2 recent tokens: the quantized keys are those of the fused
    launch, and quantizing them gives the same tokens."""
    model = _model(name)
    model.generation_config.cache_implementation = "quantized"
    model.generation_config.cache_config = {"backend": "quanto", "nbits": 4, "residual_length": 2}
    with counting_launches(monkeypatch) as launches:
        assert_patch_keeps_greedy_tokens(model, input_ids(seq=6), new_tokens=4)
    assert launches[0] >= 4 * CASES[name].qk_launches


@pytest.mark.parametrize("order", ["patch first", "lora first"])
def test_lora_on_the_projections(order, monkeypatch):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    reference = get_peft_model(_model("qwen3").train(), config)
    model = _model("qwen3").train()
    if order == "patch first":
        patch_model(model)
        model = get_peft_model(model, config)
    else:
        model = get_peft_model(model, config)
        patch_model(model)
    model.load_state_dict(reference.state_dict())
    assert len(patch_model(model).fused_qk) == 2
    grads = {}
    for label, m in (("eager", reference), ("patched", model)):
        with counting_launches(monkeypatch) as launches:
            _, logits, grads[label] = training_step(m, input_ids())
        assert (launches[0] > 0) == (label == "patched")
    lora = [key for key in grads["eager"] if "lora_" in key]
    assert lora
    for key in lora:
        scale = grads["eager"][key].abs().max().item()
        assert (grads["patched"][key] - grads["eager"][key]).abs().max().item() <= 1e-4 * scale, key
    unpatch_model(model)
    assert all(type(m).__module__.startswith(("transformers", "peft", "torch")) for m in model.modules())


def _warnings_of_ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings hf_rmsnorm's code drew while a patched model was compiled and run: Dynamo warns the user of
    every cache wrapper it traces through (``lru_cache``), which the host-side caches avoid by stepping aside while
    it traces (``hf_rmsnorm/ops/host_cache.py``)."""
    return [str(w.message) for w in caught
            if "hf_rmsnorm" in str(w.filename) + str(w.message) or "lru_cache" in str(w.message)]


# The fused operators a compiled patched layer records: the q/k one, and Gemma 3's sandwich (norm, add and norm).
COMPILED_OPERATORS = {"qwen3": ("qk_norm_rope_fwd",), "olmo2": ("qk_norm_rope_fwd",),
                      "gemma3_text": ("qk_norm_rope_fwd", "norm_add_norm_fwd"), "nanochat": ("qk_norm_rope_fwd",)}


@pytest.mark.parametrize("name", list(COMPILED_OPERATORS))
def test_torch_compile_fullgraph_calls_the_fused_operator(name):
    model = _model(name)
    expected = _logits(model)
    patch_model(model)
    compiled, graphs = compiled_fullgraph(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _logits(compiled)
    assert not _warnings_of_ours(caught)
    assert all(any(operator in graph for graph in graphs) for operator in COMPILED_OPERATORS[name])
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


# ----------------------------------------------------------------------------------- ops a patched layer dispatches


class _NonViewCounter(OpCounter):
    """``OpCounter`` without views: ops that alias their input, and ``_unsafe_view`` (a reshape of a tensor no one
    else holds, which copies nothing). One Triton launch counts one op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ != "_unsafe_view":
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _layer_ops(name: str, monkeypatch, *, fuse_qk: bool) -> collections.Counter[str]:
    """Ops of one patched decoder layer of ``name`` in bf16, by name, from models of 2 and 3 layers."""
    totals = {}
    for depth in (2, 3):
        model = _model(name, torch.bfloat16, layers=depth)
        with monkeypatch.context() as patch:
            if not fuse_qk:
                patch.setattr(qk_attention, "plan_attention", lambda modules, norms, problem: ([], []))
            patch_model(model)
        counter = _NonViewCounter()
        with monkeypatch.context() as patch, torch.no_grad():
            for method in ("norm", "fused_add_norm", "norm_add", "norm_add_norm"):
                patch.setattr(BoundNorm, method, counter.count_kernels(getattr(BoundNorm, method)))
            for name_ in ("qk_norm_rope", "qk_rope_norm"):
                patch.setattr(qk_runtime, name_, counter.count_kernels(getattr(qk_runtime, name_)))
            with counter:
                model(input_ids())
        totals[depth] = counter.counts
    return totals[3] - totals[2]


# Ops of one tiny layer in bf16, (q/k norms apart, fused with the RoPE) (README's launch-savings table): the q/k
# norms and RoPE were 2 norm kernels and 10 aten ops (mul, neg, cat, mul, add for each of q and k), now 1 launch;
# OLMo 2's RoPE casts back to bf16 either way. Gemma 3 saves one op more: normalised apart, its heads left the norm
# kernel in a layout for which SDPA copies its output (a clone); its count includes 5 ops of SDPA's repeat_kv and
# mask (2 clone, 2 scalar_tensor, 1 where); and two more again, in either count: its post-attention norm, the add
# after it and the pre-feedforward norm of the sum are one launch (``norm_add_norm``), and so are its
# post-feedforward norm, the layer's output add and the next layer's input norm (a handoff). NanoChat rotates,
# then normalises (no weight): 2 norm kernels and 10 aten ops (its RoPE's 8: mul, neg, cat, add for each, of which the
# products by sin and cos are 4 mul; its attention's clone of the heads SDPA copies, as Gemma 3's) become 1 launch.
LAYER_OPS = {"qwen3": (26, 15), "gemma3_text": (32, 20), "olmo2": (28, 17), "nanochat": (26, 14)}


@pytest.mark.parametrize("name", list(LAYER_OPS))
def test_ops_of_a_patched_layer(name, monkeypatch):
    before, after = LAYER_OPS[name]
    assert _layer_ops(name, monkeypatch, fuse_qk=False).total() == before
    assert _layer_ops(name, monkeypatch, fuse_qk=True).total() == after


# Gemma 3's 20 ops, by name (``hf_rmsnorm.kernel``: one Triton launch).
GEMMA3_LAYER_OPS = {
    "mm": 7, "hf_rmsnorm.kernel": 3, "cat": 2, "clone": 2, "scalar_tensor": 2, "where": 1,
    "_scaled_dot_product_flash_attention_for_cpu": 1, "gelu": 1, "mul": 1,
}


def test_gemma3_layer_in_the_stack_dispatches_20_ops(monkeypatch):
    """Issue 31's goal for a patched Gemma 3 layer is 21 ops; a layer inside the stack dispatches 20, the first
    layer 21.

    What is counted: the ops a third layer adds to a two-layer model (``_layer_ops``), that is a layer inside the
    stack, which receives its input norm from the layer before it. The first layer normalises its input itself: one
    launch more, 21. What the 20 are (inference, bf16, the tiny config: 4 query heads over 2 key/value heads, a
    sliding window):
    - 7 ``mm``: the q, k, v and o projections and the MLP's gate, up and down;
    - 3 launches: the post-attention norm, the residual add after it and the pre-feedforward norm of that sum in
      one (``norm_add_norm``: the sandwich, each rounding where eager rounds); the post-feedforward norm, the
      layer's output add and the next layer's input norm of that sum in one more (``norm_add_norm`` again, handed
      on: ``handoff.add_normed_residual``); the one ``qk_norm_rope``. No add next to a norm is left apart, no
      copy, ``contiguous`` or cast is added (the ``.contiguous()`` after the attention is a no-op on SDPA's
      output), the ``scaling`` is SDPA's ``scale`` argument and Gemma 3 sets no attention softcapping;
    - 2 ``cat``: the dynamic cache's update of the keys and values (the model's own);
    - 5 of SDPA's own: ``repeat_kv``'s 2 copies (grouped key/value heads) and the 3 ops (2 ``scalar_tensor``, a
      ``where``) that turn the sliding-window boolean mask into an additive one, inside
      ``scaled_dot_product_attention`` on every call;
    - SDPA itself, the MLP's ``gelu`` and its ``mul``.

    The only ops of ours are the 3 launches. Without the handoff (the output add as ``norm_add``, the next input
    norm a launch of its own) the layer dispatches 21, one launch more.
    """
    ops = _layer_ops("gemma3_text", monkeypatch, fuse_qk=True)
    assert ops == GEMMA3_LAYER_OPS and ops.total() == LAYER_OPS["gemma3_text"][1] == 20
    monkeypatch.setattr(handoff, "add_normed_residual", lambda call, norm, x, residual: None)
    unhanded = _layer_ops("gemma3_text", monkeypatch, fuse_qk=True)
    assert unhanded - ops == {"hf_rmsnorm.kernel": 1} and unhanded.total() == 21
