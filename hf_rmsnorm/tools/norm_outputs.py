"""How often, and by how much, patched norms round differently from the model's own norm modules.

Logit differences between a patched and an unpatched model are the end of a chain: a kernel's fp32 rstd can
differ from PyTorch's by an ulp (the squares are summed in a different order), which flips the rounding of a
few half-precision norm outputs, and later layers spread those flips. This module measures the start of the
chain on real activations: it records every norm's input and output while the unpatched model runs, then runs
each patched norm alone on the recorded input and compares outputs element by element, in ulps of the output
dtype.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from .verify_report import NormOutputAgreement

# Integer views of the same width, used to count representable values between two floats.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """The number of representable values of ``a.dtype`` between ``a`` and ``b``, elementwise (0 where equal).

    Floats of one sign are ordered like their bit patterns read as integers; mapping negative ones to minus
    their magnitude makes that order hold across zero (+0 and -0 both map to 0).
    """
    if a.dtype != b.dtype or a.dtype not in _BITS:
        raise ValueError(f"ulp_distance needs two tensors of one float dtype, got {a.dtype} and {b.dtype}")
    int_dtype = _BITS[a.dtype]
    magnitude_mask = torch.iinfo(int_dtype).max

    def ordered(x: Tensor) -> Tensor:
        bits = x.view(int_dtype)
        magnitude = (bits & magnitude_mask).long()
        return torch.where(bits < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


@contextlib.contextmanager
def recorded_norm_calls(model: nn.Module, names: list[str]) -> Iterator[list[tuple[str, Tensor, Tensor]]]:
    """Records ``(name, input, output)`` of every call of the named submodules while the block runs."""
    calls: list[tuple[str, Tensor, Tensor]] = []
    handles = []
    for name in names:
        def record(module, args, output, name=name):
            if args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
                calls.append((name, args[0].detach(), output.detach()))

        handles.append(model.get_submodule(name).register_forward_hook(record))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def compare_norm_outputs(model: nn.Module, calls: list[tuple[str, Tensor, Tensor]]) -> NormOutputAgreement:
    """Runs each named (now patched) norm of ``model`` on a recorded input; compares with the recorded output."""
    elements = differing = max_ulp = 0
    for name, norm_input, unpatched_output in calls:
        # The patched norms return the unpatched module's dtype (the logit check would catch one that did
        # not); the cast only keeps this measurement defined if a defect slipped through.
        patched_output = model.get_submodule(name)(norm_input).to(unpatched_output.dtype)
        distance = ulp_distance(patched_output, unpatched_output)
        elements += distance.numel()
        differing += int((distance != 0).sum())
        max_ulp = max(max_ulp, int(distance.max()) if distance.numel() else 0)
    return NormOutputAgreement(norm_calls=len(calls), elements=elements, differing=differing, max_ulp=max_ulp)
