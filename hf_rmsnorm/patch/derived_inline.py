"""Residual adds a layer writes as a call of a small function of its modeling module (Falcon's
``dropout_add(x, residual, prob, training)``, GPT-NeoX-Japanese's ``bias_dropout_add``): the call is inlined into the
layer's forward before ``derived_sites`` analyses it, so that its patterns see the add, and guarded at every call
by the function the call looks up.

**The calls inlined.** A statement ``t = f(...)`` or ``return f(...)`` of the forward (``t`` a name, in any block
of the forward's own scope), where ``f`` is a name the forward does not bind (the original looks it up in the
module's globals) whose value at patching time is a *residual add function*: an undecorated def at the top level
of the forward's own module (``derived_source.module_function`` shows its source to compile to its code) whose body
ends with ``s = r + y; return s`` or ``if T: s = r + y`` then ``return s``, ``r + y`` the sum of a parameter and a
local. Such a call is left as written, with the reason in the report (``Inlining.refusals``), unless:

1. *Its arguments bind each parameter once, as the call binds them*: no ``*``/``**`` in the call or the signature,
   every parameter given (a default read at call time is the function's to read: none is), no argument too many.
2. *Its body runs as it would in its own frame*: assignments, expression statements, ``pass`` and ``if``
   statements only (no ``return`` but the last, no loop, ``try``, ``with``, ``global``, ``yield``, nested scope);
   no private name (``__x``: the class body the forward is compiled in would mangle it); no read of ``locals``,
   ``vars``, ``dir``, ``eval``, ``exec``, ``super`` or ``__class__`` (they would see the forward's frame); every
   other name it reads but does not bind (a global of the module, or a builtin) is bound nowhere in the forward,
   so the forward looks it up where the function does. Its own names (parameters and locals) become fresh locals
   of the forward (``_hf_rmsnorm_<line>_<column>_<name>``).
3. *The add is its last computation*: ``T`` (if any) is ``p is None`` or ``p is not None`` of a parameter ``p`` no
   statement before it rebinds, so ``T`` is decided (running no code: ``is`` calls nothing) when the body starts.

**The inlined form**, for ``t = f(a, b, k=c)`` followed by the statements ``rest`` of its block::

    _f = f                          # the lookup the call makes first
    _x = a; _y = b; _k = c          # its arguments, in the order the call evaluates them
    if _hf_rmsnorm_derived.runs_inlined(_f, <f and its code when patched>) and T:
        <the body, its names renamed>
        t = _r + _s                 # the add: what the derived rewrite fuses (``derived_sites``)
        del <the body's names>      # freed where the function's frame would free them: when it returns
        <rest, as derived_rewrite rewrote it>
    else:
        t = _f(_x, _y, k=_k)        # the original call, with the arguments it evaluated
        del _x, _y, _k
        <rest, as written>

**Why it computes what the original does.** The lookup of ``f`` and the arguments are evaluated once, in the
original's order, before anything else, as the call does; the ``else`` branch then makes the original's call with
those very values and runs the original statements. The first branch runs only when the function the call looked
up is the function inlined and still runs the code whose source was inlined (``runs_inlined``: its identity, and
its ``__code__``'s, which a user or library replacing either changes; its globals and closure are read-only, and no
default is used, 1), and when ``T`` holds (3). Then its body, run in the forward's frame, computes what it computes
in its own: its parameters are bound to the same objects, its names are fresh locals nothing else binds, and every
global it reads is looked up, at the same moment, in the same module's globals and builtins (2). The only
differences are the frames: a traceback has the forward's frame where the function's would be, and it names the
lines of the code running (``derived_syntax.located``): the body's statements keep their own lines (the function
is the forward's module's, so they are the forward's file's), each argument's binding its argument's position,
the lookup, the add, the guard and the fallback the call's (the add's site is named by its call's line). This
takes one more fact of the models: the functions the body calls do not inspect their caller's frame.

``derived_sites`` analyses the forward with every call inlined straight (the body, then ``rest``), and
``derived_rewrite`` rewrites it; the guard is put in afterwards (``Inlining.guard``). A rewrite that is exact on the
straight code is exact in the first branch, which runs that code from the call on; every pattern's statements lie
in one block from its add on (``derived_sites``; the body calls no norm of the layer, so only its last add can
start one), so none reaches back across the guard. The ``else`` branch runs the original statements: no add fused,
an output add that hands nothing to the next layer (``handoff.add_residual`` is not called), an input norm that
normalises its input itself.
"""

from __future__ import annotations

import ast
import copy
import sys
import types
from dataclasses import dataclass, field
from typing import NamedTuple

from . import derived_source
from .derived_syntax import NESTED_SCOPES, located, statement_blocks, summed

