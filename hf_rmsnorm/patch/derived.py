"""Fused forwards derived from a decoder layer's own code, for layers of no shape ``shapes.py`` describes, and
the stacks' forwards derived from theirs, whose layer loop hands each layer's normed output on (``handoff.py``).

The forward transformers installed is read (its source, parsed) and every residual add next to a norm is found
by its statement pattern; the fused forward is that same source with only those adds rewritten, compiled
against the original's module globals (under its file name and line numbers), with the original's decorators
applied again. Everything else, the
token mixer (attention, Mamba, linear attention, a short convolution), its arguments and cache names, routers,
scalars, returns, runs as the original's code, so no body can go stale when transformers changes a layer: a
release that changes the layer changes the derived forward with it, and one whose adds no longer match a pattern
fuses nothing and says so.

The three patterns, in the layer's own names (``F`` is ``self.<attribute path>``, one positional argument)::

    before a norm:  s = a + b; [r = s ...]; ... F(s) ...   ->  normed, s = norm_of_sum(F, a, b); [r = s]; ... normed ...
    after a norm:   y = F(e); s = r + y   (or s = r + F(e), return r + y) ->  s = norm_then_add(F, e, r)
    layer output:   s = a + b; return s   (or return s, ..., return a + b) ->  s = stream_sum(call, a, b); return s
    input norm:     ... F(x) ...   (x the input, or x.to(...))   ->  ... input_norm(call, F, x, x) ...

(``F(s)`` may sit anywhere in the statement after the add; any other read of ``s`` there must be an operand of
an arithmetic operator. The output pattern also matches an add ending an ``if`` branch followed by the
``return``. The layer's input norm, where a previous layer hands its output's norm over, is the norm applied to
the input before anything else reads it, in each branch of an ``if`` alike. ``call`` is the
``handoff.LayerCall`` the derived forward takes as the keyword-only ``handoff.CALL_PARAM``.)

``before``: the sum and the norm of it from one kernel (the norm's ``residual=``); ``after``: the norm's kernel
also adds (its ``add_to=``); ``output``: the layer's last add, computed by the next layer's input norm (or the
final norm) when the derived stack loop asks for it; ``input norm``: the normed sum the previous layer handed on,
when it did (``handoff.py``). Each helper checks at every call that the fused kernel
computes what the original expression does (both operands tensors of one shape, type and device, the callee a
patched norm without hooks) and otherwise evaluates the original expression, so a site the plan did not expect
(a norm left alone, a broadcast add) still computes the original function. Operands are evaluated in the
original's order; a norm's computation may move before statements that cannot touch its input (aliases), and
an operand moved past a norm call is a plain name, never a call.
"""

from __future__ import annotations

import __future__
import ast
import copy
import dis
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from . import guard, handoff
from .families import NormKind, StackKind

# The closure name the derived forward calls the helpers below by (this module, passed to it).
_HELPERS = "_hf_rmsnorm_derived"
_NORMED = "_hf_rmsnorm_normed_"
# The local a derived stack forward keeps what its last layer call handed on in (``handoff.call_layer``).
_HANDED = "_hf_rmsnorm_handed"


@dataclass(frozen=True)
class AddSite:
    """A residual add of a layer's forward next to a norm: ``position`` is ``"before"`` (the norm reads the sum),
    ``"after"`` (the sum adds the norm's output) or ``"output"`` (the layer returns the sum); ``norm`` is the norm's
    attribute path from the layer (empty for ``"output"``); ``line`` is the add's line in the source file;
    ``in_tuple``: an output returned first in a tuple (``return s, ...``), not alone."""

    position: str
    norm: tuple[str, ...]
    line: int
    in_tuple: bool = False

    @property
    def label(self) -> str:
        where = {"before": "into", "after": "after", "output": "layer output"}[self.position]
        return f"residual add at line {self.line} ({where}{' ' + '.'.join(self.norm) if self.norm else ''})"


@dataclass(frozen=True)
class DerivedLayerKind:
    """A decoder layer whose fused forward is derived from its class's own forward: ``sites`` are the adds that
    forward rewrites (the analysis's, filtered to the norms the plan patches), ``input_norm`` the dotted path of the
    norm the forward applies to its input before anything else touches it (where a previous layer may hand its
    output's norm over), or None."""

    class_path: str
    sites: tuple[AddSite, ...]
    input_norm: str | None

    # What the planner asks of every layer kind (as ``families.LayerKind``).
    handoff_label = "layer output"
    handoff_dropout = None
    block = "layer whose one add next to a norm is its output"

    @property
    def inner_sites(self) -> tuple[AddSite, ...]:
        return tuple(site for site in self.sites if site.position != "output")

    @property
    def fuses_inside(self) -> bool:
        return bool(self.inner_sites)

    @property
    def hands_off_last_add(self) -> bool:
        # Returned in one form (a tensor, or first in a tuple): what the derived loop takes the output as.
        return len({site.in_tuple for site in self.sites if site.position == "output"}) == 1

    @property
    def returns_tuple(self) -> bool:
        return any(site.in_tuple for site in self.sites if site.position == "output")


