"""What a ``verify`` run is asked to do: its settings, their per-device defaults and the verdict's thresholds.

Kept apart from the modules that do the work, and free of torch and transformers, so ``scripts/verify.py
--help`` (which shows all of it) starts in a fraction of a second. ``parity.py`` explains the thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Per-device defaults: a CPU run goes through Triton's interpreter, which costs about 50 ms per kernel launch,
# and must stay within a few minutes on the real-weights preset (4 chat prompts; 61 norms, and each step of
# generation launches every one of them); a GPU run uses the decode-bound workload the kernels are meant for
# (one prompt of 128 tokens, 256 new tokens).
DEFAULTS = {
    "cpu": {"batch_size": 4, "prompt_len": 32, "max_new_tokens": 20, "repeats": 5},
    "cuda": {"batch_size": 1, "prompt_len": 128, "max_new_tokens": 256, "repeats": 5},
}


@dataclass(frozen=True)
class VerifyConfig:
    """The command line of ``scripts/verify.py``; see its ``--help``."""

    model: str
    dtype: str
    batch_size: int
    prompt_len: int
    max_new_tokens: int
    repeats: int
    seed: int = 0
    json: Path | None = None
    compile: bool = False


# The verdict's thresholds (why these values: ``parity.py``).
ACCURACY_SLACK = 1.10
NOISE_EPS_FACTOR = 4

VERDICT_RULE = (
    "PASS when (1) the patched model's mean |logit error| against the reference (the unpatched model upcast "
    f"to fp32, or fp64 for an fp32 run) is at most {ACCURACY_SLACK:.2f}x the unpatched model's, (2) its "
    "top-1 token equals the reference's wherever the reference's top-1 minus top-2 logit exceeds the dtype's "
    f"noise: max({NOISE_EPS_FACTOR} * eps(dtype) * max|logit| at that position, 2 * the unpatched model's "
    "largest |logit error| there), and (3) each row's greedy tokens equal the unpatched model's or first differ "
    "at a near-tie (the unpatched model's logit gap between the two tokens within that noise, with the "
    "unpatched model's largest prompt error standing in for its error at the step)."
)
