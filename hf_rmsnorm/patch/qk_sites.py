"""Where an attention forward normalises its query and key heads and then applies its rotary embedding
(``qk_site``), and why running the two norms and the RoPE as one ``qk_norm_rope`` launch at the RoPE's statement
(``qk_attention.py``) cannot change what the forward computes.

The pattern, in the attention's own names (``N`` is ``self.<path>``, a patched norm, called with one argument;
``OPS`` is a chain of ``.view(...)`` and ``.transpose(1, 2)``, possibly empty, possibly split over statements
``Q = OPS(Q)``; ``F`` a global function)::

    Q = OPS_q(self.q_norm(A_q))          ->  _hf_rmsnorm_q = A_q
    K = OPS_k(self.k_norm(A_k))          ->  _hf_rmsnorm_k = A_k
    ... other statements ...                 ... (the same) ...
    Q, K = F(Q, K, C, S)                 ->  Q, K = norm_rope(self, self.q_norm, self.k_norm, F, _hf_rmsnorm_q,
                                                               _hf_rmsnorm_k, C, S, <view args>)

Qwen3 writes ``self.q_norm(proj.view(shape)).transpose(1, 2)`` (a norm per head), Gemma 3 ``Q = self.q_norm(Q)`` on
the heads already transposed (per head), OLMo 2 ``Q = self.q_norm(proj)`` then ``Q = Q.view(shape).transpose(1,
2)`` (one norm over all of a token's heads). ``norm_rope`` (``qk_runtime.py``) checks at every call that the kernel
computes what the original statements did (below) and runs ``qk_norm_rope``; otherwise it evaluates them: the norms
on their inputs, ``OPS``, then ``F``.

**Why the rewrite computes what it replaces.** The kernel computes, for each of q and k, the norm over each row of
its input followed by ``rotate_half`` RoPE; the rewrite is exact when (a) the values the norms and ``F`` would
read at their new moment (the RoPE's statement) are those they read at the original one, with nothing observing
the difference, (b) ``OPS`` only rearranges the rows the kernel normalises, and (c) ``F`` computes the kernel's RoPE
(the probe, ``qk_probe.py``). The argument takes Python's semantics and four facts of the models: looking up
``self.<path>`` runs no code of the model; a norm does not change its argument; a module called (its forward) changes
neither its arguments nor another module's parameters; ``view`` and ``transpose`` return views, which compute
nothing. Each invariant below is checked; a forward breaking one keeps its norms and RoPE as written, and the report
says which (``tests/patch/test_qk_attention.py`` breaks each with a toy attention).

1. *The forward's own statements.* The norm statements, the statements ``Q = OPS(Q)`` and the RoPE statement are
   statements of the forward's body itself, not inside an ``if`` (but for invariants 6's and 7's), loop, ``try`` or
   ``with`` (where they may not run, run again, or be observed by a handler after an exception), and
   ``self.q_norm(...)`` is the value of its statement (after ``OPS``): nothing else of that statement runs after the
   norm.
2. *Nothing in between reads or rebinds the values.* Between the first norm statement and the RoPE call, ``Q`` and
   ``K`` (which no longer hold the normed values) are read by nothing but ``OPS`` statements and the RoPE call, and
   the names the whole-projection ``view`` reads, read again at the RoPE's statement, are plain locals nothing in
   between rebinds.
3. *Nothing in between runs other code.* Each other statement in between is an assignment to names of a value that
   only reads (names, constants, attributes, items), calls modules ``self.<path>(...)`` on such values, or takes views
   of them (``view``, ``transpose``, ``reshape``): no function of unknown effect, so the norms' inputs, weights and
   eps are at the RoPE's statement what they were at the norms' (a module does not change another's parameters), and
   an exception one of them raises leaves what the original left (no norm had anything to leave). The modules called
   there are guarded like the norms: a hook on one runs the original forward (``qk_runtime``).
4. *The rows the kernel normalises.* The norm's output reaches ``F`` through ``OPS`` = nothing or ``.transpose(1,
   2)`` (a norm over the last dimension of a 4-D tensor: a norm per head; transposing dimensions 1 and 2 keeps each
   head's row), or ``.view(...).transpose(1, 2)`` (a norm over the last dimension of a 3-D tensor, viewed into
   heads: a norm over all of a token's heads, when the view keeps the first two dimensions, which ``norm_rope``
   checks with the dimension counts).
5. *The RoPE is the model's function.* ``F`` is a name the forward's module defines (a global, not a local), called
   with the four positional arguments ``Q, K, C, S`` and bound back to ``Q, K``. At every call ``norm_rope`` checks
   that the ``F`` the statement evaluated is the function probed when patching, with the code and module-level
   functions it had then.
6. *A RoPE under an ``if``.* The RoPE statement may instead be the last statement of the body of an ``if`` of the
   forward's body that has no ``else``: the layers that skip the RoPE (EXAONE 4's global layers, ``if
   self.sliding_window is None or self.is_sliding:``; AFMoE's, Flint's and OLMo-hybrid's alike). Its test only
   reads and tests or compares what it reads (``derived_syntax.tests_reads``: no call of the model's code) and
   reads neither ``Q`` nor ``K``; the body's statements before the RoPE are statements in between (invariant 3)
   naming neither. The rewrite gives the ``if`` an ``else`` running the norms and ``OPS`` alone
   (``qk_runtime.norms_apart``). Where the test holds, the forward runs the site as above; where it does not, it
   computes what the original computed: the norms run after the test instead of before it, and the test reads
   nothing they compute, changes nothing they read, and an exception it raises leaves what the original left (no
   norm had anything to leave), as for the statements in between.
7. *A site split at an ``if``* (``_split_site``). Where the last ``if`` of the forward's body before the RoPE
   statement names ``Q`` or ``K`` (and has no ``else``), the statements after it up to the RoPE's are moved into
   both its blocks: ``if T: B`` then ``R`` is ``if T: B; R`` ``else: R``, the same code (statements run in the same
   order with the same values whatever ``T`` gives, a ``return`` or ``raise`` in ``B`` skipping ``R`` as before).
   The site is then sought, under invariants 1 to 5, among the statements one of the two blocks runs:

   - *The norms under the ``if``* (GLM-4.5, Sarvam: ``if self.use_qk_norm:`` holding both norm statements, the
     transposes and the RoPE after it): in its body, ``B`` then ``R``; the ``else`` runs ``R`` as written (no norm to
     fuse). Nothing moves across the test.
   - *An ``if`` the site skips* (OLMoE: ``if self.config.clip_qkv is not None:`` clamping the normed values in place
     between the norms and the RoPE): in its ``else``, both norm statements before the ``if``; its test reads and
     compares only (``tests_reads``) and names neither ``Q`` nor ``K``. The body first runs the norm statements and
     ``Q = OPS(Q)`` before the ``if`` as written but for the norms' arguments, taken at their own statements (as the
     site takes them), then ``B`` and ``R`` as written. Both blocks run the norms after the test instead of before
     it, which holds as in invariant 6; the body runs them after the statements in between before the ``if`` too,
     which holds as in invariant 3.

**One tensor at a time** (``one_sites``). Gemma 3n and Gemma 4 normalise and rotate the queries and the keys each on
its own, with a RoPE function of one tensor, the keys under the KV-sharing ``if``::

    X = self.x_norm(A)                               ->  X = norm_rope_one(self.x_norm, A, F, C, S, self)
    X = F(X, C, S, unsqueeze_dim=2)                  ->  pass

Each such pair of statements is a site (``OneSite``) where: both are statements of one block of the forward's body
or of the bodies of its ``if`` statements (no loop, which could run them again with other values bound, no ``try``,
whose handler could see ``X`` normed and not yet rotated after an exception), the RoPE statement right after the
norm's; the norm is a patched norm called with one argument ``A`` (binding no name), its output named ``X`` and
given at once as ``F``'s first argument; ``F`` a global of the module (invariant 5), called with ``X``, two
arguments ``C`` and ``S`` that only read and do not read ``X``, and the keyword ``unsqueeze_dim=2`` alone: ``X`` is
``[batch, tokens, heads, head_dim]``, its norm per head, and ``F`` broadcasts ``cos`` over the heads. The rewrite
evaluates ``self.x_norm`` and ``A`` first, as the norm statement does, then ``F``, ``C`` and ``S``, which the
original evaluates after the norm's call: that call changes none of them (a norm changes nothing but its output) and
nothing runs in between. ``norm_rope_one`` (``qk_runtime``) makes the checks ``norm_rope`` makes, and runs the one
norm and the RoPE as ``qk_norm_rope`` of ``X`` with no key heads; otherwise the two statements as written. ``F``
passes the probe as a function of one tensor (``qk_probe.probe_one_tensor_rope``).

**The RoPE before the norms** (``rope_first_site``). NanoChat and HunYuan rotate the query and key heads, then
normalise them::

    Q, K = F(Q, K, C, S)                 ->  Q, K = rope_norm(self, self.q_norm, self.k_norm, F, Q, K, C, S)
    Q = self.q_norm(Q)                   ->  pass
    K = self.k_norm(K)                   ->  pass

The site is three consecutive statements of one block of the forward's body or of the bodies of its ``if``
statements (no loop, no ``try``: as for the one-tensor sites): the RoPE statement of invariant 5's form, then, in
either order, ``Q = self.q_norm(Q)`` and ``K = self.k_norm(K)``, two different patched norms each called with the
RoPE's output as its one argument (each a norm per head: ``Q`` is ``[batch, heads, tokens, head_dim]``, which
``rope_norm`` checks). The rewrite evaluates ``self.q_norm`` and ``self.k_norm`` before ``F``'s call instead of
after it: looking them up runs no code of the model, and ``F`` (the probed function, invariant 5) changes no module.
Nothing else runs in between, nothing reads the rotated, unnormalised ``Q`` and ``K``, and an exception ``F`` or a
norm raises leaves what the original left (``rope_norm`` runs them as written where it does not fuse).
``rope_norm`` (``qk_runtime``) checks what ``norm_rope`` checks and runs ``qk_rope_norm``.
"""

