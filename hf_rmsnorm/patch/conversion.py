"""LayerNorms: every ``nn.LayerNorm`` runs the fused kernels exactly, and the explicit conversion to RMSNorm.

**Default, ``layernorm="fuse"``.** Every ``nn.LayerNorm`` of the model, wherever it sits (pre-LN, parallel and
post-LN decoders, encoders, encoder-decoders, vision towers, inside attention), becomes a fused module running the
kernels' ``"layernorm"`` mode: the row mean subtracted, the residual add fused where the code next to it allows
(``derived_sites.py``), otherwise exactly ``nn.LayerNorm``'s maths, fp64 kept in fp64; one without affine
parameters or without a bias too. Patching a LayerNorm alone needs no argument about the model around it: the
module computes what it computed. Nothing else changes: no weight, no hook, no state. The patched model computes
what the unpatched one computes in every dtype, in training and in inference, whatever happens to its weights
afterwards (LoRA, merges, ``.data`` updates, casts, ``torch.compile``). A model's own ``*LayerNorm`` classes
(subclasses of ``nn.LayerNorm`` included) are recognised by what they compute (``recognition.py``).

**Explicit, ``layernorm="rmsnorm"``: a one-time conversion to an RMSNorm model.** With ``C = I - 11^T/d``,
``LN(Ch) = LN(h)``, and on a zero-mean row a LayerNorm *is* an RMSNorm with the same weight, bias and eps. In a
pre-LN decoder every reader of the residual stream is a LayerNorm, so once everything writing into the stream
is mean-free, the stream stays zero-mean and each LayerNorm may run as an RMSNorm (the ``"layernorm_as_rmsnorm"``
mode, which skips the mean). When ``patch_model`` is called, and never again:

* the attention output and MLP down projections of every layer are centred in place, their means computed in
  fp64 (``nn.Linear``: ``W -= W.mean(0)``; GPT-2's ``Conv1D``: ``W -= W.mean(1)``; ``b -= b.mean()``); the
  report lists every parameter changed;
* the stream is centred where it enters the first layer, on every forward, by a stateless forward pre-hook on
  that layer: one mean and one subtraction. That covers the token, position and token-type embeddings and any
  ``inputs_embeds`` a caller passes, and leaves the embedding tables alone, so a table tied to the LM head keeps
  the logits exact without being untied.

Centring adds to each writer's output a multiple of the all-ones vector, which every LayerNorm ignores: the
centred weights give the same outputs in the unpatched model, and ``unpatch_model`` keeps them. From then on
the model *is* an RMSNorm model: training it, adding adapters to its writers or loading other weights into them
changes that model, and a residual dropout mask applied to a centred writer's output is not the mask on the
original output plus a constant. Convert a model when it is final; fine-tune with the default.

Only a pre-LN decoder of a registered family, whose stream this argument follows, is converted; a model without one
(BERT and the other post-LN encoders, encoder-decoders) is refused with the reason, and the LayerNorms outside a
converted stack run exactly as by default. A LayerNorm of the model's own class (DeBERTa's, Cohere's: a norm the
patcher recognises in a centring mode) is no ``nn.LayerNorm`` reader of a known stream: a model with one is refused
too (``LayerNormPlan.own_class_skip``), and ``layernorm="skip"`` leaves it alone as it leaves ``nn.LayerNorm``. Only fp32 (or fp64) writers are converted: rounding centred weights
back to fp16/bf16 rounds every writer weight a second time (tiny GPT-2: mean logit error 1.10x eager's in bf16,
1.11x in fp16). A half-precision model is refused; convert its fp32 weights, then cast the converted model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ops.modes import get_mode
from .classify import Role, norm_role
from .derived_syntax import attribute_at
from .families import (
    EXACT_LAYERNORM_FAMILY, LAYERNORM, LAYERNORM_AS_RMSNORM, LAYERNORM_WITHOUT_AFFINE, NormKind, ResidualStream,
    StackKind,
)
from .report import UnconvertibleModelError

LAYERNORM_CHOICES = ("fuse", "rmsnorm", "skip")


_SKIPPED_ON_REQUEST = "LayerNorm left alone on request (layernorm='skip')"


@dataclass
class Writer:
    """A module whose output is added to the residual stream, and the dimension of its weight that indexes the
    hidden size."""

    name: str
    module: nn.Module
    out_dim: int


@dataclass
class LayerNormPlan:
    """What one ``patch_model`` call does to the LayerNorms of its model, and the means to apply and undo it."""

    norms: dict[nn.Module, tuple[str, NormKind]] = field(default_factory=dict)
    skipped: dict[nn.Module, str] = field(default_factory=dict)
    writers: list[Writer] = field(default_factory=list)
    entrances: dict[nn.Module, str] = field(default_factory=dict)
    option: str = "fuse"

    def own_class_skip(self, model_name: str, name: str, module: nn.Module, kind: NormKind) -> str | None:
        """For a norm of the model's own class (not ``nn.LayerNorm``, which the plan above covers) that the patcher
        would run in ``kind``: the reason it is left alone when it is a LayerNorm (a centring mode) and the option
        says ``"skip"``; None when it is patched as usual.

        Raises:
            UnconvertibleModelError: it is a LayerNorm and the option says ``"rmsnorm"``: the conversion's argument
                covers ``nn.LayerNorm`` readers of a known stream only.
        """
        if module in self.norms or not get_mode(kind.mode).centre or self.option == "fuse":
            return None
        if self.option == "skip":
            return _SKIPPED_ON_REQUEST
        raise UnconvertibleModelError(
            f"cannot convert {model_name}'s LayerNorms to RMSNorm exactly: {name} is a {type(module).__name__}, a "
            "LayerNorm of the model's own class, which the conversion does not cover (it converts nn.LayerNorm "
            "readers of a pre-LN decoder's stream); patch_model(model) without layernorm='rmsnorm' runs it as an "
            "exact fused LayerNorm"
        )

    def converts(self, module: nn.Module) -> bool:
        """Whether ``module`` is a LayerNorm this plan converts to RMSNorm."""
        return module in self.norms and self.norms[module][1] is LAYERNORM_AS_RMSNORM

    @property
    def centred(self) -> list[str]:
        """The parameters the conversion changes."""
        return [f"{w.name}.{p}" for w in self.writers for p in ("weight", "bias")
                if isinstance(getattr(w.module, p, None), Tensor)]

    def apply(self) -> None:
        """Installs the entrance hooks, then centres the writers. The means are all computed (the only
        allocations) before any weight changes, and the in-place subtraction in the weight's own dtype needs no
        temporary, so a failure leaves every weight as it was."""
        for entrance in self.entrances:
            entrance.register_forward_pre_hook(centre_stream, with_kwargs=True)
        means = [_writer_means(w) for w in self.writers]
        with torch.no_grad():
            for w, (weight_mean, bias_mean) in zip(self.writers, means):
                w.module.weight.sub_(weight_mean)
                if bias_mean is not None:
                    w.module.bias.sub_(bias_mean)

    def remove_hooks(self) -> None:
        for entrance in self.entrances:
            remove_entrance_hook(entrance)


def centre_stream(layer: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the first layer of a converted stack: its input minus the row mean (stateless)."""
    if args:
        return (_centre(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        kwargs["hidden_states"] = _centre(kwargs["hidden_states"])
        return args, kwargs
    return None


def _centre(h: Tensor) -> Tensor:
    if not h.is_floating_point():
        return h
    f = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    return (f - f.mean(-1, keepdim=True)).to(h.dtype)


def remove_entrance_hook(entrance: nn.Module) -> None:
    # By identity, not through a handle: a copied model's handle would point at the original's hook dict.
    for key, hook in list(entrance._forward_pre_hooks.items()):
        if hook is centre_stream:
            del entrance._forward_pre_hooks[key]
            entrance._forward_pre_hooks_with_kwargs.pop(key, None)


def _writer_means(w: Writer) -> tuple[Tensor, Tensor | None]:
    """The means to subtract from ``w``'s weight (broadcastable) and bias: computed in fp64, rounded to the
    parameter's dtype."""
    weight = w.module.weight.detach()
    weight_mean = weight.double().mean(w.out_dim, keepdim=True).to(weight.dtype)
    bias = getattr(w.module, "bias", None)
    bias_mean = bias.detach().double().mean().to(bias.dtype) if isinstance(bias, Tensor) else None
    return weight_mean, bias_mean


def plan_layernorms(model_name: str, modules: list[tuple[str, nn.Module, Role]],
                    stacks: dict[type, tuple[str, StackKind]], layernorm: str) -> LayerNormPlan:
    """Plans what happens to the ``nn.LayerNorm`` modules among ``modules`` (the patcher's classified walk of the
    model called ``model_name``: every module with its name and role); nothing is changed. ``stacks`` is the
    registry's stack table: a LayerNorm inside a registered stack is reported under that stack's family.

    Raises:
        ValueError: ``layernorm`` is not one of ``LAYERNORM_CHOICES``.
        UnconvertibleModelError: ``layernorm="rmsnorm"`` and a stack cannot be converted exactly, or the model
            has LayerNorms and no stack whose stream the conversion's argument follows.
    """
    if layernorm not in LAYERNORM_CHOICES:
        raise ValueError(f"layernorm must be one of {', '.join(map(repr, LAYERNORM_CHOICES))}, got {layernorm!r}")
    plan = LayerNormPlan(option=layernorm)
    families: dict[nn.Module, str] = {}
    problems = []
    for name, module, role in modules:
        family, kind = stacks[type(module)] if role is Role.REGISTERED_STACK else (None, None)
        if kind is None or kind.stream is None:
            continue
        families.update((m, family) for m in module.modules() if _is_torch_layer_norm(m))
        if layernorm != "rmsnorm":
            continue
        if problem := _conversion_problem(module, kind):
            problems.append(f"{name or type(module).__name__} ({family}): {problem}")
        else:
            _plan_conversion(plan, family, name, module, kind)
    if problems:
        raise UnconvertibleModelError(
            f"cannot convert {model_name}'s LayerNorms to RMSNorm exactly: {'; '.join(problems)}. "
            "patch_model(model) without layernorm='rmsnorm' runs them as exact fused LayerNorms"
        )
    layer_norms = [m for _, m, _ in modules if _is_torch_layer_norm(m)]
    if layernorm == "rmsnorm" and layer_norms and not plan.norms:
        raise UnconvertibleModelError(
            f"{model_name} normalises with nn.LayerNorm but is not a pre-LN decoder of a supported family (post-LN "
            "models and encoders normalise residual sums, which are not zero-mean), so it cannot be converted to "
            "RMSNorm exactly; patch_model(model) without layernorm='rmsnorm' runs its LayerNorms as exact fused "
            "LayerNorms; supported families: hf_rmsnorm.patch.family_names()"
        )
    for module in layer_norms:
        if module in plan.norms or module in plan.skipped:
            continue
        if layernorm == "skip":
            plan.skipped[module] = _SKIPPED_ON_REQUEST
        elif problem := _layernorm_problem(module, None):
            plan.skipped[module] = f"LayerNorm left alone ({problem}); it stays an exact nn.LayerNorm"
        else:
            plan.norms[module] = (families.get(module, EXACT_LAYERNORM_FAMILY), exact_layernorm_kind(module))
    return plan


def _readers(stack: nn.Module, kind: StackKind) -> dict[nn.Module, str]:
    """The LayerNorms (or whatever sits at their paths) reading ``stack``'s residual stream, with their paths."""
    readers = {}
    layers = getattr(stack, kind.layers, None)
    for i, layer in enumerate(layers if isinstance(layers, nn.ModuleList) else ()):
        for path in kind.stream.norms:
            norm = _submodule_at(layer, path)
            if norm is not None:
                readers[norm] = f"{kind.layers}.{i}.{path}"
    final = getattr(stack, kind.final_norm, None)
    if isinstance(final, nn.Module):
        readers[final] = kind.final_norm
    return readers


def _plan_converted_norms(plan: LayerNormPlan, family: str, stack: nn.Module, kind: StackKind, hidden: int) -> None:
    """Plans the conversion to RMSNorm of every reader of the stream that takes it (any other LayerNorm stays exact:
    ``LN(Ch) = LN(h)`` holds for a converted stream too)."""
    for module in _readers(stack, kind):
        if not _layernorm_problem(module, hidden) and module.weight is not None:
            plan.norms[module] = (family, LAYERNORM_AS_RMSNORM)


def _is_torch_layer_norm(module: nn.Module) -> bool:
    return norm_role(type(module)) is Role.TORCH_LAYER_NORM


def _plan_conversion(plan: LayerNormPlan, family: str, name: str, stack: nn.Module, kind: StackKind) -> None:
    prefix = f"{name}." if name else ""
    layers = getattr(stack, kind.layers)
    hidden = getattr(stack, kind.final_norm).normalized_shape[-1]
    _plan_converted_norms(plan, family, stack, kind, hidden)
    plan.entrances[layers[0]] = f"{prefix}{kind.layers}.0"
    for i, layer in enumerate(layers):
        for path, writer in _writers(layer, kind.stream):
            plan.writers.append(Writer(f"{prefix}{kind.layers}.{i}.{path}", writer, _writer_out_dim(writer, hidden)))


def _conversion_problem(stack: nn.Module, kind: StackKind) -> str | None:
    """Why ``stack`` cannot be converted to RMSNorm exactly, if it cannot."""
    if kind.stream.not_pre_ln is not None and (problem := kind.stream.not_pre_ln(stack)):
        return problem
    layers = getattr(stack, kind.layers, None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return f"it has no layers in {kind.layers}"
    final = getattr(stack, kind.final_norm, None)
    if type(final) is not nn.LayerNorm:
        return f"its final norm {kind.final_norm} is not an nn.LayerNorm, so the head would read the stream"
    hidden = final.normalized_shape[-1]
    for i, layer in enumerate(layers):
        for path, writer in _writers(layer, kind.stream):
            if isinstance(reason := _writer_out_dim(writer, hidden), str):
                return f"writer {kind.layers}.{i}.{path} cannot be centred: {reason}"
            if writer.weight.dtype in (torch.float16, torch.bfloat16):
                return (
                    f"writer {kind.layers}.{i}.{path} is stored in {str(writer.weight.dtype).removeprefix('torch.')}, "
                    "and centring would round its weights again; load the model in float32, convert it, then cast it"
                )
    return None


def _writers(layer: nn.Module, stream: ResidualStream):
    for path in stream.writers:
        writer = _submodule_at(layer, path)
        if writer is not None:
            yield path, writer


def _writer_out_dim(module: nn.Module, hidden: int) -> int | str:
    """The output dimension of a writer's weight, or why it cannot be centred."""
    weight = getattr(module, "weight", None)
    if type(weight) is not nn.Parameter or not weight.is_floating_point() or weight.dim() != 2:
        return f"its weight is not a floating-point matrix ({type(weight).__name__})"
    bias = getattr(module, "bias", None)
    if bias is not None and (type(bias) is not nn.Parameter or bias.shape != (hidden,)):
        return "its bias is not a hidden-sized parameter"
    if isinstance(module, nn.Linear) and weight.shape[0] == hidden:
        return 0
    if type(module).__name__ == "Conv1D" and weight.shape[1] == hidden:
        return 1
    return f"{type(module).__name__} is not an nn.Linear or GPT-2 Conv1D writing the hidden size"


def _submodule_at(layer: nn.Module, path: str) -> nn.Module | None:
    """The module at the dotted ``path`` of a family's stream, None where the path ends early or holds no module."""
    module = attribute_at(layer, tuple(path.split(".")))
    return module if isinstance(module, nn.Module) else None


def _layernorm_problem(norm: nn.Module, hidden: int | None) -> str | None:
    """Why the kernels cannot compute ``norm`` (over ``hidden`` features, when given), if they cannot."""
    if type(norm) is not nn.LayerNorm:
        return f"{type(norm).__name__} is not exactly nn.LayerNorm"
    if len(norm.normalized_shape) != 1 or (hidden is not None and norm.normalized_shape[0] != hidden):
        return f"normalized_shape {tuple(norm.normalized_shape)} is not ({hidden or 'hidden'},)"
    return None


def exact_layernorm_kind(norm: nn.LayerNorm) -> NormKind:
    """The kind that runs ``norm`` exactly: ``LAYERNORM``, or without affine parameters
    (``elementwise_affine=False``: no weight and no bias to read)."""
    return LAYERNORM if norm.weight is not None else LAYERNORM_WITHOUT_AFFINE
