"""The tuned-plan table: per GPU architecture, the tiling constants a GPU sweep found faster than the defaults.

``launch.py``'s plan functions (``forward_plan``, ``backward_plan``) compute a default plan from the width and
the activations' element size, then apply this table's entry for the tensors' architecture, if it has one. The
table is data, ``tuned_plans.json`` next to this file, written by ``scripts/tune_kernels.py`` on a GPU (the GPU
suite's ``tune`` section leaves it in its output folder, ready to commit). It starts empty: every architecture
runs the defaults until someone has measured it. Its format::

    {"format": 1,
     "architectures": {
       "sm_90": {"card": "NVIDIA H100 80GB HBM3", "date": "YYYY-MM-DD", "command": "scripts/tune_kernels.py ...",
                 "triton": "3.4.0", "torch": "2.11.0", "swept": ["backward/2/4096", ...],
                 "entries": [
                   {"kernel": "backward", "elem_bytes": 2, "width_bucket": 4096,
                    "plan": {"block_m": 2, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1},
                    "measured": {"rows": 16384, "us": 28.1, "default_us": 30.8}}]}}}

An entry's key is the kernel, the activation element size (the widest loaded activation, as the plan
functions count it) and the width bucket (``width_bucket``); its ``plan`` overrides some or all of the
kernel's ``TUNABLE`` constants. ``swept`` lists the ``kernel/elem_bytes/width_bucket`` buckets the sweep
measured, where the defaults stand unless an entry says otherwise; ``measured`` records the sweep's figures and
is not read here. The table is read and validated once, on first use; a malformed one is an error naming the
file and the entry.

Architectures are ``sm_<major><minor>`` on CUDA and the ``gfx`` name on ROCm; CPU tensors (Triton's
interpreter) and meta tensors have none and always take the defaults.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

TABLE_PATH = Path(__file__).with_name("tuned_plans.json")
TABLE_FORMAT = 1
# The constants a table entry may override, per kernel. The forward launches one program per row block, its
# tile is not pipelined: block rows and warps are all it has.
TUNABLE: dict[str, tuple[str, ...]] = {
    "forward": ("block_m", "num_warps"),
    "backward": ("block_m", "num_warps", "num_stages", "programs_per_sm"),
}
# Activation element sizes the kernels load: fp16 and bf16, fp32.
ELEM_BYTES = (2, 4)
# A CUDA block holds at most 1024 threads (32 warps), and Triton takes only powers of two; an SM keeps at
# most 32 blocks resident (sm_80 and sm_90; fewer on some others, where a larger count still runs, just
# serialised).
MAX_NUM_WARPS = 32
MAX_PROGRAMS_PER_SM = 32
ARCH_NAME = re.compile(r"sm_\d+|gfx[0-9a-f]+")
ARCH_FIELDS = ("card", "date", "command", "triton", "torch")


class PlanKey(NamedTuple):
    """What a table entry is looked up by. ``arch`` is None for CPU tensors: only a table put in use by
    ``plans_in_use`` (the tuner's dry run, tests) has entries for it."""

    arch: str | None
    kernel: str
    elem_bytes: int
    width_bucket: int


class TableError(ValueError):
    """A tuned-plan table is malformed; the message names the file and the entry."""


def width_bucket(n_cols: int, max_tile_n: int) -> int:
    """The table's width key for rows of ``n_cols`` elements: the power of two the row is tiled at when it fits
    in one tile (``max_tile_n`` elements at most), or, for wider rows, which the looped kernel takes in column
    blocks with one plan whatever the width, the first power of two beyond the tile: ``2 * max_tile_n``."""
    return min(1 << max(n_cols - 1, 0).bit_length(), 2 * max_tile_n)


def _is_power_of_two(value: Any) -> bool:
    return type(value) is int and value > 0 and value & (value - 1) == 0


def _in_range(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: type(value) is int and low <= value <= high


# What each tunable constant must be: Triton takes power-of-two tiles and warp counts.
_CONSTANT_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_m": (_is_power_of_two, "a power of two"),
    "num_warps": (lambda v: _is_power_of_two(v) and v <= MAX_NUM_WARPS, f"a power of two from 1 to {MAX_NUM_WARPS}"),
    "num_stages": (lambda v: type(v) is int and v >= 1, "an integer of at least 1"),
    "programs_per_sm": (_in_range(1, MAX_PROGRAMS_PER_SM), f"an integer from 1 to {MAX_PROGRAMS_PER_SM}"),
}
_ENTRY_FIELDS = {"kernel", "elem_bytes", "width_bucket", "plan", "measured"}


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one entry, or None."""
    if not isinstance(entry, dict):
        return f"an entry must be an object, got {type(entry).__name__}"
    if unknown := sorted(set(entry) - _ENTRY_FIELDS):
        return f"unknown field(s) {', '.join(unknown)} (an entry has {', '.join(sorted(_ENTRY_FIELDS))})"
    kernel = entry.get("kernel")
    if kernel not in TUNABLE:
        return f"kernel must be one of {', '.join(TUNABLE)}, got {kernel!r}"
    if entry.get("elem_bytes") not in ELEM_BYTES:
        return f"elem_bytes must be one of {', '.join(map(str, ELEM_BYTES))}, got {entry.get('elem_bytes')!r}"
    if not _is_power_of_two(entry.get("width_bucket")):
        return f"width_bucket must be a power of two, got {entry.get('width_bucket')!r}"
    plan = entry.get("plan")
    if not isinstance(plan, dict) or not plan:
        return f"plan must be a non-empty object of {', '.join(TUNABLE[kernel])}"
    for name, value in plan.items():
        if name not in TUNABLE[kernel]:
            return f"the {kernel} has no tunable {name!r} (it has {', '.join(TUNABLE[kernel])})"
        accepts, what = _CONSTANT_RULES[name]
        if not accepts(value):
            return f"{name} must be {what}, got {value!r}"
    if not isinstance(entry.get("measured", {}), dict):
        return "measured must be an object"
    return None


def validate_table(table: Any, source: str) -> None:
    """Checks ``table`` (parsed JSON) against the format of this module's docstring.

    Raises:
        TableError: one line naming ``source``, the entry and what is wrong with it.
    """

    def fail(where: str, problem: str) -> None:
        raise TableError(f"{source}: {where}: {problem}; fix or delete it (scripts/tune_kernels.py writes a "
                         "valid table)")

    if not isinstance(table, dict) or set(table) != {"format", "architectures"}:
        fail("top level", "expected an object with exactly 'format' and 'architectures'")
    if table["format"] != TABLE_FORMAT:
        fail("format", f"this release reads format {TABLE_FORMAT}, got {table['format']!r}")
    if not isinstance(table["architectures"], dict):
        fail("architectures", "expected an object keyed by architecture")
    for arch, section in table["architectures"].items():
        where = f"architectures.{arch}"
        if not ARCH_NAME.fullmatch(arch):
            fail(where, "an architecture is named sm_<major><minor> (CUDA) or gfx<id> (ROCm)")
        if not isinstance(section, dict):
            fail(where, "expected an object")
        for name in ARCH_FIELDS:
            if not isinstance(section.get(name), str) or not section[name]:
                fail(f"{where}.{name}", "expected a non-empty string")
        if unknown := sorted(set(section) - {*ARCH_FIELDS, "swept", "entries"}):
            fail(where, f"unknown field(s) {', '.join(unknown)}")
        swept = section.get("swept", [])
        if not isinstance(swept, list) or not all(isinstance(s, str) for s in swept):
            fail(f"{where}.swept", "expected a list of 'kernel/elem_bytes/width_bucket' strings")
        entries = section.get("entries")
        if not isinstance(entries, list):
            fail(f"{where}.entries", "expected a list")
        seen = set()
        for i, entry in enumerate(entries):
            if problem := _entry_problem(entry):
                fail(f"{where}.entries[{i}]", problem)
            key = (entry["kernel"], entry["elem_bytes"], entry["width_bucket"])
            if key in seen:
                fail(f"{where}.entries[{i}]", f"a second entry for {'/'.join(map(str, key))}")
            seen.add(key)


def read_table(path: Path) -> dict:
    """The table in ``path``, validated (``validate_table``).

    Raises:
        TableError: the file is missing, not JSON, or not a valid table.
    """
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        raise TableError(f"{path}: no such file (the package ships it as package data: reinstall hf-rmsnorm, or "
                         "restore it from git)") from None
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not valid JSON ({exc}); restore it from git or rerun "
                         "scripts/tune_kernels.py") from None
    validate_table(table, str(path))
    return table


def index_table(table: dict) -> dict[PlanKey, dict[str, int]]:
    """A validated table's entries by ``PlanKey``: what the plan functions look up."""
    return {PlanKey(arch, e["kernel"], e["elem_bytes"], e["width_bucket"]): dict(e["plan"])
            for arch, section in table["architectures"].items() for e in section["entries"]}


@functools.cache
def _installed_index() -> dict[PlanKey, dict[str, int]]:
    return index_table(read_table(TABLE_PATH))


# The table put in use by ``plans_in_use`` (None: the installed one), and the caches of everything computed
# from the table in use, which must be dropped when it changes.
_index_in_use: Mapping[PlanKey, dict[str, int]] | None = None
_dependent_caches: list[Callable[[], None]] = []

Cached = TypeVar("Cached")


def reads_tuned_plans(cached: Cached) -> Cached:
    """Marks a cache whose contents depend on the table in use (a ``functools.lru_cache``d function, or any object
    with a ``cache_clear`` method), so that ``plans_in_use`` clears it when it switches tables. Returns it."""
    _dependent_caches.append(cached.cache_clear)  # type: ignore[attr-defined]
    return cached


@contextlib.contextmanager
def plans_in_use(index: Mapping[PlanKey, dict[str, int]]) -> Iterator[None]:
    """Within the block, the plan functions read ``index`` (``index_table``'s form; an empty one: the defaults
    everywhere) instead of the installed table. For the tuner, which launches each candidate plan through the
    library's own launch path, and for tests."""
    global _index_in_use
    previous = _index_in_use
    _index_in_use = index
    for clear in _dependent_caches:
        clear()
    try:
        yield
    finally:
        _index_in_use = previous
        for clear in _dependent_caches:
            clear()


Plan = TypeVar("Plan", bound=tuple)


def tuned(plan: Plan, key: PlanKey) -> Plan:
    """``plan`` (a NamedTuple with the tunable constants as fields) with the table's entry for ``key`` applied,
    or ``plan`` itself where the table in use has none."""
    index = _installed_index() if _index_in_use is None else _index_in_use
    overrides = index.get(key)
    return plan if overrides is None else plan._replace(**overrides)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int) -> str | None:
    """The architecture name tables are keyed by for GPU ``device_index`` (``torch.Tensor.get_device()``);
    None for -1 (CPU and meta tensors), and where torch sees no GPU (fake CUDA tensors traced on a host without
    one: the GPU the graph will run on is unknown). Cached: the launches call it every time."""
    if device_index < 0 or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-": the target features are not the arch
    return f"sm_{props.major}{props.minor}"
