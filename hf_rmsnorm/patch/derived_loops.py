"""A stack's forward read for its loop over the layers (``stack_kind``): where the derived stack forward
(``derived_rewrite.fused_stack_forward``) lets each layer hand its normed output to the next norm
(``handoff.py``).

The form read, every loop over ``self.<layers>`` alike::

    for layer in self.<layers>[...]:      # or: for i, layer in enumerate(self.<layers>[...])
        ...                               # statements that do not name h
        h = layer(h, ...)                 # h passed first, positionally; named nowhere else in the loop
    ...                                   # statements that do not name h
    h = self.<final norm>(h)              # or any statement reading h once, in a call self.<final norm>(h)

The layer call may sit in an ``if`` of the loop's body (LayerDrop's ``if not to_drop:``), and a ``continue`` may skip
it. In such a forward nothing but the layers sees the hidden states between one layer and the next, or between the
last layer and the final norm. A layer skipped leaves unread what was handed on to it: each consumer takes only
what was made for it (``handoff.call_layer`` and ``final_norm`` check its identity), so the next one normalises
the hidden states itself. ``h`` obeys ``derived_sites``' invariant 3 (a local no nested function captures:
nothing else can rebind it), and the final norm's call its invariant 1 (not deferred in a nested scope). The final
norm is None unless each loop is followed by the same one (the layers still hand over to each other).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from . import derived_source
from .derived_sites import FirstRead, first_read, named_outside_tuples, plain_locals
from .derived_syntax import assigned_name, attribute_path, parents, self_name, statement_blocks
from .families import StackKind


@dataclass(eq=False)
class StackLoop:
    """A loop over ``self.<layers>`` of the form read: the ``for`` statement, the statement list holding it, its
    layer call statement (``h = layer(h, ...)``) and how the hidden states are first read after it (``final``)."""

    loop: ast.For
    block: list[ast.stmt]
    layers: str
    call: ast.Assign
    final: FirstRead

    @property
    def final_norm(self) -> str | None:
        """The final norm this loop's output goes to first, if it is a norm of the stack itself."""
        return self.final.norm if self.final.norm is not None and "." not in self.final.norm else None


def stack_kind(cls: type) -> StackKind | None:
    """The kind of a stack class whose forward has the form read (module docstring), None for another (or one
    whose source cannot be derived from: ``derived_source.class_forward`` says why)."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return None
    layout = stack_layout(stack_loops(forward, forward.node))
    if layout is None:
        return None
    return StackKind(f"{cls.__module__}.{cls.__qualname__}", layers=layout[0], final_norm=layout[1])


def stack_loops(forward: derived_source.ClassForward, function: ast.FunctionDef) -> list[StackLoop | None]:
    """The loops over the layers of ``function`` (a parse of ``forward``'s def of its own); None for each loop
    over them not of the form read."""
    loops: list[StackLoop | None] = []
    context = _Context(self_name(function), plain_locals(forward.undecorated.__code__, function),
                       parents(function))
    _layer_loops(function.body, [], context, loops)
    return loops


def stack_layout(loops: list[StackLoop | None]) -> tuple[str, str | None] | None:
    """``(layers, final norm)`` of a forward's loops over its layers, or None when they are not all of the form
    read over one attribute."""
    if not loops or any(loop is None for loop in loops) or len({loop.layers for loop in loops}) != 1:
        return None
    # A loop whose output is never read again leaves the choice to the others; one read by another module first,
    # or two different norms, rule the final norm out.
    finals = {loop.final_norm for loop in loops if loop.final.read}
    final = finals.pop() if len(finals) == 1 else None
    return loops[0].layers, final


@dataclass(frozen=True)
class _Context:
    self_name: str
    plain: frozenset[str]
    up: dict[int, ast.AST]


def _layer_loops(statements: list[ast.stmt], continuation: list[ast.stmt], context: _Context,
                 loops: list[StackLoop | None]) -> None:
    """Appends a ``StackLoop`` (or None) for each loop over ``self.<layers>`` in ``statements``, given the
    statements that run after them (``continuation``): what follows an ``if``, a ``with`` or a ``try``, and, in a
    loop's body, the rest of the body, the body again (the next iteration) and what follows the loop."""
    for i, statement in enumerate(statements):
        after = statements[i + 1:] + continuation
        if isinstance(statement, ast.For) and (layers := _iterated_layers(statement, context.self_name)):
            loops.append(_stack_loop(statement, statements, layers, after, context))
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While)):
            again = ([ast.Expr(statement.test)] if isinstance(statement, ast.While) else []) + statement.body
            _layer_loops(statement.body, again + after, context, loops)
            _layer_loops(statement.orelse, after, context, loops)
        else:
            for block in statement_blocks(statement):
                _layer_loops(block, after, context, loops)


