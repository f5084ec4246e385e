"""FSDP2 for ``scripts/finetune.py --fsdp``: what is sharded, by whom, and what the sharded model reports and saves.

Every decoder layer is one FSDP2 unit (its parameters all-gathered before its forward and backward, resharded
after, its gradients reduce-scattered after its backward) and the root unit holds the rest (embeddings, final
norm, head), so each process keeps 1/N of the decoder parameters, gradients and optimizer state between uses.

Who applies it depends on the device. On GPUs accelerate does (:func:`accelerate_plugin`, FSDP2 with a
transformer-layer wrap policy; accelerate also gives the embeddings and the final norm with the head units of
their own). accelerate shards only on accelerators (on CPU it would run DDP), so on CPU :func:`shard` calls
torch's ``fully_shard`` itself, per decoder layer and then on the root, over the gloo process group.

Both find the decoder layers by class name (the model's ``_no_split_modules``). ``patch_model`` swaps a layer's
class for a subclass of the same name, and ``fully_shard`` for an ``FSDP<name>`` subclass of that: accelerate
takes the class of the first module with the name and wraps its instances; :func:`decoder_layers` looks for the
name anywhere in a module's MRO, which also holds for layers of the same base class left unpatched.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .finetune_data import FinetuneInputError
from .finetune_metrics import ShardSizes

# accelerate's FSDP2 policy under --mixed_precision bf16 (parameters, gradient reductions and outputs in bf16),
# mirrored on CPU; fp32 master weights stay sharded either way.
_PARAM_DTYPES = {"no": None, "bf16": torch.bfloat16}


def accelerate_plugin() -> FullyShardedDataParallelPlugin:
    """accelerate's FSDP2 set-up on GPUs: each decoder layer (``_no_split_modules``) a unit, resharded after its
    forward; the model is loaded whole on every process and sharded by ``accelerator.prepare``."""
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
        cpu_ram_efficient_loading=False,
    )


def use_one_process_group() -> None:
    """Makes a launch without a process group (``python``, or ``accelerate launch --num_processes 1``) a group
    of one, as ``torchrun --nproc_per_node 1`` would: accelerate sets up FSDP only inside a process group."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose class (or a base class) is named in the model's ``_no_split_modules``, outermost first.

    A PEFT model answers ``_no_split_modules`` from the model it wraps.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not layers:
        raise FinetuneInputError(
            f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules) that it contains, "
            "so it cannot be sharded layer by layer"
        )
    return layers


def shard(model: nn.Module, mixed_precision: str) -> nn.Module:
    """``fully_shard`` of each decoder layer, then of the root, over every process (what accelerate does on
    GPUs, for the CPU); returns ``model``, whose parameters are now DTensors sharded along dim 0."""
    if mixed_precision not in _PARAM_DTYPES:
        raise FinetuneInputError(f"--fsdp on CPU supports --mixed_precision no or bf16, not {mixed_precision}")
    dtype = _PARAM_DTYPES[mixed_precision]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Innermost first: fully_shard leaves the parameters of units already made to them.
    for layer in reversed(decoder_layers(model)):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def check_sharded(model: nn.Module) -> None:
    """Raises unless every decoder layer is an FSDP unit of its own.

    accelerate's wrap policy wraps the instances of the class of the first module with a layer's name: a layer
    of another class by that name (one ``patch_model`` left unpatched beside patched ones) would silently stay in
    the root unit, unsharded until the root is.
    """
    missed = [type(layer).__name__ for layer in decoder_layers(model) if not isinstance(layer, FSDPModule)]
    if missed:
        raise RuntimeError(f"{len(missed)} decoder layer(s) ({missed[0]}) were not made FSDP units")


def shard_sizes(accelerator: Accelerator, model: nn.Module) -> ShardSizes:
    """How the decoder parameters are spread: their total element count and the count each process holds.

    A collective (every process must call it). Sharded parameters are DTensors whose ``numel`` is the global
    size and whose local tensor is this process's shard.
    """
    layers = decoder_layers(model)
    params = [p for layer in layers for p in layer.parameters()]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    per_process = accelerator.gather(torch.tensor([local], device=accelerator.device)).tolist()
    return ShardSizes(
        decoder_layers=len(layers),
        decoder_params=sum(p.numel() for p in params),
        decoder_params_per_process=per_process,
    )


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU of the main process (empty on the others), under the model's own
    parameter names; a collective. Works whoever sharded the model (accelerate or :func:`shard`)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