@dataclass(frozen=True)
class LayerCode:
    """What a forward's source says: its candidate add sites, in source order, and its input norm."""

    sites: tuple[AddSite, ...]
    input_norm: str | None


@dataclass
class _StackLoop:
    """A loop over ``self.<layers>`` in a stack forward: the statement, the statement list holding it, and
    ``final`` (``_loop_final_norm``); for a loop of ``stack_layout``'s form, its layer call statement and the calls
    of the final norm that read its output."""

    loop: ast.For
    block: list[ast.stmt]
    layers: str
    final: str | bool | None
    call: ast.Assign | None = None
    final_calls: tuple[ast.Call, ...] = ()


@functools.lru_cache(maxsize=None)
def stack_layout(forward: object) -> tuple[str, str | None] | None:
    """``(layers, final norm)``, the attribute names of a stack forward of this form, or None::

        for layer in self.<layers>[...]:      # or: for i, layer in enumerate(self.<layers>[...])
            ...                               # statements that do not name h
            h = layer(h, ...)                 # h passed first, positionally; named nowhere else in the loop
        ...                                   # statements that do not name h
        h = self.<final norm>(h)              # or any statement reading h once, in a call self.<final norm>(h)

    In such a forward nothing but the layers sees the hidden states between one layer and the next, or between
    the last layer and the final norm: where ``fused_stack_forward``'s loop hands a layer's normed output on
    (``handoff.py``). Every loop over the layers must have that form; the final norm is None unless each loop is
    followed by the same one (the layers still hand over to each other)."""
    parsed = _parsed(forward)
    if isinstance(parsed, str):
        return None
    function = parsed[0]
    return _layout(_stack_loops(function, _self_name(function)))


def _stack_loops(function: ast.FunctionDef, self_name: str) -> list[_StackLoop]:
    loops: list[_StackLoop] = []
    _layer_loops(function.body, [], self_name, loops)
    return loops


def _layout(loops: list[_StackLoop]) -> tuple[str, str | None] | None:
    """``stack_layout`` of a forward's loops over its layers."""
    if not loops or len({loop.layers for loop in loops}) != 1 or any(loop.final is False for loop in loops):
        return None
    # A loop whose output never reaches a norm (True) leaves the choice to the others; one that reaches another
    # module first (None), or two different norms, rule the final norm out.
    finals = {loop.final for loop in loops if loop.final is not True}
    final = finals.pop() if len(finals) == 1 else None
    return loops[0].layers, final if isinstance(final, str) else None


def _layer_loops(
    statements: list[ast.stmt], continuation: list[ast.stmt], self_name: str, loops: list[_StackLoop],
) -> None:
    """Appends a ``_StackLoop`` for each loop over ``self.<layers>`` in ``statements``, given the statements that
    run after them (``continuation``): what follows an ``if``, a ``with`` or a ``try``, and, in a loop's body, the
    rest of the body, the body again (the next iteration) and what follows the loop."""
    for i, statement in enumerate(statements):
        after = statements[i + 1:] + continuation
        if isinstance(statement, ast.For) and (layers := _iterated_layers(statement, self_name)):
            loops.append(_StackLoop(statement, statements, layers, *_loop_final_norm(statement, after, self_name)))
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
            again = ([ast.Expr(statement.test)] if isinstance(statement, ast.While) else []) + statement.body
            _layer_loops(statement.body, again + after, self_name, loops)
            _layer_loops(statement.orelse, after, self_name, loops)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        else:
            for name in ("body", "orelse", "finalbody"):
                nested = getattr(statement, name, None)
                if isinstance(nested, list) and nested and isinstance(nested[0], ast.stmt):
                    _layer_loops(nested, after, self_name, loops)
            for handler in getattr(statement, "handlers", ()):
                _layer_loops(handler.body, after, self_name, loops)


def _iterated_layers(loop: ast.For, self_name: str) -> str | None:
    """``layers`` for ``for layer in self.<layers>[...]`` or ``for i, layer in enumerate(self.<layers>[...])``."""
    iterated = loop.iter
    if isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Name) and iterated.func.id == "enumerate":
        if len(iterated.args) != 1:
            return None
        iterated = iterated.args[0]
    if isinstance(iterated, ast.Subscript):
        iterated = iterated.value
    layers = _attribute_path(iterated, self_name)
    return layers[0] if layers is not None and len(layers) == 1 else None


