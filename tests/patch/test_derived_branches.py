"""Adds an ``if`` separates from their norm (``hf_rmsnorm.patch.derived_branches``), an ``if`` between a layer's
output add and its ``return`` (``derived_sites``' output pattern, withdrawn handoff), and stack loops whose layer
call sits in an ``if`` or whose output is picked by ``out[0] if isinstance(out, tuple) else out``: what is found,
and that the patched toy computes what the unpatched one does and calls its modules in the same order, whichever
way each branch goes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from derived_toys import HIDDEN, ToyDecoderLayer, ToyModel, sites, stack_layout, states, toy_model
from hf_rmsnorm import patch_model
from hf_rmsnorm.patch import derived_runtime
from hf_rmsnorm.patch.derived_sites import AddSite
from transformers.models.llama.modeling_llama import LlamaRMSNorm


class _CrossLayer(ToyDecoderLayer):
    """A seq2seq decoder layer: the cross block, with its own norm, runs only when ``memory`` is given."""

    def __init__(self) -> None:
        super().__init__()
        self.cross_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.cross = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.mixer(hidden_states)
        hidden_states = residual + hidden_states
        if memory is not None:
            residual = hidden_states
            hidden_states = self.cross_layernorm(hidden_states)
            hidden_states = self.cross(hidden_states) * memory
            hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class _CrossStack(ToyModel):
    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, memory)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _CalledTestLayer(_CrossLayer):
    """The test calls code (``bool`` of a tensor): the add before it stays where it is (invariant 8)."""

    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.mixer(self.input_layernorm(hidden_states))
        if memory.sum() > 0:
            residual = hidden_states
            hidden_states = residual + self.cross(self.cross_layernorm(hidden_states))
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class _RebindingLayer(_CrossLayer):
    """The test's parameter is rebound in the forward: it is no fixed value (invariant 8)."""

    def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.mixer(self.input_layernorm(hidden_states))
        if memory is not None:
            residual = hidden_states
            hidden_states = residual + self.cross(self.cross_layernorm(hidden_states))
            memory = None
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class _SandwichBranchLayer(ToyDecoderLayer):
    """A branch sum normed, then added to the residual (Gemma 4's MoE block): the ``after`` pattern keeps that add;
    nothing moves into the branch."""

    def forward(self, hidden_states: torch.Tensor, flag: bool = True) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.mixer(hidden_states)
        if flag:
            hidden_states = hidden_states + self.mlp(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


@pytest.mark.parametrize("flag", [True, False])
def test_a_normed_branch_sum_added_to_the_residual_stays_where_it_is(flag):
    after = AddSite("after", ("post_attention_layernorm",), _line(_SandwichBranchLayer, "hidden_states = residual +", 0))
    assert after in sites(_SandwichBranchLayer)
    report = _assert_patched_runs_as_unpatched(toy_model(_SandwichBranchLayer, stack=_FlagStack), (flag,), ())
    assert sum("(after post_attention_layernorm)" in line for line in report.fused_adds) == 2


class _FlagStack(ToyModel):
    """Passes one flag to every layer."""

    def forward(self, hidden_states: torch.Tensor, flag: bool) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, flag)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _OptionalAddLayer(ToyDecoderLayer):
    """XLNet's post-LN add taken only when asked: ``if residual: s = s + h`` then the norm of ``s``."""

    def forward(self, hidden_states: torch.Tensor, add_residual: bool = True) -> torch.Tensor:
        output = self.mixer(self.input_layernorm(hidden_states))
        if add_residual:
            output = output + hidden_states
        output = self.post_attention_layernorm(output)
        return hidden_states + self.mlp(output)


def test_the_adds_around_a_cross_block_are_found_in_both_branches():
    norms = ("input_layernorm", "post_attention_layernorm", "cross_layernorm")
    found = sites(_CrossLayer, norms)
    assert set(found) == {
        AddSite("before", ("cross_layernorm",), _line(_CrossLayer, "hidden_states = residual + hidden_states", 0)),
        AddSite("before", ("post_attention_layernorm",), _line(_CrossLayer, "hidden_states = residual + hidden_states", 0)),
        AddSite("before", ("post_attention_layernorm",), _line(_CrossLayer, "hidden_states = residual + hidden_states", 1)),
        AddSite("output", (), _line(_CrossLayer, "hidden_states = residual + hidden_states", 2)),
    }


