"""What a forward is to the patcher (``hf_rmsnorm.patch.derived_source``): the function its modeling module
defines, or foreign code (another library's wrapper or replacement, before or after patching), which runs as on
the unpatched model, with the wrapper's module in the report; a source read in full against the running function
(code, defaults, decorators), a file edited since import refused with the true reason; the reasons an unchanged
forward used to be refused for; and the locations a derived forward's new code carries."""

from __future__ import annotations

import ast
import copy
import dis
import functools
import importlib.util
import inspect
import sys
import traceback
import uuid

import pytest
import torch
from transformers import CONFIG_MAPPING

import derived_toys
from derived_toys import ToyDecoderLayer, sites, states, toy_model
from family_cases import CASES
from harness import residual_census
from patch_models import input_ids, tiny_model
from hf_rmsnorm import patch_model
from hf_rmsnorm.ops import library
from hf_rmsnorm.patch import derived_rewrite, derived_sites, derived_source

# Llama and Qwen3 (registered shapes), GraniteMoE and Apertus (derived forwards).
FAMILIES = ["llama", "qwen3", "granitemoe", "apertus"]


def _model(family: str):
    """``family``'s tiny fp32 model (the test table's config, or coverage's for a derived type)."""
    if CASES[family].derived_forward:
        if family not in CONFIG_MAPPING:
            pytest.skip(f"this transformers has no {family}")
        from harness.coverage import _build

        return _build(family)
    return tiny_model(family, **CASES[family].config)


def _scaled(output):
    """A wrapper's visible effect: the hidden states a layer (alone, or first in a tuple) or a stack (its model
    output's ``last_hidden_state``) returns, times 1.5."""
    if isinstance(output, torch.Tensor):
        return output * 1.5
    if isinstance(output, tuple):
        return (output[0] * 1.5, *output[1:])
    output["last_hidden_state"] = output["last_hidden_state"] * 1.5
    return output


def _wrapping(forward, kind: str):
    """``forward`` under another library's wrapper: ``functools.wraps`` (it copies the name, module and
    qualified name) or a plain function that says nothing of what it wraps."""
    if kind == "wraps":
        @functools.wraps(forward)
        def traced(self, *args, **kwargs):
            return _scaled(forward(self, *args, **kwargs))

        return traced

    def replaced(self, *args, **kwargs):
        return _scaled(forward(self, *args, **kwargs))

    return replaced


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32: the patched norms' kernels round differently from the eager norms by a few ulps, carried through.
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


# ----------------------------------------------------------------------------------- foreign wrappers


