"""hf_rmsnorm: fused Triton norm + residual-add kernels for Hugging Face transformers models.

Three wings, each importing only the ones below it: ``tools`` (behind the scripts) -> ``patch`` (the
transformers integration) -> ``ops`` (kernels, launcher, reference, functional API).

The public names below are imported on first use, so ``import hf_rmsnorm`` (or ``hf_rmsnorm.ops.backend``)
defines no Triton kernel yet: Triton decides between compiling and interpreting a kernel when it is defined,
and ``hf_rmsnorm.ops.backend.configure`` must be able to run before that.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_PUBLIC = {
    "rms_norm": "hf_rmsnorm.ops",
    "fused_add_rms_norm": "hf_rmsnorm.ops",
    "rms_norm_add": "hf_rmsnorm.ops",
    "layer_norm": "hf_rmsnorm.ops",
    "fused_add_layer_norm": "hf_rmsnorm.ops",
    "layer_norm_add": "hf_rmsnorm.ops",
    "qk_norm_rope": "hf_rmsnorm.ops",
    "qk_rope_norm": "hf_rmsnorm.ops",
    "patch_model": "hf_rmsnorm.patch",
    "unpatch_model": "hf_rmsnorm.patch",
    "check_model": "hf_rmsnorm.patch",
    "PatchReport": "hf_rmsnorm.patch",
    "UnsupportedModelError": "hf_rmsnorm.patch",
    "UnconvertibleModelError": "hf_rmsnorm.patch",
}

if TYPE_CHECKING:
    from .ops import (
        fused_add_layer_norm,
        fused_add_rms_norm,
        layer_norm,
        layer_norm_add,
        qk_norm_rope,
        qk_rope_norm,
        rms_norm,
        rms_norm_add,
    )
    from .patch import (
        PatchReport,
        UnconvertibleModelError,
        UnsupportedModelError,
        check_model,
        patch_model,
        unpatch_model,
    )

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
