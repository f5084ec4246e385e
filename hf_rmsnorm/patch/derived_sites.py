"""Where a decoder layer's forward adds next to its norms (``layer_code``), and why rewriting exactly those adds
into the kernels' fused calls (``derived_rewrite.py``) cannot change what the forward computes.

The patterns, in the layer's own names (``F`` is ``self.<attribute path>``, called with one positional argument)::

    before a norm:  s = a + b; [r = s ...]; ... F(s) ...  ->  normed, s = norm_of_sum(F, a, b); [r = s]; ... normed ...
    a norm's argument:  ... F(a + b) ...                  ->  ... norm_of_add(F, a, b) ...
    after a norm:   s = r + F(e)  (or F(e) + r)           ->  s = norm_then_add(F, e, r)
                    y = F(e); s = r + y  (or return r + y) ->  pass; s = norm_then_add(F, e, r)
    two norms:      y = F(e); s = r + y; [r2 = s ...]; ... F2(s) ...
                        ->  pass; normed, s = norm_add_norm(F, e, r, F2); [r2 = s]; ... normed ...
    layer output:   s = a + b; return s  (return s, ...)  ->  s = stream_sum(call, a, b); return s
                    return a + b                          ->  return stream_sum(call, a, b)
                    s = a + b; o = (s, ...) + rest; return o  (or return (s, ...) + rest)
                                                          ->  s = stream_sum(call, a, b); ...
                    s = a + b; if T: B; return s          ->  s = stream_sum(call, a, b); if T: withdraw(call); B;
                                                              return s
    input norm:     ... F(x) ...  (x the input, or x.to(...)) ->  ... input_norm(call, F, x, x) ...
    norms under tests:  s = a + b; [r = s | n = s.shape | v = s.reshape(-1, s.size(-1)) ...];
                        if T0: y = F0(v); ... if Tk: y = Fk(v)  [...; return s]
                            ->  pending, s = norm_of_sum_first(a, b, self, 0 if T0 else ... k if Tk else None,
                                                               paths [, call]);
                                ...; if T0: y = take_normed(pending, 0, F0, v); ...
    sublayer outputs:  T = self.<path>(...); [r = s ...]; ... F(s) ...   (``s`` is ``T``, or ``T``'s first name)
                            ->  T, handed = sublayer_into(self, self.<path>, ...); [r = s];
                                ... take_handed(handed, F, s) ...
                        T = self.<path>(...); return s  (return s, ...)
                            ->  T = sublayer_output(call, self, self.<path>, ...); return s

The output pattern also matches an add ending an ``if`` branch followed by the ``return``, and an add followed by
an ``if`` whose test ``T`` only reads and compares (mBART's ``if hidden_states.dtype == torch.float16:``, whose
branch clamps the sum), then the ``return``, and a sum returned first in a tuple built by ``(s, ...) + rest``
(UMT5's and LongT5's sublayers append their attention outputs so: the other items and ``rest`` only read, and
``handoff.run_layer`` checks at every call that the tuple returned begins with the sum). An add of a tuple or list
display is a concatenation, never an output add. The input norm is the norm applied to the input before anything
else reads it, in each branch of an ``if`` alike. ``call`` is the
``handoff.LayerCall`` the derived forward takes as the keyword-only ``handoff.CALL_PARAM``; the helpers are
``derived_runtime``'s, and each checks at every call that its kernel computes what the expression does (a patched
norm no hook watches, two tensors of one shape, type and device), else evaluates the original expression.

The two-norm pattern is an ``after`` site (either form) whose sum the next statement, past aliases, reads with
another norm ``F2`` as a ``before`` site's consumer does (Gemma 2-4's and GLM-4's sandwich: the post-attention
norm, the add, the pre-feedforward norm of the sum). It is recorded as the ``after`` site (the report and the
census count that add once, as before), chained to ``F2`` (``AfterPlan.next_call``).

The argument pattern is the post-LN sublayer's ``self.LayerNorm(dropout(dense(h)) + input)`` (BERT's
``*SelfOutput`` and ``*Output``): the sum is never bound, so nothing moves; a dropout inside an operand is part of
that operand, evaluated before the add either way.

**Why a rewrite computes what it replaces.** A rewrite changes when some parts are evaluated, never what they
compute: the helpers compute the same sums and norms. So it is exact when evaluating those parts at their new
moment gives the same values, with the same effects in the same order. The argument takes Python's semantics and
three facts of the models: looking up ``self.<path>`` runs no code of the model and finds the same module
throughout a statement; a norm does not change its argument; ``r + y`` of two tensors (or a tensor and a number)
equals ``y + r``. A statement breaking one of the invariants below keeps its add as written, and the report says
which invariant (``Refusal``); ``tests/patch/test_derived_soundness.py`` breaks each check with a toy layer.

1. *Once, where it is written.* A norm call a rewrite moves or replaces lies in the forward's own scope: not in a
   lambda, a nested function or class, a comprehension or a generator expression, where it runs later (after its
   operand was rebound) or any number of times. A moved one (``before``'s) is not conditional either: not in a
   branch of ``x if c else y`` or a later operand of ``and``/``or``, where the original may not call it at all.
2. *Nothing runs in between.* ``before`` moves ``F(s)`` from the statement that reads it (the consumer) up to the
   add. In between there may be only aliases ``r = s`` (bindings, no code) and, in the consumer, only reads of
   names, constants and their attributes or items evaluated before ``F(s)`` (``self.mlp`` in ``self.mlp(F(s))``): a
   call or an operator there would now run after the norm, and could change what the norm reads (its weight, a
   module's state) or see the order. What the consumer evaluates after ``F(s)`` sees the same values either way.
3. *No operand is rebound.* An operand read at another moment than the original's is a local name that nothing in
   between can rebind: ``after`` reads its residual ``r`` after the norm's argument ``e`` (``r + F(e)``) or before
   the norm's call (``y = F(e); s = r + y``), so ``r`` is a name (an attribute or a call could change), bound by no
   ``:=`` in the statement or in a comprehension, declared ``nonlocal`` by no nested function (which could rebind
   it when called), declared neither ``global`` nor ``nonlocal`` itself. The name a stack's loop passes from layer to layer (``derived_loops.py``)
   obeys the same rule. The layer's input, which its input norm's replacement relies on, needs nothing more: the
   norm must be the first statement naming it, and what could rebind it (a nested function, ``:=``) names it.
4. *The original's order.* The helpers evaluate their arguments left to right, as the original evaluates its
   operands: ``norm_of_sum(F, a, b)`` looks ``F`` up first (a lookup runs nothing), then ``a`` and ``b``;
   ``norm_then_add(F, e, r)`` evaluates ``F`` and ``e`` as ``F(e)`` does, then reads ``r`` (3). The output
   pattern moves nothing.
5. *An exception leaves what the original leaves.* An exception the moved norm raises now comes from the add's
   statement, before the sum is bound: a ``before`` site is not rewritten inside a ``try`` or ``with`` block, whose
   handler, ``finally`` or context manager could go on and read the sum. An output add inside a ``try`` is not
   handed on either: its ``finally`` could return something else than the sum.
6. *A binding removed is read nowhere.* ``y = F(e); s = r + y`` no longer binds ``y``: ``y`` is ``s``, or a local
   read or deleted nowhere else in the forward (nested scopes included), so its previous binding, which it keeps,
   is never met.
The argument pattern moves nothing: ``norm_of_add(F, a, b)`` stands where ``F(a + b)`` stood and evaluates ``F``,
``a`` and ``b`` in that order, as the call and its add do (4), then computes ``F(a + b)``; nothing runs between
them either way (2), and no operand is read at another moment (3). It is matched in the simple statements of the
forward's own scope only, outside nested scopes (1, 7), in no statement that starts another pattern; it replaces
its call alone, so a ``before`` rewrite of a norm call in the same statement (its consumer) is not touched.

The output pattern with an ``if`` between add and ``return``: the handoff's normed sum is the next norm of the sum
the kernel returns, which the layer returns unless a branch runs. In between only ``T`` runs, which reads and
compares (``derived_syntax.compares_reads``: no call, no operator but ``==``, ``!=``, ``is`` and ``is not`` of read
values), so it changes neither the sum nor a norm (2). A branch may change the sum (rebind it, or clamp it in
place), so each branch's first statement withdraws the normed sum (``handoff.withdraw``): the next norm then
normalises what the layer returns, as the original does.

**Two norms, one kernel.** The two-norm rewrite is the ``after`` rewrite followed by the ``before`` rewrite of
its sum: ``s = norm_then_add(F, e, r)`` is exact by the ``after`` argument (3, 4, 6), and moving ``F2(s)`` from
its consumer up to the statement that binds ``s`` is exact by the ``before`` argument, so the chain is checked
against both sets of invariants: the ``after`` site's (its residual a plain local, the removed binding read
nowhere), and the ``before`` rules for ``F2``'s call (not deferred or conditional: 1; only aliases in between and
only reads before it in the consumer: 2; outside ``try`` and ``with`` blocks: 5). What is evaluated, in order:
``F``, ``e``, ``r`` (as ``norm_then_add`` evaluates them), then ``F2`` (a lookup, which runs nothing), then the
first norm, the add and the second norm; the original evaluates ``F2`` and calls it after the aliases, which
run nothing. An exception from ``F2`` now leaves ``s`` unbound, which nothing reads (5). The helper computes the
values of ``r + F(e)`` and ``F2`` of that rounded sum exactly (``ops.functional.norm_add_norm``: bitwise the two
ops), and where one kernel cannot (``sandwich.chains``: a hook, another mode) evaluates ``norm_then_add(F, e, r)``
and ``F2(s)`` themselves. A chain whose consumer another pattern rewrites is not made (each statement has one
rewrite); an ``after`` site whose sum no norm reads so stays an ``after`` site.

No derived forward hands an ``after`` site's sum to the next layer's input norm (as the registered sandwich layers'
bodies do: ``handoff.add_normed_residual``). The layer output pattern is a plain add the ``return`` returns; a
sandwich layer whose last add is ``r + F(e)`` and returned as it is would need its own output rewrite (the ``after``
helper handing the sum on, with the output pattern's ``withdraw``). Gemma 4's, the one derived sandwich, returns
no such sum: after its post-feedforward norm's add come its per-layer-input branch (another ``after`` site) and
``hidden_states *= self.layer_scalar``, so what the next layer's input norm reads is a product no norm kernel
computes, and its adds stay inside the layer.

7. *The layer's own statements.* Nested functions and classes are not looked into: an add there runs when they are
   called, and their ``return`` is not the layer's output.

**Norms under tests.** OPT's decoder layer normalises before or after its adds as ``self.do_layer_norm_before``
says, and flattens the stream between (``hidden_states.reshape(-1, hidden_states.size(-1))``, and its output
``(residual + h).view(shape)``)::

    h = residual + h
    if not self.do_layer_norm_before: h = self.self_attn_layer_norm(h)    # post-LN (OPT-350m)
    shape = h.shape; h = h.reshape(-1, h.size(-1)); residual = h
    if self.do_layer_norm_before: h = self.final_layer_norm(h)            # pre-LN (the others)

The sum (``s = a + b``, or ``s = (a + b).view(...)`` with arguments that only read) is read, past statements that
bind an alias of it, its flattening (``v = s.reshape(-1, s.size(-1))`` or ``.view``, ``s.shape[-1]`` alike: its
rows as a matrix) or its sizes (``n = s.shape``, ``n = s.size()``), by ``if`` statements each holding one norm
call of one of those names, ``if T: y = F(v)``; the site's kind is ``"guarded"``, or ``"output"`` (its
``alternatives`` the norms) where a ``return`` of one of the names ends the run, the layer's output when no test
holds. The add's statement now evaluates the tests (``derived_syntax.tests_reads``: reads, comparisons and truth
values of what they read, which run no code of the model) as the ``if`` statements would, lazily: ``0 if T0 else
1 if T1 else None`` (a test only when every earlier one failed); the helper computes the sum with the norm of the
first test that holds (``norm_of_sum_first``: looked up by its attribute path, as the original's ``self.<path>``),
and that ``if``'s norm call takes it (``take_normed``, viewed as its argument), the other calls being the plain
ones. Why that is exact:

9. *The tests decide alike, and only what the rewrite evaluates runs before the norm.* Between the add and the
   ``if`` of the first test that holds, the original runs only the bindings above, torch's views and size reads
   (no code of the model), and the earlier tests, which failed (so their calls did not run). A test reads no name
   the add or those statements bind (else refused): evaluated at the add, each test sees what it sees at its
   ``if``, so the first that holds is the same. The norm chosen is that ``if``'s, the same module (``take_normed``
   checks its identity), in the same state (nothing ran), applied to the same values: the sum, or a view of it
   that keeps its rows (a norm normalises each row: the norm of the view is the view of the norm; ``take_normed``
   checks the view keeps the last dimension). Where no test holds, no norm call runs, and an output site's sum
   goes to the next norm as the output pattern's does (``stream_sum``; a view of it as ``handoff.hand_on_viewed``
   says). Invariants 1 (the norm calls are in the forward's own statements, none deferred: an ``if`` body is no
   nested scope), 3 (``a`` and ``b`` are evaluated first, as the original does) and 5 (no ``try``/``with`` block)
   hold as for ``before``; a test evaluated earlier than at its ``if`` only reads.

**Sublayer outputs.** BLOOM's block calls its attention and MLP with their residual, and each returns its own
output add (``dropout_add``, inlined: ``derived_inline.py``)::

    attention_output, attn_weights = self.self_attention(layernorm_output, residual, ...)
    layernorm_output = self.post_attention_layernorm(attention_output)
    ...
    output = self.mlp(layernorm_output, residual)
    return output, attn_weights

A *sublayer* is a module the layer calls as ``self.<path>(...)`` (attributes only), binding its output to a name
``s`` (alone, or first of a tuple target), whose class's derived forward has output sites only, no refusal, one
return form (the planner's ``_sublayer_candidates``; it is patched as a derived layer of its own, which hands its
output sum on as a stack's layer does: ``handoff.run_layer``). The sum ``s`` is read next, past aliases, by a norm
call ``F(s)`` of the layer as a ``before`` site's sum is (``_norm_reading``: invariants 1, 2 and 5), or returned by
the layer (``return s`` or ``return s, ...``: the layer's output). The sublayer call becomes a helper call
(``handoff.sublayer_into``, ``handoff.sublayer_output``) that calls the same sublayer with the same arguments, and
the consumer's ``F(s)`` becomes ``take_handed(handed, F, s)``. Why that is exact:

10. *The norm of the very sum, by the very norm, with nothing run in between.* The helper's arguments are ``self``
    (a name), ``self.<path>`` (a lookup, which runs nothing) and the call's own arguments, as written and in their
    order (positional, starred and keyword alike): the sublayer receives what the original call gives it. Its
    output add is computed by ``F``'s kernel (``F``'s own fused forward, the module the layer's links name, found
    in its parent at every call: ``handoff.foreign_code``), and the sublayer returns its usual output with the
    normed sum appended (taken off again by the helper) only when it returns that very sum, alone or first
    (``run_layer`` checks the identity at every call). Between that add and the original's ``F(s)`` run only the
    rest of the sublayer's forward after its output add (the output pattern: a ``return``, or branches that
    withdraw the normed sum), the binding of ``T``, aliases (bindings), and the consumer's reads before ``F(s)``
    (2): nothing that runs code of the model, so ``F`` is in the same state and ``s`` holds the same values.
    ``take_handed`` returns the normed sum only when the module it is given is the norm that made it and its
    argument is that very sum (identities, at every call), else calls ``F(s)``: a module put at ``self.<F>`` after
    patching, or a rebound ``s``, gets the original call. An exception ``F``'s kernel raises now comes from the
    sublayer's statement, before ``T`` is bound: refused inside ``try`` and ``with`` blocks (5), as a norm call in
    a nested scope or a conditional is (1). The layer's output form hands the sum to the norm the layer's own call
    was asked to hand on to (the stack checked the layer and that norm), the sublayer checked as a handing layer
    is; ``run_layer`` hands it on only when the layer returns that very sum. A hook on the sublayer or the norm,
    an accelerate hook, a sublayer whose class or forward was changed after patching, or another module at
    ``self.<path>`` (the links are keyed by the sublayer module itself) makes the plain call
    (``handoff.foreign_code``).
"""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass, field

