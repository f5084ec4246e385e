"""``patch_model`` / ``unpatch_model``: give a loaded model's norms, decoder layers and stacks the fused kernels.

The walker plans everything first (which modules match a family of ``families.py`` exactly and why the others
are left alone), then applies the plan as class swaps plus a few instance attributes, restoring everything if
any step fails. Parameters, buffers, hooks and attribute paths are left alone, except by the explicit
conversion of LayerNorm models to RMSNorm (``conversion.py``), which the caller asks for by name.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ops import backend
from . import derived_blocks, derived_loops, derived_sites, derived_source, fused, qk_attention
from .classify import Role, holds_norms, may_derive, role_of
from .conversion import LayerNormPlan, plan_layernorms
from .derived_syntax import attribute_at
from .families import CACHE_PARAM_SPELLINGS, LayerKind, NormKind, StackKind, registry, while_inactive
from .handoff import BLOCK_LINKS_ATTR, LINKS_ATTR, SUBLAYER_LINKS_ATTR, BlockLinks, NextNorm
from .instance_forwards import function_path, hub_forward, instance_problem, is_bound, rebind_tensor_parallel_forward
from .recognition import NormRecogniser, family_of, recognised_layer_kinds, recognised_stack_kind
from .report import PatchReport, UnsupportedModelError

_STATE_ATTR = "_hf_rmsnorm_patch"
# What a derived candidate that is no layer carries in place of why no registered shape fitted: nothing to report
# when nothing is fused (``_plan_derived_layers``).
QUIET = ""


@dataclass
class _PatchState:
    """Kept on the patched model, so ``unpatch_model`` knows what to undo (and copies of the model too)."""

    report: PatchReport
    layernorms: LayerNormPlan
    swapped: list[tuple[nn.Module, type]] = field(default_factory=list)
    added: list[tuple[nn.Module, str]] = field(default_factory=list)
    # Hub-kernel forwards (``instance_forwards.hub_forward``) taken off their modules while patched, put back.
    hub_forwards: list[tuple[nn.Module, types.MethodType]] = field(default_factory=list)


@dataclass
class _Plan:
    # Every module of the model with its qualified name and its role (``classify.py``): the one walk, classified
    # once, that the plan is made from.
    modules: list[tuple[str, nn.Module, Role]]
    report: PatchReport
    layernorms: LayerNormPlan
    swaps: list[tuple[nn.Module, NormKind | LayerKind | StackKind]] = field(default_factory=list)
    attrs: list[tuple[nn.Module, str, object]] = field(default_factory=list)
    # The planned modules whose hub-kernel forward (``instance_forwards.hub_forward``) patching sets aside.
    hub_forwards: dict[nn.Module, types.MethodType] = field(default_factory=dict)
    already_patched: int = 0
    # ``_class_problem`` of each class met, worked out once for this plan (it compiles the forward's source).
    class_problems: dict[type, str | None] = field(default_factory=dict)

    def class_problem(self, cls: type) -> str | None:
        if cls not in self.class_problems:
            self.class_problems[cls] = _class_problem(cls)
        return self.class_problems[cls]


def patch_model(model: nn.Module, *, layernorm: str = "fuse") -> PatchReport:
    """Replace the norms of every supported family in ``model`` by the fused kernels, in place.

    Norms become modules whose ``forward`` calls the kernels (and accepts ``residual=`` for a fused add);
    decoder layers of a known pre-norm structure fuse their attention residual add into
    ``post_attention_layernorm`` and their MLP residual add into the next layer's input norm
    (the last layer's into the final norm). Outputs, hidden states, hooks, parameters and state dicts stay
    what they were. Patching a patched model does nothing and returns the first report.

    Hub kernels (``kernels.kernelize``, transformers' ``use_kernels=True``): patched modules name no hub layer,
    so kernelizing a patched model (as a ``use_kernels`` model does on every ``train()``/``eval()``) leaves them
    on the fused kernels; a module kernelized before patching has its hub forward set aside while patched (the
    report's ``hub_forwards`` names each) and put back by ``unpatch_model``.

    LayerNorm models (decoders of every shape, BERT-family encoders with any head, ViT/CLIP/SigLIP towers,
    Whisper, BART-style encoder-decoders) keep their LayerNorms' maths: every LayerNorm runs the kernels' exact
    fused add + LayerNorm, and the residual adds next to them are fused where the layer has a known shape or its
    code one of the derived forwards' patterns (post-LN sublayers' ``LayerNorm(dropout(dense(h)) + input)``).

    Args:
        model: a transformers model, or a PEFT ``PeftModel`` wrapping one (its base model is patched).
        layernorm: what happens to the model's LayerNorms. ``"fuse"`` (default): the exact
            fused LayerNorm above, no weight touched. ``"rmsnorm"``: a one-time, exact conversion of a pre-LN
            fp32 model into an RMSNorm model (``hf_rmsnorm.patch.conversion``): the modules writing into the
            residual stream are centred in place now (the report lists every parameter changed), the stream is
            centred where it enters the first layer, and each LayerNorm runs as an RMSNorm. ``"skip"``: leave
            every LayerNorm alone (reported as skipped), a model's own LayerNorm classes too (DeBERTa's, Cohere's:
            a norm recognised in a centring mode).

    Returns:
        A ``PatchReport`` of what was patched, fused, converted and skipped.

    Raises:
        UnsupportedModelError: ``model`` is not a module or has no norm hf_rmsnorm can patch. Nothing changed.
        UnconvertibleModelError: (a subclass) ``layernorm="rmsnorm"`` and the model cannot be converted exactly:
            a post-LN model (BERT, OPT-350m), an encoder, fp16/bf16 writers, an unknown stack, a LayerNorm of
            the model's own class. Nothing changed.
        ValueError: ``layernorm`` is not one of the values above.
    """
    root = _unwrap(model)
    state = root.__dict__.get(_STATE_ATTR)
    if state is not None:
        return state.report
    plan = _checked_plan(root, layernorm)
    state = _PatchState(plan.report, plan.layernorms)
    try:
        for module, kind in plan.swaps:
            state.swapped.append((module, type(module)))
            hub_layer_forward = plan.hub_forwards.get(module)
            if hub_layer_forward is not None:
                state.hub_forwards.append((module, hub_layer_forward))
                del module.__dict__["forward"]
            _swap_class(module, fused.fused_class(type(module), kind))
        for module, name, value in plan.attrs + [(root, _STATE_ATTR, state)]:
            state.added.append((module, name))
            _set_attr(module, name, value)
        # Last: the only step that changes weights (the conversion to RMSNorm) cannot fail halfway.
        plan.layernorms.apply()
    except BaseException:
        plan.layernorms.remove_hooks()
        _restore(state)
        raise
    return state.report


def check_model(model: nn.Module, *, layernorm: str = "fuse") -> PatchReport:
    """What ``patch_model(model, layernorm=layernorm)`` would patch, fuse and skip, changing nothing.

    Lets a caller refuse an unsupported model before doing any work with it. For a patched model, the report
    of the patch.

    Raises:
        UnsupportedModelError, UnconvertibleModelError, ValueError: as ``patch_model`` would.
    """
    root = _unwrap(model)
    state = root.__dict__.get(_STATE_ATTR)
    return state.report if state is not None else _checked_plan(root, layernorm).report


def unpatch_model(model: nn.Module) -> None:
    """Undo ``patch_model``: original classes and forwards (hub-kernel forwards set aside by patching included,
    and patched modules copied into the model since, such as the norm copies PEFT's ``modules_to_save`` trains),
    no attribute or hook left behind. Weights centred by ``layernorm="rmsnorm"`` stay centred: they give the same
    outputs in the original LayerNorm model.

    Raises:
        ValueError: ``model`` was not patched, or a patched module's class was changed since (for example by
            an FSDP wrapper); nothing is changed then.
    """
    root = _unwrap(model)
    state = root.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError(
            f"{type(model).__name__} is not patched: call unpatch_model on the object patch_model was given"
        )
    for module, original in state.swapped:
        if fused.original_class(module) is not original:
            raise ValueError(
                f"cannot unpatch: the class of a patched {original.__name__} was changed to "
                f"{type(module).__module__}.{type(module).__qualname__} after patching; undo that wrapping first"
            )
    _restore(state)
    _restore_copies(root)
    state.layernorms.remove_hooks()


def _restore_copies(root: nn.Module) -> None:
    """After ``_restore``: gives their original class back to the patched modules copied into ``root`` since
    patching, which the patch's record does not list: PEFT's ``modules_to_save`` wraps a patched norm with a deep
    copy of it (the copy it trains). Parts of ``root`` patched by a patch_model call of their own are left alone."""
    stack = [root]
    while stack:
        module = stack.pop()
        original = fused.original_class(module)
        if original is not None:
            _swap_class(module, original)
        stack.extend(child for child in module.children() if _STATE_ATTR not in child.__dict__)


def _restore(state: _PatchState) -> None:
    """Removes the added attributes, gives every swapped module its original class back and puts back the
    hub-kernel forwards set aside."""
    for module, name in reversed(state.added):
        module.__dict__.pop(name, None)
    for module, original in reversed(state.swapped):
        if type(module) is not original:
            _swap_class(module, original)
    for module, forward in state.hub_forwards:
        _set_attr(module, "forward", forward)


def _unwrap(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"patch_model expects a torch.nn.Module (a transformers model or a PEFT PeftModel), got "
            f"{type(model).__module__}.{type(model).__qualname__}"
        )
    # PEFT's PeftModel: the transformers model is its base model (adapters wrap linears, never the norms).
    get_base_model = getattr(type(model), "get_base_model", None)
    if callable(get_base_model):
        base = model.get_base_model()
        if isinstance(base, nn.Module):
            return base
    return model


def _swap_class(module: nn.Module, new_cls: type) -> None:
    """Sets ``module``'s class, and re-points the bound forwards that accelerate keeps on the instance
    (``_old_forward`` under a hook, ``forward`` after ``remove_hook_from_module``) and the one a tensor-parallel
    wrapper calls at the new class's forward; otherwise they would keep calling the old one."""
    old_forward = type(module).forward
    module.__class__ = new_cls
    for attr in ("forward", "_old_forward"):
        if is_bound(module.__dict__.get(attr), module, old_forward):
            _set_attr(module, attr, types.MethodType(new_cls.forward, module))
    rebind_tensor_parallel_forward(module, old_forward, new_cls)


def _set_attr(module: nn.Module, name: str, value: object) -> None:
    # Bypasses nn.Module.__setattr__, which would register a module-valued attribute as a child module.
    object.__setattr__(module, name, value)


def _backend_of(root: nn.Module) -> str:
    """What will run the norms of ``root``, judged by where its first parameter lives."""
    parameter = next(root.parameters(), None)
    return backend.describe(parameter.device if parameter is not None else "cpu")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _checked_plan(root: nn.Module, layernorm: str) -> _Plan:
    """``_plan``, refusing a model where it would change nothing."""
    plan = _plan(root, layernorm)
    if plan.swaps or plan.already_patched:
        return plan
    model_name = type(root).__name__
    model_type = getattr(getattr(root, "config", None), "model_type", None)
    if model_type:
        model_name += f" (model_type {model_type!r})"
    norms = {name: type(m).__name__ for name, m, role in plan.modules if role.is_norm}
    found = sorted(set(norms.values()))
    # Why each norm found was left alone (a tensor-parallel style, a replaced forward, numerics no mode has...).
    reasons = _skip_reasons([(name, reason) for name, reason in plan.report.skipped if name in norms])
    raise UnsupportedModelError(
        f"{model_name} has no norm hf_rmsnorm can patch (found: {', '.join(found) or 'none'}{reasons}); "
        "supported families: hf_rmsnorm.patch.family_names()"
    )


def _skip_reasons(skipped: list[tuple[str, str]]) -> str:
    """Each distinct reason norms were left alone, after the first norm it applies to, for a refusal."""
    modules: dict[str, list[str]] = {}
    for name, reason in skipped:
        modules.setdefault(reason, []).append(name)
    return "".join(
        f"; {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {reason}"
        for reason, names in modules.items()
    )


def _plan(root: nn.Module, layernorm: str) -> _Plan:
    """Decides every change before any is made: which norms, layers and stacks to swap, which layers hand their
    MLP residual sum to which norm, and what happens to the LayerNorms."""
    reg = registry()
    modules = [(name, module, role_of(type(module), reg, holds_modules=next(module.children(), None) is not None,
                                      composite=holds_norms(module)))
               for name, module in root.named_modules()]
    layernorms = plan_layernorms(type(root).__name__, modules, reg.stacks, layernorm)
    report = PatchReport(
        centred=layernorms.centred, centred_inputs=list(layernorms.entrances.values()), backend=_backend_of(root)
    )
    plan = _Plan(modules, report, layernorms)
    norms, layer_candidates, stacks, unknown_layers = _plan_norms(root, reg, plan)
    layers, unmatched = _plan_layers(layer_candidates, norms, plan)
    _plan_derived_layers(unknown_layers + unmatched, norms, layers, plan)
    _plan_qk_attention(norms, layers, plan)
    _plan_blocks(layers, norms, plan)
    _plan_handoffs(stacks, layers, norms, plan)
    _report_unread_stacks(stacks, layers, plan)
    _unplan_layers_fusing_nothing(layers, plan)
    _plan_hub_forwards(plan)
    return plan


def _plan_norms(root: nn.Module, reg, plan: _Plan):
    """Goes through the classified walk: plans the norm swaps, reports every norm left alone, and returns the
    patched norms (module -> name), the decoder layers and the layer stacks of known or recognised classes, and
    the other decoder layers (``recognition.py`` explains what is recognised)."""
    norms: dict[nn.Module, str] = {}
    layer_candidates: list[tuple[str, nn.Module, tuple[LayerKind, ...]]] = []
    stacks: list[tuple[str, nn.Module, StackKind]] = []
    unknown_layers: list[tuple[str, nn.Module, str | None]] = []
    others: list[tuple[str, nn.Module]] = []
    layernorms = plan.layernorms
    recogniser = NormRecogniser()
    # The dtype of the activations the norms read (and the one a norm without a weight of its own is probed in).
    model_dtype = getattr(root, "dtype", None) if isinstance(getattr(root, "dtype", None), torch.dtype) else None
    model_dtype = model_dtype or next((p.dtype for p in root.parameters() if p.is_floating_point()), torch.float32)

    def add_norm(name: str, module: nn.Module, family: str, kind: NormKind) -> None:
        if (reason := layernorms.own_class_skip(type(root).__name__, name, module, kind)) is not None:
            plan.report.skipped.append((name, reason))
            return
        norms[module] = name
        plan.swaps.append((module, kind))
        plan.report.norms.append(name)
        if layernorms.converts(module):
            plan.report.converted.append(name)
        if family not in plan.report.families:
            plan.report.families.append(family)

    for name, module, role in plan.modules:
        cls = type(module)
        if role is Role.PATCHED:
            plan.already_patched += 1
            plan.report.skipped.append((name, "already patched by an earlier patch_model call on a submodule"))
        elif module in layernorms.skipped:
            plan.report.skipped.append((name, layernorms.skipped[module]))
        elif role is Role.REGISTERED_NORM or module in layernorms.norms:
            family, kind = layernorms.norms[module] if module in layernorms.norms else reg.norms[cls]
            problem = plan.class_problem(cls) or _norm_attribute_problem(module, kind) or instance_problem(module)
            if not problem and module not in layernorms.norms:
                # nn.LayerNorm's forward is torch's own; a registered class's is checked against its entry.
                problem = recogniser.registry_problem(module, kind, model_dtype)
            if problem:
                plan.report.skipped.append((name, problem))
            else:
                add_norm(name, module, family, kind)
        elif role.is_recognisable_norm:
            # Probed as its class's forward, so an inherited or replaced forward is judged by what it computes.
            verdict = recogniser.verdict(module, model_dtype)
            problem = verdict.reason if verdict.kind is None else instance_problem(module)
            if problem:
                plan.report.skipped.append((name, problem))
            else:
                add_norm(name, module, family_of(cls), verdict.kind)
        elif role.is_norm:
            plan.report.skipped.append((name, f"{_class_path(cls)} is not a norm of a supported family"))
        elif role is Role.REGISTERED_LAYER:
            layer_candidates.append((name, module, tuple(kind for _, kind in reg.layers[cls])))
        elif role is Role.REGISTERED_STACK:
            stacks.append((name, module, reg.stacks[cls][1]))
        elif role is Role.DECODER_LAYER:
            kinds = recognised_layer_kinds(cls)
            if kinds:
                layer_candidates.append((name, module, tuple(kind for _, kind in kinds)))
            else:
                unknown_layers.append((name, module, None))
        elif role is Role.STACK and (recognised_stack := recognised_stack_kind(cls)):
            stacks.append((name, module, recognised_stack[1]))
        elif role is Role.STACK and (derived_stack := derived_loops.stack_kind(cls)):
            stacks.append((name, module, derived_stack))
        elif may_derive(role):
            others.append((name, module))
    # The other modules calling a patched norm of their own (known once the walk is over: children come later).
    unknown_layers += [(name, module, QUIET) for name, module in others
                       if any(child in norms for child in module.children())]
    return norms, layer_candidates, stacks, unknown_layers


def _plan_derived_layers(
    candidates: list[tuple[str, nn.Module, str | None]],
    norms: dict[nn.Module, str],
    layers: dict[nn.Module, tuple[str, LayerKind | derived_sites.DerivedLayerKind]],
    plan: _Plan,
) -> None:
    """Plans the decoder layers of no known shape, and the other modules ``classify.may_derive`` names, whose
    forward has residual adds next to their patched norms (``derived_sites.py``); reports why each other layer with
    a patched norm keeps its adds unfused (``candidates`` carry why no registered kind fitted, if one was tried, or
    ``QUIET`` for a module that is no layer: one without such an add is left alone unreported), and why a layer
    keeps some of its adds unfused."""
    # Per class: the paths of its forward's module calls, and of those binding their output (sublayer calls).
    calls: dict[type, tuple[frozenset[tuple[str, ...]], frozenset[tuple[str, ...]]]] = {}
    codes: dict[tuple[type, frozenset[tuple[str, ...]], frozenset[tuple[str, ...]]],
                derived_sites.LayerCode | str] = {}
    sublayer_kinds: dict[type, derived_sites.DerivedLayerKind | None] = {}
    for name, layer, registered_problem in candidates:
        cls = type(layer)
        if cls not in calls:  # the classes' sources are read once for the plan
            calls[cls] = derived_sites.module_calls(cls), derived_sites.sublayer_calls(cls)
        paths = {path: attribute_at(layer, path) for path in calls[cls][0]}
        layer_norms = frozenset(path for path, module in paths.items() if module in norms)
        if not layer_norms:
            if registered_problem == QUIET:
                continue
            if registered_problem or any(child in norms for child in layer.children()):
                unreadable = derived_source.class_forward(cls)  # why its source gave no calls, if it did
                reason = registered_problem or (unreadable if isinstance(unreadable, str) else
                                                f"{_class_path(cls)}.forward calls none of its patched norms "
                                                "itself (the calls of the methods it calls are not read)")
                plan.report.skipped.append((name, f"residual adds not fused: {reason}"))
            continue
        sublayers = _sublayer_candidates(layer, calls[cls][1], norms, layers, plan, sublayer_kinds)
        key = (cls, layer_norms, frozenset(sublayers))
        if key not in codes:
            codes[key] = derived_sites.layer_code(cls, layer_norms, frozenset(sublayers))
        problem = plan.class_problem(cls) or instance_problem(layer)
        code = problem or codes[key]
        if registered_problem == QUIET and (isinstance(code, str) or not code.sites):
            continue
        if not isinstance(code, str) and not code.sites:
            code = "; ".join(r.text for r in code.refusals) or (
                f"no residual add sits next to a patched norm in {_class_path(cls)}.forward")
        if not isinstance(code, str):
            called = frozenset(site.sublayer for site in code.sites if site.sublayer)
            kind = derived_sites.DerivedLayerKind(_class_path(cls), code.sites, code.input_norm, layer_norms, called)
            try:
                for path in called:
                    fused.fused_class(type(sublayers[path]), sublayer_kinds[type(sublayers[path])])
                fused.fused_class(cls, kind)
            except Exception as exc:  # what the derived source cannot compile or decorate is left alone
                code = f"its derived forward failed to build ({type(exc).__name__}: {exc})"[:300]
        if isinstance(code, str):
            reason = f"{registered_problem}; {code}" if registered_problem and registered_problem != code else code
            plan.report.skipped.append((name, f"residual adds not fused: {reason}"))
            continue
        layers[layer] = (name, kind)
        plan.swaps.append((layer, kind))
        if kind.sublayers:
            plan.attrs.append((layer, SUBLAYER_LINKS_ATTR, _sublayer_links(layer, kind, sublayers)))
            plan.swaps.extend((sublayers[path], sublayer_kinds[type(sublayers[path])]) for path in kind.sublayers)
        if registered_problem:
            plan.report.skipped.append(
                (name, f"its forward is derived: no registered shape fits ({registered_problem})"))
        plan.report.skipped.extend((name, refusal.text) for refusal in code.refusals)
        for site in kind.inner_sites:
            plan.report.fused_adds.append(f"{name}: {site.label} -> "
                                          + " or ".join(norms[paths[norm]] for norm in site.norms))


def _sublayer_candidates(layer: nn.Module, paths: frozenset[tuple[str, ...]], norms: dict[nn.Module, str],
                         layers: dict[nn.Module, object], plan: _Plan,
                         kinds: dict[type, derived_sites.DerivedLayerKind | None]) -> dict[tuple[str, ...], nn.Module]:
    """The modules ``layer``'s forward calls (at ``paths``) whose one residual add is their output, returned alone
    or first in a tuple (``derived_sites``' "Sublayer outputs": BLOOM's attention and MLP, through
    ``dropout_add``), which hold no patched norm and which no other plan swaps; ``kinds`` caches each class's
    derived kind (None: none)."""
    found = {}
    for path in paths:
        module = attribute_at(layer, path)
        if not isinstance(module, nn.Module) or any(m in norms for m in module.modules()) or module in layers or any(
                module is swapped for swapped, _ in plan.swaps) or instance_problem(module):
            continue
        cls = type(module)
        if cls not in kinds:
            code = None if plan.class_problem(cls) else derived_sites.layer_code(cls, frozenset())
            sites = () if isinstance(code, str) or code is None or code.refusals else code.sites
            kinds[cls] = derived_sites.DerivedLayerKind(_class_path(cls), sites, None, frozenset()) if sites and all(
                site.position == "output" for site in sites) and len({s.in_tuple for s in sites}) == 1 else None
        if kinds[cls] is not None:
            found[path] = module
    return found


def _sublayer_links(layer: nn.Module, kind: derived_sites.DerivedLayerKind,
                    sublayers: dict[tuple[str, ...], nn.Module]) -> dict[nn.Module, NextNorm | None]:
    """Where each sublayer call of a derived layer hands its output sum: the layer's norm that reads it next, or
    None (the layer's output: the norm its own call is asked to hand on to)."""
    links: dict[nn.Module, NextNorm | None] = {}
    for site in kind.sites:
        if not site.sublayer:
            continue
        if site.norm:
            parent = attribute_at(layer, site.norm[:-1])
            norm = getattr(parent, site.norm[-1])
            links[sublayers[site.sublayer]] = NextNorm(norm, norm, parent, site.norm[-1])
        else:
            links[sublayers[site.sublayer]] = None
    return links


def _plan_blocks(layers: dict[nn.Module, tuple[str, object]], norms: dict[nn.Module, str], plan: _Plan) -> None:
    """Plans the blocks whose forward calls planned sublayers one after the other (``derived_blocks.py``): each
    sublayer's output add goes into the next sublayer's input norm, and the block becomes a layer of its stack's
    loop (``layers``), receiving into its first sublayer's input norm and handing on its last sublayer's add."""
    names = {name: (module, role) for name, module, role in plan.modules}
    candidates = dict.fromkeys(name.rsplit(".", depth)[0] for name, _ in layers.values()
                               for depth in (1, 2) if name.count(".") >= depth)
    codes: dict[type, derived_blocks.BlockCode | None] = {}
    for name in candidates:
        block, role = names[name]
        if block in layers or not may_derive(role):
            continue
        cls = type(block)
        if cls not in codes:
            codes[cls] = derived_blocks.block_code(cls)
        code = codes[cls]
        # A block is told about only where two of its calls reach planned layers: a handoff between them was asked.
        if code is None or len({m for site in code.sites if (m := site.module(block)) in layers}) < 2:
            continue
        problem = code.problem or plan.class_problem(cls) or instance_problem(block)
        if problem is None:
            planned = _block_kind(block, code, layers, norms)
            if planned is None:
                continue
            kind, links = planned
            try:
                fused.fused_class(cls, kind)
            except Exception as exc:  # what the derived source cannot compile or decorate is left alone
                problem = f"its derived forward failed to build ({type(exc).__name__}: {exc})"[:300]
        if problem is not None:
            plan.report.skipped.append((name, f"residual adds between sublayers not fused: {problem}"))
            continue
        layers[block] = (name, kind)
        plan.swaps.append((block, kind))
        plan.attrs.append((block, BLOCK_LINKS_ATTR, links))
        for site, link in zip(code.sites, links.sites):
            if link is not None:
                sublayer_name, sublayer_kind = layers[site.module(block)]
                plan.report.fused_adds.append(f"{sublayer_name}: {sublayer_kind.handoff_label} -> {norms[link.norm]}")


def _block_kind(block: nn.Module, code: derived_blocks.BlockCode, layers: dict[nn.Module, tuple[str, object]],
                norms: dict[nn.Module, str]) -> tuple[derived_blocks.DerivedBlockKind, BlockLinks] | None:
    """The kind of ``block`` and its links: call ``i`` hands on to call ``i + 1`` where both reach planned layers
    (two different ones) that hand off and receive into a patched norm; None where nothing would be handed on,
    inside the block or across it."""
    modules = [site.module(block) for site in code.sites]
    kinds = [layers[m][1] if m in layers else None for m in modules]
    links: list[NextNorm | None] = []
    for i in range(len(modules) - 1):
        sender, receiver = kinds[i], kinds[i + 1]
        link = None
        if (sender is not None and receiver is not None and modules[i] is not modules[i + 1]
                and sender.hands_off_last_add and receiver.input_norm is not None):
            link = _input_link(modules[i + 1], receiver.input_norm, norms)
        links.append(link)
    links.append(None)
    first = kinds[0] is not None and kinds[0].input_norm is not None and _input_link(
        modules[0], kinds[0].input_norm, norms) is not None
    input_norm = f"{_item_path(block, code.sites[0].path)}.{kinds[0].input_norm}" if first else None
    hands = kinds[-1] is not None and kinds[-1].hands_off_last_add
    if not any(links) and input_norm is None and not hands:
        return None
    kind = derived_blocks.DerivedBlockKind(
        _class_path(type(block)), code.sites, tuple(i for i, link in enumerate(links) if link is not None),
        input_norm, hands, code.returns_tuple)
    return kind, BlockLinks(modules[0] if first else None, tuple(links))


def _item_path(block: nn.Module, path: tuple[str | int, ...]) -> str:
    """``path`` as the dotted path ``getattr`` follows from ``block`` (a negative item index made positive)."""
    steps, module = [], block
    for step in path:
        if isinstance(step, int):
            step = step % len(module)
            module = module[step]
        else:
            module = getattr(module, step)
        steps.append(str(step))
    return ".".join(steps)


def _input_link(consumer: nn.Module, input_norm: str, norms: dict[nn.Module, str]) -> NextNorm | None:
    """The link to ``consumer``'s input norm (the dotted path ``input_norm`` from it), if that is a patched
    norm. A dotted path names a ModuleList item (``input_layernorm.0``) or a sublayer's norm: its parent is the
    module before the last step."""
    parent_path, _, attribute = input_norm.rpartition(".")
    parent = attribute_at(consumer, tuple(parent_path.split("."))) if parent_path else consumer
    norm = getattr(parent, attribute, None)
    return NextNorm(consumer, norm, parent, attribute) if norm in norms else None


def _plan_qk_attention(norms: dict[nn.Module, str], layers: dict[nn.Module, tuple[str, object]], plan: _Plan) -> None:
    """Plans the attention modules whose q/k norms and RoPE run as one launch (``qk_attention.py``). A module planned
    as a derived layer (``layers``: one class swap per module) is no candidate: its norms read its input or a
    residual sum (DBRX's ``DbrxNormAttentionNorm``: an input norm, the attention, the add and the next norm; BLT's
    cross-attention, whose ``q_norm`` and ``k_norm`` normalise its two inputs, no RoPE following)."""
    candidates = [(name, module) for name, module, role in plan.modules if role is Role.OTHER and module not in layers]
    fused_attention, skipped = qk_attention.plan_attention(candidates, norms, plan.class_problem)
    for name, module, kind in fused_attention:
        try:
            fused.fused_class(type(module), kind)
        except Exception as exc:  # what the derived source cannot compile or decorate is left alone
            plan.report.skipped.append((name, f"{qk_attention.UNFUSED}its derived forward failed to build "
                                              f"({type(exc).__name__}: {exc})"[:300]))
            continue
        plan.swaps.append((module, kind))
        plan.report.fused_qk.append(f"{name}: {kind.label}")
    plan.report.skipped.extend(skipped)


def _plan_layers(
    candidates: list[tuple[str, nn.Module, tuple[LayerKind, ...]]], norms: dict[nn.Module, str], plan: _Plan
) -> tuple[dict[nn.Module, tuple[str, LayerKind]], list[tuple[str, nn.Module, str]]]:
    """Plans the swaps of the decoder layers whose structure matches one of their kinds (the first that does);
    returns them, and the others with why none fitted. A parallel block fuses nothing inside itself: its one add
    goes to the next norm (handoffs)."""
    layers: dict[nn.Module, tuple[str, LayerKind]] = {}
    unmatched: list[tuple[str, nn.Module, str]] = []
    for name, layer, kinds in candidates:
        problems: dict[str, None] = {}
        for kind in kinds:
            problem = plan.class_problem(type(layer)) or _layer_problem(layer, kind, norms) or instance_problem(layer)
            if problem is None:
                break
            problems.setdefault(problem)
        else:
            unmatched.append((name, layer, "; ".join(problems)))
            continue
        layers[layer] = (name, kind)
        plan.swaps.append((layer, kind))
        for label, norm, dropout in kind.shape.inner_adds(kind):
            plan.report.fused_adds.append(
                f"{name}: {label} -> {norms[getattr(layer, norm)]}" + while_inactive(dropout))
    return layers, unmatched


def _plan_handoffs(
    stacks: list[tuple[str, nn.Module, StackKind]],
    layers: dict[nn.Module, tuple[str, LayerKind]],
    norms: dict[nn.Module, str],
    plan: _Plan,
) -> None:
    """Plans the stacks whose layers fuse their last residual add into the next norm: the stack's class swap (its
    forward, derived from its own, hands each layer's normed output on) and its table of links (``handoff.py``)."""
    for name, stack, kind in stacks:
        links = _stack_links(stack, kind, layers, norms)
        if not links:
            continue
        problem = plan.class_problem(type(stack)) or instance_problem(stack)
        if problem is None:
            try:
                fused.fused_class(type(stack), kind)
            except Exception as exc:  # a forward whose loop cannot be derived keeps its adds apart
                problem = f"its derived forward failed to build ({type(exc).__name__}: {exc})"[:300]
        if problem:
            plan.report.skipped.append((name, f"residual adds across layers not fused: {problem}"))
            continue
        plan.swaps.append((stack, kind))
        plan.attrs.append((stack, LINKS_ATTR, links))
        for layer, target in links.items():
            layer_name, layer_kind = layers[layer]
            line = f"{layer_name}: {layer_kind.handoff_label} -> "
            inside = layer_kind.last_add_inside
            guarded = getattr(layer_kind, "guarded_output", None)
            if guarded is not None:  # reported with the layer's own norms it may go into: else the next norm
                reported = next(k for k, text in enumerate(plan.report.fused_adds)
                                if text.startswith(f"{layer_name}: {guarded.label} -> "))
                plan.report.fused_adds[reported] += f", else {norms[target.norm]}"
            elif inside is None:
                plan.report.fused_adds.append(f"{line}{norms[target.norm]}"
                                              + while_inactive(layer_kind.handoff_dropout))
            else:  # an add already reported inside the layer: one add, now with the next norm too
                reported = plan.report.fused_adds.index(f"{line}{norms[getattr(layer, inside)]}")
                plan.report.fused_adds[reported] += f", then {norms[target.norm]}"


def _report_unread_stacks(
    stacks: list[tuple[str, nn.Module, StackKind]], layers: dict[nn.Module, tuple[str, LayerKind]], plan: _Plan
) -> None:
    """Reports the stacks whose forward could not be read (its source is not the code running, or another
    library's wrapper runs) and whose layers would hand their last add on: those handoffs are not planned, and the
    report says why, once per stack (the nearest stack holding such a layer)."""
    read = {name for name, _, _ in stacks}
    holders = {name: module for name, module, role in plan.modules if role is Role.STACK and name not in read}
    linked = {layer for _, attr, links in plan.attrs if attr == LINKS_ATTR for layer in links}
    reported: set[str] = set()
    for layer, (name, kind) in layers.items():
        if layer in linked or not kind.hands_off_last_add:
            continue
        nearest = max((s for s in read | holders.keys() if name.startswith(f"{s}.") or not s), key=len, default=None)
        if nearest is None or nearest not in holders or nearest in reported:
            continue
        reason = derived_source.class_forward(type(holders[nearest]))
        if isinstance(reason, str):
            reported.add(nearest)
            plan.report.skipped.append((nearest, f"residual adds across layers not fused: {reason}"))


def _unplan_layers_fusing_nothing(layers: dict[nn.Module, tuple[str, LayerKind]], plan: _Plan) -> None:
    """Keeps the original class of a layer whose shape fuses no add inside it (a parallel block) when no stack
    links it to a next norm either: patched, it would run its adds unfused all the same, and say nothing. A block
    of sublayers is judged first; a sublayer of a block kept stays (its block's forward calls it with what it
    hands on or receives)."""
    linked = {layer for _, attr, links in plan.attrs if attr == LINKS_ATTR for layer in links}
    blocks = [(block, name, kind) for block, (name, kind) in layers.items()
              if isinstance(kind, derived_blocks.DerivedBlockKind)]
    for block, name, kind in blocks:
        if not kind.fuses_inside and block not in linked:
            _unplan(block, name, kind, plan)
            plan.attrs.remove(next(a for a in plan.attrs if a[0] is block and a[1] == BLOCK_LINKS_ATTR))
        else:
            linked.update(site.module(block) for site in kind.sites)
    for layer, (name, kind) in layers.items():
        if not kind.fuses_inside and layer not in linked and not isinstance(kind, derived_blocks.DerivedBlockKind):
            _unplan(layer, name, kind, plan)


def _unplan(layer: nn.Module, name: str, kind, plan: _Plan) -> None:
    plan.swaps.remove((layer, kind))
    # A derived layer's sublayers were swapped for it alone: they go with it, and its links.
    links = next((a for a in plan.attrs if a[0] is layer and a[1] == SUBLAYER_LINKS_ATTR), None)
    if links is not None:
        plan.attrs.remove(links)
        plan.swaps[:] = [(module, k) for module, k in plan.swaps if module not in links[2]]
    plan.report.skipped.append((name, f"residual adds not fused: a {kind.block}'s add can only go into the next "
                                      "norm's kernel, and no model forward of known code runs this layer"))


def _stack_links(
    stack: nn.Module, kind: StackKind, layers: dict[nn.Module, tuple[str, LayerKind]], norms: dict[nn.Module, str]
) -> dict[nn.Module, NextNorm]:
    """Where the MLP residual sum of each patched layer of ``stack`` goes, for the layers followed by a patched
    layer or, for the last one, by a patched final norm."""
    layer_list = getattr(stack, kind.layers, None)
    final_norm = None if kind.final_norm is None else getattr(stack, kind.final_norm, None)
    if not isinstance(layer_list, nn.ModuleList):
        return {}
    links = {}
    for i, layer in enumerate(layer_list):
        # A layer whose shape fuses its last add inside it (post-norm) hands nothing on.
        if layer not in layers or not layers[layer][1].hands_off_last_add:
            continue
        if i + 1 < len(layer_list):
            consumer = layer_list[i + 1]
            if consumer not in layers or layers[consumer][1].input_norm is None:
                continue
            link = _input_link(consumer, layers[consumer][1].input_norm, norms)
            if link is not None:
                links[layer] = link
        elif final_norm in norms:
            links[layer] = NextNorm(final_norm, final_norm, stack, kind.final_norm)
    return links


def _class_problem(cls: type) -> str | None:
    """A known class whose forward another library replaced or wrapped is no longer the class the family
    describes (``derived_source.foreign_forward``)."""
    return derived_source.foreign_forward(cls)


def _norm_attribute_problem(norm: nn.Module, kind: NormKind) -> str | None:
    """Why ``norm`` lacks an attribute its kind's forward reads, if it does."""
    if kind.weight_attr is not None and not isinstance(getattr(norm, kind.weight_attr, None), Tensor):
        return f"{type(norm).__name__} has no {kind.weight_attr} tensor"
    if kind.eps_attr is not None and not isinstance(getattr(norm, kind.eps_attr, None), (int, float)):
        return f"{type(norm).__name__} has no numeric {kind.eps_attr}"
    if kind.bias_attr is not None and not isinstance(getattr(norm, kind.bias_attr, ()), (Tensor, type(None))):
        return f"{type(norm).__name__}.{kind.bias_attr} is neither a tensor nor None"
    return None


def _plan_hub_forwards(plan: _Plan) -> None:
    """Records the hub-kernel forward of each planned module that runs one in place of its class's, for
    ``patch_model`` to set aside, and names its hub layer in the report."""
    planned = {module for module, _ in plan.swaps}
    for name, module, _ in plan.modules:
        forward = hub_forward(module) if module in planned else None
        if forward is not None:
            plan.hub_forwards[module] = forward
            plan.report.hub_forwards.append(
                f"{name}: hub layer {function_path(forward).removesuffix('.forward')} "
                f"(kernel_layer_name {type(module).kernel_layer_name!r}) set aside, the fused forward runs"
            )


def _layer_problem(layer: nn.Module, kind: LayerKind, norms: dict[nn.Module, str]) -> str | None:
    """Why ``layer`` does not have the structure ``kind`` describes, if it does not."""
    params = list(inspect.signature(type(layer).forward).parameters.values())[1:]
    names = fused.layer_arg_names(type(layer))
    if not kind.matches(names) or params[-1].kind is not inspect.Parameter.VAR_KEYWORD or len(params) != len(
        names
    ) + 1:
        return f"forward({', '.join(str(p) for p in params)}) is not the signature this transformers family had"
    for attr in kind.norms:
        norm = getattr(layer, attr, None)
        if norm not in norms:
            # PEFT's modules_to_save wrapper keeps the norm as its original_module, beside the copy it trains.
            hint = (
                " (it wraps one, as PEFT's modules_to_save does: call patch_model before get_peft_model to fuse "
                "this layer's adds)" if getattr(norm, "original_module", None) in norms else ""
            )
            return f"{attr} is a {type(norm).__name__}, not a patched norm{hint}"
    attention = kind.attention
    if kind.mixer_switch is not None:
        switch = getattr(layer, kind.mixer_switch, None)
        mixer = kind.mixer_for(switch)
        if mixer is None:
            return f"its {kind.mixer_switch} {switch!r} is not a token mixer this layer body knows"
        attention = mixer.attribute
        if mixer.takes_cache_by_name and isinstance(getattr(layer, attention, None), nn.Module):
            cache = next(name for name in names if name in CACHE_PARAM_SPELLINGS)
            if cache not in inspect.signature(type(getattr(layer, attention)).forward).parameters:
                return f"its {attention} takes no {cache} argument (this transformers renames it on the way)"
    for attr in (attention, kind.mlp):
        if not isinstance(getattr(layer, attr, None), nn.Module):
            return f"it has no {attr} module"
    for attr in kind.unsupported_if:
        if getattr(layer, attr, None):
            return f"its {attr} makes it more than a {kind.shape.block}"
    for attr in kind.requires:
        if not getattr(layer, attr, None):
            return f"it is not a {kind.shape.block} without {attr}"
    for attr in (kind.attention_dropout, kind.mlp_dropout):
        if attr is not None and not isinstance(getattr(layer, attr, None), nn.Dropout):
            return f"{attr} is not an nn.Dropout"
    if kind.residual_scale is not None and not isinstance(getattr(layer, kind.residual_scale, None), (int, float)):
        return f"{kind.residual_scale} is not a number"
    return kind.shape.problem(layer, kind)