@pytest.mark.parametrize("kind", ["wraps", "plain", "instance"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_forward_wrapped_before_patching_keeps_its_wrapper_and_its_adds(family, kind, monkeypatch):
    """A layer whose forward another library wrapped (on its class with or without ``functools.wraps``, or on
    each instance): its norms are patched, its adds are not, and the wrapper runs; the report names the wrapper's
    module."""
    model = _model(family)
    layer_class = type(model.model.layers[0])
    if kind == "instance":
        for layer in model.model.layers:
            layer.forward = _wrapping(layer_class.forward, "wraps").__get__(layer)
    else:
        monkeypatch.setattr(layer_class, "forward", _wrapping(layer_class.forward, kind))
    ids = input_ids()
    expected = _logits(model, ids)
    report = patch_model(model)
    assert report.norms and report.fused_adds == []
    verb = {"wraps": "is wrapped by", "plain": "was replaced by", "instance": "was replaced on the instance by"}[kind]
    assert f"forward {verb} {__name__}." in dict(report.skipped)["model.layers.0"]
    _assert_close(_logits(model, ids), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_forward_wrapped_after_patching_runs_its_wrapper_unfused(family, monkeypatch):
    """A wrapper put on the layer class after patching is honoured at call time: the layers run the wrapped
    class forward, unfused and handing nothing on; without it they fuse again."""
    model = _model(family)
    ids = input_ids()
    layer_class = type(model.model.layers[0])
    with monkeypatch.context() as wrapped:
        wrapped.setattr(layer_class, "forward", _wrapping(layer_class.forward, "wraps"))
        expected = _logits(model, ids)
    unwrapped = _logits(model, ids)
    patch_model(model)
    patched_class = type(model.model.layers[0])
    with monkeypatch.context() as wrapped:
        wrapped.setattr(layer_class, "forward", _wrapping(layer_class.forward, "wraps"))
        assert type(model.model.layers[0]) is patched_class
        _assert_close(_logits(model, ids), expected)
        assert residual_census.fused_adds(model, lambda m: _logits(m, ids)) == 0
    _assert_close(_logits(model, ids), unwrapped)
    assert residual_census.fused_adds(model, lambda m: _logits(m, ids)) == CASES[family].adds


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrapper_put_on_the_patched_layer_class_sees_the_unpatched_calls(family, monkeypatch):
    """A library wrapping every module class's forward after patching wraps the patched class itself: the loop
    then calls the layers plainly (no private argument, no appended output reaches the wrapper)."""
    model = _model(family)
    ids = input_ids()
    layer_class = type(model.model.layers[0])
    with monkeypatch.context() as wrapped:
        wrapped.setattr(layer_class, "forward", _wrapping(layer_class.forward, "wraps"))
        expected = _logits(model, ids)
    report = patch_model(model)
    patched_class = type(model.model.layers[0])
    monkeypatch.setattr(patched_class, "forward", _wrapping(patched_class.forward, "wraps"))
    _assert_close(_logits(model, ids), expected)
    # What is left fused: the adds inside each layer ("<layer>: <add> -> <a norm of that layer>").
    inner = [line for line in report.fused_adds if line.split(" -> ")[1].startswith(line.split(": ")[0] + ".")]
    assert residual_census.fused_adds(model, lambda m: _logits(m, ids)) == len(inner) < CASES[family].adds


@pytest.mark.parametrize("family", ["granitemoe", "apertus"])
def test_a_stack_forward_wrapped_before_patching_hands_nothing_on_and_says_why(family, monkeypatch):
    model = _model(family)
    stack_class = type(model.model)
    monkeypatch.setattr(stack_class, "forward", _wrapping(stack_class.forward, "wraps"))
    ids = input_ids()
    expected = _logits(model, ids)
    report = patch_model(model)
    assert dict(report.skipped)["model"].startswith(
        f"residual adds across layers not fused: {stack_class.__qualname__}.forward is wrapped by {__name__}.")
    assert not any("layer output" in line for line in report.fused_adds)
    _assert_close(_logits(model, ids), expected)


# ----------------------------------------------------------------------------------- whole-function staleness


@pytest.fixture
def edited_toys(tmp_path):
    """A copy of ``derived_toys`` imported from a file of its own, and a function editing that file afterwards
    (``edit(old, new)``, the first occurrence), as an editable install is edited under a running process."""
    path = tmp_path / f"toys_{uuid.uuid4().hex}.py"
    path.write_text(inspect.getsource(derived_toys))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)

    def edit(old: str, new: str) -> None:
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))

    yield module, edit
    del sys.modules[path.stem]


LAYER_DEF = "    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5) -> torch.Tensor:\n"
EDITS = {
    "default": (LAYER_DEF, LAYER_DEF.replace("0.5", "0.75"),
                "the running function's defaults are (0.5,), its source's (0.75,)"),
    "decorator": (LAYER_DEF, "    @torch.no_grad()\n" + LAYER_DEF,
                  "its source applies torch.no_grad(), which the running function lacks"),
    "body": ("self.mixer(hidden_states) * scale", "self.mixer(hidden_states) * scale * 2",
             "its code differs from the code running"),
}


