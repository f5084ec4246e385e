"""``scripts/verify.py``'s job: patch a model and check it computes what the unpatched model computes, and how
fast, on a GPU.

The model is refused at once if the patcher cannot patch it. Then the unpatched model runs (recording every
norm's input and output), then the same weights upcast in place (the reference), then the patched model: no
second copy of the model is ever held. On a GPU the three states (unpatched, patched, norm-free) are timed last,
interleaved. ``run`` returns the report (a ``verify_report.VerifyReport``, whose ``to_dict`` is the JSON document)
and ``render`` prints it; the verdict rule is ``verify_settings.VERDICT_RULE``. With ``--json`` the document is
also written before the timing and after every timed round, so a run stopped there leaves what it measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers
import triton

import hf_rmsnorm

from ..ops import backend
from ..patch import UnsupportedModelError, check_model, patch_model, unpatch_model
from ..patch.report import qk_summary
from . import parity, verify_encoder, workload
from .cli import InputError
from .loading import DTYPES, is_encoder, load_encoder, load_model, parse_dtype, weights_source
from .norm_free import ORACLE_NOTE, format_share, fused_ropes, gain_share, norm_free
from .norm_outputs import compare_norm_outputs, recorded_norm_calls
from .speed import ModelState, SpeedFigures, measure_states, speedups
from .verify_report import (
    EncoderSettings,
    EncoderVerifyReport,
    Environment,
    GeneratedText,
    ParityReport,
    PatchSummary,
    SpeedReport,
    VerifyReport,
    WorkloadSettings,
)
from .verify_settings import VERDICT_RULE, VerifyConfig

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


def _count_plain(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)


def _greedy_summary(par: ParityReport) -> str:
    rows = len(par.divergences)
    if par.greedy_match:
        return "identical"
    return f"differs in {rows} rows" if rows else "differs in length"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _compiled(settings: WorkloadSettings) -> str:
    mode = settings.compile
    return f" compiled (static cache, torch.compile mode {mode})" if mode else ""


def render(report: VerifyReport | EncoderVerifyReport) -> str:
    """The human-readable report printed on stdout."""
    if isinstance(report, EncoderVerifyReport):
        return render_encoder(report)
    env, patch, par, speed, settings = report.environment, report.patch, report.parity, report.speed, report.settings
    lines = _header(report)

    positions = par.positions
    prompts = (
        f"{settings.parity_batch_size} chat prompts" if settings.parity_prompts == "chat"
        else f"{settings.parity_batch_size} passage rows"
    )
    norms = report.norm_outputs
    lines += [
        "",
        f"Parity: {prompts} left-padded to {settings.parity_prompt_len} tokens ({positions} real positions); "
        f"reference = unpatched model in {par.reference_dtype}",
        _table([
            ("", "unpatched", "patched"),
            ("max |logit error| vs reference", _g(par.unpatched_max_err), _g(par.patched_max_err)),
            ("mean |logit error| vs reference", _g(par.unpatched_mean_err), _g(par.patched_mean_err)),
            (f"top-1 misses at {par.decisive_positions} decisive positions",
             str(par.unpatched_top1_misses), str(par.patched_top1_misses)),
        ]),
        "Patched vs unpatched",
        _table([
            ("norm outputs, same inputs", f"{norms.differing} of {_count_plain(norms.elements)} elements "
             f"differ ({norms.norm_calls} norm calls), by at most {norms.max_ulp} ulp"),
            ("logits bitwise equal", f"{100 * par.logits_equal_fraction:.1f}%"),
            ("max / mean |d logits|", f"{_g(par.max_abs_diff)} / {_g(par.mean_abs_diff)}"),
            ("top-1 agreement", f"{100 * par.top1_agreement:.1f}% of {positions} positions"),
            ("KL divergence mean / max", f"{_g(par.kl_mean)} / {_g(par.kl_max)}"),
            (f"greedy generation{' (compiled)' if settings.compile else ''}, up to "
             f"{settings.max_new_tokens} tokens", _greedy_summary(par)),
        ], numeric=False),
    ]
    lines += [
        f"  row {d.row} first differs at token {d.step}: unpatched gap {_g(d.unpatched_gap)}, patched gap "
        f"{_g(d.patched_gap)}, noise {_g(d.noise)}: {'a near-tie' if d.near_tie else 'NOT a near-tie'}"
        for d in par.divergences
    ]
    if report.generations:
        lines += ["", "Generated text"]
        for i, item in enumerate(report.generations):
            lines.append(f"  [{i}] {item.prompt}")
            lines.append(f"      unpatched: {item.unpatched!r}")
            same = item.patched == item.unpatched
            lines.append(f"      patched:   {'(identical)' if same else repr(item.patched)}")
    lines.append("")
    if speed is None:
        lines.append("Speed: not measured; it needs a GPU (the interpreter's timings would mean nothing).")
    else:
        unpatched, patched, free = speed.unpatched, speed.patched, speed.norm_free
        gib = 1024 ** 3
        lines += [
            f"Speed: generate(){_compiled(settings)} on {env.device_name}, batch {settings.batch_size}, prompt "
            f"{settings.prompt_len}, {settings.max_new_tokens} new tokens, median of {settings.repeats} "
            "rounds, the three states interleaved",
            _table([
                ("", "unpatched", "patched", "speedup", "norm-free", "share of its gain"),
                ("prefill tokens/s", f"{unpatched.prefill_tokens_per_s:.0f}",
                 f"{patched.prefill_tokens_per_s:.0f}", f"{speed.prefill_speedup:.3f}x",
                 f"{free.prefill_tokens_per_s:.0f}", format_share(speed.prefill_gain_share)),
                ("decode tokens/s", f"{unpatched.decode_tokens_per_s:.1f}",
                 f"{patched.decode_tokens_per_s:.1f}", f"{speed.decode_speedup:.3f}x",
                 f"{free.decode_tokens_per_s:.1f}", format_share(speed.decode_gain_share)),
                ("generate() peak memory GiB (beyond weights)", f"{unpatched.peak_memory_bytes / gib:.3f}",
                 f"{patched.peak_memory_bytes / gib:.3f}", "", f"{free.peak_memory_bytes / gib:.3f}", ""),
            ]),
            f"  {speed.norm_free_note}: the most any norm kernel could save.",
        ]
    eager_err, patched_err = par.unpatched_mean_err, par.patched_mean_err
    ratio = patched_err / eager_err if eager_err else (1.0 if patched_err == 0 else float("inf"))
    flips = len(par.divergences)
    lines += [
        "",
        f"Verdict: {'PASS' if report.passed else 'FAIL'}: error vs reference {ratio:.3f}x the unpatched "
        f"model's ({'ok' if par.accuracy_ok else 'too high'}), {par.patched_top1_misses} top-1 misses "
        f"where the reference is decisive ({'ok' if par.top1_ok else 'must be 0'}), greedy tokens "
        + ("identical" if not flips else f"first differ in {flips} rows, "
           + ("all at near-ties (ok)" if par.greedy_ok else "not all at near-ties (must be)")),
    ]
    if report.failure:
        lines.append(f"  {report.failure}")
    return "\n".join(lines)


def _header(report: VerifyReport | EncoderVerifyReport) -> list[str]:
    """The lines every report starts with: the model, the environment and the patch summary."""
    env, patch = report.environment, report.patch
    lines = [
        f"hf_rmsnorm {env.hf_rmsnorm} verify: {report.model} ({report.model_class}, "
        f"{_count(report.parameters)} parameters), {report.dtype} on {env.device_name}",
        f"weights: {report.weights}",
        f"torch {env.torch}, transformers {env.transformers}, triton {env.triton}, Python {env.python}",
    ]
    if env.triton_interpreter:
        lines.append(
            "Kernels ran in Triton's CPU interpreter (TRITON_INTERPRET=1): a correctness check, not a speed one."
        )
    families = f" ({', '.join(patch.families)})" if patch.families else ""
    lines += ["", f"Patch: {patch.norms} norms replaced{families}, {patch.fused_adds} residual adds fused, "
              f"{patch.skipped} skipped{qk_summary(patch.fused_qk, patch.qk_apart)}"]
    lines += [f"  skipped {name}: {reason}" for name, reason in patch.skipped_modules]
    return lines


def render_encoder(report: EncoderVerifyReport) -> str:
    """The human-readable report of an encoder's run."""
    par, speed, settings, norms = report.parity, report.speed, report.settings, report.norm_outputs
    lines = _header(report) + [
        "",
        f"Parity: {settings.parity_batch_size} passage rows right-padded to {settings.parity_tokens} tokens "
        f"({par.positions} real tokens); reference = unpatched model in {par.reference_dtype}",
        _table([
            ("", "unpatched", "patched"),
            ("max |hidden-state error| vs reference", _g(par.unpatched_hidden_max_err),
             _g(par.patched_hidden_max_err)),
            ("mean |hidden-state error| vs reference", _g(par.unpatched_hidden_mean_err),
             _g(par.patched_hidden_mean_err)),
            ("mean |embedding error| vs reference", _g(par.unpatched_embedding_mean_err),
             _g(par.patched_embedding_mean_err)),
            ("lowest embedding cosine with reference", f"{par.unpatched_min_cosine:.9f}",
             f"{par.patched_min_cosine:.9f}"),
        ]),
        "Patched vs unpatched",
        _table([
            ("norm outputs, same inputs", f"{norms.differing} of {_count_plain(norms.elements)} elements "
             f"differ ({norms.norm_calls} norm calls), by at most {norms.max_ulp} ulp"),
            ("hidden states bitwise equal", f"{100 * par.hidden_equal_fraction:.1f}%"),
            ("max |d hidden state|", _g(par.hidden_max_abs_diff)),
        ], numeric=False),
        "",
    ]
    if speed is None:
        lines.append("Speed: not measured; it needs a GPU (the interpreter's timings would mean nothing).")
    else:
        lines += [
            f"Speed: embedding forward on {report.environment.device_name}, batch {settings.speed_batch_size} x "
            f"{settings.speed_tokens} tokens, median of {settings.repeats} rounds, the three states interleaved",
            _table([
                ("", "unpatched", "patched", "speedup", "norm-free", "share of its gain"),
                ("tokens/s", f"{speed.unpatched_tokens_per_s:.0f}", f"{speed.patched_tokens_per_s:.0f}",
                 f"{speed.speedup:.3f}x", f"{speed.norm_free_tokens_per_s:.0f}", format_share(speed.gain_share)),
            ]),
            f"  {speed.norm_free_note}: the most any norm kernel could save.",
        ]
    ratio = (par.patched_hidden_mean_err / par.unpatched_hidden_mean_err if par.unpatched_hidden_mean_err
             else (1.0 if par.patched_hidden_mean_err == 0 else float("inf")))
    lines += ["", f"Verdict: {'PASS' if report.passed else 'FAIL'}: hidden-state error vs reference {ratio:.3f}x the "
              f"unpatched model's ({'ok' if par.hidden_ok else 'too high'}), embedding error "
              f"({'ok' if par.embeddings_ok else 'too high'})"]
    if report.failure:
        lines.append(f"  {report.failure}")
    return "\n".join(lines)


