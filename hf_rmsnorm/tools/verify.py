"""``scripts/verify.py``'s job: patch a model and check it computes what the unpatched model computes, and how
fast, on a GPU.

The unpatched model runs first, then the same weights upcast in place (the reference), then the patched model:
no second copy of the model is ever held. ``run`` returns the report as a JSON-ready dict and ``render`` prints
it; the verdict rule is ``parity.VERDICT_RULE``.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import transformers
import triton

import hf_rmsnorm

from ..ops import backend
from ..patch import UnsupportedModelError, patch_model
from . import parity, workload
from .cli import InputError
from .loading import DTYPES, load_model, parse_dtype
from .speed import measure_generate, speedups

# Per-device defaults: a CPU run goes through Triton's interpreter and must stay quick; a GPU run uses the
# decode-bound workload the kernels are meant for (one prompt of 128 tokens, 256 new tokens).
DEFAULTS = {
    "cpu": {"batch_size": 2, "prompt_len": 32, "max_new_tokens": 16, "repeats": 5},
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


@contextlib.contextmanager
def step(label: str) -> Iterator[None]:
    """Prints ``label ...`` on stderr, then how long the step took: the progress indication."""
    print(f"verify: {label} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        # End the progress line so an error message starts a line of its own.
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _table(rows: list[tuple[str, ...]], *, numeric: bool = True) -> str:
    """Rows of cells as aligned plain-text columns, indented; cells after the first are right-aligned when
    ``numeric``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) if numeric else cell.ljust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  " + "   ".join(cells).rstrip())
    return "\n".join(lines)


def _g(value: float) -> str:
    return f"{value:.3g}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def render(report: dict) -> str:
    """The human-readable report printed on stdout."""
    env, patch, par, speed, settings = (report[k] for k in ("environment", "patch", "parity", "speed", "settings"))
    lines = [
        f"hf_rmsnorm {env['hf_rmsnorm']} verify: {report['model']} ({report['model_class']}, "
        f"{_count(report['parameters'])} parameters), {report['dtype']} on {env['device_name']}",
        f"torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}, "
        f"Python {env['python']}",
    ]
    if env["triton_interpreter"]:
        lines.append(
            "Kernels ran in Triton's CPU interpreter (TRITON_INTERPRET=1): a correctness check, not a speed one."
        )
    families = f" ({', '.join(patch['families'])})" if patch.get("families") else ""
    lines += ["", f"Patch: {patch['norms']} norms replaced{families}, {patch['fused_adds']} residual adds fused, "
              f"{patch['skipped']} skipped"]
    lines += [f"  skipped {name}: {reason}" for name, reason in patch["skipped_modules"]]

    positions = par["positions"]
    lines += [
        "",
        f"Parity: {settings['parity_batch_size']} rows left-padded to {settings['prompt_len']} tokens "
        f"({positions} real positions); reference = unpatched model in {par['reference_dtype']}",
        _table([
            ("", "unpatched", "patched"),
            ("max |logit error| vs reference", _g(par["eager_max_err"]), _g(par["patched_max_err"])),
            ("mean |logit error| vs reference", _g(par["eager_mean_err"]), _g(par["patched_mean_err"])),
            (f"top-1 misses at {par['decisive_positions']} decisive positions",
             str(par["eager_top1_misses"]), str(par["patched_top1_misses"])),
        ]),
        "Patched vs unpatched",
        _table([
            ("max / mean |d logits|", f"{_g(par['max_abs_diff'])} / {_g(par['mean_abs_diff'])}"),
            ("top-1 agreement", f"{100 * par['top1_agreement']:.1f}% of {positions} positions"),
            ("KL divergence mean / max", f"{_g(par['kl_mean'])} / {_g(par['kl_max'])}"),
            (f"greedy generation, {par['new_tokens']} tokens",
             "identical" if par["greedy_match"] else f"differs from token {par['greedy_first_divergence']}"),
        ], numeric=False),
        "",
    ]
    if speed is None:
        lines.append("Speed: not measured; it needs a GPU (the interpreter's timings would mean nothing).")
    else:
        unpatched, patched = speed["unpatched"], speed["patched"]
        gib = 1024 ** 3
        lines += [
            f"Speed: generate() on {env['device_name']}, batch {settings['batch_size']}, prompt "
            f"{settings['prompt_len']}, {settings['max_new_tokens']} new tokens, median of {settings['repeats']}",
            _table([
                ("", "unpatched", "patched", "speedup"),
                ("prefill tokens/s", f"{unpatched['prefill_tokens_per_s']:.0f}",
                 f"{patched['prefill_tokens_per_s']:.0f}", f"{speed['prefill_speedup']:.3f}x"),
                ("decode tokens/s", f"{unpatched['decode_tokens_per_s']:.1f}",
                 f"{patched['decode_tokens_per_s']:.1f}", f"{speed['decode_speedup']:.3f}x"),
                ("peak memory GiB", f"{unpatched['peak_memory_bytes'] / gib:.3f}",
                 f"{patched['peak_memory_bytes'] / gib:.3f}", ""),
            ]),
        ]
    eager_err, patched_err = par["eager_mean_err"], par["patched_mean_err"]
    ratio = patched_err / eager_err if eager_err else (1.0 if patched_err == 0 else float("inf"))
    lines += [
        "",
        f"Verdict: {'PASS' if report['passed'] else 'FAIL'}: error vs reference {ratio:.3f}x the unpatched "
        f"model's ({'ok' if par['accuracy_ok'] else 'too high'}), {par['patched_top1_misses']} top-1 misses "
        f"where the reference is decisive ({'ok' if par['top1_ok'] else 'must be 0'})",
    ]
    if report["failure"]:
        lines.append(f"  {report['failure']}")
    return "\n".join(lines)


