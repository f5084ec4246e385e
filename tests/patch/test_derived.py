"""Fused forwards derived from a layer's own code (``hf_rmsnorm.patch.derived_*``): the patterns it rewrites and
those it must leave alone, the guards that keep a rewritten add exact, and the model types it newly fuses, each
a tiny model of transformers' own classes compared with its eager self, with an fp64 copy and in training. (The
soundness invariants' toys: ``test_derived_soundness.py``; the source checks: ``test_derived_source.py``.)"""

from __future__ import annotations

import copy
import functools
import inspect
import linecache
import pickle

import pytest
import torch
from transformers import CONFIG_MAPPING

from derived_toys import (
    AddingSublayer, SublayerDecoderLayer, ToyDecoderLayer, ToyModel, sites, stack_layout, states, toy_model,
)
from family_cases import CASES, DERIVED, names
from harness import residual_census
from patch_models import (
    Parity, assert_outputs_and_gradients_alike, assert_patch_keeps_greedy_tokens, fused_and_unfused,
)
from hf_rmsnorm import check_model, patch_model, unpatch_model
from hf_rmsnorm.patch import derived_rewrite, derived_runtime, derived_sites, fused, handoff
from hf_rmsnorm.patch.derived_sites import AddSite

# ----------------------------------------------------------------------------------- toy layers and stacks