from . import derived_inline, derived_source
from .derived_branches import sink_adds
from .derived_syntax import (
    COMPREHENSIONS, assigned_name, attribute_path, conditional_in, deferred_by, evaluated_before, flattened, item_path,
    loads, module_call, named, parents, compares_reads, past_aliases, reads_only, returned_sum, self_name, shape_read,
    statement_blocks, summed, tests_reads, viewed_sum, walrus_targets,
)


@dataclass(frozen=True)
class AddSite:
    """A residual add of a layer's forward next to a norm: ``position`` is ``"before"`` (the norm reads the sum),
    ``"guarded"`` (norms under ``if`` tests read the sum or its rows: the first whose test holds),
    ``"argument"`` (the sum is the norm's argument, ``F(a + b)``),
    ``"after"`` (the sum adds the norm's output) or ``"output"`` (the layer returns the sum); ``norm`` is the norm's
    attribute path from the layer (empty for ``"output"``; a ``"guarded"`` site's first, ``alternatives`` the
    others, in the order the code tests them); ``line`` is the add's line in the source file;
    ``in_tuple``: an output returned first in a tuple (``return s, ...``), not alone."""

    position: str
    norm: tuple[str, ...]
    line: int
    in_tuple: bool = False
    alternatives: tuple[tuple[str, ...], ...] = ()
    sublayer: tuple[str | int, ...] = ()

    @property
    def norms(self) -> tuple[tuple[str, ...], ...]:
        """The paths of the norms of the layer the add may go into (one but for a ``"guarded"`` site; none for an
        output, or the guarded norms of one whose sum the layer returns where no test holds)."""
        return (self.norm, *self.alternatives) if self.norm else self.alternatives

    @property
    def label(self) -> str:
        norms = " or ".join(".".join(norm) for norm in self.norms)
        if self.sublayer:
            called = ".".join(str(step) for step in self.sublayer)
            return f"output add of {called} (line {self.line}: {'into ' + norms if norms else 'layer output'})"
        if self.position == "output" and norms:
            return f"residual add at line {self.line} (into {norms} where a test holds, else layer output)"
        where = {"before": "into", "guarded": "into", "argument": "into", "after": "after",
                 "output": "layer output"}[self.position]
        return f"residual add at line {self.line} ({where}{' ' + norms if norms else ''})"


