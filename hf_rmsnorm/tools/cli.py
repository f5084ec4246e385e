"""What the command-line scripts share: options declared on settings, device set-up, one-line errors, exit statuses.

Every script in ``scripts/`` has the same shape: parse the arguments (with ``ArgumentParser``; a script's
settings are a dataclass whose every field is declared with ``option`` and becomes an option through
``add_options``, so a setting, its default and its help are written once), set up the device
(``select_device``, before anything defines a kernel), run one function of ``hf_rmsnorm.tools`` and turn its
result into an exit status. ``run`` turns an ``InputError`` into one line on stderr and ``EXIT_BAD_INPUT``,
and any other exception (a bug, or a model the libraries below cannot run) into one line and ``EXIT_INTERNAL``,
with the traceback behind ``--traceback``.

This module imports torch only to select a device, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
DEVICES = ("auto", "cuda", "cpu")
TRACEBACK_FLAG = "--traceback"


class InputError(ValueError):
    """Something the user passed cannot be used; the message is one line that says what to do instead."""


class ArgumentParser(argparse.ArgumentParser):
    """Reports a usage error as an ``InputError`` (one line, exit status 2) instead of the usage block, and
    accepts ``--traceback``, which ``run`` reads from the command line (it is not in the parsed namespace, so
    scripts can turn the namespace into their settings as it is)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.add_help:
            self.add_argument(TRACEBACK_FLAG, action="store_true", dest="_traceback",
                              help="on an internal error, print the full traceback instead of one line")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.__dict__.pop("_traceback", None)
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        raise InputError(message)


@dataclasses.dataclass(frozen=True)
class Option:
    """How a script reads one field of its settings dataclass (``add_options``): ``--<field name with dashes>``,
    parsed by ``type``, the field's default when left out (None for a field without one: a per-device setting the
    script fills in once the device is known, or a ``required`` one). A ``flag`` takes no value and sets the
    field to the opposite of its default: ``--<name>`` when that is False, ``--no-<name>`` when it is True."""

    help: str
    type: Callable[[str], object] | None = None
    metavar: str | None = None
    required: bool = False
    flag: bool = False


def option(help: str, *, default: object = dataclasses.MISSING, **settings: Any) -> Any:
    """A settings-dataclass field that is also a command-line option: the one place the option is declared.

    ``default`` is the field's default (left out: the field has none); ``settings`` are ``Option``'s."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **settings)})


def add_options(parser: argparse.ArgumentParser, settings: type) -> None:
    """Adds to ``parser`` one option per field of the dataclass ``settings``, as its ``Option`` says, in field
    order; the parsed namespace has one attribute per field."""
    for setting in dataclasses.fields(settings):
        declared: Option = setting.metadata["option"]
        name = setting.name.replace("_", "-")
        default = None if setting.default is dataclasses.MISSING else setting.default
        if declared.flag:
            parser.add_argument(f"--no-{name}" if default else f"--{name}", dest=setting.name,
                                action="store_false" if default else "store_true", help=declared.help)
        else:
            parser.add_argument(f"--{name}", type=declared.type, default=default, metavar=declared.metavar,
                                required=declared.required, help=declared.help)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run(prog: str, main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit status.

    An ``InputError`` becomes one line on stderr and ``EXIT_BAD_INPUT``; any other exception one line naming
    it and ``EXIT_INTERNAL`` (the whole traceback with ``--traceback``). Under a multi-process launch every
    process meets the same error, and only the first prints it.
    """
    argv = sys.argv[1:] if argv is None else argv
    first = os.environ.get("RANK", "0") == "0"
    try:
        return main(argv)
    except InputError as exc:
        if first:
            print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 (the point: no traceback a user did not ask for)
        if TRACEBACK_FLAG in argv:
            traceback.print_exc()
        elif first:
            print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]} "
                  f"(rerun with {TRACEBACK_FLAG} for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def select_device(requested: str = "auto") -> torch.device:
    """The device a run uses (``auto``: the GPU when there is one), with the kernels set up for it: compiled on
    a GPU, in Triton's interpreter on the CPU (``hf_rmsnorm.ops.backend.configure``)."""
    import torch

    from ..ops import backend

    if requested == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    device = torch.device("cuda" if requested != "cpu" and torch.cuda.is_available() else "cpu")
    backend.configure(device)
    return device


def at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``; ``why`` (a clause) is added to the refusal."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{reason}, got {value}")
        return value

    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    """An option type that takes one of ``choices`` (argparse names them in its one-line error otherwise)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(choices)}")
        return text

    parse.__name__ = "choice"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a float above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