def _loop_final_norm(
    loop: ast.For, rest: list[ast.stmt], self_name: str
) -> tuple[str | None | bool, ast.Assign | None, tuple[ast.Call, ...]]:
    """For a loop over the layers, followed by the statements ``rest`` (to the end of the forward): the final norm
    the first statement naming its output applies to it; True when nothing names it again (it is copied out or
    rebound first); None when something else does; False when the loop is not of ``stack_layout``'s form. Then,
    unless False, the layer call statement, and the calls of that final norm."""
    target = loop.target
    if isinstance(loop.iter, ast.Call):  # enumerate: (i, layer)
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2):
            return False, None, ()
        target = target.elts[1]
    if not isinstance(target, ast.Name) or loop.orelse:
        return False, None, ()
    calls = [s for s in loop.body if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.value, ast.Call)
             and isinstance(s.value.func, ast.Name) and s.value.func.id == target.id]
    if len(calls) != 1:
        return False, None, ()
    call = calls[0].value
    hidden = _layer_output_name(calls[0], loop.body)
    # Positionally, as the layer's first argument: a gradient checkpoint's inputs are the positional ones.
    argument = call.args[0] if call.args else None
    if not (isinstance(argument, ast.Name) and argument.id == hidden):
        return False, None, ()
    if len(_named(loop.body, hidden)) != 2:  # the call's argument and the target it is assigned to
        return False, None, ()
    final = _first_norm(rest, {hidden}, self_name, None)
    if final is True:
        return True, calls[0], ()
    if isinstance(final, tuple) and "." not in final[0]:
        return final[0], calls[0], final[1]
    return None, calls[0], ()


def _layer_output_name(call: ast.Assign, body: list[ast.stmt]) -> str | None:
    """The name the hidden states get from the layer call ``call``: ``h = layer(...)``, ``h, *other = layer(...)``,
    or ``out = layer(...)`` then ``h = out[0]`` (``out`` read nowhere else but as ``out[k]``, its other items)."""
    target = call.targets[0]
    if isinstance(target, ast.Tuple):
        return target.elts[0].id if target.elts and isinstance(target.elts[0], ast.Name) else None
    if not isinstance(target, ast.Name):
        return None
    items = {id(n.value): n.slice.value for n in ast.walk(ast.Module(body=body, type_ignores=[]))
             if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and type(n.slice.value) is int}
    picks = [s for s in body if _assigned_name(s) and isinstance(s.value, ast.Subscript)
             and isinstance(s.value.value, ast.Name) and s.value.value.id == target.id
             and items.get(id(s.value.value)) == 0]
    reads = [n for n in _named(body, target.id) if n is not target]
    if len(picks) == 1 and all(n is picks[0].value.value or items.get(id(n), 0) > 0 for n in reads):
        return _assigned_name(picks[0])
    return target.id


def _named(statements: list[ast.stmt], name: str) -> list[ast.Name]:
    """The occurrences of ``name`` in ``statements``, but for the elements of a tuple display (recording the hidden
    states, ``all_hidden_states + (h,)``, neither changes them nor lets anything else reach them)."""
    in_tuples = {id(e) for n in ast.walk(ast.Module(body=statements, type_ignores=[]))
                 if isinstance(n, ast.Tuple) and isinstance(n.ctx, ast.Load) for e in n.elts}
    return [n for n in ast.walk(ast.Module(body=statements, type_ignores=[]))
            if isinstance(n, ast.Name) and n.id == name and id(n) not in in_tuples]


def stack_kind(cls: type) -> StackKind | None:
    """The kind of a stack class whose forward has the form ``stack_layout`` reads, None for another."""
    layout = stack_layout(cls.forward)
    if layout is None:
        return None
    return StackKind(f"{cls.__module__}.{cls.__qualname__}", layers=layout[0], final_norm=layout[1])


# ------------------------------------------------------------------------------------------------ the helpers


def _fusable(norm: object, a: object, b: object) -> bool:
    """Whether ``norm``'s fused kernel computes ``norm(a + b)`` (or ``a + norm(b)``) as the original does: a
    patched norm no hook watches, and two tensors of one shape, class and device (no broadcasting, no DTensor
    mixed with a tensor)."""
    return (
        isinstance(getattr(type(norm), "_hf_rmsnorm_kind", None), NormKind)
        and isinstance(a, Tensor) and isinstance(b, Tensor)
        and type(a) is type(b) and a.shape == b.shape and a.device == b.device
        and not guard.watched(norm)
    )


def norm_of_sum(norm: nn.Module, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(a + b), a + b)``, from one kernel when it can be."""
    if _fusable(norm, a, b):
        return norm(b, residual=a)
    total = a + b
    return norm(total), total


def norm_then_add(norm: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + norm(x)``, from one kernel when it can be."""
    if _fusable(norm, residual, x):
        return norm(x, add_to=residual)
    return residual + norm(x)


def stream_sum(call: handoff.LayerCall | None, a: Tensor, b: Tensor) -> Tensor:
    """``a + b``, the layer's output: computed by the next norm's kernel when the derived loop asked for it
    (``handoff.py``)."""
    return handoff.add_residual(call, b, a)


# The derived forwards call these too, as ``_hf_rmsnorm_derived.<name>`` (``handoff.py`` says what they do).
input_norm, final_norm = handoff.input_norm, handoff.final_norm
call_layer, layers_with_next = handoff.call_layer, handoff.layers_with_next


# ------------------------------------------------------------------------------------------------ analysis


@functools.lru_cache(maxsize=None)
def module_calls(forward: object) -> frozenset[tuple[str, ...]]:
    """The attribute paths of the ``self.<path>(x)`` calls in the layer forward ``forward`` (empty when its source
    cannot be read): the planner tells the analysis which of them are patched norms."""
    parsed = _parsed(forward)
    if isinstance(parsed, str):
        return frozenset()
    function = parsed[0]
    self_name = _self_name(function)
    return frozenset(path for node in ast.walk(function) if (path := _module_call(node, self_name)) is not None)


