"""Norms, decoder layers and stacks that ``families.py`` does not name, recognised by what they compute.

transformers has well over a hundred RMSNorm classes, but only a couple of dozen distinct ``forward`` bodies
(most are Llama's under another name), and its modular code generation copies whole decoder layers verbatim.
So instead of a list of class names:

* **Norms by their numerics.** A module whose class name contains ``RMSNorm`` (or a ``torch.nn.RMSNorm``, or a
  model's own ``*LayerNorm`` class, also tried in the mean-centred ``layernorm`` mode) is run,
  as its own class's ``forward``, on probe inputs, and compared bit for bit with each mode of
  ``hf_rmsnorm.ops.modes`` computed by the PyTorch reference. The probe runs on the CPU (whatever the caller's
  default device or ``torch.device`` context, so a model built on the meta device gets the verdict it will have
  once loaded) on a stand-in module with a trained-like random weight (and bias) of the module's dtypes (a
  freshly initialised weight of ones would make the modes indistinguishable, yet they differ once trained), on
  rows of ordinary, tiny, large and outlier magnitudes, in every input dtype a model of that dtype feeds it (the
  weight's, the model's, fp32, bf16: a norm kept in fp32 in a bf16 model reads bf16). The first mode that
  reproduces every probe bit for bit is the module's; a module no mode reproduces is left alone with the reason.
  The answer depends only on the class, the dtypes, whether the instance has a weight (Gemma 4 makes its
  value norms without one) and its plain settings (Qwen4-Exp's ``group_size`` makes some instances grouped
  norms), so each combination is probed once per ``patch_model`` call.
  The norms the registry *does* name are probed the same way at patch time and left alone, with the reason,
  where their forward does not compute the registry's mode (a transformers release changed the class).
* **Layers and stacks by their code.** A class whose ``forward`` is, token for token, the ``forward`` of a class
  the registry describes (decorators included, docstrings, comments and layout ignored) computes what that class
  computes from attributes of the same names, so it gets that class's kinds. The patcher still checks each
  instance's attributes exactly as for the registered class.
"""

from __future__ import annotations

import functools
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..ops import reference
from ..ops.modes import MODES, dtype_of
from .classify import Role, norm_role
from .families import FAMILIES, LayerKind, NormKind, StackKind, class_at

# Attribute names an RMSNorm keeps its epsilon under, in the order they are tried.
EPS_ATTRS = ("variance_epsilon", "eps")
# Modes a recognised RMSNorm may have (the LayerNorm modes centre the row; no RMSNorm body does).
RMS_MODES = tuple(name for name, mode in MODES.items() if not mode.centre and not mode.keeps_fp64)
# Also tried for a model's own LayerNorm classes (Cohere's: mean-centred, weight in fp32; DeBERTa's: llama's order,
# divided by the standard deviation), and for subclasses of nn.LayerNorm: every centring mode of the table, and
# ``layernorm_1p``, the layernorm mode of ``weight + 1`` rounded in the weight's dtype (Nemotron's LayerNorm1P:
# ``F.layer_norm(x, shape, self.weight + 1.0, self.bias, self.eps)``).
CENTRED_MODES = (*(name for name, mode in MODES.items() if mode.centre), "layernorm_1p")
# The modes of ``CENTRED_MODES`` that scale by ``weight + offset`` (``NormKind.weight_offset``): name -> (the
# kernels' mode, offset).
OFFSET_MODES = {"layernorm_1p": ("layernorm", 1.0)}
# The epsilons tried for a LayerNorm class that keeps none as an attribute (OLMo's writes ``eps=1e-5`` in its
# forward): torch's default, then the other common one. The probe's rows of magnitude 1e-3 tell them apart.
CONSTANT_EPS = (1e-5, 1e-6)
PROBE_ROWS_PER_SCALE = 8
# Row magnitudes: ordinary, where eps matters, large (an fp16 square would overflow), and the size of real
# activation outliers.
PROBE_SCALES = (1.0, 1e-3, 300.0, 3e3)
PROBE_SEED = 1234
# Spread of the probe's weight around 1 and bias around 0: trained-like, never ones and zeros.
PROBE_WEIGHT_STD = 0.5
# Row width of the probes of a norm without a weight (nothing else tells its width).
PROBE_WIDTH = 96
PROBE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class NormVerdict:
    """The outcome of probing a norm: its kind, or why it is left alone."""

    kind: NormKind | None
    reason: str = ""