@pytest.mark.parametrize("memory", [None, "given"])
def test_a_cross_block_computes_and_calls_as_the_unpatched_one(memory):
    model = toy_model(_CrossLayer, stack=_CrossStack)
    argument = None if memory is None else torch.rand(HIDDEN, generator=torch.Generator().manual_seed(3))
    report = _assert_patched_runs_as_unpatched(model, (argument,), ("input_layernorm", "cross_layernorm",
                                                                    "post_attention_layernorm", "mlp"))
    assert sum("into" in line for line in report.fused_adds) == 6  # three sites in each of the two layers


@pytest.mark.parametrize("layer, memory", [(_CalledTestLayer, 1.0), (_CalledTestLayer, -1.0), (_RebindingLayer, 1.0),
                                           (_RebindingLayer, None)])
def test_an_add_before_a_test_that_runs_code_stays_in_place(layer, memory):
    norms = ("input_layernorm", "post_attention_layernorm", "cross_layernorm")
    first_add = _line(layer, "hidden_states = residual + self.mixer", 0)
    assert all(site.line != first_add for site in sites(layer, norms))
    argument = None if memory is None else torch.full((HIDDEN,), memory)
    _assert_patched_runs_as_unpatched(toy_model(layer, stack=_CrossStack), (argument,), ("cross_layernorm",))


@pytest.mark.parametrize("add_residual", [True, False])
def test_an_add_ending_a_branch_goes_into_the_norm_after_the_if(add_residual):
    found = sites(_OptionalAddLayer)
    assert AddSite("before", ("post_attention_layernorm",), _line(_OptionalAddLayer, "output = output + hidden_states",
                                                                  0)) in found

    _assert_patched_runs_as_unpatched(toy_model(_OptionalAddLayer, stack=_FlagStack), (add_residual,),
                                      ("post_attention_layernorm",))


