"""Sandwich layers (Gemma 2-4, GLM-4): the post-attention norm, the residual add after it and the pre-feedforward
norm of the sum in one launch (``hf_rmsnorm.patch.sandwich``), in the post-norm shape's body and in the forwards
derived from a layer's code. Each model is compared with today's two launches (``sandwich.chains`` refused:
bitwise, values and gradients), with its eager self and with an fp64 copy."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from derived_toys import HIDDEN, ToyDecoderLayer, sites, states, toy_model
from family_cases import CASES
from patch_models import Parity, graph_calls, input_ids, recording_aot_eager, tiny_model
from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import fused, handoff, sandwich
from hf_rmsnorm.patch.derived_sites import AddSite

# The sandwich families: their PostNorm entries (Gemma 2, Gemma 3, GLM-4) and a derived forward (Gemma 4).
FAMILIES = ["gemma2", "gemma3_text", "glm4", "gemma4_text"]
# Where each family's chained pair is: (the norm before the add, the norm of the sum).
PAIRS = {
    "gemma2": ("post_attention_layernorm", "pre_feedforward_layernorm"),
    "gemma3_text": ("post_attention_layernorm", "pre_feedforward_layernorm"),
    "glm4": ("post_self_attn_layernorm", "post_attention_layernorm"),
    "gemma4_text": ("post_attention_layernorm", "pre_feedforward_layernorm"),
}


def _model(family: str, dtype: torch.dtype = torch.float32):
    return tiny_model(CASES[family].model_type, dtype, **CASES[family].config)


def _counting_pairs(monkeypatch) -> list:
    calls = []
    real = sandwich.fused_pair
    monkeypatch.setattr(sandwich, "fused_pair", lambda *args: calls.append(args) or real(*args))
    return calls


def _unchained(monkeypatch):
    """Today's two launches: ``chains`` refused, so every caller takes its plain path."""
    monkeypatch.setattr(sandwich, "chains", lambda norm, next_norm: False)


def _not_handed(monkeypatch):
    """The patch before the sandwich handoff: each layer's output add a ``norm_add`` of its own, the next norm a
    launch of its own (``handoff.add_normed_residual`` hands nothing on)."""
    monkeypatch.setattr(handoff, "add_normed_residual", lambda call, norm, x, residual: None)


def _split(calls: list, model, family: str) -> tuple[list, list]:
    """The chained calls inside the layers (``PAIRS[family]``), and the others: layers' output adds handed on."""
    seconds = [getattr(layer, PAIRS[family][1]) for layer in model.model.layers]
    inside = [call for call in calls if any(call[3] is norm for norm in seconds)]
    return inside, [call for call in calls if all(call[3] is not norm for norm in seconds)]


def _handoff_pairs(model, family: str) -> list[tuple]:
    """What each sandwich layer's output add hands on to: (its post-feedforward norm, the next layer's input norm
    or the final norm)."""
    layers, post = model.model.layers, POST_MLP_NORMS[family]
    return [(getattr(layer, post), following.input_layernorm)
            for layer, following in zip(layers, layers[1:])] + [(getattr(layers[-1], post), model.model.norm)]


# The norm before each sandwich layer's output add (registered families: the handoff chains it to the next norm).
POST_MLP_NORMS = {"gemma2": "post_feedforward_layernorm", "gemma3_text": "post_feedforward_layernorm",
                  "glm4": "post_mlp_layernorm"}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_launch_per_layer_bitwise_as_two_in_bf16(family, monkeypatch):
    """bf16 logits of the chained patch equal the two-launch patch's bit for bit (and the fp32 model's are within
    1e-5 of eager's, and bf16 no less accurate against fp64: ``Parity``; unpatching restores every class and drops
    the stack's links); each layer makes one chained call inside it, and a registered sandwich layer (not Gemma 4:
    its output is scaled after the add, ``derived_sites``) one more for its output add with the next norm, bitwise
    as the patch without that handoff."""
    ids = input_ids()
    model = _model(family)
    parity = Parity(model, lambda m: _logits(m, ids))
    report = patch_model(model)
    if family in POST_MLP_NORMS:  # one line for the output add, naming both norms it goes into
        post = POST_MLP_NORMS[family]
        assert [line for line in report.fused_adds if "mlp residual" in line] == [
            f"model.layers.0: mlp residual -> model.layers.0.{post}, then model.layers.1.input_layernorm",
            f"model.layers.1: mlp residual -> model.layers.1.{post}, then model.norm"]
    parity.check_patched()  # fp32 and bf16 parity, then unpatches the fp32 model
    assert not any(fused.original_class(m) for m in model.modules()) and handoff.LINKS_ATTR not in vars(model.model)
    bf16 = parity.bf16  # patched by check_patched
    calls = _counting_pairs(monkeypatch)
    chained = _logits(bf16, ids)
    inside, handed = _split(calls, bf16, family)
    assert len(inside) == bf16.config.num_hidden_layers
    first, second = PAIRS[family]
    assert all(norm is getattr(layer, first) and next_norm is getattr(layer, second)
               for (norm, _, _, next_norm), layer in zip(inside, bf16.model.layers))
    expected = [] if family == "gemma4_text" else _handoff_pairs(bf16, family)
    assert len(handed) == len(expected)
    assert all(norm is a and next_norm is b for (norm, _, _, next_norm), (a, b) in zip(handed, expected))
    with monkeypatch.context() as patch:
        _not_handed(patch)
        assert torch.equal(chained, _logits(bf16, ids))
    with monkeypatch.context() as patch:
        _unchained(patch)
        assert torch.equal(chained, _logits(bf16, ids))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    loss = logits.float().logsumexp(-1).mean() - logits.float()[..., 3].mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_are_bitwise_those_of_two_launches(family, monkeypatch):
    """Training in bf16: the loss and every parameter's gradient equal the two-launch patch's bit for bit (the
    operator's backward is the two ops' backwards, the sum's gradient accumulated as autograd accumulates it), and
    the patch's without the output add handed on."""
    model = _model(family, torch.bfloat16).train()
    patch_model(model)
    ids = input_ids()
    calls = _counting_pairs(monkeypatch)
    loss, grads = _loss_and_grads(model, ids)
    assert len(calls) == (1 if family == "gemma4_text" else 2) * model.config.num_hidden_layers
    for other in (_not_handed, _unchained):
        with monkeypatch.context() as patch:
            other(patch)
            loss2, grads2 = _loss_and_grads(model, ids)
        assert torch.equal(loss, loss2) and grads.keys() == grads2.keys()
        assert all(torch.equal(grads[name], grads2[name]) for name in grads)


