"""Times the fused query/key norms + RoPE (``qk_norm_rope``) on a GPU against what a Qwen3 attention runs
unpatched, forward and backward, as achieved bandwidth and as a fraction of the card's copy bandwidth.

Implementations (``--ops``), each taking the q and k projections' views ``[1, tokens, heads, head_dim]`` (Qwen3-8B's
``kernel_inspect.QK_Q_HEADS`` query and ``QK_K_HEADS`` key heads), ``cos`` and ``sin`` and returning the rotated
``[1, heads, tokens, head_dim]``:

* ``hf_qk_rope``: this package's ``qk_norm_rope``, one launch.
* ``hf_eager_qk``: transformers' ``Qwen3RMSNorm`` modules, then Qwen3's ``apply_rotary_pos_emb`` (what an unpatched
  model runs: two norms of 8 aten ops, ten RoPE ops).
* ``torch_rms_norm_qk``: ``torch.nn.functional.rms_norm`` for each norm, then the same eager RoPE.

The method is ``kernel_bench``'s (its settings, clocks, CUDA graphs, L2 flush, copy-bandwidth probe and JSON): the
kernels' figure is a CUDA graph's replay, the call's the eager call, host included; the backward is timed alone
(``torch.autograd.grad`` with ``retain_graph``); the traffic is ``kernel_bench.qk_min_traffic_bytes``. Results are
``kernel_bench.Result`` rows whose ``rows`` are tokens and ``hidden`` the head_dim. ``--dry-run`` runs the harness on
the CPU (kernels in Triton's interpreter; the figures mean nothing).

Usage::

    python scripts/bench_qk.py --json qk.json
    python scripts/bench_qk.py --tokens 16384 --phases bwd --ops hf_qk_rope hf_eager_qk
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import kernel_bench
from .kernel_bench import DTYPES, EPS, Result
from .kernel_inspect import QK_K_HEADS, QK_Q_HEADS

IMPLS = ("hf_qk_rope", "hf_eager_qk", "torch_rms_norm_qk")
PHASES = ("fwd", "bwd")
DEFAULT_TOKENS = (1, 16, 4096, 16384)
DEFAULT_HEAD_DIM = (128,)


@dataclass
class QKImpl:
    """``forward(q, k, cos, sin) -> (q_out, k_out)`` and the norm weights it differentiates."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    weights: tuple[torch.Tensor, torch.Tensor]


