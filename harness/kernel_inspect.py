"""Compiles every launch variant of the RMSNorm kernels for a GPU architecture, offline, and reports what the
machine code does with registers and memory: registers per thread, spilled bytes, the widest global load and
the asynchronous global-to-shared copies (``LDGSTS``, PTX ``cp.async``) of the backward's pipelined row loop.

No GPU is needed: ``triton.compile`` builds PTX and a cubin for any target, ``cuobjdump`` reads the cubin's
resource usage and ``nvdisasm`` its SASS (both ship inside the Triton wheel).

The kernels are not described twice. Each variant calls launch.py's own ``norm_forward`` / ``norm_backward`` on
``meta`` tensors with the kernels swapped for a recorder, so the arguments, the constexprs (``BLOCK_M``,
``BLOCK_N``, ``SINGLE_TILE``, ``NUM_STAGES``) and ``num_warps`` are exactly those a real launch passes;
Triton's own argument binder then specialises them as at run time (pointers and integers divisible by 16 get
``tt.divisibility``), so the load widths are those of real launches.

``run_inspection`` is what ``scripts/inspect_kernels.py`` runs; the script reads the command line (into an
``InspectConfig``), sets the kernels up for a GPU before any is defined, finds the binary tools with
``find_tools`` and turns the records into an exit status. Importing this module imports neither torch nor the
kernels.

Usage::

    python scripts/inspect_kernels.py --arch sm_90 --json inspect_sm90.json
    python scripts/inspect_kernels.py --arch sm_80 --hidden 4096 --dtype bf16 --strict
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from unittest import mock

from hf_rmsnorm.ops import backend

DEFAULT_HIDDEN = (128, 896, 4096, 8192, 16384, 32768, 65536)
DTYPES = ("bf16", "fp16", "fp32")
# A row count that is not a multiple of 16 (so it gets no divisibility specialisation) and is not 1 (which
# Triton turns into a constexpr): the general prefill/training launch.
DEFAULT_ROWS = 4095
# SMs of the reference card of each architecture (H100 SXM, A100); only the backward's program count uses it.
SM_COUNTS = {"sm_80": 108, "sm_90": 132}
# "infer": a forward without autograd, which skips the statistics only the backward reads. "bwd+dsum+rounded": the
# backward of a sandwich's second norm, which rounds its input gradient before adding dsum (``round_before_dsum``).
# "bwd-dot": the row
# reductions that come first in the backward of rows wider than one tile (row_dot_kernel; the "bwd" variants are
# then column_bwd_kernel), not launched for narrower rows.
# The fused q/k norms + RoPE (qk_kernels.py), "qk" variants: per-head norms over heads of ``hidden`` (head_dim =
# hidden) with Qwen3-8B's QK_Q_HEADS query and QK_K_HEADS key heads; "qk-whole" variants: norms over the whole
# projection (OLMo 2's), hidden // QK_HEAD_DIM heads of QK_HEAD_DIM for both q and k; "qk-rope-first" variants:
# per-head norms of the rotated heads (qk_rope_norm: NanoChat's and HunYuan's order, NanoChat's opposite angle);
# "rows" counts tokens. Widths these kernels do not take (odd head dims, rows wider than their tile) make no launch.
QK_VARIANTS = ("qk-fwd", "qk-infer", "qk-bwd", "qk-whole-fwd", "qk-whole-bwd", "qk-rope-first-fwd",
               "qk-rope-first-bwd")
QK_Q_HEADS, QK_K_HEADS, QK_HEAD_DIM = 32, 8, 128
# "sandwich" variants: a sandwich norm's norm, add and next norm in one launch (norm_add_norm_fwd_kernel), with the
# statistics or without ("sandwich-infer"); rows wider than one tile make no such launch (the "fwd" variants' two).
SANDWICH_VARIANTS = ("sandwich", "sandwich-infer")
VARIANTS = ("fwd", "fwd+bias", "fwd+res", "fwd+res+bias", "infer", "infer+res", "bwd", "bwd+dsum", "bwd+dsum+bias",
            "bwd+dsum+rounded", "bwd-dot", *QK_VARIANTS, *SANDWICH_VARIANTS)
# The most a variant may spill, in bytes a thread (issue 28): a few reloads per row. The plans send a backward
# whose single tile would spill more to the wide kernels (launch.bwd_max_tile_n).
MAX_SPILL_BYTES = 64

# Global loads (LDGSTS, the asynchronous global-to-shared copy, reads global memory too) and stores.
_GLOBAL_ACCESS = re.compile(r"\b(LDGSTS|LDG|STG)((?:\.\w+)*)\s")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_LOCAL_ACCESS = re.compile(r"\b(?:LDL|STL)\b")
_ASYNC_COPY = re.compile(r"\bLDGSTS\b")


@dataclass
class Record:
    """What one compiled variant costs. ``spill_bytes`` is the per-thread stack frame plus local memory:
    these kernels have no local arrays or calls, so any of either is spilled registers. ``async_copies`` counts
    ``LDGSTS`` instructions."""

    arch: str
    kernel: str
    variant: str
    dtype: str
    hidden: int
    rows: int
    mode: str
    block_m: int
    block_n: int
    single_tile: bool
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int
    local_mem_ops: int
    shared_bytes: int
    vector_bits: int
    store_vector_bits: int
    async_copies: int
    load_widths: dict[int, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- SASS parsing


def access_bits(modifiers: str) -> int:
    """Width in bits of a global access from its SASS modifiers (``.E.128`` -> 128, ``.E.U16`` -> 16, none of
    those -> 32, the default word)."""
    for token in modifiers.split("."):
        if token.isdigit():
            return int(token)
        if token in ("U16", "S16"):
            return 16
        if token in ("U8", "S8"):
            return 8
    return 32


def global_access_widths(sass: str) -> tuple[Counter[int], Counter[int]]:
    """Counts of global loads and of global stores by width in bits."""
    loads: Counter[int] = Counter()
    stores: Counter[int] = Counter()
    for op, modifiers in _GLOBAL_ACCESS.findall(sass):
        (stores if op == "STG" else loads)[access_bits(modifiers)] += 1
    return loads, stores


def count_async_copies(sass: str) -> int:
    """``LDGSTS`` instructions: the asynchronous global-to-shared copies (PTX ``cp.async``) that a software-
    pipelined loop prefetches with on sm_80 and later."""
    return len(_ASYNC_COPY.findall(sass))


def parse_resource_usage(text: str) -> dict[str, int]:
    """``registers``, ``spill_bytes`` and ``shared_bytes`` from ``cuobjdump --dump-resource-usage``
    (one kernel per cubin)."""
    match = _RESOURCES.search(text)
    if match is None:
        raise ValueError(f"no resource usage line in cuobjdump output:\n{text}")
    reg, stack, shared, local = map(int, match.groups())
    return {"registers": reg, "spill_bytes": stack + local, "shared_bytes": shared}


def analyse_cubin(cubin: bytes, cuobjdump: str, nvdisasm: str) -> dict[str, Any]:
    """Resource usage and global access widths of a cubin, via the CUDA binary tools."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], check=True, capture_output=True,
                               text=True).stdout
        sass = subprocess.run([nvdisasm, str(path)], check=True, capture_output=True, text=True).stdout
    loads, stores = global_access_widths(sass)
    return {
        **parse_resource_usage(usage),
        "local_mem_ops": len(_LOCAL_ACCESS.findall(sass)),
        "vector_bits": max(loads, default=0),
        "store_vector_bits": max(stores, default=0),
        "async_copies": count_async_copies(sass),
        "load_widths": dict(sorted(loads.items())),
    }