# Names a body may not read: they would see the forward's frame (or class) instead of the function's.
_FRAME_NAMES = frozenset({"locals", "vars", "dir", "eval", "exec", "super", "__class__"})
_STRAIGHT = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Pass, ast.If)


class InlinedFunction(NamedTuple):
    """A function whose body a derived forward runs in place of its call, and the code that body is the source
    of (what ``runs_inlined`` compares at every call)."""

    function: types.FunctionType
    code: types.CodeType


def runs_inlined(function: object, inlined: InlinedFunction) -> bool:
    """Whether calling ``function`` (what the call looked up) runs ``inlined``'s body: it is that function, with
    that code."""
    return function is inlined.function and inlined.function.__code__ is inlined.code


@dataclass(eq=False)
class _Call:
    """One inlined call: the statement list holding it, the inlining's first statement (the lookup), how many
    statements bind the lookup and the arguments, the offset of the add from the first statement, the guard's
    test, the fallback branch, and the names freed after the add."""

    statements: list[ast.stmt]
    first: ast.stmt
    bindings: int
    add_offset: int
    test: ast.expr
    fallback: list[ast.stmt]
    freed: list[str]


@dataclass
class Inlining:
    """What ``inline_calls`` did to a forward's tree: the locals it binds (``names``), the functions the derived
    forward reaches by name (``bound``, for ``derived_source.compile_forward``), the calls of residual add functions
    left as written and why (``refusals``)."""

    names: frozenset[str] = frozenset()
    bound: dict[str, InlinedFunction] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)

    def guard(self) -> None:
        """Puts each inlined call's guard in (module docstring), once the tree was rewritten: later calls of a block
        first, so that an earlier one's branch takes them whole."""
        for call in reversed(self.calls):
            start = next(k for k, s in enumerate(call.statements) if s is call.first)
            add = call.statements[start + call.add_offset]
            if call.freed and not isinstance(add, ast.Return):
                call.statements.insert(start + call.add_offset + 1, _deleted(call.freed, add))
            inlined = call.statements[start + call.bindings:]
            call.statements[start + call.bindings:] = [located(ast.If(call.test, inlined, call.fallback), call.first)]


def inline_calls(forward: derived_source.ClassForward, function: ast.FunctionDef) -> Inlining:
    """Inlines, straight, each call of a residual add function in ``function`` (a parse of ``forward``'s def of its
    own) that can be (module docstring); the rest are in the refusals."""
    module = sys.modules[forward.definer.__module__]
    code = forward.undecorated.__code__
    bound_here = frozenset(code.co_varnames + code.co_cellvars + code.co_freevars)
    inlining = Inlining()
    found: list[tuple[list[ast.stmt], int, ast.Call, types.FunctionType, ast.FunctionDef, list[ast.stmt]]] = []
    placed: set[int] = set()
    for statements, i in _statements(function.body):
        statement = statements[i]
        call = statement.value if isinstance(statement, (ast.Assign, ast.Return)) else None
        if isinstance(statement, ast.Assign) and not (len(statement.targets) == 1
                                                      and isinstance(statement.targets[0], ast.Name)):
            call = None
        candidate = _candidate(call, module, bound_here)
        if candidate is not None:
            placed.add(id(call))
            # The fallback's statements as written, copied before any inlining changes them.
            found.append((statements, i, call, *candidate, copy.deepcopy(statements[i + 1:])))
    for node in ast.walk(function):  # calls elsewhere: not the whole value of a statement of the forward's scope
        candidate = _candidate(node, module, bound_here) if id(node) not in placed else None
        if candidate is not None:
            inlining.refusals.append(_refusal(node, "the call is not the whole value of a statement 'name = f(...)' "
                                                    "or 'return f(...)' of the forward's own scope"))
    names: set[str] = set()
    refused: list[str] = []
    for statements, i, call, target, node, rest in reversed(found):  # later first: indices stay valid
        problem = _problem(call, target, node, module, bound_here)
        if problem is not None:
            refused.insert(0, _refusal(call, problem))
            continue
        inlined = _inlined(statements[i], call, target, node, rest)
        statements[i:i + 1] = inlined.statements
        inlined.call.statements = statements
        names |= inlined.names
        inlining.bound[inlined.expected] = InlinedFunction(target, target.__code__)
        inlining.calls.insert(0, inlined.call)
    inlining.refusals = refused + inlining.refusals
    inlining.names = frozenset(names)
    return inlining


def _statements(statements: list[ast.stmt]):
    """``(list, index)`` of each statement of the forward's own scope, its blocks' statements after it."""
    for i, statement in enumerate(statements):
        yield statements, i
        for block in statement_blocks(statement):
            yield from _statements(block)