@dataclass(frozen=True)
class Refusal:
    """A residual add next to a norm (or an input norm) that a pattern matches but that is left as written, and
    why: the invariant (module docstring) its statement breaks."""

    text: str


@dataclass(frozen=True)
class DerivedLayerKind:
    """A decoder layer whose fused forward is derived from its class's own forward: ``sites`` are the adds that
    forward rewrites, ``input_norm`` the dotted path of the norm the forward applies to its input before anything
    else touches it (where a previous layer may hand its output's norm over), or None; ``norms`` the paths of the
    patched norms the forward calls (what its analysis was given)."""

    class_path: str
    sites: tuple[AddSite, ...]
    input_norm: str | None
    norms: frozenset[tuple[str, ...]]
    sublayers: frozenset[tuple[str, ...]] = frozenset()

    # What the planner asks of every layer kind (as ``families.LayerKind``).
    handoff_label = "layer output"
    handoff_dropout = None
    last_add_inside = None
    block = "layer whose one add next to a norm is its output"

    @property
    def inner_sites(self) -> tuple[AddSite, ...]:
        """The sites whose add may go into a norm of the layer itself: all but the plain outputs (an output whose
        sum a guarded norm may read first is one too)."""
        return tuple(site for site in self.sites if site.norms)

    @property
    def fuses_inside(self) -> bool:
        return bool(self.inner_sites)

    @property
    def guarded_output(self) -> AddSite | None:
        """The output site whose sum guarded norms of the layer may read first, if any (reported as one add)."""
        return next((site for site in self.sites if site.position == "output" and site.norms), None)

    @property
    def hands_off_last_add(self) -> bool:
        # Returned in one form (a tensor, or first in a tuple): what the derived loop takes the output as.
        return len({site.in_tuple for site in self.sites if site.position == "output"}) == 1

    @property
    def returns_tuple(self) -> bool:
        return any(site.in_tuple for site in self.sites if site.position == "output")


