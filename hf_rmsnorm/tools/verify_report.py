"""The report of a ``verify`` run as typed records, and its JSON form (``scripts/verify.py --json``).

``verify.run`` returns a ``VerifyReport``, ``verify.render`` prints one, ``to_dict`` writes the JSON document
and ``from_dict`` reads one back (the GPU suite's summary reads its ``verify.py`` runs so). Each record's field
names are the document's keys, so the document's shape is written once: here.

The records hold plain data and import no torch, so the GPU suite's report (which runs without torch) reads
them too; the modules that compute the figures (``parity``, ``norm_outputs``, ``speed``) fill them in.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

R = TypeVar("R", bound="Record")


class Record:
    """A part of the report: a dataclass whose JSON form is its fields (nested records as dicts, tuples as
    lists) followed by the properties named in ``DERIVED``, verdicts computed from the fields, written for the
    document's readers and recomputed, not read, by ``from_dict``."""

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


@dataclass
class WorkloadSettings(Record):
    """What the run computed on: the ``VerifyConfig`` settings after the device's defaults, and what they made."""

    batch_size: int
    parity_batch_size: int  # at least 2 rows, so one of them is left-padded
    parity_prompts: str  # "chat" (the tokenizer's chat template) or "passage" (rows cut from a fixed text)
    parity_prompt_len: int  # the padded width of the parity batch
    prompt_len: int
    max_new_tokens: int
    repeats: int | None  # None: nothing was timed (no GPU)
    seed: int
    compile: str | None  # torch.compile's mode of compiled generation, None when generation ran eagerly


@dataclass
class Environment(Record):
    """The versions and the device the run used."""

    hf_rmsnorm: str
    torch: str
    transformers: str
    triton: str
    python: str
    device: str
    device_name: str
    triton_interpreter: bool
    kernels: str  # what ran the norms (``hf_rmsnorm.ops.backend.describe``)


@dataclass
class PatchSummary(Record):
    """What ``patch_model`` changed, counted (its ``PatchReport`` names every module)."""

    norms: int
    fused_adds: int
    skipped: int
    skipped_modules: list[tuple[str, str]]  # (qualified name, reason)
    families: list[str]


@dataclass
class Divergence(Record):
    """Where one row's greedy tokens first differ, and how close the choice was (rule 3 of ``parity.py``)."""

    DERIVED: ClassVar[tuple[str, ...]] = ("near_tie",)

    row: int
    step: int
    unpatched_token: int
    patched_token: int
    # Each model's logit for its own token minus its logit for the other model's token.
    unpatched_gap: float
    patched_gap: float
    noise: float

    @property
    def near_tie(self) -> bool:
        """Whether the eager model itself barely preferred its token: a legitimate flip."""
        return self.unpatched_gap <= self.noise


@dataclass
class ParityReport(Record):
    """Parity figures of a patched model against the eager model and the reference (``parity.compare``; the
    rules: ``parity.py``'s docstring)."""

    DERIVED: ClassVar[tuple[str, ...]] = ("passed",)

    dtype: str
    reference_dtype: str
    positions: int
    # Patched against eager.
    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float
    kl_mean: float
    kl_max: float
    # Both against the reference.
    unpatched_max_err: float
    unpatched_mean_err: float
    patched_max_err: float
    patched_mean_err: float
    # Rule 2: positions where the reference is decisive, and top-1 misses there.
    decisive_positions: int
    unpatched_top1_misses: int
    patched_top1_misses: int
    # Fraction of logits bitwise equal, patched against eager.
    logits_equal_fraction: float
    # Greedy generation, patched against eager (rule 3).
    new_tokens: int
    greedy_match: bool
    greedy_first_divergence: int | None
    divergences: list[Divergence]
    # Verdict.
    accuracy_ok: bool
    top1_ok: bool
    greedy_ok: bool

    @property
    def passed(self) -> bool:
        """The verdict: all three rules hold."""
        return self.accuracy_ok and self.top1_ok and self.greedy_ok


@dataclass
class NormOutputAgreement(Record):
    """Patched norms against the unpatched ones, on the same recorded inputs (``norm_outputs.py``)."""

    norm_calls: int
    elements: int
    differing: int
    max_ulp: int


@dataclass
class GeneratedText(Record):
    """One chat prompt and what each model answered to it (greedy, up to end-of-sequence)."""

    prompt: str
    unpatched: str
    patched: str


@dataclass
class SpeedFigures(Record):
    """Throughput of one model on one workload (``speed.measure_states``)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int


@dataclass
class Speedups(Record):
    """One state's throughput over the unpatched model's (above 1: faster)."""

    prefill_speedup: float
    decode_speedup: float


@dataclass
class SpeedReport(Record):
    """The timed states' figures, the patched model's speedups, and the share of the norm-free model's gain
    that the patch delivers (None where the norm-free model was not faster: ``norm_free.gain_share``)."""

    unpatched: SpeedFigures
    patched: SpeedFigures
    norm_free: SpeedFigures
    prefill_speedup: float
    decode_speedup: float
    norm_free_speedups: Speedups
    prefill_gain_share: float | None
    decode_gain_share: float | None
    norm_free_note: str  # what the norm-free model is (``norm_free.ORACLE_NOTE``)


@dataclass
class VerifyReport(Record):
    """Everything a ``verify`` run found: what it ran, the patch, parity and, on a GPU, speed."""

    passed: bool  # parity's verdict, and something was patched
    failure: str | None  # why the run failed apart from parity's rules
    model: str
    model_class: str
    weights: str  # where the weights came from (``loading.weights_source``)
    parameters: int
    dtype: str
    settings: WorkloadSettings
    environment: Environment
    patch: PatchSummary
    parity: ParityReport
    norm_outputs: NormOutputAgreement
    generations: list[GeneratedText] | None  # None for a model without a tokenizer
    rule: str  # the verdict's rule in words (``verify_settings.VERDICT_RULE``)
    speed: SpeedReport | None  # None off a GPU