@pytest.mark.parametrize("family", ["gemma3_text", "gemma4_text"])
@pytest.mark.parametrize("watched", ["first", "second"])
def test_a_hook_on_either_norm_makes_the_pair_two_calls(family, watched, monkeypatch):
    """A forward pre-hook on either norm of the pair: no chained launch, and the hooked norm is called as the
    unpatched layer calls it (the sum, for the second), whatever the hook sees; the logits unchanged."""
    model = _model(family, torch.bfloat16)
    ids = input_ids()
    expected = _logits(model, ids)
    patch_model(model)
    layer = model.model.layers[0]
    norm = getattr(layer, PAIRS[family][0 if watched == "first" else 1])
    seen = []
    handle = norm.register_forward_pre_hook(lambda module, args: seen.append(args))
    calls = _counting_pairs(monkeypatch)
    got = _logits(model, ids)
    handle.remove()
    assert len(_split(calls, model, family)[0]) == model.config.num_hidden_layers - 1
    assert len(seen) == 1 and len(seen[0]) == 1  # one tensor: the plain call
    assert torch.equal(got, expected)


@pytest.mark.parametrize("how", ["compiled on its own", "profiler's _call_impl"])
def test_a_norm_whose_call_does_more_than_its_forward_is_not_chained(how, monkeypatch):
    """The pair's kernel runs both norms' work without calling them, so a norm whose call would do more than run its
    forward (compiled on its own, ``_call_impl`` wrapped by a profiler: ``guard.calls_forward_alone``) is not
    chained: its own call runs."""
    model = _model("gemma3_text")
    patch_model(model)
    layer = model.model.layers[0]
    first, second = (getattr(layer, name) for name in PAIRS["gemma3_text"])
    assert sandwich.chains(first, second)
    if how == "compiled on its own":
        second.compile()
    else:
        wrapped = torch.nn.Module._call_impl
        monkeypatch.setattr(torch.nn.Module, "_call_impl", lambda self, *args, **kwargs: wrapped(self, *args, **kwargs))
    assert not sandwich.chains(first, second) and not sandwich.chains(second, first)


@pytest.mark.parametrize("when", ["before the call", "by the layer's code"])
def test_a_hook_on_the_next_input_norm_gets_the_plain_calls(when, monkeypatch):
    """A forward pre-hook on layer 1's input norm, registered before the model's call (the loop links nothing
    then: ``handoff.foreign_code``) or by layer 0's own code while it runs (its MLP's hook; the output add asks
    ``sandwich.chains`` again): layer 0's output add runs as without a handoff, the norm is called on the sum (the
    hook sees that one tensor), layer 1 hands on to the final norm still, and the logits are the unpatched
    model's (bf16, which the patch equals bit for bit)."""
    model = _model("gemma3_text", torch.bfloat16)
    ids = input_ids()
    expected = _logits(model, ids)
    patch_model(model)
    layers = model.model.layers
    seen, hooks = [], []

    def register(*_):
        hooks.append(layers[1].input_layernorm.register_forward_pre_hook(lambda m, args: seen.append(args)))

    if when == "before the call":
        register()
    else:
        hooks.append(layers[0].mlp.register_forward_hook(register))
    calls = _counting_pairs(monkeypatch)
    got = _logits(model, ids)
    for hook in hooks:
        hook.remove()
    inside, handed = _split(calls, model, "gemma3_text")
    assert len(inside) == 2 and [(norm, next_norm) for norm, _, _, next_norm in handed] == [
        (layers[1].post_feedforward_layernorm, model.model.norm)]
    assert len(seen) == 1 and len(seen[0]) == 1
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------- derived forwards' pattern


