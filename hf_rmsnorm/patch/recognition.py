"""Norms, decoder layers and stacks that ``families.py`` does not name, recognised by what they compute.

transformers has well over a hundred RMSNorm classes, but only a couple of dozen distinct ``forward`` bodies
(most are Llama's under another name), and its modular code generation copies whole decoder layers verbatim.
So instead of a list of class names:

* **Norms by their numerics.** A module whose class name contains ``RMSNorm`` (or a ``torch.nn.RMSNorm``, or a
  model's own ``*LayerNorm`` class, also tried in the mean-centred ``layernorm`` mode) is run,
  as its own class's ``forward``, on probe inputs, and compared bit for bit with each mode of
  ``hf_rmsnorm.ops.modes`` computed by the PyTorch reference. The probe runs on the CPU on a stand-in module with
  a random weight of the module's dtype (a freshly initialised weight of ones would make the modes
  indistinguishable, yet they differ once trained), on rows of ordinary, tiny, large and outlier magnitudes, in
  every input dtype a model of that dtype feeds it (its own, fp32, bf16). The first mode that reproduces every
  probe bit for bit is the module's; a module no mode reproduces is left alone with the reason. The answer
  depends only on the class, the dtypes and whether the instance has a weight (Gemma 4 makes its value norms
  without one), so each combination is probed once per ``patch_model`` call.
* **Layers and stacks by their code.** A class whose ``forward`` is, token for token, the ``forward`` of a class
  the registry describes (decorators included, docstrings, comments and layout ignored) computes what that class
  computes from attributes of the same names, so it gets that class's kinds. The patcher still checks each
  instance's attributes exactly as for the registered class.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..ops import reference
from ..ops.modes import MODES
from .families import FAMILIES, LayerKind, NormKind, StackKind

# Attribute names an RMSNorm keeps its epsilon under, in the order they are tried.
EPS_ATTRS = ("variance_epsilon", "eps")
# Modes a recognised RMSNorm may have (the LayerNorm modes centre the row; no RMSNorm body does).
RMS_MODES = tuple(name for name, mode in MODES.items() if not mode.centre and not mode.keeps_fp64)
# Also tried for a model's own LayerNorm classes (Cohere's: mean-centred, weight in fp32).
CENTRED_MODES = ("layernorm",)
PROBE_ROWS_PER_SCALE = 8
# Row magnitudes: ordinary, where eps matters, large (an fp16 square would overflow), and the size of real
# activation outliers.
PROBE_SCALES = (1.0, 1e-3, 300.0, 3e3)
PROBE_SEED = 1234
# Row width of the probes of a norm without a weight (nothing else tells its width).
PROBE_WIDTH = 96
PROBE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_rms_norm_like(module: nn.Module) -> bool:
    """A module that may be an RMSNorm: ``torch.nn.RMSNorm`` or a class with ``RMSNorm`` in its name (gated
    variants are looked at too, so their report says why they are left alone)."""
    return isinstance(module, nn.RMSNorm) or "RMSNorm" in type(module).__name__


def _is_own_layer_norm(module: nn.Module) -> bool:
    # nn.LayerNorm itself is left to the LayerNorm families, which know which ones read the residual stream.
    return type(module).__name__.endswith("LayerNorm") and not isinstance(module, nn.LayerNorm)


def is_recognisable_norm(module: nn.Module) -> bool:
    """A module recognition looks at: an RMSNorm-like one, or a model's own ``*LayerNorm`` class (Cohere's, and
    T5-style RMSNorms under that name)."""
    return is_rms_norm_like(module) or _is_own_layer_norm(module)


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
    """Probes norm classes, caching each verdict for the life of one plan (one ``patch_model`` call)."""

    def __init__(self) -> None:
        self._verdicts: dict[tuple, NormVerdict] = {}

    def verdict(self, module: nn.Module, dtype: torch.dtype) -> NormVerdict:
        """``module``'s kind; ``dtype`` is the model's (the weight's decides for a norm with one)."""
        cls = type(module)
        problem = _shape_problem(module)
        if problem:
            return NormVerdict(None, problem)
        weight = getattr(module, "weight", None)
        eps_attr = next(a for a in EPS_ATTRS if _is_number(getattr(module, a, None)))
        key = (cls, eps_attr, dtype if weight is None else weight.dtype, weight is None)
        if key not in self._verdicts:
            self._verdicts[key] = _probe(cls, module, eps_attr, key[2])
        return self._verdicts[key]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shape_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot be one of the kernels' norms whatever its numerics, if it cannot."""
    cls = type(module)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    ):
        return f"{cls.__name__}.forward takes more than the hidden states ({', '.join(p.name for p in params)})"
    if any(True for _ in module.children()):
        return f"{cls.__name__} has submodules"
    weight = getattr(module, "weight", None)
    if weight is not None and (not isinstance(weight, Tensor) or weight.dim() != 1):
        return f"{cls.__name__}.weight is not a 1-D tensor"
    others = [name for name, _ in module.named_parameters(recurse=False) if name != "weight"]
    if others:
        return f"{cls.__name__} has parameters besides its weight ({', '.join(others)})"
    if weight is not None and weight.is_meta:
        return f"{cls.__name__}'s weight is on the meta device (not loaded)"
    if weight is not None and weight.dtype not in PROBE_DTYPES:
        return f"{cls.__name__}'s weight is {weight.dtype}, not a dtype the kernels load"
    if not any(_is_number(getattr(module, a, None)) for a in EPS_ATTRS):
        return f"{cls.__name__} has no numeric {' or '.join(EPS_ATTRS)}"
    return None


