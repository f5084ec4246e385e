"""What the derived forwards call at every call (``derived_rewrite.py`` compiles them to reach this module as
``_hf_rmsnorm_derived``): each rewritten add's helper, which checks that the fused kernel computes what the
original expression does and otherwise evaluates that expression, and the handoff's helpers (``handoff.py``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from . import derived_inline, guard, handoff, sandwich
from .families import NormKind


def _fused_call(norm: object, a: object, b: object) -> Callable | None:
    """How to call ``norm`` fused (``guard.unwatched_call``) where its fused kernel computes ``norm(a + b)`` (or
    ``a + norm(b)``) as the original does: a patched norm no hook watches, and an add the kernel computes
    (``handoff.kernel_adds``); None elsewhere."""
    if isinstance(getattr(type(norm), "_hf_rmsnorm_kind", None), NormKind) and handoff.kernel_adds(a, b):
        return guard.unwatched_call(norm)
    return None


def norm_of_sum(norm: nn.Module, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(a + b), a + b)``, from one kernel when it can be."""
    call = _fused_call(norm, a, b)
    if call is not None:
        return call(b, residual=a)
    total = a + b
    return norm(total), total


def norm_of_sum_first(a: Tensor, b: Tensor, layer: nn.Module, chosen: int | None,
                      paths: tuple[tuple[str, ...], ...], call: handoff.LayerCall | None = None,
                      ) -> tuple[tuple[int, nn.Module, Tensor] | None, Tensor]:
    """``(pending, a + b)`` for a guarded site (``derived_sites``' "Norms under tests"): ``chosen`` is the index of
    the first ``if`` whose test holds (None: none does), ``paths`` the norms' attribute paths from ``layer``; when
    that norm's kernel can compute the add, ``pending`` is ``(chosen, norm, norm of the sum)`` from that kernel,
    else None and the add is the plain one. An output site passes its ``call``: where no test holds, the sum is
    the layer's output, computed by the next norm's kernel when the loop asked for it (``stream_sum``)."""
    if chosen is None:
        return None, handoff.add_residual(call, b, a)
    norm = layer
    for name in paths[chosen]:  # the lookup the original makes when it reaches that ``if``
        norm = getattr(norm, name)
    fused_call = _fused_call(norm, a, b)
    if fused_call is None:
        return None, a + b
    normed, total = fused_call(b, residual=a)
    return (chosen, norm, normed), total


def viewed_output(call: handoff.LayerCall | None, total: Tensor, viewed: Tensor) -> Tensor:
    """``viewed``, the original's view of its output sum ``total`` (OPT's ``(residual + h).view(shape)``), which
    the layer returns: what it hands on becomes the normed sum viewed alike (``handoff.hand_on_viewed``)."""
    handoff.hand_on_viewed(call, total, viewed)
    return viewed


def take_normed(pending: tuple[int, nn.Module, Tensor] | None, index: int, norm: nn.Module,
                argument: Tensor) -> Tensor:
    """``norm(argument)`` in the ``if`` ``index`` of a guarded site, ``argument`` the sum or a view of it: the
    normed sum ``norm_of_sum_first`` computed for this ``if`` and this module, viewed as ``argument`` (a view that
    keeps the rows, as a flattening does: the norm of each row), when it did."""
    if pending is not None and pending[0] == index and pending[1] is norm:
        normed = pending[2]
        if normed.shape == argument.shape:
            return normed
        if handoff.keeps_rows(argument, normed):
            return normed.view(argument.shape)
    return norm(argument)


def norm_of_add(norm: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``norm(a + b)``, from one kernel when it can be."""
    return norm_of_sum(norm, a, b)[0]


def norm_then_add(norm: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + norm(x)``, from one kernel when it can be."""
    call = _fused_call(norm, residual, x)
    if call is not None:
        return call(x, add_to=residual)
    return residual + norm(x)


def norm_add_norm(norm: nn.Module, x: Tensor, residual: Tensor, next_norm: nn.Module) -> tuple[Tensor, Tensor]:
    """``(next_norm(residual + norm(x)), residual + norm(x))``, a sandwich norm's add between two norms
    (``derived_sites``' chained ``after`` site): from one kernel when it can be (``sandwich.chains``), else
    ``norm_then_add`` and the next norm's call, the original's expressions."""
    if handoff.kernel_adds(residual, x) and sandwich.chains(norm, next_norm):
        return sandwich.fused_pair(norm, x, residual, next_norm)
    total = norm_then_add(norm, x, residual)
    return next_norm(total), total


def stream_sum(call: handoff.LayerCall | None, a: Tensor, b: Tensor) -> Tensor:
    """``a + b``, the layer's output: computed by the next norm's kernel when the derived loop asked for it
    (``handoff.py``)."""
    return handoff.add_residual(call, b, a)


# The derived forwards call these too, as ``_hf_rmsnorm_derived.<name>`` (``handoff.py`` says what they do).
input_norm, final_norm, withdraw = handoff.input_norm, handoff.final_norm, handoff.withdraw
call_layer, layers_with_next = handoff.call_layer, handoff.layers_with_next
block_input, call_sublayer = handoff.block_input, handoff.call_sublayer
sublayer_into, take_handed, sublayer_output = handoff.sublayer_into, handoff.take_handed, handoff.sublayer_output
# The guard of each inlined call of a residual add function (``derived_inline.py``).
runs_inlined = derived_inline.runs_inlined
