"""The q/k norms + RoPE fusion with the offloaded caches, which need a GPU (``gpu`` marker: skipped elsewhere). Apart
from ``test_qk_families.py`` so that the GPU suite's tests section runs this file whole at little cost."""

from __future__ import annotations

import pytest
import torch
from family_cases import CASES
from patch_models import input_ids
from qk_generate import GENERATE_QK, GPU_CACHES, counting_launches, generated, qk_model

from hf_rmsnorm import patch_model


@pytest.mark.gpu
@pytest.mark.parametrize("name", GENERATE_QK)
@pytest.mark.parametrize("cache", GPU_CACHES)
def test_generate_with_the_offloaded_caches_on_a_gpu(name, cache, monkeypatch):
    """The offloaded caches keep every full-attention layer's keys and values on the CPU and prefetch the next
    layer's to the GPU: patched and unpatched fp32 generation give the same tokens, each step's logits within 1e-5
    of the largest, and the fused launch runs at every step of every layer. Gemma 3 gets a full-attention layer:
    the offloaded dynamic cache keeps sliding layers on the GPU."""
    overrides = {"layer_types": ["sliding_attention", "full_attention"]} if name == "gemma3_text" else {}
    model = qk_model(name, **overrides).cuda()
    model.generation_config.cache_implementation = cache
    ids = input_ids(seq=6).cuda()
    unpatched_tokens, unpatched_logits = generated(model, ids)
    patch_model(model)
    with counting_launches(monkeypatch) as launches:
        tokens, logits = generated(model, ids)
    assert launches[0] >= 4 * CASES[name].qk_launches
    assert torch.equal(tokens, unpatched_tokens)
    scale = unpatched_logits.abs().max().item()
    assert (logits - unpatched_logits).abs().max().item() <= 1e-5 * scale
