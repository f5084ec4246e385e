"""The norm-free oracle: a model whose norms return their input, for timing only.

A model run with every norm replaced by a stand-in that costs nothing (it returns its input; the residual adds
stay plain adds) bounds what any norm kernel could save: the patched model's gain over the unpatched one, divided
by the norm-free model's gain, is the share of the possible gain the patch delivers. Where the patch runs an
attention's q/k norms and its RoPE as one launch (``hf_rmsnorm.patch.qk_attention``), the RoPE is part of what the
patch removes, so the oracle makes that RoPE function return its inputs too (``ropes``). Its outputs mean nothing
(nothing is normalised): it is timed, never compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # imported by the GPU suite's report, which runs without torch
    from torch import Tensor, nn

ORACLE_NOTE = ("norm-free: every norm returns its input, and so does the RoPE the patch fuses with q/k norms "
               "(timing only; its outputs are meaningless)")


def _pass_through(hidden_states: Tensor, *args, **kwargs) -> Tensor:
    return hidden_states


def _rope_pass_through(q: Tensor, k: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
    return q, k


def _one_tensor_rope_pass_through(x: Tensor, *args, **kwargs) -> Tensor:
    return x


def fused_ropes(model: nn.Module) -> list[tuple[dict, str, Callable]]:
    """The RoPE functions of the attention modules of patched ``model`` whose q/k norms run with them as one
    launch: ``(the modeling module's namespace, the function's name, its norm-free stand-in)``, each once (the
    stand-in returns the query and key, or the one tensor of a one-tensor site's function)."""
    from ..patch.qk_attention import QKAttentionKind

    found: dict[tuple[int, str], tuple[dict, str, Callable]] = {}
    for module in model.modules():
        kind = type(module).__dict__.get("_hf_rmsnorm_kind")
        if isinstance(kind, QKAttentionKind):  # a tuple of one-tensor sites, or one site of q and k
            stand_in = _one_tensor_rope_pass_through if isinstance(kind.site, tuple) else _rope_pass_through
            found[id(kind.rope.__globals__), kind.rope_name] = (kind.rope.__globals__, kind.rope_name, stand_in)
    return list(found.values())


@contextlib.contextmanager
def norm_free(model: nn.Module, norm_names: list[str],
              ropes: Sequence[tuple[dict, str, Callable]] = ()) -> Iterator[None]:
    """Within the block, the modules of ``model`` named in ``norm_names`` return their input, and the functions
    ``ropes`` names (``fused_ropes``) their query and key.

    The stand-in is an instance attribute ``forward`` (``nn.Module.__call__`` calls ``self.forward``), removed on
    exit, so the classes, weights and hooks stay as they were; the modules must not be patched meanwhile (the
    patcher refuses modules with an instance ``forward``). A RoPE function is replaced in its module's namespace,
    where the attention's forward looks it up, and put back on exit."""
    modules = dict(model.named_modules())
    missing = [name for name in norm_names if name not in modules]
    if missing:
        raise ValueError(f"norm_free: {missing[0]} is not a module of the model")
    replaced = [modules[name] for name in norm_names]
    functions = [(namespace, name, namespace[name], stand_in) for namespace, name, stand_in in ropes]
    for module in replaced:
        module.forward = _pass_through
    for namespace, name, _, stand_in in functions:
        namespace[name] = stand_in
    try:
        yield
    finally:
        for module in replaced:
            del module.forward
        for namespace, name, function, _ in functions:
            namespace[name] = function


def gain_share(unpatched_rate: float, patched_rate: float, norm_free_rate: float) -> float | None:
    """The patched model's time saved over the norm-free model's time saved, per token (rates in tokens/s);
    None when the norm-free model is not faster than the unpatched one (no gain to share: noise, or norms that
    cost nothing measurable)."""
    unpatched, patched, free = 1 / unpatched_rate, 1 / patched_rate, 1 / norm_free_rate
    if free >= unpatched:
        return None
    return (unpatched - patched) / (unpatched - free)


def format_share(share: float | None) -> str:
    """A ``gain_share`` as a whole percentage, or ``n/a`` where there was no gain to share."""
    return "n/a" if share is None else f"{100 * share:.0f}%"
