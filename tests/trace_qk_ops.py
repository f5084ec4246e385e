"""Traces compiled ``qk_norm_rope`` calls on fake GPU tensors and prints, as JSON, what the graphs inductor would get
contain: ``trace_compiled_ops.py``'s method (and helpers) for the fused q/k norms + RoPE.

Run as a script by tests/ops/test_qk_rope.py, in a process of its own (the kernels must be defined for a GPU).
"""

from __future__ import annotations

import json
import sys

import torch


from trace_compiled_ops import _Context, _describe, _trace, _without_a_gpu  # sets the kernels up for a GPU

from hf_rmsnorm import qk_norm_rope  # noqa: E402
from hf_rmsnorm.ops import library, qk  # noqa: E402

B, T, Q_HEADS, K_HEADS, HEAD_DIM = 2, 5, 4, 2, 64


def _qk_backward(mode: str, per_head: bool):
    """The backward as the autograd engine calls it (fake CUDA tensors cannot take part in autograd on a CPU-only
    torch build), from the saved tensors of a forward."""

    def backward(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, stats):
        ctx = _Context()
        qk._setup(ctx, (q, k, q_weight, k_weight, cos, sin, 1e-6, 1e-6, mode, per_head), (None, None, stats))
        return [g for g in qk._backward(ctx, dq_out, dk_out, None) if g is not None]

    return backward


def main() -> None:
    if not torch.cuda.is_available():
        _without_a_gpu()
    bf16, fp32 = torch.bfloat16, torch.float32
    q, k = ((B, T, Q_HEADS, HEAD_DIM), bf16), ((B, T, K_HEADS, HEAD_DIM), bf16)
    trig = ((1, T, HEAD_DIM), bf16)
    per_head_stats = ((4 + B * T * (Q_HEADS + K_HEADS),), fp32)
    cases = {
        "qwen3": _trace(lambda *a: qk_norm_rope(*a), q, k, ((HEAD_DIM,), bf16), ((HEAD_DIM,), bf16), trig, trig),
        "olmo2_dynamic": _trace(lambda *a: qk_norm_rope(*a, mode="fp32_affine", per_head=False), q, k,
                                ((Q_HEADS * HEAD_DIM,), bf16), ((K_HEADS * HEAD_DIM,), bf16), trig, trig,
                                dynamic=True),
        "weightless": _trace(lambda q_, k_, c, s: qk_norm_rope(q_, k_, None, None, c, s), q, k, trig, trig),
        "qwen3_backward": _trace(_qk_backward("llama", True), q, k, q, k, ((HEAD_DIM,), bf16), ((HEAD_DIM,), fp32),
                                 trig, trig, per_head_stats),
    }
    kernels = {name: [kernel.fn.__name__
                      for kernel in torch._library.triton.get_triton_kernels_for_op(library.qualified_name(name))]
               for name in ("qk_norm_rope_fwd_triton", "qk_norm_rope_bwd_triton")}
    json.dump({"cases": cases, "kernels_of_ops": kernels}, sys.stdout)


if __name__ == "__main__":
    main()
