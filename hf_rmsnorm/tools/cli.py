"""What the command-line scripts share: the device and kernel set-up, one-line errors and exit statuses.

Every script in ``scripts/`` has the same shape: parse the arguments (with ``ArgumentParser``), set up the
device (``select_device``, before anything defines a kernel), run one function of ``hf_rmsnorm.tools`` and turn
its result into an exit status; ``run`` turns an ``InputError`` into one line on stderr and ``EXIT_BAD_INPUT``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from ..ops import backend

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEVICES = ("auto", "cuda", "cpu")


class InputError(ValueError):
    """Something the user passed cannot be used; the message is one line that says what to do instead."""


class ArgumentParser(argparse.ArgumentParser):
    """Reports a usage error as an ``InputError`` (one line, exit status 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        raise InputError(message)


def run(prog: str, main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit status; an ``InputError`` becomes one line on stderr and ``EXIT_BAD_INPUT``.

    Under a multi-process launch every process meets the same error, and only the first prints it.
    """
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except InputError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


def requested_device(argv: list[str]) -> str:
    """The ``--device`` of ``argv`` alone (default ``auto``), read before the full command line so that the
    kernels can be set up before the modules that define them are imported."""
    parser = ArgumentParser(add_help=False)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    return parser.parse_known_args(argv)[0].device


def select_device(requested: str = "auto") -> torch.device:
    """The device a run uses (``auto``: the GPU when there is one), with the kernels set up for it: compiled on
    a GPU, in Triton's interpreter on the CPU (``hf_rmsnorm.ops.backend.configure``)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    device = torch.device("cuda" if requested != "cpu" and torch.cuda.is_available() else "cpu")
    backend.configure(device)
    return device


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

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
