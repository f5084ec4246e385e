"""Parity of a patched model with its unpatched ("eager") self: the reference, the metrics and the verdict.

The check runs one left-padded batch through the eager model, through the same weights in a higher precision
(the reference: fp32, or fp64 when the model runs in fp32) and through the patched model, then asks whether
the patched model is as good an approximation of the reference as the eager model is.

Verdict (``verify_settings.VERDICT_RULE`` states it for users and holds the thresholds): the patched model
passes when

1. accuracy: its mean |logit error| against the reference is at most ``ACCURACY_SLACK`` (1.10) times the
   eager model's. Both models share every rounding outside the norms, so their errors are nearly the same
   number; a 10% allowance covers a kernel that rounds differently (not worse) while a real defect (a wrong
   eps, a dropped weight, a missed cast) moves the error by far more than that; and
2. decisions: at every position where the reference's top-1 logit beats its top-2 by more than the dtype's
   noise, the patched model's top-1 token is the reference's. The noise at a position is the larger of
   ``NOISE_EPS_FACTOR`` (4) machine epsilons of the dtype times the position's largest |logit| (a floor of
   2 to 4 units in the last place of that logit, about what the final norm and the LM head's rounding alone
   put there) and twice the eager model's largest |logit error| at that position (what this dtype
   demonstrably did there: an error of that size cannot swap two logits further apart than twice it). The
   eager model meets rule 2 by construction of the second term, so a failure means the patched model errs
   where the eager model does not.

3. generation: each row's greedy tokens are the eager model's, or first differ at a near-tie: a step where
   the eager model's logit for its own token beats its logit for the patched model's token by no more than
   the noise at that step, ``NOISE_EPS_FACTOR`` epsilons times the step's largest |logit| or twice the
   largest |logit error| the eager model made on the prompt (generated positions have no reference, so the
   eager model's worst observed error stands in). A near-tie flipped by a legitimate rounding difference
   changes every later token of its row, so only the first divergence is judged, and it is reported with
   its logit gap.

Logits are not expected to be bitwise equal to the eager model's: the kernels sum a row's squares in a
different order than PyTorch does, so their fp32 rstd differs from PyTorch's by an ulp in some rows, which
flips the rounding of a few half-precision norm outputs, and those flips spread through the later layers.
What is claimed is accuracy: no worse than eager against a higher-precision copy, same decisions wherever the
decision is not a near-tie.
"""

from __future__ import annotations

import contextlib
import math
from itertools import chain
from typing import Iterator

import torch
from torch import Tensor
from transformers import PreTrainedModel

from .verify_report import Divergence, ParityReport
from .verify_settings import ACCURACY_SLACK, NOISE_EPS_FACTOR
from .workload import Generation

