"""Test setup: without a GPU the Triton kernels run on CPU in Triton's interpreter, rounding bf16 as a GPU does.

``hf_rmsnorm.ops.backend.configure`` must run before any kernel is defined, so it runs here at collection time
(importing hf_rmsnorm defines no kernel). With a GPU the kernels run natively (set HF_RMSNORM_TEST_INTERPRET=1
to force the interpreter); ``gpu``-marked tests skip without one.
"""

import os

import pytest
import torch

from hf_rmsnorm.ops import backend

backend.configure("cuda" if torch.cuda.is_available() and os.environ.get("HF_RMSNORM_TEST_INTERPRET") != "1" else "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
