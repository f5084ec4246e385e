"""A sandwich norm's add between two norms in one kernel (Gemma 2-4, GLM-4: ``h = residual + post_norm(h);
residual = h; h = pre_norm(h)``): ``ops.functional.norm_add_norm`` of the two patched norms' own arguments, where it
computes what calling them does (``chains``). The layer shapes' bodies (``shapes.py``) and the derived forwards
(``derived_runtime.norm_add_norm``) call it; so does a sandwich layer's output add, ``residual +
post_mlp_norm(h)``, with the next layer's input norm (``handoff.add_normed_residual``). Each falls back to its own
plain calls otherwise.
"""

from __future__ import annotations

from torch import Tensor, nn

from . import guard


def chains(norm: nn.Module, next_norm: nn.Module) -> bool:
    """Whether one kernel computes ``next_norm(residual + norm(x))`` and the sum as the two modules' calls do. The
    kernel takes both norms' parameters without calling either module (``fused_pair``), so each must be a patched
    norm (a fused class holding its mode's ``BoundNorm``) of one mode whose call runs nothing but its class's fused
    forward as installed: no hook, a call dispatched straight to ``forward`` (``guard.calls_forward_alone``: not
    compiled on its own, no profiler's ``_call_impl``, no ``torch.jit.trace``), no forward set on the class or the
    instance since patching, no accelerate hook (``_hf_hook``, which moves or offloads its weights on the call).
    Then calling it runs exactly that forward, which reads its parameters (``NormKind.argument_reader``) and runs its
    mode's op: ``fused_pair`` reads the same and runs the op that computes both (bitwise the two ops)."""
    return (
        _runs_its_fused_forward(norm) and _runs_its_fused_forward(next_norm)
        and type(norm)._hf_rmsnorm_kind.mode == type(next_norm)._hf_rmsnorm_kind.mode
        and guard.calls_forward_alone(norm) and guard.calls_forward_alone(next_norm)
    )


def fused_pair(norm: nn.Module, x: Tensor, residual: Tensor, next_norm: nn.Module) -> tuple[Tensor, Tensor]:
    """``(next_norm(residual + norm(x)), residual + norm(x))`` from one launch (rows of one tile); for two norms
    ``chains`` accepts."""
    weight, eps, bias = type(norm)._hf_rmsnorm_arguments(norm)
    weight2, eps2, bias2 = type(next_norm)._hf_rmsnorm_arguments(next_norm)
    return type(norm)._hf_rmsnorm_norm.norm_add_norm(x, residual, weight, eps, bias, weight2, eps2, bias2)


def _runs_its_fused_forward(norm: nn.Module) -> bool:
    # ``cls.forward``, not the class ``__dict__``'s entry: Dynamo refuses a mapping proxy read after the dict changed.
    cls = type(norm)
    return getattr(cls, "_hf_rmsnorm_norm", None) is not None and cls.forward is cls._hf_rmsnorm_forward and not (
        "forward" in norm.__dict__ or "_hf_hook" in norm.__dict__)