class ToySandwichLayer(ToyDecoderLayer):
    """Gemma's sandwich in a layer of no registered shape: the input norm, the post-attention norm and its add,
    then the pre-feedforward norm of the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_feedforward_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(self.input_layernorm(hidden_states))
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states) * scale
        return residual + hidden_states


class ToyCallFirstLayer(ToySandwichLayer):
    """The consumer runs a call before the next norm (invariant 2): the add stays an ``after`` site alone."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(self.input_layernorm(hidden_states))
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mixer(residual) + self.pre_feedforward_layernorm(hidden_states)
        return residual + self.mlp(hidden_states) * scale


class ToyWithBlockLayer(ToySandwichLayer):
    """The sum and its next norm inside a ``with`` block (invariant 5): the add stays an ``after`` site alone."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(self.input_layernorm(hidden_states))
        with torch.enable_grad():
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.pre_feedforward_layernorm(hidden_states)
        return residual + self.mlp(hidden_states) * scale


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")


@pytest.mark.parametrize("layer, chained", [(ToySandwichLayer, True), (ToyCallFirstLayer, False),
                                            (ToyWithBlockLayer, False)])
def test_a_derived_forward_chains_an_after_site_to_the_next_norm(layer, chained, monkeypatch):
    """The post-attention add is an ``after`` site either way (the report counts it once); where the ``before``
    rules allow moving the next norm's call up to it, one chained call per layer, computing what the unpatched
    layer computes (fp32: within the norms' own rounding)."""
    lines = layer.forward.__code__.co_firstlineno
    add_line = lines + (5 if layer is ToyWithBlockLayer else 4)
    assert AddSite("after", ("post_attention_layernorm",), add_line) in sites(layer, NORMS)
    model = toy_model(layer)
    x = states()
    with torch.no_grad():
        expected = model(x)
    report = patch_model(model)
    assert sum("(after post_attention_layernorm)" in add for add in report.fused_adds) == 2, str(report)
    calls = _counting_pairs(monkeypatch)
    with torch.no_grad():
        got = model(x)
    assert len(calls) == (2 if chained else 0)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


def test_gradient_checkpointing_keeps_the_chained_gradients(monkeypatch):
    """Non-reentrant checkpointing recomputes each layer, chained call included: the loss and gradients of the
    checkpointed patched model equal those without checkpointing, bit for bit (bf16)."""
    model = _model("gemma3_text", torch.bfloat16).train()
    patch_model(model)
    ids = input_ids()
    loss, grads = _loss_and_grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = _counting_pairs(monkeypatch)
    loss2, grads2 = _loss_and_grads(model, ids)
    # The forward, then the recomputation: each layer's sandwich and its output add handed on.
    assert len(calls) == 2 * 2 * model.config.num_hidden_layers
    assert torch.equal(loss, loss2) and all(torch.equal(grads[name], grads2[name]) for name in grads)


@pytest.mark.parametrize("mode", ["compiled", "checkpointed", "checkpointed reentrant"])
def test_compiled_and_checkpointed_training_hand_on_with_the_same_gradients(mode, monkeypatch):
    """torch.compile(fullgraph=True) and either checkpointing kind hand each Gemma 3 layer's output add on as eager
    training does (twice the chained launches of the patch without the handoff: one inside each layer, one for its
    output), and the loss and every gradient equal that patch's bit for bit (bf16)."""
    model = _model("gemma3_text", torch.bfloat16).train()
    patch_model(model)
    ids = input_ids()
    if mode.startswith("checkpointed"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode.endswith("reentrant")})
    results = []
    for handing in (True, False):
        with monkeypatch.context() as patch:
            if not handing:
                _not_handed(patch)
            calls, graphs = _counting_pairs(patch), []
            torch._dynamo.reset()
            runner = model
            if mode == "compiled":
                runner = torch.compile(model, backend=recording_aot_eager(graphs), fullgraph=True)
            loss, grads = _loss_and_grads(runner, ids)
        chained = graph_calls(graphs, "norm_add_norm_fwd")
        results.append((chained if mode == "compiled" else len(calls), loss, grads))
    (chained, loss, grads), (unhanded, loss2, grads2) = results
    assert unhanded > 0 and chained == 2 * unhanded
    assert torch.equal(loss, loss2) and grads.keys() == grads2.keys()
    assert all(torch.equal(grads[name], grads2[name]) for name in grads)