class ToyPostNormDecoderLayer(ToyDecoderLayer):
    """Post-norm adds, one in each form, and an output add inside an ``if`` whose ``return`` follows it."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(hidden_states)
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.post_attention_layernorm(self.mlp(hidden_states))
        if scale:
            hidden_states = hidden_states + self.mixer(hidden_states) * scale
        return hidden_states


def test_a_toy_layer_fuses_its_adds_and_hands_its_output_to_the_next_norm():
    model = toy_model()
    x = states()
    with torch.no_grad():
        expected = model(x)
        report = patch_model(model)
        got = model(x)
    assert report.fused_adds == [
        f"layers.{i}: residual add at line {ToyDecoderLayer.forward.__code__.co_firstlineno + 3} "
        f"(into post_attention_layernorm) -> layers.{i}.post_attention_layernorm" for i in range(2)
    ] + ["layers.0: layer output -> layers.1.input_layernorm", "layers.1: layer output -> norm"]
    # fp32: the kernels' sums are torch's; each norm may differ from the eager one by its rounding (a few ulps).
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    unpatch_model(model)
    assert type(model.layers[0]) is ToyDecoderLayer
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_post_norm_adds_and_an_output_add_inside_an_if_are_found():
    lines = ToyPostNormDecoderLayer.forward.__code__.co_firstlineno
    assert sites(ToyPostNormDecoderLayer) == (
        AddSite("after", ("input_layernorm",), lines + 4),
        AddSite("after", ("post_attention_layernorm",), lines + 5),
        AddSite("output", (), lines + 7),
    )
    model = toy_model(ToyPostNormDecoderLayer)
    x = states()
    with torch.no_grad():
        expected = model(x)
        patch_model(model)
        torch.testing.assert_close(model(x), expected, rtol=2e-6, atol=2e-6)


class _Unfusable(ToyDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        # The sum is read again by the statement that norms it: the norm cannot move before that statement.
        hidden_states = residual + self.mixer(hidden_states)
        hidden_states = self.mlp(hidden_states) * self.input_layernorm(hidden_states)
        # A statement that may change the sum between the add and the norm.
        total = residual + hidden_states
        total.mul_(scale)
        hidden_states = self.post_attention_layernorm(total)
        # An in-place add, and a norm whose output is read again after the add.
        hidden_states += residual
        normed = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + normed
        hidden_states = hidden_states * normed.mean()
        return hidden_states * scale


def test_patterns_that_would_change_the_function_are_left_alone():
    assert sites(_Unfusable) == ()


def test_only_norm_calls_count_and_the_input_norm_must_come_first():
    code = derived_sites.layer_code(ToyDecoderLayer, frozenset({("post_attention_layernorm",)}))
    # mixer and mlp are no norms; the input norm is not one of the given norms either.
    assert [s.position for s in code.sites] == ["before", "output"]
    assert code.input_norm is None
    assert derived_sites.layer_code(ToyDecoderLayer, frozenset({("input_layernorm",)})).input_norm == (
        "input_layernorm")


class _AnnotatedTupleLayer(ToyDecoderLayer):
    """The output add followed by an annotated tuple of it: not the ``o = (s, ...) + rest`` form."""

    def forward(self, hidden_states: torch.Tensor) -> tuple:
        residual = hidden_states
        hidden_states = self.mlp(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        outputs: tuple = (hidden_states, residual) + ()
        return outputs


def test_an_annotated_tuple_after_the_output_add_is_no_output_form():
    """Only ``o = (s, ...) + rest`` (one name bound) then ``return o`` makes the add a layer output returned first
    in a tuple; another statement there (an annotated assignment) leaves the add unread as an output, without
    failing the analysis."""
    code = derived_sites.layer_code(_AnnotatedTupleLayer, frozenset({("input_layernorm",)}))
    assert [s.position for s in code.sites] == []
    assert code.input_norm == "input_layernorm"


class _ChunkedModel(ToyModel):
    """Two loops over the layers, as xLSTM's: chunks copied out of the last layer, or the whole stream."""

    def forward(self, hidden_states: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        if chunk:
            out = torch.zeros_like(hidden_states)
            offset = 0
            while offset < hidden_states.shape[1]:
                piece = hidden_states[:, offset:offset + chunk]
                for layer in self.layers:
                    piece = layer(piece)
                out[:, offset:offset + chunk] = piece
                offset += chunk
            hidden_states = out
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _EditedModel(ToyModel):
    """A loop whose output is changed in place before the final norm: no final norm may be linked."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states.mul_(2)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _RereadModel(ToyModel):
    """A chunk loop whose output the next iteration reads before rebinding it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        piece = hidden_states
        while piece.shape[1] > 1:
            for layer in self.layers:
                piece = layer(piece)
            piece = piece[:, 1:]
        hidden_states = self.norm(piece)
        return hidden_states


class ToyTupleDecoderLayer(ToyDecoderLayer):
    """A layer returning its hidden states first in a tuple, as GPT-J's did before transformers 5.24."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        extra = self.mixer(hidden_states)
        hidden_states = residual + extra * scale
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states, extra


class _TupleModel(ToyModel):
    """Its loop takes the hidden states as ``outputs[0]`` and reads another item of the layer's output too."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        extras = ()
        for layer in self.layers:
            outputs = layer(hidden_states)
            hidden_states = outputs[0]
            extras = extras + (outputs[1],)
        hidden_states = self.norm(hidden_states)
        return hidden_states, extras


def test_a_layer_returning_a_tuple_hands_its_output_on_and_keeps_its_other_items():
    assert stack_layout(_TupleModel) == ("layers", "norm")
    assert [site.in_tuple for site in sites(ToyTupleDecoderLayer) if site.position == "output"] == [True]
    torch.manual_seed(0)
    model = _TupleModel(ToyTupleDecoderLayer).eval()
    x = states()
    with torch.no_grad():
        expected, expected_extras = model(x)
        report = patch_model(model)
        got, extras = model(x)
    assert report.fused_adds[2:] == ["layers.0: layer output -> layers.1.input_layernorm",
                                     "layers.1: layer output -> norm"]
    assert residual_census.fused_adds(model, lambda m: m(x)) == 4
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    assert len(extras) == 2
    for a, b in zip(extras, expected_extras):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_model_loops_are_followed_to_the_end_of_the_forward():
    """The final norm is linked only where every loop's output reaches it untouched or never reaches anything
    again (copied out, rebound): xLSTM's chunked and whole-stream loops."""
    assert stack_layout(ToyModel) == ("layers", "norm")
    assert stack_layout(_ChunkedModel) == ("layers", "norm")
    assert stack_layout(_EditedModel) == ("layers", None)
    assert stack_layout(_RereadModel) == ("layers", None)
    torch.manual_seed(0)
    model = _ChunkedModel(ToyDecoderLayer).eval()
    x = states()
    with torch.no_grad():
        expected = [model(x), model(x, chunk=2)]
        assert len(patch_model(model).fused_adds) == 4
        for got, chunk in zip(expected, (0, 2)):
            torch.testing.assert_close(model(x, chunk=chunk), got, rtol=2e-6, atol=2e-6)


def test_a_broadcast_operand_or_a_hooked_norm_runs_the_original_expression():
    """The helpers evaluate the original expression whenever the kernel would not compute it: here a norm with a
    hook (which must see the sum, as in the unpatched model) and a residual that broadcasts."""
    model = toy_model()
    x = states()
    seen = []
    with torch.no_grad():
        expected = model(x)
        patch_model(model)
        handle = model.layers[0].post_attention_layernorm.register_forward_pre_hook(
            lambda module, args: seen.append(args[0]))
        torch.testing.assert_close(model(x), expected, rtol=2e-6, atol=2e-6)
        handle.remove()
        assert len(seen) == 1 and seen[0].shape == x.shape
        norm = model.layers[0].post_attention_layernorm
        row = x[:1, :1]
        normed, total = derived_runtime.norm_of_sum(norm, row, x)
        assert torch.equal(total, row + x)
        torch.testing.assert_close(normed, norm(row + x), rtol=0, atol=0)


def test_a_patched_toy_model_copies_pickles_and_trains_like_the_original():
    model = toy_model().train()
    patched = copy.deepcopy(model)
    assert len(patch_model(patched).fused_adds) == 4
    restored = pickle.loads(pickle.dumps(patched))
    assert type(restored.layers[0]).forward is type(patched.layers[0]).forward
    x = states().requires_grad_()
    grads = []
    for m in (model, patched, restored):
        x.grad = None
        m.zero_grad()
        m(x).square().sum().backward()
        grads.append({"x": x.grad.clone(), **{n: p.grad for n, p in m.named_parameters()}})
    for got in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_derived_forward_keeps_the_decorators_signature_and_source():
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeDecoderLayer

    kind = derived_sites.DerivedLayerKind("x", sites(GraniteMoeDecoderLayer), "input_layernorm",
                                          frozenset({("input_layernorm",), ("post_attention_layernorm",)}))
    forward = derived_rewrite.fused_forward(GraniteMoeDecoderLayer, kind)

    # The layer's forward has the original's signature; the derived body it calls takes the handoff's call too.
    signature = inspect.signature(GraniteMoeDecoderLayer.forward)
    assert inspect.signature(fused.fused_class(GraniteMoeDecoderLayer, kind).forward) == signature
    assert inspect.signature(forward).replace(parameters=[
        p for p in inspect.signature(forward).parameters.values() if p.name != handoff.CALL_PARAM]) == signature
    assert hasattr(GraniteMoeDecoderLayer.forward, "__wrapped__") == hasattr(forward, "__wrapped__")
    # Compiled under the original's file and lines (tracebacks point at the modeling code), calling the helpers.
    code, original = inspect.unwrap(forward).__code__, inspect.unwrap(GraniteMoeDecoderLayer.forward).__code__
    assert code.co_filename == original.co_filename
    assert linecache.getline(code.co_filename, code.co_firstlineno).strip().startswith("def forward(")
    assert {"norm_of_sum", "stream_sum", "input_norm"} <= set(code.co_names)


# ----------------------------------------------------------------------------------- transformers' own models

def _build(model_type: str):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    from harness.coverage import _build as build

    return build(model_type)


def _width(model) -> int:
    return model.get_input_embeddings().embedding_dim


def _ids(model) -> torch.Tensor:
    return torch.randint(3, min(model.config.get_text_config().vocab_size, 100), (2, 7),
                         generator=torch.Generator().manual_seed(1))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits.double()


@pytest.mark.parametrize("model_type", sorted(names(DERIVED)))
def test_derived_model_types_patch_with_parity(model_type):
    model = _build(model_type)
    run = functools.partial(_logits, ids=_ids(model))
    parity = Parity(model, run)
    norm_names = set(check_model(model).norms)  # once: a comprehension's condition would plan it per module
    norms = {m for name, m in model.named_modules() if name in norm_names}
    next_to_norms = residual_census.adds_next_to_norms(model, run, norms, _width(model))
    report = patch_model(model)
    adds = CASES[model_type].adds
    assert len(report.fused_adds) == adds, str(report)
    assert residual_census.fused_adds(model, run) == len(next_to_norms) == adds
    parity.check_patched()


@pytest.mark.parametrize("model_type", ["granitemoe", "nemotron_h", "mamba", "gemma4_text", "falcon_h1"])
def test_derived_model_types_generate_with_their_caches(model_type):
    """Greedy generate(): the derived forward calls the mixers (attention, Mamba, short convolutions) as the
    original does, with their caches; fp32 tokens identical to the eager model's."""
    model = _build(model_type)
    assert_patch_keeps_greedy_tokens(model, _ids(model), new_tokens=5)


@pytest.mark.parametrize("model_type", ["granitemoe", "jamba", "gemma4_text"])
def test_derived_model_types_train_like_the_original(model_type):
    model = _build(model_type).train()
    patched = copy.deepcopy(model)
    assert patch_model(patched).fused_adds
    ids = _ids(model)
    losses, grads = [], []
    for m in (model, patched):
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in m.named_parameters() if p.grad is not None})
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[0].items():
        # fp32 roundings of the fused sums and norms, carried through the layers: bounded relative to the
        # gradient's own scale (entries near zero get the absolute part).
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_a_registered_layer_that_no_kind_fits_falls_back_to_its_derived_forward(monkeypatch):
    """What a transformers release that changes a registered layer gets: not a stale body, but the new forward's
    own code with its adds rewritten (here the registered kind is made not to fit)."""
    import dataclasses

    from patch_models import input_ids, tiny_model

    from hf_rmsnorm.patch import patcher
    from hf_rmsnorm.patch.families import Registry, registry

    model = tiny_model("llama")
    full = registry()
    changed = {cls: tuple((family, dataclasses.replace(kind, forward_params=("hidden_states", "mask")))
                          for family, kind in kinds) for cls, kinds in full.layers.items()}
    monkeypatch.setattr(patcher, "registry", lambda: Registry(full.norms, changed, full.stacks))
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
        report = patch_model(model)
        got = model(ids).logits
    assert len(report.fused_adds) == 4 and all("residual add at line" in line or "layer output" in line
                                               for line in report.fused_adds)
    assert dict(report.skipped)["model.layers.0"].startswith(
        "its forward is derived: no registered shape fits (forward(hidden_states")
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_a_vision_tower_fuses_through_its_derived_forward():
    """Pixtral's vision layers (no registered shape): the attention add goes into the FFN norm's kernel, and a
    layer's output into the next layer's first norm."""
    from transformers import PixtralVisionConfig, PixtralVisionModel

    config = PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 head_dim=16, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = PixtralVisionModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(pixels, image_sizes=[(32, 32)]).last_hidden_state
        report = patch_model(model)
        got = model(pixels, image_sizes=[(32, 32)]).last_hidden_state
    # Each layer's attention add into its FFN norm; the first layer's output into the second's attention norm
    # (PixtralTransformer's loop, read as a stack without a final norm).
    assert sum(" (into ffn_norm) -> transformer.layers." in line for line in report.fused_adds) == 2
    assert report.fused_adds[2] == "transformer.layers.0: layer output -> transformer.layers.1.attention_norm"
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6 * expected.abs().max().item())


