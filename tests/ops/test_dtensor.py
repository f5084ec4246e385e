"""DTensor arguments of the public ops and of patched norms, in this process on a 1-rank gloo mesh.

On one rank a shard is the whole tensor, so the ops must give exactly the plain ops' values, with the placements
DTensor's own eager computation of the same norm gives (outputs and gradients). Real 2-rank shards, even and
uneven, run in tests/tp_run.py (test_tensor_parallel.py). The refusals are asserted whole. A compiled call
(``fullgraph=True``) takes DTensors as the eager one does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from patch_models import tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hf_rmsnorm import fused_add_layer_norm, fused_add_rms_norm, layer_norm, patch_model, rms_norm
from hf_rmsnorm.ops import layer_norm_add, rms_norm_add
from hf_rmsnorm.ops.backend import kernels_interpreted

pytestmark = pytest.mark.skipif(
    not dist.is_available() or (not kernels_interpreted() and not torch.cuda.is_available()),
    reason="needs torch.distributed, and a GPU or Triton's interpreter for the kernels",
)

DEVICE = "cpu" if kernels_interpreted() else "cuda"
EPS = 1e-6


def _eager_llama_norm(x, weight):
    """Hugging Face's Llama RMSNorm written out in torch ops, which DTensor runs itself (its placements rule)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _call(op: str, x, residual, weight, bias):
    if op == "rms_norm":
        return rms_norm(x, weight, EPS, bias=bias), None
    if op == "layer_norm":
        return layer_norm(x, weight, bias, EPS), None
    if op == "fused_add_rms_norm":
        return fused_add_rms_norm(x, residual, weight, EPS, bias=bias)
    if op == "fused_add_layer_norm":
        return fused_add_layer_norm(x, residual, weight, bias, EPS)
    if op == "layer_norm_add":
        return layer_norm_add(x, residual, weight, bias, EPS), None
    return rms_norm_add(x, residual, weight, EPS, bias=bias), None


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate()], ids=str)
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "rms_norm_add", "layer_norm", "fused_add_layer_norm",
                                "layer_norm_add"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_ops_run_on_the_local_shards_and_return_dtensors_placed_as_x(mesh, placement, op, with_bias):
    gen = torch.Generator().manual_seed(0)
    x, residual, dy = (torch.randn(2, 6, 32, generator=gen).to(DEVICE) for _ in range(3))
    weight = (torch.randn(32, generator=gen) * 0.3 + 1).to(DEVICE)
    bias = torch.randn(32, generator=gen).to(DEVICE) if with_bias else None
    plain = [None if t is None else t.clone().requires_grad_() for t in (x, residual, weight, bias)]
    dist_args = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, residual)]
    dist_args += [None if t is None else torch.nn.Parameter(distribute_tensor(t, mesh, [Replicate()]))
                  for t in (weight, bias)]

    expected, expected_sum = _call(op, *plain)
    y, new_sum = _call(op, *dist_args)
    (expected * dy).sum().backward()
    (y * distribute_tensor(dy, mesh, [placement])).sum().backward()

    assert isinstance(y, DTensor) and y.placements == (placement,) and y.shape == x.shape
    assert torch.equal(y.full_tensor(), expected)
    if new_sum is not None:
        assert new_sum.placements == (placement,) and torch.equal(new_sum.full_tensor(), expected_sum)
    for got, want in zip(dist_args, plain):
        if want is None or want.grad is None:  # no bias; rms_norm and layer_norm take no residual
            assert got is None or got.grad is None
        else:
            assert torch.equal(got.grad.full_tensor(), want.grad)
    # A replicated parameter's gradient sums over the rows: a pending sum where they are sharded, as in DTensor's
    # own computation of the norm since torch 2.13 (2.11's reduces its own at once: Replicate, the same values).
    reference_weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
    _eager_llama_norm(distribute_tensor(x, mesh, [placement]), reference_weight).sum().backward()
    pending = (Replicate(),) if placement == Replicate() else (Partial(),)
    assert dist_args[2].grad.placements == pending
    assert reference_weight.grad.placements in {pending, (Replicate(),)}
    assert dist_args[0].grad.placements == (placement,)


def test_a_patched_norm_takes_the_dtensors_of_a_sequence_parallel_plan(mesh):
    # What transformers' SequenceParallel hands a norm: a replicated weight, an input sharded along the sequence.
    model = tiny_model("llama").to(DEVICE)
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]))
    x = distribute_tensor(torch.randn(2, 6, 64, device=DEVICE), mesh, [Shard(1)]).requires_grad_()
    expected = _eager_llama_norm(x, norm.weight)
    expected.sum().backward()
    expected_grads = (x.grad.full_tensor(), norm.weight.grad.full_tensor())
    x.grad = norm.weight.grad = None

    patch_model(model)
    y = norm(x)
    y.sum().backward()

    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), expected.full_tensor(), rtol=1e-6, atol=1e-6)  # fp32 reductions
    torch.testing.assert_close(x.grad.full_tensor(), expected_grads[0], rtol=1e-5, atol=1e-5)
    assert norm.weight.grad.placements == (Partial(),)
    torch.testing.assert_close(norm.weight.grad.full_tensor(), expected_grads[1], rtol=1e-5, atol=1e-5)


