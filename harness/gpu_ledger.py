"""What GPU runs still owe and what they cost: the two data files the suite reads and writes back.

* ``gpu_pending.json``: the changes built since the last recorded GPU run that await a GPU measurement, each with
  the suite sections that measure it. A run's summary lists those whose sections did not all complete
  (``still_pending``), and the suite writes the list less what it measured into its output folder, ready to copy
  over this one once the run is recorded in BENCHMARKS.md.
* ``gpu_section_costs.json``: each section's time on an H100, measured where a GPU run recorded it, estimated
  (with how) until one does. The plans are sized from it (``plan_seconds``; tests/harness/test_gpu_suite.py
  holds every plan to one lease), and the suite writes it back with the times it measured (``measured_costs``).

Plain JSON and no torch: the suite's summary runs without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PENDING_PATH = HERE / "gpu_pending.json"
COSTS_PATH = HERE / "gpu_section_costs.json"
# The costs' key for the suite's offline install of the carried wheels, which runs before any plan's sections.
WHEELS = "wheels"


@dataclass(frozen=True)
class PendingChange:
    """A change awaiting a GPU measurement, and the suite sections that measure it (all of them must complete)."""

    change: str
    sections: tuple[str, ...]


def read_pending(path: Path = PENDING_PATH) -> list[PendingChange]:
    """The changes of ``path`` (``{"changes": [{"change": ..., "sections": [...]}, ...]}``)."""
    return [PendingChange(entry["change"], tuple(entry["sections"]))
            for entry in json.loads(path.read_text())["changes"]]


def pending_document(changes: Iterable[PendingChange]) -> dict:
    """``changes`` as the document ``read_pending`` reads."""
    return {"changes": [{"change": c.change, "sections": list(c.sections)} for c in changes]}


def still_pending(changes: Iterable[PendingChange], completed: set[str]) -> list[PendingChange]:
    """The changes not measured by a run whose ``completed`` sections are those named: a change is measured when
    every section that measures it completed."""
    return [c for c in changes if not set(c.sections) <= completed]


def read_costs(path: Path = COSTS_PATH) -> dict:
    """The section-costs document: ``{"card": ..., "sections": {name: {"seconds": s, "source": how}}}``."""
    return json.loads(path.read_text())


def plan_seconds(costs: Mapping, sections: Iterable[str]) -> float:
    """The time a run of ``sections`` takes on the costs' card: the wheels' install, then each section's."""
    return sum(costs["sections"][name]["seconds"] for name in (WHEELS, *sections))


def measured_costs(costs: Mapping, times: Mapping[str, tuple[str, float, float]], card: str, date: str) -> dict:
    """``costs`` with what one GPU run measured: ``times`` maps a section (or ``WHEELS``) to its ``(status,
    seconds, limit)``. A section that completed takes its time; one stopped at its limit takes the limit, as a
    lower bound (it needs at least that much); any other (failed, not run) keeps its entry."""
    sections = dict(costs["sections"])
    for name, (status, seconds, limit) in times.items():
        if status == "ok":
            sections[name] = {"seconds": round(seconds, 1), "source": f"measured on {card}, {date}"}
        elif status.startswith("timed out"):
            bound = max(limit, sections.get(name, {}).get("seconds", 0))
            sections[name] = {"seconds": round(bound, 1),
                              "source": f"timed out at {limit:.0f} s on {card}, {date}: at least that"}
    return {**costs, "sections": sections}