@pytest.mark.parametrize("model_type", ["stablelm", "lfm2"])
def test_torch_compile_fullgraph_of_a_derived_model(model_type):
    """The derived forwards and their helpers trace as Python code, with no graph break."""
    model = _build(model_type)
    ids = _ids(model)
    expected = _logits(model, ids)
    patch_model(model)
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        got = compiled(ids, use_cache=False).logits.double()
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()



class ToyPostLNSublayer(ToyDecoderLayer):
    """Post-LN sublayers, BERT's ``LayerNorm(dropout(dense(h)) + input)``: the sum is the norm's argument; the one in
    a lambda is not matched (it may run later, or never)."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        hidden_states = self.input_layernorm(self.mixer(hidden_states) + hidden_states)
        later = lambda: self.post_attention_layernorm(hidden_states + scale)  # noqa: E731
        return self.post_attention_layernorm(self.mlp(hidden_states) + later())


def test_a_sum_as_a_norm_argument_is_fused_in_place():
    assert [(s.position, s.norm) for s in sites(ToyPostLNSublayer)] == [
        ("argument", ("input_layernorm",)), ("argument", ("post_attention_layernorm",))]
    model = toy_model(ToyPostLNSublayer)
    x = states()
    expected = model(x)
    report = patch_model(model)
    assert len(report.fused_adds) == 2 * len(model.layers)
    assert residual_census.fused_adds(model, lambda m: m(x)) == 2 * len(model.layers)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)  # fp32 reductions in another order


# ----------------------------------------------------------------------------------- norms under tests (OPT's form)


class ToyFlaggedLayer(ToyDecoderLayer):
    """OPT's form: each norm under a test of a flag (before or after its add), the sum flattened between, the
    output a view of the sum."""

    norm_first = True

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        if self.norm_first:
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.mixer(hidden_states) * scale
        if not self.norm_first:
            hidden_states = self.input_layernorm(hidden_states)
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        if self.norm_first:
            hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = (residual + hidden_states).view(shape)
        if not self.norm_first:
            hidden_states = self.post_attention_layernorm(hidden_states)
        return hidden_states


def _flagged(norm_first: bool, dtype: torch.dtype = torch.float32) -> ToyModel:
    model = toy_model(ToyFlaggedLayer, dtype)
    for layer in model.layers:
        layer.norm_first = norm_first
    return model


def test_norms_under_tests_are_read_through_flattenings_and_views():
    lines = ToyFlaggedLayer.forward.__code__.co_firstlineno
    norms = (("input_layernorm",), ("post_attention_layernorm",))
    assert sites(ToyFlaggedLayer) == (
        AddSite("guarded", norms[0], lines + 4, alternatives=norms[1:]),
        AddSite("output", (), lines + 13, alternatives=norms[1:]),
    )
    report = patch_model(_flagged(True))
    assert report.fused_adds == [
        line for i, following in enumerate(["layers.1.input_layernorm", "norm"]) for line in (
            f"layers.{i}: residual add at line {lines + 4} (into input_layernorm or post_attention_layernorm) -> "
            f"layers.{i}.input_layernorm or layers.{i}.post_attention_layernorm",
            f"layers.{i}: residual add at line {lines + 13} (into post_attention_layernorm where a test holds, else "
            f"layer output) -> layers.{i}.post_attention_layernorm, else {following}",
        )
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_norms_under_tests_fuse_every_add_with_the_unfused_values_and_gradients(norm_first, dtype, monkeypatch):
    """Pre-norm: each attention add into the flattened sum's norm, each output (a view) into the next norm; post-norm:
    each add into the norm after it. The values and gradients of the adds apart, bit for bit (fp32: gradients too)."""
    _, fused, unfused = fused_and_unfused(_flagged(norm_first, dtype), monkeypatch)
    x = states(dtype)
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 4
    assert_outputs_and_gradients_alike(fused, unfused, x, gradients=dtype == torch.float32)


def test_a_flag_changed_after_patching_is_followed(monkeypatch):
    """No hidden state: the tests are evaluated at every call, so a layer switched to post-norm after patching
    computes as the unfused post-norm layer (and fuses its adds into the norms after them)."""
    _, fused, unfused = fused_and_unfused(_flagged(True), monkeypatch)
    x = states()
    for norm_first in (False, True):
        for m in (fused, unfused):
            for layer in m.layers:
                layer.norm_first = norm_first
        with torch.no_grad():
            assert torch.equal(fused(x), unfused(x))
        assert residual_census.fused_adds(fused, lambda m: m(x)) == 4


def test_a_hooked_norm_under_a_test_gets_the_flattened_sum_as_the_original(monkeypatch):
    """layers.0's attention add (into the hooked norm) stays apart, and the hook sees the flattened sum; the other
    three adds stay fused."""
    _, fused, unfused = fused_and_unfused(_flagged(True), monkeypatch)
    x = states()
    seen, outputs = {}, {}
    for name, m in (("fused", fused), ("unfused", unfused)):
        seen[name] = []
        handle = m.layers[0].post_attention_layernorm.register_forward_pre_hook(
            lambda module, args, into=seen[name]: into.append(args[0]))
        with torch.no_grad():
            outputs[name] = m(x)
        handle.remove()
    assert torch.equal(outputs["fused"], outputs["unfused"])
    assert seen["fused"][0].shape == (x.shape[0] * x.shape[1], x.shape[2])
    assert torch.equal(seen["fused"][0], seen["unfused"][0])
    handle = fused.layers[0].post_attention_layernorm.register_forward_pre_hook(lambda module, args: None)
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 3
    handle.remove()


# ----------------------------------------------------------------------------------- sublayer outputs (BLOOM's)


class _SublayerInTheMiddleLayer(SublayerDecoderLayer):
    """Look-alikes left alone: the attention's output is its add, but the layer adds to it before its norm reads
    it; the feed-forward's output is no add of its own (its ``forward`` normalises after adding)."""

    def __init__(self) -> None:
        super().__init__()
        self.feed_forward = _NormedSublayer()

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attention_output = self.attention(normed, hidden_states)
        attention_output = attention_output + scale
        normed = self.post_attention_layernorm(attention_output)
        output = self.feed_forward(normed, attention_output)
        return output


