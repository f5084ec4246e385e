"""Where the time goes on a GPU: the diagnostic behind a speed figure that misses its goal.

``profile_backward`` profiles training-sized fused add + RMSNorm forward and backward calls: device time per
kernel and the host functions with the most own time. ``profile_generate`` profiles ``generate()``, unpatched
and then patched, in one process: for each model state it prints torch.profiler's table of one prefill
(``generate`` of one new token) by device time, the same for a few decode steps, and Python's cProfile of the
host side of those decode steps (the functions with the most own time). The model's weights are the same in
both states: the patched run is the same model object after ``patch_model``.
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from hf_rmsnorm.ops import fused_add_rms_norm
from hf_rmsnorm.patch import patch_model
from hf_rmsnorm.tools.loading import load_model
from hf_rmsnorm.tools.workload import generation_config, make_prompts, pad_token_id

TABLE_ROWS = 15


def _generate(model, prompts, new_tokens: int, pad_id: int) -> None:
    with torch.no_grad():
        model.generate(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                       generation_config=generation_config(new_tokens, pad_id))
    torch.cuda.synchronize()


def _device_table(run) -> str:
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        run()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=TABLE_ROWS, max_name_column_width=60)


def _host_profile(run) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(TABLE_ROWS)
    return out.getvalue()


def profile_backward(rows: int, hidden: int, calls: int = 20) -> None:
    """Prints the profiles of ``calls`` bf16 fused add + RMSNorm forward and backward passes of ``rows x hidden``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual, dy, dsum = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
                             for _ in range(4))
    x.requires_grad_()
    residual.requires_grad_()
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run():
        for _ in range(calls):
            y, s = fused_add_rms_norm(x, residual, weight)
            torch.autograd.backward((y, s), (dy, dsum))
        torch.cuda.synchronize()

    run()  # warm-up
    print(f"===== fused add + RMSNorm forward and backward, {rows} x {hidden} bf16, {calls} calls, by device time")
    print(_device_table(run))
    print("===== the same, host functions by own time (cProfile)")
    print(_host_profile(run))


def profile_generate(model_name: str, prompt_len: int, decode_tokens: int) -> None:
    """Prints the profiles of ``model_name`` (bf16, on the current GPU), unpatched then patched."""
    model, tokenizer = load_model(model_name, dtype=torch.bfloat16, device="cuda", seed=0)
    pad_id = pad_token_id(model, tokenizer)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    prompts = make_prompts(None, vocab_size, 1, prompt_len, pad_id, left_pad=False, device="cuda")
    for state in ("unpatched", "patched"):
        if state == "patched":
            print(patch_model(model))
        _generate(model, prompts, decode_tokens, pad_id)  # warm-up: kernels compiled, allocator grown
        print(f"===== {state}: prefill of {prompt_len} tokens (generate of 1 token), by device time")
        print(_device_table(lambda: _generate(model, prompts, 1, pad_id)))
        print(f"===== {state}: prefill + {decode_tokens} decode steps, by device time")
        print(_device_table(lambda: _generate(model, prompts, decode_tokens, pad_id)))
        print(f"===== {state}: prefill + {decode_tokens} decode steps, host functions by own time (cProfile)")
        print(_host_profile(lambda: _generate(model, prompts, decode_tokens, pad_id)))
