"""A block's forward read for its calls of sibling sublayers (``block_code``): where each sublayer's output add may
go into the next sublayer's input norm (``handoff.call_sublayer``), and the block itself be a layer of its stack's
loop (``handoff.py``), whose input norm is its first sublayer's and whose last add its last sublayer's.

T5's ``T5Block`` (and mT5's, UMT5's, LongT5's, SwitchTransformers') is such a block: its sublayers
(``T5LayerSelfAttention``, ``T5LayerCrossAttention``, ``T5LayerFF``) each begin with their input norm and end with
their output add (derived layers, ``derived_sites.py``), and the block calls them one after the other::

    def forward(self, h, ...):
        ...                                   # statements that do not name h
        h, *other = self.<path>(h, ...)       # the first statement naming h: a sublayer call, not in an ``if``
        ...
        if <test not naming h>:               # a sublayer call may sit in an ``if`` (T5's cross-attention)
            out = self.<path>(h, ...)         # LongT5's form: the call's output, then its first item
            h = out[0]
        if <comparison of reads>:             # T5's fp16 clamp: its branches may change h
            ...
        if <comparison of reads> and ...:     # LongT5's: anything after the comparison may change h too
            ...
        h = self.<path>(h)                    # the last sublayer call, not in an ``if``
        ...
        return h, ...                         # or ``return h``, or ``return (h, ...) + rest``

``<path>`` is ``self.a``, ``self.a[k]`` or deeper (``k`` an integer, negative too). Each call passes ``h`` as its
first positional argument and names it nowhere else, and binds its output to ``h`` (alone, or first in a tuple),
or to ``out`` followed at once by ``h = out[0]``, ``out`` read elsewhere only as ``out[k]`` or ``out[k:]`` for
``k >= 1`` (the sublayer's other outputs, never the sum).

**Why handing on inside the block is exact.** Sublayer call ``i`` (in source order) hands its normed output sum to
the sublayer of call ``i + 1``: the sum is what call ``i`` binds to ``h``, and what reaches call ``i + 1`` as its
``h`` is that very value unless code in between changes it. In between there are only statements not naming ``h``
(they cannot reach it: ``h`` is a plain local, ``derived_sites``' invariant 3, and the value was just made by the
sublayer), headers of ``if`` statements whose tests do not name it, and ``if`` statements whose test only reads
and compares (``derived_syntax.compares_reads``), whose branches may change ``h`` (T5's fp16 clamp rebinds it):
each of their branches first drops what is handed on (``_hf_rmsnorm_handed = None``), as a layer's output pattern
withdraws its handoff (``handoff.withdraw``). A test ``A and B`` whose ``A`` only reads and compares may run code in
``B``: what is handed on is dropped once ``A`` is true, before ``B`` runs (an operand inserted between them, which
is true), and first thing in the ``else`` branch; while ``A`` is false nothing of the statement runs but ``A``.
A call skipped (its ``if`` not taken) leaves unread what was made for it: every sublayer takes only what was made
for it (``handoff.call_sublayer`` checks the consumer's identity, as the stack loop does), so the next one
normalises its input itself. Any other statement naming ``h`` between the
first and the last call, a call in a loop, a ``try`` or a ``with`` block, or a call whose other arguments name
``h``, rules the block out (``block_code`` says which).

**Why the block may be a layer of its stack.** Its input reaches its first sublayer unchanged (the first statement
naming it is that call, run unconditionally), so what the previous layer hands the block is the first sublayer's
normed input. Its output is its last sublayer's output sum: after the last call only statements not naming ``h``,
comparison ``if`` statements that withdraw the handoff as above (``handoff.withdraw``), then the ``return`` of
``h`` (alone or first in a tuple). No other ``return`` follows the last call outside such a branch (one before it
returns before anything is handed on). At every call ``handoff.run_layer`` checks that what the block returns is
that very sum, or a tuple beginning with it (``(h,) + rest`` is one unless ``rest``'s own ``__radd__`` decides
otherwise), else it hands nothing on.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torch import nn

from . import derived_source
from .derived_sites import plain_locals, signature_problem
from .derived_syntax import NESTED_SCOPES, compares_reads, item_path, named, self_name


@dataclass(frozen=True)
class BlockSite:
    """A sublayer call of a block's forward: the sublayer's path from the block (attributes and integer items,
    negative ones too) and the call's line."""

    path: tuple[str | int, ...]
    line: int

    @property
    def text(self) -> str:
        return "self" + "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in self.path)

    def module(self, block: nn.Module) -> nn.Module | None:
        """The sublayer this call reaches in ``block`` now, or None where there is none."""
        found: object = block
        for step in self.path:
            if isinstance(step, int):
                if not isinstance(found, (nn.ModuleList, nn.Sequential)) or not -len(found) <= step < len(found):
                    return None
                found = found[step]
            else:
                found = found._modules.get(step) if isinstance(found, nn.Module) else None
        return found if isinstance(found, nn.Module) else None


