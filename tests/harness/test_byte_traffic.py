"""Bytes each kernel variant moves, counted in Triton's interpreter (harness.byte_traffic), pinned per
variant: a kernel change that re-reads a row, or rewrites a partial row per row, fails here on the CPU.

The pins are steady-state bytes per row over the minimum's (``per_row_ratio``), bf16, mode llama. The minimum
(kernel_bench.min_traffic_bytes) per element of a row: forward 8 bytes with the residual (read x, residual; write
y, sum), 4 without (read x; write y); backward 8 with the residual's gradient (read dy, the saved sum, dsum; write
dx), 6 without (read dy, x; write dx). The weight is counted once per call (it stays in cache), so it costs
nothing per row; the backward's fp32 ``rstd`` read adds 4 bytes per row, under 0.02% of a row's minimum at these
widths, inside TOLERANCE. Per-launch costs (the per-program weight-gradient partial rows) cancel in a per-row
figure: the interpreter's handful of programs does not skew it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from launching import SCRIPTS

from harness import byte_traffic, kernel_bench

SCRIPT = SCRIPTS / "byte_traffic.py"

# Widths at which the launch plans keep a bf16 row whole in registers, or not (the forward keeps up to 32768
# elements whole, the backward up to 16384).
SINGLE_TILE = 4096
WIDEST_SINGLE_TILE_BWD = 16384
WIDEST_SINGLE_TILE_FWD = 32768
FWD_LOOPED = 65536
BWD_WIDE = 32768
# (variant, hidden) -> expected per-row ratio. Update here when a kernel's traffic changes on purpose.
EXPECTED_PER_ROW_RATIO = {
    # Single tile: every row element read and written once.
    ("infer", SINGLE_TILE): 1.0,
    ("infer+res", SINGLE_TILE): 1.0,
    ("bwd", SINGLE_TILE): 1.0,
    ("bwd+dsum", SINGLE_TILE): 1.0,
    ("infer+res", WIDEST_SINGLE_TILE_FWD): 1.0,
    # The widest backward tile (pipelined or not) reads the norm's input again after the row reductions rather than
    # keep its normalised row live across them (registers: launch.BWD_TILE_LIVE_VALUES): +2 bytes per element over
    # 8, asked of the caches just after the first read.
    ("bwd+dsum", WIDEST_SINGLE_TILE_BWD): 1.25,
    # Looped forward: the second pass re-reads the norm's input (the sum it wrote, or x): 2 extra bytes per
    # element, over 8 with the residual (1.25) and over 4 without (1.5).
    ("infer", FWD_LOOPED): 1.5,
    ("infer+res", FWD_LOOPED): 1.25,
    # Wide backward: the row reductions read dy and the saved input (+4 bytes per element) before the column
    # kernel reads them again with dsum and writes dx; no partial sum is read back: (8 + 4) / 8 = 1.5 with dsum,
    # (6 + 4) / 6 = 1.67 without (was 2.5 and 3.0 with a read-modify-written partial row per row).
    ("bwd", BWD_WIDE): 10 / 6,
    ("bwd+dsum", BWD_WIDE): 1.5,
    # A sandwich's norm, add and next norm (norm_add_norm) in one launch: read x and the residual, write the sum and
    # y (8 bytes per element), nothing re-read. Its backward's two kernels: the second norm's reads dy, the saved
    # sum and the gradient from the sum's other readers, and writes the sum's gradient (the residual's too: the
    # same tensor); the first's reads that gradient again and x, and writes dx: 14 bytes over the minimum's 12 (the
    # sum's gradient passed between the kernels; it was 18 with an aten add accumulating it between them).
    ("sandwich-infer", SINGLE_TILE): 1.0,
    ("sandwich-fwd", SINGLE_TILE): 1.0,
    ("sandwich-bwd", SINGLE_TILE): 14 / 12,
}
TOLERANCE = 0.01
# Rows of the smaller run: 4 one-row tiles give the backward its 3 interpreter programs at both row counts.
ROWS = 4


@pytest.mark.parametrize(("variant", "hidden"), sorted(EXPECTED_PER_ROW_RATIO))
def test_per_row_traffic_is_pinned(variant, hidden):
    record = byte_traffic.measure_variant(variant, hidden, "bf16", rows=ROWS)
    assert record.per_row_ratio == pytest.approx(EXPECTED_PER_ROW_RATIO[variant, hidden], abs=TOLERANCE), (
        byte_traffic.format_table([record]))
    # The whole call moves at least the minimum (a smaller count would mean an access the counter missed), and
    # the per-row breakdown adds up to the ratio.
    assert record.call_bytes >= record.call_min_bytes
    assert sum(record.bytes_per_element.values()) == pytest.approx(
        record.per_row_ratio * record.min_bytes_per_element, rel=1e-3)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_tuned_pipelined_widest_backward_tile_still_reads_its_row_again(num_stages):
    """Which tiles read their row again is the tile's size (``launch.bwd_rereads_row``), not its pipeline: a tuned
    plan that pipelines the widest bf16 tile (the tuner tries 1 to ``BWD_MAX_STAGES`` stages) keeps the registers
    that re-read frees, and moves the default plan's bytes."""
    from hf_rmsnorm.ops import launch, tuning

    key = tuning.PlanKey(None, "backward", 2, tuning.width_bucket(WIDEST_SINGLE_TILE_BWD, launch.bwd_max_tile_n(2)))
    with tuning.plans_in_use({key: {"num_stages": num_stages}}):
        plan = launch.backward_plan(WIDEST_SINGLE_TILE_BWD, 2, None, launch.BWD_BASE_LIVE_TILES)
        assert (plan.single_tile, plan.num_stages) == (True, num_stages)
        record = byte_traffic.measure_variant("bwd+dsum", WIDEST_SINGLE_TILE_BWD, "bf16", rows=ROWS)
    assert record.per_row_ratio == pytest.approx(EXPECTED_PER_ROW_RATIO["bwd+dsum", WIDEST_SINGLE_TILE_BWD],
                                                 abs=TOLERANCE)


