"""``hf_rmsnorm.tools.norm_outputs``: counting patched norm outputs that round differently, in ulps."""

from __future__ import annotations

import pytest
import torch
from patch_models import input_ids, tiny_model

from hf_rmsnorm import check_model, patch_model
from hf_rmsnorm.tools.norm_outputs import compare_norm_outputs, recorded_norm_calls, ulp_distance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_ulp_distance_counts_representable_values(dtype):
    one = torch.tensor([1.0], dtype=dtype)
    up = one + torch.finfo(dtype).eps  # the next representable value above 1
    assert ulp_distance(one, one).item() == 0 and ulp_distance(one, up).item() == 1
    # Across zero: +0 and -0 are the same value, and the smallest values either side are two steps apart.
    tiny = torch.tensor([torch.finfo(dtype).smallest_normal], dtype=dtype)
    zeros = torch.tensor([0.0], dtype=dtype)
    assert ulp_distance(zeros, -zeros).item() == 0
    assert ulp_distance(tiny, -tiny).item() == 2 * ulp_distance(tiny, zeros).item()


def test_ulp_distance_needs_one_float_dtype():
    with pytest.raises(ValueError, match="one float dtype"):
        ulp_distance(torch.ones(1), torch.ones(1, dtype=torch.float64))


def test_patched_norms_are_compared_on_the_recorded_inputs():
    model = tiny_model("llama", torch.bfloat16)
    names = check_model(model).norms
    with recorded_norm_calls(model, names) as calls, torch.no_grad():
        model(input_ids(batch=3, seq=9))
    assert [name for name, _, _ in calls] == [n for n in names if "layers" in n] + ["model.norm"]
    assert not any(module._forward_hooks for module in model.modules())  # the hooks are gone
    patch_model(model)
    agreement = compare_norm_outputs(model, calls)
    assert agreement.norm_calls == len(names) and agreement.elements == len(names) * 3 * 9 * 64
    assert agreement.differing <= agreement.elements // 1000 and agreement.max_ulp <= 1
    # A defect shows: a weight changed after recording makes most outputs differ, by many ulps.
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    broken = compare_norm_outputs(model, calls)
    assert broken.differing - agreement.differing > 3 * 9 * 64 // 2 and broken.max_ulp > 10