# ------------------------------------------------------------------------------------ capturing launches


class _LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def capture_launch(variant: str, dtype: Any, hidden: int, rows: int, mode: str,
                   sm_count: int, arch: str | None = None) -> tuple[Any, tuple, dict] | None:
    """Runs launch.py's host code for ``variant`` on meta tensors and returns ``(kernel, args, kwargs)`` of the
    launch it makes (None for ``bwd-dot`` where the backward makes no such launch). A backward variant runs its forward first, so it gets the saved tensors launch.py makes.
    Weights have the activations' dtype, as in a model loaded in that dtype. The tiling is the plan for GPU
    architecture ``arch`` (its tuned-plan table entry, if any; None: the defaults)."""
    import torch

    from hf_rmsnorm.ops import launch

    def tensor() -> torch.Tensor:
        return torch.empty(rows, hidden, dtype=dtype, device="meta")

    weight = torch.empty(hidden, dtype=dtype, device="meta")
    bias = weight if "bias" in variant else None
    # The backward's dsum is the gradient of the residual sum: it exists only after a fused add.
    if variant in SANDWICH_VARIANTS:
        sandwich = _LaunchRecorder()
        with (mock.patch.object(launch, "norm_add_norm_fwd_kernel", sandwich),
              mock.patch.object(launch, "norm_fwd_kernel", _LaunchRecorder()),
              mock.patch.object(launch, "device_arch", lambda _index: arch)):
            launch.norm_add_norm_forward(tensor(), tensor(), weight, None, 1e-6, weight, None, 1e-6, mode,
                                         store_stats=variant == "sandwich")
        if not sandwich.calls:
            return None
        (args, kwargs), = sandwich.calls
        return launch.norm_add_norm_fwd_kernel, args, kwargs
    residual = tensor() if "res" in variant or "dsum" in variant else None
    fwd, bwd = _LaunchRecorder(), _LaunchRecorder()
    wide_bwd, row_dot = _LaunchRecorder(), _LaunchRecorder()
    with (
        mock.patch.object(launch, "norm_fwd_kernel", fwd),
        mock.patch.object(launch, "norm_bwd_kernel", bwd),
        mock.patch.object(launch, "column_bwd_kernel", wide_bwd),
        mock.patch.object(launch, "row_dot_kernel", row_dot),
        mock.patch.object(launch, "_sm_count", lambda _index: sm_count),
        mock.patch.object(launch, "device_arch", lambda _index: arch),
    ):
        x = tensor()
        y, new_residual, stats = launch.norm_forward(x, residual, weight, bias, 1e-6, mode,
                                                     store_stats=not variant.startswith("infer"))
        if variant.startswith("bwd"):
            norm_input = x if new_residual is None else new_residual
            dsum = None if new_residual is None else torch.empty_like(new_residual)
            launch.norm_backward(torch.empty_like(y), dsum, norm_input, stats, weight,
                                 None if bias is None else bias.dtype, mode, x.dtype, None, "rounded" in variant)
    if not variant.startswith("bwd"):
        (args, kwargs), = fwd.calls
        return launch.norm_fwd_kernel, args, kwargs
    if variant == "bwd-dot":
        if not row_dot.calls:
            return None
        (args, kwargs), = row_dot.calls
        return launch.row_dot_kernel, args, kwargs
    if wide_bwd.calls:  # rows wider than one tile: the column kernel does the gradients' work
        (args, kwargs), = wide_bwd.calls
        return launch.column_bwd_kernel, args, kwargs
    (args, kwargs), = bwd.calls
    return launch.norm_bwd_kernel, args, kwargs


