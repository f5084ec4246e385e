"""The attention modules whose query/key norms and RoPE run as one ``qk_norm_rope`` launch (or one per tensor, where
the attention normalises and rotates its queries and keys each on its own: ``qk_sites.one_sites``; or one
``qk_rope_norm`` launch, where it rotates them before normalising them: ``qk_sites.rope_first_site``): planned
(``plan_attention``), their kind (``QKAttentionKind``) and their forward, derived from the attention's own code with
its q/k site rewritten (``fused_attention_forward``; ``qk_sites.py`` finds the site and says why the rewrite is
exact, ``qk_probe.py`` accepts the RoPE function, ``qk_runtime.py`` runs it).

A module is a candidate when its class forward calls two patched norms; it is fused when its forward has the
site, its RoPE function passes the probe, and nothing set on the instance replaces its forward (a hook of
accelerate's, a tensor-parallel wrapper). Tensor-parallel plans are left alone: a plan shards the projections'
heads, and whether a whole-projection norm (OLMo 2) is then computed over the local heads only is the plan's
business, which this module does not prove, so an attention with any module under a plan keeps its statements.
"""

from __future__ import annotations

import ast
import copy
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import derived_source, qk_runtime
from .derived_source import helper_call
from .derived_syntax import attribute_at, located, self_name
from .instance_forwards import instance_problem, tensor_parallel_planned
from .qk_probe import RopeVerdict, probe_one_tensor_rope, probe_rope
from .qk_sites import (
    NO_ROPE_FIRST,
    NORMS_UNDER_IF,
    ROPE_UNDER_IF,
    SKIPPED_IF,
    OnePlan,
    OneSite,
    QKSite,
    RopeFirstPlan,
    RopeFirstSite,
    SitePlan,
    module_calls,
    one_sites,
    peel,
    qk_site,
    rope_first_site,
)
from .report import QK_APART

# The locals the derived forward keeps the norms' inputs in, from their statements to the RoPE's.
_INPUTS = ("_hf_rmsnorm_q", "_hf_rmsnorm_k")
# What the report says first of an attention whose q/k site is not fused (``PatchReport.qk_apart`` reads it).
UNFUSED = QK_APART
# A fused attention's site or sites.
Site = QKSite | RopeFirstSite | tuple[OneSite, ...]


@dataclass(frozen=True)
class QKAttentionKind:
    """An attention class whose q/k site (``site``: the norms then the RoPE, or the RoPE then the norms) runs as one
    launch, or whose one-tensor sites (``site`` a tuple of them: Gemma 3n's and Gemma 4's queries and keys) one launch
    each: ``rope`` the RoPE function the probe accepted,
    with its code, defaults and the module-level functions it reads (``rope_globals``: ``rotate_half``), which
    ``qk_runtime`` checks at every call; ``dtypes`` (each (norm output, cos) dtype pair the function computes as the
    kernel does, and whether it casts the result back to the norm's dtype), ``partial`` and ``negate_sin`` (its
    angle) what the probe found (``qk_probe``)."""

    class_path: str
    site: Site
    rope: types.FunctionType
    rope_code: types.CodeType
    rope_defaults: tuple | None
    rope_globals: tuple[tuple[str, object], ...]
    dtypes: tuple[tuple[tuple[torch.dtype, torch.dtype], bool], ...]
    partial: bool
    negate_sin: bool

    @property
    def label(self) -> str:
        rotary = ("full and partial rotary" if self.partial else "full rotary") + (
            ", the opposite angle" if self.negate_sin else "")
        if isinstance(self.site, QKSite):
            return f"{self.site.label} -> one qk_norm_rope launch ({rotary})"
        if isinstance(self.site, RopeFirstSite):
            return f"{self.site.label} -> one qk_rope_norm launch ({rotary})"
        each = " each" if len(self.site) > 1 else ""
        return f"{'; '.join(s.label for s in self.site)} -> one qk_norm_rope launch{each} ({rotary})"

    @property
    def rope_name(self) -> str:
        """The RoPE function's name in its modeling module."""
        return _rope_name(self.site)

    @property
    def watched_paths(self) -> tuple[tuple[str, ...], ...]:
        """The modules whose hooks make the attention run its original forward: the norms and the modules called
        between them and the RoPE."""
        if isinstance(self.site, QKSite):
            return (self.site.q_norm, self.site.k_norm, *self.site.between)
        if isinstance(self.site, RopeFirstSite):
            return self.site.q_norm, self.site.k_norm
        return tuple(s.norm for s in self.site)

    def __deepcopy__(self, memo: dict) -> QKAttentionKind:
        return self  # immutable: a copied fused module shares its class, and the probe's verdict

    def __reduce__(self):
        # Code objects do not pickle: a loaded model's kind probes its function (pickled by name) again, and
        # a function that no longer passes gets a kind that never fuses (its statements run as written).
        return _probed_kind, (self.class_path, self.site, self.rope)