@pytest.mark.parametrize("edit_kind", list(EDITS))
def test_a_layer_whose_file_changed_since_import_keeps_its_adds_with_the_reason(edit_kind, edited_toys):
    """The whole running function is compared with what its file compiles to now: an edited default, an added
    decorator or body is refused with what differs; the patched model computes, and trains, as the unpatched."""
    toys, edit = edited_toys
    model = toys.toy_model(toys.ToyDecoderLayer, stack=toys.ToyModel).train()
    old, new, reason = EDITS[edit_kind]
    edit(old, new)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert report.fused_adds == []
    assert dict(report.skipped)["layers.0"] == (
        f"residual adds not fused: the source of ToyDecoderLayer.forward on disk is not the code running: {reason} "
        "(its file changed since it was imported)")
    gradients = []
    for m in (model, patched):
        x = states().requires_grad_()
        m(x).square().sum().backward()
        gradients.append([x.grad, *(p.grad for p in m.parameters())])
    for got, expected in zip(*gradients[::-1]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_stack_whose_file_changed_since_import_hands_nothing_on_and_says_why(edited_toys):
    """The handoffs a stack's forward would make vanish with an entry in the report."""
    toys, edit = edited_toys
    model = toys.toy_model(toys.ToyDecoderLayer, stack=toys.ToyModel)
    edit("        hidden_states = self.norm(hidden_states)\n", "        hidden_states = self.norm(hidden_states * 1)\n")
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert len(report.fused_adds) == 2  # the adds inside each layer
    assert dict(report.skipped)[""].startswith(
        "residual adds across layers not fused: the source of ToyModel.forward on disk is not the code running: "
        "its code differs from the code running")
    with torch.no_grad():
        torch.testing.assert_close(patched(states()), model(states()), rtol=2e-6, atol=2e-6)


def test_lines_added_above_a_forward_leave_it_derived_from_the_file_as_it_is(edited_toys):
    """A class is found by its name, not its line: lines added above it change nothing but the lines the derived
    forward (and the report) name, which are the file's."""
    toys, edit = edited_toys
    model = toys.toy_model(toys.ToyDecoderLayer, stack=toys.ToyModel)
    line = toys.ToyDecoderLayer.forward.__code__.co_firstlineno
    edit("HIDDEN = 48\n", "HIDDEN = 48\n# a comment\n# and another\n")
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert report.fused_adds[0] == (f"layers.0: residual add at line {line + 2 + 3} (into post_attention_layernorm) "
                                    "-> layers.0.post_attention_layernorm")
    assert len(report.fused_adds) == 4
    with torch.no_grad():
        torch.testing.assert_close(patched(states()), model(states()), rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------------- accurate reasons


class _StringDecoderLayer(ToyDecoderLayer):
    """An indented multi-line string and a private ``**__kwargs`` parameter (ESMFold's)."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 0.5, **__kwargs) -> torch.Tensor:
        note = """a string whose later lines
        are indented with the method"""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.mixer(hidden_states) * scale * len(note) / len(note)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class _InheritingDecoderLayer(ToyDecoderLayer):
    """The parent's forward, inherited."""


@pytest.mark.parametrize("layer", [_StringDecoderLayer, _InheritingDecoderLayer])
def test_an_unchanged_forward_is_derived_from(layer):
    """An indented multi-line string, a private name (mangled as in the class body) and an inherited forward
    (the parent's) are the running function's own source, derived from as any other."""
    assert derived_source.foreign_forward(layer) is None
    assert len(sites(layer)) == 2
    model = toy_model(layer)
    patched = copy.deepcopy(model)
    assert len(patch_model(patched).fused_adds) == 4
    with torch.no_grad():
        torch.testing.assert_close(patched(states()), model(states()), rtol=2e-6, atol=2e-6)


def test_the_norms_layers_and_stacks_of_esmfold_and_granitemoe_are_their_sources():
    """ESMFold's layers take ``**__kwargs`` and hold indented multi-line docstrings."""
    from transformers.models.esm import modeling_esmfold
    from transformers.models.granitemoe import modeling_granitemoe

    for module in (modeling_esmfold, modeling_granitemoe):
        for cls in vars(module).values():
            if (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == module.__name__
                    and cls.__name__.endswith(("Norm", "Layer", "Block", "Model")) and "forward" in cls.__dict__):
                assert derived_source.foreign_forward(cls) is None, cls
                assert not isinstance(derived_source.class_forward(cls), str), cls


def test_a_subclass_inheriting_a_transformers_layers_forward_fuses_as_its_parent(monkeypatch):
    """transformers 5.24 wraps each layer subclass's forward again when the class is made (gradient
    checkpointing): the inherited forward is still the parent's."""
    model = _model("granitemoe")
    parent = type(model.model.layers[0])
    child = type(parent.__name__, (parent,), {"__module__": __name__, "__qualname__": "_ChildDecoderLayer"})
    monkeypatch.setitem(globals(), "_ChildDecoderLayer", child)
    for layer in model.model.layers:
        layer.__class__ = child
    ids = input_ids()
    expected = _logits(model, ids)
    report = patch_model(model)
    assert len(report.fused_adds) == CASES["granitemoe"].adds
    _assert_close(_logits(model, ids), expected)


# ----------------------------------------------------------------------------------- locations


def _frame(error: BaseException, filename: str) -> tuple[int, int, int, int]:
    """The position of the last traceback frame in ``filename``."""
    frame = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == filename][-1]
    return frame.lineno, frame.end_lineno, frame.colno, frame.end_colno


@pytest.mark.parametrize("fault", ["operand", "add"])
def test_an_error_in_a_rewritten_add_is_reported_at_the_adds_own_position(fault):
    """GraniteMoE's attention add (its operand ``hidden_states * self.residual_multiplier``, or the add itself
    given operands that do not broadcast): the traceback names the same line and columns patched or not."""
    model = _model("granitemoe")
    layer = model.model.layers[0]
    filename = inspect.getsourcefile(type(layer))
    if fault == "operand":
        layer.residual_multiplier = None
    else:
        layer.self_attn.register_forward_hook(lambda module, args, output: (output[0][..., :-1], output[1]))
    positions = []
    for patch in (False, True):
        if patch:
            patch_model(model)
        with pytest.raises((TypeError, RuntimeError)) as raised:
            _logits(model, input_ids())
        positions.append(_frame(raised.value, filename))
    assert positions[0] == positions[1]
    source = open(filename).read().splitlines()
    assert source[positions[0][0] - 1].strip().startswith("hidden_states = residual + hidden_states *")


def test_every_instruction_of_a_derived_forward_is_located_at_the_code_it_stands_for():
    """``dis``: the helper calls a rewrite creates sit at their add's full position; no instruction names a line
    outside the forward (a new node without a position would take the function's last line)."""
    kind = derived_sites.DerivedLayerKind("x", sites(ToyDecoderLayer), "input_layernorm",
                                          frozenset({("input_layernorm",), ("post_attention_layernorm",)}))
    code = inspect.unwrap(derived_rewrite.fused_forward(ToyDecoderLayer, kind)).__code__
    first = ToyDecoderLayer.forward.__code__.co_firstlineno
    function = next(node for node in ast.walk(ast.parse(open(code.co_filename).read()))
                    if isinstance(node, ast.FunctionDef) and node.lineno == first)
    adds = {node.lineno: node for node in ast.walk(function)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)}
    helpers = {"norm_of_sum", "stream_sum"}
    seen = set()
    for instruction in dis.get_instructions(code):
        position = instruction.positions
        if position.lineno is None:
            continue
        assert function.lineno <= position.lineno <= position.end_lineno <= function.end_lineno, instruction
        if instruction.argval in helpers:
            add = adds[position.lineno]
            assert (position.lineno, position.end_lineno, position.col_offset, position.end_col_offset) == (
                add.lineno, add.end_lineno, add.col_offset, add.end_col_offset)
            seen.add(instruction.argval)
    assert seen == helpers


