"""The transformers integration: families as data, fused module classes, the cross-layer handoff, LayerNorm
models, and the walker (``patch_model`` / ``unpatch_model``) that ties them together. Imports only ``ops``."""

from .families import family_names
from .patcher import check_model, patch_model, unpatch_model
from .report import PatchReport, UnconvertibleModelError, UnsupportedModelError

__all__ = [
    "patch_model", "unpatch_model", "check_model", "family_names", "PatchReport", "UnsupportedModelError",
    "UnconvertibleModelError",
]