def _candidate(node: ast.AST, module: types.ModuleType,
               bound_here: frozenset[str]) -> tuple[types.FunctionType, ast.FunctionDef] | None:
    """The function and def a call ``f(...)`` of a global name calls, when it is a residual add function."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.func.id in bound_here:
        return None
    target = module.__dict__.get(node.func.id)
    if not isinstance(target, types.FunctionType):
        return None
    definition = derived_source.module_function(target)
    if isinstance(definition, str) or _final_add(definition) is None:
        return None
    return target, definition


@dataclass(frozen=True)
class _FinalAdd:
    """A residual add function's body before its add (``before``), its add ``r + y``, and the test ``T`` the add
    is under (None: none)."""

    before: list[ast.stmt]
    add: ast.BinOp
    test: ast.expr | None


def _final_add(definition: ast.FunctionDef) -> _FinalAdd | None:
    """The body's last add, if it ends ``s = r + y; return s`` or ``if T: s = r + y`` then ``return s``, with
    ``r + y`` the sum of a parameter and a local."""
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring: evaluating it does nothing
    if len(body) < 2 or not (isinstance(body[-1], ast.Return) and isinstance(body[-1].value, ast.Name)):
        return None
    last, test = body[-2], None
    if isinstance(last, ast.If) and len(last.body) == 1 and not last.orelse:
        last, test = last.body[0], last.test
    found = summed(last)
    if found is None or found[0] != body[-1].value.id:
        return None
    parameters = {a.arg for a in _parameters(definition.args)}
    operands = found[1].left, found[1].right
    if not all(isinstance(o, ast.Name) for o in operands) or {o.id in parameters for o in operands} != {True, False}:
        return None
    return _FinalAdd(body[:-2], found[1], test)


def _parameters(arguments: ast.arguments) -> list[ast.arg]:
    return [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]


def _problem(call: ast.Call, target: types.FunctionType, definition: ast.FunctionDef, module: types.ModuleType,
             bound_here: frozenset[str]) -> str | None:
    """Why ``call`` of ``target`` cannot be inlined exactly (module docstring), if it cannot."""
    if target.__globals__ is not module.__dict__:
        return f"{target.__module__}.{target.__name__} is another module's: its body reads other globals"
    binding = _binding(call, definition.args)
    if isinstance(binding, str):
        return binding
    final = _final_add(definition)
    statements = [*final.before, ast.Expr(final.add)]
    for statement in _all_statements(statements):
        if not isinstance(statement, _STRAIGHT) or (isinstance(statement, ast.AnnAssign) and statement.value is None):
            return f"its body has a {type(statement).__name__} statement (line {statement.lineno})"
    for node in (n for s in statements for n in ast.walk(s)):
        if isinstance(node, (*NESTED_SCOPES, ast.Yield, ast.YieldFrom, ast.Await)):
            return f"its body has a {type(node).__name__} (line {node.lineno})"
        for name in _identifiers(node):
            if name.startswith("__") and not name.endswith("__"):
                return f"its body names {name}, which the class the forward is compiled in would mangle"
    local = set(target.__code__.co_varnames)
    for node in (n for s in statements for n in ast.walk(s)):
        if isinstance(node, ast.Name) and node.id not in local:
            if node.id in _FRAME_NAMES:
                return f"its body reads {node.id}, which would see the forward's frame"
            if node.id in bound_here:
                return f"its body reads the global {node.id}, which the forward binds"
    if final.test is not None and not _decided_first(final.test, final.before, {a.arg for a in _parameters(
            definition.args)}):
        return (f"its add is under 'if {ast.unparse(final.test)}', which cannot be decided before its body runs "
                "(only 'p is None' or 'p is not None' of a parameter p it does not rebind)")
    return None


def _binding(call: ast.Call, arguments: ast.arguments) -> dict[str, ast.expr] | str:
    """Each parameter's argument expression as ``call`` binds them, or why it does not bind each once."""
    if arguments.vararg or arguments.kwarg:
        return "the function takes *args or **kwargs"
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return "the call passes *args or **kwargs"
    positional = [*arguments.posonlyargs, *arguments.args]
    if len(call.args) > len(positional):
        return "the call passes more positional arguments than the function takes"
    binding = {p.arg: a for p, a in zip(positional, call.args)}
    by_keyword = {a.arg for a in [*arguments.args, *arguments.kwonlyargs]}
    for keyword in call.keywords:
        if keyword.arg not in by_keyword or keyword.arg in binding:
            return f"the call's keyword {keyword.arg} binds no parameter once"
        binding[keyword.arg] = keyword.value
    missing = [p.arg for p in _parameters(arguments) if p.arg not in binding]
    if missing:
        return f"the call leaves {', '.join(missing)} to the function's defaults"
    return binding