from __future__ import annotations

import ast
import copy
import types
from dataclasses import dataclass

from . import derived_source
from .derived_sites import plain_locals
from .derived_syntax import (
    assigned_name,
    attribute_path,
    located,
    module_call,
    named,
    reads_only,
    self_name,
    tests_reads,
)

# The methods whose calls only take views, allowed in the statements between the norms and the RoPE (invariant 3).
_VIEW_METHODS = frozenset({"view", "transpose", "reshape"})
TRANSPOSE, VIEW = "transpose", "view"
# The layouts of invariant 4: what may follow each norm (``OPS``), and whether the norm is per head.
LAYOUTS = {(): True, (TRANSPOSE,): True, (VIEW, TRANSPOSE): False}
# The ``if`` of a site (``QKSite.branch_role``): its body ends with the RoPE (invariant 6), or the site is split at
# it (invariant 7), its body holding the norms or skipped where the site fuses; each as the label says it.
ROPE_UNDER_IF, NORMS_UNDER_IF, SKIPPED_IF = "rope", "norms", "skipped"
BRANCH_ROLES = {ROPE_UNDER_IF: "under the if at line", NORMS_UNDER_IF: "with the norms, under the if at line",
                SKIPPED_IF: "where the if does not run its body, at line"}
# Why a forward has no site of the other order (``rope_first_site``), said after why it has none of the first.
NO_ROPE_FIRST = ("and no statement Q, K = F(Q, K, cos, sin) is directly followed by Q = self.q_norm(Q) and K = "
                 "self.k_norm(K) in a block of the forward's body or of its if statements (the RoPE before the norms)")


