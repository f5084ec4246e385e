"""Cross-layer fusion as data flow: layer ``i``'s last residual add computed by the next norm's kernel, whose
normed output reaches that norm's reader as an argument.

The stack's forward is derived from its own code (``derived_rewrite.fused_stack_forward``): its loop over the layers
calls ``call_layer`` for each layer, with the layer the loop calls next. Where the stack links the layer to the
next norm (``NextNorm``: layer ``i + 1``'s input norm, or the final norm after the last layer) and nothing else
watches them (``foreign_code``), the layer is called with a private keyword, ``KWARG = (next norm, receives)``:

* asked to hand on, its last residual add runs as ``next_norm(branch, residual=residual)``, one kernel writing the
  sum and the normed sum (a sandwich layer's, ``residual + post_mlp_norm(h)``, as ``sandwich.fused_pair``: the
  post-feedforward norm, the add and the next norm in one kernel, ``add_normed_residual``); the layer returns its
  usual output with the normed sum appended (``(sum, normed)``, or ``(*outputs, normed)`` for a layer returning a
  tuple), and the loop passes the usual output on as the original loop does;
* receiving, the normed sum is the layer's last positional argument, and the layer's input norm returns it
  instead of normalising the same sum again. After the loop the final norm's call does the same with the last
  layer's.

The fused layer's class forward (``fused.py``) takes the keyword and the argument off before its body runs, and
passes the body one ``LayerCall``: what it received and, once its last add ran, the normed sum to return. Nothing
else carries a value from one call to another: what a layer computes depends on its arguments alone.

A block of sublayers (``derived_blocks.py``: T5's ``T5Block`` calling its self-attention, cross-attention and
feed-forward sublayers) is a layer of its stack's loop like any other, and inside it the same handoff runs between
its sublayer calls: its forward, derived from its own, calls each sublayer through ``call_sublayer`` with the
block's ``BlockLinks`` (planned with the stack's links): call ``i`` hands its sum to call ``i + 1``'s sublayer as
the loop hands layer ``i``'s to layer ``i + 1``, checked by ``foreign_code`` alike; the first call receives what
the stack handed the block (``block_input``: the stack checked the block and the norm, the block checks its first
sublayer's hooks), and the last call hands its sum to the norm the stack asked the block to hand on to (the
stack checked the block and that norm; ``call_sublayer`` checks the last sublayer as ``foreign_code`` checks a
handing layer).

A derived layer whose residual adds sit in sublayers it calls (``derived_sites``' "Sublayer outputs": BLOOM's block
calling its attention and MLP, whose output is their add) calls each through ``sublayer_into`` (its sum read next
by the layer's own norm: the sublayer hands it to that norm, and ``take_handed`` gives the consumer the normed sum)
or ``sublayer_output`` (its sum the layer's output: the sublayer hands it to the norm the layer's own call was asked
to hand on to), with the links the planner put on the layer (``SUBLAYER_LINKS_ATTR``, keyed by the sublayer module),
checked by ``foreign_code`` as the loop's are.

Why this computes the unpatched function, and its gradients, exactly:

* The sum is the add the layer's code does, computed by the kernel that also normalises it; the kernel's norm is
  the next norm's own forward (same module, same casting order), applied to that very sum (``fused_pair`` runs
  what both norms' fused forwards run, bitwise the two ops: ``sandwich.chains``). The loop passes the
  sum on as the layer's output, so ``output_hidden_states`` and the hooks that may watch (transformers' output
  recorders, which record ``output[0]`` of a tuple, the first item kept at its place) see the unpatched hidden
  states. A normed sum is taken only by the module it was made for (the loop checks the consumer's identity) and
  only from the same sum's dtype, device and shape (a ``.to(...)`` the code applies first changes none of its
  values then); it is handed on only when the layer returns that very sum, or a tuple beginning with it
  (``run_layer`` checks the identity at every call), or a view of it that keeps its rows, with the normed sum
  viewed alike (``hand_on_viewed``: OPT's ``(residual + h).view(shape)``).
* Whatever else could see or change the hidden state between the two modules makes the loop call both plainly
  (``foreign_code``): a forward hook, pre-hook or backward hook (module or global) on the layer, the next layer or
  the norm, other than transformers' read-only output recorders and the conversion's own centring pre-hook on a
  layer that only hands on (``guard.py``, the guard of every fused site); accelerate's hooks (they move and
  offload weights); a layer whose class or forward was changed after patching; a norm replaced in its parent after
  patching (PEFT's ``modules_to_save``), or whose weight is on another device than the hidden states. The layer's
  last add asks the guard about the norm again (``add_residual``; ``add_normed_residual`` asks ``sandwich.chains``
  about both norms it runs): a hook the layer's own code registers on it meanwhile makes it the plain add (a
  sandwich layer's ``norm_add``), and the next layer calls the norm on the sum. A custom loop, or a stack
  forward replaced after patching, never calls ``call_layer``: every layer called directly runs its adds unfused,
  exactly as before patching.
* The normed sum is an output of the fused kernel's autograd node and an input of the next layer, so the
  gradient reaching it and the sum's reach that node's backward together, as in eager fusion (whose gradients
  the tests hold bitwise equal to the unfused adds').
* Activation checkpointing (transformers' ``GradientCheckpointingLayer`` wraps the class forward:
  ``checkpoint(partial(forward, layer, **kwargs), *args)``): the normed sum travels as a positional argument,
  so it is one of the checkpoint's inputs. Reentrant checkpointing detaches its inputs and returns their gradients
  from the recomputation, the normed sum's included; its outputs are the layer's, the normed sum included, so its
  gradient comes back through the checkpoint into the kernel's node. Non-reentrant checkpointing recomputes the
  layer with the same arguments, and since every decision inside the layer is made from its arguments, the
  recomputation saves the same tensors as the first run.
* ``torch.compile`` traces all of it as Python: a tuple, module identities, hook dictionaries; no state outside
  the call (a compiled model, a compiled layer, an unrolled loop alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from . import guard, sandwich
from .attributes import registered_parameter

# The private keyword the derived loop calls a fused layer with: ``(next norm or None, receives)``.
KWARG = "_hf_rmsnorm_handoff"
# The keyword-only parameter a fused layer's body takes its ``LayerCall`` by (the shapes' bodies spell it out).
CALL_PARAM = "_hf_rmsnorm_call"
# Instance attribute of a patched stack: layer -> NextNorm.
LINKS_ATTR = "_hf_rmsnorm_links"
# Instance attribute of a patched block of sublayers: its ``BlockLinks``.
BLOCK_LINKS_ATTR = "_hf_rmsnorm_block_links"
# Instance attribute of a derived layer calling sublayers whose output add goes into a norm of its own, or is its
# output: sublayer -> NextNorm (its norm), or None (the layer's output).
SUBLAYER_LINKS_ATTR = "_hf_rmsnorm_sublayer_links"


@dataclass
class NextNorm:
    """Where layer ``i``'s last residual sum goes: ``norm`` is the first module to read it, and ``consumer``
    (the next layer, or the final norm itself) is the module the stack calls with it. The consumer reaches the
    norm as ``parent.<attribute>`` (the next layer's input norm, or the stack's final norm): a wrapper put there
    after patching (PEFT's ``modules_to_save``) calls another module, so the loop checks it is still ``norm``."""

    consumer: nn.Module
    norm: nn.Module
    parent: nn.Module
    attribute: str


class LayerCall:
    """What one call of a fused layer's body gets from the loop: ``normed_input``, the normed sum its input norm
    returns (None: it normalises its input itself); ``next_norm``, the norm its last add goes into (None: a plain
    add); ``normed_output``, set by that add to the normed sum it hands on, and ``sum`` to the sum it is the norm
    of (handed on only when the layer returns that very tensor: ``run_layer``)."""

    __slots__ = ("normed_input", "next_norm", "normed_output", "sum")

    def __init__(self, normed_input: Tensor | None, next_norm: nn.Module | None) -> None:
        self.normed_input = normed_input
        self.next_norm = next_norm
        self.normed_output: Tensor | None = None
        self.sum: Tensor | None = None

    def hand_on(self, normed: Tensor, total: Tensor) -> None:
        """Records the normed sum to hand on, and the sum it is the norm of."""
        self.normed_output, self.sum = normed, total


def run_layer(body, layer: nn.Module, args: tuple, kwargs: dict):
    """``body(layer, *args, **kwargs)`` for a fused layer's forward: with ``KWARG`` in ``kwargs`` (the derived
    loop's call), the normed input taken off the positional arguments and the normed output appended to the
    result (module docstring); without it, the plain call."""
    request = kwargs.pop(KWARG, None)
    if request is None:
        return body(layer, *args, **kwargs)
    next_norm, receives = request
    call = LayerCall(args[-1] if receives else None, next_norm)
    output = body(layer, *(args[:-1] if receives else args), **{CALL_PARAM: call}, **kwargs)
    if next_norm is None:
        return output
    # What the layer returns is, or begins with, the sum whose norm it hands on (its code was read so when
    # patching; checked here, the sum's identity, for a form such as ``(s,) + rest`` whose result a type's own
    # ``__radd__`` would decide): else it hands nothing on.
    returns_tuple = type(layer)._hf_rmsnorm_kind.returns_tuple
    first = output[0] if returns_tuple and isinstance(output, tuple) and output else output
    normed = call.normed_output if call.sum is not None and first is call.sum else None
    return (*output, normed) if returns_tuple else (output, normed)


def input_norm(call: LayerCall | None, norm: nn.Module, argument: Tensor, hidden_states: Tensor) -> Tensor:
    """``norm(argument)``, the layer's input norm of its input ``hidden_states`` (``argument`` is it, or its
    ``.to(...)``): the normed sum the previous layer handed on, when it did."""
    return _handed_or_norm(None if call is None else call.normed_input, norm, argument, hidden_states)


def final_norm(handed: tuple[nn.Module, Tensor] | None, norm: nn.Module, argument: Tensor,
               hidden_states: Tensor) -> Tensor:
    """``norm(argument)`` after the loop: the normed sum the last layer handed to ``norm``, when it did."""
    return _handed_or_norm(handed[1] if handed is not None and handed[0] is norm else None, norm, argument,
                           hidden_states)


def _handed_or_norm(normed: Tensor | None, norm: nn.Module, argument: Tensor, hidden_states: Tensor) -> Tensor:
    # `argument` is `hidden_states` or a `.to(...)` of it: the same values where dtype, device and shape are.
    if normed is not None and isinstance(argument, Tensor) and (argument is hidden_states or (
        argument.dtype == hidden_states.dtype and argument.device == hidden_states.device
        and argument.shape == hidden_states.shape
    )):
        return normed
    return norm(argument)


def add_residual(call: LayerCall | None, branch: Tensor, residual: Tensor) -> Tensor:
    """``residual + branch``, the layer's output: from the next norm's kernel when the loop asked for it, the
    kernel computes that add (two tensors of one shape and class, no broadcast) and no hook watches the norm now
    (``guard.unwatched_call``: the loop asked before the layer ran, whose code may have registered one since); the
    normed sum goes into ``call.normed_output``."""
    norm = None if call is None else call.next_norm
    if norm is None or not kernel_adds(branch, residual) or (fused_norm := guard.unwatched_call(norm)) is None:
        return residual + branch
    normed, total = fused_norm(branch, residual=residual)
    call.hand_on(normed, total)
    return total


def add_normed_residual(call: LayerCall | None, norm: nn.Module, x: Tensor, residual: Tensor) -> Tensor | None:
    """``residual + norm(x)``, a sandwich layer's output (its post-feedforward norm's add), from one kernel with
    the next norm (``sandwich.fused_pair``) when the loop asked for it, the kernel computes that add (as
    ``add_residual``) and ``sandwich.chains`` accepts the two norms now (no hook watches either: the layer's code
    may have registered one since the loop asked); the normed sum goes into ``call.normed_output``. None where
    it does not: the caller computes the add as without a handoff, and the next norm runs on the sum itself."""
    next_norm = None if call is None else call.next_norm
    if next_norm is None or not kernel_adds(x, residual) or not sandwich.chains(norm, next_norm):
        return None
    normed, total = sandwich.fused_pair(norm, x, residual, next_norm)
    call.hand_on(normed, total)
    return total


def hand_on_viewed(call: LayerCall | None, total: Tensor, viewed: Tensor) -> None:
    """Hands on, in place of the normed ``total``, that normed sum viewed as ``viewed`` (a view of ``total``, which
    the layer returns): the norm of a view that keeps each row (the last dimension, the dtype and the number of
    elements; a contiguous sum's rows in their order) is the same view of the norm. Any other view hands nothing
    on."""
    if call is None or call.sum is not total or call.normed_output is None:
        return
    if isinstance(viewed, Tensor) and viewed.dtype == total.dtype and keeps_rows(viewed, total) and (
            total.is_contiguous()):
        call.hand_on(call.normed_output.view(viewed.shape), viewed)
    else:
        withdraw(call)


def keeps_rows(view: Tensor, tensor: Tensor) -> bool:
    """Whether ``view``, a view or reshape of ``tensor`` (the derived layers read only such), holds its rows in
    their order: the same last dimension and number of elements (a flattening ``reshape(-1, size(-1))``, or its
    undoing). A norm normalises each row, so the norm of such a view is the same view of the norm."""
    return view.shape[-1:] == tensor.shape[-1:] and view.numel() == tensor.numel()


def kernel_adds(a: object, b: object) -> bool:
    """Whether a norm kernel's add computes ``a + b`` as torch does: two tensors of one shape, class and device (no
    broadcasting, no DTensor mixed with a tensor)."""
    return (isinstance(a, Tensor) and isinstance(b, Tensor) and type(a) is type(b) and a.shape == b.shape
            and a.device == b.device)


def withdraw(call: LayerCall | None) -> None:
    """Hands nothing on after all: code after the layer's output add may change the sum (``derived_sites``)."""
    if call is not None:
        call.normed_output = call.sum = None


def layers_with_next(layers) -> list[tuple[nn.Module, nn.Module | None]]:
    """Each layer the loop iterates with the one it iterates next (None after the last)."""
    items = list(layers)
    return list(zip(items, items[1:] + [None]))


def call_layer(stack: nn.Module, layer: nn.Module, next_layer: nn.Module | None, feeds_final_norm: bool,
               handed: tuple[nn.Module, Tensor] | None, *args, **kwargs):
    """``layer(*args, **kwargs)`` as one iteration of ``stack``'s loop, and what it hands on: ``(output,
    (consumer, normed sum) or None)``. ``handed`` is what the previous iteration handed on; ``next_layer`` the
    layer the loop calls next, None after the last, whose output goes to the final norm when
    ``feeds_final_norm`` (module docstring)."""
    link = getattr(stack, LINKS_ATTR, {}).get(layer)
    consumer = next_layer if next_layer is not None else (link.norm if link is not None and feeds_final_norm else None)
    if link is None or link.consumer is not consumer or not args or foreign_code(layer, link, args[0]):
        return _linked_call(layer, None, None, handed, args, kwargs)
    return _linked_call(layer, link.consumer, link.norm, handed, args, kwargs)


def _linked_call(layer: nn.Module, consumer: nn.Module | None, norm: nn.Module | None,
                 handed: tuple[nn.Module, Tensor] | None, args: tuple, kwargs: dict):
    """``(layer(*args, **kwargs), (consumer, normed sum) or None)``: ``layer`` receiving what ``handed`` made for
    it, and handing its output sum to ``norm`` for ``consumer`` (checked by the caller), if any."""
    # len(), not bool(): torch 2.11's Dynamo cannot trace bool() of a tuple (fullgraph compilation failed on a GPU).
    receives = handed is not None and handed[0] is layer and len(args) > 0
    if norm is None and not receives:
        return layer(*args, **kwargs), None
    if receives:
        args = (*args, handed[1])
    output = layer(*args, **{KWARG: (norm, receives)}, **kwargs)
    if norm is None:
        return output, None
    *output, normed = output
    output = tuple(output) if type(layer)._hf_rmsnorm_kind.returns_tuple else output[0]
    return output, None if normed is None else (consumer, normed)


@dataclass(frozen=True)
class BlockLinks:
    """A patched block's links (``derived_blocks.py``), the instance attribute ``BLOCK_LINKS_ATTR``: ``first``,
    the sublayer its first call reaches (which takes the normed input handed to the block; None: the block takes
    none); ``sites``, per sublayer call, where its output sum goes (``NextNorm``: the next call's sublayer), or
    None; ``last``, the index of the last call, whose sum goes to the norm the block's own call hands on to."""

    first: nn.Module | None
    sites: tuple[NextNorm | None, ...]

    @property
    def last(self) -> int:
        return len(self.sites) - 1


def block_input(block: nn.Module, call: LayerCall | None) -> tuple[nn.Module, Tensor] | None:
    """What a block hands its first sublayer call: the normed input the stack handed the block, made for the
    first sublayer's input norm (the stack's link checked that norm, and the block, before calling it)."""
    links = getattr(block, BLOCK_LINKS_ATTR, None)
    if call is None or call.normed_input is None or links is None or links.first is None:
        return None
    first = links.first
    if not _fused_layer(first) or guard.watched(first, guard.is_output_recorder):
        return None
    return first, call.normed_input


def call_sublayer(block: nn.Module, call: LayerCall | None, handed: tuple[nn.Module, Tensor] | None, site: int,
                  layer: nn.Module, /, *args, **kwargs):
    """``layer(*args, **kwargs)`` as the sublayer call ``site`` of ``block``'s forward, and what it hands on:
    ``(output, (consumer, normed sum) or None)``. ``handed`` is what the block's input or the previous call
    handed on; the last call hands its sum to the norm the block's own call was asked to hand on to
    (``call.next_norm``), setting ``call.normed_output``."""
    links = getattr(block, BLOCK_LINKS_ATTR, None)
    if links is None:
        return _linked_call(layer, None, None, handed, args, kwargs)
    if site < links.last:
        link = links.sites[site]
        if link is None or foreign_code(layer, link, args[0]):
            return _linked_call(layer, None, None, handed, args, kwargs)
        return _linked_call(layer, link.consumer, link.norm, handed, args, kwargs)
    return _last_call(call, layer, handed, args, kwargs), None


def _last_call(call: LayerCall | None, layer: nn.Module, handed: tuple[nn.Module, Tensor] | None, args: tuple,
               kwargs: dict):
    """``layer(*args, **kwargs)``, the call whose output sum is the calling layer's or block's output: handed to the
    norm that one's own call was asked to hand on to (``call.next_norm``: the stack checked it and the caller),
    ``layer`` checked as a handing layer is, setting ``call.normed_output``."""
    norm = None if call is None else call.next_norm
    if norm is not None and _hands_on_watched(layer, norm, args[0]):
        norm = None
    output, handing = _linked_call(layer, norm, norm, handed, args, kwargs)
    if handing is not None:
        call.hand_on(handing[1], _stream_of(layer, output))
    return output


def _stream_of(layer: nn.Module, output):
    """The residual stream in a fused layer's output: the output itself, or its first item for a kind that returns
    a tuple."""
    return output[0] if type(layer)._hf_rmsnorm_kind.returns_tuple else output


def sublayer_into(layer: nn.Module, sublayer: nn.Module, /, *args, **kwargs):
    """``(sublayer(*args, **kwargs), (norm, normed sum, sum) or None)``: a sublayer call of a derived layer whose
    output sum the layer's own norm reads next (``derived_sites``' "Sublayer outputs"), the sum computed by that
    norm's kernel where the layer's links say so and nothing else watches the two modules (``foreign_code``)."""
    link = getattr(layer, SUBLAYER_LINKS_ATTR, {}).get(sublayer)
    if link is None or not args or not isinstance(args[0], Tensor) or foreign_code(sublayer, link, args[0]):
        return sublayer(*args, **kwargs), None
    output, handing = _linked_call(sublayer, link.norm, link.norm, None, args, kwargs)
    if handing is None:
        return output, None
    return output, (link.norm, handing[1], _stream_of(sublayer, output))


def take_handed(handed: tuple[nn.Module, Tensor, Tensor] | None, norm: nn.Module, argument: Tensor) -> Tensor:
    """``norm(argument)``: the normed sum ``sublayer_into`` made, when it was made by that norm of that very sum."""
    if handed is not None and handed[0] is norm and argument is handed[2]:
        return handed[1]
    return norm(argument)


def sublayer_output(call: LayerCall | None, layer: nn.Module, sublayer: nn.Module, /, *args, **kwargs):
    """``sublayer(*args, **kwargs)``, the sublayer call whose output sum is the derived layer's output: handed to
    the norm the layer's own call was asked to hand on to (the stack checked the layer and the norm; the sublayer
    is checked as a handing layer is), as ``call_sublayer``'s last call."""
    if sublayer not in getattr(layer, SUBLAYER_LINKS_ATTR, {}) or not args or not isinstance(args[0], Tensor):
        return sublayer(*args, **kwargs)
    return _last_call(call, sublayer, None, args, kwargs)


def foreign_code(layer: nn.Module, link: NextNorm, hidden_states: Tensor) -> bool:
    """Whether anything but the two modules' own code could see or change what passes between ``layer`` and
    ``link``'s norm, or would see the private arguments (module docstring): then the loop makes the plain calls.
    Hooks are ``guard.watched``'s to judge, the one guard of every fused site."""
    norm, consumer = link.norm, link.consumer
    if link.parent._modules.get(link.attribute) is not norm or _hands_on_watched(layer, norm, hidden_states):
        return True
    return consumer is not norm and (not _fused_layer(consumer) or guard.watched(consumer, guard.is_output_recorder))


def _hands_on_watched(layer: nn.Module, norm: nn.Module, hidden_states: Tensor) -> bool:
    """``foreign_code``'s checks of the handing layer and the norm: an accelerate hook or another device on the
    norm, a hook on either, a layer no longer the fused class as installed."""
    if "_hf_hook" in norm.__dict__:
        return True
    weight = registered_parameter(norm, "weight", None)
    if isinstance(weight, Tensor) and weight.device != hidden_states.device:
        return True
    return guard.watched(norm) or not _fused_layer(layer) or guard.watched(layer, _seen_alike_by_handing_layer)


def _fused_layer(module: nn.Module) -> bool:
    # The fused class itself (not a subclass made since, such as FSDP2's), running its class forward as installed
    # (no wrapper set on the class since), with no accelerate hook.
    # (``cls.forward``, not the class ``__dict__``'s entry: Dynamo refuses a mapping proxy read after the dict changed.)
    cls = type(module)
    return "_hf_rmsnorm_base" in cls.__dict__ and cls.forward is cls._hf_rmsnorm_forward and not (
        "forward" in module.__dict__ or "_hf_hook" in module.__dict__)


def _seen_alike_by_handing_layer(hook) -> bool:
    # A hook of a layer that hands on but does not receive: transformers' output recorders, and conversion.py's
    # pre-hook of a converted stack's first layer (it centres the input; the first layer never receives).
    return guard.is_output_recorder(hook) or (
        getattr(hook, "__name__", None) == "centre_stream"
        and getattr(hook, "__module__", None) == f"{__package__}.conversion")