def test_counter_counts_masked_elements_by_their_size_and_restores_the_interpreter():
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)

    original = interpreter.InterpreterBuilder.create_masked_load
    src, dst = torch.arange(10, dtype=torch.float32), torch.zeros(10, dtype=torch.float32)
    counter = byte_traffic.TrafficCounter()
    with counter.counting():
        copy_kernel[(1,)](src, dst, 7, BLOCK=16)
    assert interpreter.InterpreterBuilder.create_masked_load is original
    assert counter.bytes_by_tensor() == {"src": 7 * 4, "dst": 7 * 4}
    assert [(launch.kernel, launch.grid) for launch in counter.launches] == [("copy_kernel", (1,))]
    torch.testing.assert_close(dst[:7], src[:7])


def test_an_interpreter_without_the_wrapped_operations_is_refused_in_one_line(monkeypatch):
    from triton.runtime import interpreter

    monkeypatch.delattr(interpreter.InterpreterBuilder, "create_atomic_cas")
    with pytest.raises(RuntimeError, match=r"interpreter has no InterpreterBuilder\.create_atomic_cas: the byte "
                                           r"count knows the interpreters of Triton 3\.2 to 3\.9"):
        with byte_traffic.TrafficCounter().counting():
            pass


def test_cached_tensors_count_once_per_call():
    # The weight of a 4-row forward is read by every row (one-row tiles at this width) but counted once.
    counter = byte_traffic.count_call("infer", 4, SINGLE_TILE, torch.bfloat16, "llama")
    assert counter.bytes_by_tensor()["W"] == SINGLE_TILE * 2
    assert counter.cached_reads()["W"] == pytest.approx(4.0)


def test_min_traffic_without_residual():
    assert kernel_bench.min_traffic_bytes("fwd", 2, 64, 2, 2, residual=False) == 2 * 2 * 64 * 2 + 64 * 2
    assert kernel_bench.min_traffic_bytes("bwd", 2, 64, 2, 2, residual=False) == 3 * 2 * 64 * 2 + 2 * 64 * 2


@pytest.mark.slow
def test_script_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "traffic.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "256", "--variant", "infer+res", "--json",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "per-row" in proc.stdout.splitlines()[0]
    (record,) = json.loads(out.read_text())
    assert (record["variant"], record["hidden"]) == ("infer+res", 256)
    assert record["per_row_ratio"] == pytest.approx(1.0, abs=TOLERANCE)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--mode", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown --mode" in bad.stderr