def family_of(cls: type) -> str:
    """The name a recognised class's family is reported under: its class name without the norm suffix."""
    name = cls.__name__.removesuffix("RMSNorm").removesuffix("LayerNorm") or cls.__name__
    return f"{name} (recognised)"


class NormRecogniser:
    """Probes norm classes, caching each answer for the life of one plan (one ``patch_model`` call): a norm
    the registry does not name gets the kind of its numerics (``verdict``); one it names is checked against its
    entry (``registry_problem``), so a transformers release that changed the class's rounding order turns the
    kernels off for it instead of running the entry's stale order."""

    def __init__(self) -> None:
        self._modes: dict[tuple, tuple[str | None, str]] = {}

    def verdict(self, module: nn.Module, model_dtype: torch.dtype) -> NormVerdict:
        """The kind of ``module``, a norm of a class the registry does not name, in a model of ``model_dtype``."""
        cls = type(module)
        centred = norm_role(cls) is Role.OWN_LAYER_NORM
        # A LayerNorm class may have a bias (None or a tensor), and may keep no epsilon (a constant of its code).
        bias_attr = "bias" if centred and hasattr(module, "bias") else None
        eps_attrs = EPS_ATTRS if not centred or any(_is_number(getattr(module, a, None)) for a in EPS_ATTRS) else ()
        problem = _shape_problem(module, eps_attrs, "weight", bias_attr)
        if problem:
            return NormVerdict(None, problem)
        weight_attr = "weight" if getattr(module, "weight", None) is not None else None
        bias_attr = bias_attr if getattr(module, "bias", None) is not None else None
        path = f"{cls.__module__}.{cls.__qualname__}"
        reason = ""
        for eps_attr, eps in ([(a, None) for a in eps_attrs if _is_number(getattr(module, a, None))][:1]
                              or [(None, e) for e in CONSTANT_EPS]):
            mode, reason = self._mode(module, eps_attr, weight_attr, bias_attr, model_dtype, candidate_modes(module),
                                      eps)
            if mode is not None:
                mode, offset = OFFSET_MODES.get(mode, (mode, 0.0))
                return NormVerdict(NormKind(path, eps_attr=eps_attr, mode=mode, weight_attr=weight_attr,
                                            bias_attr=bias_attr, eps=eps, weight_offset=offset))
        return NormVerdict(None, reason)

    def registry_problem(self, module: nn.Module, kind: NormKind, model_dtype: torch.dtype) -> str | None:
        """Why ``module`` (of a class the registry names, with ``kind``) does not compute ``kind.mode``, if it
        does not: its forward is probed exactly as an unregistered class's is."""
        problem = _shape_problem(module, (kind.eps_attr,), kind.weight_attr, kind.bias_attr)
        if problem:
            return problem
        modes = tuple(dict.fromkeys((kind.mode, *candidate_modes(module))))
        mode, reason = self._mode(module, kind.eps_attr, kind.weight_attr, kind.bias_attr, model_dtype, modes)
        if mode == kind.mode:
            return None
        computed = reason if mode is None else f"{type(module).__name__}.forward computes the {mode} mode"
        return f"{computed}, not the {kind.mode} mode its registry entry says: left alone rather than mis-rounded"

    def _mode(
        self, module: nn.Module, eps_attr: str | None, weight_attr: str | None, bias_attr: str | None,
        model_dtype: torch.dtype, modes: tuple[str, ...], eps: float | None = None,
    ) -> tuple[str | None, str]:
        weight, bias = (None if a is None else getattr(module, a, None) for a in (weight_attr, bias_attr))
        # The answer depends on the class, its plain settings, the parameters' presence and dtypes and the model's
        # dtype only.
        key = (type(module), _settings(module), eps_attr, eps, weight_attr, bias_attr, dtype_of(weight),
               dtype_of(bias), model_dtype, modes)
        if key not in self._modes:
            self._modes[key] = probe_mode(module, eps_attr, weight_attr, bias_attr, model_dtype, modes, eps=eps)
        return self._modes[key]


