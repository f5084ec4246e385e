"""Test setup: without a GPU the Triton kernels run on CPU in Triton's interpreter, rounding bf16 as a GPU does.

``hf_rmsnorm.ops.backend.configure`` must run before any kernel is defined, so it runs here at collection time
(importing hf_rmsnorm defines no kernel). With a GPU the kernels run natively (set HF_RMSNORM_TEST_INTERPRET=1
to force the interpreter); ``gpu``-marked tests skip without one.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

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


@pytest.fixture(scope="module")
def mesh():
    """A 1-rank device mesh (gloo on CPU, nccl on a GPU), for the DTensor and tensor-parallel tests."""
    device = "cpu" if backend.kernels_interpreted() else "cuda"
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo" if device == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh(device, (1,))
    if started:
        dist.destroy_process_group()


@pytest.fixture
def fresh_accelerate_state():
    """Resets accelerate's singleton state around a test that builds an Accelerator in this process."""
    from accelerate.state import AcceleratorState  # a test extra: imported by the tests that need it only

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