def capture_qk_launch(variant: str, dtype: Any, hidden: int, rows: int, mode: str) -> tuple[Any, tuple, dict] | None:
    """``capture_launch`` for the q/k norm + RoPE variants (``QK_VARIANTS``): qk_launch.py's own host code on meta
    tensors, the kernels swapped for recorders (the backward after its forward); None where the variant makes no
    launch (a centring mode, a width the kernels do not take)."""
    import torch

    from hf_rmsnorm.ops import checks, qk_launch

    per_head = not variant.startswith("qk-whole")
    if per_head:
        head_dim, q_heads, k_heads = hidden, QK_Q_HEADS, QK_K_HEADS
    elif hidden % QK_HEAD_DIM:
        return None
    else:
        head_dim, q_heads, k_heads = QK_HEAD_DIM, hidden // QK_HEAD_DIM, hidden // QK_HEAD_DIM
    q = torch.empty(1, rows, q_heads, head_dim, dtype=dtype, device="meta")
    k = torch.empty(1, rows, k_heads, head_dim, dtype=dtype, device="meta")
    q_weight = torch.empty(head_dim if per_head else q_heads * head_dim, dtype=dtype, device="meta")
    k_weight = torch.empty(head_dim if per_head else k_heads * head_dim, dtype=dtype, device="meta")
    cos = torch.empty(1, rows, head_dim, dtype=dtype, device="meta")
    rope_first = variant.startswith("qk-rope-first")
    try:
        checks.check_qk_norm_rope(q, k, q_weight, k_weight, cos, cos, 1e-6, 1e-6, mode, per_head, rope_first)
    except ValueError:
        return None
    fwd, bwd = _LaunchRecorder(), _LaunchRecorder()
    with (mock.patch.object(qk_launch, "qk_norm_rope_fwd_kernel", fwd),
          mock.patch.object(qk_launch, "qk_norm_rope_bwd_kernel", bwd)):
        q_out, k_out, stats = qk_launch.qk_norm_rope_forward(q, k, q_weight, k_weight, cos, cos, 1e-6, 1e-6, mode,
                                                             per_head, variant != "qk-infer", rope_first, rope_first)
        if variant.endswith("bwd"):
            qk_launch.qk_norm_rope_backward(torch.empty_like(q_out), torch.empty_like(k_out), q, k, q_weight, k_weight,
                                            cos, cos, stats, mode, per_head, rope_first, rope_first)
    if variant.endswith("bwd"):
        (args, kwargs), = bwd.calls
        return qk_launch.qk_norm_rope_bwd_kernel, args, kwargs
    (args, kwargs), = fwd.calls
    return qk_launch.qk_norm_rope_fwd_kernel, args, kwargs