@dataclass(frozen=True)
class LayerCode:
    """What a forward's source says: its add sites in source order, its input norm, and the adds (or input norm)
    a pattern matches but an invariant rules out."""

    sites: tuple[AddSite, ...]
    input_norm: str | None
    refusals: tuple[Refusal, ...]


# ------------------------------------------------------------------------------------- the plans


@dataclass(eq=False)
class BeforePlan:
    """``s = a + b`` (``statements[index]``), then aliases, then ``consumer`` calling ``call`` = ``F(s)``."""

    site: AddSite
    statements: list[ast.stmt]
    index: int
    add: ast.BinOp
    total: str
    consumer: ast.stmt
    call: ast.Call


@dataclass(eq=False)
class GuardedPlan:
    """``s = a + b`` or ``s = (a + b).view(...)`` (``statements[index]``, ``view`` that call), then aliases,
    flattenings and sizes of the sum, and ``consumers``: ``if T: y = F(v)`` statements and ``calls`` their norm
    calls ``F(v)``, in order; an ``output`` site when a ``return`` of the sum follows."""

    site: AddSite
    statements: list[ast.stmt]
    index: int
    add: ast.BinOp
    total: str
    consumers: list[ast.If]
    calls: list[ast.Call]
    view: ast.Call | None = None


@dataclass(eq=False)
class AfterPlan:
    """``s = r + F(e)`` or ``return r + y`` (``statements[index]``; ``total`` None for a return), ``call`` =
    ``F(e)`` and ``residual`` = ``r``; ``dropped`` the index of ``y = F(e)`` in the two-statement form;
    ``next_call`` the next norm's call ``F2(s)`` in ``consumer`` where the site is chained to it."""

    site: AddSite
    statements: list[ast.stmt]
    index: int
    add: ast.BinOp
    total: str | None
    call: ast.Call
    residual: ast.Name
    dropped: int | None = None
    consumer: ast.stmt | None = None
    next_call: ast.Call | None = None


@dataclass(eq=False)
class ArgumentPlan:
    """``call`` = ``F(a + b)`` (``add``) in the simple statement ``statement``."""

    site: AddSite
    statement: ast.stmt
    call: ast.Call
    add: ast.BinOp


@dataclass(eq=False)
class OutputPlan:
    """``statement`` (``s = a + b`` or ``return a + b``) holding the layer's output add ``add``; ``withdrawn``
    the branches of an ``if`` between the add and the ``return``, each of which withdraws the handoff first."""

    site: AddSite
    statement: ast.stmt
    add: ast.BinOp
    withdrawn: list[list[ast.stmt]] = field(default_factory=list)


@dataclass(eq=False)
class SublayerPlan:
    """``T = self.<path>(...)`` (``statements[index]``, ``call`` the sublayer call), the sublayer's output add
    bound to ``total`` (``T``, or its first name); ``consumer`` calling ``norm_call`` = ``F(total)`` next, or None
    for the layer's output (returned, alone or first in a tuple)."""

    site: AddSite
    statements: list[ast.stmt]
    index: int
    call: ast.Call
    total: str
    consumer: ast.stmt | None = None
    norm_call: ast.Call | None = None


@dataclass(frozen=True)
class FirstRead:
    """How names are first read in the statements after a point (``first_read``): never again (``read`` False), by
    a norm call (``norm`` its dotted path, ``calls`` one per branch of an ``if``), or otherwise (``norm`` None;
    ``reason`` says why a norm call found first cannot stand in, if that is why)."""

    read: bool
    norm: str | None = None
    calls: tuple[ast.Call, ...] = ()
    reason: str | None = None


@dataclass
class LayerAnalysis:
    """Everything ``analysed`` finds in one parse of a layer forward: the plans of its add sites, its input norm's
    calls, the refusals. The plans hold that parse's nodes, which ``derived_rewrite`` rewrites in place."""

    plans: list[BeforePlan | GuardedPlan | AfterPlan | ArgumentPlan | OutputPlan | SublayerPlan] = field(
        default_factory=list)
    input_norm: FirstRead | None = None
    refusals: list[Refusal] = field(default_factory=list)
    inlining: derived_inline.Inlining = field(default_factory=derived_inline.Inlining)

    def code(self) -> LayerCode:
        norm = self.input_norm.norm if self.input_norm is not None else None
        return LayerCode(tuple(dict.fromkeys(plan.site for plan in self.plans)), norm, tuple(self.refusals))


# ------------------------------------------------------------------------------------- entry points


