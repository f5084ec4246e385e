"""Test setup: without a GPU the Triton kernels run on CPU in Triton's interpreter, rounding bf16 as a GPU does.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before hf_rmsnorm is
imported, so it is set here at collection time (importing torch defines no kernel). With a GPU the kernels
run natively (set HF_RMSNORM_TEST_INTERPRET=1 to force the interpreter); ``gpu``-marked tests skip without one.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("HF_RMSNORM_TEST_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from hf_rmsnorm.interpreter import round_bf16_to_nearest_even  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    assert round_bf16_to_nearest_even(), "could not patch the Triton interpreter's bf16 rounding"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
