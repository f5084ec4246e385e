"""What a ``verify`` run is asked to do: its settings, their per-device defaults and the verdict's thresholds.

Kept apart from the modules that do the work, and free of torch and transformers, so ``scripts/verify.py
--help`` (which shows all of it) starts in a fraction of a second. ``parity.py`` explains the thresholds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import cli
from .presets import DEFAULT_MODEL, PRESETS, REAL_PRESETS

# Per-device defaults: a CPU run goes through Triton's interpreter, which costs about 50 ms per kernel launch,
# and must stay within a few minutes on the real-weights preset (4 chat prompts; 61 norms, and each step of
# generation launches every one of them); a GPU run uses the decode-bound workload the kernels are meant for
# (one prompt of 128 tokens, 256 new tokens).
DEFAULTS = {
    "cpu": {"batch_size": 4, "prompt_len": 32, "max_new_tokens": 20, "repeats": 5},
    "cuda": {"batch_size": 1, "prompt_len": 128, "max_new_tokens": 256, "repeats": 5},
}
_CPU, _GPU = DEFAULTS["cpu"], DEFAULTS["cuda"]


@dataclass(frozen=True)
class Option:
    """How ``scripts/verify.py`` reads one ``VerifyConfig`` field: ``--<field name with dashes>``, parsed by
    ``type`` (a flag when ``store_true``), ``default`` when left out (None for a per-device setting of
    ``DEFAULTS``: ``scripts/verify.py`` fills it in once the device is known)."""

    help: str
    default: object = None
    type: Callable[[str], object] | None = None
    metavar: str | None = None
    store_true: bool = False


def _option(help: str, **settings) -> dict:
    # A dataclass field's metadata: the one place an option of verify.py is declared.
    return {"option": Option(help, **settings)}


@dataclass(frozen=True)
class VerifyConfig:
    """What a ``scripts/verify.py`` run does: one field per command-line option (``Option``)."""

    model: str = field(metadata=_option(
        f"a real-weights preset ({', '.join(REAL_PRESETS)}; default {DEFAULT_MODEL}: from the Hub, else offline "
        f"from its pip package), a random-weight preset ({', '.join(PRESETS)}), a directory written by "
        "save_pretrained, or a Hub id", default=DEFAULT_MODEL, metavar="NAME_OR_PATH"))
    dtype: str = field(metadata=_option("model dtype (default bf16)", default="bf16", metavar="{bf16,fp16,fp32}"))
    batch_size: int = field(metadata=_option(
        f"rows per batch (default {_GPU['batch_size']} on GPU, {_CPU['batch_size']} on CPU); the speed run uses "
        "unpadded rows, the parity batch at least 2 left-padded rows", type=cli.at_least(1)))
    prompt_len: int = field(metadata=_option(
        "prompt tokens per row of the speed run, and of the parity run for models without a tokenizer (default "
        f"{_GPU['prompt_len']} on GPU, {_CPU['prompt_len']} on CPU)", type=cli.at_least(2)))
    max_new_tokens: int = field(metadata=_option(
        f"greedy tokens generated per row (default {_GPU['max_new_tokens']} on GPU, {_CPU['max_new_tokens']} on "
        "CPU; parity rows stop early at end-of-sequence)",
        type=cli.at_least(2, "decode is timed over the tokens after the first, so it needs two")))
    repeats: int = field(metadata=_option(
        f"timed runs per speed figure, median reported (default {_GPU['repeats']}; GPU only)", type=cli.at_least(1)))
    json: Path | None = field(default=None, metadata=_option(
        "also write the report as JSON", type=Path, metavar="PATH"))
    seed: int = field(default=0, metadata=_option("seed of a preset's random weights (default 0)", default=0,
                                                  type=int))
    compile: bool = field(default=False, metadata=_option(
        "generate with transformers' compiled generation, unpatched and patched alike: a static cache and "
        "torch.compile of each decoding step (CUDA graphs, mode reduce-overhead, on a GPU; inductor's default "
        "mode on CPU, slow to compile); the logits parity stays eager", default=False, store_true=True))


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
