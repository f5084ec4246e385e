"""Where the checkout's files are, and how the tests launch scripts and multi-process runs: a free port, a
subprocess run that must succeed, ``accelerate launch`` from this environment."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

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