class _NormedSublayer(AddingSublayer):
    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.tanh(residual + self.proj(hidden_states))


def test_sublayer_outputs_go_into_the_layers_norm_and_the_next_layers(monkeypatch):
    """A layer calling sublayers whose output is their add (derived_sites' "Sublayer outputs"): the first's sum into
    the layer's own norm, the second's (the layer's output) into the next layer's input norm, or the final norm.
    Values and gradients those of the adds apart, bit for bit; unpatched, the original classes."""
    report, fused, unfused = fused_and_unfused(toy_model(SublayerDecoderLayer), monkeypatch)
    line = SublayerDecoderLayer.forward.__code__.co_firstlineno + 2
    assert report.fused_adds == [
        f"layers.{i}: output add of attention (line {line}: into post_attention_layernorm) -> "
        f"layers.{i}.post_attention_layernorm" for i in range(2)
    ] + ["layers.0: layer output -> layers.1.input_layernorm", "layers.1: layer output -> norm"]
    x = states()
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 4
    assert_outputs_and_gradients_alike(fused, unfused, x)
    unpatch_model(fused)
    assert type(fused.layers[0]) is SublayerDecoderLayer
    assert type(fused.layers[0].attention) is type(fused.layers[0].feed_forward) is AddingSublayer
    assert not any(name.startswith("_hf_rmsnorm") for m in fused.modules() for name in vars(m))


