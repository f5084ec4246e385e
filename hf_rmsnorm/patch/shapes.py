"""Decoder-layer shapes: where a layer's norms read the residual stream, where its residual adds are, and the
fused body that runs them with the adds inside the norm kernels. One class per shape, each owning its body, the
checks of a registry entry of its shape, the adds it fuses inside the layer and whether its last add can go into
the next norm's kernel (``handoff.py``). A family's entry (``families.LayerKind``) names its shape and its
attribute names; adding a shape is a class here, the entries that use it and a test row.

A body is a plain function of ``(layer, hidden_states, *args, _hf_rmsnorm_call=None, **kwargs)``: the fused
layer's forward (``fused.py``, with the original forward's signature) calls it, passing the ``handoff.LayerCall``
of a call from the derived stack loop. Each calls what the original calls, in the original's order (dropouts draw
random numbers), and passes every other layer argument to the attention as the original does. An add goes into a
norm's kernel only when no hook watches that norm (``guard.unwatched_call``, asked at every call); otherwise the
body adds and calls the norm on the sum as the original does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import Tensor, nn

from . import guard, handoff, sandwich
from .handoff import LayerCall

if TYPE_CHECKING:
    from .families import LayerKind


def _sequential_body(self, hidden_states: Tensor, *args, _hf_rmsnorm_call: LayerCall | None = None,
                     **kwargs) -> Tensor:
    """The sequential pre-norm decoder layer of ``LayerKind``, with the residual adds inside the norm kernels."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    hidden_states = _attend(self, kind, _input_norm(self, kind, hidden_states, _hf_rmsnorm_call), args, kwargs)

    post_attention_norm = getattr(self, kind.post_attention_norm)
    fused_norm = (guard.unwatched_call(post_attention_norm) if _dropout_skippable(self, kind.attention_dropout)
                  else None)
    if fused_norm is not None:
        hidden_states, residual = fused_norm(_scaled(self, kind, hidden_states), residual=residual)
    else:
        residual = residual + _scaled(self, kind, _dropped(self, kind.attention_dropout, hidden_states))
        hidden_states = post_attention_norm(residual)
    hidden_states = getattr(self, kind.mlp)(hidden_states)
    if kind.mlp_output == "pair" or (kind.mlp_output == "pair if tuple" and isinstance(hidden_states, tuple)):
        hidden_states, _ = hidden_states
    if kind.mlp_output_as_residual:
        hidden_states = hidden_states.view(residual.shape)

    if not _dropout_skippable(self, kind.mlp_dropout):
        return residual + _scaled(self, kind, getattr(self, kind.mlp_dropout)(hidden_states))
    return handoff.add_residual(_hf_rmsnorm_call, _scaled(self, kind, hidden_states), residual)