def _tile(kernel_name: str, kwargs: dict) -> dict[str, Any]:
    """The record's tile fields from a launch's constexprs: a q/k kernel's are q's rows a program and its padded
    row (heads times the pieces of a head), one tile, not pipelined."""
    if kernel_name.startswith("qk_"):
        pieces = 2 * kwargs["HALF_BLOCK"] + (kwargs["PASS_BLOCK"] if kwargs["ROTARY_DIM"] < kwargs["HEAD_DIM"] else 0)
        return dict(block_m=kwargs["Q_BLOCK_M"], block_n=kwargs["Q_HEADS_BLOCK"] * pieces, single_tile=True,
                    num_stages=1)
    return dict(block_m=kwargs["BLOCK_M"], block_n=kwargs["BLOCK_N"],
                single_tile=kwargs.get("SINGLE_TILE", kernel_name not in ("column_bwd_kernel", "row_dot_kernel")),
                num_stages=kwargs.get("NUM_STAGES", 1))


def compile_launch(kernel: Any, args: tuple, kwargs: dict, target: Any) -> Any:
    """Compiles ``kernel`` for ``target`` specialised as Triton's launcher would specialise these arguments."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def inspect_variant(arch: str, variant: str, dtype_name: str, hidden: int, rows: int, mode: str,
                    tools: tuple[str, str]) -> Record | None:
    """Compiles one variant and measures its cubin; None where the variant makes no launch at this width."""
    import torch
    from triton.backends.compiler import GPUTarget

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    if variant in QK_VARIANTS:
        launch = capture_qk_launch(variant, dtype, hidden, rows, mode)
    else:
        launch = capture_launch(variant, dtype, hidden, rows, mode, SM_COUNTS[arch], arch)
    if launch is None:
        return None
    kernel, args, kwargs = launch
    compiled = compile_launch(kernel, args, kwargs, GPUTarget("cuda", int(arch.removeprefix("sm_")), 32))
    measured = analyse_cubin(compiled.asm["cubin"], *tools)
    # cuobjdump sees the static shared memory only; Triton's own figure includes the dynamic allocation it
    # launches with (the pipelined loop's staging buffers, the reductions' scratch).
    measured["shared_bytes"] = max(measured["shared_bytes"], compiled.metadata.shared)
    return Record(
        arch=arch, kernel=kernel.__name__, variant=variant, dtype=dtype_name, hidden=hidden, rows=rows, mode=mode,
        **_tile(kernel.__name__, kwargs), num_warps=kwargs["num_warps"], **measured,
    )


# -------------------------------------------------------------------------------------------------- report


def problems(record: Record) -> list[str]:
    """What falls short of the goal: at most ``MAX_SPILL_BYTES`` spilled, 128-bit loads of the activations, and
    asynchronous copies in a pipelined loop (without them the prefetch was not made). Rows are contiguous, so for
    widths that are multiples of 16 elements 128-bit accesses are possible in every dtype; other widths give
    Triton no alignment to rely on and are rightly flagged."""
    found = []
    if record.spill_bytes > MAX_SPILL_BYTES:
        found.append(f"spills {record.spill_bytes} B ({record.local_mem_ops} local ops)")
    if record.vector_bits < 128:
        found.append(f"widest load {record.vector_bits} bits")
    if record.num_stages > 1 and not record.async_copies:
        found.append(f"{record.num_stages} stages but no async copies")
    return found


def format_table(records: list[Record]) -> str:
    """A fixed-width table, one line per variant."""
    header = ("arch", "variant", "dtype", "hidden", "BM", "BN", "tile", "warps", "stages", "regs", "spill", "smem",
              "ld_bits", "st_bits", "async", "loads by width", "check")
    rows = [header]
    for r in records:
        widths = " ".join(f"{bits}b:{n}" for bits, n in r.load_widths.items())
        rows.append((r.arch, r.variant, r.dtype, str(r.hidden), str(r.block_m), str(r.block_n),
                     "single" if r.single_tile else "loop", str(r.num_warps), str(r.num_stages), str(r.registers),
                     str(r.spill_bytes), str(r.shared_bytes), str(r.vector_bits), str(r.store_vector_bits),
                     str(r.async_copies), widths,
                     "; ".join(problems(r)) or "ok"))
    sizes = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(size) for cell, size in zip(row, sizes)).rstrip() for row in rows)


# ------------------------------------------------------------------------------------------------ whole run


# The compiler internals ``compile_launch`` drives (the signature binder, ``_pack_args``, ``triton.knobs``) took
# their present form in Triton 3.5; the kernels themselves run on older releases.
MIN_TRITON = (3, 5)


def find_tools() -> tuple[str, str] | None:
    """Paths of cuobjdump and nvdisasm as Triton resolves them, or None when either is missing."""
    from triton import knobs

    try:
        return knobs.nvidia.cuobjdump.path, knobs.nvidia.nvdisasm.path
    except RuntimeError:
        return None


def unavailable_reason() -> str | None:
    """Why the inspection cannot run with the installed Triton, in one line with the fix, or None if it can."""
    if not backend.triton_at_least(*MIN_TRITON):
        return (f"the kernel inspection needs triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]} (installed "
                f"{backend.triton_version()}): pip install 'triton>={MIN_TRITON[0]}.{MIN_TRITON[1]}'")
    if find_tools() is None:
        return "cuobjdump/nvdisasm not found (they ship in triton/backends/nvidia/bin)"
    return None


class CompilationFailed(RuntimeError):
    """A variant did not compile; the message names the variant and gives the compiler's error."""