@dataclass(frozen=True)
class QKSite:
    """A q/k norm + RoPE site of an attention forward: the norms' attribute paths, the RoPE function's global name,
    the RoPE statement's line, whether the norms are per head (else over a token's heads together), ``OPS`` after
    each norm (``LAYOUTS``' keys), the paths of the modules called between the norms and the RoPE (guarded
    as the norms are), the line of the ``if`` whose body runs the RoPE (invariant 6) or that the site is split at
    (invariant 7; None: no ``if``) and which (``BRANCH_ROLES``' keys)."""

    q_norm: tuple[str, ...]
    k_norm: tuple[str, ...]
    rope: str
    line: int
    per_head: bool
    q_ops: tuple[str, ...]
    k_ops: tuple[str, ...]
    between: tuple[tuple[str, ...], ...]
    branch_line: int | None = None
    branch_role: str | None = None

    @property
    def label(self) -> str:
        over = "per head" if self.per_head else "over each token's heads"
        under = "" if self.branch_line is None else f" ({BRANCH_ROLES[self.branch_role]} {self.branch_line})"
        return (f"{'.'.join(self.q_norm)}, {'.'.join(self.k_norm)} ({over}) and {self.rope} at line {self.line}"
                f"{under}")


@dataclass(frozen=True)
class OneSite:
    """A norm + RoPE site of one tensor (``one_sites``): the norm's attribute path, the RoPE function's global name,
    the RoPE statement's line."""

    norm: tuple[str, ...]
    rope: str
    line: int

    @property
    def label(self) -> str:
        return f"{'.'.join(self.norm)} (per head) and {self.rope} at line {self.line}"