def test_a_sublayer_whose_sum_is_changed_or_whose_output_is_no_add_is_left_alone():
    model = toy_model(_SublayerInTheMiddleLayer)
    x = states()
    with torch.no_grad():
        expected = model(x)
    report = patch_model(model)
    assert not any("output add of" in line for line in report.fused_adds), report.fused_adds
    assert type(model.layers[0].attention) is AddingSublayer and type(model.layers[0].feed_forward) is _NormedSublayer
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=2e-6, atol=2e-6)


def test_a_sublayer_replaced_or_hooked_after_patching_gets_the_plain_calls(monkeypatch):
    """The layer's links name the sublayer module itself: another module put at its path after patching, or a hook
    on the sublayer or the norm, gets the original calls (values bitwise the adds apart); the rest stays fused."""
    _, fused, unfused = fused_and_unfused(toy_model(SublayerDecoderLayer), monkeypatch)
    x = states()
    replacement = copy.deepcopy(unfused.layers[0].attention)
    for m in (fused, unfused):
        m.layers[0].attention = copy.deepcopy(replacement)
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 3
    assert_outputs_and_gradients_alike(fused, unfused, x)
    handles = [m.layers[1].post_attention_layernorm.register_forward_pre_hook(lambda mod, args: None)
               for m in (fused, unfused)]
    assert residual_census.fused_adds(fused, lambda m: m(x)) == 2
    assert_outputs_and_gradients_alike(fused, unfused, x)
    for handle in handles:
        handle.remove()


class _SublayerOutputOnlyLayer(SublayerDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        return_value = self.feed_forward(normed, hidden_states)
        return return_value


class _UnreadStack(ToyModel):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers[1](self.layers[0](hidden_states)))


def test_a_layer_whose_only_sublayer_add_goes_nowhere_keeps_its_and_its_sublayers_classes():
    """A layer whose one sublayer add is its output, in a stack whose loop is not read: nothing to hand it to, so
    neither the layer nor its sublayer is swapped (the report says why), and the model computes as before."""
    model = toy_model(_SublayerOutputOnlyLayer, stack=_UnreadStack)
    x = states()
    with torch.no_grad():
        expected = model(x)
    report = patch_model(model)
    assert report.fused_adds == [] and "can only go into the next norm's kernel" in dict(report.skipped)["layers.0"]
    assert type(model.layers[0]) is _SublayerOutputOnlyLayer and type(model.layers[0].feed_forward) is AddingSublayer
    assert handoff.SUBLAYER_LINKS_ATTR not in vars(model.layers[0])
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=2e-6, atol=2e-6)
