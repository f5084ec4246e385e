"""Tensor-parallel plans: which norms they leave patchable, and patched TP models matching unpatched ones.

transformers' TP styles (``transformers.distributed.tensor_parallel``) replace a planned module's forward on the
instance by a wrapper around the forward bound then. The fast tests install the real styles on tiny models on a
1-rank mesh: a wrapper that only hooks gradients (Qwen3's q_norm/k_norm in "auto" plans) or passes everything
through leaves the norm patchable, and the wrapper then calls the patched forward; a style that converts the
norm's arguments (SequenceParallel) is reported, with the reason also in the refusal of a model left with nothing
to patch. The slow test loads Llama and Qwen3 with ``tp_plan="auto"`` in 2 processes (tests/tp_run.py).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from family_cases import CASES
from patch_models import tiny_model
from launching import TESTS, free_port, run_checked
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from hf_rmsnorm import UnsupportedModelError, patch_model, unpatch_model
from hf_rmsnorm.ops.backend import kernels_interpreted
from hf_rmsnorm.patch.qk_attention import UNFUSED

pytestmark = pytest.mark.skipif(
    not kernels_interpreted(), reason="runs the kernels in Triton's interpreter, on CPU tensors (gloo)"
)

# Patched vs unpatched TP model, fp32, relative to the largest magnitude: the kernels' statistics differ from
# torch's by 1-2 fp32 ulp (reduction order, ~1e-7 relative), which 2 layers, the softmax and the loss's backward
# grow to ~1e-6 (measured: logits 3e-7, gradients 1.1e-6); 1e-5 leaves room without hiding a wrong term (>= 1e-3).
FP32_RTOL = 1e-5
SEQUENCE_PARALLEL_REASON = (
    "transformers' tensor-parallel style SequenceParallel transforms its arguments and output around its forward, "
    "and a fused residual add would pass the residual around that transform; hf_rmsnorm patches norms under styles "
    "that pass them through unchanged: leave the norms out of the tp_plan to patch them"
)

TP_QK_REASON = f"{UNFUSED}a tensor-parallel plan shards this attention"


def _wrapped_forward(module: torch.nn.Module):
    """The function a tensor-parallel wrapper on ``module`` calls, or None without a wrapper."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__))
    return cells["original_forward"].cell_contents.__func__


def test_qwen3_qk_norms_under_their_auto_plan_style_are_patched_and_the_wrapper_calls_the_kernels(mesh):
    model = tiny_model("qwen3")
    x = torch.randn(2, 5, 4, 16)
    q_norms = [layer.self_attn.q_norm for layer in model.model.layers]
    expected = q_norms[0](x)
    original_forward = type(q_norms[0]).forward
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            # transformers >= 5.2x wraps the forward (gradient all-reduce hooks); 5.17 adds a backward hook.
            ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"].install_forward(norm, mesh)

    report = patch_model(model)

    assert all(f"model.layers.{i}.self_attn.{n}_norm" in report.norms for i in range(2) for n in "qk")
    if _wrapped_forward(q_norms[0]) is not None:
        # The q/k norms run apart from the RoPE under a plan (hf_rmsnorm.patch.qk_attention): each attention says so.
        assert not report.fused_qk and [name for name, _ in report.skipped] == [f"model.layers.{i}.self_attn"
                                                                                 for i in range(2)]
        assert all(TP_QK_REASON in reason for _, reason in report.skipped)
    else:
        # 5.17's style is a backward hook, no wrapper: the attention is planned fused, and the hook guard
        # (hf_rmsnorm.patch.guard) runs its original statements at every call while the hook watches the norm.
        assert len(report.fused_qk) == 2
    if _wrapped_forward(q_norms[0]) is not None:
        assert all(_wrapped_forward(norm) is type(norm).forward is not original_forward for norm in q_norms)
    torch.testing.assert_close(q_norms[0](x), expected, rtol=1e-6, atol=1e-6)  # fp32 reductions
    unpatch_model(model)
    if _wrapped_forward(q_norms[0]) is not None:
        assert all(_wrapped_forward(norm) is original_forward for norm in q_norms)