def _kind(class_path: str, site: Site, rope: types.FunctionType, verdict: RopeVerdict) -> QKAttentionKind:
    module_functions = tuple((name, value) for name in rope.__code__.co_names
                             if isinstance(value := rope.__globals__.get(name), types.FunctionType))
    return QKAttentionKind(class_path, site, rope, rope.__code__, rope.__defaults__, module_functions, verdict.dtypes,
                           verdict.partial, verdict.negate_sin)


def _probed_kind(class_path: str, site: Site, rope: types.FunctionType) -> QKAttentionKind:
    verdict = _probe(rope, site)
    return _kind(class_path, site, rope, RopeVerdict((), False) if isinstance(verdict, str) else verdict)


def _rope_name(site: Site) -> str:
    return site[0].rope if isinstance(site, tuple) else site.rope


def _probe(rope: types.FunctionType, site: Site) -> RopeVerdict | str:
    """The probe's verdict on ``rope`` called as ``site`` calls it: on q and k, or on one tensor."""
    return probe_one_tensor_rope(rope) if isinstance(site, tuple) else probe_rope(rope)


def attention_kind(cls: type, norms: frozenset[tuple[str, ...]],
                   verdicts: dict[object, RopeVerdict | str]) -> QKAttentionKind | str:
    """The kind of attention class ``cls`` whose forward calls the patched norms at ``norms``, or why its q/k site
    is not fused; ``verdicts`` holds the probes already run for this plan (one per RoPE function)."""
    forward = derived_source.class_forward(cls)
    if isinstance(forward, str):
        return forward
    plan = qk_site(forward, forward.node, norms)
    site: Site
    if isinstance(plan, str):
        ones = one_sites(forward, forward.node, norms)
        rope_first = None if ones else rope_first_site(forward, forward.node, norms)
        if rope_first is not None:
            site = rope_first.site
        elif not ones:
            return f"{plan}; {NO_ROPE_FIRST}"
        else:
            site = tuple(one.site for one in ones)
            if len({one.rope for one in site}) > 1:
                return (f"its one-tensor sites call different RoPE functions "
                        f"({', '.join(sorted({o.rope for o in site}))})")
    else:
        site = plan.site
    name = _rope_name(site)
    rope = forward.undecorated.__globals__.get(name)
    if not isinstance(rope, types.FunctionType):
        return f"{name} is not a Python function of {cls.__module__}"
    key = (rope, isinstance(site, tuple))  # a function is probed once per way of calling it
    if key not in verdicts:
        verdicts[key] = _probe(rope, site)
    verdict = verdicts[key]
    if isinstance(verdict, str):
        return verdict
    return _kind(f"{cls.__module__}.{cls.__qualname__}", site, rope, verdict)


def fused_attention_forward(base: type, kind: QKAttentionKind) -> Callable[..., object]:
    """``base.forward`` with its q/k site rewritten (``qk_sites``' module docstring), decorated as the original.

    Raises:
        ValueError: the source cannot be derived from, or no longer has ``kind.site``.
    """
    forward = derived_source.class_forward(base)
    if isinstance(forward, str):
        raise ValueError(f"cannot derive a fused attention forward for {base.__qualname__}: {forward}")
    function = forward.node
    if isinstance(kind.site, QKSite):
        plan = qk_site(forward, function, frozenset({kind.site.q_norm, kind.site.k_norm}))
        if isinstance(plan, str) or plan.site != kind.site:
            raise ValueError(f"{base.__qualname__}.forward no longer has {kind.site.label}")
        _rewrite(plan, self_name(function))
    elif isinstance(kind.site, RopeFirstSite):
        plan = rope_first_site(forward, function, frozenset({kind.site.q_norm, kind.site.k_norm}))
        if plan is None or plan.site != kind.site:
            raise ValueError(f"{base.__qualname__}.forward no longer has {kind.site.label}")
        _rewrite_rope_first(plan, self_name(function))
    else:
        ones = one_sites(forward, function, frozenset(one.norm for one in kind.site))
        if tuple(one.site for one in ones) != kind.site:
            raise ValueError(f"{base.__qualname__}.forward no longer has {kind.label}")
        for one in ones:
            _rewrite_one(one, self_name(function))
    return derived_source.compile_forward(forward, function, qk_runtime)