@functools.lru_cache(maxsize=None)
def layer_code(forward: object, norms: frozenset[tuple[str, ...]]) -> LayerCode | str:
    """The add sites and input norm of the layer forward ``forward`` (a class's, as defined), whose calls of
    ``self.<path>`` for ``path`` in ``norms`` are norms; or why its source cannot be derived from."""
    parsed = _parsed(forward)
    if isinstance(parsed, str):
        return parsed
    function, _ = parsed
    sites = _Sites(function, norms, selected=None)
    input_norm = _input_norm(function, norms)
    return LayerCode(tuple(sites.applied), None if input_norm is None else input_norm[0])


def fused_forward(base: type, kind: DerivedLayerKind) -> Callable[..., Tensor]:
    """``base.forward`` with ``kind.sites`` rewritten and its input norm reading what a previous layer hands on
    (module docstring), taking the ``handoff.LayerCall`` as the keyword ``handoff.CALL_PARAM``; decorated as the
    original is.

    Raises:
        ValueError: the source cannot be derived from, or a site or the input norm of ``kind`` is not in it (any
            more).
    """
    function, original = _parsed_or_raise(base)
    norms = frozenset(site.norm for site in kind.sites if site.norm)
    if kind.input_norm is not None:
        norms |= {tuple(kind.input_norm.split("."))}
    missing = set(kind.sites) - set(_Sites(function, norms, selected=frozenset(kind.sites)).applied)
    if missing:
        raise ValueError(f"{base.__qualname__}.forward has no {', '.join(s.label for s in missing)}")
    if kind.input_norm is not None:
        found = _input_norm(function, norms)
        if found is None or found[0] != kind.input_norm:
            raise ValueError(f"{base.__qualname__}.forward no longer applies {kind.input_norm} to its input first")
        for call in found[1]:
            _replace(function, call, _handed_norm_call("input_norm", handoff.CALL_PARAM, call))
    function.args.kwonlyargs.append(ast.arg(handoff.CALL_PARAM))
    function.args.kw_defaults.append(ast.Constant(None))
    return _compiled(function, original, base)


def fused_stack_forward(base: type, layers: str, final_norm: str | None) -> Callable[..., object]:
    """``base.forward`` (a forward of ``stack_layout``'s form running ``self.<layers>`` then ``self.<final_norm>``)
    with each loop over the layers calling ``handoff.call_layer`` and the final norm reading what the last layer
    hands on (``handoff.py``); decorated as the original is::

        for layer in self.layers[...]:
            h = layer(h, ...)
        h = self.norm(h)

    becomes::

        _hf_rmsnorm_handed = None
        for layer, _hf_rmsnorm_next_<line> in _hf_rmsnorm_derived.layers_with_next(self.layers[...]):
            h, _hf_rmsnorm_handed = _hf_rmsnorm_derived.call_layer(
                self, layer, _hf_rmsnorm_next_<line>, True, _hf_rmsnorm_handed, h, ...)
        h = _hf_rmsnorm_derived.final_norm(_hf_rmsnorm_handed, self.norm, h, h)

    (``True``: the loop's output goes to the final norm; a loop whose output is copied out says False, so its last
    layer hands nothing on). What is handed on is reset before every loop and read only by the module it was made
    for.

    Raises:
        ValueError: the source cannot be derived from, or its loops are not of that form (any more).
    """
    function, original = _parsed_or_raise(base)
    self_name = _self_name(function)
    loops = _stack_loops(function, self_name)
    if _layout(loops) != (layers, final_norm):
        raise ValueError(f"{base.__qualname__}.forward does not run self.{layers} then "
                         f"{'no final norm' if final_norm is None else f'self.{final_norm}'} as read when patching")
    final_calls: dict[int, ast.Call] = {}
    for loop in loops:
        feeds_final_norm = final_norm is not None and loop.final == final_norm
        _rewrite_loop(loop, self_name, feeds_final_norm)
        if feeds_final_norm:
            final_calls.update((id(call), call) for call in loop.final_calls)
    for call in final_calls.values():
        _replace(function, call, _handed_norm_call("final_norm", _HANDED, call))
    has_docstring = isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant)
    function.body.insert(int(has_docstring), _handed_reset())
    return _compiled(function, original, base)


def _rewrite_loop(loop: _StackLoop, self_name: str, feeds_final_norm: bool) -> None:
    """``fused_stack_forward``'s rewrite of one loop: iterated with the next layer, its layer called through
    ``call_layer``, what is handed on reset before it."""
    following = f"_hf_rmsnorm_next_{loop.loop.lineno}"
    statement = loop.loop
    if isinstance(statement.iter, ast.Call):  # enumerate(self.<layers>[...]): (i, layer)
        statement.iter.args[0] = _helper_call("layers_with_next", statement.iter.args[0])
        statement.target.elts[1] = ast.Tuple([statement.target.elts[1], ast.Name(following, ast.Store())], ast.Store())
    else:
        statement.iter = _helper_call("layers_with_next", statement.iter)
        statement.target = ast.Tuple([statement.target, ast.Name(following, ast.Store())], ast.Store())
    call = loop.call.value
    loop.call.value = _helper_call(
        "call_layer", ast.Name(self_name, ast.Load()), call.func, ast.Name(following, ast.Load()),
        ast.Constant(feeds_final_norm), ast.Name(_HANDED, ast.Load()), *call.args)
    loop.call.value.keywords = call.keywords
    loop.call.targets = [ast.Tuple([loop.call.targets[0], ast.Name(_HANDED, ast.Store())], ast.Store())]
    loop.block.insert(next(i for i, s in enumerate(loop.block) if s is statement), _handed_reset())


