#!/usr/bin/env python
"""Checks that hf_rmsnorm's patched model computes what the unpatched model computes, and how fast.

    python scripts/verify.py                       # default preset, works offline on any machine
    python scripts/verify.py --model Qwen/Qwen3-0.6B --dtype bf16 --json report.json

Exit status: 0 parity passed, 1 parity failed, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterator, NoReturn

# Per-device defaults: a CPU run goes through Triton's interpreter and must stay quick; a GPU run uses the
# decode-bound workload the kernels are meant for (one prompt of 128 tokens, 256 new tokens).
DEFAULTS = {
    "cpu": {"batch_size": 2, "prompt_len": 32, "max_new_tokens": 16, "repeats": 5},
    "cuda": {"batch_size": 1, "prompt_len": 128, "max_new_tokens": 256, "repeats": 5},
}
EXIT_PASSED, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEVICES = ("auto", "cuda", "cpu")


class BadInput(Exception):
    """Something the user passed cannot be used; reported as one line on stderr with exit status 2."""


def _bad_input(message: str) -> NoReturn:
    one_line = " ".join(message.split())
    print(f"verify.py: error: {one_line}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line on stderr (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        _bad_input(message)


def select_device(argv: list[str]):
    """The device the run uses, from ``--device`` alone; bad input if CUDA is asked for and absent.

    Runs before hf_rmsnorm is imported: on CPU the kernels must be defined for Triton's interpreter, which
    happens only if ``TRITON_INTERPRET=1`` is in the environment when they are defined (REFERENCE.md s5).
    """
    import torch

    pre = _Parser(add_help=False)
    pre.add_argument("--device", default="auto", choices=DEVICES)
    requested = pre.parse_known_args(argv)[0].device
    if requested == "cuda" and not torch.cuda.is_available():
        _bad_input("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    device = torch.device("cuda" if requested != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        # Interpreted kernels on a GPU would time numpy, not the kernels.
        os.environ.pop("TRITON_INTERPRET", None)
    return device


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def parse_args(argv: list[str], device_type: str) -> argparse.Namespace:
    """The full command line, with the defaults of ``device_type`` filled in."""
    from hf_rmsnorm.parity import VERDICT_RULE
    from hf_rmsnorm.presets import DEFAULT_PRESET, PRESETS

    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]
    parser = _Parser(
        prog="verify.py",
        description="Runs a model unpatched and patched by hf_rmsnorm on the same left-padded batch and reports "
        "logit parity (against each other and against an fp32 copy of the unpatched model, fp64 for --dtype "
        "fp32), greedy-generation agreement, the patch summary and, on a GPU, generate() prefill/decode speed "
        "and peak memory. On CPU the kernels run in Triton's interpreter (correctness only; no speed figures). "
        "The reference is the model upcast in place, so the run needs memory for the model in fp32 (fp64).",
        epilog=f"Verdict: {VERDICT_RULE} Exit status: 0 passed, 1 failed, 2 bad input.",
    )
    parser.add_argument("--model", default=DEFAULT_PRESET, metavar="NAME_OR_PATH",
                        help=f"a preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET}, random weights, no "
                        "network), a directory written by save_pretrained, or a Hub id")
    parser.add_argument("--dtype", default="bf16", metavar="{bf16,fp16,fp32}", help="model dtype (default bf16)")
    parser.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda if available, else cpu")
    parser.add_argument("--batch-size", type=_at_least(1), default=None,
                        help=f"rows per batch (default {gpu['batch_size']} on GPU, {cpu['batch_size']} on CPU); "
                        "the speed run uses unpadded rows, the parity batch at least 2 left-padded rows")
    parser.add_argument("--prompt-len", type=_at_least(2), default=None,
                        help=f"prompt tokens per row (default {gpu['prompt_len']} on GPU, {cpu['prompt_len']} "
                        "on CPU); parity rows shrink down the batch to about half this, left-padded")
    parser.add_argument("--max-new-tokens", type=_at_least(2), default=None,
                        help=f"greedy tokens generated per row (default {gpu['max_new_tokens']} on GPU, "
                        f"{cpu['max_new_tokens']} on CPU)")
    parser.add_argument("--repeats", type=_at_least(1), default=None,
                        help=f"timed runs per speed figure, median reported (default {gpu['repeats']}; GPU only)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[device_type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.json is not None and not args.json.expanduser().absolute().parent.is_dir():
        _bad_input(f"--json {args.json}: directory {args.json.expanduser().absolute().parent} does not exist")
    return args


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
    lines += ["", f"Patch: {patch['norms']} norms replaced, {patch['fused_adds']} residual adds fused, "
              f"{patch['skipped']} skipped"]
    if patch.get("layernorms_converted"):
        lines.append(f"  {patch['layernorms_converted']} LayerNorms converted exactly to RMSNorm; centred: "
                     f"{', '.join(patch['centred'])}")
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


def _layer_norm_hint(model) -> str:
    """What to do with an unsupported model that normalises with ``nn.LayerNorm``."""
    from torch import nn

    if not any(isinstance(m, nn.LayerNorm) for m in model.modules()):
        return ""
    return (
        ". It uses nn.LayerNorm: hf_rmsnorm patches LayerNorm models only where every LayerNorm converts exactly "
        "to RMSNorm (pre-LN decoders); post-LN models such as BERT or OPT-350m cannot be "
        "converted, so run this one unpatched"
    )


def run(args: argparse.Namespace, device) -> dict:
    """Loads, runs, patches and compares; returns the report (the JSON document)."""
    import torch
    import transformers
    import triton

    import hf_rmsnorm
    from hf_rmsnorm import UnsupportedModelError, parity, patch_model
    from hf_rmsnorm.interpreter import round_bf16_to_nearest_even
    from hf_rmsnorm.loading import DTYPES, ModelLoadError, load_model, parse_dtype
    from hf_rmsnorm.speed import measure_generate, speedups

    on_gpu = device.type == "cuda"
    if not on_gpu:
        round_bf16_to_nearest_even()
    try:
        dtype = parse_dtype(args.dtype)
    except ModelLoadError as exc:
        raise BadInput(str(exc)) from exc
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)

    with step(f"loading {args.model} ({dtype_name}) on {device.type}"):
        try:
            model, tokenizer = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
        except ModelLoadError as exc:
            raise BadInput(str(exc)) from exc
    new_tokens = args.max_new_tokens
    pad_id = parity.pad_token_id(model, tokenizer)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    parity_rows = max(2, args.batch_size)
    prompts = parity.make_prompts(
        tokenizer, vocab_size, parity_rows, args.prompt_len, pad_id, left_pad=True, device=device
    )
    speed_prompts = parity.make_prompts(
        tokenizer, vocab_size, args.batch_size, args.prompt_len, pad_id, left_pad=False, device=device
    ) if on_gpu else None

    def outputs(label: str):
        with step(f"{label} model: logits and {new_tokens} greedy tokens"):
            return parity.prompt_logits(model, prompts), parity.greedy_tokens(model, prompts, new_tokens, pad_id)

    def timing(label: str):
        if not on_gpu:
            return None
        with step(f"{label} model: timing generate(), {args.repeats} repeats"):
            return measure_generate(model, speed_prompts, new_tokens, args.repeats, pad_id)

    # Unpatched first, then the reference, then patch in place: no second copy of the model is ever held.
    eager_logits, eager_tokens = outputs("unpatched")
    eager_speed = timing("unpatched")
    reference_dtype = parity.reference_dtype(dtype)
    with step(f"reference: unpatched model upcast to {str(reference_dtype).removeprefix('torch.')}"):
        with parity.upcast(model, reference_dtype):
            reference_logits = parity.prompt_logits(model, prompts)
    with step("patching"):
        try:
            patch = patch_model(model)
        except UnsupportedModelError as exc:
            raise BadInput(f"{exc}{_layer_norm_hint(model)}") from exc
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
        "model": args.model,
        "model_class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype_name,
        "settings": {
            "batch_size": args.batch_size, "parity_batch_size": parity_rows, "prompt_len": args.prompt_len,
            "max_new_tokens": new_tokens, "repeats": args.repeats if on_gpu else None, "seed": args.seed,
        },
        "environment": {
            "hf_rmsnorm": hf_rmsnorm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "triton_interpreter": not on_gpu,
        },
        "patch": {
            "norms": len(patch.norms), "fused_adds": len(patch.fused_adds), "skipped": len(patch.skipped),
            "skipped_modules": [list(item) for item in patch.skipped],
            "layernorms_converted": len(patch.converted), "centred": list(patch.centred),
        },
        "parity": result.to_dict(),
        "rule": parity.VERDICT_RULE,
        "speed": speed,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the check; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    device = select_device(argv)
    # Quiet transformers' own progress bars and advice: our step lines are the progress indication.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Lets the script run from a checkout that was not pip-installed.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    args = parse_args(argv, device.type)
    try:
        report = run(args, device)
    except BadInput as exc:
        _bad_input(str(exc))
    print(render(report))
    if args.json is not None:
        args.json.expanduser().write_text(json.dumps(report, indent=2) + "\n")
    return EXIT_PASSED if report["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
