"""Residual adds written as a call of a module-level function (``hf_rmsnorm.patch.derived_inline``): the call is
inlined so that the add fuses, guarded at every call by the function it looks up; each check of the module
docstring broken by a toy layer (the call is left as written, the report says why, and the patched model computes
what the unpatched one does); then Falcon's and GPT-NeoX-Japanese's layers, which write their adds so."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.nn.functional as F
from derived_toys import HIDDEN, ToyDecoderLayer, states, toy_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.falcon.modeling_falcon import dropout_add as falcon_dropout_add

from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import derived_rewrite, derived_sites, handoff

NORMS = frozenset({("input_layernorm",), ("post_attention_layernorm",)})
PROB = 0.25


# ----------------------------------------------------------------------------------- residual add functions


def dropout_add(x: torch.Tensor, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    """Falcon's form."""
    out = F.dropout(x, p=prob, training=training)
    out = residual + out
    return out


def bias_dropout_add(x, bias, residual, prob, training):
    """GPT-NeoX-Japanese's form: an ``if`` inside, and the add under one decided when the body starts."""
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    if residual is not None:
        out = residual + out
    return out


def _dropout_sub(x: torch.Tensor, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    """Another body of the same signature (what a library could set as ``dropout_add.__code__``)."""
    out = F.dropout(x, p=prob, training=training)
    return residual - out


def defaulted_add(x, residual, prob=PROB):
    out = F.dropout(x, p=prob, training=False)
    out = residual + out
    return out


def looped_add(x, residual, repeats):
    out = x
    for _ in range(repeats):
        out = out * 1.0
    out = residual + out
    return out


def gated_add(x, residual, gate):
    out = x * 1.0
    if gate:
        out = residual + out
    return out


# ----------------------------------------------------------------------------------- toy layers


class InlinedLayer(ToyDecoderLayer):
    """A pre-norm layer whose two adds are calls: the first feeds the second norm, the second is the output."""

    prob = PROB

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = dropout_add(self.mixer(hidden_states) * scale, residual, self.prob, training=self.training)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = bias_dropout_add(hidden_states, bias=None, residual=residual, prob=self.prob,
                                         training=self.training)
        return hidden_states


class NoResidualLayer(InlinedLayer):
    """The add function's residual is None (where the scale is positive): no add happens."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        hidden_states = self.input_layernorm(hidden_states)
        residual = None if scale > 0 else hidden_states
        hidden_states = bias_dropout_add(self.mixer(hidden_states), None, residual, PROB, self.training)
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class _DefaultLayer(ToyDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = defaulted_add(self.mixer(hidden_states) * scale, residual)
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class _LoopLayer(ToyDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = looped_add(self.mixer(hidden_states) * scale, residual, 2)
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class _GateLayer(ToyDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = gated_add(self.mixer(hidden_states) * scale, residual, scale > 0)
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class _ShadowLayer(ToyDecoderLayer):
    """The forward binds F, which the function's body reads as its module's global."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        F = self.input_layernorm(hidden_states)  # noqa: N806
        hidden_states = dropout_add(self.mixer(F) * scale, residual, PROB, False)
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class _ForeignLayer(ToyDecoderLayer):
    """Falcon's function, another module's: its body reads that module's globals."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = falcon_dropout_add(self.mixer(hidden_states) * scale, residual, PROB, False)
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class _NestedCallLayer(ToyDecoderLayer):
    """The call inside an expression: its result is not bound as the sum."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = dropout_add(self.mixer(hidden_states), residual, PROB, False) * scale
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


REFUSED = {
    "a default": (_DefaultLayer, "the call leaves prob to the function's defaults"),
    "a loop": (_LoopLayer, "its body has a For statement"),
    "an undecided add": (_GateLayer, "its add is under 'if gate', which cannot be decided"),
    "a shadowed global": (_ShadowLayer, "its body reads the global F, which the forward binds"),
    "another module's": (_ForeignLayer, "transformers.models.falcon.modeling_falcon.dropout_add is another module's"),
    "not the whole value": (_NestedCallLayer, "the call is not the whole value of a statement"),
}


def _outputs(model: torch.nn.Module, train: bool, seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's output and, in training, the gradients of its parameters (of the output's sum of squares),
    the dropouts drawing from one seed."""
    model.train(train)
    x = states().requires_grad_(train)
    torch.manual_seed(seed)
    with torch.set_grad_enabled(train):
        out = model(x)
        if not train:
            return out, []
        out.pow(2).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def _assert_runs_as_unpatched(model: torch.nn.Module, patched: torch.nn.Module, train: bool = False) -> None:
    expected, expected_grads = _outputs(model, train)
    got, grads = _outputs(patched, train)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def _patched(model: torch.nn.Module) -> torch.nn.Module:
    patched = copy.deepcopy(model)
    patch_model(patched)
    return patched


# ----------------------------------------------------------------------------------- the toys


def test_the_calls_adds_are_sites_at_their_call_lines():
    code = derived_sites.layer_code(InlinedLayer, NORMS)
    first = InlinedLayer.forward.__code__.co_firstlineno + 3  # the dropout_add call
    assert [(s.position, s.norm, s.line) for s in code.sites] == [
        ("before", ("post_attention_layernorm",), first), ("output", (), first + 3)]
    assert code.refusals == ()


def test_the_inlined_adds_fuse_and_hand_on():
    report = patch_model(toy_model(InlinedLayer))
    assert len(report.fused_adds) == 4, report.fused_adds  # each layer's inner add and its output
    assert sum("layer output -> " in line for line in report.fused_adds) == 2


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_an_inlined_layer_computes_as_the_unpatched_one(train):
    """With dropout active in training the same masks are drawn in the same order: the outputs and every
    gradient are the unpatched model's."""
    model = toy_model(InlinedLayer)
    _assert_runs_as_unpatched(model, _patched(model), train)


def test_a_function_replaced_in_its_module_after_patching_is_called(monkeypatch):
    model = toy_model(InlinedLayer)
    patched = _patched(model)
    expected_before = _outputs(model, False)[0]
    monkeypatch.setitem(globals(), "dropout_add", _dropout_sub)
    expected = _outputs(model, False)[0]
    assert not torch.allclose(expected, expected_before)  # what the inlined body computes is no longer right
    torch.testing.assert_close(_outputs(patched, False)[0], expected, rtol=2e-6, atol=2e-6)


def test_a_function_whose_code_is_replaced_after_patching_runs_its_new_code(monkeypatch):
    model = toy_model(InlinedLayer)
    patched = _patched(model)
    expected_before = _outputs(model, False)[0]
    monkeypatch.setattr(dropout_add, "__code__", _dropout_sub.__code__)
    expected = _outputs(model, False)[0]
    assert not torch.allclose(expected, expected_before)
    torch.testing.assert_close(_outputs(patched, False)[0], expected, rtol=2e-6, atol=2e-6)


def test_an_add_under_a_parameter_that_is_none_runs_the_original_call():
    """``bias_dropout_add(..., residual=None)`` adds nothing: the guard's test sends it to the original call."""
    assert [s.position for s in derived_sites.layer_code(NoResidualLayer, NORMS).sites] == ["before"]
    model = toy_model(NoResidualLayer)
    _assert_runs_as_unpatched(model, _patched(model), train=True)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_call_that_cannot_be_inlined_exactly_is_left_with_the_reason(case):
    layer, reason = REFUSED[case]
    code = derived_sites.layer_code(layer, NORMS)
    assert any(reason in refusal.text for refusal in code.refusals), code.refusals
    assert all(site.position != "before" for site in code.sites)
    assert any(reason in text for _, text in patch_model(toy_model(layer)).skipped)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_call_left_as_written_computes_as_the_unpatched_one(case):
    model = toy_model(REFUSED[case][0])
    _assert_runs_as_unpatched(model, _patched(model))


def _derived_forward(cls: type):
    code = derived_sites.layer_code(cls, NORMS)
    kind = derived_sites.DerivedLayerKind(f"{cls.__module__}.{cls.__qualname__}", code.sites, code.input_norm, NORMS)
    return derived_rewrite.fused_forward(cls, kind)


def test_tracebacks_and_dis_name_the_functions_and_the_calls_lines():
    forward = _derived_forward(InlinedLayer)
    lines = {line for _, _, line in forward.__code__.co_lines() if line is not None}
    call = InlinedLayer.forward.__code__.co_firstlineno + 3
    body = dropout_add.__code__.co_firstlineno + 2  # out = F.dropout(...)
    assert {call, call + 3, body} <= lines
    layer = InlinedLayer()
    layer.prob = 2.0  # F.dropout raises, from the inlined body
    with pytest.raises(ValueError) as raised:
        forward(layer, states().to(torch.float32), **{handoff.CALL_PARAM: None})
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert any(f.filename == __file__ and f.lineno == body for f in frames), frames


def test_a_compiled_inlined_model_traces_in_one_graph_and_follows_a_replaced_function(monkeypatch):
    model = toy_model(InlinedLayer)
    patched = _patched(model)
    compiled = torch.compile(patched, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(states()), model(states()), rtol=2e-6, atol=2e-6)
        monkeypatch.setitem(globals(), "dropout_add", _dropout_sub)
        torch.testing.assert_close(compiled(states()), model(states()), rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------------- Falcon, GPT-NeoX-Japanese


def _tiny(model_type: str, dtype: torch.dtype = torch.float32, **fields) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=64, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # trained-like norms: weights around 1, biases not zero
                p.normal_(1.0, 0.3) if name.endswith("weight") else p.normal_(0.0, 0.1)
    return model.to(dtype).eval()


# (model type, config fields, the fused adds: (layer, "residual add" inside it or its "layer output" handed on))
MODELS = {
    # Parallel attention: one output add per layer, handed on (the next layer's input norm sits in one branch of an
    # `if` whose other branch calls other norms).
    "falcon": ("falcon", {}, [("transformer.h.0", "layer output"), ("transformer.h.1", "layer output")]),
    "falcon_sequential": ("falcon", dict(parallel_attn=False), [
        ("transformer.h.0", "residual add"), ("transformer.h.1", "residual add"), ("transformer.h.0", "layer output"),
        ("transformer.h.1", "layer output")]),
    "gpt_neox_japanese": ("gpt_neox_japanese", dict(intermediate_multiple_size=2), [
        ("gpt_neox_japanese.layers.0", "residual add"), ("gpt_neox_japanese.layers.1", "residual add"),
        ("gpt_neox_japanese.layers.0", "layer output"), ("gpt_neox_japanese.layers.1", "layer output")]),
}


def _fused(report) -> list[tuple[str, str]]:
    return sorted((line.split(": ")[0], "layer output" if ": layer output" in line else "residual add")
                  for line in report.fused_adds)


def _ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(MODELS))
def test_models_writing_their_adds_as_calls_fuse_them_with_parity(case):
    model_type, fields, fused = MODELS[case]
    model = _tiny(model_type, **fields)
    truth = _tiny(model_type, torch.float64, **fields)
    bf16 = _tiny(model_type, torch.bfloat16, **fields)
    x = _ids()
    with torch.no_grad():
        expected, exact, eager16 = model(x).logits, truth(x).logits, bf16(x).logits
    report = patch_model(model)
    patch_model(bf16)
    assert _fused(report) == sorted(fused), report.fused_adds
    with torch.no_grad():
        got, got16 = model(x).logits, bf16(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # bf16 against fp64: never less accurate than eager (one bf16 ulp of the largest logit at most).
    scale = exact.abs().max().item()
    assert (got16.double() - exact).abs().max() <= (eager16.double() - exact).abs().max() + 2**-7 * scale
    assert (got16.double() - exact).abs().mean() <= 1.05 * (eager16.double() - exact).abs().mean()


@pytest.mark.parametrize("case", ["falcon_sequential", "gpt_neox_japanese"])
def test_models_writing_their_adds_as_calls_train_like_the_original(case):
    """Dropout active in the inlined functions: the same masks in the same order, the same losses and gradients."""
    model_type, fields, _ = MODELS[case]
    drop = dict(hidden_dropout=0.2, attention_dropout=0.1)
    model = _tiny(model_type, **fields, **drop).train()
    patched = copy.deepcopy(model)
    patch_model(patched)
    x = _ids()
    losses, grads = [], []
    for m in (model, patched):
        torch.manual_seed(5)
        loss = m(x, labels=x).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