def test_export_annotates_each_fused_add_with_the_adds_line():
    """``torch.export``'s stack traces of the fused kernels' nodes name the toy layer's adds: the attention add
    into the second norm, and the output add into the next layer's first norm (or the final norm)."""
    model = toy_model()
    patch_model(model)
    lines = set()
    for node in torch.export.export(model, (states(),)).graph.nodes:
        if node.op == "call_function" and str(node.target) == str(library.op("add_norm_fwd").default):
            frame = [line for line in node.meta["stack_trace"].splitlines() if derived_toys.__file__ in line][-1]
            lines.add(int(frame.split(", line ")[1].split(",")[0]))
    first = ToyDecoderLayer.forward.__code__.co_firstlineno
    assert lines == {first + 3, first + 6}


@pytest.fixture
def edited_modeling(tmp_path):
    """``(model, copy)``: ``family``'s tiny model, and the same model (weights and config) built from a copy of
    its modeling file imported under a name of its own, whose decoder layer's forward is then decorated with
    ``@torch.no_grad()`` on disk: the file edited since import, a line added above the layers' and the model's
    forwards."""
    names = []

    def make(family: str):
        model = _model(family)
        original = sys.modules[type(model).__module__]
        path = tmp_path / f"modeling_copy_{uuid.uuid4().hex}.py"
        text = inspect.getsource(original)
        path.write_text(text)
        name = f"{original.__package__}.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        names.append(name)
        spec.loader.exec_module(module)
        copied = getattr(module, type(model).__name__)._from_config(model.config, experts_implementation="eager")
        copied.load_state_dict(model.state_dict())
        layer = type(model.model.layers[0]).__name__
        start = text.index("\n    def forward(", text.index(f"\nclass {layer}("))
        while text[:start].splitlines()[-1].startswith("    @"):  # above the decorators written over it
            start = text.rindex("\n", 0, start)
        path.write_text(text[:start] + "\n    @torch.no_grad()" + text[start:])
        return model, copied.eval()

    yield make
    for name in names:
        del sys.modules[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_layer_whose_file_changed_since_import_trains_as_the_unpatched_one(family, edited_modeling):
    """The layer (of a copied file, so of no registered class: derived from, Llama's and Qwen3's too) is refused
    with what differs, the decorator its file now applies, and the patched model's loss and gradients are the
    unpatched one's."""
    _, copied = edited_modeling(family)
    patched = copy.deepcopy(copied)
    report = patch_model(patched)
    assert report.fused_adds == []
    assert dict(report.skipped)["model.layers.0"] == (
        f"residual adds not fused: the source of {type(copied.model.layers[0]).__qualname__}.forward on disk is not "
        "the code running: its source applies torch.no_grad(), which the running function lacks (its file changed "
        "since it was imported)")
    ids = input_ids()
    results = []
    for m in (copied.train(), patched.train()):
        loss = m(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (expected_loss, expected), (loss, grads) = results
    assert loss == pytest.approx(expected_loss, rel=1e-5) and grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)
