"""Where the checkout's files are, and how the tests launch scripts and multi-process runs: a free port, a
subprocess run that must succeed, ``accelerate launch`` from this environment, and a launch's outputs made once in a
test session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
# The tests' shared modules and the scripts the multi-process tests launch (tp_run.py, trainer_run.py, ...).
TESTS = ROOT / "tests"
LAUNCH_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port free on this host now, for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_checked(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``cmd`` offline, asserting it succeeds (the message holds the end of its output)."""
    # PYTHONFAULTHANDLER: a worker killed by a signal (a C++ abort in a collective) prints every thread's Python
    # stack, so the failure names the line it happened on.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    return proc


def accelerate_launch() -> list[str]:
    """``accelerate launch`` from this interpreter's environment, with the defaults it would warn about set."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    return [accelerate, "launch", "--num_machines", "1", "--dynamo_backend", "no"]


def accelerate_ddp(mixed_precision: str = "no") -> list[str]:
    """``accelerate launch`` of 2 processes on this host (DDP, or FSDP2 with finetune.py's --fsdp)."""
    return [
        *accelerate_launch(), "--multi_gpu", "--num_processes", "2", "--mixed_precision", mixed_precision,
        "--main_process_port", str(free_port()),
    ]


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, fill: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``fill`` writes once in this test session: the first pytest-xdist worker to ask
    fills it, the others wait for it and read what it holds. A module-scoped fixture is set up again by every
    worker its tests are spread over, and by one worker whenever it comes back to the module after another module's
    tests: for a training launch, tens of seconds each time. A ``fill`` that fails leaves the next asker to try again.
    """
    base = tmp_path_factory.getbasetemp()
    # Each xdist worker has its own basetemp in the session's; without xdist the session's is basetemp itself.
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    filled = folder / ".filled"
    with FileLock(f"{folder}.lock"):
        if not filled.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            fill(folder)
            filled.touch()
    return folder
