"""The transformers integration: families as data, fused module classes, the cross-layer handoff, LayerNorm
models, and the walker (``patch_model`` / ``unpatch_model``) that ties them together. Imports only ``ops``."""

from .patcher import patch_model, unpatch_model
from .report import PatchReport, UnconvertibleModelError, UnsupportedModelError

__all__ = ["patch_model", "unpatch_model", "PatchReport", "UnsupportedModelError", "UnconvertibleModelError"]