@dataclass(frozen=True)
class InspectConfig:
    """The command line of ``scripts/inspect_kernels.py``, one field per option but ``--strict`` (which only
    decides the exit status); see its ``--help``."""

    arch: str
    hidden: list[int]
    dtype: list[str]
    variant: list[str]
    mode: str
    rows: int
    json: Path | None = None


def run_inspection(config: InspectConfig, tools: tuple[str, str]) -> list[Record]:
    """Compiles every variant, dtype and hidden size of ``config`` and measures each cubin with ``tools``
    (``find_tools()``); prints the table and how many variants fall short of the goal (``problems``), writes
    the records to ``config.json`` if given, and returns them.

    The kernels must be set up for a GPU (``hf_rmsnorm.ops.backend.configure("cuda")``) before this runs:
    kernels defined for the interpreter cannot be compiled.

    Raises:
        CompilationFailed: a variant did not compile; nothing is printed or written.
    """
    records = []
    for variant in config.variant:
        for dtype in config.dtype:
            for hidden in config.hidden:
                try:
                    record = inspect_variant(config.arch, variant, dtype, hidden, config.rows, config.mode, tools)
                except Exception as exc:  # report which variant broke, then fail the run
                    raise CompilationFailed(f"{config.arch} {variant} {dtype} hidden={hidden}: compilation failed: "
                                            f"{exc!r}") from exc
                if record is not None:
                    records.append(record)
    print(format_table(records))
    if config.json:
        config.json.write_text(json.dumps([asdict(r) for r in records], indent=1))
    failing = [r for r in records if problems(r)]
    print(f"\n{len(records)} variants, {len(failing)} with problems")
    return records