@dataclass(frozen=True)
class RopeFirstSite:
    """A RoPE + q/k norms site (``rope_first_site``): the norms' attribute paths, the RoPE function's global name,
    the RoPE statement's line, and whether the queries' norm statement comes first (the order ``qk_runtime``
    calls the norms in where the site does not fuse)."""

    q_norm: tuple[str, ...]
    k_norm: tuple[str, ...]
    rope: str
    line: int
    q_first: bool

    @property
    def label(self) -> str:
        return f"{self.rope} at line {self.line}, then {'.'.join(self.q_norm)}, {'.'.join(self.k_norm)} (per head)"


@dataclass(eq=False)
class RopeFirstPlan:
    """``RopeFirstSite`` and the block holding its statements: the RoPE's at ``index``, the norms' after it."""

    site: RopeFirstSite
    block: list[ast.stmt]
    index: int


@dataclass(eq=False)
class OnePlan:
    """``OneSite`` and the block holding its statements: the norm's at ``index``, the RoPE's after it."""

    site: OneSite
    block: list[ast.stmt]
    index: int


@dataclass(eq=False)
class _Chain:
    """How one of ``Q``/``K`` reaches the RoPE: its norm statement (index), the norm call, ``OPS`` (kinds and the
    ``view``'s call node, if any), and the indices of its ``Q = OPS(Q)`` statements."""

    index: int
    call: ast.Call
    ops: tuple[str, ...]
    view: ast.Call | None
    view_index: int
    dropped: tuple[int, ...]


@dataclass(eq=False)
class SitePlan:
    """``QKSite`` and the nodes of the parse it was found in, which ``qk_attention`` rewrites in place:
    ``statements`` the forward's body, ``rope_index`` the index there of the RoPE statement or of the ``if``
    (``branch``) one of whose blocks (``arm``) ends with it. The chains' indices count the statements as the site runs
    them: ``statements`` up to ``rope_index``, then ``arm``'s (``slot``)."""

    site: QKSite
    statements: list[ast.stmt]
    rope_index: int
    q: _Chain
    k: _Chain
    branch: ast.If | None
    arm: list[ast.stmt] | None

    @property
    def rope_statement(self) -> ast.Assign:
        return self.arm[-1] if self.arm is not None else self.statements[self.rope_index]

    def slot(self, index: int) -> tuple[list[ast.stmt], int]:
        """The block holding the site's ``index``-th statement, and its index there."""
        if self.arm is not None and index >= self.rope_index:
            return self.arm, index - self.rope_index
        return self.statements, index