def _post_norm_body(self, hidden_states: Tensor, *args, _hf_rmsnorm_call: LayerCall | None = None,
                    **kwargs) -> Tensor:
    """The post-norm decoder layer of ``LayerKind`` (OLMo2; with norms before the branches too, Gemma2's
    sandwich): each branch's norm and the residual add after it in one kernel; in a sandwich, the attention's
    with the MLP's norm before it too (``sandwich.py``), and the MLP's with the next layer's input norm (or the
    final norm) when the derived stack loop asks (``handoff.add_normed_residual``)."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    if kind.input_norm is not None:
        hidden_states = _input_norm(self, kind, hidden_states, _hf_rmsnorm_call)
    hidden_states = _attend(self, kind, hidden_states, args, kwargs)
    post_attention_norm = getattr(self, kind.post_attention_norm)
    pre_mlp_norm = None if kind.pre_mlp_norm is None else getattr(self, kind.pre_mlp_norm)
    if pre_mlp_norm is not None and sandwich.chains(post_attention_norm, pre_mlp_norm):
        mlp_input, hidden_states = sandwich.fused_pair(post_attention_norm, hidden_states, residual, pre_mlp_norm)
    else:
        hidden_states = _norm_then_add(post_attention_norm, hidden_states, residual)
        mlp_input = hidden_states if pre_mlp_norm is None else pre_mlp_norm(hidden_states)
    post_mlp_norm = getattr(self, kind.post_mlp_norm)
    mlp_output = getattr(self, kind.mlp)(mlp_input)
    handed_sum = handoff.add_normed_residual(_hf_rmsnorm_call, post_mlp_norm, mlp_output, hidden_states)
    return _norm_then_add(post_mlp_norm, mlp_output, hidden_states) if handed_sum is None else handed_sum


def _parallel_body(self, hidden_states: Tensor, *args, _hf_rmsnorm_call: LayerCall | None = None,
                   **kwargs) -> Tensor:
    """The parallel pre-norm block of ``LayerKind`` (both branches read the same input): the original's calls
    in the original's order (the dropouts draw random numbers), then ``(attention + mlp) + residual``, whose
    add goes into the next norm's kernel when the derived stack loop asks (the branch sum is computed first, as
    the original does; NeoX's ``mlp + attention`` is the same IEEE sum)."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    normed = _input_norm(self, kind, hidden_states, _hf_rmsnorm_call)
    attention = _dropped(self, kind.attention_dropout, _attend(self, kind, normed, args, kwargs))
    if kind.post_attention_norm is not None:
        normed = getattr(self, kind.post_attention_norm)(residual)
    mlp = _dropped(self, kind.mlp_dropout, getattr(self, kind.mlp)(normed))
    return handoff.add_residual(_hf_rmsnorm_call, attention + mlp, residual)


def _input_norm(layer: nn.Module, kind: LayerKind, hidden_states: Tensor, call: LayerCall | None) -> Tensor:
    """The input norm of ``hidden_states``, or the normed sum the previous layer handed on (``handoff.py``)."""
    return handoff.input_norm(call, getattr(layer, kind.input_norm), hidden_states, hidden_states)


def _attend(layer: nn.Module, kind: LayerKind, normed: Tensor, args: tuple, kwargs: dict) -> Tensor:
    """The attention branch: every layer argument but the hidden states goes to the attention by name, as the
    original forward passes it; the normed states by ``kind.attention_input`` (or positionally)."""
    if args:
        names = type(layer)._hf_rmsnorm_arg_names
        if len(args) > len(names):
            raise TypeError(f"{type(layer).__name__}.forward takes at most {len(names) + 1} positional arguments")
        kwargs.update(zip(names, args))
    name, returns_pair, dropped = kind.attention, True, kind.attention_dropped_args
    if kind.mixer_switch is not None:  # a hybrid layer: the token mixer its switch names (checked when patching)
        mixer = kind.mixer_for(getattr(layer, kind.mixer_switch))
        name, returns_pair, dropped = mixer.attribute, mixer.returns_pair, mixer.dropped_args
    for arg in dropped:
        kwargs.pop(arg, None)
    attention = getattr(layer, name)
    if kind.attention_input is None:
        output = attention(normed, **kwargs)
    else:
        output = attention(**{kind.attention_input: normed}, **kwargs)
    if returns_pair:
        output, _ = output
    return output


def _dropped(layer: nn.Module, name: str | None, branch: Tensor) -> Tensor:
    # Called whenever the original calls it (active or not), so the random stream is the original's.
    return branch if name is None else getattr(layer, name)(branch)


def _scaled(layer: nn.Module, kind: LayerKind, branch: Tensor) -> Tensor:
    # Rounded to the branch's dtype before the add, exactly as `residual + h * multiplier` rounds.
    return branch if kind.residual_scale is None else branch * getattr(layer, kind.residual_scale)


def _dropout_skippable(layer: nn.Module, name: str | None) -> bool:
    """Whether the fused add may leave out the residual dropout ``name``: none, or one that would neither change
    its input nor be seen by a hook (``guard.watched``)."""
    if name is None:
        return True
    dropout = getattr(layer, name)
    return not (dropout.training and dropout.p > 0) and not guard.watched(dropout)


