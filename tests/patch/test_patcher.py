"""patch_model on tiny models of the real transformers classes: outputs, gradients, generation, op counts.

The kernels run in Triton's interpreter. Logits are compared with the eager model up to a couple of ulps: the
kernel's fp32 mean and rsqrt can differ from torch's by an ulp, which flips a bf16/fp16 rounding tie now and
then. The fused residual adds themselves are checked bitwise against the same kernels with the adds left
unfused, and accuracy against an fp64 copy of the model.
"""

import pytest
import torch
from family_cases import CASES, MAIN, OTHER, names
from patch_models import clone, count_ops, input_ids, tiny_model, without_layer_fusion

from hf_rmsnorm import UnsupportedModelError, check_model, patch_model, unpatch_model
from hf_rmsnorm.patch import fused, patcher, qk_attention
from hf_rmsnorm.patch.families import LayerKind, Registry, registry

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Largest difference from the eager model, relative to the largest |value|: two ulps of the dtype, a bit more
# for fp32 where the differing reduction order is the only source.
LOGIT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_close_rel(actual, expected, tol):
    scale = expected.double().abs().max().item()
    assert _max_err(actual, expected) <= tol * scale, (_max_err(actual, expected), scale)


@pytest.fixture
def norms_only(monkeypatch):
    """Makes patch_model swap the norms only (no layer fusion): the unfused baseline of the same kernels."""
    without_layer_fusion(monkeypatch)
    return monkeypatch


@pytest.mark.parametrize(
    "family, dtype",
    [(family, dtype) for family in names(MAIN) for dtype in DTYPES]
    + [(family, torch.bfloat16) for family in names(OTHER)],
    ids=str,
)
def test_logits_match_eager_and_fp64(family, dtype, norms_only):
    case = CASES[family]
    model = tiny_model(family, dtype, **case.config)
    ids = input_ids()
    truth = _logits(clone(model).double(), ids)
    eager = _logits(model, ids)

    patch_model(model)
    unfused = _logits(model, ids)
    unpatch_model(model)
    norms_only.undo()
    report = patch_model(model)
    patched = _logits(model, ids)

    assert (len(report.norms), len(report.fused_adds)) == (case.norms, case.adds)  # adds: both of both layers
    # The residual sum is rounded exactly as `residual + h` rounds, so fusing the adds changes no bit.
    assert torch.equal(patched, unfused)
    _assert_close_rel(patched, eager, LOGIT_TOL[dtype])
    # Not less accurate than the eager model, up to one ulp at the largest logit.
    eps = torch.finfo(dtype).eps * truth.abs().max().item()
    assert _max_err(patched, truth) <= _max_err(eager, truth) + eps

    unpatch_model(model)
    assert torch.equal(_logits(model, ids), eager)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", names(MAIN))
def test_loss_and_every_gradient_match_eager(family, dtype):
    model = tiny_model(family, dtype, **CASES[family].config).train()
    ids = input_ids()
    patched_model = clone(model)
    patch_model(patched_model)

    losses, grads = [], []
    for m in (model, patched_model):
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        grads.append({name: p.grad for name, p in m.named_parameters()})

    torch.testing.assert_close(losses[1], losses[0], rtol=LOGIT_TOL[dtype], atol=0)
    assert grads[0].keys() == grads[1].keys()
    for name, expected in grads[0].items():
        actual = grads[1][name]
        assert actual is not None and actual.dtype == expected.dtype, name
        _assert_close_rel(actual, expected, GRAD_TOL[dtype])
    assert any("norm" in name and grads[1][name].abs().sum() > 0 for name in grads[1])


@pytest.mark.parametrize("family", names(MAIN))
def test_greedy_generation_is_identical(family):
    model = tiny_model(family, **CASES[family].config)
    prompt = input_ids(batch=1, seq=5)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = model.generate(prompt, **kwargs)
    patch_model(model)
    assert torch.equal(model.generate(prompt, **kwargs), expected)


