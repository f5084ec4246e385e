"""The casting modes of the norm kernels, as data: one row per family of Hugging Face norm ``forward`` bodies.

A mode says in which order a norm rounds and which dtype it returns; the Triton kernels, their launcher and the
PyTorch reference all read this table, so a mode is described here and nowhere else. The maths of every mode
(``x`` the norm's input, ``w`` the weight, ``b`` an optional bias, all reductions in fp32)::

    n = s * rsqrt(mean(s^2) + eps),   s = x.float()            (s = x.float() - mean(x.float()) if centre)
    llama:        y = w * n.to(x.dtype)  (+ b)                 output dtype: torch promotion of x, w (and b)
    gemma:        y = (n * (1 + w.float())).to(x.dtype)         output dtype: x.dtype
    fp32_affine:  y = (n * w.float() (+ b.float())).to(x.dtype) output dtype: x.dtype
    t5:           y = w * n.to(w.dtype)  (+ b)                 output dtype: w.dtype for an fp16/bf16 weight
                  (an fp32 weight: no cast, y = w * n in fp32)   (fp32 for an fp32 weight, fp64 for an fp64 input)
    layernorm:    fp32_affine with centre (exactly nn.LayerNorm)
    layernorm_fp32:  layernorm in fp32 whatever the input, as a model's own LayerNorm class spells it out
                  (Cohere's: x.float(), mean, variance, (x - mean) * rsqrt(var + eps), w.float() * n)
    layernorm_as_rmsnorm:  layernorm without the mean (a LayerNorm converted to RMSNorm)
    deberta:      d = x.float() - mean(x.float()),  n = d / sqrt(mean(d^2) + eps),  y = w * n.to(x.dtype) + b
                  (llama's order, centred, and divided by the standard deviation rather than multiplied by its
                  reciprocal: DeBERTa's DebertaLayerNorm)           output dtype: as llama
    without a weight (every mode): y = n.to(x.dtype) (+ b, rounded as the mode rounds it)

The ``nn.LayerNorm`` modes (``layernorm``, ``layernorm_as_rmsnorm``) normalise an fp64 input in fp64, as
``nn.LayerNorm`` does; the others in fp32, as Hugging Face's bodies (``x.float()``) do. Only the PyTorch reference
sees fp64: the kernels load fp32 at most. (T5's body is the one exception on the way: its variance is fp32 but
``x * rsqrt(var + eps)`` multiplies in the input's dtype promoted with fp32, fp64 for an fp64 input; the
reference does the same.)

``docs/numerics.md`` explains which models use which mode and why the order of the roundings matters.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .host_cache import host_cache

# The statistics a forward saves for its backward are one flat tensor: STATS_SYNC_SLOTS int32 counters (in the
# fp32 tensor's first elements, zero bits being zero in both), then ``rstd`` of every row, then, when centring, the
# row means. The forward kernel zeroes the counters; the backward kernel's programs count on them to agree on when
# every partial weight gradient is written and who sums it (kernels.py, ``sum_partials_once_written``), and its
# last program zeroes them again, so that the tensor a forward returns is the tensor every backward finds. Four
# int32 counters are 16 bytes: the values after them keep the tensor's 16-byte alignment. The PyTorch
# implementation saves the same layout, its counters zero.
STATS_SYNC_SLOTS = 4

# The dtypes a T5-style norm rounds its normalised row to when its weight has one of them.
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Mode:
    """One casting order.

    Attributes:
        name: what callers pass as ``mode=``.
        cast_before_weight: the normalised row is rounded to the input dtype before the weight multiplies it
            (Llama), instead of the product being rounded once at the end in fp32 (Gemma, OLMo2, LayerNorm).
        weight_offset: added to the weight in fp32 before it scales the row (Gemma's ``1 + w``).
        centre: the row mean is subtracted first (LayerNorm); the mean is then saved for the backward too.
        promotes_output: the output dtype follows torch's promotion of the input, weight and bias dtypes
            (Llama's ``weight * n`` with an fp32 weight returns fp32); otherwise it is the input dtype.
        keeps_fp64: an fp64 input is normalised in fp64 (``nn.LayerNorm``), not in fp32.
        divides_by_std: the centred row is divided by ``sqrt(var + eps)`` rather than multiplied by
            ``rsqrt(var + eps)`` (the two round differently in fp32), and its statistics are those the body spells
            out: ``mean = sum / width``, ``var = mean((x - mean)^2)``, without the corrected two-pass mean of the
            other centring modes (DeBERTa's ``DebertaLayerNorm``). Forward only: the backward's maths is the same
            function, with ``rstd = rsqrt(var + eps)``.
        rounds_to_weight_dtype: with ``cast_before_weight``, the normalised row is rounded to the *weight's* dtype
            when that is fp16 or bf16, and left unrounded for an fp32 weight (T5's ``T5LayerNorm``: ``if
            self.weight.dtype in [torch.float16, torch.bfloat16]: h = h.to(self.weight.dtype)``), instead of
            to the input's dtype (Llama). The output is then the weight's dtype (an fp16/bf16 weight) or the
            input's promoted with fp32 and the weight's: an fp32 weight returns fp32 for a bf16 input.
    """

    name: str
    cast_before_weight: bool = False
    weight_offset: float = 0.0
    centre: bool = False
    promotes_output: bool = False
    keeps_fp64: bool = False
    rounds_to_weight_dtype: bool = False
    divides_by_std: bool = False

    def __post_init__(self) -> None:
        # The kernels add the offset in fp32 and the rounded-row path multiplies in the promoted dtype: no Hugging
        # Face body combines the two, and the kernels do not either.
        if self.cast_before_weight and self.weight_offset:
            raise ValueError(f"mode {self.name!r}: a weight offset needs the product in fp32")
        if self.rounds_to_weight_dtype and not self.cast_before_weight:
            raise ValueError(f"mode {self.name!r}: rounding to the weight's dtype is a cast before the weight")
        if self.divides_by_std and not self.centre:
            raise ValueError(f"mode {self.name!r}: the division by the standard deviation is a centring mode's")

    @functools.cached_property
    def is_torch_layer_norm(self) -> bool:
        """Whether the mode is ``torch.nn.functional.layer_norm``'s maths (``nn.LayerNorm``): the row centred,
        multiplied by rstd and the affine product in fp32 (fp64 for fp64), no offset, rounded once at the end."""
        return (self.centre and self.keeps_fp64 and not self.cast_before_weight and not self.weight_offset
                and not self.divides_by_std)

    @functools.cached_property
    def kernel_flags(self) -> dict[str, object]:
        """The constexpr arguments of the Triton kernels that select this mode (built once: launches are
        host-bound at decode sizes), those of the backward kernels: the forward's are ``forward_kernel_flags``."""
        return {"CAST_BEFORE_WEIGHT": self.cast_before_weight, "CAST_TO_WEIGHT": self.rounds_to_weight_dtype,
                "WEIGHT_OFFSET": self.weight_offset, "CENTER": self.centre}

    @functools.cached_property
    def forward_kernel_flags(self) -> dict[str, object]:
        """``kernel_flags`` and the forward kernel's own (``divides_by_std``: the backward differentiates the same
        function whichever way the forward rounded its division)."""
        return {**self.kernel_flags, "DIVIDE_BY_STD": self.divides_by_std}

    def output_dtype(
        self, norm_dtype: torch.dtype, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.dtype:
        """The dtype Hugging Face's module returns for an input of ``norm_dtype``."""
        return self.output_dtype_of(norm_dtype, dtype_of(weight), dtype_of(bias))

    # Cached: torch.promote_types is an aten op, dispatched on every call (host time at decode sizes).
    @host_cache
    def output_dtype_of(
        self, norm_dtype: torch.dtype, weight_dtype: torch.dtype | None, bias_dtype: torch.dtype | None
    ) -> torch.dtype:
        """``output_dtype`` from the dtypes of the weight and the bias (None: absent)."""
        if self.rounds_to_weight_dtype and weight_dtype is not None:
            dtype = torch.promote_types(weight_dtype, self.rounded_dtype_of(norm_dtype, weight_dtype))
            return dtype if bias_dtype is None else torch.promote_types(dtype, bias_dtype)
        if not self.promotes_output:
            return norm_dtype
        dtype = norm_dtype if weight_dtype is None else torch.promote_types(weight_dtype, norm_dtype)
        return dtype if bias_dtype is None else torch.promote_types(dtype, bias_dtype)

    def rounded_dtype_of(self, norm_dtype: torch.dtype, weight_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype the normalised row has when the weight multiplies it, in a ``cast_before_weight`` mode: the
        input's (Llama), or with ``rounds_to_weight_dtype`` an fp16/bf16 weight's, else the input's promoted with
        fp32 (T5's ``x * rsqrt(...)``, which is not rounded for an fp32 weight)."""
        if not self.rounds_to_weight_dtype:
            return norm_dtype
        if weight_dtype in HALF_DTYPES:
            return weight_dtype
        return torch.promote_types(norm_dtype, torch.float32)

    def compute_dtype(self, norm_dtype: torch.dtype) -> torch.dtype:
        """The dtype the row is normalised in, which is also the dtype of the saved statistics."""
        return torch.float64 if self.keeps_fp64 and norm_dtype == torch.float64 else torch.float32

    def stats_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """Shape of the statistics a forward of an input of ``shape`` saves for the backward (the layout of
        ``STATS_SYNC_SLOTS``): one dimension, the counters, ``rstd`` per row, the means too when centring."""
        return ((2 if self.centre else 1) * math.prod(shape[:-1]) + STATS_SYNC_SLOTS,)

    def pack_stats(self, rstd: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        """The statistics of rows with these ``rstd`` and means (None unless centring), counters zero."""
        values = (rstd, mean) if self.centre else (rstd,)
        return torch.cat([rstd.new_zeros(STATS_SYNC_SLOTS), *(v.reshape(-1) for v in values)])

    def unpack_stats(self, stats: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rstd, mean)`` of an input of ``shape``, each of shape ``shape[:-1]`` (mean None unless centring),
        from its statistics."""
        values = stats[STATS_SYNC_SLOTS:]
        rows = math.prod(shape[:-1])
        rstd = values[:rows].view(shape[:-1])
        return rstd, values[rows:2 * rows].view(shape[:-1]) if self.centre else None


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("llama", cast_before_weight=True, promotes_output=True),
        Mode("gemma", weight_offset=1.0),
        Mode("fp32_affine"),
        # Before ``layernorm``: recognition takes the first mode that reproduces a class bit for bit, and
        # layernorm_fp32 is reproduced step by step only, layernorm also as torch's kernel rounds it (a class
        # calling F.layer_norm: OLMo's); their fp32 probes tell the two apart.
        Mode("layernorm_fp32", centre=True),
        Mode("layernorm", centre=True, keeps_fp64=True),
        Mode("layernorm_as_rmsnorm", keeps_fp64=True),
        Mode("t5", cast_before_weight=True, rounds_to_weight_dtype=True),
        Mode("deberta", cast_before_weight=True, centre=True, promotes_output=True, divides_by_std=True),
    )
}


def get_mode(name: str) -> Mode:
    """The mode called ``name``; a ``ValueError`` naming the valid ones otherwise."""
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"unknown mode {name!r}: use one of {', '.join(MODES)}")
    return mode


def sum_dtype(x_dtype: torch.dtype, residual_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of the norm's input: ``residual + x`` as torch promotes it, or ``x``'s (no residual: None)."""
    return x_dtype if residual_dtype is None else torch.promote_types(x_dtype, residual_dtype)


def dtype_of(t: torch.Tensor | None) -> torch.dtype | None:
    """``t``'s dtype, None for an absent optional tensor (keys of the per-dtype caches)."""
    return None if t is None else t.dtype