def _settings(module: nn.Module) -> tuple[tuple[str, object], ...]:
    """The plain settings of ``module`` its forward may branch on (Qwen4-Exp's ``group_size`` makes some instances
    of one class grouped norms), epsilons aside: instances that differ in one are probed apart."""
    plain = (bool, int, float, str, type(None))
    return tuple(sorted((name, value) for name, value in vars(module).items()
                        if not name.startswith("_") and name not in EPS_ATTRS and name != "training"
                        and isinstance(value, plain)))


def candidate_modes(module: nn.Module) -> tuple[str, ...]:
    """The modes a norm may be in: the RMS modes, and the centred ones too for a model's own LayerNorm class."""
    return RMS_MODES + (CENTRED_MODES if norm_role(type(module)) is Role.OWN_LAYER_NORM else ())


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shape_problem(
    module: nn.Module, eps_attrs: tuple[str, ...], weight_attr: str | None, bias_attr: str | None
) -> str | None:
    """Why ``module`` cannot be one of the kernels' norms whatever its numerics, if it cannot (its epsilon is
    under one of ``eps_attrs``, none: a constant of its code; its weight and bias under the attributes named, None:
    none). Where its parameters live does not matter (the probe only reads their presence, shapes and dtypes), so a
    norm on the meta device (a skeleton not loaded yet) gets the verdict it will have once loaded."""
    cls = type(module)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    ):
        return f"{cls.__name__}.forward takes more than the hidden states ({', '.join(p.name for p in params)})"
    if any(True for _ in module.children()):
        return f"{cls.__name__} has submodules"
    for attr in (weight_attr, bias_attr):
        value = None if attr is None else getattr(module, attr, None)
        if value is not None and (not isinstance(value, Tensor) or value.dim() != 1):
            return f"{cls.__name__}.{attr} is not a 1-D tensor"
        if value is not None and value.dtype not in PROBE_DTYPES:
            return f"{cls.__name__}.{attr} is {value.dtype}, not a dtype the kernels load"
    others = [name for name, _ in module.named_parameters(recurse=False) if name not in (weight_attr, bias_attr)]
    if others:
        return f"{cls.__name__} has parameters besides its weight ({', '.join(others)})"
    if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
        return f"{cls.__name__} has buffers on the meta device, whose values its forward may read (not loaded)"
    if eps_attrs and not any(_is_number(getattr(module, a, None)) for a in eps_attrs):
        return f"{cls.__name__} has no numeric {' or '.join(eps_attrs)}"
    return None


