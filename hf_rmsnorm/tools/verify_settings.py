"""What a ``verify`` run is asked to do: its settings, their per-device defaults and the verdict's thresholds.

Kept apart from the modules that do the work, and free of torch and transformers, so ``scripts/verify.py
--help`` (which shows all of it) starts in a fraction of a second. ``parity.py`` explains the thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import cli
from .presets import DEFAULT_MODEL, ENCODER_PRESETS, PRESETS, REAL_PRESETS

# Per-device defaults: a CPU run goes through Triton's interpreter, which costs about 50 ms per kernel launch,
# and must stay within a few minutes on the real-weights preset (4 chat prompts; 61 norms, and each step of
# generation launches every one of them); a GPU run uses the decode-bound workload the kernels are meant for
# (one prompt of 128 tokens, 256 new tokens).
DEFAULTS = {
    "cpu": {"batch_size": 4, "prompt_len": 32, "max_new_tokens": 20, "repeats": 5},
    "cuda": {"batch_size": 1, "prompt_len": 128, "max_new_tokens": 256, "repeats": 5},
}
_CPU, _GPU = DEFAULTS["cpu"], DEFAULTS["cuda"]


# Keyword-only, so a field with a default may come before one without: the fields' order is the options' order
# in --help.
@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """What a ``scripts/verify.py`` run does: one field per command-line option (``cli.option``); a field
    without a default is a per-device setting of ``DEFAULTS``."""

    model: str = cli.option(
        f"a real-weights preset ({', '.join(REAL_PRESETS)}; default {DEFAULT_MODEL}: from the Hub, else offline "
        f"from its pip package), a random-weight preset ({', '.join(PRESETS)}; encoders: "
        f"{', '.join(ENCODER_PRESETS)}), a directory written by save_pretrained (an encoder's, when its config "
        "names no causal-LM architecture), or a Hub id", default=DEFAULT_MODEL, metavar="NAME_OR_PATH")
    dtype: str = cli.option("model dtype (default bf16)", default="bf16", metavar="{bf16,fp16,fp32}")
    batch_size: int = cli.option(
        f"rows per batch (default {_GPU['batch_size']} on GPU, {_CPU['batch_size']} on CPU); the speed run uses "
        "unpadded rows, the parity batch at least 2 left-padded rows", type=cli.at_least(1))
    prompt_len: int = cli.option(
        "prompt tokens per row of the speed run, and of the parity run for models without a tokenizer (default "
        f"{_GPU['prompt_len']} on GPU, {_CPU['prompt_len']} on CPU)", type=cli.at_least(2))
    max_new_tokens: int = cli.option(
        f"greedy tokens generated per row (default {_GPU['max_new_tokens']} on GPU, {_CPU['max_new_tokens']} on "
        "CPU; parity rows stop early at end-of-sequence)",
        type=cli.at_least(2, "decode is timed over the tokens after the first, so it needs two"))
    repeats: int = cli.option(
        f"timed runs per speed figure, median reported (default {_GPU['repeats']}; GPU only)", type=cli.at_least(1))
    json: Path | None = cli.option("also write the report as JSON", default=None, type=Path, metavar="PATH")
    seed: int = cli.option("seed of a preset's random weights (default 0)", default=0, type=int)
    compile: bool = cli.option(
        "generate with transformers' compiled generation, unpatched and patched alike: a static cache and "
        "torch.compile of each decoding step (CUDA graphs, mode reduce-overhead, on a GPU; inductor's default "
        "mode on CPU, slow to compile); the logits parity stays eager", default=False, flag=True)


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
