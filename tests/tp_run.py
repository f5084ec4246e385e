"""Tensor parallel on CPU, run by tests/patch/test_tensor_parallel.py as ``python -m torch.distributed.run
--nproc_per_node 2 tests/tp_run.py --out RESULT.json FAMILY=MODEL_DIR...`` (gloo; kernels in Triton's interpreter).

Each rank checks, and rank 0 writes as JSON (the largest difference over both ranks):

* ``ops``: the public ops on real 2-rank DTensors (sequence-sharded, evenly and not, and replicated activations,
  replicated weight and bias) against the plain ops on the whole tensors: outputs, input and weight gradients;
* ``models``: each saved model loaded with ``tp_plan="auto"`` (and Llama with a sequence-parallel final norm),
  unpatched then patched in place: logits in inference (where layers hand their sums to the next norm) and the
  gradients of one ``loss.backward()``, with the patch report.
"""

from __future__ import annotations

import argparse
import gc
import json

from hf_rmsnorm.ops import backend

backend.configure("cpu")  # before any kernel is defined

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from patch_models import input_ids  # noqa: E402  (tests/ is the script's directory, on sys.path)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from hf_rmsnorm import fused_add_rms_norm, patch_model, rms_norm, unpatch_model  # noqa: E402
from hf_rmsnorm.ops import rms_norm_add  # noqa: E402

# The final norm of Llama's "auto" plan made sequence parallel: a style that converts the norm's input to a DTensor.
SEQUENCE_PARALLEL_FINAL_NORM = {"model.norm": "sequence_parallel"}


def _max_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``b`` (fp32 noise is relative to the scale)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_ops(mesh) -> dict[str, float]:
    """Public ops on DTensors vs on the whole plain tensors; every rank holds the same whole tensors (one seed)."""
    results = {}
    gen = torch.Generator().manual_seed(0)
    for seq, placement in ((6, Shard(1)), (5, Shard(1)), (6, Replicate())):
        x, residual, dy = (torch.randn(2, seq, 32, generator=gen) for _ in range(3))
        weight, bias = torch.randn(32, generator=gen) * 0.3 + 1, torch.randn(32, generator=gen)
        for op in ("rms_norm", "fused_add_rms_norm", "rms_norm_add"):
            plain = [t.clone().requires_grad_() for t in (x, residual, weight, bias)]
            dtensors = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (x, residual)]
            dtensors += [torch.nn.Parameter(distribute_tensor(t, mesh, [Replicate()])) for t in (weight, bias)]
            outs = []
            for px, pres, pw, pb in (plain, dtensors):
                if op == "rms_norm":
                    y = rms_norm(px, pw, 1e-6, bias=pb)
                elif op == "fused_add_rms_norm":
                    y = fused_add_rms_norm(px, pres, pw, 1e-6, bias=pb)[0]
                else:
                    y = rms_norm_add(px, pres, pw, 1e-6, bias=pb)
                grad = distribute_tensor(dy, mesh, [placement]) if isinstance(y, DTensor) else dy
                (y * grad).sum().backward()
                outs.append([_full(t) for t in (y, px.grad, pw.grad, pb.grad)])
            key = f"{op} {placement} seq={seq}"
            results[key] = max(_relative(d, p) for d, p in zip(outs[1], outs[0]))
            results[f"{key} placements"] = str(y.placements)
    return {key: _max_over_ranks(v) if isinstance(v, float) else v for key, v in results.items()}


def _forward_backward(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(ids).logits
    model(ids, labels=ids).loss.backward()
    return logits, {name: _full(p.grad) for name, p in model.named_parameters()}


def _wrapped_forwards(model) -> dict[str, str]:
    """For each norm whose forward a tensor-parallel plan wrapped: the qualified name of the forward it calls."""
    calls = {}
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if "Norm" in type(module).__name__ and getattr(forward, "__name__", None) == "tp_forward":
            cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
            wrapped = cells["original_forward"].cell_contents
            calls[name] = f"{type(module).__name__}: {wrapped.__func__.__module__}.{wrapped.__func__.__qualname__}"
    return calls


def compare(model_dir: str, tp_plan) -> dict:
    """The TP model unpatched, then patched in place: its report and the largest differences."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_plan=tp_plan), dtype=torch.float32
    ).eval()
    ids = input_ids()
    # What the fused residual adds receive from the attention and the MLP once the plan has reduced their outputs.
    branch_outputs = set()

    def record_type(_module, _args, output):
        branch_outputs.add(type(output[0] if isinstance(output, tuple) else output).__name__)

    for name, module in model.named_modules():
        if name.endswith((".self_attn", ".mlp")):
            module.register_forward_hook(record_type)
    logits, grads = _forward_backward(model, ids)
    report = patch_model(model)
    patched_logits, patched_grads = _forward_backward(model, ids)
    wrapped = _wrapped_forwards(model)
    unpatch_model(model)
    return {
        "norms": report.norms,
        "skipped": report.skipped,
        "fused_adds": report.fused_adds,
        "fused_qk": report.fused_qk,
        "branch_outputs": sorted(branch_outputs),
        "wrapped_forwards_patched": wrapped,
        "wrapped_forwards_unpatched": _wrapped_forwards(model),
        "logits": _max_over_ranks(_relative(patched_logits, logits)),
        "grads": _max_over_ranks(max(_relative(patched_grads[name], g) for name, g in grads.items())),
        "grads_checked": len(grads),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("models", nargs="+", help="FAMILY=DIR of a model saved with save_pretrained")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = {"ops": check_ops(init_device_mesh("cpu", (dist.get_world_size(),))), "models": {}}
    for family, model_dir in (arg.split("=", 1) for arg in args.models):
        results["models"][f"{family} auto"] = compare(model_dir, "auto")
        if family == "llama":
            key = f"{family} sequence-parallel final norm"
            results["models"][key] = compare(model_dir, SEQUENCE_PARALLEL_FINAL_NORM)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    # Teardown in order, both ranks together (as finetune.py's): first every model and DTensor, which hold the
    # process group through their device mesh (a patched model is a reference cycle, freed by the collector
    # only), then the group. A group left to die during interpreter exit takes gloo's worker threads down with
    # it: a rank aborted there once in CI ("terminate called without an active exception").
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