def run(config: VerifyConfig, device: torch.device) -> dict:
    """Loads, runs, patches and compares; returns the report (the JSON document).

    Raises:
        InputError: the model cannot be loaded or patched; the message says what to pass instead.
    """
    on_gpu = device.type == "cuda"
    dtype = parse_dtype(config.dtype)
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)

    with step(f"loading {config.model} ({dtype_name}) on {device.type}"):
        model, tokenizer = load_model(config.model, dtype=dtype, device=device, seed=config.seed)
    new_tokens = config.max_new_tokens
    pad_id = workload.pad_token_id(model, tokenizer)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    parity_rows = max(2, config.batch_size)
    prompts = workload.make_prompts(
        tokenizer, vocab_size, parity_rows, config.prompt_len, pad_id, left_pad=True, device=device
    )
    speed_prompts = workload.make_prompts(
        tokenizer, vocab_size, config.batch_size, config.prompt_len, pad_id, left_pad=False, device=device
    ) if on_gpu else None

    def outputs(label: str):
        with step(f"{label} model: logits and {new_tokens} greedy tokens"):
            return workload.prompt_logits(model, prompts), workload.greedy_tokens(model, prompts, new_tokens, pad_id)

    def timing(label: str):
        if not on_gpu:
            return None
        with step(f"{label} model: timing generate(), {config.repeats} repeats"):
            return measure_generate(model, speed_prompts, new_tokens, config.repeats, pad_id)

    # Unpatched first, then the reference, then patch in place: no second copy of the model is ever held.
    eager_logits, eager_tokens = outputs("unpatched")
    eager_speed = timing("unpatched")
    reference_dtype = parity.reference_dtype(dtype)
    with step(f"reference: unpatched model upcast to {str(reference_dtype).removeprefix('torch.')}"):
        with parity.upcast(model, reference_dtype):
            reference_logits = workload.prompt_logits(model, prompts)
    with step("patching"):
        try:
            patch = patch_model(model)
        except UnsupportedModelError as exc:
            raise InputError(str(exc)) from exc
    patched_logits, patched_tokens = outputs("patched" if on_gpu else "patched (Triton interpreter)")
    patched_speed = timing("patched")

    result = parity.compare(eager_logits, patched_logits, reference_logits, dtype, eager_tokens, patched_tokens)
    # A patch that replaced nothing compares the model with itself: parity would pass and prove nothing.
    failure = None if patch.norms else "nothing was patched, so parity proves nothing"
    speed = None
    if on_gpu:
        speed = {"unpatched": eager_speed.to_dict(), "patched": patched_speed.to_dict(),
                 **speedups(eager_speed, patched_speed)}
    return {
        "passed": result.passed and failure is None,
        "failure": failure,
        "model": config.model,
        "model_class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype_name,
        "settings": {
            "batch_size": config.batch_size, "parity_batch_size": parity_rows, "prompt_len": config.prompt_len,
            "max_new_tokens": new_tokens, "repeats": config.repeats if on_gpu else None, "seed": config.seed,
        },
        "environment": {
            "hf_rmsnorm": hf_rmsnorm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "triton_interpreter": not on_gpu,
            "kernels": backend.describe(device),
        },
        "patch": {
            "norms": len(patch.norms), "fused_adds": len(patch.fused_adds), "skipped": len(patch.skipped),
            "skipped_modules": [list(item) for item in patch.skipped], "families": list(patch.families),
        },
        "parity": result.to_dict(),
        "rule": parity.VERDICT_RULE,
        "speed": speed,
    }


def verify(config: VerifyConfig, device: torch.device) -> dict:
    """``run``, then the report printed on stdout (and written as JSON to ``config.json``); returns it."""
    report = run(config, device)
    print(render(report))
    if config.json is not None:
        config.json.expanduser().write_text(json.dumps(report, indent=2) + "\n")
    return report
