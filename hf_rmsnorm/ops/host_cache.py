"""``host_cache``: ``functools.cache`` for the pure host-side functions a norm call runs (dtype rules, tiles),
which saves their work on every eager call (decode calls are bound by host time) and stays out of torch.compile's
way: Dynamo traces through a cache wrapper with a warning to the user that silent incorrectness is a potential
risk (torch 2.11 to 2.13), and through the function itself without one, to the same constants."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def host_cache(function: Callable[..., Result]) -> Callable[..., Result]:
    """``function`` (pure, of hashable arguments) cached for eager calls, called itself while torch.compile
    traces."""
    cached = functools.cache(function)

    @functools.wraps(function)
    def call(*args):
        if torch.compiler.is_compiling():
            return function(*args)
        return cached(*args)

    return call