def _loaded(config: VerifyConfig, device: torch.device, load: Callable[..., tuple]) -> tuple:
    """``(model, tokenizer, plan, dtype, dtype name)`` of ``config.model`` loaded by ``load`` (``load_model`` or
    ``load_encoder``), and planned: an unpatchable model is refused before any work (an ``InputError``)."""
    dtype = parse_dtype(config.dtype)
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    with step(f"loading {config.model} ({dtype_name}) on {device.type}"):
        model, tokenizer = load(config.model, dtype=dtype, device=device, seed=config.seed)
    try:
        planned = check_model(model)
    except UnsupportedModelError as exc:
        raise InputError(f"{config.model}: {exc}") from exc
    return model, tokenizer, planned, dtype, dtype_name


def _unpatched_and_reference(
    model: torch.nn.Module, norms: list[str], dtype: torch.dtype, forward: Callable[[], torch.Tensor], what: str
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``forward()`` of the unpatched model, recording every norm's input and output, then of the same weights upcast
    in place to the reference dtype (``parity.upcast``, restored exactly after): ``(eager, reference, norm calls)``;
    ``what`` names the output in the progress lines."""
    with step(f"unpatched model: {what}, recording every norm's input and output"):
        with recorded_norm_calls(model, norms) as norm_calls:
            eager = forward()
    reference_dtype = parity.reference_dtype(dtype)
    with step(f"reference: unpatched model upcast to {str(reference_dtype).removeprefix('torch.')}"):
        with parity.upcast(model, reference_dtype):
            reference = forward()
    return eager, reference, norm_calls


def _patched(model: torch.nn.Module, norm_calls: list, on_gpu: bool, forward: Callable[[], torch.Tensor],
             what: str) -> tuple[object, torch.Tensor, object]:
    """Patches ``model`` in place and runs ``forward()`` again, then each patched norm on the unpatched run's
    recorded inputs: ``(the patch report, the patched output, the norm outputs' agreement)``."""
    with step("patching"):
        patch = patch_model(model)
    kernels = "" if on_gpu else " (Triton interpreter)"
    with step(f"patched model{kernels}: {what}"):
        patched = forward()
    with step(f"patched norms{kernels}: rerun on the recorded inputs"):
        agreement = compare_norm_outputs(model, norm_calls)
    norm_calls.clear()  # the recorded tensors are no longer needed
    return patch, patched, agreement


def _environment(device: torch.device) -> Environment:
    """The versions and the device of this run."""
    on_gpu = device.type == "cuda"
    return Environment(
        hf_rmsnorm=hf_rmsnorm.__version__, torch=torch.__version__,
        transformers=transformers.__version__, triton=triton.__version__,
        python=platform.python_version(), device=device.type,
        device_name=torch.cuda.get_device_name(device) if on_gpu else "cpu",
        triton_interpreter=not on_gpu,
        kernels=backend.describe(device),
    )


def _patch_summary(patch) -> PatchSummary:
    """The counted form of a ``PatchReport``."""
    return PatchSummary(
        norms=len(patch.norms), fused_adds=len(patch.fused_adds), fused_qk=len(patch.fused_qk),
        qk_apart=len(patch.qk_apart), skipped=len(patch.skipped),
        skipped_modules=list(patch.skipped), families=list(patch.families),
    )


def run_encoder(config: VerifyConfig, device: torch.device,
                on_report: Callable[[EncoderVerifyReport], object] | None = None,
                ) -> EncoderVerifyReport:
    """``run`` for an encoder (``loading.is_encoder``): hidden-state and embedding parity, and on a GPU the
    embedding workload's speed (``verify_encoder``'s docstring). ``on_report`` as for ``run``.

    Raises:
        InputError: the model cannot be loaded or patched.
    """
    on_gpu = device.type == "cuda"
    model, tokenizer, planned, dtype, dtype_name = _loaded(config, device, load_encoder)
    pad_id = workload.pad_token_id(model, tokenizer)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    prompts = verify_encoder.parity_batch(tokenizer, vocab_size, max(2, config.batch_size), config.prompt_len,
                                          pad_id, device)
    def forward() -> torch.Tensor:
        return verify_encoder.hidden_states(model, prompts)

    eager, reference, norm_calls = _unpatched_and_reference(model, planned.norms, dtype, forward, "hidden states")
    patch, patched, norm_agreement = _patched(model, norm_calls, on_gpu, forward, "hidden states")
    result = verify_encoder.compare(eager, patched, reference, prompts.attention_mask, dtype)
    failure = None if patch.norms else "nothing was patched, so parity proves nothing"
    report = EncoderVerifyReport(
        kind="encoder", passed=result.passed and failure is None, failure=failure, model=config.model,
        model_class=type(model).__name__, weights=weights_source(config.model, model, config.seed),
        parameters=sum(p.numel() for p in model.parameters()), dtype=dtype_name,
        settings=EncoderSettings(
            parity_batch_size=int(prompts.input_ids.shape[0]), parity_tokens=int(prompts.input_ids.shape[1]),
            speed_batch_size=verify_encoder.EMBEDDING_BATCH, speed_tokens=verify_encoder.EMBEDDING_TOKENS,
            repeats=config.repeats if on_gpu else None, seed=config.seed),
        environment=_environment(device), patch=_patch_summary(patch), parity=result, norm_outputs=norm_agreement,
        rule=verify_encoder.ENCODER_VERDICT_RULE, speed=None,
    )
    if not on_gpu:
        return report
    if on_report is not None:
        on_report(report)
    speed_prompts = workload.make_prompts(tokenizer, vocab_size, verify_encoder.EMBEDDING_BATCH,
                                          verify_encoder.EMBEDDING_TOKENS, pad_id, left_pad=False, device=device)

    def timed_round(rates: dict[str, float], rounds: int) -> None:
        on_report(verify_encoder.with_speed(report, verify_encoder.speed_report(rates, rounds, partial=True)))

    with step(f"timing the embedding forward: unpatched, patched and norm-free interleaved, {config.repeats} "
              "rounds"):
        rates = verify_encoder.measure_forward_states(model, _timed_states(model, planned.norms), speed_prompts,
                                                      config.repeats, None if on_report is None else timed_round)
    return verify_encoder.with_speed(report, verify_encoder.speed_report(rates, config.repeats))


def _texts(tokenizer, generation: workload.Generation, eos_id) -> list[str]:
    """Each row's generated text, up to its end-of-sequence token."""
    stops = set(eos_id if isinstance(eos_id, list) else [eos_id])
    texts = []
    for row in generation.tokens.tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True).strip())
    return texts