def _refusal_cases(mesh):
    x = torch.randn(2, 6, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    seq = distribute_tensor(x, mesh, [Shard(1)])
    rep_w = distribute_tensor(w, mesh, [Replicate()])
    other_mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=("other",))
    fix = "redistribute x to Replicate() or Shard(<sequence dim>) first"
    return {
        "hidden shard": (
            lambda: rms_norm(distribute_tensor(x, mesh, [Shard(2)]), rep_w),
            "rms_norm: x is a DTensor sharded along its last (hidden) dimension (S(2) on mesh dimension 0), which the "
            f"norm reduces over; {fix}",
        ),
        "partial": (
            lambda: rms_norm(DTensor.from_local(x, mesh, [Partial()], run_check=False), rep_w),
            "rms_norm: x is a DTensor with a Partial placement on mesh dimension 0 (a pending sum across ranks); a "
            f"norm needs the summed values: {fix}",
        ),
        "sharded weight": (
            lambda: rms_norm(seq, distribute_tensor(w, mesh, [Shard(0)])),
            "rms_norm: weight is a DTensor with placements (S(0)); a norm needs the whole weight on every rank: use "
            "Replicate() for weight (the plan's default for norms)",
        ),
        "plain weight": (
            lambda: rms_norm(seq, w),
            "rms_norm: x is a DTensor but weight is a plain torch.Tensor; pass both as DTensors "
            "(DTensor.from_local(weight, mesh, placements)) or both as local tensors (.to_local())",
        ),
        "plain x": (
            lambda: rms_norm(x, rep_w),
            "rms_norm: weight is a DTensor but x is a plain torch.Tensor; pass both as DTensors "
            "(DTensor.from_local(x, mesh, placements)) or both as local tensors (.to_local())",
        ),
        "plain residual": (
            lambda: fused_add_rms_norm(seq, x, rep_w),
            "fused_add_rms_norm: x is a DTensor but residual is a plain torch.Tensor; pass both as DTensors "
            "(DTensor.from_local(residual, mesh, placements)) or both as local tensors (.to_local())",
        ),
        "residual placed otherwise": (
            lambda: rms_norm_add(seq, distribute_tensor(x, mesh, [Replicate()]), rep_w),
            "rms_norm_add: residual is a DTensor with placements (R) but x has (S(1)); DTensor activations must have "
            "the same placements (redistribute one of them)",
        ),
        # The LayerNorm functions' errors name them.
        "layer_norm hidden shard": (
            lambda: layer_norm(distribute_tensor(x, mesh, [Shard(2)]), rep_w, None),
            "layer_norm: x is a DTensor sharded along its last (hidden) dimension (S(2) on mesh dimension 0), which "
            f"the norm reduces over; {fix}",
        ),
        "layer_norm_add residual placed otherwise": (
            lambda: layer_norm_add(seq, distribute_tensor(x, mesh, [Replicate()]), rep_w, None),
            "layer_norm_add: residual is a DTensor with placements (R) but x has (S(1)); DTensor activations must "
            "have the same placements (redistribute one of them)",
        ),
        "other mesh": (
            lambda: rms_norm(seq, distribute_tensor(w, other_mesh, [Replicate()])),
            f"rms_norm: weight is a DTensor on {other_mesh} but x is on {mesh}; all DTensor arguments must be on one "
            "device mesh",
        ),
    }


@pytest.mark.parametrize("case", [
    "hidden shard", "partial", "sharded weight", "plain weight", "plain x",
    "plain residual", "residual placed otherwise", "other mesh", "layer_norm hidden shard",
    "layer_norm_add residual placed otherwise",
])
def test_dtensors_the_norm_is_not_row_local_on_are_refused_in_one_line(mesh, case):
    call, message = _refusal_cases(mesh)[case]
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message


def test_compiled_calls_take_dtensors_too(mesh):
    x = torch.randn(2, 6, 32, device=DEVICE)
    weight = torch.randn(32, device=DEVICE) * 0.3 + 1
    y = torch.compile(rms_norm, fullgraph=True)(
        distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(weight, mesh, [Replicate()]), EPS
    )
    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    assert torch.equal(y.full_tensor(), rms_norm(x, weight, EPS))