def _probe(cls: type, module: nn.Module, eps_attr: str, dtype: torch.dtype) -> NormVerdict:
    """Compares ``cls.forward`` with every RMS mode on the probes (module docstring). A norm without a weight
    is probed at the width of ``PROBE_WIDTH`` and gets the kind of its numerics with ``weight_attr=None``."""
    has_weight = getattr(module, "weight", None) is not None
    hidden = module.weight.shape[0] if has_weight else PROBE_WIDTH
    gen = torch.Generator().manual_seed(PROBE_SEED)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).to(dtype) if has_weight else None
    stand_in = _stand_in(module, weight)
    eps = getattr(module, eps_attr)
    rows = torch.cat([torch.randn(PROBE_ROWS_PER_SCALE, hidden, generator=gen) * scale for scale in PROBE_SCALES])
    rows[0, 0] = 100.0  # one outlier in an ordinary row
    input_dtypes = dict.fromkeys((dtype, torch.float32, torch.bfloat16))
    outputs = []
    try:
        with torch.no_grad():
            for dtype in input_dtypes:
                x = rows.to(dtype)
                outputs.append((x, cls.forward(stand_in, x)))
    except Exception as exc:  # its forward needs more than the module's own state: not a plain norm
        return NormVerdict(None, f"{cls.__name__}.forward failed on a probe ({type(exc).__name__}: {exc})"[:200])
    modes = RMS_MODES + (CENTRED_MODES if _is_own_layer_norm(module) else ())
    for mode in modes:
        if all(_reproduces(x, expected, weight, eps, mode) for x, expected in outputs):
            path = f"{cls.__module__}.{cls.__qualname__}"
            weight_attr = "weight" if has_weight else None
            return NormVerdict(NormKind(path, eps_attr=eps_attr, mode=mode, weight_attr=weight_attr))
    return NormVerdict(None, f"{cls.__name__}'s numerics match none of the kernels' modes ({', '.join(modes)})")


def _stand_in(module: nn.Module, weight: Tensor | None) -> nn.Module:
    """A module of ``module``'s class sharing its plain attributes (eps, flags) but with ``weight`` and CPU
    copies of its buffers: the probe never touches the real module or its device."""
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__["_parameters"] = {} if weight is None else {"weight": nn.Parameter(weight, requires_grad=False)}
    stand_in.__dict__["_buffers"] = {k: None if v is None else v.detach().cpu() for k, v in module._buffers.items()}
    return stand_in


def _reproduces(x: Tensor, expected: object, weight: Tensor | None, eps: float, mode: str) -> bool:
    if not isinstance(expected, Tensor):
        return False
    got = reference.forward_reference(x, None, weight, None, eps, mode)[0]
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


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


def _importable_class(path: str) -> type | None:
    """The class at ``module.Class``, importing its module (unlike ``families.resolve_class``): the code of a
    registered class is the reference even when the model being patched does not use that class."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and cls.__module__ == module and cls.__qualname__ == name else None


def recognised_layer_kinds(cls: type) -> tuple[tuple[str, LayerKind], ...]:
    """The kinds of the registered layer class whose forward ``cls.forward`` is, under ``cls``'s own path."""
    for family in FAMILIES:
        for kind in family.layers:
            known = _importable_class(kind.class_path)
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
            known = None if kind.stream is not None else _importable_class(kind.class_path)
            if known is not None and known is not cls and same_code(cls, known):
                return family.name, replace(kind, class_path=f"{cls.__module__}.{cls.__qualname__}")
    return None