@dataclass(frozen=True)
class BlockCode:
    """What a block's forward says: its sublayer calls in source order, whether it returns ``h`` first in a tuple,
    and why the calls cannot hand on (None: they can)."""

    sites: tuple[BlockSite, ...]
    returns_tuple: bool
    problem: str | None = None


@dataclass(frozen=True)
class DerivedBlockKind:
    """A block whose forward is derived from its class's own (``derived_rewrite.fused_block_forward``): ``sites``
    its sublayer calls; ``links`` the calls whose output sum goes into the next call's sublayer's input norm;
    ``input_norm`` the dotted path of its first sublayer's input norm (None: the block receives nothing);
    ``hands_off_last_add`` whether its last sublayer's output add may go into the next norm."""

    class_path: str
    sites: tuple[BlockSite, ...]
    links: tuple[int, ...]
    input_norm: str | None
    hands_off_last_add: bool
    returns_tuple: bool

    # What the planner asks of every layer kind (as ``families.LayerKind``).
    handoff_dropout = None
    last_add_inside = None
    block = "block of sublayers"

    @property
    def handoff_label(self) -> str:
        return f"output of {self.sites[-1].text}"

    @property
    def fuses_inside(self) -> bool:
        return bool(self.links)


def block_code(cls: type) -> BlockCode | None:
    """The sublayer calls of ``cls``'s forward (module docstring), with why they are not of the form read if they
    are not; None where it has none (no block)."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str) or signature_problem(forward.node) is not None:
        return None
    function = forward.node
    reading = _Reading(function)
    reading.read(function.body, top=True)
    if not reading.sites:
        return None
    problem = reading.problem(plain_locals(forward.undecorated.__code__, function))
    return BlockCode(tuple(site for _, site in reading.sites), reading.returns_tuple, problem)


class _Reading:
    """One pass over a block forward's statements (``block_code``)."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.function = function
        self.self_name = self_name(function)
        self.hidden = function.args.args[1].arg
        self.sites: list[tuple[ast.Assign, BlockSite]] = []
        self.top_sites: set[int] = set()
        self.resetting: list[ast.If] = []  # the comparison ifs, in source order
        self.issue: str | None = None
        self.first_naming: ast.stmt | None = None
        self.returns_tuple = False
        self.final_return: ast.Return | None = None

    def read(self, statements: list[ast.stmt], top: bool) -> None:
        picked: set[int] = set()  # the ``h = out[0]`` statements of the calls read
        for i, statement in enumerate(statements):
            if id(statement) in picked:
                continue
            site = self._site(statement, statements[i + 1] if i + 1 < len(statements) else None)
            if top and self.first_naming is None and named(statement, self.hidden):
                self.first_naming = statement
            if site is not None:
                self.sites.append((statement, site))
                if top:
                    self.top_sites.add(id(statement))
                if isinstance(statement.targets[0], ast.Name) and statement.targets[0].id != self.hidden:
                    picked.add(id(statements[i + 1]))
            elif not named(statement, self.hidden):
                continue
            elif isinstance(statement, ast.If) and not named(statement.test, self.hidden):
                self.read(statement.body, top=False)
                self.read(statement.orelse, top=False)
            elif isinstance(statement, ast.If) and _comparison(statement.test) is not None and not self._calls_in(
                    statement):
                self.resetting.append(statement)
            elif top and statement is self.function.body[-1] and isinstance(statement, ast.Return):
                self.final_return = statement
            elif self.issue is None:
                self.issue = f"line {statement.lineno} names {self.hidden} otherwise than the forms read"

    def _site(self, statement: ast.stmt, following: ast.stmt | None) -> BlockSite | None:
        """The sublayer call ``statement`` is (``h = self.<path>(h, ...)``, ``h, ... = ...``, or ``out = ...``
        followed by ``h = out[0]``, ``out`` read elsewhere only for its other items), if it is one."""
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.value, ast.Call) and statement.value.args):
            return None
        target, call = statement.targets[0], statement.value
        first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
        path = item_path(call.func, self.self_name)
        if path is None or not _is(call.args[0], self.hidden) or not isinstance(first, ast.Name):
            return None
        if first.id != self.hidden and not (target is first and self._picks_first(first.id, following)):
            return None
        if len(named(statement, self.hidden)) != 1 + (first.id == self.hidden):  # h nowhere else in the call
            return None
        return BlockSite(path, statement.lineno)

    def _picks_first(self, out: str, following: ast.stmt | None) -> bool:
        """Whether ``following`` is ``h = out[0]`` and the forward reads ``out`` elsewhere only as ``out[k]`` or
        ``out[k:]`` (``k`` a positive integer): the sublayer's other outputs, never the sum."""
        if not (isinstance(following, ast.Assign) and len(following.targets) == 1
                and _is(following.targets[0], self.hidden) and _item(following.value, out) == 0):
            return False
        items = {id(node.value) for node in ast.walk(self.function)
                 if isinstance(node, ast.Subscript) and (_item(node, out) or 0) > 0}
        reads = [n for n in named(self.function, out) if isinstance(n.ctx, ast.Load)]
        return all(id(n) in items or n is following.value.value for n in reads)

    def _calls_in(self, statement: ast.stmt) -> bool:
        return any(self._site(s, None) is not None for s in ast.walk(statement) if isinstance(s, ast.stmt))

    def problem(self, plain: frozenset[str]) -> str | None:
        """Why the calls read cannot hand on (module docstring), if they cannot."""
        first, last = self.sites[0][0], self.sites[-1][0]
        if self.hidden not in plain:
            return f"{self.hidden} is rebound by a nested scope, or no local"
        if self.issue is not None:
            return self.issue
        if self.first_naming is not first:
            return f"the first statement naming {self.hidden} is not a sublayer call outside an if"
        if id(last) not in self.top_sites:
            return f"the last sublayer call (line {last.lineno}) sits in an if"
        if self.final_return is None:
            return f"the forward does not end by returning {self.hidden}"
        value = self.final_return.value
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):  # (h, ...) + rest
            value = value.left
        self.returns_tuple = isinstance(value, ast.Tuple)
        if not _is(value.elts[0] if self.returns_tuple and value.elts else value, self.hidden):
            return f"the forward does not end by returning {self.hidden}, alone or first in a tuple"
        withdrawn = {id(node) for statement in self.resetting if statement.lineno > last.lineno
                     for node in ast.walk(statement)}
        stray = [node for node in _own_nodes(self.function) if isinstance(node, ast.Return)
                 and node.lineno > last.lineno and node is not self.final_return and id(node) not in withdrawn]
        if stray:
            return f"line {stray[0].lineno} returns after the last sublayer call"
        return None