def _timed_states(model: torch.nn.Module, norm_names: list[str]) -> list[ModelState]:
    """The states ``verify`` times, starting from and returning to the patched model: unpatched (unpatched, then
    patched again), patched, and norm-free (``norm_free.py``: the unpatched model with every norm returning its
    input, and the RoPE the patch fuses with q/k norms returning its query and key)."""
    oracle = contextlib.ExitStack()
    ropes = fused_ropes(model)

    def enter_norm_free() -> None:
        unpatch_model(model)
        oracle.enter_context(norm_free(model, norm_names, ropes))

    def leave_norm_free() -> None:
        oracle.close()
        patch_model(model)

    def nothing() -> None:
        return None

    return [
        ModelState("unpatched", lambda: unpatch_model(model), lambda: patch_model(model)),
        ModelState("patched", nothing, nothing),
        ModelState("norm_free", enter_norm_free, leave_norm_free),
    ]


def _speed_report(figures: dict[str, SpeedFigures], rounds: int, partial: bool = False) -> SpeedReport:
    """The ``speed`` part of the report, from each timed state's figures (``_timed_states`` names them), the
    medians of ``rounds`` timed rounds; ``partial`` while more rounds are to come."""
    unpatched, patched, free = figures["unpatched"], figures["patched"], figures["norm_free"]
    patched_speedups = speedups(unpatched, patched)
    return SpeedReport(
        unpatched=unpatched,
        patched=patched,
        norm_free=free,
        prefill_speedup=patched_speedups.prefill_speedup,
        decode_speedup=patched_speedups.decode_speedup,
        norm_free_speedups=speedups(unpatched, free),
        prefill_gain_share=gain_share(unpatched.prefill_tokens_per_s, patched.prefill_tokens_per_s,
                                      free.prefill_tokens_per_s),
        decode_gain_share=gain_share(unpatched.decode_tokens_per_s, patched.decode_tokens_per_s,
                                     free.decode_tokens_per_s),
        norm_free_note=ORACLE_NOTE,
        rounds=rounds,
        partial=partial,
    )