def _per_layer(counts_by_depth: dict[int, dict[str, int]], key=None) -> tuple[int, int]:
    """(ops of one layer, ops outside the layers) from counts of the same model at depths 2 and 3."""
    total = {depth: sum(c.values()) if key is None else sum(c[k] for k in key) for depth, c in counts_by_depth.items()}
    per_layer = total[3] - total[2]
    return per_layer, total[2] - 2 * per_layer


NORM_OPS = ("pow", "mean", "rsqrt")


@pytest.mark.parametrize("family, norms_per_layer", [("llama", 2), ("qwen3", 4)])
def test_dispatch_counts(family, norms_per_layer, monkeypatch):
    """Eager, a layer spends 8 aten ops per norm (to, pow, mean, add, rsqrt, mul, to, mul) and 2 residual adds;
    patched, no norm maths is left in aten and a layer runs one kernel per norm, both residual adds included,
    with autograd as without."""
    ids = input_ids()
    counts = {}
    # Qwen3's q/k norms apart from its RoPE: their fusion is counted in tests/patch/test_qk_families.py.
    monkeypatch.setattr(qk_attention, "plan_attention", lambda modules, norms, class_problem: ([], []))
    for depth in (2, 3):
        model = tiny_model(family, torch.bfloat16, layers=depth)
        eager = count_ops(model, ids, monkeypatch)
        patch_model(model)
        counts[depth] = (eager, count_ops(model, ids, monkeypatch), count_ops(model, ids, monkeypatch, grad=True))
    eager, inference, training = ({depth: counts[depth][i] for depth in counts} for i in range(3))

    assert _per_layer(eager, NORM_OPS) == (3 * norms_per_layer, 3)
    for patched in (inference, training):
        assert all(patched[depth][op] == 0 for depth in patched for op in NORM_OPS)
        # Layer 0's input norm and the final norm outside the layers (in inference the final norm is handed
        # the last layer's sum), one kernel per norm in each layer.
        assert _per_layer(patched, ("hf_rmsnorm.kernel",)) == (norms_per_layer, 1)
    eager_adds = _per_layer(eager, ("add",))[0]
    for patched in (inference, training):
        assert eager_adds - _per_layer(patched, ("add",))[0] == norms_per_layer + 2  # eps adds and both residuals
    assert _per_layer(eager)[0] - _per_layer(inference)[0] == 8 * norms_per_layer + 2 - norms_per_layer
    print(
        f"\n{family} aten ops per layer (bf16): eager {_per_layer(eager)[0]}, patched {_per_layer(inference)[0]} "
        f"in inference, {_per_layer(training)[0]} with autograd"
    )


def test_classes_keep_their_names_and_isinstance():
    from accelerate.utils.dataclasses import get_module_class_from_name
    from transformers.models.qwen3 import modeling_qwen3 as q3

    model = tiny_model("qwen3")
    originals = {name: type(m) for name, m in model.named_modules()}
    report = patch_model(model)

    assert {"model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm", "model.norm"} <= set(report.norms)
    assert len(report.norms) == CASES["qwen3"].norms and report.families == ["Qwen3"]
    for name, module in model.named_modules():
        cls, original = type(module), originals[name]
        assert isinstance(module, original)
        assert (cls.__name__, cls.__qualname__, cls.__module__) == (
            original.__name__, original.__qualname__, original.__module__
        )
    layer = model.model.layers[0]
    assert type(layer) is not q3.Qwen3DecoderLayer and isinstance(layer, q3.Qwen3DecoderLayer)
    # FSDP's auto-wrap policy and accelerate look layers up by the names in _no_split_modules ...
    assert get_module_class_from_name(model, "Qwen3DecoderLayer") is type(layer)
    assert "Qwen3DecoderLayer" in model._no_split_modules
    # ... and FSDP2 recipes find the final norm by "Norm" in its class name.
    assert "Norm" in type(model.model.norm).__name__
    assert repr(model) == repr(tiny_model("qwen3"))


def _snapshot(model):
    return {name: (type(m), sorted(m.__dict__), dict(m.__dict__)) for name, m in model.named_modules()}


def _assert_same(model, snapshot):
    for name, module in model.named_modules():
        cls, keys, attrs = snapshot[name]
        assert type(module) is cls, name
        assert sorted(module.__dict__) == keys, name
        assert all(module.__dict__[k] is v or module.__dict__[k] == v for k, v in attrs.items()), name


