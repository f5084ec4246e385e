"""Pure-PyTorch norm with exactly the semantics of the Triton kernels, mode by mode (see ``modes.py``).

This is the implementation that runs on CPU tensors when Triton's interpreter is off (``backend.py`` decides),
and it spells out the numerics the kernels follow (``stepwise_output``), but for ``nn.LayerNorm``'s maths, which
it leaves to torch's own kernel so that such a model's LayerNorms are reproduced bit for bit. Tests never use it
as their only oracle: they compare the kernels against fp64 maths and against Hugging Face's own modules as well.

The forward also returns the per-row statistics for the backward, laid out as the kernels lay them out
(``modes.STATS_SYNC_SLOTS``): ``rstd`` and, in a centring mode (``"layernorm"``, ``"deberta"``), the row means.
"""

from __future__ import annotations

import math

import torch

from .modes import STATS_SYNC_SLOTS, Mode, dtype_of, get_mode


def forward_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(y, norm_input, stats)``; ``norm_input`` is ``residual + x`` rounded as torch rounds it."""
    m = get_mode(mode)
    norm_input = x if residual is None else residual + x
    s, variance, rstd, mean = _statistics(norm_input, eps, m)
    # ``nn.LayerNorm``'s maths, rounded as torch's own kernel rounds it: such a model's LayerNorm bit for bit, where
    # the steps of ``_normalised`` may land an ulp away (fp32 noise that makes a patched model less accurate than
    # the original on some inputs). The statistics, in fp32 at least, feed the backward.
    y = torch_layer_norm(norm_input, weight, bias, eps) if m.is_torch_layer_norm else None
    if y is None:
        y = _normalised(norm_input, s, variance, rstd, weight, bias, eps, m)
    return y, norm_input, m.pack_stats(rstd, mean)


# The parameter dtypes torch's layer_norm kernel takes with an input of each dtype besides the input's own: fp32
# parameters with a half-precision input (norms kept in fp32 in a bf16 or fp16 model); it refuses any other mix.
_MIXED_PARAMETER_DTYPES = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def torch_layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     eps: float) -> torch.Tensor | None:
    """What ``nn.LayerNorm`` returns for ``x`` with these parameters, where torch's kernel takes their dtypes: all
    of ``x``'s dtype, or all fp32 with a half-precision ``x`` (None otherwise)."""
    dtypes = {t.dtype for t in (weight, bias) if t is not None}
    if not (dtypes <= {x.dtype} or dtypes == {_MIXED_PARAMETER_DTYPES.get(x.dtype)}):
        return None
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def stepwise_output(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    mode: str) -> torch.Tensor:
    """``mode``'s output for ``x``, each step rounded as a Hugging Face body that spells the maths out rounds it
    (a model's own LayerNorm class: Cohere's): ``forward_reference``'s, but that one runs torch's kernel for
    ``nn.LayerNorm``'s maths."""
    m = get_mode(mode)
    s, variance, rstd, _ = _statistics(x, eps, m)
    return _normalised(x, s, variance, rstd, weight, bias, eps, m)


def _statistics(norm_input: torch.Tensor, eps: float, m: Mode) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor | None]:
    """The row in mode ``m``'s compute dtype, centred where ``m`` centres, its variance, rstd and mean (None
    where ``m`` does not centre)."""
    s = norm_input.to(m.compute_dtype(norm_input.dtype))
    mean = None
    if m.centre:
        mean = s.mean(-1, keepdim=True)
        s = s - mean
    variance = s.pow(2).mean(-1, keepdim=True)
    return s, variance, torch.rsqrt(variance + eps), mean


def _normalised(norm_input: torch.Tensor, s: torch.Tensor, variance: torch.Tensor, rstd: torch.Tensor,
                weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, m: Mode) -> torch.Tensor:
    """Mode ``m``'s output for ``norm_input`` from its row ``s`` in the compute dtype (centred where ``m``
    centres), its variance and rstd: each step rounded as the mode's Hugging Face body rounds it."""
    compute = s.dtype
    if m.divides_by_std:
        n = s / torch.sqrt(variance + eps)  # DeBERTa's division, which rounds otherwise than a product by rstd
    else:
        # T5's ``x * rsqrt(var + eps)`` multiplies the input itself (fp64 stays fp64); otherwise x.float() does.
        n = (norm_input.to(torch.promote_types(norm_input.dtype, compute)) if m.rounds_to_weight_dtype else s) * rstd
    if m.cast_before_weight:
        # The product (and the bias add) round in the dtype torch promotes them to, as the eager module's do.
        rounded = n.to(m.rounded_dtype_of(norm_input.dtype, dtype_of(weight)))
        y = rounded if weight is None else weight * rounded
        if bias is not None:
            y = y + bias
    else:
        y = n if weight is None else n * (weight.to(compute) + m.weight_offset)
        if bias is not None:
            y = y + bias.to(compute)
    return y.to(m.output_dtype(norm_input.dtype, weight, bias))