def run(config: VerifyConfig, device: torch.device,
        on_report: Callable[[VerifyReport], object] | None = None,
        ) -> VerifyReport | EncoderVerifyReport:
    """Loads, checks, runs, patches and compares; returns the report. An encoder (``loading.is_encoder``) takes
    ``run_encoder``.

    On a GPU, ``on_report`` (if given) is called with the report as it stands before the timing starts (no
    speed) and after every timed round (the figures so far, ``speed.partial``), so a run stopped while timing
    still leaves its parity and what it measured (``verify`` writes each to ``--json``).

    Raises:
        InputError: the model cannot be loaded or patched; the message says what to pass instead.
    """
    if is_encoder(config.model):
        return run_encoder(config, device, on_report)
    on_gpu = device.type == "cuda"
    model, tokenizer, planned, dtype, dtype_name = _loaded(config, device, load_model)
    new_tokens = config.max_new_tokens
    pad_id = workload.pad_token_id(model, tokenizer)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    parity_rows = max(2, config.batch_size)
    if tokenizer is not None:
        prompts, questions = workload.chat_prompts(tokenizer, parity_rows, pad_id, device)
    else:
        prompts, questions = workload.make_prompts(
            tokenizer, vocab_size, parity_rows, config.prompt_len, pad_id, left_pad=True, device=device
        ), None
    speed_prompts = workload.make_prompts(
        tokenizer, vocab_size, config.batch_size, config.prompt_len, pad_id, left_pad=False, device=device
    ) if on_gpu else None

    compile_on = device.type if config.compile else None
    compiled = " (compiled)" if config.compile else ""

    def generation(label: str) -> workload.Generation:
        with step(f"{label}: up to {new_tokens} greedy tokens per row{compiled}"):
            return workload.greedy_tokens(model, prompts, new_tokens, pad_id, compile_on=compile_on)

    def forward() -> torch.Tensor:
        return workload.prompt_logits(model, prompts)

    # Unpatched first, then the reference, then patch in place: no second copy of the model is ever held. The
    # unpatched model generates after the reference ran: the upcast restores its weights bit for bit.
    eager_logits, reference_logits, norm_calls = _unpatched_and_reference(model, planned.norms, dtype, forward,
                                                                          "logits")
    eager_generation = generation("unpatched model")
    patch, patched_logits, norm_agreement = _patched(model, norm_calls, on_gpu, forward, "logits")
    patched_generation = generation(f"patched model{'' if on_gpu else ' (Triton interpreter)'}")

    result = parity.compare(
        eager_logits, patched_logits, reference_logits, dtype, eager_generation, patched_generation
    )
    # A patch that replaced nothing compares the model with itself: parity would pass and prove nothing.
    failure = None if patch.norms else "nothing was patched, so parity proves nothing"
    generations = None
    if tokenizer is not None:
        eos_id = model.generation_config.eos_token_id
        generations = [
            GeneratedText(prompt=question, unpatched=eager_text, patched=patched_text)
            for question, eager_text, patched_text in zip(
                questions, _texts(tokenizer, eager_generation, eos_id), _texts(tokenizer, patched_generation, eos_id)
            )
        ]
    report = VerifyReport(
        passed=result.passed and failure is None,
        failure=failure,
        model=config.model,
        model_class=type(model).__name__,
        weights=weights_source(config.model, model, config.seed),
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype_name,
        settings=WorkloadSettings(
            batch_size=config.batch_size, parity_batch_size=parity_rows,
            parity_prompts="chat" if questions else "passage",
            parity_prompt_len=int(prompts.input_ids.shape[1]), prompt_len=config.prompt_len,
            max_new_tokens=new_tokens, repeats=config.repeats if on_gpu else None, seed=config.seed,
            compile=workload.COMPILE_MODES.get(compile_on),
        ),
        environment=_environment(device),
        patch=_patch_summary(patch),
        parity=result,
        norm_outputs=norm_agreement,
        generations=generations,
        rule=VERDICT_RULE,
        speed=None,
    )
    if not on_gpu:
        return report
    if on_report is not None:
        on_report(report)

    def timed_round(figures: dict[str, SpeedFigures], rounds: int) -> None:
        on_report(dataclasses.replace(report, speed=_speed_report(figures, rounds, partial=True)))

    with step(f"timing generate(){compiled}: unpatched, patched and norm-free interleaved, {config.repeats} "
              "rounds"):
        figures = measure_states(model, _timed_states(model, planned.norms), speed_prompts, new_tokens,
                                 config.repeats, pad_id, compile_on=compile_on,
                                 on_round=None if on_report is None else timed_round)
    return dataclasses.replace(report, speed=_speed_report(figures, config.repeats))


def write_json(report: VerifyReport | EncoderVerifyReport, path: Path) -> None:
    """Writes ``report``'s JSON document to ``path`` whole or not at all (a temporary file renamed over it), so a
    run stopped while writing leaves the previous document, never half of one."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    os.replace(temporary, path)


def verify(config: VerifyConfig, device: torch.device) -> VerifyReport | EncoderVerifyReport:
    """``run``, then the report printed on stdout; returns it. With ``config.json`` the report is written there as
    JSON, also as it stands before the timing and after every timed round (``run``'s ``on_report``)."""
    path = None if config.json is None else config.json.expanduser().absolute()
    report = run(config, device, None if path is None else lambda partial: write_json(partial, path))
    print(render(report))
    if path is not None:
        write_json(report, path)
        print(f"Report written as JSON to {path}")
    return report