def _handed_reset() -> ast.Assign:
    return ast.Assign([ast.Name(_HANDED, ast.Store())], ast.Constant(None))


def _handed_norm_call(helper: str, handed: str, call: ast.Call) -> ast.Call:
    """``_hf_rmsnorm_derived.<helper>(<handed>, self.<norm>, x, x)`` for the norm call ``self.<norm>(x)`` (or
    ``self.<norm>(x.to(...))``, then its second argument is that)."""
    read = _read_name(call.args[0])
    return _helper_call(helper, ast.Name(handed, ast.Load()), call.func, call.args[0], ast.Name(read.id, ast.Load()))


def _parsed_or_raise(base: type) -> tuple[ast.FunctionDef, object]:
    parsed = _parsed(base.forward)
    if isinstance(parsed, str):
        raise ValueError(f"cannot derive a fused forward for {base.__qualname__}: {parsed}")
    return parsed


def _compiled(function: ast.FunctionDef, original, base: type) -> Callable[..., object]:
    """The rewritten ``function`` (``base``'s, ``original`` undecorated) compiled (``_factory_code``) and
    decorated as the original's definition is."""
    decorators, function.decorator_list = function.decorator_list, []
    namespace: dict[str, object] = {}
    exec(_factory_code(function, original), original.__globals__, namespace)  # the imports are never run
    # The helpers are this module's functions: the derived forward reaches them as ``_hf_rmsnorm_derived.<name>``.
    forward = namespace["_hf_rmsnorm_factory"](base, sys.modules[__name__])
    forward.__qualname__ = original.__qualname__
    for decorator in reversed(decorators):
        expression = ast.fix_missing_locations(ast.Expression(decorator))
        compiled = compile(expression, original.__code__.co_filename, "eval", dont_inherit=True)
        forward = eval(compiled, original.__globals__)(forward)
    return forward


def _factory_code(function: ast.FunctionDef, original) -> types.CodeType:
    """The code of ``def _hf_rmsnorm_factory(__class__, _hf_rmsnorm_derived): <function>; return it``: the
    function's ``__class__`` cell (zero-argument ``super()``) and the helpers are the factory's arguments.

    Compiled from the tree under the original's file name and line numbers, so a traceback points at the line of
    the modeling code each statement comes from (a rewritten add keeps its line); with the original's own future
    features (postponed annotations or not), never this module's. Run against the original's module globals
    (read live, never written: the factory is a local)."""
    module = ast.parse(f"def _hf_rmsnorm_factory(__class__, {_HELPERS}):\n    pass\n")
    module.body[0].body = [function, ast.Return(ast.Name(function.name, ast.Load()))]
    ast.copy_location(module.body[0], function)
    # The compiler calls a module's attribute (``torch.arange(...)``) differently from an object's method when the
    # module was imported at the top of the file: the same names are declared imported here (never run), so the
    # bytecode is the original's.
    imported = _module_imports(original.__module__)
    if imported:
        module.body.insert(0, ast.If(ast.Constant(False), [ast.Import([ast.alias("_", name) for name in imported])],
                                     []))
    features = original.__code__.co_flags & __future__.annotations.compiler_flag
    return compile(ast.fix_missing_locations(module), original.__code__.co_filename, "exec", flags=features,
                   dont_inherit=True)


@functools.lru_cache(maxsize=None)
def _module_imports(module_name: str) -> tuple[str, ...]:
    """The names the top level of module ``module_name`` binds by an import (empty if its source is unreadable)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return ()
    names: dict[str, None] = {}
    statements = list(tree.body)
    while statements:
        statement = statements.pop()
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            names.update(dict.fromkeys((a.asname or a.name).split(".")[0] for a in statement.names if a.name != "*"))
        elif not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                statements.extend(getattr(statement, field, None) or ())
            for handler in getattr(statement, "handlers", ()):
                statements.extend(handler.body)
    return tuple(sorted(names))


def _compiled_function(code: types.CodeType) -> types.CodeType:
    """The function's code inside ``_factory_code``'s module code."""
    factory = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "_hf_rmsnorm_factory")
    return next(c for c in factory.co_consts if isinstance(c, types.CodeType))


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two code objects run the same instructions on the same names and constants (nested functions
    alike), whatever their jump offsets, qualified names and positions."""
    if (a.co_names, a.co_varnames, a.co_freevars) != (b.co_names, b.co_varnames, b.co_freevars):
        return False
    ops_a, ops_b = list(dis.get_instructions(a)), list(dis.get_instructions(b))
    if len(ops_a) != len(ops_b):
        return False
    for x, y in zip(ops_a, ops_b):
        if x.opname != y.opname:
            return False
        if isinstance(x.argval, types.CodeType) and isinstance(y.argval, types.CodeType):
            if not _same_code(x.argval, y.argval):
                return False
        elif x.opcode not in dis.hasjrel + dis.hasjabs and x.argrepr != y.argrepr and not (
            isinstance(x.argval, str) and isinstance(y.argval, str) and ".<locals>." in x.argval + y.argval
        ):
            return False
    return True