def test_patching_twice_is_a_no_op_and_unpatch_restores_exactly():
    model = tiny_model("llama", torch.bfloat16)
    ids = input_ids()
    before = _snapshot(model)
    eager = _logits(model, ids)

    report = patch_model(model)
    patched = _snapshot(model)
    assert patch_model(model) is report
    _assert_same(model, patched)

    unpatch_model(model)
    _assert_same(model, before)
    assert torch.equal(_logits(model, ids), eager)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_model(model)


def test_a_model_whose_submodule_was_patched_is_left_as_is():
    model = tiny_model("llama")
    inner = patch_model(model.model)
    report = patch_model(model)
    assert not report.norms and len(report.skipped) == len(inner.norms) + 3  # + the two layers and their stack
    assert all("already patched" in reason for _, reason in report.skipped)


@pytest.mark.parametrize("where, failing_call", [("fused_class", 6), ("_set_attr", 2)])
def test_a_failure_midway_restores_everything(where, failing_call, monkeypatch):
    """Fails at the first layer's class swap (after the five norms') or at the second added attribute."""
    module = {"fused_class": patcher.fused, "_set_attr": patcher}[where]
    model = tiny_model("llama")
    before = _snapshot(model)
    original = getattr(module, where)
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == failing_call:
            raise RuntimeError("injected failure")
        return original(*args)

    monkeypatch.setattr(module, where, failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        patch_model(model)
    _assert_same(model, before)


def test_a_handed_on_norm_is_taken_only_by_the_norm_it_was_made_for_from_the_same_values():
    from hf_rmsnorm.patch import handoff

    norm, other = torch.nn.Identity(), torch.nn.Identity()  # an Identity "norm" returns what it computes from
    source, normed = torch.ones(2, 4), torch.zeros(2, 4)
    assert handoff.final_norm((norm, normed), norm, source, source) is normed
    assert handoff.final_norm((norm, normed), other, source, source) is source  # made for another norm
    assert handoff.final_norm(None, norm, source, source) is source
    # The norm of a conversion that changes the values (``h.to(torch.float64)``) is computed, not handed on.
    converted = source.double()
    assert handoff.final_norm((norm, normed), norm, converted, source) is converted
    assert handoff.input_norm(handoff.LayerCall(normed, None), norm, source, source) is normed
    assert handoff.input_norm(handoff.LayerCall(None, None), norm, source, source) is source
    assert handoff.input_norm(None, norm, source, source) is source


def test_a_model_running_fewer_layers_than_it_has(norms_only):
    """``config.num_hidden_layers`` below the layer count: the last layer run hands nothing on (the layer its link
    names is not called next), and the final norm computes its norm itself."""
    from harness import residual_census

    model = tiny_model("llama", torch.bfloat16, layers=3)
    model.config.num_hidden_layers = 2
    ids = input_ids()
    unfused = clone(model)
    patch_model(unfused)
    norms_only.undo()
    patch_model(model)
    assert torch.equal(_logits(model, ids), _logits(unfused, ids))
    # The two layers' attention adds and the first layer's output into the second's input norm.
    assert residual_census.fused_adds(model, lambda m: m(ids)) == 3


@pytest.mark.parametrize("obj", [42, "model", torch.nn.Linear(4, 4)], ids=["int", "str", "Linear"])
def test_unsupported_objects_raise_and_are_left_untouched(obj):
    expected = "expects a torch.nn.Module" if not isinstance(obj, torch.nn.Module) else "has no norm"
    with pytest.raises(UnsupportedModelError, match=expected) as error:
        patch_model(obj)
    assert isinstance(error.value, ValueError)
    assert type(obj).__name__ in str(error.value)


def test_an_unsupported_family_raises_and_is_left_untouched():
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2's LayerNorms are converted by default (tests/patch/test_layernorm.py); with layernorm="skip" it has none.
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    before = _snapshot(model)
    message = r"^GPT2LMHeadModel \(model_type 'gpt2'\) has no norm .*LayerNorm.*supported families: .*family_names"
    for attempt in (check_model, patch_model):
        with pytest.raises(UnsupportedModelError, match=message) as raised:
            attempt(model, layernorm="skip")
        assert len(str(raised.value)) < 250 and "\n" not in str(raised.value)
    _assert_same(model, before)


def test_norms_of_unknown_classes_are_patched_by_their_numerics_or_skipped_with_the_reason():
    class MyRMSNorm(torch.nn.Module):
        """Llama's maths under another name: recognised by its numerics."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(hidden_states.dtype)

    class ScaledRMSNorm(MyRMSNorm):
        """Not an RMSNorm of any mode: its output is scaled once more."""

        def forward(self, hidden_states):
            return super().forward(hidden_states) * 1.5

    class GatedRMSNorm(MyRMSNorm):
        def forward(self, hidden_states, gate=None):
            return super().forward(hidden_states)

    model = tiny_model("llama")
    model.model.extra_norm = MyRMSNorm()
    model.model.scaled_norm = ScaledRMSNorm()
    model.model.gated_norm = GatedRMSNorm()
    model.model.group_norm = torch.nn.GroupNorm(4, 64)  # a norm no mode computes
    x = torch.randn(3, 64)
    expected = model.model.extra_norm(x)
    report = patch_model(model)
    assert "model.extra_norm" in report.norms and "My (recognised)" in report.families
    torch.testing.assert_close(model.model.extra_norm(x), expected, rtol=1e-6, atol=1e-6)  # fp32 reductions
    assert type(model.model.scaled_norm) is ScaledRMSNorm and type(model.model.group_norm) is torch.nn.GroupNorm
    skipped = dict(report.skipped)
    assert "ScaledRMSNorm's numerics match none of the kernels' modes" in skipped["model.scaled_norm"]
    assert "GatedRMSNorm.forward takes more than the hidden states (hidden_states, gate)" in skipped["model.gated_norm"]
    assert skipped["model.group_norm"].startswith("torch.nn.modules.normalization.GroupNorm is not")
    assert len(report.norms) == 6


def test_a_layer_of_unexpected_structure_keeps_patched_norms_without_fused_adds(monkeypatch):
    import dataclasses

    model = tiny_model("llama", torch.bfloat16)
    full = registry()
    changed = {cls: tuple((family, dataclasses.replace(kind, forward_params=("hidden_states", "mask")))
                          for family, kind in kinds)
               for cls, kinds in full.layers.items()}
    without_layer_fusion(monkeypatch, layers=changed)
    ids = input_ids()
    eager = _logits(model, ids)
    report = patch_model(model)
    assert len(report.norms) == CASES["llama"].norms and not report.fused_adds
    assert [name for name, _ in report.skipped] == ["model.layers.0", "model.layers.1"]
    assert "residual adds not fused: forward(hidden_states" in report.skipped[0][1]
    _assert_close_rel(_logits(model, ids), eager, LOGIT_TOL[torch.bfloat16])


def test_a_norm_whose_forward_another_library_replaced_is_skipped(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, hidden_states):
        return hidden_states

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)
    model = tiny_model("qwen2")
    model.model.norm = tiny_model("llama").model.norm
    report = patch_model(model)
    assert "model.norm" not in report.norms
    assert dict(report.skipped)["model.norm"].startswith("LlamaRMSNorm.forward was replaced by ")


def test_unpatch_refuses_when_a_class_was_changed_after_patching():
    model = tiny_model("llama")
    patch_model(model)
    norm = model.model.norm
    norm.__class__ = type("Wrapped", (type(norm),), {})
    with pytest.raises(ValueError, match="was changed to .*Wrapped after patching"):
        unpatch_model(model)
    assert type(model.model.layers[0].input_layernorm).__dict__.get("_hf_rmsnorm_base") is not None


def test_report_reads_well():
    model = tiny_model("phi3")
    model.model.extra = torch.nn.GroupNorm(4, 64)
    text = str(patch_model(model))
    assert text.splitlines()[0] == "hf_rmsnorm: 5 norms patched (Phi3), 4 residual adds fused, 1 skipped"
    assert "    model.layers.0: attention residual -> model.layers.0.post_attention_layernorm (while " in text
    assert "    model.layers.1: mlp residual -> model.norm (while resid_mlp_dropout is inactive)" in text
    assert text.endswith("\n    model.extra: torch.nn.modules.normalization.GroupNorm is not a norm of a supported family")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_check_model_reports_what_patch_model_will_do_and_changes_nothing(family):
    model = tiny_model(family)
    before = _snapshot(model)
    planned = check_model(model)
    _assert_same(model, before)
    report = patch_model(model)
    assert (planned.norms, planned.fused_adds, planned.skipped, planned.families) == (
        report.norms, report.fused_adds, report.skipped, report.families)
    assert check_model(model) is report  # a patched model: the report of its patch


def test_the_report_says_what_runs_the_norms():
    report = patch_model(tiny_model("llama"))
    # conftest set this process up for Triton's interpreter on CPU.
    assert report.backend.startswith("Triton kernels in Triton's CPU interpreter")
    assert f"runs on: {report.backend}" in str(report).splitlines()[1]


def test_layer_kinds_accept_the_cache_argument_under_either_name():
    kind = LayerKind("m.Layer")
    params = ("hidden_states", "attention_mask", "position_ids", "{}", "use_cache", "position_embeddings")
    assert kind.matches(tuple(p.format("cache") for p in params))  # transformers >= 5.24
    assert kind.matches(tuple(p.format("past_key_values") for p in params))  # earlier releases
    assert not kind.matches(tuple(p.format("layer_past") for p in params))
    assert not kind.matches(tuple(p.format("cache") for p in params) + ("output_attentions",))


def test_a_layer_kind_names_one_shape_that_copies_and_pickles_keep_and_that_checks_it():
    """A shape is one object per class: a deep-copied or unpickled kind (patched models copy and pickle theirs)
    keeps the very same one, so it still finds its fused class; each shape refuses attributes it cannot run."""
    import copy
    import pickle

    from hf_rmsnorm.patch import shapes

    for shape, fields in ((shapes.SEQUENTIAL, {}), (shapes.PARALLEL, {"post_attention_norm": None}),
                          (shapes.POST_NORM, {"post_mlp_norm": "post_feedforward_layernorm"}),
                          (shapes.PARALLEL_RESIDUAL_FIRST, {"post_attention_norm": None})):
        kind = LayerKind("m.Layer", shape=shape, **fields)
        for clone_ in (copy.deepcopy(kind), pickle.loads(pickle.dumps(kind))):
            assert clone_ == kind and clone_.shape is shape
    with pytest.raises(ValueError, match="a parallel LayerKind has no residual_scale"):
        LayerKind("m.Layer", shape=shapes.PARALLEL, residual_scale="scale")
    with pytest.raises(ValueError, match="a sequential LayerKind has no pre_mlp_norm or post_mlp_norm"):
        LayerKind("m.Layer", pre_mlp_norm="pre_feedforward_layernorm")
    with pytest.raises(ValueError, match="a post-norm LayerKind has a post_mlp_norm"):
        LayerKind("m.Layer", shape=shapes.POST_NORM)


def test_a_parallel_layer_no_known_model_forward_runs_keeps_its_class_and_says_why(monkeypatch):
    """A parallel block fuses its one add only into the next norm's kernel, through its model's forward: where
    that forward is not a known one's, the layer keeps its class (patched, it would run the same unfused add) and
    the report says why."""
    model = tiny_model("cohere")
    full = registry()  # after the model is built: the registry holds the classes of imported modeling modules
    monkeypatch.setattr(patcher, "registry", lambda: Registry(full.norms, full.layers, {}))
    monkeypatch.setattr(patcher, "recognised_stack_kind", lambda cls: None)
    monkeypatch.setattr(patcher.derived_loops, "stack_kind", lambda cls: None)
    report = patch_model(model)
    assert len(report.norms) == CASES["cohere"].norms and not report.fused_adds
    assert all(fused.original_class(layer) is None for layer in model.model.layers)
    assert dict(report.skipped)["model.layers.0"] == (
        "residual adds not fused: a parallel pre-norm block's add can only go into the next norm's kernel, and no "
        "model forward of known code runs this layer")