def _norm_then_add(norm: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + norm(x)``: from the norm's kernel unless a hook watches the norm (``guard.unwatched_call``)."""
    fused_norm = guard.unwatched_call(norm)
    if fused_norm is None:
        return residual + norm(x)
    return fused_norm(x, add_to=residual)


def _parallel_residual_first_body(self, hidden_states: Tensor, *args, _hf_rmsnorm_call: LayerCall | None = None,
                                  **kwargs) -> Tensor:
    """The parallel block of ``ParallelResidualFirst`` (Cohere): ``(residual + attention) + mlp``, the first add
    as the original rounds it, the second in the next norm's kernel in a handoff."""
    kind: LayerKind = self._hf_rmsnorm_kind
    residual = hidden_states
    normed = _input_norm(self, kind, hidden_states, _hf_rmsnorm_call)
    attention = _attend(self, kind, normed, args, kwargs)
    return handoff.add_residual(_hf_rmsnorm_call, getattr(self, kind.mlp)(normed), residual + attention)


class LayerShape:
    """What every shape provides (one instance each, the module attribute ``name.upper()``, pickled and copied by
    that name)."""

    name: str
    body: Callable[..., Tensor]
    # What a patch report and a refused layer call the block.
    block: str
    # What the report calls the add that goes into the next norm's kernel.
    handoff_label = "mlp residual"

    def hands_off_last_add(self, kind: LayerKind) -> bool:
        """Whether the layer's last residual add may go into the next norm's kernel."""
        return True

    def last_add_inside(self, kind: LayerKind) -> str | None:
        """The norm attribute whose kernel computes the layer's last residual add inside the layer (an inner add,
        ``inner_adds``), which a handoff chains with the next norm; None where that add is the layer's plain
        output add."""
        return None

    def validate(self, kind: LayerKind) -> None:
        """Raises ValueError when ``kind``'s attribute names do not make a layer of this shape (by default: one
        without the post-norm shape's norms around the MLP)."""
        if kind.pre_mlp_norm is not None or kind.post_mlp_norm is not None:
            raise ValueError(f"a {self.name} LayerKind has no pre_mlp_norm or post_mlp_norm")

    def problem(self, layer: nn.Module, kind: LayerKind) -> str | None:
        """Why ``layer`` lacks what this shape's body needs beyond the checks every layer passes (the patcher's
        ``_layer_problem``: signature, norms, token mixer, MLP, dropouts, scale), if it does."""
        return None

    def inner_adds(self, kind: LayerKind) -> tuple[tuple[str, str, str | None], ...]:
        """The residual adds fused inside the layer: ``(label, the norm attribute whose kernel adds it, the
        dropout whose activity stops the fusion or None)``."""
        return ()

    def handoff_dropout(self, kind: LayerKind) -> str | None:
        """The dropout whose activity keeps the last add out of the next norm's kernel, if any."""
        return kind.mlp_dropout

    def __reduce__(self) -> str:
        # Pickled by reference to the module-level instance, named after the shape: a copy of a LayerKind keeps
        # the very same shape.
        return self.name.upper()

    def __repr__(self) -> str:
        return f"shapes.{self.name.upper()}"


class Sequential(LayerShape):
    """Pre-norm, one branch after the other (Llama and most decoders)::

        residual = h; h = input_norm(h); h, _ = attention(hidden_states=h, **every other argument)
        h = residual + attention_dropout(h) * residual_scale
        residual = h; h = post_attention_norm(h); h = mlp(h)
        return residual + mlp_dropout(h) * residual_scale

    The attention add goes into ``post_attention_norm``'s kernel; the MLP add into the next norm's."""

    name = "sequential"
    block = "sequential pre-norm block"

    def validate(self, kind: LayerKind) -> None:
        super().validate(kind)
        if kind.post_attention_norm is None:
            raise ValueError("a sequential LayerKind needs its post_attention_norm")

    def inner_adds(self, kind: LayerKind) -> tuple[tuple[str, str, str | None], ...]:
        return (("attention residual", kind.post_attention_norm, kind.attention_dropout),)

    body = staticmethod(_sequential_body)


class PostNorm(LayerShape):
    """Post-norm: the norms read the branch outputs, not the stream (OLMo2, OLMo3, Exaone4); Gemma2 and Gemma3's
    "sandwich" adds ``input_norm`` and ``pre_mlp_norm`` before the branches::

        residual = h; h, _ = attention(hidden_states=input_norm(h), **every other argument)
        h = residual + post_attention_norm(h)
        residual = h; return residual + post_mlp_norm(mlp(pre_mlp_norm(h)))

    Both adds go into the kernels of the norms before them. A sandwich layer's next layer begins with a norm of
    the stream: its last add, ``residual + post_mlp_norm(h)``, goes into one kernel with that norm (or the final
    norm) when the derived stack loop asks (``sandwich.fused_pair``). OLMo2's layers hand nothing on: the next
    layer reads the stream unnormed (its last layer's add, read by the final norm, is not chained either)."""

    name = "post_norm"
    block = "post-norm block"

    def hands_off_last_add(self, kind: LayerKind) -> bool:
        return kind.input_norm is not None

    def last_add_inside(self, kind: LayerKind) -> str | None:
        return kind.post_mlp_norm

    def validate(self, kind: LayerKind) -> None:
        if kind.post_mlp_norm is None or kind.residual_scale or kind.attention_dropout or kind.mlp_dropout:
            raise ValueError("a post-norm LayerKind has a post_mlp_norm and no dropouts or scale")

    def inner_adds(self, kind: LayerKind) -> tuple[tuple[str, str, str | None], ...]:
        # The last is the add a handoff chains (``last_add_inside``): the report's line for it is extended then.
        return (("attention residual", kind.post_attention_norm, None), (self.handoff_label, kind.post_mlp_norm, None))

    body = staticmethod(_post_norm_body)


class Parallel(LayerShape):
    """Parallel pre-norm: both branches read the same ``h`` (GPT-J, Phi, GPT-NeoX's parallel residual)::

        normed = input_norm(h); a, _ = attention(hidden_states=normed, **every other argument)
        a = attention_dropout(a)
        b = mlp_dropout(mlp(normed if post_attention_norm is None else post_attention_norm(h)))
        return (a + b) + h

    Its one add goes into the next norm's kernel; the dropouts act on the branches before it, so they never stop
    that fusion."""

    name = "parallel"
    block = "parallel pre-norm block"
    handoff_label = "parallel residual"

    def validate(self, kind: LayerKind) -> None:
        super().validate(kind)
        if kind.residual_scale is not None:
            raise ValueError("a parallel LayerKind has no residual_scale")

    def handoff_dropout(self, kind: LayerKind) -> str | None:
        return None

    body = staticmethod(_parallel_body)


class ParallelResidualFirst(Parallel):
    """Parallel pre-norm whose sum adds the attention to the stream before the MLP (Cohere, Cohere2)::

        normed = input_norm(h); a, _ = attention(hidden_states=normed, **every other argument)
        return (h + a) + mlp(normed)

    The second add goes into the next norm's kernel; the first stays a separate op, rounded as the original
    rounds it."""

    name = "parallel_residual_first"

    def validate(self, kind: LayerKind) -> None:
        super().validate(kind)
        if kind.post_attention_norm or kind.attention_dropout or kind.mlp_dropout:
            raise ValueError("a parallel_residual_first LayerKind has one norm and no dropouts or scale")

    body = staticmethod(_parallel_residual_first_body)


SEQUENTIAL, POST_NORM, PARALLEL = Sequential(), PostNorm(), Parallel()
PARALLEL_RESIDUAL_FIRST = ParallelResidualFirst()
