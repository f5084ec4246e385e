"""The q/k norms + RoPE fusion with the offloaded caches, which need a GPU (``gpu`` marker: skipped elsewhere). Apart
from ``test_qk_families.py`` so that the GPU suite's tests section runs this file whole at little cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launching import ROOT, TESTS
from qk_generate import GENERATE_QK, GPU_CACHES

# Each case runs in a child process: ``generate()`` with the offloaded static cache compiles the model on a GPU, and
# that compilation crashed once on an H200 (torch 2.11, a segmentation fault in Dynamo during an OLMo 2 cache
# update, 2026-11-28), taking the pytest worker with it. In a child, a crash fails its case alone and says which
# generation crashed: the unpatched model's (torch's own) or the patched one's.
CHILD_TIMEOUT_S = 100
_CHILD = """
import json, sys
sys.path[:0] = {paths!r}
import torch
from _pytest.monkeypatch import MonkeyPatch
from family_cases import CASES
from patch_models import input_ids
from qk_generate import counting_launches, generated, qk_model
from hf_rmsnorm import patch_model

name, cache = {name!r}, {cache!r}
overrides = {{"layer_types": ["sliding_attention", "full_attention"]}} if name == "gemma3_text" else {{}}
model = qk_model(name, **overrides).cuda()
model.generation_config.cache_implementation = cache
ids = input_ids(seq=6).cuda()
unpatched_tokens, unpatched_logits = generated(model, ids)
print("unpatched generated", flush=True)
patch_model(model)
with counting_launches(MonkeyPatch()) as launches:
    tokens, logits = generated(model, ids)
print("patched generated", flush=True)
print(json.dumps(dict(
    launches=launches[0], expected_launches=4 * CASES[name].qk_launches,
    same_tokens=torch.equal(tokens, unpatched_tokens),
    logits_error=(logits - unpatched_logits).abs().max().item(), scale=unpatched_logits.abs().max().item(),
)))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name", GENERATE_QK)
@pytest.mark.parametrize("cache", GPU_CACHES)
def test_generate_with_the_offloaded_caches_on_a_gpu(name, cache):
    """The offloaded caches keep every full-attention layer's keys and values on the CPU and prefetch the next
    layer's to the GPU: patched and unpatched fp32 generation give the same tokens, each step's logits within 1e-5
    of the largest, and the fused launch runs at every step of every layer. Gemma 3 gets a full-attention layer:
    the offloaded dynamic cache keeps sliding layers on the GPU. Where the unpatched model's own generation
    crashes, the case is an expected failure of torch's, not a result."""
    child = _CHILD.format(paths=[str(TESTS), str(ROOT)], name=name, cache=cache)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env=env)
    if proc.returncode != 0:
        output = proc.stdout[-2000:] + proc.stderr[-6000:]
        if proc.returncode < 0 and "unpatched generated" not in proc.stdout:
            pytest.xfail(f"the unpatched model's own generate() crashed (signal {-proc.returncode}): {output}")
        pytest.fail(f"exit status {proc.returncode}: {output}")
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["launches"] >= result["expected_launches"]
    assert result["same_tokens"]
    assert result["logits_error"] <= 1e-5 * result["scale"]
