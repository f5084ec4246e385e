"""How many of a forward's residual adds sit next to a norm, and how many of them a patched model fuses: the
coverage page's measure of residual fusion, taken by running the model, independently of how the patcher finds
the adds.

* ``adds_next_to_norms``: in one forward of the unpatched model, the residual adds next to a given norm. A tensor
  is on the residual stream once a norm or a layer (a module with one of the norms as a direct child) has read it
  as an input as wide as the stream (a post-LN sublayer reads it as its second), once a norm returns it as wide as
  the stream (a post-LN layer's stream is its normed sum), once it is the result of a residual add, or of a product
  or dtype conversion of a tensor on it
  (a scaled residual, one kept in fp32), or a view of one that keeps its rows (``reshape``/``view`` keeping the
  last dimension: a norm reading the view reads the tensor viewed). A residual add is an add (``a + b``, ``torch.add``,
  ``+=``) of two tensors of one shape, as wide as the stream, one of them already on it (a branch sum inside a
  mixture of experts, an embedding sum, a rotary embedding are not); it sits next to a norm when a norm reads its
  result as its input, or when its other operand is a norm's output. Inputs and outputs are recorded by forward
  pre-hooks and hooks, in the order they happen; every tensor involved is kept alive until the count is made, so
  no id is reused.
* ``fused_adds``: in one forward of the patched model, the norm kernel calls that also add (a fused add + norm, or
  a norm + add of a post-norm layer): each is one add that no longer runs on its own.

A model type fuses every such add when the two counts are equal; ``unfused_sites`` names the code lines of those
it does not (the adds found next to a norm that still run as adds in the patched model).
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from hf_rmsnorm.ops import reference
from hf_rmsnorm.ops.functional import BoundNorm
from hf_rmsnorm.patch import fused

_ADDS = {torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__}
# Ops whose result stays on the stream when their first operand is on it: a residual scaled before its add
# (``residual * alpha + h``), or carried in another dtype (``residual.to(torch.float32)``).
_CARRIERS = {torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__, Tensor.to, Tensor.float}
# Views of a tensor on the stream that keep its rows (OPT's ``h.reshape(-1, h.size(-1))`` and
# ``(residual + h).view(shape)``): the same values, so a norm reading the view reads the tensor viewed.
_VIEWS = {torch.reshape, Tensor.reshape, Tensor.view}
# The methods a patched norm's forward calls when it adds (on its class's ``BoundNorm``: ``hf_rmsnorm.patch.fused``),
# and the one a sandwich's two norms call together (``hf_rmsnorm.patch.sandwich``), which adds once too.
_ADDING_KERNELS = ("fused_add_norm", "norm_add", "norm_add_norm")
_PACKAGE = Path(fused.__file__).resolve().parents[1]
# The PyTorch implementation of the ops (CPU tensors where the kernels are compiled for a GPU, fp64): the adds it
# makes are the fused ops' own, each inside one call that ``fused_adds`` counts.
_OPS_IN_PYTORCH = str(Path(reference.__file__).resolve())


class _Census(TorchFunctionMode):
    """Follows the residual stream through one forward (module docstring)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.kept: list[object] = []  # every tensor whose id is recorded, alive until the count
        self.stream: set[int] = set()
        self.norm_outputs: set[int] = set()
        self.norm_inputs: set[int] = set()
        self.viewed: dict[int, int] = {}  # a view's id -> the id of the tensor it views (not itself a view)
        # Per residual add: its result's id, whether its other operand is a norm's output, and its code site.
        self.residual_adds: list[tuple[int, bool, str]] = []

    def read_by_layer(self, *tensors: object) -> None:
        """Every tensor argument of a layer as wide as the stream: a post-LN sublayer reads the stream as its
        second one (BERT's ``*SelfOutput(hidden_states, input_tensor)``)."""
        for tensor in tensors:
            if isinstance(tensor, Tensor) and tensor.shape[-1:] == (self.width,):
                self.kept.append(tensor)
                self.stream.add(id(tensor))

    def read_by_norm(self, tensor: object) -> None:
        # Kept whatever its width (a q/k norm's input is narrower than the stream): a freed input's id, reused by a
        # later add's result, would count that add as read by a norm.
        self.read_by_layer(tensor)
        self.kept.append(tensor)
        self.norm_inputs.add(self.viewed.get(id(tensor), id(tensor)))

    def made_by_norm(self, tensor: object) -> None:
        """A norm's output: as wide as the stream, it is the stream of a post-LN layer (its normed sum)."""
        if isinstance(tensor, Tensor):
            self.read_by_layer(tensor)
            self.kept.append(tensor)
            self.norm_outputs.add(id(tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ADDS and len(args) >= 2 and isinstance(result, Tensor) and all(
            isinstance(a, Tensor) and a.shape == result.shape and a.shape[-1:] == (self.width,) for a in args[:2]
        ):
            a, b = args[:2]
            if id(a) in self.stream or id(b) in self.stream:
                self.kept.extend((a, b, result))
                other = b if id(a) in self.stream else a
                self.residual_adds.append((id(result), id(other) in self.norm_outputs, _caller_site()))
                self.stream.add(id(result))
        elif func in _VIEWS and isinstance(result, Tensor) and args and isinstance(args[0], Tensor) and (
            id(args[0]) in self.stream and result.shape[-1:] == args[0].shape[-1:] == (self.width,)
        ):
            self.kept.append(result)
            self.stream.add(id(result))
            self.viewed[id(result)] = self.viewed.get(id(args[0]), id(args[0]))
            if id(args[0]) in self.norm_outputs:
                self.norm_outputs.add(id(result))
        elif func in _CARRIERS and isinstance(result, Tensor) and args and any(
            isinstance(a, Tensor) and id(a) in self.stream and a.shape == result.shape for a in args[:2]
        ):
            self.read_by_layer(result)
        return result

    def next_to_norms(self) -> list[str]:
        return [site for result, after_norm, site in self.residual_adds if result in self.norm_inputs or after_norm]


class _AddSites(TorchFunctionMode):
    """The code sites of every add of two same-shaped tensors ``width`` wide, but those of a fused op run by its
    PyTorch implementation (``_in_pytorch_ops``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ADDS and len(args) >= 2 and all(
            isinstance(a, Tensor) and a.shape[-1:] == (self.width,) for a in args[:2]
        ) and args[0].shape == args[1].shape and not _in_pytorch_ops():
            self.sites[_caller_site()] += 1
        return func(*args, **(kwargs or {}))


def _in_pytorch_ops() -> bool:
    """Whether the add running is made by the ops' PyTorch implementation (``_OPS_IN_PYTORCH``)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == _OPS_IN_PYTORCH:
            return True
        frame = frame.f_back
    return False


def _caller_site() -> str:
    """``file:line`` of the model code running the add: the frame that called into the mode, or, for an add
    hf_rmsnorm runs for a patched layer (a derived forward's helper falling back to the plain add), the layer's
    statement that called it (a derived forward keeps the original's file and lines)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and _PACKAGE in Path(frame.f_code.co_filename).parents:
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def unfused_sites(model: nn.Module, run, next_to_norms: list[str], width: int) -> list[str]:
    """Which of the adds ``adds_next_to_norms`` found (by code site) still run as adds in ``run(model)`` of the
    patched model, sorted: where a model type's remaining unfused adds are."""
    recorder = _AddSites(width)
    with torch.no_grad(), recorder:
        run(model)
    return sorted((collections.Counter(next_to_norms) & recorder.sites).elements())


def adds_next_to_norms(model: nn.Module, run, norms: set[nn.Module], width: int) -> list[str]:
    """The code sites of the residual adds (``width``: the stream's) next to one of ``norms`` in ``run(model)``,
    one per add run (module docstring); ``model`` must be unpatched."""
    census = _Census(width)
    layers = {m for m in model.modules() if any(child in norms for child in m.children())}
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(
            lambda module, args, kwargs: census.read_by_layer(*args, *kwargs.values()), with_kwargs=True))
    for norm in norms:
        handles.append(norm.register_forward_pre_hook(lambda module, args: census.read_by_norm(args[0])))
        handles.append(norm.register_forward_hook(lambda module, args, output: census.made_by_norm(output)))
    try:
        with torch.no_grad(), census:
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return census.next_to_norms()


def fused_adds(model: nn.Module, run, *, grad: bool = False) -> int:
    """The adding kernel calls in ``run(model)`` of a patched model (module docstring), under ``no_grad`` unless
    ``grad`` (a checkpointed or training forward). ``model`` may be compiled: torch.compile traces the count into
    its graphs as a side effect it replays every time a graph runs."""
    calls = [0]

    def counted(function):
        def count(*args, **kwargs):
            calls[0] += 1
            return function(*args, **kwargs)

        return count

    with contextlib.ExitStack() as stack:
        for name in _ADDING_KERNELS:
            original = getattr(BoundNorm, name)
            setattr(BoundNorm, name, counted(original))
            stack.callback(setattr, BoundNorm, name, original)
        with torch.set_grad_enabled(grad):
            run(model)
    return calls[0]