def norm_add_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    weight2: torch.Tensor | None,
    bias2: torch.Tensor | None,
    eps2: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, total, stats, stats2)`` of a sandwich norm's two norms and the add between them: ``total = residual +
    norm(x)``, the norm's output rounded to its dtype and the add rounded as torch rounds it, then ``y =
    norm2(total)`` of that rounded sum (``weight2``, ``bias2``, ``eps2``, the same mode); each norm's statistics."""
    normed, _, stats = forward_reference(x, None, weight, bias, eps, mode)
    total = residual + normed
    y, _, stats2 = forward_reference(total, None, weight2, bias2, eps2, mode)
    return y, total, stats, stats2


def backward_reference(
    dy: torch.Tensor,
    dsum: torch.Tensor | None,
    norm_input: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor | None,
    has_bias: bool,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients in the mode's compute dtype: ``(d norm_input, dweight, dbias)`` (``dweight`` None without a
    weight); the caller casts them to the input dtypes.

    ``dsum`` is the gradient arriving at the ``new_residual`` output; it is folded into the input gradient.
    The cast of the normalised row to the input (or weight) dtype (``cast_before_weight`` modes) has an identity
    gradient, as in autograd, but the weight gradient sees the rounded row the forward multiplied.
    """
    m = get_mode(mode)
    n_cols = norm_input.shape[-1]
    compute = m.compute_dtype(norm_input.dtype)
    s = norm_input.to(compute)
    rstd, mean = m.unpack_stats(stats, norm_input.shape)
    if m.centre:
        s = s - mean.unsqueeze(-1)
    r = rstd.unsqueeze(-1)
    n = s * r
    g = dy.to(compute) if weight is None else dy.to(compute) * (weight.to(compute) + m.weight_offset)
    dx = g - n * (g * n).mean(-1, keepdim=True)
    if m.centre:
        dx = dx - g.mean(-1, keepdim=True)
    dx = r * dx
    if dsum is not None:
        dx = dx + dsum.to(compute)
    rounded_dtype = m.rounded_dtype_of(norm_input.dtype, dtype_of(weight))
    n_weighted = n.to(rounded_dtype).to(compute) if m.cast_before_weight else n
    dy2 = dy.to(compute).reshape(-1, n_cols)
    dweight = None if weight is None else (dy2 * n_weighted.reshape(-1, n_cols)).sum(0)
    dbias = dy2.sum(0) if has_bias else None
    return dx, dweight, dbias


def error_beyond_bound(ours: torch.Tensor, baseline: torch.Tensor, exact: torch.Tensor) -> float:
    """How far ``ours`` is from the project's accuracy rule, against the fp64 truth ``exact``: its largest error
    may be no more than 1% over ``baseline``'s (the model's own module in the kernel tests; the default plan in
    the tuner), where an error of one unit in the last place of ``ours``'s dtype at the largest magnitude of
    ``exact`` always passes, plus 1e-6 of that magnitude (fp32 reductions summed in another order than the
    baseline's). Zero or less: within the rule; more: by how much it is beyond."""
    scale = exact.abs().max().item()
    error = (ours.double() - exact.double()).abs().max().item()
    baseline_error = (baseline.double() - exact.double()).abs().max().item()
    return error - (max(baseline_error, torch.finfo(ours.dtype).eps * scale) * 1.01 + 1e-6 * scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` of the halves of ``x``'s last dimension: the rotation of Hugging Face's ``rotate_half`` RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_eps: float,
    k_eps: float,
    mode: str,
    per_head: bool,
    rope_first: bool = False,
    negate_sin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_out, k_out, stats)`` of ``qk.qk_norm_rope``'s op, as the attention modules compute them: each norm
    (``forward_reference``) over each head or over all heads of a token, then ``n * cos + rotate_half(n) * sin``
    over the first ``cos.shape[-1]`` columns of each head, in torch's dtypes and roundings; ``rope_first``
    (``qk.qk_rope_norm``): the RoPE of the input, then the norm of that. Outputs are ``[batch, tokens, heads,
    head_dim]`` and contiguous; ``stats`` are laid out as the kernels lay them out (the counters, ``rstd`` of q's
    rows, then of k's). ``negate_sin``: the rotation by the opposite angle (``-sin``, exact)."""
    m = get_mode(mode)
    sin = -sin if negate_sin else sin
    one = _rope_norm_reference if rope_first else _norm_rope_reference
    q_out, q_rstd = one(q, q_weight, cos, sin, q_eps, mode, per_head)
    k_out, k_rstd = one(k, k_weight, cos, sin, k_eps, mode, per_head)
    return q_out, k_out, torch.cat([m.pack_stats(q_rstd, None), k_rstd.reshape(-1)])


def _norm_rows(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """``x`` (``[batch, tokens, heads, head_dim]``) as the norm's rows: each head, or each token's heads together."""
    return x if per_head else x.reshape(*x.shape[:2], -1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` of ``x`` (``[batch, tokens, heads, head_dim]``) over the first
    ``cos.shape[-1]`` columns of each head, the rest passed through, in torch's dtypes and roundings."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over the heads
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1).contiguous()


def _norm_rope_reference(x, weight, cos, sin, eps, mode, per_head):
    y, _, stats = forward_reference(_norm_rows(x, per_head), None, weight, None, eps, mode)
    rstd, _ = get_mode(mode).unpack_stats(stats, _norm_rows(x, per_head).shape)
    return _rope(y.view(x.shape), cos, sin), rstd


def _rope_norm_reference(x, weight, cos, sin, eps, mode, per_head):
    rotated = _rope(x, cos, sin)
    y, _, stats = forward_reference(_norm_rows(rotated, per_head), None, weight, None, eps, mode)
    rstd, _ = get_mode(mode).unpack_stats(stats, _norm_rows(x, per_head).shape)
    return y.view(x.shape).contiguous(), rstd


def qk_norm_rope_backward_reference(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    stats: torch.Tensor,
    mode: str,
    per_head: bool,
    rope_first: bool = False,
    negate_sin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, d q_weight, d k_weight)`` of ``qk_norm_rope_reference`` in the norms' compute dtype (None for an
    absent weight): the rotation's transpose (``dn = dy * cos + rotate_half^T(dy * sin)``, the rest of each head
    passing ``dy`` through), then ``backward_reference``; ``rope_first``: ``backward_reference`` on the rotated rows
    (computed again as the forward computes them), then the rotation's transpose. The caller casts them to the
    inputs' dtypes."""
    m = get_mode(mode)
    q_rows = _norm_rows(q, per_head).shape
    rstd = stats[STATS_SYNC_SLOTS:]
    q_count = math.prod(q_rows[:-1])
    sin = -sin if negate_sin else sin
    one = _rope_norm_backward_reference if rope_first else _norm_rope_backward_reference
    dq, dqw = one(dq_out, q, q_weight, cos, sin, rstd[:q_count], m, per_head)
    dk, dkw = one(dk_out, k, k_weight, cos, sin, rstd[q_count:], m, per_head)
    return dq, dk, dqw, dkw