def _parsed(forward: object) -> tuple[ast.FunctionDef, object] | str:
    """The definition of ``forward`` (a class's, as defined, decorators included), parsed, and the undecorated
    function; or why it cannot be rewritten."""
    original = inspect.unwrap(forward)
    code = getattr(original, "__code__", None)
    name = getattr(original, "__qualname__", repr(forward))
    if code is None:
        return f"{name} is not a Python function"
    if set(code.co_freevars) - {"__class__"}:
        return f"{name} is a closure over {', '.join(code.co_freevars)}"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(original)))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"the source of {name} cannot be read ({type(exc).__name__})"
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef) or function.name != original.__name__ or len(function.args.args) < 2:
        return f"the source of {name} is not a method taking the hidden states"
    # Private names are mangled inside a class body; the derived forward is compiled outside one.
    if any(isinstance(node, (ast.Name, ast.Attribute)) and _is_private(node) for node in ast.walk(function)):
        return f"{name} uses a class-private __name"
    # The source read is the code running only if it compiles to it: a file edited or replaced on disk since the
    # module was imported (an editable install, an upgrade under a running process) must not be run instead.
    undecorated = copy.copy(function)
    undecorated.decorator_list = []
    if not _same_code(_compiled_function(_factory_code(undecorated, original)), code):
        return f"the source of {name} on disk is not the code running (its file changed since it was imported)"
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    return function, original


def _is_private(node: ast.Name | ast.Attribute) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr
    return name.startswith("__") and not name.endswith("__")


def _self_name(function: ast.FunctionDef) -> str:
    return function.args.args[0].arg


def _attribute_path(node: ast.expr, self_name: str) -> tuple[str, ...] | None:
    """``("a", "b")`` for ``self.a.b``, ``("a", "0")`` for ``self.a[0]`` (a ``ModuleList`` item, which ``getattr``
    finds by that name), None for anything else."""
    path: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            path.append(node.attr)
        elif isinstance(node.slice, ast.Constant) and type(node.slice.value) is int and node.slice.value >= 0:
            path.append(str(node.slice.value))
        else:
            return None
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name and path:
        return tuple(reversed(path))
    return None


def _module_call(node: ast.AST, self_name: str) -> tuple[str, ...] | None:
    """The attribute path of ``self.a.b(x)`` (one positional argument, no keywords), None for anything else."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and not isinstance(
        node.args[0], ast.Starred
    ):
        return _attribute_path(node.func, self_name)
    return None


def _assigned_name(statement: ast.stmt) -> str | None:
    """``x`` for ``x = <value>``."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0].id
    return None


def _sum(statement: ast.stmt) -> tuple[str, ast.BinOp] | None:
    """``(s, a + b)`` for ``s = a + b``."""
    name = _assigned_name(statement)
    if name is not None and isinstance(statement.value, ast.BinOp) and isinstance(statement.value.op, ast.Add):
        return name, statement.value
    return None


def _returned_sum(statement: ast.stmt) -> tuple[None, ast.BinOp] | None:
    """``(None, a + b)`` for ``return a + b``."""
    if isinstance(statement, ast.Return) and isinstance(statement.value, ast.BinOp) and isinstance(
        statement.value.op, ast.Add
    ):
        return None, statement.value
    return None