def module_calls(cls: type) -> frozenset[tuple[str, ...]]:
    """The attribute paths of the ``self.<path>(x)`` calls of ``cls``'s forward (empty when its source cannot be
    derived from): the planner tells ``qk_site`` which of them are patched norms."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return frozenset()
    name = self_name(forward.node)
    return frozenset(path for node in ast.walk(forward.node) if (path := module_call(node, name)) is not None)


def qk_site(forward: derived_source.ClassForward, function: ast.FunctionDef,
            norms: frozenset[tuple[str, ...]]) -> SitePlan | str:
    """The q/k norm + RoPE site of ``function`` (a parse of ``forward``'s def of its own) whose norm calls are
    ``self.<path>`` for ``path`` in ``norms``; or why there is none (the first invariant broken). A site split at an
    ``if`` (invariant 7) leaves ``function``'s body with the statements after that ``if`` moved into its two blocks."""
    statements = function.body
    me = self_name(function)
    plain = plain_locals(forward.undecorated.__code__, function)
    reasons = []
    for r, statement in enumerate(statements):
        branch = statement if isinstance(statement, ast.If) and not statement.orelse else None
        rope = _rope_call(branch.body[-1] if branch is not None else statement, forward.undecorated.__code__)
        if rope is None:
            continue
        found = _site_at(statements, r, rope, me, norms, plain, branch, branch and ROPE_UNDER_IF)
        split = _split_site(function, r, rope, me, norms, plain) if isinstance(found, str) and not branch else None
        if split is not None:
            found = split if isinstance(split, SitePlan) else f"{found}; split at an if: {split}"
        if isinstance(found, SitePlan):
            return found
        reasons.append(f"line {statement.lineno}: {found}")
    if reasons:
        return "; ".join(reasons)
    return ("no statement Q, K = F(Q, K, cos, sin) of a global F follows the q/k norms at the forward's top level "
            "or at the end of an if's body there (invariants 1, 5, 6)")


def one_sites(forward: derived_source.ClassForward, function: ast.FunctionDef,
              norms: frozenset[tuple[str, ...]]) -> list[OnePlan]:
    """The one-tensor sites of ``function`` (a parse of ``forward``'s def of its own) whose norm calls are
    ``self.<path>`` for ``path`` in ``norms``, in source order."""
    me = self_name(function)
    code = forward.undecorated.__code__
    return [plan for block in _if_blocks(function.body) for i in range(len(block) - 1)
            if (plan := _one_site_at(block, i, me, norms, code)) is not None]


def rope_first_site(forward: derived_source.ClassForward, function: ast.FunctionDef,
                    norms: frozenset[tuple[str, ...]]) -> RopeFirstPlan | None:
    """The RoPE + q/k norms site of ``function`` (a parse of ``forward``'s def of its own) whose norm calls are
    ``self.<path>`` for ``path`` in ``norms``; None if it has none (or more than one)."""
    me = self_name(function)
    code = forward.undecorated.__code__
    plans = [plan for block in _if_blocks(function.body) for i in range(len(block) - 2)
             if (plan := _rope_first_at(block, i, me, norms, code)) is not None]
    return plans[0] if len(plans) == 1 else None


def _rope_first_at(block: list[ast.stmt], i: int, me: str, norms: frozenset[tuple[str, ...]],
                   code: types.CodeType) -> RopeFirstPlan | None:
    rope = _rope_call(block[i], code)
    if rope is None:
        return None
    name, q_name, k_name = rope
    paths: dict[str, tuple[str, ...]] = {}  # in the order of the norm statements
    for statement in block[i + 1:i + 3]:
        target = assigned_name(statement)
        call = statement.value if target is not None else None
        path = module_call(call, me) if isinstance(call, ast.Call) else None
        if (path is None or path not in norms or target in paths or target not in (q_name, k_name)
                or not isinstance(call.args[0], ast.Name) or call.args[0].id != target):
            return None
        paths[target] = path
    if paths[q_name] == paths[k_name]:
        return None
    site = RopeFirstSite(paths[q_name], paths[k_name], name, block[i].lineno, next(iter(paths)) == q_name)
    return RopeFirstPlan(site, block, i)


def _if_blocks(block: list[ast.stmt]) -> list[list[ast.stmt]]:
    """``block`` and the bodies and ``else`` blocks of its ``if`` statements, theirs in turn."""
    blocks = [block]
    for statement in block:
        if isinstance(statement, ast.If):
            blocks += _if_blocks(statement.body) + (_if_blocks(statement.orelse) if statement.orelse else [])
    return blocks


def _one_site_at(block: list[ast.stmt], i: int, me: str, norms: frozenset[tuple[str, ...]],
                 code: types.CodeType) -> OnePlan | None:
    norm_statement, rope_statement = block[i], block[i + 1]
    name = assigned_name(norm_statement)
    path = module_call(norm_statement.value, me) if name is not None else None
    if path is None or path not in norms or assigned_name(rope_statement) != name:
        return None
    if any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) for n in ast.walk(norm_statement.value)):
        return None
    call = rope_statement.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 3
            and isinstance(call.args[0], ast.Name) and call.args[0].id == name
            and call.func.id not in code.co_varnames + code.co_cellvars + code.co_freevars):
        return None
    if not (len(call.keywords) == 1 and call.keywords[0].arg == "unsqueeze_dim"
            and isinstance(call.keywords[0].value, ast.Constant) and type(call.keywords[0].value.value) is int
            and call.keywords[0].value.value == 2):
        return None
    for table in call.args[1:]:
        if not reads_only(table) or any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(table)):
            return None
    return OnePlan(OneSite(path, call.func.id, rope_statement.lineno), block, i)


