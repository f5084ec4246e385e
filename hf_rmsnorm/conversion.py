"""Exact LayerNorm -> RMSNorm conversion of pre-LN decoders (REFERENCE.md section 2).

With ``C = I - 11^T/d``, ``LN(Ch) = LN(h)``, and on a zero-mean row ``LN`` is an RMSNorm with the same weight,
bias and eps. In a pre-LN decoder every reader of the residual stream is a LayerNorm, so once everything that
writes into the stream is centred the stream stays zero-mean and each LayerNorm may run as an RMSNorm:

* the attention output projection and the MLP down projection of every layer are centred in place, in fp64
  and stored back in their dtype (``nn.Linear``: ``W -= W.mean(0)``, GPT-2's ``Conv1D``: ``W -= W.mean(1)``,
  ``b -= b.mean()``), at the model's first inference forward (eval mode, no autograd), never while or after
  it trains (see below);
* the stream is centred where it enters the first layer (a forward pre-hook on that layer: one mean and one
  subtraction per forward). That covers the token, position and token-type embeddings, OPT's ``project_in``
  and ``inputs_embeds`` passed by the caller at once, and it leaves the embedding tables alone, so a table
  tied to the LM head keeps the logits exact without untying it (no second copy of the table).

Centring adds to each writer's output a multiple of the all-ones vector, which every LayerNorm ignores: the
centred weights give the same outputs in the unpatched model, and ``unpatch_model`` keeps them.

Which kernel mode a converted norm runs (``_StreamState.mode``): the pure RMSNorm (``"fp32_affine"``) only in
inference on a stream known to be centred; the exact fused LayerNorm (``"layernorm"``, mean subtracted) when
autograd records, when the module is in training mode, or when the writers changed since they were centred
(an optimizer step, ``load_state_dict``, an adapter wrapped around a writer: every forward checks the writers'
modules and parameter versions at the first layer).

Training runs the original model's maths. The writers are not centred when a model trains before any
inference, and a model that has been in training mode is never centred automatically: a residual dropout mask
applied to a centred writer's output is not the mask applied to the original output plus a multiple of the
all-ones vector, so centred writers would train a different model (GPT-2 at its default ``resid_pdrop=0.1``:
logits 0.065 off). Without active dropout, centred writers also train exactly (the LayerNorm backward already
removes the mean component the centring removed, and the mean components the updates add stay invisible to
every LayerNorm). After training, ``recentre(model)`` centres the writers and returns inference to the
RMSNorm path; until then inference runs the (equally exact) LayerNorm mode.

Half-precision models are not centred: rounding the centred weights back to fp16/bf16 changes every writer
weight by up to half an ulp, which measurably costs accuracy (tiny GPT-2: mean logit error 1.10x eager's in
bf16, 1.11x in fp16). Their LayerNorms still become the fused modules, running the LayerNorm mode, whose
memory traffic is the RMSNorm's; the weights stay bit for bit the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .families import NormKind, resolve_class

_LN_PATH = "torch.nn.modules.normalization.LayerNorm"
_HALF = (torch.float16, torch.bfloat16)
# A converted LayerNorm: its weight, bias and eps, the kernel mode chosen per call (see _StreamState.mode).
LN_KIND = NormKind(_LN_PATH, eps_attr="eps", mode="layernorm", bias_attr="bias")
LN_KIND_NO_BIAS = NormKind(_LN_PATH, eps_attr="eps", mode="layernorm")


@dataclass(frozen=True)
class LayerNormFamily:
    """A pre-LN decoder: ``stack`` runs ``for layer in stack.<layers>: h = layer(h, ...)`` then
    ``stack.<final_norm>(h)``, and nothing after the first layer reads ``h`` except the LayerNorms named here.

    ``norms`` and ``writers`` are paths inside each layer (a path whose module is absent or ``None`` is skipped:
    Falcon and StableLM build different norms per config); ``problem`` says why an instance is not pre-LN.
    """

    name: str
    stack: str
    layers: str
    final_norm: str
    norms: tuple[str, ...]
    writers: tuple[str, ...]
    problem: Callable[[nn.Module], str | None] | None = None


def _opt_problem(decoder: nn.Module) -> str | None:
    if not decoder.config.do_layer_norm_before:
        return "it is post-LN (do_layer_norm_before=False, as OPT-350m): its LayerNorms read the residual sums"
    return None


_M = "transformers.models"
LAYERNORM_FAMILIES: tuple[LayerNormFamily, ...] = (
    LayerNormFamily(
        "GPT-2", f"{_M}.gpt2.modeling_gpt2.GPT2Model", "h", "ln_f",
        norms=("ln_1", "ln_cross_attn", "ln_2"), writers=("attn.c_proj", "crossattention.c_proj", "mlp.c_proj"),
    ),
    LayerNormFamily(
        "GPT-NeoX", f"{_M}.gpt_neox.modeling_gpt_neox.GPTNeoXModel", "layers", "final_layer_norm",
        norms=("input_layernorm", "post_attention_layernorm"), writers=("attention.dense", "mlp.dense_4h_to_h"),
    ),
    LayerNormFamily(
        "OPT", f"{_M}.opt.modeling_opt.OPTDecoder", "layers", "final_layer_norm",
        norms=("self_attn_layer_norm", "final_layer_norm"), writers=("self_attn.out_proj", "fc2"),
        problem=_opt_problem,
    ),
    LayerNormFamily(
        "Phi", f"{_M}.phi.modeling_phi.PhiModel", "layers", "final_layernorm",
        norms=("input_layernorm",), writers=("self_attn.dense", "mlp.fc2"),
    ),
    LayerNormFamily(
        "Falcon", f"{_M}.falcon.modeling_falcon.FalconModel", "h", "ln_f",
        norms=("input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp"),
        writers=("self_attention.dense", "mlp.dense_4h_to_h"),
    ),
    LayerNormFamily(
        "GPT-J", f"{_M}.gptj.modeling_gptj.GPTJModel", "h", "ln_f",
        norms=("ln_1",), writers=("attn.out_proj", "mlp.fc_out"),
    ),
    LayerNormFamily(
        "StableLM", f"{_M}.stablelm.modeling_stablelm.StableLmModel", "layers", "norm",
        norms=("input_layernorm", "post_attention_layernorm"), writers=("self_attn.o_proj", "mlp.down_proj"),
    ),
)


def family_names() -> str:
    return ", ".join(f.name for f in LAYERNORM_FAMILIES)


@dataclass
class _Writer:
    name: str
    parent: nn.Module
    attr: str
    module: nn.Module
    out_dim: int  # the dimension of ``weight`` that indexes the hidden size


@dataclass
class _StreamState:
    """Shared by the converted norms of one stack: whether the stream is known to be centred."""

    writers: list[_Writer]
    # Writers stored in fp16/bf16: centring would round every writer weight once more (on tiny GPT-2 that made
    # the logits ~10% less accurate than eager), so they are left as they are and the norms run the fused
    # LayerNorm mode, which costs the same memory traffic.
    half: bool = False
    centred: bool = False
    # Set by the first forward in training mode: from then on only recentre() centres the writers.
    trained: bool = False
    # What "unchanged since centred" compares, taken by recentre(): each writer's place, each writer parameter's
    # place, and the sum of those parameters' version counters (counters only grow, so an equal sum means no
    # parameter was modified in place).
    _places: list[tuple[dict, str, object]] = field(default_factory=list)
    _params: list[Tensor] = field(default_factory=list)
    _version_sum: int = -1

    def _unchanged(self) -> bool:
        # Runs once per forward: flat lists and early exits keep it to a few microseconds for a 32-layer model.
        return all(table.get(key) is value for table, key, value in self._places) and (
            sum(p._version for p in self._params) == self._version_sum
        )

    def recentre(self) -> None:
        """Centres the writers, unless they are stored in fp16/bf16 (then they stay as they are)."""
        self.half = any(w.module.weight.dtype in _HALF for w in self.writers)
        if self.half:
            self.centred = False
            return
        with torch.no_grad():
            for w in self.writers:
                centre_writer(w.module, w.out_dim)
        self._places = [(w.parent._modules, w.attr, w.module) for w in self.writers]
        self._params = []
        for w in self.writers:
            for name in ("weight", "bias"):
                p = w.module._parameters.get(name)
                if p is not None:
                    self._places.append((w.module._parameters, name, p))
                    self._params.append(p)
        self._version_sum = sum(p._version for p in self._params)
        self.centred = True

    def enter(self, layer: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of the first layer: checks the writers, centres them at the first inference forward
        of a model that never trained, and centres the stream of a centred model."""
        if layer.training:
            self.trained = True
        if self.centred and not self._unchanged():
            self.centred = False
        if not (self.centred or self.half or self.trained or torch.is_grad_enabled()):
            self.recentre()
        if not self.centred:
            return None  # the norms run the LayerNorm mode, which needs no centred stream
        if args:
            return (_centre(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            kwargs["hidden_states"] = _centre(kwargs["hidden_states"])
            return args, kwargs
        return None

    def mode(self, norm: nn.Module, tensors: tuple) -> str:
        if norm.training or not self.centred:
            return "layernorm"
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return "layernorm"
        return "fp32_affine"


def _centre(h: Tensor) -> Tensor:
    if not h.is_floating_point():
        return h
    f = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    return (f - f.mean(-1, keepdim=True)).to(h.dtype)


def centre_writer(module: nn.Module, out_dim: int) -> None:
    """Centres ``module``'s output over the hidden dimension, in fp64, stored back in place."""
    weight = module.weight
    w = weight.detach().double()
    weight.detach().copy_(w - w.mean(out_dim, keepdim=True))
    bias = getattr(module, "bias", None)
    if isinstance(bias, Tensor):
        b = bias.detach().double()
        bias.detach().copy_(b - b.mean())


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


def _get(module: nn.Module, path: str) -> tuple[nn.Module | None, nn.Module | None, str]:
    parent = module
    *head, attr = path.split(".")
    for part in head:
        parent = getattr(parent, part, None)
        if not isinstance(parent, nn.Module):
            return None, None, attr
    child = getattr(parent, attr, None)
    return parent, (child if isinstance(child, nn.Module) else None), attr


@dataclass
class Conversion:
    """The plan of one ``patch_model`` call for its LayerNorm stacks, and the means to apply and undo it."""

    norms: dict[nn.Module, tuple[str, NormKind]] = field(default_factory=dict)
    skipped: dict[nn.Module, str] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    stacks: list[tuple[str, nn.Module, _StreamState]] = field(default_factory=list)
    stream_of: dict[nn.Module, _StreamState] = field(default_factory=dict)

    @property
    def centred(self) -> list[str]:
        """Report lines: where the stream is centred and the writers centred at the first inference forward."""
        lines = []
        for name, entrance, state in self.stacks:
            if state.half:
                lines.append(f"{name or 'model'}: nothing (fp16/bf16 writers are left as they are; the norms run "
                             "the fused LayerNorm mode)")
                continue
            lines.append(f"{name or 'model'} input (centred at run time); the writers below at the first "
                         "inference forward, unless the model trains first")
            lines.extend(w.name for w in state.writers)
        return lines

    def apply(self) -> None:
        """Installs the entrance hooks (which centre the writers at the first inference forward)."""
        for _, entrance, state in self.stacks:
            # Also on half-precision stacks: recentre() after a cast to fp32 must find the stream centred.
            entrance.register_forward_pre_hook(state.enter, with_kwargs=True)

    def remove_hooks(self) -> None:
        for _, entrance, state in self.stacks:
            remove_entrance_hook(entrance, state)


def remove_entrance_hook(entrance: nn.Module, state: _StreamState) -> None:
    # By identity, not through a handle: a copied model's handle would point at the original's hook dict.
    for key, hook in list(entrance._forward_pre_hooks.items()):
        if getattr(hook, "__self__", None) is state:
            del entrance._forward_pre_hooks[key]
            entrance._forward_pre_hooks_with_kwargs.pop(key, None)


def plan_conversion(root: nn.Module, convert: bool) -> Conversion:
    """Finds the LayerNorm stacks of supported families in ``root`` and plans their conversion (nothing is
    changed). With ``convert=False`` (``layernorm="skip"``) every LayerNorm is only reported as skipped."""
    conv = Conversion()
    families = {}
    for family in LAYERNORM_FAMILIES:
        cls = resolve_class(family.stack)
        if cls is not None:
            families[cls] = family
    for name, module in root.named_modules():
        family = families.get(type(module))
        if family is None:
            continue
        if not convert:
            for _, m in module.named_modules():
                if isinstance(m, nn.LayerNorm):
                    conv.skipped[m] = "LayerNorm left alone on request (layernorm='skip')"
            continue
        problem = _stack_problem(module, family)
        if problem:
            conv.refused.append(f"{name or type(module).__name__} ({family.name}): {problem}")
            for _, m in module.named_modules():
                if isinstance(m, nn.LayerNorm):
                    conv.skipped[m] = f"not converted to RMSNorm: {problem}"
            continue
        _plan_stack(conv, name, module, family)
    return conv


def _stack_problem(stack: nn.Module, family: LayerNormFamily) -> str | None:
    if family.problem is not None and (problem := family.problem(stack)):
        return problem
    layers = getattr(stack, family.layers, None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return f"it has no layers in {family.layers}"
    final = getattr(stack, family.final_norm, None)
    if type(final) is not nn.LayerNorm:
        return f"its final norm {family.final_norm} is not an nn.LayerNorm, so the head would read the stream"
    hidden = final.normalized_shape[-1]
    for i, layer in enumerate(layers):
        for path in family.writers:
            _, writer, _ = _get(layer, path)
            if writer is not None and isinstance(reason := _writer_out_dim(writer, hidden), str):
                return f"writer {family.layers}.{i}.{path} cannot be centred: {reason}"
    return None


def _plan_stack(conv: Conversion, name: str, stack: nn.Module, family: LayerNormFamily) -> None:
    prefix = f"{name}." if name else ""
    layers = getattr(stack, family.layers)
    final = getattr(stack, family.final_norm)
    hidden = final.normalized_shape[-1]
    writers = []
    readers: dict[nn.Module, str] = {final: f"{prefix}{family.final_norm}"}
    for i, layer in enumerate(layers):
        base = f"{prefix}{family.layers}.{i}."
        for path in family.norms:
            _, norm, _ = _get(layer, path)
            if norm is not None:
                readers[norm] = base + path
        for path in family.writers:
            parent, writer, attr = _get(layer, path)
            if writer is not None:
                writers.append(_Writer(base + path, parent, attr, writer, _writer_out_dim(writer, hidden)))
    state = _StreamState(writers, half=any(w.module.weight.dtype in _HALF for w in writers))
    conv.stacks.append((name, layers[0], state))
    for module, reason in ((m, _norm_problem(m, hidden)) for m in readers):
        if reason:
            # Left as nn.LayerNorm: still exact, LN(Ch) = LN(h).
            conv.skipped[module] = f"LayerNorm not converted ({reason}); it stays an exact nn.LayerNorm"
        else:
            conv.norms[module] = (family.name, LN_KIND if module.bias is not None else LN_KIND_NO_BIAS)
            conv.stream_of[module] = state
    # Any other LayerNorm inside the stack (Phi's and StableLM's q/k norms) reads no residual stream.
    for sub_name, m in stack.named_modules():
        if isinstance(m, nn.LayerNorm) and m not in readers:
            conv.skipped[m] = "LayerNorm inside a sub-layer (it does not read the residual stream); left alone"


def _norm_problem(norm: nn.Module, hidden: int) -> str | None:
    if type(norm) is not nn.LayerNorm:
        return f"{type(norm).__name__} is not exactly nn.LayerNorm"
    if tuple(norm.normalized_shape) != (hidden,):
        return f"normalized_shape {tuple(norm.normalized_shape)} is not ({hidden},)"
    if norm.weight is None:
        return "elementwise_affine=False"
    return None
