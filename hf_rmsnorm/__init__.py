"""hf_rmsnorm: fused Triton RMSNorm + residual-add kernels for Hugging Face transformers models."""

from .ops import fused_add_rms_norm, rms_norm
from .patcher import (
    PatchReport,
    UnconvertibleModelError,
    UnsupportedModelError,
    patch_model,
    recentre,
    unpatch_model,
)

__version__ = "0.1.0"

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "patch_model",
    "unpatch_model",
    "PatchReport",
    "UnsupportedModelError",
    "UnconvertibleModelError",
    "recentre",
    "__version__",
]