def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference runs in: fp32 for half-precision models, fp64 for fp32 ones."""
    return torch.float64 if dtype == torch.float32 else torch.float32


@contextlib.contextmanager
def upcast(model: PreTrainedModel, dtype: torch.dtype) -> Iterator[PreTrainedModel]:
    """Temporarily casts every floating parameter and buffer of ``model`` to ``dtype``, in place.

    Used instead of a copy so a large model needs memory for one copy in the reference dtype, not two. The
    restore is exact: every bf16/fp16/fp32 value is representable in the wider dtype, so casting back gives
    the original bits. Tensors are cast one by one to their own dtype, which keeps fp32 buffers of a bf16
    model (rotary ``inv_freq``) in fp32 afterwards.
    """
    originals: list[tuple[Tensor, torch.dtype]] = []
    for tensor in chain(model.parameters(), model.buffers()):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            originals.append((tensor, tensor.dtype))
            tensor.data = tensor.data.to(dtype)
    try:
        yield model
    finally:
        for tensor, original in originals:
            tensor.data = tensor.data.to(original)


def noise(dtype: torch.dtype, reference: Tensor, eager: Tensor) -> Tensor:
    """Per-position logit noise of ``dtype``: the threshold of rule 2 (see module docstring)."""
    a_priori = NOISE_EPS_FACTOR * torch.finfo(dtype).eps * reference.abs().amax(-1)
    observed = 2 * (eager.to(reference.dtype) - reference).abs().amax(-1)
    return torch.maximum(a_priori, observed)


def _kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(p || q) per position, in fp64 so that tiny divergences do not drown in cancellation."""
    log_p = torch.log_softmax(p_logits.double(), -1)
    log_q = torch.log_softmax(q_logits.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def divergences(eager: Generation, patched: Generation, dtype: torch.dtype, unpatched_max_err: float) -> list[Divergence]:
    """Each row's first differing greedy token, with both models' logit gaps and the noise there (rule 3)."""
    found = []
    steps = min(eager.tokens.shape[1], patched.tokens.shape[1])
    for row in range(eager.tokens.shape[0]):
        differs = (eager.tokens[row, :steps] != patched.tokens[row, :steps]).nonzero()
        if not differs.numel():
            continue
        step = int(differs[0])
        mine, theirs = int(eager.tokens[row, step]), int(patched.tokens[row, step])
        eager_logits, patched_logits = eager.logits[step, row].double(), patched.logits[step, row].double()
        a_priori = NOISE_EPS_FACTOR * torch.finfo(dtype).eps * float(eager_logits.abs().max())
        found.append(Divergence(
            row=row,
            step=step,
            unpatched_token=mine,
            patched_token=theirs,
            unpatched_gap=float(eager_logits[mine] - eager_logits[theirs]),
            patched_gap=float(patched_logits[theirs] - patched_logits[mine]),
            noise=max(a_priori, 2 * unpatched_max_err),
        ))
    return found


def compare(
    eager: Tensor,
    patched: Tensor,
    reference: Tensor,
    dtype: torch.dtype,
    eager_generation: Generation,
    patched_generation: Generation,
) -> ParityReport:
    """Computes every parity figure and the verdict.

    Args:
        eager, patched, reference: ``[positions, vocab]`` logits from ``prompt_logits`` of the unpatched model,
            the patched model and the unpatched model in the reference dtype.
        dtype: the dtype the eager and patched models ran in.
        eager_generation, patched_generation: greedy generations from ``workload.greedy_tokens``.
    """
    equal = float((patched == eager).double().mean())
    ref = reference.double()
    eager, patched = eager.double(), patched.double()
    diff = (patched - eager).abs()
    kl = _kl(eager, patched)
    eager_err, patched_err = (eager - ref).abs(), (patched - ref).abs()

    top2 = ref.topk(2, -1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    decisive = margin > noise(dtype, ref, eager)
    ref_top1 = top2.indices[:, 0]
    eager_misses = int(((eager.argmax(-1) != ref_top1) & decisive).sum())
    patched_misses = int(((patched.argmax(-1) != ref_top1) & decisive).sum())

    diverged = divergences(eager_generation, patched_generation, dtype, float(eager_err.max()))
    report = ParityReport(
        dtype=str(dtype).removeprefix("torch."),
        reference_dtype=str(reference.dtype).removeprefix("torch."),
        positions=int(ref.shape[0]),
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        top1_agreement=float((patched.argmax(-1) == eager.argmax(-1)).double().mean()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        unpatched_max_err=float(eager_err.max()),
        unpatched_mean_err=float(eager_err.mean()),
        patched_max_err=float(patched_err.max()),
        patched_mean_err=float(patched_err.mean()),
        decisive_positions=int(decisive.sum()),
        unpatched_top1_misses=eager_misses,
        patched_top1_misses=patched_misses,
        logits_equal_fraction=equal,
        new_tokens=int(eager_generation.tokens.shape[1]),
        greedy_match=not diverged and eager_generation.tokens.shape == patched_generation.tokens.shape,
        greedy_first_divergence=min((d.step for d in diverged), default=None),
        divergences=diverged,
        accuracy_ok=float(patched_err.mean()) <= ACCURACY_SLACK * float(eager_err.mean()),
        top1_ok=patched_misses == 0,
        greedy_ok=all(d.near_tie for d in diverged),
    )
    if not all(math.isfinite(v) for v in (report.max_abs_diff, report.kl_max, report.patched_max_err)):
        # NaN compares false everywhere, so the rules above could not see it; a NaN logit is a failure.
        report.accuracy_ok = False
    return report