def module_calls(cls: type) -> frozenset[tuple[str, ...]]:
    """The attribute paths of the ``self.<path>(x)`` calls in ``cls``'s forward (empty when no forward may be
    derived from its source): the planner tells the analysis which of them are patched norms."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return frozenset()
    name = self_name(forward.node)
    return frozenset(path for node in ast.walk(forward.node) if (path := module_call(node, name)) is not None)


def sublayer_calls(cls: type) -> frozenset[tuple[str, ...]]:
    """The attribute paths of the ``self.<path>(...)`` calls in ``cls``'s forward binding their output to a name
    (alone or first in a tuple): the planner tells the analysis which reach sublayers whose output is an add."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return frozenset()
    name = self_name(forward.node)
    return frozenset(path for node in ast.walk(forward.node) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and node.value.args
                     and (path := attribute_path(node.value.func, name)) is not None)


def layer_code(cls: type, norms: frozenset[tuple[str, ...]],
               sublayers: frozenset[tuple[str, ...]] = frozenset()) -> LayerCode | str:
    """The add sites and input norm of ``cls``'s forward, whose calls of ``self.<path>`` for ``path`` in ``norms``
    are norms; or why no forward may be derived from its source."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return forward
    problem = signature_problem(forward.node)
    return problem or analysed(forward, forward.node, norms, sublayers).code()


def signature_problem(function: ast.FunctionDef) -> str | None:
    if len(function.args.args) < 2:
        return f"{function.name}({ast.unparse(function.args)}) does not take the hidden states positionally"
    return None


def analysed(forward: derived_source.ClassForward, function: ast.FunctionDef,
             norms: frozenset[tuple[str, ...]], sublayers: frozenset[tuple[str, ...]] = frozenset()) -> LayerAnalysis:
    """The analysis of ``function`` (a parse of ``forward``'s def of its own) given its patched norms, once the
    adds an ``if`` separates from their norms are moved into its branches (``derived_branches``), then its calls
    of residual add functions inlined (``derived_inline``: their fresh locals are plain; inlined last, so that the
    statements each inlined call guards stay where it put them)."""
    plain = plain_locals(forward.undecorated.__code__, function)
    sink_adds(function, norms, self_name(function), plain)
    inlining = derived_inline.inline_calls(forward, function)
    result = _Analysis(function, norms, plain | inlining.names, sublayers).result
    result.refusals[:0] = [Refusal(text) for text in inlining.refusals]
    result.inlining = inlining
    return result


def plain_locals(code: types.CodeType, function: ast.FunctionDef) -> frozenset[str]:
    """The names only the function's own statements can rebind: its locals (``code``'s, captured by a nested scope
    or not: reading them there changes nothing), but those a nested function rebinds (``nonlocal``), a
    comprehension binds (``:=`` binds the enclosing function's name) or the function declares ``global`` or
    ``nonlocal`` (none of its locals then)."""
    rebound = {name for node in ast.walk(function) if isinstance(node, (ast.Global, ast.Nonlocal))
               for name in node.names}
    rebound |= {target for node in ast.walk(function) if isinstance(node, COMPREHENSIONS)
                for target in walrus_targets(node)}
    return frozenset(code.co_varnames + code.co_cellvars) - rebound


# ------------------------------------------------------------------------------------- the analysis


class _Analysis:
    """Walks a layer forward's statements once, recording each pattern's plan, or its refusal (module
    docstring)."""

    def __init__(self, function: ast.FunctionDef, norms: frozenset[tuple[str, ...]], plain: frozenset[str],
                 sublayers: frozenset[tuple[str, ...]] = frozenset()) -> None:
        self.function, self.norms, self.plain, self.sublayers = function, norms, plain, sublayers
        self.self_name = self_name(function)
        self.up = parents(function)
        self.result = LayerAnalysis()
        self._block(function.body, None, ())
        self._drop_overlapping_sublayers()
        self._unchain_overlaps()
        self._input_norm()

    def _refuse(self, site: AddSite, reason: str) -> int:
        self.result.refusals.append(Refusal(f"{site.label} not fused: {reason}"))
        return 0

    def _block(self, statements: list[ast.stmt], after: ast.stmt | None, enclosing: tuple[str, ...]) -> None:
        """Looks at one statement list; ``after`` is the statement that runs once the list ends (the one after an
        ``if`` whose branch this is), for the output pattern; ``enclosing`` the ``try``/``with`` blocks around it
        (invariant 5)."""
        i = 0
        while i < len(statements):
            statement = statements[i]
            following = statements[i + 1] if i + 1 < len(statements) else after
            i += self._match(statements, i, after, enclosing) or 1
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # invariant 7
            if isinstance(statement, ast.If):
                self._block(statement.body, following, enclosing)
                self._block(statement.orelse, following, enclosing)
                continue
            inner = enclosing + tuple(kind for kind, types_ in (("try", (ast.Try, ast.TryStar)),
                                                                ("with", (ast.With, ast.AsyncWith)))
                                      if isinstance(statement, types_))
            for block in statement_blocks(statement):
                self._block(block, None, inner)

    def _norm(self, node: ast.AST) -> tuple[str, ...] | None:
        """The path of ``self.<path>(x)`` when it is one of the norms."""
        path = module_call(node, self.self_name)
        return path if path in self.norms else None

    def _match(self, statements: list[ast.stmt], i: int, after: ast.stmt | None,
               enclosing: tuple[str, ...]) -> int:
        """Records the pattern starting at ``statements[i]`` (``after`` runs once the list ends); returns how many
        statements it spans, 0 for none."""
        return (
            self._sublayer_output(statements, i, after, enclosing)
            or self._before_norm(statements, i, enclosing)
            or self._guarded_before(statements, i, enclosing)
            or self._after_norm(statements, i, enclosing)
            or self._output(statements, i, after, enclosing)
            or self._argument_sums(statements[i])
        )

    def _drop_overlapping_sublayers(self) -> None:
        """Drops the sublayer sites whose norm call another plan rewrites: AFMoE's MoE returns its experts' sum, which
        its ``post_mlp_layernorm`` reads, whose output the layer then adds to the residual (an ``after`` site). A norm
        call is fused with one add: the residual's, the site recorded before sublayers were read."""
        taken = {id(plan.statements[plan.dropped]) for plan in self.result.plans
                 if isinstance(plan, AfterPlan) and plan.dropped is not None}
        for plan in [p for p in self.result.plans if isinstance(p, SublayerPlan) and id(p.consumer) in taken]:
            self.result.plans.remove(plan)
            self._refuse(plan.site, "its norm's output goes into a residual add fused with that norm")

    def _unchain_overlaps(self) -> None:
        """Unchains the ``after`` sites whose consumer another plan rewrites (``y = F2(s); t = q + y`` is an
        ``after`` site of its own): each statement is rewritten by one plan."""
        rewritten = set()
        for plan in self.result.plans:
            if isinstance(plan, (BeforePlan, AfterPlan)):
                rewritten.add(id(plan.statements[plan.index]))
            if isinstance(plan, AfterPlan) and plan.dropped is not None:
                rewritten.add(id(plan.statements[plan.dropped]))
            if isinstance(plan, BeforePlan):
                rewritten.add(id(plan.consumer))
            if isinstance(plan, (ArgumentPlan, OutputPlan)):
                rewritten.add(id(plan.statement))
            if isinstance(plan, SublayerPlan):
                rewritten.update(id(s) for s in (plan.statements[plan.index], plan.consumer) if s is not None)
            if isinstance(plan, GuardedPlan):
                rewritten.update(id(s) for s in (plan.statements[plan.index], *plan.consumers))
        for plan in self.result.plans:
            if isinstance(plan, AfterPlan) and plan.consumer is not None and id(plan.consumer) in rewritten:
                plan.consumer = plan.next_call = None

    def _sublayer_output(self, statements: list[ast.stmt], i: int, after: ast.stmt | None,
                         enclosing: tuple[str, ...]) -> int:
        """``T = self.<path>(...)``, a sublayer whose output is its output add, read next by a norm of the layer
        as a ``before`` site's sum is, or returned as the layer's output (module docstring: "Sublayer outputs")."""
        statement = statements[i]
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.value, ast.Call)):
            return 0
        target, call = statement.targets[0], statement.value
        first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
        path = item_path(call.func, self.self_name)
        if path not in self.sublayers or not isinstance(first, ast.Name):
            return 0
        total = first.id
        read = self._norm_reading(statements, i, total, enclosing)
        if read is not None:
            consumer, norm_call, problem = read
            site = AddSite("before", self._norm(norm_call), statement.lineno, sublayer=path)
            if problem is not None:
                return self._refuse(site, problem)
            self.result.plans.append(SublayerPlan(site, statements, i, call, total, consumer, norm_call))
            return 1
        in_tuple = _returns(statements[i + 1] if i + 1 < len(statements) else after, total)
        if in_tuple is None:
            return 0
        site = AddSite("output", (), statement.lineno, in_tuple, sublayer=path)
        if "try" in enclosing:  # invariant 5
            return self._refuse(site, "it sits in a try block, whose finally could return something else")
        self.result.plans.append(SublayerPlan(site, statements, i, call, total))
        return 1

    def _argument_sums(self, statement: ast.stmt) -> int:
        """``F(a + b)`` in a simple statement, outside nested scopes (invariants 1 and 7)."""
        if not isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)):
            return 0
        found = 0
        for node in ast.walk(statement):
            if (self._norm(node) is not None and isinstance(node.args[0], ast.BinOp)
                    and isinstance(node.args[0].op, ast.Add) and deferred_by(node, statement, self.up) is None):
                site = AddSite("argument", self._norm(node), node.args[0].lineno)
                self.result.plans.append(ArgumentPlan(site, statement, node, node.args[0]))
                found = 1
        return found

    def _before_norm(self, statements: list[ast.stmt], i: int, enclosing: tuple[str, ...]) -> int:
        found = summed(statements[i])
        if found is None:
            return 0
        total, add = found
        read = self._norm_reading(statements, i, total, enclosing)
        if read is None:
            return 0
        consumer, call, problem = read
        site = AddSite("before", self._norm(call), add.lineno)
        if problem is not None:
            return self._refuse(site, problem)
        self.result.plans.append(BeforePlan(site, statements, i, add, total, consumer, call))
        return 1

    def _guarded_before(self, statements: list[ast.stmt], i: int, enclosing: tuple[str, ...]) -> int:
        """``s = a + b`` read next, past aliases, flattenings (``v = s.reshape(-1, s.size(-1))``) and sizes of it,
        by norms under ``if`` tests (module docstring: "Norms under tests")."""
        found = viewed_sum(statements[i])
        if found is None:
            return 0
        total, add, view = found
        names, bound = {total}, {total}
        consumers: list[tuple[ast.If, ast.Call]] = []
        returned = None
        for statement in statements[i + 1:]:
            if isinstance(statement, ast.Return) and isinstance(statement.value, ast.Name):
                returned = statement.value.id in names  # the layer returns the sum where no test holds
                break
            alias = assigned_name(statement)
            if alias is not None and isinstance(statement.value, ast.Name) and statement.value.id in names:
                names.add(alias)
            elif (alias := flattened(statement, names)) is not None:
                names.add(alias)
            elif (alias := shape_read(statement, names)) is not None and alias not in names:
                pass
            elif (call := self._guarded_norm(statement, names)) is not None:
                consumers.append((statement, call))
                continue
            else:
                break
            bound.add(alias)
        if not consumers:
            return 0
        paths = [self._norm(call) for _, call in consumers]
        if returned:
            site = AddSite("output", (), add.lineno, alternatives=tuple(paths))
        else:
            site = AddSite("guarded", paths[0], add.lineno, alternatives=tuple(paths[1:]))
        if enclosing:  # invariant 5
            return self._refuse(site, f"it sits in a {enclosing[-1]} block, which could go on after the norm raised "
                                      "and read the sum")
        reading = next((n.id for statement, _ in consumers for n in loads(statement.test, bound)), None)
        if reading is not None:  # invariant 9
            return self._refuse(site, f"a test reads {reading}, which the statements after the add bind")
        self.result.plans.append(GuardedPlan(site, statements, i, add, total, [c for c, _ in consumers],
                                             [call for _, call in consumers], view))
        return 1

    def _guarded_norm(self, statement: ast.stmt, names: set[str]) -> ast.Call | None:
        """``F(v)`` of ``if T: y = F(v)`` (nothing else in the ``if``), ``F`` a norm reached by attributes,
        ``v`` one of ``names``, ``T`` a test that only reads (``tests_reads``)."""
        if not (isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 1
                and tests_reads(statement.test) and assigned_name(statement.body[0]) is not None):
            return None
        call = statement.body[0].value
        if (self._norm(call) is None or item_path(call.func, self.self_name) != self._norm(call)
                or not (isinstance(call.args[0], ast.Name) and call.args[0].id in names)):
            return None
        return call

    def _norm_reading(self, statements: list[ast.stmt], i: int, total: str,
                      enclosing: tuple[str, ...]) -> tuple[ast.stmt, ast.Call, str | None] | None:
        """``(consumer, call, problem)`` where the sum ``total`` bound by ``statements[i]`` is read next, after
        aliases, by a norm call (``call``, in the statement ``consumer``); ``problem`` says which invariant forbids
        moving that call up to ``statements[i]`` (None: none does). None where no norm reads the sum so."""
        j = past_aliases(statements, i + 1, {total})
        if j == len(statements) or not isinstance(statements[j], (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
            return None
        consumer = statements[j]
        call = next((node for node in ast.walk(consumer) if self._norm(node)
                     and isinstance(node.args[0], ast.Name) and node.args[0].id == total), None)
        if call is None:
            return None
        if enclosing:  # invariant 5
            return consumer, call, (f"it sits in a {enclosing[-1]} block, which could go on after the norm raised "
                                    "and read the sum")
        where = deferred_by(call, consumer, self.up) or conditional_in(call, consumer, self.up)
        if where is not None:  # invariant 1
            return consumer, call, f"the norm call sits in {where}: it runs elsewhere than the statement, or not at all"
        running = next((e for e in evaluated_before(consumer, call) if not reads_only(e)), None)
        if running is not None:  # invariant 2
            return consumer, call, (f"line {consumer.lineno} evaluates {ast.unparse(running)} before the norm, "
                                    "which would then run first")
        return consumer, call, None

    def _chain(self, plan: AfterPlan, enclosing: tuple[str, ...]) -> None:
        """Chains the next norm to an ``after`` site whose sum it reads, where the ``before`` rules allow moving
        that norm's call up to the add (module docstring: "Two norms, one kernel"). Where they do not, the site
        stays an ``after`` site alone: nothing is refused, the add is fused all the same."""
        if plan.total is None:
            return
        read = self._norm_reading(plan.statements, plan.index, plan.total, enclosing)
        if read is not None and read[2] is None:
            plan.consumer, plan.next_call = read[0], read[1]

    def _after_norm(self, statements: list[ast.stmt], i: int, enclosing: tuple[str, ...]) -> int:
        # One statement: s = r + F(e) or s = F(e) + r.
        found = summed(statements[i])
        if found is not None:
            total, add = found
            for normed, residual in ((add.right, add.left), (add.left, add.right)):
                if self._norm(normed) is not None:
                    site = AddSite("after", self._norm(normed), add.lineno)
                    problem = self._residual_problem(residual, statements[i])
                    if problem is not None:
                        return self._refuse(site, problem)
                    plan = AfterPlan(site, statements, i, add, total, normed, residual)
                    self._chain(plan, enclosing)
                    self.result.plans.append(plan)
                    return 1
            return 0
        # Two statements: y = F(e); s = r + y (or return r + y).
        normed_name = assigned_name(statements[i])
        if normed_name is None or self._norm(statements[i].value) is None or i + 1 == len(statements):
            return 0
        second = statements[i + 1]
        found = summed(second) or ((None, returned_sum(second)) if returned_sum(second) is not None else None)
        if found is None:
            return 0
        total, add = found
        for normed, residual in ((add.right, add.left), (add.left, add.right)):
            if isinstance(normed, ast.Name) and normed.id == normed_name and not loads(residual, {normed_name}):
                site = AddSite("after", self._norm(statements[i].value), add.lineno)
                problem = (self._residual_problem(residual, second)
                           or self._binding_problem(normed_name, total, statements[i], second))
                if problem is not None:
                    return self._refuse(site, problem)
                plan = AfterPlan(site, statements, i + 1, add, total, statements[i].value, residual, dropped=i)
                self._chain(plan, enclosing)
                self.result.plans.append(plan)
                return 2
        return 0

    def _residual_problem(self, residual: ast.expr, statement: ast.stmt) -> str | None:
        """Invariant 3 for the residual of an ``after`` add, read at another moment than the original's."""
        if not isinstance(residual, ast.Name):
            return (f"its residual {ast.unparse(residual)} is no local name: read at another moment, it could "
                    "evaluate differently")
        if residual.id in walrus_targets(statement):
            return f"':=' in the statement rebinds its residual {residual.id}"
        if residual.id not in self.plain:
            return (f"its residual {residual.id} is rebound by a nested scope, or no local: code run in between "
                    "could rebind it")
        return None

    def _binding_problem(self, normed: str, total: str | None, first: ast.stmt, second: ast.stmt) -> str | None:
        """Invariant 6 for ``y = F(e); s = r + y``, which no longer binds ``y``: a read or a ``del`` of ``y``
        elsewhere could meet its previous binding, or none."""
        if normed == total:
            return None
        used = [n for n in named(self.function, normed) if not isinstance(n.ctx, ast.Store)]
        if normed not in self.plain or len(used) != len(loads(first, {normed})) + len(loads(second, {normed})):
            return f"{normed}, which the rewrite no longer binds, is read or deleted elsewhere in the forward"
        return None

    def _output(self, statements: list[ast.stmt], i: int, after: ast.stmt | None,
                enclosing: tuple[str, ...]) -> int:
        statement = statements[i]
        withdrawn: list[list[ast.stmt]] = []
        if (add := returned_sum(statement)) is not None:
            in_tuple = False
        elif (found := summed(statement)) is not None:
            total, add = found
            in_tuple = _returns(statements[i + 1] if i + 1 < len(statements) else after, total)
            tupled = assigned_name(statements[i + 1]) if i + 2 < len(statements) else None
            if in_tuple is None and tupled is not None and _prepends(statements[i + 1].value, total):
                in_tuple = True if _returns(statements[i + 2], tupled) is False else None
            if in_tuple is None and i + 1 < len(statements):  # s = a + b; if <test>: ...; return s
                branching = statements[i + 1]
                if isinstance(branching, ast.If) and compares_reads(branching.test):
                    in_tuple = _returns(statements[i + 2] if i + 2 < len(statements) else after, total)
                    withdrawn = [branch for branch in (branching.body, branching.orelse) if branch]
            if in_tuple is None:
                return 0
        else:
            return 0
        if any(isinstance(operand, (ast.Tuple, ast.List)) for operand in (add.left, add.right)):
            return 0  # a concatenation of sequences, no tensor add
        site = AddSite("output", (), add.lineno, in_tuple)
        if "try" in enclosing:  # invariant 5
            return self._refuse(site, "it sits in a try block, whose finally could return something else")
        self.result.plans.append(OutputPlan(site, statement, add, withdrawn))
        return 1

    def _input_norm(self) -> None:
        """The norm the forward applies to its input before anything could touch it (invariants 1 and 3)."""
        argument = self.function.args.args[1].arg
        found = first_read(self.function.body, {argument}, self.self_name, self.norms, self.up)
        if found.reason is not None:
            self.result.refusals.append(Refusal(f"the norm of the input {argument} does not take the previous "
                                                f"layer's normed output: {found.reason}"))
        self.result.input_norm = found if found.norm is not None else None


def _returns(statement: ast.stmt | None, name: str) -> bool | None:
    """Whether ``statement`` is ``return name, ...`` or ``return (name, ...) + rest`` (True: the stack takes the
    first item), ``return name`` (False), or neither (None)."""
    if not isinstance(statement, ast.Return):
        return None
    if _prepends(statement.value, name):
        return True
    value, in_tuple = statement.value, isinstance(statement.value, ast.Tuple)
    if in_tuple and value.elts:
        value = value.elts[0]
    return in_tuple if isinstance(value, ast.Name) and value.id == name else None


def _prepends(value: ast.expr | None, name: str) -> bool:
    """Whether ``value`` is ``(name, ...) + rest``, the other items and ``rest`` only reading and naming ``name``
    nowhere: a tuple whose first item is the sum (UMT5's and LongT5's sublayers append their attention outputs so,
    as ``o = (s, ...) + rest`` or ``return (s, ...) + rest``)."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) and isinstance(value.left, ast.Tuple)
            and value.left.elts and isinstance(value.left.elts[0], ast.Name) and value.left.elts[0].id == name):
        return False
    return all(reads_only(e) and not named(e, name) for e in (*value.left.elts[1:], value.right))


# ------------------------------------------------------------------------------------- the first read


def first_read(statements: list[ast.stmt], names: set[str], self_name_: str,
               norms: frozenset[tuple[str, ...]] | None, up: dict[int, ast.AST]) -> FirstRead:
    """Follows ``names`` (a value's names: the input and its aliases ``r = x``) through ``statements``: a norm
    first reads them when the first statement naming them reads them once, as the argument of ``self.<norm>(x)``
    or ``self.<norm>(x.to(...))`` (any module call when ``norms`` is None), anywhere in that statement but a nested
    scope (invariant 1): nothing evaluated before it can reach the value; or, for an ``if`` that does not read them
    in its test, when a branch begins so with a norm and the other begins so with the same norm or reads them
    otherwise (Falcon's ``ln_attn`` and ``ln_mlp``, or its ``input_layernorm``). Only the norm's call is replaced
    by what a previous layer hands on; the other branch reads the value itself, as the original does. Unread when
    nothing names them, or a statement rebinds the one name without reading it (its value can no longer reach
    anything). A statement that only copies them into a slice of another tensor (``out[...] = x``) does not count:
    it cannot change them."""
    for statement in statements:
        if isinstance(statement, ast.If) and not loads(statement.test, names):
            branches = [first_read(b, set(names), self_name_, norms, up) for b in (statement.body, statement.orelse)]
            if not any(branch.read for branch in branches):
                continue
            problem = next((b for b in branches if b.reason is not None), None)
            normed = {b.norm for b in branches if b.norm is not None}
            if problem is not None or len(normed) != 1:
                return problem or FirstRead(True)
            return FirstRead(True, normed.pop(), branches[0].calls + branches[1].calls)
        occurrences = [n for name in names for n in named_outside_tuples([statement], name)]
        if not occurrences or _copies_out(statement, names):
            continue
        uses = [n for n in occurrences if isinstance(n.ctx, ast.Load)]
        if not uses and len(names) == 1:
            return FirstRead(False)
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Name) and assigned_name(statement):
            names.add(assigned_name(statement))
            continue
        if len(uses) != 1 or len(occurrences) != 1 + sum(id(n) in _store_ids(statement) for n in occurrences):
            return FirstRead(True)
        calls = [node for node in ast.walk(statement) if (path := module_call(node, self_name_)) is not None
                 and (norms is None or path in norms) and _read_name(node.args[0]) is uses[0]]
        if not calls:
            return FirstRead(True)
        where = deferred_by(calls[0], statement, up)
        if where is not None:
            return FirstRead(True, reason=f"the norm call at line {calls[0].lineno} sits in {where}, which may run "
                                          "after the value is rebound")
        return FirstRead(True, ".".join(module_call(calls[0], self_name_)), (calls[0],))
    return FirstRead(False)


def named_outside_tuples(statements: list[ast.stmt], name: str) -> list[ast.Name]:
    """The occurrences of ``name`` in ``statements``, but for the elements of a tuple display (recording the hidden
    states, ``all_hidden_states + (h,)``, neither changes them nor lets anything else reach them)."""
    module = ast.Module(body=statements, type_ignores=[])
    in_tuples = {id(e) for n in ast.walk(module) if isinstance(n, ast.Tuple) and isinstance(n.ctx, ast.Load)
                 for e in n.elts}
    return [n for n in named(module, name) if id(n) not in in_tuples]


def _read_name(argument: ast.expr) -> ast.expr:
    """``x`` for ``x`` or ``x.to(...)`` (the same values when the conversion changes neither dtype nor device:
    ``handoff.input_norm`` checks that before it returns a handed-on norm of ``x``)."""
    if isinstance(argument, ast.Call) and isinstance(argument.func, ast.Attribute) and argument.func.attr == "to":
        return argument.func.value
    return argument


def _copies_out(statement: ast.stmt, names: set[str]) -> bool:
    """``out[...] = x`` with ``x`` one of ``names`` and ``out`` none of them."""
    return (
        isinstance(statement, ast.Assign) and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Subscript) and isinstance(statement.value, ast.Name)
        and statement.value.id in names and not loads(statement.targets[0], names)
    )


def _store_ids(statement: ast.stmt) -> set[int]:
    """The names an assignment statement binds (its targets)."""
    targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
    return {id(n) for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
