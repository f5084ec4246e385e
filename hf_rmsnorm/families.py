"""Model families the patcher knows, described as data.

Each family says which of its classes are norms (and how they cast), which are pre-norm decoder layers (and
the attribute names of their parts), and which module runs the layers and then a final norm. The patcher has
one walker and one fused layer body for all of them; adding a family of the same shape is adding an entry here.

Classes are named by import path and looked up among the loaded modules at patch time, so a transformers
version without a family simply does not offer it. Matching is by exact class (never by name or subclass): a
norm of an unknown class is reported as skipped, never patched on a guess.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class NormKind:
    """A norm class and the numerics of its forward (see ``hf_rmsnorm.reference`` for the modes)."""

    class_path: str
    eps_attr: str = "variance_epsilon"
    mode: str = "llama"
    bias_attr: str | None = None


@dataclass(frozen=True)
class LayerKind:
    """A pre-norm decoder layer whose forward is, with the attribute names below (an attribute set to None is
    absent: no dropout, no scale)::

        residual = h; h = input_norm(h); h, _ = attention(hidden_states=h, **every other argument)
        h = residual + attention_dropout(h) * residual_scale
        residual = h; h = post_attention_norm(h); h = mlp(h)
        return residual + mlp_dropout(h) * residual_scale

    or, with ``parallel`` (GPT-J, Phi, GPT-NeoX's parallel residual: both branches read the same ``h``)::

        normed = input_norm(h); a, _ = attention(hidden_states=normed, **every other argument)
        a = attention_dropout(a)
        b = mlp_dropout(mlp(normed if post_attention_norm is None else post_attention_norm(h)))
        return (a + b) + h

    (the dropouts are called as the original does, also when inactive; ``residual_scale`` is sequential only).
    ``attention_input`` is the keyword the normed states go to the attention by, None for positionally.

    ``forward_params`` is the original forward's parameter list; the patcher checks it at patch time, so a
    transformers release that changes the layer turns fusion off for it instead of running a stale body.
    ``unsupported_if`` names instance attributes that, when present and truthy, mean the layer does more than
    this body (GPT-2's cross-attention, GPT-NeoX's parallel residual): such a layer keeps its own forward.
    ``requires`` names instance attributes that must be present and truthy (GPT-NeoX's parallel kind requires
    ``use_parallel_residual``). A class may have several kinds; the patcher takes the first that fits.
    """

    class_path: str
    input_norm: str = "input_layernorm"
    attention: str = "self_attn"
    post_attention_norm: str | None = "post_attention_layernorm"
    mlp: str = "mlp"
    attention_dropout: str | None = None
    mlp_dropout: str | None = None
    residual_scale: str | None = None
    forward_params: tuple[str, ...] = (
        "hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings",
    )
    unsupported_if: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    parallel: bool = False
    attention_input: str | None = "hidden_states"

    def __post_init__(self) -> None:
        if self.parallel and self.residual_scale is not None:
            raise ValueError("a parallel LayerKind has no residual_scale")
        if not self.parallel and self.post_attention_norm is None:
            raise ValueError("a sequential LayerKind needs its post_attention_norm")


@dataclass(frozen=True)
class StackKind:
    """A module whose forward runs ``for layer in layers[:n]: h = layer(h, ...)`` and then ``final_norm(h)``
    with nothing else touching ``h``: the MLP residual add of layer ``i`` may then be fused with the input norm
    of layer ``i + 1`` (or the final norm)."""

    class_path: str
    layers: str = "layers"
    final_norm: str = "norm"


@dataclass(frozen=True)
class Family:
    name: str
    norms: tuple[NormKind, ...]
    layers: tuple[LayerKind, ...] = ()
    stacks: tuple[StackKind, ...] = ()


def _llama_shaped(
    name: str, package: str, prefix: str, *, dropouts: bool = False, residual_scale: str | None = None
) -> Family:
    """A family laid out like Llama: ``<prefix>RMSNorm``, ``<prefix>DecoderLayer`` and ``<prefix>Model`` in
    ``transformers.models.<package>.modeling_<package>``. ``dropouts`` adds Phi3's residual dropouts and
    ``residual_scale`` names the layer attribute Granite multiplies each residual branch by."""
    module = f"transformers.models.{package}.modeling_{package}"
    drop = {"attention_dropout": "resid_attn_dropout", "mlp_dropout": "resid_mlp_dropout"} if dropouts else {}
    return Family(
        name=name,
        norms=(NormKind(f"{module}.{prefix}RMSNorm"),),
        layers=(LayerKind(f"{module}.{prefix}DecoderLayer", residual_scale=residual_scale, **drop),),
        stacks=(StackKind(f"{module}.{prefix}Model"),),
    )


# Each entry was checked against transformers' source: the norm's forward is LlamaRMSNorm's, the layer's is the
# LayerKind body, and the model runs its layers then the final norm. Qwen3's q_norm / k_norm are Qwen3RMSNorm
# instances inside the attention, matched by class like the others.
FAMILIES: tuple[Family, ...] = (
    _llama_shaped("Llama", "llama", "Llama"),
    _llama_shaped("Mistral", "mistral", "Mistral"),
    _llama_shaped("Qwen2", "qwen2", "Qwen2"),
    _llama_shaped("Qwen3", "qwen3", "Qwen3"),
    _llama_shaped("Phi3", "phi3", "Phi3", dropouts=True),
    _llama_shaped("Ministral", "ministral", "Ministral"),
    _llama_shaped("SmolLM3", "smollm3", "SmolLM3"),
    _llama_shaped("Qwen2-MoE", "qwen2_moe", "Qwen2Moe"),
    _llama_shaped("Qwen3-MoE", "qwen3_moe", "Qwen3Moe"),
    _llama_shaped("Granite", "granite", "Granite", residual_scale="residual_multiplier"),
    # Pre-LN LayerNorm decoders of the same shape: their norms come from the LayerNorm conversion
    # (hf_rmsnorm.conversion), these entries only fuse their residual adds.
    Family(
        name="GPT-2",
        norms=(),
        layers=(LayerKind(
            "transformers.models.gpt2.modeling_gpt2.GPT2Block", input_norm="ln_1", attention="attn",
            post_attention_norm="ln_2", unsupported_if=("crossattention",),
            forward_params=("hidden_states", "cache", "attention_mask", "encoder_hidden_states",
                            "encoder_attention_mask", "use_cache"),
        ),),
        stacks=(StackKind("transformers.models.gpt2.modeling_gpt2.GPT2Model", layers="h", final_norm="ln_f"),),
    ),
    Family(
        name="GPT-NeoX",
        norms=(),
        # One layer class, two bodies: use_parallel_residual (the default) picks the parallel one.
        layers=tuple(
            LayerKind(
                "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer", attention="attention",
                attention_input=None, attention_dropout="post_attention_dropout", mlp_dropout="post_mlp_dropout",
                forward_params=("hidden_states", "attention_mask", "position_ids", "use_cache", "layer_past",
                                "position_embeddings"),
                **gate,
            )
            for gate in ({"unsupported_if": ("use_parallel_residual",)},
                         {"parallel": True, "requires": ("use_parallel_residual",)})
        ),
        stacks=(StackKind("transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXModel",
                          final_norm="final_layer_norm"),),
    ),
    Family(
        name="GPT-J",
        norms=(),
        layers=(LayerKind(
            "transformers.models.gptj.modeling_gptj.GPTJBlock", input_norm="ln_1", attention="attn",
            post_attention_norm=None, parallel=True,
        ),),
        stacks=(StackKind("transformers.models.gptj.modeling_gptj.GPTJModel", layers="h", final_norm="ln_f"),),
    ),
    Family(
        name="Phi",
        norms=(),
        layers=(LayerKind(
            "transformers.models.phi.modeling_phi.PhiDecoderLayer", post_attention_norm=None, parallel=True,
            attention_dropout="resid_dropout", mlp_dropout="resid_dropout",
        ),),
        stacks=(StackKind("transformers.models.phi.modeling_phi.PhiModel", final_norm="final_layernorm"),),
    ),
)


def family_names() -> str:
    """The RMSNorm families, for error messages (the LayerNorm ones are listed by ``hf_rmsnorm.conversion``)."""
    return ", ".join(f.name for f in FAMILIES if f.norms)


def resolve_class(path: str) -> type | None:
    """The class defined at ``module.Class``, or ``None`` when that module is not loaded (then no model can hold
    an instance of it, so nothing is imported here) or this transformers version has no such class.

    A name that another library rebound to its own class (some plugins assign their norm class into
    transformers' modeling modules) does not count: the class must say it was defined there.
    """
    module, _, name = path.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    if not isinstance(cls, type) or cls.__module__ != module or cls.__qualname__ != name:
        return None
    return cls


@dataclass(frozen=True)
class Registry:
    """Exact class -> (family name, kind) for every class of every family this installation has."""

    norms: dict[type, tuple[str, NormKind]]
    layers: dict[type, tuple[tuple[str, LayerKind], ...]]  # every kind of the class, in FAMILIES order
    stacks: dict[type, tuple[str, StackKind]]


def registry() -> Registry:
    """The classes of every family whose modeling module is loaded (cheap: a few dozen lookups)."""
    tables: dict[str, dict] = {"norms": {}, "layers": {}, "stacks": {}}
    for family in FAMILIES:
        for table, kinds in (("norms", family.norms), ("layers", family.layers), ("stacks", family.stacks)):
            for kind in kinds:
                cls = resolve_class(kind.class_path)
                if cls is None:
                    continue
                if table == "layers":
                    tables[table][cls] = tables[table].get(cls, ()) + ((family.name, kind),)
                else:
                    tables[table][cls] = (family.name, kind)
    return Registry(**tables)