def build_impl(name: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> QKImpl:
    """One implementation; weights in the activations' dtype, drawn around 1 (trained-like)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    norms = [Qwen3RMSNorm(head_dim, eps=EPS).to(device=device, dtype=dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    q_weight, k_weight = (norm.weight for norm in norms)
    if name == "hf_qk_rope":
        from hf_rmsnorm.ops import qk_norm_rope

        return QKImpl(lambda q, k, cos, sin: qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS),
                      (q_weight, k_weight))
    if name == "hf_eager_qk":
        def eager(q, k, cos, sin):
            return apply_rotary_pos_emb(norms[0](q).transpose(1, 2), norms[1](k).transpose(1, 2), cos, sin)

        return QKImpl(eager, (q_weight, k_weight))
    if name == "torch_rms_norm_qk":
        def functional(q, k, cos, sin):
            q_states = torch.nn.functional.rms_norm(q, (head_dim,), q_weight, EPS).transpose(1, 2)
            k_states = torch.nn.functional.rms_norm(k, (head_dim,), k_weight, EPS).transpose(1, 2)
            return apply_rotary_pos_emb(q_states, k_states, cos, sin)

        return QKImpl(functional, (q_weight, k_weight))
    raise ValueError(f"unknown implementation {name!r}")


def phase_callable(impl: QKImpl, phase: str, inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """What one timed run of ``phase`` executes: the inference forward, or the backward alone (its forward runs
    here, once, outside the timing)."""
    q, k, cos, sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    if phase == "fwd":
        def run_forward():
            with torch.no_grad():
                return impl.forward(q, k, cos, sin)

        return run_forward
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    outputs = impl.forward(q, k, cos, sin)
    return lambda: torch.autograd.grad(outputs, (q, k, *impl.weights), (inputs["dq"], inputs["dk"]),
                                       retain_graph=True)


def bench_shape(tokens: int, head_dim: int, impls: list[str], phases: list[str],
                settings: kernel_bench.Settings) -> list[Result]:
    """Every implementation and phase on one shape."""
    dtype = DTYPES[settings.dtype_name]
    gen = torch.Generator(device=settings.device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=settings.device, generator=gen)

    try:
        inputs = {"q": randn(1, tokens, QK_Q_HEADS, head_dim), "k": randn(1, tokens, QK_K_HEADS, head_dim),
                  "cos": randn(1, tokens, head_dim), "sin": randn(1, tokens, head_dim),
                  # The gradients as the attention's backward hands them: [1, heads, tokens, head_dim].
                  "dq": randn(1, QK_Q_HEADS, tokens, head_dim), "dk": randn(1, QK_K_HEADS, tokens, head_dim)}
    except torch.OutOfMemoryError:
        return [Result(i, p, tokens, head_dim, settings.dtype_name, "oom") for i in impls for p in phases]
    results = []
    for name in impls:
        impl = build_impl(name, head_dim, dtype, settings.device)
        for phase in phases:
            timed = kernel_bench.time_call_and_kernels(functools.partial(phase_callable, impl, phase, inputs),
                                                       settings)
            if isinstance(timed, str):
                results.append(Result(name, phase, tokens, head_dim, settings.dtype_name, timed))
                continue
            call_seconds, seconds = timed
            traffic = kernel_bench.qk_min_traffic_bytes(phase, tokens, QK_Q_HEADS + QK_K_HEADS, head_dim, head_dim,
                                                        dtype.itemsize, dtype.itemsize)
            results.append(kernel_bench.make_result(name, phase, tokens, head_dim, settings.dtype_name, seconds,
                                                    call_seconds, dtype.itemsize, dtype.itemsize, settings.copy_gbps,
                                                    settings.cuda_graphs, traffic))
    return results


@dataclass(frozen=True)
class QKBenchConfig:
    """The command line of ``scripts/bench_qk.py``, one field per option; see its ``--help``."""

    tokens: list[int]
    head_dim: list[int]
    ops: list[str]
    phases: list[str]
    dtype: str
    warmup: int
    repeats: int
    json: Path | None = None
    dry_run: bool = False


def run_benchmark(config: QKBenchConfig) -> list[Result]:
    """Measures the copy bandwidth and every shape of ``config``, printing each shape's table as it is measured
    (``kernel_bench.format_table``; its ``x eager`` column is against ``hf_eager``, absent here) and writing the
    JSON after every shape; returns the results. The kernels must be set up for the device first, as for
    ``kernel_bench.run_benchmark``."""
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        settings = kernel_bench.gpu_settings(device, config.dtype, config.warmup, config.repeats)
        device_name = torch.cuda.get_device_name(device)
    elif config.dry_run:
        settings = kernel_bench.dry_run_settings(config.dtype, config.warmup, config.repeats)
        device_name = "cpu (dry run)"
        print(kernel_bench.DRY_RUN_NOTE)
    else:
        raise RuntimeError("run_benchmark needs a GPU, or config.dry_run to run on the CPU")
    print(f"{device_name}: device-to-device copy {settings.copy_gbps:.0f} GB/s")
    results: list[Result] = []
    for tokens in config.tokens:
        for head_dim in config.head_dim:
            shape_results = bench_shape(tokens, head_dim, config.ops, config.phases, settings)
            kernel_bench.release_cached_memory(settings.device)
            print(kernel_bench.format_table(shape_results, header=not results), flush=True)
            results += shape_results
            if config.json:
                kernel_bench.write_json(config.json, results, device_name, settings.copy_gbps)
    return results
