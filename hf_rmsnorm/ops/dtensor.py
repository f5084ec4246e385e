"""DTensor arguments of the public ops: the norm runs on each rank's local shard, where that is the same maths.

Tensor- and sequence-parallel plans hand the norms ``DTensor``s: activations sharded along the sequence
(``Shard(1)``) or replicated, weights replicated. The kernels read raw pointers and cannot take a DTensor, but a
norm only mixes the elements of one row (the last dimension), so on activations sharded along any other dimension
(or replicated) and replicated weights, each rank normalising its local rows *is* the global norm.
``call_on_local_shards`` runs a public op that way (each op calls it when ``holds_dtensor`` says a DTensor came
in), and refuses, in one line naming the placement and the fix, the arguments where it is not: a row split across
ranks (``Shard(-1)``), pending sums (``Partial``), a sharded weight, tensors on different meshes or with different
placements, DTensors mixed with plain tensors.

Autograd crosses the local/global boundary through ``to_local(grad_placements=...)`` and ``from_local``: the
activations' gradients keep the activations' placements, and the gradient of a replicated weight (or bias) is
``Partial`` along every mesh dimension the activations are sharded on (each rank holds the sum over its own rows;
DTensor sums them when the gradient is redistributed), ``Replicate`` along the others (each rank computed the
same whole sum).

Plain tensors go straight through: the check is a set lookup per tensor, and ``torch.distributed.tensor`` is never
imported here (no DTensor can exist before it is). ``torch.compile`` traces the DTensor path as it is (``to_local``
and ``from_local`` are traceable).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
from torch import Tensor

# The tensor arguments of the public ops, by role: rows of activations, or per-column parameters.
_ACTIVATIONS = ("x", "residual")
_PARAMETERS = ("weight", "bias")
# Argument types that are never DTensors: a plain call is told apart by one set lookup per tensor
# (``isinstance(t, DTensor)`` costs ~0.2 us on a 2-core CPU host, and a decode-sized call's whole host time is a
# few us).
_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter, float, int, str, bool, type(None)})


def holds_dtensor(*values: object) -> bool:
    """Whether any of ``values`` is a DTensor: one set lookup per plain tensor, float or None."""
    for value in values:
        if type(value) not in _PLAIN_TYPES and _is_dtensor(value):
            return True
    return False


def call_on_local_shards(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` (a public norm op whose tensor arguments are named as in ``_ACTIVATIONS`` and
    ``_PARAMETERS``, given a DTensor) run on the local shards, its outputs returned as DTensors with ``x``'s mesh
    and placements.

    Raises:
        ValueError: the op is not row-local on these arguments (module docstring), or DTensors and plain
            tensors are mixed.
    """
    arguments = inspect.signature(op).bind(*args, **kwargs).arguments
    output = op(**{**arguments, **_local_arguments(op.__name__, arguments)})
    x = arguments["x"]
    if isinstance(output, tuple):
        return tuple(_from_local(t, x) for t in output)
    return _from_local(output, x)


def _is_dtensor(value: object) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported (importing it here would cost ~1.5 s).
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _local_arguments(op: str, arguments: dict[str, Any]) -> dict[str, Tensor]:
    """The local shards of the tensor arguments, after checking that the op is row-local on them."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    x = arguments["x"]
    if not _is_dtensor(x):
        name = next(n for n in (*_ACTIVATIONS, *_PARAMETERS) if _is_dtensor(arguments.get(n)))
        raise _mixed_error(op, name, "x")
    placements = x.placements
    for dim, placement in enumerate(placements):
        _check_activation_placement(op, "x", x, dim, placement)
    local = {}
    for name in _ACTIVATIONS:
        t = arguments.get(name)
        if t is None:
            continue
        _check_same_mesh(op, name, t, x)
        if name != "x" and t.placements != placements:
            raise ValueError(
                f"{op}: {name} is a DTensor with placements {_text(t.placements)} but x has {_text(placements)}; "
                "DTensor activations must have the same placements (redistribute one of them)"
            )
        local[name] = t.to_local(grad_placements=placements)
    # A parameter's gradient sums over the rows: partial where the rows are split across ranks.
    param_grad = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in placements)
    for name in _PARAMETERS:
        t = arguments.get(name)
        if t is None:
            continue
        _check_same_mesh(op, name, t, x)
        if any(not p.is_replicate() for p in t.placements):
            raise ValueError(
                f"{op}: {name} is a DTensor with placements {_text(t.placements)}; a norm needs the whole {name} on "
                f"every rank: use Replicate() for {name} (the plan's default for norms)"
            )
        local[name] = t.to_local(grad_placements=param_grad)
    return local


def _check_activation_placement(op: str, name: str, t: Tensor, mesh_dim: int, placement) -> None:
    from torch.distributed.tensor import Shard

    if placement.is_partial():
        raise ValueError(
            f"{op}: {name} is a DTensor with a Partial placement on mesh dimension {mesh_dim} (a pending sum across "
            f"ranks); a norm needs the summed values: redistribute {name} to Replicate() or Shard(<sequence dim>) first"
        )
    if isinstance(placement, Shard):
        if placement.dim % t.ndim == t.ndim - 1:
            raise ValueError(
                f"{op}: {name} is a DTensor sharded along its last (hidden) dimension ({placement} on mesh dimension "
                f"{mesh_dim}), which the norm reduces over; redistribute {name} to Replicate() or "
                "Shard(<sequence dim>) first"
            )
    elif not placement.is_replicate():
        raise ValueError(
            f"{op}: {name} is a DTensor with placement {placement} on mesh dimension {mesh_dim}; the norms take "
            "Shard(d) along a dimension other than the last, or Replicate()"
        )


def _check_same_mesh(op: str, name: str, t: Tensor, x: Tensor) -> None:
    if not _is_dtensor(t):
        raise _mixed_error(op, "x", name)
    if t.device_mesh != x.device_mesh:
        raise ValueError(
            f"{op}: {name} is a DTensor on {t.device_mesh} but x is on {x.device_mesh}; all DTensor arguments must be "
            "on one device mesh"
        )


def _mixed_error(op: str, dtensor_name: str, plain_name: str) -> ValueError:
    return ValueError(
        f"{op}: {dtensor_name} is a DTensor but {plain_name} is a plain torch.Tensor; pass both as DTensors "
        f"(DTensor.from_local({plain_name}, mesh, placements)) or both as local tensors (.to_local())"
    )


def _from_local(local: Tensor, like: Tensor) -> Tensor:
    """``local`` (the op's output on ``like``'s local shard) as a contiguous DTensor placed as ``like``. The
    global shape and strides are given, so nothing is communicated (and uneven shards keep their sizes)."""
    from torch.distributed.tensor import DTensor

    shape = like.shape
    return DTensor.from_local(
        local.contiguous(), like.device_mesh, like.placements, run_check=False,
        shape=shape, stride=_contiguous_strides(shape),
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _text(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"