def _rope_call(statement: ast.stmt, code: types.CodeType) -> tuple[str, str, str] | None:
    """``(F, Q, K)`` for ``Q, K = F(Q, K, C, S)`` with ``F`` a global name (no local of the forward)."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Tuple) and len(statement.targets[0].elts) == 2):
        return None
    value, targets = statement.value, statement.targets[0].elts
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and len(value.args) == 4
            and not value.keywords and not any(isinstance(a, ast.Starred) for a in value.args)):
        return None
    q, k = value.args[:2]
    if not all(isinstance(n, ast.Name) for n in (q, k, *targets)) or [t.id for t in targets] != [q.id, k.id]:
        return None
    if q.id == k.id or value.func.id in code.co_varnames + code.co_cellvars + code.co_freevars:
        return None
    return value.func.id, q.id, k.id


def _split_site(function: ast.FunctionDef, r: int, rope: tuple[str, str, str], me: str,
                norms: frozenset[tuple[str, ...]], plain: frozenset[str]) -> SitePlan | str | None:
    """The site whose RoPE is ``function.body[r]``, split at the last ``if`` before it naming ``Q`` or ``K``
    (invariant 7): the statements after that ``if`` up to the RoPE go into both its blocks; a site is then sought in
    the one without the ``if``'s own statements when the ``if`` calls no norm (``SKIPPED_IF``), in its body
    otherwise (``NORMS_UNDER_IF``). None when there is no such ``if``."""
    body = function.body
    for i in range(r - 1, -1, -1):
        guard = body[i]
        if isinstance(guard, ast.If) and _names(guard, rope[1:]):
            break
    else:
        return None
    if guard.orelse:
        return f"line {guard.lineno}: the if naming {' or '.join(rope[1:])} before the RoPE has an else (invariant 7)"
    rest = body[i + 1:r + 1]
    if any(module_call(node, me) in norms for node in ast.walk(guard)):
        role, branch = NORMS_UNDER_IF, ast.If(guard.test, guard.body + rest, copy.deepcopy(rest))
    else:
        role, branch = SKIPPED_IF, ast.If(guard.test, guard.body + copy.deepcopy(rest), rest)
    candidate = body[:i] + [located(branch, guard)] + body[r + 1:]
    found = _site_at(candidate, i, rope, me, norms, plain, branch, role)
    if isinstance(found, SitePlan):
        function.body = candidate
    return found


def _names(node: ast.AST, names: tuple[str, ...]) -> list[str]:
    return sorted(name for name in set(names) if named(node, name))


def _site_at(body: list[ast.stmt], index: int, rope: tuple[str, str, str], me: str,
             norms: frozenset[tuple[str, ...]], plain: frozenset[str], branch: ast.If | None,
             role: str | None) -> SitePlan | str:
    """The site whose RoPE is ``body[index]``, or the last statement of a block of ``branch`` (``body[index]``,
    its body but for ``SKIPPED_IF``); the checks run on the statements as they run up to the RoPE (``statements``),
    the branch's test and the norms' place apart (invariants 6, 7)."""
    name, q_name, k_name = rope
    arm = None if branch is None else branch.orelse if role == SKIPPED_IF else branch.body
    statements = body[:index] + (arm if arm is not None else [body[index]])
    r = len(statements) - 1
    if branch is not None and role != NORMS_UNDER_IF:
        problem = _branch_problem(branch, (q_name, k_name), role)
        if problem is not None:
            return problem
    chains = []
    for value in (q_name, k_name):
        chain = _chain(statements, r, value, me, norms)
        if isinstance(chain, str):
            return chain
        chains.append(chain)
    q, k = chains
    if (role == NORMS_UNDER_IF and min(q.index, k.index) < index
            or role == SKIPPED_IF and max(q.index, k.index) >= index):
        where = "outside" if role == NORMS_UNDER_IF else "after"
        return f"line {branch.lineno}: a norm is {where} the if naming {q_name} or {k_name} (invariant 7)"
    q_norm, k_norm = module_call(q.call, me), module_call(k.call, me)
    if q_norm == k_norm:
        return f"{q_name} and {k_name} go through the same norm self.{'.'.join(q_norm)}"
    if q.ops not in LAYOUTS or k.ops not in LAYOUTS or LAYOUTS[q.ops] != LAYOUTS[k.ops]:
        return (f"the norms' outputs reach {name} through {'.'.join(q.ops) or 'nothing'} and "
                f"{'.'.join(k.ops) or 'nothing'}: not the per-head or whole-projection layouts of the kernel "
                "(invariant 4)")
    first = min(q.index, k.index)
    chain_statements = {q.index, k.index, *q.dropped, *k.dropped}
    between: list[tuple[str, ...]] = []
    for j in range(first + 1, r):
        if j in chain_statements:
            continue
        problem = _between_problem(statements[j], me, between)
        if problem is not None:
            return f"line {statements[j].lineno} {problem}"
    later, other = (k, q_name) if k.index > q.index else (q, k_name)
    argument = later.call.args[0]
    if any(isinstance(n, ast.Name) and n.id == other for n in ast.walk(argument)):
        return f"line {statements[later.index].lineno}'s norm reads {other}, no longer normed (invariant 2)"
    if not _only_views_and_modules(argument, me, between):
        return (f"line {statements[later.index].lineno} evaluates {ast.unparse(argument)} after the first norm: more "
                "than module calls and views (invariant 3)")
    for chain in (q, k):
        problem = _view_names_problem(statements, chain, r, plain)
        if problem is not None:
            return problem
    site = QKSite(q_norm, k_norm, name, statements[r].lineno, LAYOUTS[q.ops], q.ops, k.ops,
                  tuple(dict.fromkeys(between)), None if branch is None else branch.lineno, role)
    return SitePlan(site, body, index, q, k, branch, arm)


def _branch_problem(branch: ast.If, names: tuple[str, str], role: str) -> str | None:
    """Invariants 6 and 7 for an ``if`` whose test the norms move across: its test reads and compares only and does
    not name ``Q`` or ``K``, nor (invariant 6) do the body's statements before the RoPE, which are checked as the
    statements in between are, too."""
    if not tests_reads(branch.test):
        where = "the RoPE runs under" if role == ROPE_UNDER_IF else "the norms would move across"
        return (f"line {branch.lineno}: {where} a test that does more than read and compare "
                f"(invariant {6 if role == ROPE_UNDER_IF else 7})")
    for node in (branch.test, *(branch.body[:-1] if role == ROPE_UNDER_IF else ())):
        named = _names(node, names)
        if named:
            where = "the if around the RoPE names" if role == ROPE_UNDER_IF else "the if's test names"
            return (f"line {node.lineno}: {where} {', '.join(named)} before it "
                    f"(invariant {6 if role == ROPE_UNDER_IF else 7})")
    return None


def _chain(statements: list[ast.stmt], r: int, value: str, me: str,
           norms: frozenset[tuple[str, ...]]) -> _Chain | str:
    """How ``value`` reaches the RoPE at ``statements[r]``: back through ``value = OPS(value)`` statements to
    ``value = OPS(self.<norm>(A))``; statements naming ``value`` otherwise are refused (invariants 1, 2)."""
    ops: tuple[str, ...] = ()
    view, view_index, dropped = None, -1, []
    for j in range(r - 1, -1, -1):
        statement = statements[j]
        if not any(isinstance(n, ast.Name) and n.id == value for n in ast.walk(statement)):
            continue
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == value):
            return (f"line {statement.lineno} names {value} otherwise than binding it to its norm's output or a "
                    "view of it (invariants 1, 2)")
        base, step = peel(statement.value)
        if step is None:
            return (f"line {statement.lineno} applies to {value} something else than view and transpose(1, 2) "
                    "(invariant 4)")
        ops = tuple(kind for kind, _ in step) + ops
        view_calls = [call for kind, call in step if kind == VIEW]
        if view_calls:
            view, view_index = view_calls[-1], j
        if isinstance(base, ast.Name) and base.id == value and step:
            dropped.append(j)
            continue
        path = module_call(base, me)
        if path is None or path not in norms:
            return (f"line {statement.lineno} binds {value} to neither a patched norm's output nor a view (view, "
                    "transpose(1, 2)) of one (invariants 1, 4)")
        if any(isinstance(n, ast.Name) and n.id == value and isinstance(n.ctx, ast.Store)
               for n in ast.walk(base)):
            return f"line {statement.lineno} binds {value} inside its norm's argument"
        return _Chain(j, base, ops, view, view_index, tuple(dropped))
    return f"{value} is bound by no norm statement before the RoPE (invariant 1)"


def peel(expr: ast.expr) -> tuple[ast.expr, list[tuple[str, ast.Call]] | None]:
    """``(base, [(kind, call), ...])`` for ``base.view(...).transpose(1, 2)...`` (ops in the order they apply);
    None as the list when a ``view`` reads more than names and constants (or a transpose is not (1, 2))."""
    step: list[tuple[str, ast.Call]] = []
    while (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
           and expr.func.attr in (VIEW, TRANSPOSE) and not expr.keywords):
        if expr.func.attr == TRANSPOSE:
            if [a.value if isinstance(a, ast.Constant) else None for a in expr.args] != [1, 2]:
                return expr, None
        elif not all(_plain_argument(a) for a in expr.args):
            return expr, None
        step.insert(0, (expr.func.attr, expr))
        expr = expr.func.value
    return expr, step


def _plain_argument(node: ast.expr) -> bool:
    """A name, a constant, ``*name``, or a tuple of these: what a ``view`` may read at the RoPE's statement."""
    if isinstance(node, ast.Starred):
        return isinstance(node.value, ast.Name)
    if isinstance(node, ast.Tuple):
        return all(_plain_argument(e) for e in node.elts)
    return isinstance(node, (ast.Name, ast.Constant)) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant))


