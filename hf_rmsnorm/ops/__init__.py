"""The kernel library: fused add + norm kernels, their launcher, a PyTorch reference and the functional API.

``modes`` (the casting orders, as data) -> ``reference`` (the maths in PyTorch) and ``kernels`` (the same maths
in Triton) -> ``launch`` (block sizes, allocation, launches) -> ``functional`` (custom ops, autograd and the
public functions; ``library`` names their namespace after this package's code); ``backend`` decides which
implementation runs, ``dtensor`` runs the public functions on the local shards of DTensor arguments. The query/key norms fused with the rotary embedding follow the same layers:
``qk_kernels`` -> ``qk_launch`` -> ``qk`` (``qk_norm_rope``, ``qk_rope_norm``). Nothing here knows about transformers.

Importing this package defines no Triton kernel (see ``backend``): the functional API is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .modes import MODES

if TYPE_CHECKING:
    from .functional import (
        fused_add_layer_norm,
        fused_add_rms_norm,
        layer_norm,
        layer_norm_add,
        rms_norm,
        rms_norm_add,
    )
    from .qk import qk_norm_rope, qk_rope_norm

# The functional API, loaded from ``functional`` on first use.
_FUNCTIONAL = ("rms_norm", "fused_add_rms_norm", "rms_norm_add", "layer_norm", "fused_add_layer_norm", "layer_norm_add")
# The fused q/k norms and RoPE, loaded from ``qk`` on first use.
_QK = ("qk_norm_rope", "qk_rope_norm")

__all__ = [*_FUNCTIONAL, *_QK, "MODES"]


def __getattr__(name: str):
    if name not in _FUNCTIONAL and name not in _QK:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".qk" if name in _QK else ".functional", __name__), name)
    globals()[name] = value  # later lookups skip this function (an import costs tens of microseconds)
    return value