def _rewrite(plan: SitePlan, me: str) -> None:
    """Each norm statement -> ``_hf_rmsnorm_<q|k> = <its argument>``, each ``Q = OPS(Q)`` -> ``pass``, the RoPE's
    call -> ``norm_rope(self, self.q_norm, self.k_norm, F, <inputs>, C, S, <view args>)`` (``qk_runtime``); an ``if``
    around it gets ``else: Q, K = norms_apart(self, self.q_norm, self.k_norm, <inputs>, <view args>)``, an ``if`` the
    site skips runs first the norm statements and ``Q = OPS(Q)`` before it, as written but for the norms' arguments
    (``_hf_rmsnorm_<q|k>``); the inputs deleted after the RoPE; every new node located at the code it stands for."""
    rope_statement = plan.rope_statement
    call = rope_statement.value
    role = plan.site.branch_role
    views, before_skipped = [], []
    for chain, name in ((plan.q, _INPUTS[0]), (plan.k, _INPUTS[1])):
        block, at = plan.slot(chain.index)
        norm_statement = block[at]
        if role == SKIPPED_IF:
            before_skipped += [(chain.index, _reading(norm_statement, name))] + [
                (j, copy.deepcopy(plan.statements[j])) for j in chain.dropped if j < plan.rope_index]
        block[at] = located(ast.Assign([ast.Name(name, ast.Store())], chain.call.args[0]), norm_statement)
        for j in chain.dropped:
            block, at = plan.slot(j)
            block[at] = located(ast.Pass(), block[at])
        view = chain.view.args if chain.view is not None else []
        views.append(located(ast.Tuple(list(view), ast.Load()), call))
    attention = ast.Name(me, ast.Load())
    norms = [_attribute(me, path) for path in (plan.site.q_norm, plan.site.k_norm)]
    inputs = [ast.Name(name, ast.Load()) for name in _INPUTS]
    rope_statement.value = located(helper_call("norm_rope", attention, *norms, call.func, *inputs, call.args[2],
                                                call.args[3], *views), call)
    if role == ROPE_UNDER_IF:
        apart = helper_call("norms_apart", attention, *norms, *inputs, *views)
        plan.branch.orelse = [located(ast.Assign(copy.deepcopy(rope_statement.targets), apart), plan.branch)]
    elif role == SKIPPED_IF:
        plan.branch.body[:0] = [statement for _, statement in sorted(before_skipped, key=lambda pair: pair[0])]
    # Where the norms run under the if, the inputs exist in its body alone.
    block, at = (plan.arm, len(plan.arm)) if role == NORMS_UNDER_IF else (plan.statements, plan.rope_index + 1)
    block.insert(at, located(ast.Delete([ast.Name(name, ast.Del()) for name in _INPUTS]), rope_statement))


def _reading(norm_statement: ast.Assign, name: str) -> ast.Assign:
    """A copy of ``Q = OPS(self.q_norm(A))`` reading its norm's input from ``name``."""
    statement = copy.deepcopy(norm_statement)
    base, _ = peel(statement.value)
    base.args[0] = located(ast.Name(name, ast.Load()), base.args[0])
    return statement


def _rewrite_one(plan: OnePlan, me: str) -> None:
    """The norm statement ``X = self.x_norm(A)`` -> ``X = norm_rope_one(self.x_norm, A, F, C, S, self)``, the RoPE's
    ``X = F(X, C, S, unsqueeze_dim=2)`` -> ``pass`` (``qk_sites``' "One tensor at a time")."""
    norm_statement, rope_statement = plan.block[plan.index], plan.block[plan.index + 1]
    rope = rope_statement.value
    value = helper_call("norm_rope_one", _attribute(me, plan.site.norm), norm_statement.value.args[0], rope.func,
                        rope.args[1], rope.args[2], ast.Name(me, ast.Load()))
    plan.block[plan.index] = located(ast.Assign(copy.deepcopy(norm_statement.targets), located(value, rope)),
                                     norm_statement)
    plan.block[plan.index + 1] = located(ast.Pass(), rope_statement)


