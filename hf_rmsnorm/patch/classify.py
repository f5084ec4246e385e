"""What each module of a model is to the patcher, judged by its class: a norm, a decoder layer, a stack of layers,
a module an earlier ``patch_model`` call patched, or none of these.

The one place the "is this a norm / a layer / a stack" rules live. The patcher (``patcher.py``) classifies every
module of its one walk of the model, and it and the LayerNorm planning (``conversion.py``) read that
classification; what they then patch, and why they leave a module alone, is theirs to decide.
"""

from __future__ import annotations

import re
from enum import Enum

from torch import nn

from .families import Registry
from .fused import base_class

# Class-name endings of the decoder layers and stacks of no registered family: layers are recognised by their code
# (``recognition.py``) or given a derived forward (``derived_rewrite.py``), stacks recognised or read from their code.
DECODER_LAYER_SUFFIXES = ("DecoderLayer", "Block", "Layer")
STACK_SUFFIXES = ("Model", "Decoder", "Encoder", "Transformer", "Stack")
# A name ending with the word Norm (torch's BatchNorm2d: with a dimension after it). A module holding modules whose
# name says Norm elsewhere is named after a norm it applies, not a norm: RoBERTa-PreLayerNorm's
# ``RobertaPreLayerNormLayer`` is a layer, Wav2Vec2's ``Wav2Vec2LayerNormConvLayer`` a convolution (``role_of``).
_NAMED_NORM = re.compile(r"Norm(?:[123]d)?$")
# torch's norm classes: a subclass is a norm whatever its name and whatever it holds.
_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
# The layer and stack words of a composite's name (``role_of``): a suffix word followed by another word that does not
# make it a norm's name (the Layer of LayerNorm).
_LAYER_WORD = re.compile(rf"(?:{'|'.join(DECODER_LAYER_SUFFIXES)})(?!Norm)(?=[A-Z]|$)")
_STACK_WORD = re.compile(rf"(?:{'|'.join(STACK_SUFFIXES)})(?=[A-Z]|$)")


class Role(Enum):
    """What a module is to the patcher (the value says how it is told)."""

    PATCHED = "a class made by an earlier patch_model call"
    REGISTERED_NORM = "a norm class a family of families.py names"
    TORCH_LAYER_NORM = "torch's nn.LayerNorm itself: run exactly, wherever it sits (conversion.py)"
    RMS_NORM_LIKE = "torch's nn.RMSNorm, or a class named *RMSNorm*: recognised by what it computes"
    OWN_LAYER_NORM = ("a model's own class named *LayerNorm, or a subclass of nn.LayerNorm: recognised by what it "
                      "computes, centred modes included")
    OTHER_NORM = "any other norm class of torch's, or class named *Norm*: reported, never patched"
    REGISTERED_LAYER = "a decoder-layer class a family names"
    DECODER_LAYER = "a class named *DecoderLayer, *Block or *Layer: recognised by its code, or derived"
    REGISTERED_STACK = "a layer-stack class a family names"
    STACK = "a class named *Model, *Decoder, *Encoder, *Transformer or *Stack: recognised by its code, or read"
    OTHER = "anything else"

    @property
    def is_norm(self) -> bool:
        """A norm of any kind: these are patched, or reported with the reason they are not."""
        return self in _NORMS

    @property
    def is_recognisable_norm(self) -> bool:
        """A norm class no family names that recognition probes (``recognition.py``)."""
        return self in (Role.RMS_NORM_LIKE, Role.OWN_LAYER_NORM)


_NORMS = frozenset({Role.REGISTERED_NORM, Role.TORCH_LAYER_NORM, Role.RMS_NORM_LIKE, Role.OWN_LAYER_NORM,
                    Role.OTHER_NORM})


def may_derive(role: Role) -> bool:
    """Whether a module of ``role`` that calls patched norms of its own may get a forward derived from its code
    (``derived_sites.py``), fusing the adds next to them: a decoder layer of no known shape, and any module that is
    no norm, layer or stack (a post-LN sublayer such as BERT's ``*SelfOutput``). Each rewrite is exact wherever its
    pattern is found, so this only says where the planner looks; of the second kind, one whose forward has no such
    add is left alone without a word."""
    return role in (Role.DECODER_LAYER, Role.OTHER)


def norm_role(cls: type) -> Role | None:
    """The role of a norm class judged by its type and name alone (no registry), or None for a class that is no
    norm. Gated and grouped ``*RMSNorm`` variants are RMSNorm-like too, so their report says why they are left
    alone."""
    if issubclass(cls, nn.RMSNorm) or "RMSNorm" in cls.__name__:
        return Role.RMS_NORM_LIKE
    if cls is nn.LayerNorm:
        return Role.TORCH_LAYER_NORM
    if issubclass(cls, nn.LayerNorm) or cls.__name__.endswith("LayerNorm"):
        return Role.OWN_LAYER_NORM
    if issubclass(cls, _TORCH_NORMS) or "Norm" in cls.__name__:
        return Role.OTHER_NORM
    return None


def holds_norms(module: nn.Module) -> bool:
    """Whether a child of ``module`` is a norm (``norm_role``)."""
    return any(norm_role(type(child)) is not None for child in module.children())


def role_of(cls: type, registry: Registry, *, holds_modules: bool = False, composite: bool = False) -> Role:
    """What a module of class ``cls`` is, the registry's classes first, then by type and name.

    ``holds_modules``: whether the module has children; ``composite``: whether one of them is a norm
    (``holds_norms``). A class that only its name makes a norm (no norm class of torch's is among its bases) is no
    norm when it holds modules and its name says Norm before its last word (``RobertaPreLayerNormLayer``), or when it
    holds norms: it is named after the norms it applies (Wav2Vec2's pre-LN ``Wav2Vec2EncoderLayerStableLayerNorm`` and
    ``Wav2Vec2EncoderStableLayerNorm``, a layer and its stack; DBRX's ``DbrxNormAttentionNorm``: norm, attention, add,
    norm). It is then a layer or a stack by its name's last word, or for a composite by a layer or stack word in it
    (``EncoderLayer``, ``Encoder``), else any other module."""
    if base_class(cls) is not None:
        return Role.PATCHED
    if cls in registry.norms:
        return Role.REGISTERED_NORM
    role = norm_role(cls)
    named_after_norms = not issubclass(cls, _TORCH_NORMS) and (
        composite or (holds_modules and not _NAMED_NORM.search(cls.__name__)))
    if role is not None and not named_after_norms:
        return role
    if cls in registry.layers:
        return Role.REGISTERED_LAYER
    if cls in registry.stacks:
        return Role.REGISTERED_STACK
    name = cls.__name__
    if name.endswith(DECODER_LAYER_SUFFIXES) or (composite and role is not None and _LAYER_WORD.search(name)):
        return Role.DECODER_LAYER
    if name.endswith(STACK_SUFFIXES) or (composite and role is not None and _STACK_WORD.search(name)):
        return Role.STACK
    return Role.OTHER