class _ShiftedOutputLayer(ToyDecoderLayer):
    """An ``if`` between the output add and the ``return`` that changes the sum (mBART's fp16 clamp), here taken
    in fp32, by rebinding or in place."""

    shifted_dtype = torch.float32

    def forward(self, hidden_states: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.mixer(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        if hidden_states.dtype == self.shifted_dtype:
            if in_place:
                hidden_states.add_(1.0)
            else:
                hidden_states = hidden_states + 1.0
        return hidden_states


class _UntakenBranchLayer(_ShiftedOutputLayer):
    """The same ``if`` never taken here (fp16 only): the handoff stands."""

    shifted_dtype = torch.float16


@pytest.mark.parametrize("in_place", [False, True])
def test_a_branch_after_the_output_add_withdraws_the_handoff(in_place):
    assert AddSite("output", (), _line(_ShiftedOutputLayer, "hidden_states = residual + self.mlp", 0)) in sites(
        _ShiftedOutputLayer)
    report = _assert_patched_runs_as_unpatched(toy_model(_ShiftedOutputLayer, stack=_FlagStack), (in_place,), ())
    assert sum("layer output" in line for line in report.fused_adds) == 2  # planned: withdrawn at every call


def test_a_branch_not_taken_after_the_output_add_keeps_the_handoff(monkeypatch):
    withdrawn, withdraw = [], derived_runtime.withdraw
    monkeypatch.setattr(derived_runtime, "withdraw", lambda call: (withdrawn.append(call), withdraw(call)))
    _assert_patched_runs_as_unpatched(toy_model(_ShiftedOutputLayer, stack=_FlagStack), (False,), ())
    assert len(withdrawn) == 4  # the branch taken: each layer withdraws, in both runs of the helper
    withdrawn.clear()
    report = _assert_patched_runs_as_unpatched(toy_model(_UntakenBranchLayer), (), ())
    assert withdrawn == [] and sum("layer output" in line for line in report.fused_adds) == 2


class _OneBranchOpeningLayer(ToyDecoderLayer):
    """Falcon's opening: the input normalised in one branch, read otherwise in the other."""

    def forward(self, hidden_states: torch.Tensor, raw: bool = False) -> torch.Tensor:
        if raw:
            normed = self.mixer(hidden_states)
        else:
            normed = self.input_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(normed)
        hidden_states = residual + hidden_states
        return hidden_states


@pytest.mark.parametrize("raw", [False, True])
def test_an_input_norm_in_one_branch_takes_the_handoff_there(raw):
    report = _assert_patched_runs_as_unpatched(toy_model(_OneBranchOpeningLayer, stack=_FlagStack), (raw,), ())
    assert report.fused_adds == ["layers.0: layer output -> layers.1.input_layernorm", "layers.1: layer output -> norm"]


class _LayerDropStack(ToyModel):
    """LayerDrop's loop: the layer call in an ``if``, some layers skipped."""

    def forward(self, hidden_states: torch.Tensor, skipped: tuple[int, ...] = ()) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            to_drop = i in skipped
            if not to_drop:
                hidden_states = layer(hidden_states)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class _PickingStack(ToyModel):
    """Blenderbot's loop: the output picked as ``out[0] if isinstance(out, tuple) else out``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            layer_outputs = layer(hidden_states)
            hidden_states = layer_outputs[0] if isinstance(layer_outputs, tuple) else layer_outputs
        hidden_states = self.norm(hidden_states)
        return hidden_states


def test_loops_with_the_layer_call_in_an_if_or_a_picked_output_are_read():
    assert stack_layout(_LayerDropStack) == ("layers", "norm")
    assert stack_layout(_PickingStack) == ("layers", "norm")


@pytest.mark.parametrize("skipped", [(), (1,), (2,), (0, 2)])
def test_a_layer_skipped_leaves_what_was_handed_to_it_unread(skipped):
    """Layer 1 skipped: layer 0 handed its normed sum to layer 1, so layer 2 normalises its input itself; the last
    layer skipped: the final norm does."""
    torch.manual_seed(0)
    model = _LayerDropStack(ToyDecoderLayer, n_layers=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.5)
    report = _assert_patched_runs_as_unpatched(model.eval(), (skipped,), ("input_layernorm",))
    assert sum("layer output" in line for line in report.fused_adds) == 3


def test_a_picked_output_is_handed_on():
    report = _assert_patched_runs_as_unpatched(toy_model(ToyDecoderLayer, stack=_PickingStack), (), ())
    assert sum("layer output" in line for line in report.fused_adds) == 2


def _line(cls: type, text: str, occurrence: int) -> int:
    """The file line of the ``occurrence``-th line of ``cls.forward`` that starts with ``text``."""
    import inspect

    lines, start = inspect.getsourcelines(cls.forward)
    matches = [start + k for k, line in enumerate(lines) if line.strip().startswith(text)]
    return matches[occurrence]


def _assert_patched_runs_as_unpatched(model: nn.Module, args: tuple, watched: tuple[str, ...]):
    """``model`` patched (a copy) gives its output on ``states()`` and ``args`` (no hook: the fused paths run), and
    calls the layers' ``watched`` modules in its order (hooks record them: the hook guard runs the original code
    wherever a hook watches, so the order is checked where the rewrite left the statements alone); returns the
    patch report."""
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    with torch.no_grad():
        torch.testing.assert_close(patched(states(), *args), model(states(), *args), rtol=2e-6, atol=2e-6)
    orders = []
    for m in (model, patched):
        calls: list[str] = []
        handles = [getattr(layer, name).register_forward_hook(
            lambda module, a, out, label=f"{i}.{name}": calls.append(label))
            for i, layer in enumerate(m.layers) for name in watched]
        try:
            with torch.no_grad():
                m(states(), *args)
        finally:
            for handle in handles:
                handle.remove()
        orders.append(calls)
    assert orders[0] == orders[1]
    return report