def _rope_transpose(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """The gradient at the RoPE's input for ``dy`` at its output, in ``compute``: ``dy * cos +
    rotate_half^T(dy * sin)`` over the rotated columns, ``dy`` itself over the rest."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(2).to(compute), sin.unsqueeze(2).to(compute)
    dy = dy.to(compute)
    rotated = dy[..., :rotary_dim]
    along_sin = rotated * sin
    # rotate_half's transpose: (x1, x2) -> (x2, -x1).
    x1, x2 = along_sin.chunk(2, dim=-1)
    return torch.cat([rotated * cos + torch.cat((x2, -x1), dim=-1), dy[..., rotary_dim:]], dim=-1)


def _norm_rope_backward_reference(dy, x, weight, cos, sin, rstd, m, per_head):
    dn = _rope_transpose(dy, cos, sin, m.compute_dtype(x.dtype))
    rows = _norm_rows(x, per_head)
    dx, dweight, _ = backward_reference(_norm_rows(dn, per_head), None, rows, m.pack_stats(rstd.view(rows.shape[:-1]),
                                        None), weight, False, m.name)
    return dx.view(x.shape), dweight


def _rope_norm_backward_reference(dy, x, weight, cos, sin, rstd, m, per_head):
    rows = _norm_rows(_rope(x, cos, sin), per_head)
    dr, dweight, _ = backward_reference(_norm_rows(dy, per_head), None, rows,
                                        m.pack_stats(rstd.view(rows.shape[:-1]), None), weight, False, m.name)
    return _rope_transpose(dr.view(x.shape), cos, sin, m.compute_dtype(rows.dtype)), dweight