def _loads(node: ast.AST, names: set[str] | None) -> list[ast.Name]:
    """The reads of ``names`` (of every name when None) in ``node``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and (names is None or n.id in names)]


def _is_plain(node: ast.expr, self_name: str) -> bool:
    # An operand that may be evaluated at another moment: a name or an attribute of self (no call).
    return isinstance(node, ast.Name) or _attribute_path(node, self_name) is not None


def _helper_call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(ast.Attribute(ast.Name(_HELPERS, ast.Load()), name, ast.Load()), list(args), [])


class _Sites:
    """Finds the add sites of a function (module docstring) and rewrites those in ``selected`` (all when None),
    in place; ``applied`` lists the rewritten ones in source order."""

    def __init__(
        self, function: ast.FunctionDef, norms: frozenset[tuple[str, ...]], selected: frozenset[AddSite] | None
    ) -> None:
        self.self_name = _self_name(function)
        self.norms = norms
        self.selected = selected
        self.applied: list[AddSite] = []
        self.reads: dict[str, int] = {}
        for node in _loads(function, None):
            self.reads[node.id] = self.reads.get(node.id, 0) + 1
        self.block(function.body, None)

    def block(self, statements: list[ast.stmt], after: ast.stmt | None) -> None:
        """Looks at one statement list; ``after`` is the statement that runs once the list ends (the one after
        an ``if`` whose branch this is), for the output pattern."""
        i = 0
        while i < len(statements):
            statement = statements[i]
            following = statements[i + 1] if i + 1 < len(statements) else after
            i += self._match(statements, i, following) or 1
            if isinstance(statement, ast.If):
                self.block(statement.body, following)
                self.block(statement.orelse, following)
                continue
            for name in ("body", "orelse", "finalbody"):
                nested = getattr(statement, name, None)
                if isinstance(nested, list) and nested and isinstance(nested[0], ast.stmt):
                    self.block(nested, None)
            for handler in getattr(statement, "handlers", ()):
                self.block(handler.body, None)

    def _norm_call(self, node: ast.AST) -> tuple[str, ...] | None:
        """The path of ``self.<path>(x)`` when it is one of the norms."""
        path = _module_call(node, self.self_name)
        return path if path in self.norms else None

    def _record(self, position: str, norm: tuple[str, ...], line: int, in_tuple: bool = False) -> bool:
        """Whether the site is to be rewritten (the caller then does); if so it counts as applied."""
        site = AddSite(position, norm, line, in_tuple)
        if self.selected is not None and site not in self.selected:
            return False
        self.applied.append(site)
        return True

    def _match(self, statements: list[ast.stmt], i: int, following: ast.stmt | None) -> int:
        """Records (and rewrites, if selected) the pattern starting at ``statements[i]``; returns how many
        statements it spans, 0 for none."""
        return (
            self._before_norm(statements, i)
            or self._after_norm(statements, i)
            or self._output(statements, i, following)
        )

    def _before_norm(self, statements: list[ast.stmt], i: int) -> int:
        found = _sum(statements[i])
        if found is None:
            return 0
        total, add = found
        names, j = {total}, i + 1
        while j < len(statements) and isinstance(statements[j], ast.Assign) and _assigned_name(statements[j]) and (
            isinstance(statements[j].value, ast.Name) and statements[j].value.id == total
        ):
            names.add(_assigned_name(statements[j]))
            j += 1
        if j == len(statements) or not isinstance(statements[j], (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
            return 0
        consumer = statements[j]
        call = next((node for node in ast.walk(consumer) if self._norm_call(node)
                     and isinstance(node.args[0], ast.Name) and node.args[0].id == total), None)
        # Other reads of the sum in that statement see the same tensor either way, as long as nothing evaluated
        # before the norm could change it: they must be plain operands of an arithmetic operator, no call's.
        operands = {id(operand) for node in ast.walk(consumer) if isinstance(node, ast.BinOp)
                    for operand in (node.left, node.right)}
        if call is None or any(use is not call.args[0] and id(use) not in operands for use in _loads(consumer, names)):
            return 0
        if not self._record("before", self._norm_call(call), add.lineno):
            return 0
        normed = f"{_NORMED}{add.lineno}"
        statements[i] = ast.Assign(
            [ast.Tuple([ast.Name(normed, ast.Store()), ast.Name(total, ast.Store())], ast.Store())],
            _helper_call("norm_of_sum", call.func, add.left, add.right),
            lineno=add.lineno,
        )
        _replace(consumer, call, ast.Name(normed, ast.Load()))
        return 1

    def _after_norm(self, statements: list[ast.stmt], i: int) -> int:
        # One statement: s = r + F(e) or s = F(e) + r.
        found = _sum(statements[i])
        if found is not None:
            total, add = found
            for normed, residual in ((add.right, add.left), (add.left, add.right)):
                if self._norm_call(normed) is not None and _is_plain(residual, self.self_name):
                    return int(self._rewrite_after(statements, i, total, normed, residual, add.lineno))
            return 0
        # Two statements: y = F(e); s = r + y (or return r + y), where y is s or read nowhere else.
        normed_name = _assigned_name(statements[i])
        if normed_name is None or self._norm_call(statements[i].value) is None or i + 1 == len(statements):
            return 0
        found = _sum(statements[i + 1]) or _returned_sum(statements[i + 1])
        if found is None:
            return 0
        total, add = found
        for normed, residual in ((add.right, add.left), (add.left, add.right)):
            if (
                isinstance(normed, ast.Name) and normed.id == normed_name and _is_plain(residual, self.self_name)
                and not _loads(residual, {normed_name})
                and (normed_name == total or not self._read_elsewhere(normed_name, (statements[i], statements[i + 1])))
            ):
                if not self._rewrite_after(statements, i + 1, total, statements[i].value, residual, add.lineno):
                    return 0
                statements[i] = ast.Pass(lineno=statements[i].lineno)
                return 2
        return 0

    def _read_elsewhere(self, name: str, statements: tuple[ast.stmt, ...]) -> bool:
        """Whether ``name`` is read anywhere in the function but ``statements``."""
        return self.reads.get(name, 0) != sum(len(_loads(s, {name})) for s in statements)

    def _rewrite_after(
        self, statements: list[ast.stmt], i: int, total: str | None, call: ast.Call, residual: ast.expr, line: int
    ) -> bool:
        """Makes ``statements[i]`` ``total = norm_then_add(self.<norm>, x, residual)`` (``return ...`` when
        ``total`` is None) for the norm call ``self.<norm>(x)``, if selected."""
        if not self._record("after", self._norm_call(call), line):
            return False
        value = _helper_call("norm_then_add", call.func, call.args[0], residual)
        statements[i] = (ast.Return(value, lineno=line) if total is None
                         else ast.Assign([ast.Name(total, ast.Store())], value, lineno=line))
        return True

    def _output(self, statements: list[ast.stmt], i: int, following: ast.stmt | None) -> int:
        statement = statements[i]
        if (returned := _returned_sum(statement)) is not None:
            add, in_tuple = returned[1], False
        elif (found := _sum(statement)) is not None and (in_tuple := _returns(following, found[0])) is not None:
            add = found[1]
        else:
            return 0
        if not self._record("output", (), add.lineno, in_tuple):
            return 0
        statement.value = _helper_call("stream_sum", ast.Name(handoff.CALL_PARAM, ast.Load()), add.left, add.right)
        return 1


def _returns(statement: ast.stmt | None, name: str) -> bool | None:
    """Whether ``statement`` is ``return name, ...`` (True: the stack takes the first item), ``return name``
    (False), or neither (None)."""
    if not isinstance(statement, ast.Return):
        return None
    value, in_tuple = statement.value, isinstance(statement.value, ast.Tuple)
    if in_tuple and value.elts:
        value = value.elts[0]
    return in_tuple if isinstance(value, ast.Name) and value.id == name else None


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list):
                for k, item in enumerate(value):
                    if item is old:
                        value[k] = new


def _input_norm(
    function: ast.FunctionDef, norms: frozenset[tuple[str, ...]]
) -> tuple[str, tuple[ast.Call, ...]] | None:
    """The attribute of the norm the forward applies to its first argument before anything could touch it, and
    its calls, or None (``_first_norm``)."""
    found = _first_norm(function.body, {function.args.args[1].arg}, _self_name(function), norms)
    return found if isinstance(found, tuple) else None


def _reads_as_is(argument: ast.expr, name: ast.Name) -> bool:
    """Whether ``argument`` is ``name`` or ``name.to(...)``: the same values when the conversion changes neither
    dtype nor device (``handoff.input_norm`` checks that before it returns a handed-on norm of ``name``)."""
    return _read_name(argument) is name


def _read_name(argument: ast.expr) -> ast.expr:
    """``x`` for ``x`` or ``x.to(...)``."""
    if isinstance(argument, ast.Call) and isinstance(argument.func, ast.Attribute) and argument.func.attr == "to":
        return argument.func.value
    return argument


def _first_norm(
    statements: list[ast.stmt], names: set[str], self_name: str, norms: frozenset[tuple[str, ...]] | None
) -> tuple[str, tuple[ast.Call, ...]] | bool:
    """Follows ``names`` (the input and its aliases ``r = x``) through ``statements``: the norm's dotted path, and
    its calls, when the first statement naming them reads them once, as the argument of ``self.<norm>(x)`` or
    ``self.<norm>(x.to(...))`` (any module call when ``norms`` is None), anywhere in that statement: nothing evaluated
    before it can reach the input; or, for an ``if`` that does not read them in its test, when both branches begin
    so with the same norm. False when something else names them first; True when nothing does, or a statement
    rebinds the one name without reading it (its value can no longer reach anything). A statement that only copies
    them into a slice of another tensor (``out[...] = x``) does not count: it cannot change them."""
    for statement in statements:
        if isinstance(statement, ast.If) and not _loads(statement.test, names):
            branches = [_first_norm(b, set(names), self_name, norms) for b in (statement.body, statement.orelse)]
            if all(branch is True for branch in branches):
                continue
            if all(isinstance(branch, tuple) for branch in branches) and branches[0][0] == branches[1][0]:
                return branches[0][0], branches[0][1] + branches[1][1]
            return False
        named = [n for name in names for n in _named([statement], name)]
        if not named or _copies_out(statement, names):
            continue
        uses = [n for n in named if isinstance(n.ctx, ast.Load)]
        if not uses and len(names) == 1:
            return True
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Name) and _assigned_name(statement):
            names.add(_assigned_name(statement))
            continue
        if len(uses) != 1 or len(named) != 1 + sum(id(n) in _store_ids(statement) for n in named):
            return False
        calls = [node for node in ast.walk(statement) if _module_call(node, self_name) is not None
                 and (norms is None or _module_call(node, self_name) in norms) and _reads_as_is(node.args[0], uses[0])]
        return (".".join(_module_call(calls[0], self_name)), (calls[0],)) if calls else False
    return True


def _copies_out(statement: ast.stmt, names: set[str]) -> bool:
    """``out[...] = x`` with ``x`` one of ``names`` and ``out`` none of them."""
    return (
        isinstance(statement, ast.Assign) and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Subscript) and isinstance(statement.value, ast.Name)
        and statement.value.id in names and not _loads(statement.targets[0], names)
    )


def _store_ids(statement: ast.stmt) -> set[int]:
    """The names an assignment statement binds (its targets)."""
    targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
    return {id(n) for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