def _all_statements(statements: list[ast.stmt]):
    for statement in statements:
        yield statement
        if isinstance(statement, ast.If):
            yield from _all_statements(statement.body)
            yield from _all_statements(statement.orelse)


def _identifiers(node: ast.AST) -> list[str]:
    """The identifiers a node writes that the compiler could mangle."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.keyword) and node.arg is not None:
        return [node.arg]
    return []


def _decided_first(test: ast.expr, before: list[ast.stmt], parameters: set[str]) -> bool:
    """Whether ``test`` is ``p is None`` or ``p is not None`` for a parameter ``p`` that ``before`` never binds."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None and test.left.id in parameters):
        return False
    return not any(isinstance(n, ast.Name) and n.id == test.left.id and not isinstance(n.ctx, ast.Load)
                   for s in before for n in ast.walk(s))


@dataclass(frozen=True)
class _Inlined:
    statements: list[ast.stmt]
    names: frozenset[str]
    expected: str
    call: _Call


def _inlined(statement: ast.Assign | ast.Return, call: ast.Call, target: types.FunctionType,
             definition: ast.FunctionDef, rest: list[ast.stmt]) -> _Inlined:
    """The statements standing for ``statement`` (its call inlined straight), and its guard's parts."""
    final = _final_add(definition)
    prefix = f"_hf_rmsnorm_{call.lineno}_{call.col_offset}"
    renamed = {name: f"{prefix}_{name}" for name in target.__code__.co_varnames}
    binding = _binding(call, definition.args)
    lookup = located(ast.Assign([ast.Name(prefix, ast.Store())], ast.Name(call.func.id, ast.Load())), call.func)
    # In the call's order: its positional arguments, then its keywords (nothing starred: the order written).
    arguments = [*call.args, *(k.value for k in call.keywords)]
    parameter = {id(expression): name for name, expression in binding.items()}
    bindings = [located(ast.Assign([ast.Name(renamed[parameter[id(a)]], ast.Store())], a), a) for a in arguments]
    body = [_renamed(copy.deepcopy(s), renamed) for s in final.before]
    add = located(ast.BinOp(_renamed(copy.deepcopy(final.add.left), renamed), ast.Add(),
                            _renamed(copy.deepcopy(final.add.right), renamed)), call)
    if isinstance(statement, ast.Return):
        last: ast.stmt = located(ast.Return(add), statement)
    else:
        last = located(ast.Assign([ast.Name(statement.targets[0].id, ast.Store())], add), statement)
    expected = f"_hf_rmsnorm_inlined_{target.__name__}"
    test: ast.expr = ast.Call(ast.Attribute(ast.Name(derived_source.HELPERS, ast.Load()), "runs_inlined", ast.Load()),
                              [ast.Name(prefix, ast.Load()), ast.Name(expected, ast.Load())], [])
    if final.test is not None:
        test = ast.BoolOp(ast.And(), [test, _renamed(copy.deepcopy(final.test), renamed)])
    original = copy.deepcopy(statement)
    original.value = located(ast.Call(
        ast.Name(prefix, ast.Load()),
        [ast.Name(renamed[parameter[id(a)]], ast.Load()) for a in call.args],
        [ast.keyword(k.arg, ast.Name(renamed[k.arg], ast.Load())) for k in call.keywords]), call)
    parameters = [renamed[a.arg] for a in _parameters(definition.args)]
    fallback = [original]
    if not isinstance(statement, ast.Return):
        fallback.append(_deleted(parameters, statement))
    # Freed after the add: the parameters and the names the body binds whatever its branches do.
    unconditional = {renamed[n.id] for s in final.before if not isinstance(s, ast.If) for n in ast.walk(s)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    freed = parameters + sorted(unconditional - set(parameters))
    statements = [lookup, *bindings, *body, last]
    inlined_call = _Call([], lookup, 1 + len(bindings), len(statements) - 1, located(test, statement),
                         fallback + rest, freed)
    return _Inlined(statements, frozenset({prefix, *renamed.values()}), expected, inlined_call)


def _renamed(node: ast.AST, renamed: dict[str, str]) -> ast.AST:
    for part in ast.walk(node):
        if isinstance(part, ast.Name) and part.id in renamed:
            part.id = renamed[part.id]
    return node


def _deleted(names: list[str], where: ast.AST) -> ast.Delete:
    return located(ast.Delete([ast.Name(name, ast.Del()) for name in names]), where)


def _refusal(call: ast.Call, reason: str) -> str:
    return f"residual add in {call.func.id}() called at line {call.lineno} not fused: {reason}"
