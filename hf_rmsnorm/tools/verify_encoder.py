"""``scripts/verify.py`` on an encoder: parity of the last hidden state and of sentence embeddings, and the speed
of an embedding workload.

What is checked. An encoder's users read its last hidden state (token classification, a task head) or pool it
into sentence embeddings (retrieval): the mean of the hidden states over each row's real tokens (the attention
mask's), L2-normalised. Both are compared, for the unpatched and the patched model, with the reference (the
same weights upcast in place, as for decoders: fp32 for a half model, fp64 for an fp32 one), over a batch of
right-padded rows of different lengths (padding as tokenizers pad for encoders).

An encoder-decoder (T5) is checked through its encoder: ``loading.load_encoder`` returns ``get_encoder()`` of the
checkpoint, the part an embedding workload runs (sentence-T5 pools the encoder's states); its decoder is a
generator, which the decoder path's generation checks cover for causal LMs only.

Verdict (``ENCODER_VERDICT_RULE``): PASS when the patched model's mean |error| against the reference is at most
``ACCURACY_SLACK`` (1.10) times the unpatched model's, on the hidden states and on the embeddings alike (why that
slack: ``parity.py``), every value is finite, and something was patched. Exit statuses as for decoders.

Speed (GPU only): forward passes of ``EMBEDDING_BATCH`` rows of ``EMBEDDING_TOKENS`` tokens (no padding), tokens
per second, for the unpatched, patched and norm-free states interleaved (``verify._timed_states``; the median of
``repeats`` rounds after a warm-up round), with the share of the norm-free gain.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
from torch import Tensor, nn

from .norm_free import ORACLE_NOTE, gain_share
from .speed import ModelState
from .verify_report import EncoderParity, EncoderSpeed, EncoderVerifyReport
from .verify_settings import ACCURACY_SLACK
from .workload import Prompts, make_prompts

# The embedding workload the speed figure is of: 32 rows of 128 tokens, forward only.
EMBEDDING_BATCH = 32
EMBEDDING_TOKENS = 128

ENCODER_VERDICT_RULE = (
    "PASS when the patched encoder's mean |error| against the reference (the unpatched model upcast to fp32, or "
    f"fp64 for an fp32 run) is at most {ACCURACY_SLACK:.2f}x the unpatched model's, both on the last hidden state "
    "(every real token) and on the sentence embeddings (the hidden states mean-pooled over each row's real tokens, "
    "L2-normalised), and every value is finite."
)


def right_padded(prompts: Prompts, pad_id: int) -> Prompts:
    """``prompts`` (left-padded rows) with each row's tokens moved to the left and the padding to the right, as
    tokenizers pad for encoders."""
    ids, mask = prompts.input_ids.clone(), prompts.attention_mask.clone()
    for row in range(ids.shape[0]):
        real = int(mask[row].sum())
        ids[row] = pad_id
        ids[row, :real] = prompts.input_ids[row, -real:] if real else ids[row, :0]
        mask[row] = 0
        mask[row, :real] = 1
    return Prompts(ids, mask)


def parity_batch(tokenizer, vocab_size: int, rows: int, tokens: int, pad_id: int, device) -> Prompts:
    """The parity batch: ``rows`` rows cut from ``workload``'s passage, of lengths from ``tokens`` down to about
    half of it, right-padded."""
    return right_padded(make_prompts(tokenizer, vocab_size, rows, tokens, pad_id, left_pad=True, device=device),
                        pad_id)


@torch.no_grad()
def hidden_states(model: nn.Module, prompts: Prompts) -> Tensor:
    """The last hidden state ``[batch, tokens, hidden]`` of an encoder, in at least fp32."""
    out = model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden.to(torch.promote_types(hidden.dtype, torch.float32))


def sentence_embeddings(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of each row's hidden states over its real tokens (the mask's ones), L2-normalised, in fp64."""
    mask = attention_mask.to(torch.float64).unsqueeze(-1)
    pooled = (hidden.double() * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def compare(eager: Tensor, patched: Tensor, reference: Tensor, attention_mask: Tensor,
            dtype: torch.dtype) -> EncoderParity:
    """Every parity figure and the verdict, from the three models' last hidden states."""
    real = attention_mask.bool()
    ref, eager64, patched64 = reference.double()[real], eager.double()[real], patched.double()[real]
    eager_err, patched_err = (eager64 - ref).abs(), (patched64 - ref).abs()
    ref_emb = sentence_embeddings(reference, attention_mask)
    eager_emb = sentence_embeddings(eager, attention_mask)
    patched_emb = sentence_embeddings(patched, attention_mask)
    eager_emb_err = float((eager_emb - ref_emb).abs().mean())
    patched_emb_err = float((patched_emb - ref_emb).abs().mean())
    finite = bool(torch.isfinite(patched64).all())
    return EncoderParity(
        dtype=str(dtype).removeprefix("torch."),
        reference_dtype=str(reference.dtype).removeprefix("torch."),
        positions=int(real.sum()),
        unpatched_hidden_max_err=float(eager_err.max()),
        unpatched_hidden_mean_err=float(eager_err.mean()),
        patched_hidden_max_err=float(patched_err.max()),
        patched_hidden_mean_err=float(patched_err.mean()),
        hidden_max_abs_diff=float((patched64 - eager64).abs().max()),
        hidden_equal_fraction=float((patched.double()[real] == eager.double()[real]).double().mean()),
        unpatched_embedding_mean_err=eager_emb_err,
        patched_embedding_mean_err=patched_emb_err,
        unpatched_min_cosine=float((eager_emb * ref_emb).sum(-1).min()),
        patched_min_cosine=float((patched_emb * ref_emb).sum(-1).min()),
        hidden_ok=finite and float(patched_err.mean()) <= ACCURACY_SLACK * float(eager_err.mean()),
        embeddings_ok=finite and patched_emb_err <= ACCURACY_SLACK * eager_emb_err,
    )


@torch.no_grad()
def measure_forward_states(
    model: nn.Module, states: list[ModelState], prompts: Prompts, repeats: int,
    on_round: Callable[[dict[str, float], int], object] | None = None,
) -> dict[str, float]:
    """Tokens per second of one forward over ``prompts`` (unpadded) in each of ``states``, interleaved as
    ``speed.measure_states`` interleaves generation: a warm-up round, then ``repeats`` rounds of one timed forward
    per state, the device synchronised around each; the median per state."""
    tokens = prompts.input_ids.numel()
    times: dict[str, list[float]] = {state.name: [] for state in states}
    for round_index in range(repeats + 1):  # round 0 warms every state up (Triton compiles, cuBLAS picks)
        for state in states:
            state.enter()
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask)
                torch.cuda.synchronize()
                if round_index:
                    times[state.name].append(time.perf_counter() - start)
            finally:
                state.leave()
        if round_index and on_round is not None:
            on_round({name: tokens / statistics.median(t) for name, t in times.items()}, round_index)
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def speed_report(rates: dict[str, float], rounds: int, partial: bool = False) -> EncoderSpeed:
    """The ``speed`` part of the report from each state's tokens/s."""
    unpatched, patched, free = rates["unpatched"], rates["patched"], rates["norm_free"]
    return EncoderSpeed(
        unpatched_tokens_per_s=unpatched, patched_tokens_per_s=patched, norm_free_tokens_per_s=free,
        speedup=patched / unpatched, norm_free_speedup=free / unpatched,
        gain_share=gain_share(unpatched, patched, free), norm_free_note=ORACLE_NOTE, rounds=rounds,
        partial=partial,
    )


def with_speed(report: EncoderVerifyReport, speed: EncoderSpeed) -> EncoderVerifyReport:
    """``report`` with its speed figures."""
    return dataclasses.replace(report, speed=speed)