def _comparison(test: ast.expr) -> ast.expr | None:
    """The comparison of reads (``derived_syntax.compares_reads``) that decides whether anything of an ``if``
    beyond it runs: the whole test (T5's ``h.dtype == torch.float16``), or the first operand of an ``and``
    (LongT5's ``h.dtype == torch.float16 and torch.isinf(h).any()``, whose second operand runs only when the
    first is true); None for another test."""
    if compares_reads(test):
        return test
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and compares_reads(test.values[0]):
        return test.values[0]
    return None


def _item(node: ast.expr, out: str) -> int | None:
    """``k`` for ``out[k]`` or ``out[k:]`` (``k`` a non-negative integer constant), None for anything else."""
    if not (isinstance(node, ast.Subscript) and _is(node.value, out)):
        return None
    index = node.slice
    if isinstance(index, ast.Slice) and index.step is None and index.upper is None:
        index = index.lower
    return index.value if isinstance(index, ast.Constant) and type(index.value) is int and index.value >= 0 else None


def resets(function: ast.FunctionDef, code: BlockCode) -> list[tuple[ast.If, bool]]:
    """The comparison ``if`` statements of a block forward (a fresh parse: ``derived_rewrite`` rewrites it), each
    with whether it follows the last sublayer call (its branches withdraw the block's handoff) or not (they drop
    what a sublayer hands on)."""
    reading = _Reading(function)
    reading.read(function.body, top=True)
    last = code.sites[-1].line
    return [(statement, statement.lineno > last) for statement in reading.resetting]


def site_calls(function: ast.FunctionDef) -> list[ast.Assign]:
    """The sublayer call statements of a block forward (a fresh parse), in source order."""
    reading = _Reading(function)
    reading.read(function.body, top=True)
    return [statement for statement, _ in reading.sites]


def _own_nodes(function: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of ``function``'s own scope (not those of nested functions, classes or lambdas)."""
    found, pending = [], list(function.body)
    while pending:
        node = pending.pop()
        found.append(node)
        if not isinstance(node, NESTED_SCOPES):
            pending.extend(ast.iter_child_nodes(node))
    return found


def _is(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name