def test_a_norm_under_a_style_that_passes_everything_through_is_patched(mesh):
    model = tiny_model("llama")
    TensorParallelLayer().install_forward(model.model.norm, mesh)  # the plans' "replicate"
    report = patch_model(model)
    assert "model.norm" in report.norms and report.skipped == []
    assert _wrapped_forward(model.model.norm) is type(model.model.norm).forward


def test_a_sequence_parallel_norm_is_skipped_with_the_reason(mesh):
    model = tiny_model("llama")
    ALL_PARALLEL_STYLES["sequence_parallel"].install_forward(model.model.norm, mesh)
    report = patch_model(model)
    assert report.skipped == [("model.norm", SEQUENCE_PARALLEL_REASON)]
    assert len(report.norms) == 4 and "model.layers.1: mlp residual -> model.norm" not in report.fused_adds


def test_a_model_whose_norms_are_all_sequence_parallel_is_refused_with_the_reason(mesh):
    model = tiny_model("llama")
    for name, module in model.named_modules():
        if name.endswith("norm"):
            ALL_PARALLEL_STYLES["sequence_parallel"].install_forward(module, mesh)
    with pytest.raises(UnsupportedModelError) as error:
        patch_model(model)
    assert str(error.value) == (
        "LlamaForCausalLM (model_type 'llama') has no norm hf_rmsnorm can patch (found: LlamaRMSNorm; "
        f"model.layers.0.input_layernorm and 4 more: {SEQUENCE_PARALLEL_REASON}); supported families: "
        "hf_rmsnorm.patch.family_names()"
    )


def test_a_wrapper_around_a_replaced_forward_is_reported(mesh):
    model = tiny_model("llama")
    norm = model.model.norm
    norm.forward = lambda hidden_states: hidden_states
    TensorParallelLayer().install_forward(norm, mesh)
    report = patch_model(model)
    assert ("model.norm", "transformers' tensor-parallel style TensorParallelLayer wraps a forward other than "
            "LlamaRMSNorm's own; call patch_model before replacing it") in report.skipped


@pytest.mark.slow
def test_patched_tp_models_match_unpatched_on_2_processes(tmp_path):
    models = []
    for family in ("llama", "qwen3"):
        tiny_model(family).save_pretrained(tmp_path / family)
        models.append(f"{family}={tmp_path / family}")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(TESTS / "tp_run.py"), "--out", str(out), *models]
    run_checked(cmd, TESTS)
    result = json.loads(out.read_text())

    for case, value in result["ops"].items():  # 2-rank DTensors vs the plain ops on the whole tensors
        if case.endswith("placements"):
            assert value == ("(Replicate(),)" if " R " in case else "(Shard(dim=1),)"), case
        else:
            assert value <= FP32_RTOL, case
    for case, run in result["models"].items():
        assert run["logits"] <= FP32_RTOL and run["grads"] <= FP32_RTOL, (case, run)
        assert run["grads_checked"] >= 21, case
        # The all-reduced branch outputs the fused adds read are local tensors, not DTensors.
        assert run["branch_outputs"] == ["Tensor"], case
    qwen3 = result["models"]["qwen3 auto"]
    assert len(qwen3["norms"]) == CASES["qwen3"].norms and not qwen3["fused_qk"]
    assert [name for name, _ in qwen3["skipped"]] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(TP_QK_REASON in reason for _, reason in qwen3["skipped"])
    assert all(f"model.layers.{i}.self_attn.{n}_norm" in qwen3["norms"] for i in range(2) for n in "qk")
    # Where the plan wrapped q_norm/k_norm (transformers >= 5.2x), the wrapper called the kernels, and calls the
    # original forward again after unpatching.
    for name, forward in qwen3["wrapped_forwards_patched"].items():
        assert forward == "Qwen3RMSNorm: hf_rmsnorm.patch.fused.Qwen3RMSNorm.forward", name
        assert qwen3["wrapped_forwards_unpatched"][name] == (
            "Qwen3RMSNorm: transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm.forward"
        )
    llama = result["models"]["llama auto"]
    assert llama["skipped"] == [] and (len(llama["norms"]), len(llama["fused_adds"])) == (
        CASES["llama"].norms, CASES["llama"].adds)
    sequence_parallel = result["models"]["llama sequence-parallel final norm"]
    assert sequence_parallel["skipped"] == [["model.norm", SEQUENCE_PARALLEL_REASON]]

