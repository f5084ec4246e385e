"""Typed records of the JSON documents the tools write: ``verify``'s report (``verify_report.py``) and
``finetune``'s metrics (``finetune_metrics.py``).

A record is a dataclass whose field names are the document's keys, so each document's shape is written once, in
its record; ``to_dict`` writes the document and ``from_dict`` reads one back, nested records and all. Plain data
and no torch: the GPU suite's summary, which runs without torch, reads the documents through them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

R = TypeVar("R", bound="Record")


class Record:
    """A dataclass whose JSON form is its fields (nested records as dicts, tuples as lists) followed by the
    properties named in ``DERIVED``, verdicts computed from the fields, written for the document's readers and
    recomputed, not read, by ``from_dict``."""

    DERIVED: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict of the record."""
        return {**{f.name: _json_value(getattr(self, f.name)) for f in fields(self)},
                **{name: getattr(self, name) for name in self.DERIVED}}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record ``to_dict`` wrote (or the JSON parsed from it), with its nested records and tuples rebuilt.

        Raises:
            KeyError: ``data`` lacks one of the record's fields (it is not a document this version wrote).
        """
        hints = get_type_hints(cls)
        return cls(**{f.name: _read(hints[f.name], data[f.name]) for f in fields(cls)})


def _json_value(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return value


def _read(hint: Any, value: Any) -> Any:
    """``value``, a JSON value, as the type ``hint`` of the field it fills."""
    if value is None:
        return None
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # X | None: None is handled above
        (inner,) = (arg for arg in args if arg is not type(None))
        return _read(inner, value)
    if origin is list:
        return [_read(args[0], item) for item in value]
    if origin is tuple:
        return tuple(_read(arg, item) for arg, item in zip(args, value))
    return value