def _between_problem(statement: ast.stmt, me: str, between: list[tuple[str, ...]]) -> str | None:
    """Invariant 3 for a statement between the norms and the RoPE (``_chain`` refused any naming ``Q`` or ``K``:
    invariant 2); records the modules it calls."""
    if not isinstance(statement, (ast.Assign, ast.AnnAssign)) or statement.value is None:
        return "is no assignment: it could run code that sees or changes what the norms read (invariant 3)"
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    for target in targets:
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        if not all(isinstance(n, ast.Name) for n in names):
            return f"assigns to {ast.unparse(target)}, not to names (invariant 3)"
    calls: list[tuple[str, ...]] = []
    if not _only_views_and_modules(statement.value, me, calls):
        return f"evaluates {ast.unparse(statement.value)}: more than module calls and views (invariant 3)"
    between.extend(path for path in calls if path not in between)
    return None


def _only_views_and_modules(expr: ast.expr, me: str, calls: list[tuple[str, ...]]) -> bool:
    if reads_only(expr):
        return True
    if not isinstance(expr, ast.Call) or any(not reads_only(k.value) for k in expr.keywords):
        return False
    if not all(_only_views_and_modules(a, me, calls) for a in expr.args):
        return False
    path = attribute_path(expr.func, me)
    if path is not None:
        calls.append(path)
        return True
    return (isinstance(expr.func, ast.Attribute) and expr.func.attr in _VIEW_METHODS
            and _only_views_and_modules(expr.func.value, me, calls))


def _view_names_problem(statements: list[ast.stmt], chain: _Chain, r: int, plain: frozenset[str]) -> str | None:
    """Invariant 2 for the names the whole-projection ``view`` reads, read again at the RoPE's statement."""
    if chain.view is None:
        return None
    names = {n.id for a in chain.view.args for n in ast.walk(a) if isinstance(n, ast.Name)}
    for name in names:
        if name not in plain:
            return f"the view's {name} is no plain local: read again at the RoPE, it could differ (invariant 2)"
        for statement in statements[chain.view_index:r]:
            if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del))
                   for n in ast.walk(statement)):
                return f"line {statement.lineno} rebinds the view's {name} before the RoPE (invariant 2)"
    return None
