"""What every script shares (``hf_rmsnorm.tools.cli``) and what a new user meets first: quick ``--help``,
one-line errors with their own exit statuses, suggestions for mistyped presets."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from launching import SCRIPTS

from hf_rmsnorm.tools import cli, workload
from hf_rmsnorm.tools.finetune_settings import FinetuneConfig
from hf_rmsnorm.tools.loading import ModelLoadError, load_model
from hf_rmsnorm.tools.presets import build_preset
from hf_rmsnorm.tools.verify_settings import VerifyConfig

SCRIPTS = SCRIPTS


@pytest.mark.parametrize("script", ["verify.py", "finetune.py"])
def test_help_imports_neither_torch_nor_transformers(script):
    # -X importtime lists every module imported; --help must answer before the heavy ones load.
    result = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPTS / script), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--traceback" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "transformers" not in imported


def _failing_main(argv: list[str]) -> int:
    raise IndexError("index out of range in self")


def test_an_internal_error_is_one_line_with_its_own_exit_status(capsys):
    assert cli.run("x.py", _failing_main, ["--model", "m"]) == cli.EXIT_INTERNAL == 3
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "x.py: internal error: IndexError: index out of range in self (rerun with --traceback for the traceback)"
    ]
    assert cli.run("x.py", _failing_main, ["--traceback"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "IndexError" in err


def test_bad_input_stays_exit_status_2(capsys):
    def main(argv):
        raise cli.InputError("--x: no\nsuch thing")

    assert cli.run("x.py", main, []) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "x.py: error: --x: no such thing\n"


def test_the_traceback_flag_is_accepted_and_not_a_setting():
    parser = cli.ArgumentParser(prog="x")
    parser.add_argument("--n", type=int, default=1)
    assert vars(parser.parse_args(["--traceback", "--n", "2"])) == {"n": 2}


def test_a_refused_number_says_why():
    parser = cli.ArgumentParser(prog="x")
    parser.add_argument("--max-new-tokens", type=cli.at_least(2, "decode is timed after the first token"))
    with pytest.raises(cli.InputError, match=r"at least 2 \(decode is timed after the first token\), got 1"):
        parser.parse_args(["--max-new-tokens", "1"])


@dataclass(frozen=True, kw_only=True)
class _Settings:
    rows: int = cli.option("rows per batch", type=cli.at_least(1))  # no default: None until the device is known
    out: Path = cli.option("where to write", type=Path, required=True)
    name: str = cli.option("a name", default="a", metavar="NAME")
    patch: bool = cli.option("leave the model as it is", default=True, flag=True)
    fast: bool = cli.option("go fast", default=False, flag=True)


def test_a_settings_dataclass_declares_its_options():
    parser = cli.ArgumentParser(prog="x")
    cli.add_options(parser, _Settings)
    assert vars(parser.parse_args(["--out", "o"])) == {
        "rows": None, "out": Path("o"), "name": "a", "patch": True, "fast": False}
    argv = ["--out", "o", "--rows", "3", "--name", "b", "--no-patch", "--fast"]
    assert _Settings(**vars(parser.parse_args(argv))) == _Settings(
        rows=3, out=Path("o"), name="b", patch=False, fast=True)
    with pytest.raises(cli.InputError, match="required: --out"):
        parser.parse_args([])
    with pytest.raises(cli.InputError, match="--rows: must be at least 1, got 0"):
        parser.parse_args(["--out", "o", "--rows", "0"])
    assert "--name NAME" in parser.format_help()


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script,settings,other_options", [("verify.py", VerifyConfig, {"--device"}),
                                                           ("finetune.py", FinetuneConfig, set())])
def test_help_lists_one_option_per_setting(script, settings, other_options, capsys):
    with pytest.raises(SystemExit):
        _load_script(script).parse_args(["--help"])
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    # An option's own line starts with two spaces; a wrapped help line is indented further.
    listed = {line.split()[0] for line in options.splitlines() if line.startswith("  --")}
    # A flag named --no-<name> turns off a setting that defaults to True (--no-patch).
    expected = {"--" + ("no-" if setting.default is True else "") + setting.name.replace("_", "-")
                for setting in fields(settings)}
    assert listed == expected | other_options | {"--traceback"}


@pytest.mark.parametrize("typo,preset", [("tiny_llama", "tiny-llama"), ("tiny-lama", "tiny-llama"),
                                         ("smollm2", "smollm2-135m")])
def test_a_mistyped_preset_gets_a_suggestion(typo, preset, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=f"did you mean '{preset}'"):
        load_model(typo, dtype=torch.float32, device="cpu")


def test_padding_never_uses_an_id_outside_the_vocabulary():
    # A shrunk GPT-2 config keeps bos/eos 50256, outside its 512-token table; padding with it would crash.
    model = build_preset("tiny-llama")
    model.config.pad_token_id, model.config.eos_token_id = None, 50256
    assert workload.pad_token_id(model, None) == 0
    model.config.pad_token_id = 5
    assert workload.pad_token_id(model, None) == 5