def _iterated_layers(loop: ast.For, self_name_: str) -> str | None:
    """``layers`` for ``for layer in self.<layers>[...]`` or ``for i, layer in enumerate(self.<layers>[...])``."""
    iterated = loop.iter
    if isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Name) and iterated.func.id == "enumerate":
        if len(iterated.args) != 1:
            return None
        iterated = iterated.args[0]
    if isinstance(iterated, ast.Subscript):
        iterated = iterated.value
    layers = attribute_path(iterated, self_name_)
    return layers[0] if layers is not None and len(layers) == 1 else None


def _stack_loop(loop: ast.For, block: list[ast.stmt], layers: str, rest: list[ast.stmt],
                context: _Context) -> StackLoop | None:
    """The loop over the layers ``loop`` (in ``block``, followed by the statements ``rest`` to the end of the
    forward) read, or None when it is not of the form read."""
    target = loop.target
    if isinstance(loop.iter, ast.Call):  # enumerate: (i, layer)
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2):
            return None
        target = target.elts[1]
    if not isinstance(target, ast.Name) or loop.orelse:
        return None
    calls = [s for s in _under_ifs(loop.body)
             if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.value, ast.Call)
             and isinstance(s.value.func, ast.Name) and s.value.func.id == target.id]
    if len(calls) != 1:
        return None
    call = calls[0].value
    hidden = _layer_output_name(calls[0], loop.body)
    # Positionally, as the layer's first argument: a gradient checkpoint's inputs are the positional ones.
    argument = call.args[0] if call.args else None
    if not (isinstance(argument, ast.Name) and argument.id == hidden) or hidden not in context.plain:
        return None
    if len(named_outside_tuples(loop.body, hidden)) != 2:  # the call's argument and the target it is assigned to
        return None
    return StackLoop(loop, block, layers, calls[0], first_read(rest, {hidden}, context.self_name, None, context.up))


def _layer_output_name(call: ast.Assign, body: list[ast.stmt]) -> str | None:
    """The name the hidden states get from the layer call ``call``: ``h = layer(...)``, ``h, *other = layer(...)``,
    or ``out = layer(...)`` then ``h = out[0]`` or ``h = out[0] if isinstance(out, tuple) else out`` (the output's
    first item, or the output itself: what the layer returns the hidden states as), ``out`` read nowhere else but
    as ``out[k]``, its other items."""
    target = call.targets[0]
    if isinstance(target, ast.Tuple):
        return target.elts[0].id if target.elts and isinstance(target.elts[0], ast.Name) else None
    if not isinstance(target, ast.Name):
        return None
    module = ast.Module(body=body, type_ignores=[])
    items = {id(n.value): n.slice.value for n in ast.walk(module)
             if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and type(n.slice.value) is int}
    picks = [(s, reads) for s in _under_ifs(body)
             if assigned_name(s) and (reads := _first_item_reads(s.value, target.id, items))]
    reads = [n for n in named_outside_tuples(body, target.id) if n is not target]
    if len(picks) == 1 and all(any(n is read for read in picks[0][1]) or items.get(id(n), 0) > 0 for n in reads):
        return assigned_name(picks[0][0])
    return target.id


def _first_item_reads(value: ast.expr, out: str, items: dict[int, object]) -> list[ast.Name]:
    """The reads of ``out`` in ``value`` when it is ``out[0]`` or ``out[0] if isinstance(out, tuple) else out``;
    empty for anything else."""
    def is_first_item(node: ast.expr) -> bool:
        return isinstance(node, ast.Subscript) and _is_name(node.value, out) and items.get(id(node.value)) == 0

    if is_first_item(value):
        return [value.value]
    if isinstance(value, ast.IfExp) and is_first_item(value.body) and _is_name(value.orelse, out):
        test = value.test
        if (isinstance(test, ast.Call) and _is_name(test.func, "isinstance") and len(test.args) == 2
                and not test.keywords and _is_name(test.args[0], out) and _is_name(test.args[1], "tuple")):
            return [value.body.value, test.args[0], value.orelse]
    return []


def _under_ifs(statements: list[ast.stmt]) -> list[ast.stmt]:
    """``statements`` and those in the branches of their ``if`` statements, at any depth."""
    found: list[ast.stmt] = []
    for statement in statements:
        found.append(statement)
        if isinstance(statement, ast.If):
            found += _under_ifs(statement.body) + _under_ifs(statement.orelse)
    return found


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name
