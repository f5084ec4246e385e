"""The wheels a GPU run carries: whatever the suite's commands need that the bare GPU image may lack.

The lent GPU machine starts bare and reaches no network. What it is known to ship is ``IMAGE_PACKAGES`` (with
their own dependencies): Python 3.12, torch 2.11, Triton 3.6, transformers 5.17, accelerate, peft and matplotlib.
Everything else the suite runs travels with the checkout as wheels, pinned in ``WHEELS`` (one version each):

* ``prepare`` (``scripts/prepare_gpu.py``, on the CPU machine) downloads them for CPython 3.12 on manylinux
  x86_64 into ``WHEEL_DIR``, a git-ignored folder of the checkout that the device call carries;
* ``install_argv`` is the offline install the suite runs on the GPU machine first (``--wheels``): ``pip
  --no-index --no-deps --target`` into a folder of its own that the sections find on ``PYTHONPATH``, so the
  image's own packages stay as they are.

pytest and its plugins were seen in the image once, but at versions nobody pinned, so the suite carries its own
and loads only the plugins it names (``gpu_suite.TEST_PLUGINS``). tests/harness/test_gpu_wheels.py checks that
the wheels cover every module the sections' commands import and every plugin they name.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".gpu-wheels"
# What the GPU image is known to ship, as distribution names; their dependencies come with them.
IMAGE_PACKAGES = ("torch", "triton", "transformers", "accelerate", "peft", "matplotlib")
# The GPU image's interpreter and machine, as pip download names them. pip matches a manylinux tag exactly,
# so every glibc level a wheel may be tagged with is listed (the image's glibc is newer than all of them).
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


@dataclass(frozen=True)
class Wheel:
    """One carried distribution: its pinned version, the modules it provides and why the suite needs it."""

    name: str
    version: str
    modules: tuple[str, ...]
    why: str


# Versions: Liger-Kernel 0.8.5 ran on the GPU image (torch 2.11, Triton 3.6) in the H100 run of 2026-11-26; pytest
# and its plugins are the releases CI runs the suite's dry run with.
WHEELS = (
    Wheel("liger-kernel", "0.8.5", ("liger_kernel",), "the Liger baseline of the kernels-* sections"),
    Wheel("pytest", "9.2.0", ("pytest", "_pytest"), "the tests section"),
    Wheel("pluggy", "1.7.0", ("pluggy",), "pytest's plugin system"),
    Wheel("iniconfig", "2.3.1", ("iniconfig",), "pytest's ini files"),
    Wheel("pygments", "2.21.0", ("pygments",), "pytest's tracebacks"),
    Wheel("pytest-xdist", "3.8.0", ("xdist",), "the tests section's -n"),
    Wheel("execnet", "2.1.2", ("execnet",), "pytest-xdist's workers"),
    Wheel("pytest-timeout", "2.4.0", ("pytest_timeout",), "the tests section's --timeout"),
)


def normalized(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of -_. become _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_key(path: Path) -> tuple[str, str]:
    """``(normalized name, version)`` of a wheel file (``name-version-...whl``)."""
    name, version = path.name.split("-")[:2]
    return normalized(name), version


def download_argv(wheel: Wheel, dest: Path, python: str = sys.executable) -> list[str]:
    """The ``pip download`` of ``wheel`` alone, built for the GPU image's interpreter and machine, into ``dest``."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", str(dest), f"{wheel.name}=={wheel.version}"]


def install_argv(wheel_dir: Path, target: Path, python: str = sys.executable) -> list[str]:
    """The offline install of every wheel in ``wheel_dir`` into ``target`` (not into the interpreter's own
    packages); ``target`` then goes on ``PYTHONPATH``. Absolute paths: it runs from any folder."""
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(target.resolve()), *map(str, sorted(wheel_dir.resolve().glob("*.whl")))]


class PrepareError(RuntimeError):
    """A wheel could not be fetched; the message is one line naming it and what to do."""


def prepare(dest: Path = WHEEL_DIR, run: Callable[..., subprocess.CompletedProcess] | None = None) -> list[str]:
    """Makes ``dest`` hold exactly the wheels of ``WHEELS``: downloads the missing ones and removes any other
    wheel (another version of a pinned one, or one no longer pinned: pip refuses two versions of one
    distribution). Idempotent: a complete folder is left as it is. Returns what it did, a line per wheel.

    ``run`` runs pip (``subprocess.run`` unless given).

    Raises:
        PrepareError: pip could not download a wheel (no registry, or no build for the GPU image).
    """
    run = run or subprocess.run
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {(normalized(w.name), w.version): w for w in WHEELS}
    lines = []
    for path in sorted(dest.glob("*.whl")):
        if wheel_key(path) not in wanted:
            path.unlink()
            lines.append(f"removed {path.name} (not pinned in harness/gpu_wheels.py)")
    present = {wheel_key(path) for path in dest.glob("*.whl")}
    for key, wheel in wanted.items():
        if key in present:
            lines.append(f"kept {wheel.name} {wheel.version}")
            continue
        result = run(download_argv(wheel, dest), capture_output=True, text=True)
        if result.returncode != 0:
            said = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise PrepareError(f"could not download {wheel.name}=={wheel.version} for CPython {PYTHON_VERSION} on "
                               f"manylinux x86_64 (pip: {said}); check that the package registry is reachable, or "
                               "pin a version that has such a wheel in harness/gpu_wheels.py")
        lines.append(f"downloaded {wheel.name} {wheel.version}")
    return lines
