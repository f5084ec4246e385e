"""Pure-PyTorch RMSNorm with exactly the semantics of the Triton kernels.

This is the implementation that runs on CPU tensors when Triton's interpreter is off, and it documents the
numerics the kernels follow. Tests never use it as their only oracle: they compare the kernels against fp64
maths and against Hugging Face's own modules as well.

Casting modes (see REFERENCE.md section 1):

* ``"llama"`` (Llama, Mistral, Qwen2/3, Phi3, Granite): the norm is computed in fp32, cast to the input dtype,
  then multiplied by the weight with torch type promotion (bf16 input + fp32 weight gives fp32).
* ``"gemma"``: ``n * (1 + w.float())`` in fp32, then cast to the input dtype.
* ``"fp32_affine"`` (OLMo2, LayerNorm converted to RMSNorm): ``n * w.float() (+ b.float())`` in fp32, then cast
  to the input dtype.
* ``"layernorm"``: ``fp32_affine`` after subtracting the row mean, i.e. ``nn.LayerNorm``.

The forward also returns per-row statistics for the backward: ``rstd`` (fp32, shape ``x.shape[:-1]``), and in
``"layernorm"`` mode ``stack([rstd, mean])``.
"""

from __future__ import annotations

import torch

MODES = ("llama", "gemma", "fp32_affine", "layernorm")


def weight_offset(mode: str) -> float:
    """The constant added to the weight in fp32 before it scales the normalised row (Gemma's ``1 + w``)."""
    return 1.0 if mode == "gemma" else 0.0


def sum_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype of the norm's input: ``residual + x`` as torch promotes it, or ``x``'s."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def stats_shape(shape: torch.Size, mode: str) -> tuple[int, ...]:
    """Shape of the per-row statistics the backward reads: ``rstd``, stacked with the means for LayerNorm."""
    return (2, *shape[:-1]) if mode == "layernorm" else tuple(shape[:-1])


def output_dtype(
    normed_dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None, mode: str
) -> torch.dtype:
    """The dtype Hugging Face's module returns for an input of ``normed_dtype``."""
    if mode != "llama":
        return normed_dtype
    dtype = torch.promote_types(weight.dtype, normed_dtype)
    return dtype if bias is None else torch.promote_types(dtype, bias.dtype)


def forward_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(y, normed_input, stats)``; ``normed_input`` is ``residual + x`` rounded as torch rounds it."""
    normed_input = x if residual is None else residual + x
    s = normed_input.float()
    if mode == "layernorm":
        mean = s.mean(-1, keepdim=True)
        s = s - mean
    rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    n = s * rstd
    if mode == "llama":
        y = weight * n.to(normed_input.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = n * (weight.float() + weight_offset(mode))
        if bias is not None:
            y = y + bias.float()
        y = y.to(normed_input.dtype)
    stats = rstd.squeeze(-1)
    if mode == "layernorm":
        stats = torch.stack([stats, mean.squeeze(-1)])
    return y, normed_input, stats


def backward_reference(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    normed_input: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor,
    has_bias: bool,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients in fp32: ``(d normed_input, dweight, dbias)``; the caller casts them to the input dtypes.

    ``dsum`` is the gradient arriving at the ``new_residual`` output; it is folded into the input gradient.
    The cast of the normalised row to the input dtype (``"llama"`` mode) has an identity gradient, as in
    autograd, but the weight gradient sees the rounded row the forward multiplied.
    """
    n_cols = normed_input.shape[-1]
    s = normed_input.float()
    if mode == "layernorm":
        rstd, mean = stats
        s = s - mean.unsqueeze(-1)
    else:
        rstd = stats
    r = rstd.unsqueeze(-1)
    n = s * r
    g = dy.float() * (weight.float() + weight_offset(mode))
    dx = g - n * (g * n).mean(-1, keepdim=True)
    if mode == "layernorm":
        dx = dx - g.mean(-1, keepdim=True)
    dx = r * dx
    if dsum is not None:
        dx = dx + dsum.float()
    n_weighted = n.to(normed_input.dtype).float() if mode == "llama" else n
    dy2 = dy.float().reshape(-1, n_cols)
    dweight = (dy2 * n_weighted.reshape(-1, n_cols)).sum(0)
    dbias = dy2.sum(0) if has_bias else None
    return dx, dweight, dbias
