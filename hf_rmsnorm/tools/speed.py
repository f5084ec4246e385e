"""End-to-end ``generate()`` speed on a GPU: prefill and decode throughput and peak memory.

Both figures come from the same ``generate(max_new_tokens=N)`` call, split where the first token's logits
arrive (a logits processor synchronises the device and reads the clock there): prefill is the time up to the
first token's logits (one forward over the prompt), decode is the time from there to the end (N - 1 cached
forwards and the N sampling steps). Each figure is the median of ``repeats`` runs after a warm-up run (Triton
compiles its kernels and cuBLAS picks its algorithms on first use), with the device synchronised around every
timed call so queued GPU work is counted. Splitting one run, rather than subtracting a short run from a long
one, keeps both intervals positive whatever the noise.

The states of the model compared (unpatched, patched, norm-free) are timed interleaved: each repeat runs every
state once, in turn. Batch-1 decode is bound by host time, and a shared GPU host's speed drifts: on an H100
host the same unpatched decode step measured 12.8 ms and 19.0 ms a few seconds apart, and one aten add 7.6 to
15.6 us. Timing the states one after another in blocks gave whichever state ran in a slow spell the blame
(patched decode "0.69x" in one run, faster than unpatched when interleaved in the same process).
There is no CPU path: Triton's interpreter runs one program at a time in numpy, so CPU timings would measure
the interpreter, not the kernels.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from .verify_report import SpeedFigures, Speedups
from .workload import Prompts, generation_config


def speedups(unpatched: SpeedFigures, patched: SpeedFigures) -> Speedups:
    """Patched over unpatched throughput (above 1 means the patch is faster)."""
    return Speedups(
        prefill_speedup=patched.prefill_tokens_per_s / unpatched.prefill_tokens_per_s,
        decode_speedup=patched.decode_tokens_per_s / unpatched.decode_tokens_per_s,
    )


@dataclass(frozen=True)
class ModelState:
    """One state of the model in an interleaved timing: ``enter()`` puts the model in it, ``leave()`` back."""

    name: str
    enter: Callable[[], object]
    leave: Callable[[], object]


class _FirstTokenClock(LogitsProcessor):
    """Reads the clock, after a device sync, when the first generated token's logits arrive."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first_token_at is None:
            torch.cuda.synchronize()
            self.first_token_at = time.perf_counter()
        return scores


@torch.no_grad()
def _timed_generate(model: PreTrainedModel, prompts: Prompts, new_tokens: int, pad_id: int,
                    compile_on: str | None) -> tuple[float, float]:
    """Seconds of prefill and of decode in one ``generate()`` call."""
    clock = _FirstTokenClock()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        generation_config=generation_config(new_tokens, pad_id, compile_on=compile_on),
        logits_processor=LogitsProcessorList([clock]),
    )
    torch.cuda.synchronize()
    end = time.perf_counter()
    return clock.first_token_at - start, end - clock.first_token_at


def measure_states(
    model: PreTrainedModel, states: list[ModelState], prompts: Prompts, new_tokens: int, repeats: int, pad_id: int,
    *, compile_on: str | None = None, on_round: Callable[[dict[str, SpeedFigures], int], object] | None = None,
) -> dict[str, SpeedFigures]:
    """Times greedy ``generate()`` of ``new_tokens`` tokens on a CUDA model in each of ``states``, interleaved
    (see module docstring): a warm-up run per state, then ``repeats`` rounds of one timed run per state.

    Args:
        model: a model on a CUDA device.
        states: the states to compare; each is entered before its run and left after it.
        prompts: an unpadded batch (every position is a real token, so tokens/s counts real tokens).
        new_tokens: tokens to generate per row; at least 2 (decode is the part after the first).
        repeats: timed runs per state; the median is reported.
        pad_id: pad token for ``generate``.
        compile_on: ``"cuda"`` for transformers' compiled generation (``workload.generation_config``); each
            state's warm-up run compiles and captures.
        on_round: called after every timed round with the figures of the rounds so far and their count, so a
            run stopped early still leaves what it measured (``verify`` writes its JSON there).

    Returns:
        Per state name: prefill tokens/s (``batch * prompt_len`` per prefill), decode tokens/s (``batch`` per
        step after the first) and the peak memory its timed runs allocated on the device beyond what was
        allocated before each run (the model's weights are not counted).
    """
    if new_tokens < 2:
        raise ValueError("decode timing needs new_tokens >= 2")
    batch, prompt_len = prompts.input_ids.shape
    device = prompts.input_ids.device
    times: dict[str, list[tuple[float, float]]] = {state.name: [] for state in states}
    peaks = dict.fromkeys(times, 0)
    for round_index in range(repeats + 1):  # round 0 warms every state up
        for state in states:
            state.enter()
            try:
                # What the run adds on top of what is already held (the model, and whatever the caller keeps),
                # so the states compare fairly.
                held_before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                seconds = _timed_generate(model, prompts, new_tokens, pad_id, compile_on)
                if round_index:
                    times[state.name].append(seconds)
                    peaks[state.name] = max(peaks[state.name], torch.cuda.max_memory_allocated(device) - held_before)
            finally:
                state.leave()
        if round_index and on_round is not None:
            on_round(_figures(times, peaks, batch * prompt_len, batch * (new_tokens - 1)), round_index)
    return _figures(times, peaks, batch * prompt_len, batch * (new_tokens - 1))


def _figures(times: dict[str, list[tuple[float, float]]], peaks: dict[str, int], prefill_tokens: int,
             decode_tokens: int) -> dict[str, SpeedFigures]:
    """Each state's figures from its timed runs' (prefill, decode) seconds: medians as throughputs."""
    figures = {}
    for name, runs in times.items():
        prefill_s, decode_s = zip(*runs)
        figures[name] = SpeedFigures(
            prefill_tokens_per_s=prefill_tokens / statistics.median(prefill_s),
            decode_tokens_per_s=decode_tokens / statistics.median(decode_s),
            peak_memory_bytes=peaks[name],
        )
    return figures
