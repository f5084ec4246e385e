"""The soundness invariants of the derived forwards (``hf_rmsnorm.patch.derived_sites``' module docstring), each
broken by a toy layer (or stack): the statement is left as written, the report says which invariant, and the patched
model computes what the unpatched one does and makes the same module calls in the same order. Without the
matching refusal each of these toys would be rewritten and compute something else, or call its modules otherwise
(checked by hand when the invariants were written)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from derived_toys import SublayerDecoderLayer, ToyDecoderLayer, ToyModel, stack_layout, states, toy_model
from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import derived_sites

NORMS = frozenset({("input_layernorm",), ("post_attention_layernorm",)})

# ----------------------------------------------------------------------------------- 1. once, where it is written


class _DeferredLayer(ToyDecoderLayer):
    """The norm's call deferred in a lambda, which runs after the sum is rebound."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.mixer(hidden_states)
        normed = lambda: self.post_attention_layernorm(hidden_states)  # noqa: E731
        hidden_states = hidden_states + scale
        return hidden_states + self.mlp(normed())


class _ConditionalLayer(ToyDecoderLayer):
    """The norm's call in a branch of a conditional expression: the original does not call it here."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normalise = scale > 1
        residual = hidden_states
        hidden_states = residual + self.mixer(hidden_states)
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states) if normalise else hidden_states)
        return residual + hidden_states


class _DeferredInputLayer(ToyDecoderLayer):
    """The input norm's call deferred in a lambda, which runs after the input is rebound."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = lambda: self.input_layernorm(hidden_states)  # noqa: E731
        hidden_states = hidden_states + scale
        hidden_states = hidden_states + self.mixer(normed())
        return hidden_states


# ----------------------------------------------------------------------------------- 2. nothing runs in between


class _CallBeforeLayer(ToyDecoderLayer):
    """The statement reading the sum calls the mixer before the norm."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.mixer(hidden_states)
        hidden_states = self.mixer(residual) * self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states) * scale


# ----------------------------------------------------------------------------------- 3. no operand is rebound


class _WalrusLayer(ToyDecoderLayer):
    """``:=`` rebinds the residual in the norm's argument, evaluated before the residual is read."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(hidden_states)
        hidden_states = residual + self.post_attention_layernorm(hidden_states + (residual := residual * scale))
        return hidden_states + self.mlp(residual)


class _NonlocalLayer(ToyDecoderLayer):
    """A nested function rebinds the residual (``nonlocal``) while the norm's argument is evaluated."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states

        def scaled(x: torch.Tensor) -> torch.Tensor:
            nonlocal residual
            residual = residual * scale
            return x

        hidden_states = self.mixer(hidden_states)
        hidden_states = residual + self.post_attention_layernorm(scaled(hidden_states))
        return hidden_states + self.mlp(residual)


class _CallResidualLayer(ToyDecoderLayer):
    """The residual is a call, which would run after the norm's argument."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        hidden_states = self.mixer(hidden_states) + self.post_attention_layernorm(self.mlp(hidden_states))
        return hidden_states * scale


class _NonlocalStack(ToyModel):
    """A nested function rebinds the hidden states between two layers."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        def shift() -> None:
            nonlocal hidden_states
            hidden_states = hidden_states + 1.0

        for layer in self.layers:
            hidden_states = layer(hidden_states)
            shift()
        hidden_states = self.norm(hidden_states)
        return hidden_states


# ----------------------------------------------------------------------------------- 5. exceptions


class _SuppressedLayer(ToyDecoderLayer):
    """The sum and its norm in a ``with`` block that suppresses what the norm raises."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        with contextlib.suppress(RuntimeError):
            hidden_states = residual + self.mixer(hidden_states)
            hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states) * scale


class _OverriddenReturnLayer(ToyDecoderLayer):
    """The output add in a ``try`` whose ``finally`` returns something else."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        try:
            hidden_states = residual + self.mlp(hidden_states)
            return hidden_states
        finally:
            return hidden_states - scale  # noqa: B012


# ----------------------------------------------------------------------------------- 6. and 7.


class _ReadAgainLayer(ToyDecoderLayer):
    """``y = F(e); s = r + y`` with ``y`` read again afterwards."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(hidden_states)
        normed = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + normed
        return hidden_states * scale + self.mlp(normed)


class _NestedOutputLayer(ToyDecoderLayer):
    """An add returned by a nested function: not the layer's output."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        def branch(x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(x)

        hidden_states = self.input_layernorm(hidden_states)
        return branch(hidden_states) - scale


# ----------------------------------------------------------------------------------- 9. the tests decide alike


class _TestReadingABindingLayer(ToyDecoderLayer):
    """A norm's test reads a name a statement after the add binds: evaluated at the add, ``marker is not None``
    fails, so the second norm would be chosen, which then reads the first norm's output, not the sum."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        marker = None
        residual = hidden_states
        hidden_states = residual + self.mixer(hidden_states)
        marker = hidden_states.shape
        if marker is not None:
            hidden_states = self.input_layernorm(hidden_states)
        if scale:
            hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