def probe_parameters(width: int, dtype: torch.dtype, bias_dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    """The probe's weight, trained-like: around 1 with spread ``PROBE_WEIGHT_STD`` (a weight of ones, as a fresh
    model has, would make the modes indistinguishable); a bias around 0 (None for ``bias_dtype`` None)."""
    gen = torch.Generator().manual_seed(PROBE_SEED + 1)
    weight = (torch.randn(width, generator=gen, device="cpu") * PROBE_WEIGHT_STD + 1.0).to(dtype)
    bias = None if bias_dtype is None else (torch.randn(width, generator=gen, device="cpu") * PROBE_WEIGHT_STD
                                            ).to(bias_dtype)
    return weight, bias


def probe_rows(width: int) -> Tensor:
    """The probe's fp32 input rows (module docstring): ``PROBE_ROWS_PER_SCALE`` rows per magnitude."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    rows = torch.cat([torch.randn(PROBE_ROWS_PER_SCALE, width, generator=gen, device="cpu") * scale
                      for scale in PROBE_SCALES])
    rows[0, 0] = 100.0  # one outlier in an ordinary row
    return rows


def probe_mode(
    module: nn.Module, eps_attr: str | None, weight_attr: str | None, bias_attr: str | None, model_dtype: torch.dtype,
    modes: tuple[str, ...], input_dtypes: tuple[torch.dtype, ...] | None = None, eps: float | None = None,
) -> tuple[str | None, str]:
    """The first of ``modes`` whose PyTorch reference reproduces ``type(module).forward`` bit for bit on every
    probe, or None and why none does (module docstring). The forward runs on a CPU stand-in with the probe's
    weight and bias in the dtypes of ``module``'s (``model_dtype`` for a norm without a weight), on every input
    dtype a model of ``model_dtype`` feeds it, or on ``input_dtypes``. It runs on the CPU whatever the default
    device or ``torch.device`` context of the caller, so the verdict does not depend on them. ``eps_attr`` None:
    the forward's epsilon is the constant ``eps``."""
    cls = type(module)
    weight, bias = (None if a is None else getattr(module, a, None) for a in (weight_attr, bias_attr))
    shape = getattr(module, "normalized_shape", None)  # a LayerNorm's width, weight or none (OLMo's)
    declared = shape[-1] if isinstance(shape, (tuple, list)) and shape and isinstance(shape[-1], int) else None
    width = weight.shape[0] if weight is not None else declared or PROBE_WIDTH
    dtype = model_dtype if weight is None else weight.dtype
    with torch.device("cpu"):
        probe_weight, probe_bias = probe_parameters(width, dtype, dtype_of(bias))
        probe_weight = None if weight is None else probe_weight
        stand_in = _stand_in(module, {weight_attr: probe_weight, bias_attr: probe_bias})
        eps = eps if eps_attr is None else getattr(module, eps_attr)
        rows = probe_rows(width)
        outputs = []
        # The dtypes its own parameters and the model feed it must work; another one its forward refuses (aten's
        # layer_norm takes no fp32 input with a bf16 weight: Nemotron's) is one the model never feeds it.
        required = (dtype, model_dtype)
        with torch.no_grad():
            for input_dtype in input_dtypes or dict.fromkeys((*required, torch.float32, torch.bfloat16)):
                x = rows.to(input_dtype)
                try:
                    outputs.append((x, cls.forward(stand_in, x)))
                except Exception as exc:  # its forward needs more than the module's own state: not a plain norm
                    if input_dtypes is None and input_dtype not in required:
                        continue
                    return None, f"{cls.__name__}.forward failed on a probe ({type(exc).__name__}: {exc})"[:200]
        for mode in modes:
            if all(_reproduces(x, expected, probe_weight, probe_bias, eps, mode) for x, expected in outputs):
                return mode, ""
    return None, f"{cls.__name__}'s numerics match none of the kernels' modes ({', '.join(modes)})"


def _stand_in(module: nn.Module, parameters: dict[str | None, Tensor | None]) -> nn.Module:
    """A module of ``module``'s class sharing its plain attributes (eps, flags) but with ``parameters`` in place
    of its own and CPU copies of its buffers: the probe never touches the real module or its device."""
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    params = {name: None for name in module._parameters}
    params.update({name: None if p is None else nn.Parameter(p, requires_grad=False)
                   for name, p in parameters.items() if name is not None})
    stand_in.__dict__["_parameters"] = params
    for name in params:  # a tensor kept as a plain attribute would hide the probe's
        stand_in.__dict__.pop(name, None)
    stand_in.__dict__["_buffers"] = {k: None if v is None else v.detach().cpu() for k, v in module._buffers.items()}
    return stand_in


def _reproduces(
    x: Tensor, expected: object, weight: Tensor | None, bias: Tensor | None, eps: float, mode: str
) -> bool:
    if not isinstance(expected, Tensor):
        return False
    mode, offset = OFFSET_MODES.get(mode, (mode, 0.0))
    if offset:
        if weight is None:
            return False
        weight = weight + offset  # in the weight's dtype, as the module's forward does
    candidates = [reference.stepwise_output(x, weight, bias, eps, mode)]
    if MODES[mode].is_torch_layer_norm:
        candidates += _torch_layer_norms(x, weight, bias, eps, MODES[mode].output_dtype(x.dtype, weight, bias))
    return any(got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
               for got in candidates)


def _torch_layer_norms(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                       dtype: torch.dtype) -> list[Tensor]:
    """What ``nn.LayerNorm`` itself returns for ``x`` (the layernorm mode *is* its maths, and the kernels run an
    ``nn.LayerNorm`` as that mode), called as a model's own class may call it: on ``x`` and the parameters as they
    are, and on all of them in fp32, rounded to ``dtype``. Compared besides ``reference.stepwise_output`` because
    aten reduces an fp32 row in another order than those steps, an ulp apart (a class calling ``F.layer_norm``:
    OLMo's, Nemotron's)."""
    as_is = reference.torch_layer_norm(x, weight, bias, eps)
    in_fp32 = reference.torch_layer_norm(
        x.float(), None if weight is None else weight.float(), None if bias is None else bias.float(), eps)
    return [t.to(dtype) for t in (as_is, in_fp32) if t is not None]


# -------------------------------------------------------------------------------------- layers and stacks


@functools.lru_cache(maxsize=None)
def _code_of(function: object) -> tuple[str, ...] | None:
    """``function``'s source as tokens, without comments, docstrings or layout; None when there is no source.

    Keyed by the function object, so a class whose forward is replaced later is looked at afresh."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tokens: list[str] = []
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    line_start, after_colon_line = True, False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NEWLINE:
            after_colon_line, line_start = bool(tokens) and tokens[-1] == ":", True
            continue
        if token.type in layout:
            continue
        # A string that is a whole statement right after a line ending in ':' is a docstring.
        if not (line_start and after_colon_line and token.type == tokenize.STRING):
            tokens.append(token.string)
        line_start = False
    return tuple(tokens)


def same_code(a: type, b: type) -> bool:
    """Whether ``a.forward`` and ``b.forward`` are the same code (module docstring)."""
    code = _code_of(a.forward)
    return code is not None and code == _code_of(b.forward)


def recognised_layer_kinds(cls: type) -> tuple[tuple[str, LayerKind], ...]:
    """The kinds of the registered layer class whose forward ``cls.forward`` is, under ``cls``'s own path."""
    for family in FAMILIES:
        for kind in family.layers:
            known = class_at(kind.class_path, importing=True)
            if known is not None and known is not cls and same_code(cls, known):
                path = f"{cls.__module__}.{cls.__qualname__}"
                return tuple((family.name, replace(k, class_path=path)) for k in family.layers
                             if k.class_path == kind.class_path)
    return ()


def recognised_stack_kind(cls: type) -> tuple[str, StackKind] | None:
    """The kind of the registered RMSNorm stack class whose forward ``cls.forward`` is, under ``cls``'s own path.
    LayerNorm stacks are not recognised: their kinds name the LayerNorms of one family's layers."""
    for family in FAMILIES:
        for kind in family.stacks:
            known = None if kind.stream is not None else class_at(kind.class_path, importing=True)
            if known is not None and known is not cls and same_code(cls, known):
                return family.name, replace(kind, class_path=f"{cls.__module__}.{cls.__qualname__}")
    return None
