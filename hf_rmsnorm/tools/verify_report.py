"""The report of a ``verify`` run as typed records, and its JSON form (``scripts/verify.py --json``).

``verify.run`` returns a ``VerifyReport`` (an ``EncoderVerifyReport`` for an encoder, told apart by its
``kind``), ``verify.render`` prints one, ``to_dict`` writes the JSON document and ``from_dict`` reads one back
(the GPU suite's summary reads its ``verify.py`` runs so); both come from ``records.Record``. Each record's
field names are the document's keys, so the document's shape is written once: here.

The records hold plain data and import no torch, so the GPU suite's report (which runs without torch) reads
them too; the modules that compute the figures (``parity``, ``norm_outputs``, ``speed``, ``verify_encoder``)
fill them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .records import Record


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
    fused_qk: int  # attention modules whose q/k norms and RoPE run as one launch (``PatchReport.fused_qk``)
    qk_apart: int  # attention modules whose q/k norms and RoPE stay apart; in ``skipped_modules``, with the reason
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
    rounds: int  # the timed rounds the medians are of
    # True in the JSON written after each round while the states are still being timed (``scripts/verify.py
    # --json``): a run stopped then leaves the figures of the rounds it finished, marked so.
    partial: bool


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


@dataclass
class EncoderSettings(Record):
    """What an encoder's run computed on (``verify_encoder``)."""

    parity_batch_size: int
    parity_tokens: int  # the padded width of the parity batch (rows are right-padded to it)
    speed_batch_size: int
    speed_tokens: int
    repeats: int | None  # None: nothing was timed (no GPU)
    seed: int


@dataclass
class EncoderParity(Record):
    """The unpatched and the patched encoder against the reference, and against each other."""

    DERIVED: ClassVar[tuple[str, ...]] = ("passed",)

    dtype: str
    reference_dtype: str
    positions: int  # real tokens in the parity batch
    # Last hidden state, every real token.
    unpatched_hidden_max_err: float
    unpatched_hidden_mean_err: float
    patched_hidden_max_err: float
    patched_hidden_mean_err: float
    hidden_max_abs_diff: float  # patched against unpatched
    hidden_equal_fraction: float
    # Sentence embeddings (mean-pooled, L2-normalised).
    unpatched_embedding_mean_err: float
    patched_embedding_mean_err: float
    unpatched_min_cosine: float  # the lowest cosine similarity of a row's embedding with the reference's
    patched_min_cosine: float
    hidden_ok: bool
    embeddings_ok: bool

    @property
    def passed(self) -> bool:
        """The verdict: both rules hold."""
        return self.hidden_ok and self.embeddings_ok


@dataclass
class EncoderSpeed(Record):
    """Tokens per second of the embedding workload in each timed state."""

    unpatched_tokens_per_s: float
    patched_tokens_per_s: float
    norm_free_tokens_per_s: float
    speedup: float
    norm_free_speedup: float
    gain_share: float | None  # of the norm-free model's gain (``norm_free.gain_share``)
    norm_free_note: str
    rounds: int
    partial: bool  # True in the JSON written after each round while rounds remain


@dataclass
class EncoderVerifyReport(Record):
    """Everything a ``verify`` run on an encoder found; ``kind`` tells it from the decoders' report."""

    kind: str  # "encoder"
    passed: bool
    failure: str | None
    model: str
    model_class: str
    weights: str
    parameters: int
    dtype: str
    settings: EncoderSettings
    environment: Environment
    patch: PatchSummary
    parity: EncoderParity
    norm_outputs: NormOutputAgreement
    rule: str
    speed: EncoderSpeed | None  # None off a GPU