# (layer, what the refusal says, the layer's modules whose calls are recorded, the module made to raise)
BROKEN = {
    "1 deferred": (_DeferredLayer, "the norm call sits in a lambda", (), None),
    "1 conditional": (_ConditionalLayer, "the norm call sits in a conditional expression",
                      ("post_attention_layernorm",), None),
    "1 deferred input norm": (_DeferredInputLayer, "sits in a lambda, which may run after the value is rebound",
                              (), None),
    "2 call before": (_CallBeforeLayer, "before the norm, which would then run first",
                      ("mixer", "post_attention_layernorm"), None),
    "3 walrus": (_WalrusLayer, "':=' in the statement rebinds its residual residual", (), None),
    "3 nonlocal": (_NonlocalLayer, "its residual residual is rebound by a nested scope", (), None),
    "3 call": (_CallResidualLayer, "its residual self.mixer(hidden_states) is no local name", ("mixer", "mlp"), None),
    "5 with": (_SuppressedLayer, "it sits in a with block", (), "post_attention_layernorm"),
    "5 try": (_OverriddenReturnLayer, "it sits in a try block, whose finally could return", (), None),
    "6 read again": (_ReadAgainLayer, "normed, which the rewrite no longer binds, is read or deleted elsewhere",
                     (), None),
    "9 test reads a binding": (_TestReadingABindingLayer, "a test reads marker, which the statements after the add "
                               "bind", (), None),
}


# ----------------------------------------------------------------------------------- 10. sublayer outputs


class _SublayerCallBeforeLayer(SublayerDecoderLayer):
    """Invariant 2 for a sublayer's sum: the consumer runs a call before the norm, which the kernel inside the
    sublayer would then have run first."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attention_output = self.attention(normed, hidden_states)
        normed = torch.tanh(attention_output) * self.post_attention_layernorm(attention_output)
        return self.feed_forward(normed, attention_output)


class _SublayerInTryLayer(SublayerDecoderLayer):
    """Invariant 5 for a sublayer's sum: its handler reads the sum after the norm raised (which the sublayer's
    statement would then raise, before binding it)."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attention_output = None
        try:
            attention_output = self.attention(normed, hidden_states)
            normed = self.post_attention_layernorm(attention_output)
        except RuntimeError:
            normed = attention_output
        return self.feed_forward(normed, attention_output)


SUBLAYER_BROKEN = {
    "2 call before": (_SublayerCallBeforeLayer, "evaluates torch.tanh(attention_output) before the norm", None),
    "5 try": (_SublayerInTryLayer, "it sits in a try block", "post_attention_layernorm"),
}


@pytest.mark.parametrize("case", list(SUBLAYER_BROKEN))
def test_a_sublayer_output_breaking_an_invariant_is_left_as_written_with_the_reason(case):
    layer, reason, raising = SUBLAYER_BROKEN[case]
    code = derived_sites.layer_code(layer, NORMS, frozenset({("attention",), ("feed_forward",)}))
    assert any(reason in refusal.text and "output add of attention" in refusal.text for refusal in code.refusals)
    assert any(reason in text for _, text in patch_model(toy_model(layer)).skipped)
    _assert_patched_runs_as_unpatched(toy_model(layer), ("attention", "post_attention_layernorm"), raising)


def _run(model: nn.Module, watched: tuple[str, ...], raising: str | None) -> tuple[torch.Tensor, list[str]]:
    """The model's output, and the calls of the layers' ``watched`` modules in order (``raising``'s pre-hook
    raises a RuntimeError)."""
    calls: list[str] = []
    handles = []
    for i, layer in enumerate(model.layers):
        for name in watched:
            handles.append(getattr(layer, name).register_forward_hook(
                lambda module, args, output, label=f"{i}.{name}": calls.append(label)))
        if raising is not None:
            def fail(module, args):
                raise RuntimeError("a hook that stops the norm")

            handles.append(getattr(layer, raising).register_forward_pre_hook(fail))
    try:
        with torch.no_grad():
            return model(states()), calls
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_statement_breaking_an_invariant_is_left_as_written_with_the_reason(case):
    layer, reason, _, _ = BROKEN[case]
    code = derived_sites.layer_code(layer, NORMS)
    assert any(reason in refusal.text for refusal in code.refusals), code.refusals
    assert any(reason in text for _, text in patch_model(toy_model(layer)).skipped)


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_statement_breaking_an_invariant_computes_and_calls_as_the_unpatched_one(case):
    layer, _, watched, raising = BROKEN[case]
    _assert_patched_runs_as_unpatched(toy_model(layer), watched, raising)


def test_an_add_in_a_nested_function_is_not_the_layers():
    """Invariant 7: the layer's own statements only (its ``return branch(...) - scale`` is no add)."""
    assert derived_sites.layer_code(_NestedOutputLayer, NORMS).sites == ()
    assert patch_model(toy_model(_NestedOutputLayer)).fused_adds == []


def test_a_layer_with_an_add_in_a_nested_function_computes_as_the_unpatched_one():
    _assert_patched_runs_as_unpatched(toy_model(_NestedOutputLayer))


def test_a_loop_whose_hidden_states_a_nested_function_rebinds_is_no_stack_loop():
    """Invariant 3 for the name a stack's loop passes between layers: a nested function could rebind it between
    two layers (or before the final norm), so nothing is handed on."""
    assert stack_layout(_NonlocalStack) is None
    report = patch_model(toy_model(ToyDecoderLayer, stack=_NonlocalStack))
    assert not any("layer output" in line for line in report.fused_adds)


def test_a_loop_whose_hidden_states_a_nested_function_rebinds_computes_as_the_unpatched_one():
    _assert_patched_runs_as_unpatched(toy_model(ToyDecoderLayer, stack=_NonlocalStack))


def _assert_patched_runs_as_unpatched(model: nn.Module, watched: tuple[str, ...] = (), raising: str | None = None):
    """``model`` patched (a copy) gives its output, and calls the watched modules in its order."""
    patched = copy.deepcopy(model)
    patch_model(patched)
    expected, expected_calls = _run(model, watched, raising)
    got, got_calls = _run(patched, watched, raising)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    assert got_calls == expected_calls