def _rewrite_rope_first(plan: RopeFirstPlan, me: str) -> None:
    """The RoPE's call ``F(Q, K, C, S)`` -> ``rope_norm(self, self.q_norm, self.k_norm, F, Q, K, C, S)``, the norm
    statements after it -> ``pass`` (``qk_sites``' "The RoPE before the norms")."""
    rope_statement = plan.block[plan.index]
    call = rope_statement.value
    norms = [_attribute(me, path) for path in (plan.site.q_norm, plan.site.k_norm)]
    rope_statement.value = located(helper_call("rope_norm", ast.Name(me, ast.Load()), *norms, call.func, *call.args),
                                   call)
    for j in (plan.index + 1, plan.index + 2):
        plan.block[j] = located(ast.Pass(), plan.block[j])


def _attribute(me: str, path: tuple[str, ...]) -> ast.expr:
    node: ast.expr = ast.Name(me, ast.Load())
    for attr in path:
        node = (ast.Subscript(node, ast.Constant(int(attr)), ast.Load()) if attr.isdigit()
                else ast.Attribute(node, attr, ast.Load()))
    return node


def class_namespace(base: type, kind: QKAttentionKind) -> dict[str, object]:
    """What ``fused.fused_class`` puts in the fused attention class beside its common entries and its forward
    (``qk_runtime.attention_forward`` under the original's name and signature)."""
    return {
        "_hf_rmsnorm_checked_forward": staticmethod(base.forward),
        "_hf_rmsnorm_body": staticmethod(fused_attention_forward(base, kind)),
    }


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def plan_attention(modules: list[tuple[str, nn.Module]], norms: dict[nn.Module, str],
                   class_problem: Callable[[type], str | None]) -> tuple[list[tuple[str, nn.Module, QKAttentionKind]],
                                                                        list[tuple[str, str]]]:
    """The attention modules among ``modules`` (the model's, with their names) whose q/k site is fused, and why each
    other module with two patched norms among its children is not (``(name, reason)`` for the report). A module with
    one patched norm is fused where that norm is a one-tensor site's (Gemma 4's KV-sharing layers normalise only their
    queries), and left alone unreported otherwise."""
    fused: list[tuple[str, nn.Module, QKAttentionKind]] = []
    skipped: list[tuple[str, str]] = []
    verdicts: dict[object, RopeVerdict | str] = {}
    kinds: dict[tuple[type, frozenset], QKAttentionKind | str] = {}
    for name, module in modules:
        # A container of norms (LongCat-Flash's ModuleList of two input norms) calls none of them itself.
        held = sum(child in norms for child in module.children())
        if isinstance(module, _CONTAINERS) or not held:
            continue
        cls = type(module)
        source = derived_source.class_forward(cls)
        paths = frozenset(path for path in module_calls(cls) if attribute_at(module, path) in norms)
        if isinstance(source, str) or not paths:
            if isinstance(source, str) and held >= 2:  # why its source gave no calls
                skipped.append((name, f"{UNFUSED}{class_problem(cls) or source}"))
            continue
        if (cls, paths) not in kinds:
            kinds[cls, paths] = class_problem(cls) or attention_kind(cls, paths, verdicts)
        kind = kinds[cls, paths]
        if len(paths) < 2 and isinstance(kind, str):
            continue
        problem = kind if isinstance(kind, str) else instance_problem(module) or _tensor_parallel_problem(module)
        if problem is None:
            fused.append((name, module, kind))
        else:
            skipped.append((name, f"{UNFUSED}{problem}"))
    return fused, skipped


def _tensor_parallel_problem(attention: nn.Module) -> str | None:
    planned = [name or "the attention" for name, module in attention.named_modules() if tensor_parallel_planned(module)]
    if planned or any(type(p) is not nn.Parameter and type(p) is not torch.Tensor for p in attention.parameters()):
        return (f"a tensor-parallel plan shards this attention ({', '.join(planned) or 'DTensor parameters'}); the "
                "fused site is not proven right under it")
    return None
