"""Residual adds that an ``if`` separates from their norm, moved so that each branch holds an add next to its norm
(``derived_sites``' ``before`` pattern then finds them).

Seq2seq decoder layers (mBART, Pegasus, Whisper, Blenderbot, BigBird-Pegasus, GPT-BigCode and the like) run their
cross-attention block only when the encoder's states are given::

    s = a + b                      # the self-attention's residual add
    if encoder_hidden_states is not None:
        r = s                      # the block begins with the cross-attention's norm
        h = self.encoder_attn_layer_norm(s)
        ...
        s = a2 + b2                # and ends with its residual add
    r = s                          # both paths reach the feed-forward's norm
    h = self.final_layer_norm(s)

and XLNet adds its residual only when asked (``if residual: s = s + h``, then ``self.layer_norm(s)``).
``sink_adds`` rewrites such code in place, before the analysis reads the forward (planning and rewriting alike)::

    if encoder_hidden_states is not None:
        s = a + b
        r = s; h = self.encoder_attn_layer_norm(s)
        ...
        s = a2 + b2
        r = s; h = self.final_layer_norm(s)
    else:
        s = a + b
        r = s; h = self.final_layer_norm(s)

The statements after the ``if`` up to the norm's consumer (aliases ``r = s``, then the statement calling the norm
on ``s``) go to the end of both branches, when ``s`` is the add just before the ``if`` or the last statement of a
branch, and the norm's output is not added to a residual right away (a sandwich layer's ``y = F(s); s2 = r + y``,
which the ``after`` pattern fuses where it stands). The add just before the ``if`` goes to the top of both
branches.

**Why the forward computes the same.** Copying the statements that follow an ``if`` to the end of each of its
branches changes nothing, whatever the test: each path runs the same statements in the same order. Moving the add
below the test changes one thing only: the test is now evaluated before the add, not after. That is exact when the
two commute, which the test's form makes sure of:

8. *A test that runs nothing* (for an add moved below it). It is built only from ``is`` and ``is not``
   comparisons, with ``not``, ``and`` and ``or``. Its operands are constants and parameters of the forward that no
   statement, ``:=`` or nested scope rebinds. An identity comparison calls no code and cannot raise, a parameter is
   always bound, and ``not``, ``and`` and ``or`` of booleans call nothing. So the test has no effect that the add
   could see, and it reads no value the add could change: the add binds ``s`` alone, and ``s`` is no parameter
   the test may read. Evaluating the add's operands (calls, dropout) after the test is then what the original
   does, in the same order.
"""

from __future__ import annotations

import ast
import copy

from .derived_syntax import (
    assigned_name, module_call, past_aliases, returned_sum, statement_blocks, summed, walrus_targets,
)


def sink_adds(function: ast.FunctionDef, norms: frozenset[tuple[str, ...]], self_name: str,
              plain: frozenset[str]) -> None:
    """Moves the statements after an ``if`` up to the consumer of a norm of a sum into the ``if``'s branches, with
    the add before the ``if`` when its test runs nothing (invariant 8; module docstring); ``plain`` are the locals
    only the forward's own statements can rebind (``derived_sites.plain_locals``)."""
    _sink_in(function.body, _FixedParameters(function, plain), norms, self_name)


class _FixedParameters:
    """The parameters of a forward that nothing rebinds: no statement, ``:=``, ``del`` or nested scope."""

    def __init__(self, function: ast.FunctionDef, plain: frozenset[str]) -> None:
        arguments = function.args
        names = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
        names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
        # Every binding or deletion, nested scopes and ``:=`` targets included (a Name in a Store or Del context).
        bound = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        self.names = frozenset(names & plain) - bound

    def test_runs_nothing(self, test: ast.expr) -> bool:
        """Invariant 8: ``is``/``is not`` comparisons of these parameters and constants, under ``not``/``and``/
        ``or``."""
        if isinstance(test, ast.BoolOp):
            return all(self.test_runs_nothing(value) for value in test.values)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.test_runs_nothing(test.operand)
        if isinstance(test, ast.Compare):
            return all(isinstance(op, (ast.Is, ast.IsNot)) for op in test.ops) and all(
                isinstance(o, ast.Constant) or (isinstance(o, ast.Name) and o.id in self.names)
                for o in (test.left, *test.comparators))
        return False


def _sink_in(statements: list[ast.stmt], parameters: _FixedParameters, norms: frozenset[tuple[str, ...]],
             self_name: str) -> None:
    """``sink_adds`` in one statement list and the lists nested in it, nested scopes left out (invariant 7)."""
    i = 0
    while i < len(statements):
        statement = statements[i]
        if isinstance(statement, ast.If):
            i -= _into_branches(statements, i, parameters, norms, self_name)
        for block in statement_blocks(statement):
            _sink_in(block, parameters, norms, self_name)
        i += 1


def _into_branches(statements: list[ast.stmt], i: int, parameters: _FixedParameters,
                   norms: frozenset[tuple[str, ...]], self_name: str) -> int:
    """Rewrites the ``if`` at ``i`` when the statements after it are aliases of a sum ``s`` then a statement
    calling a norm on ``s`` (the consumer), and ``s`` is the add just before the ``if`` (of a test that runs
    nothing) or a branch's last statement: the add goes to the top of both branches, the aliases and the consumer
    to the end of both. Returns how many statements before ``i`` moved into the branches (0 or 1)."""
    branching = statements[i]
    before = summed(statements[i - 1]) if i > 0 and not walrus_targets(statements[i - 1]) else None
    if before is not None and parameters.test_runs_nothing(branching.test):
        total = before[0]
    else:
        before = None
        ends = {found[0] for branch in (branching.body, branching.orelse) if branch and (found := summed(branch[-1]))}
        if len(ends) != 1:
            return 0
        total = ends.pop()
    end = past_aliases(statements, i + 1, {total})
    if end == len(statements) or not any(
        module_call(node, self_name) in norms and isinstance(node.args[0], ast.Name) and node.args[0].id == total
        for node in ast.walk(statements[end])
    ) or _adds_to_normed(statements, end):
        return 0
    moved = statements[i + 1:end + 1]
    branching.body.extend(copy.deepcopy(moved))
    branching.orelse.extend(moved)
    del statements[i + 1:end + 1]
    if before is None:
        return 0
    add = statements.pop(i - 1)
    branching.body.insert(0, copy.deepcopy(add))
    branching.orelse.insert(0, add)
    return 1


def _adds_to_normed(statements: list[ast.stmt], end: int) -> bool:
    """Whether the norm's output is added to a residual right away (``s2 = r + F(s)``, or ``y = F(s)`` then ``s2 =
    r + y``): ``derived_sites``' ``after`` pattern fuses that add where the statements stand, so they stay there
    (a sandwich layer's branch sum normed before its residual add)."""
    consumer = statements[end]
    found = summed(consumer)
    if found is not None and any(isinstance(o, ast.Call) for o in (found[1].left, found[1].right)):
        return True
    normed = assigned_name(consumer)
    following = statements[end + 1] if end + 1 < len(statements) else None
    add = (summed(following) or (None, returned_sum(following)))[1] if following is not None else None
    return normed is not None and isinstance(add, ast.BinOp) and any(
        isinstance(o, ast.Name) and o.id == normed for o in (add.left, add.right))
