"""Model families the patcher knows, described as data: the one registry, RMSNorm and LayerNorm families alike.

Each family says which of its classes are norms (and how they cast), which are pre-norm decoder layers (and
the attribute names of their parts), and which module runs the layers and then a final norm. A LayerNorm family
also says, for its stack, which LayerNorms read the residual stream and which modules write into it. The patcher
has one walker and one fused layer body for all of them; adding a family of the same shape is adding an entry.

Classes are named by import path and looked up among the loaded modules at patch time, so a transformers
version without a family simply does not offer it. Matching is by exact class (never by name or subclass): a
norm of an unknown class is reported as skipped, never patched on a guess.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from .attributes import registered_parameter
from .shapes import PARALLEL, PARALLEL_RESIDUAL_FIRST, POST_NORM, SEQUENTIAL, LayerShape


@dataclass(frozen=True)
class NormKind:
    """A norm class and the numerics of its forward (the modes of ``hf_rmsnorm.ops.modes``). ``bias_attr`` names
    an optional bias: the attribute must exist, its value may be None. ``weight_attr`` is None for a norm without
    a weight (NanoChat's). ``eps_attr`` None: the forward's epsilon is the constant ``eps`` (OLMo's LayerNorm
    writes ``eps=1e-5`` in its code). ``weight_offset``: the forward scales by ``weight + weight_offset`` computed
    in the weight's own dtype, as a tensor op before the norm (Nemotron's ``LayerNorm1P``), which the fused forward
    does too (the kernels' ``weight_offset`` adds in fp32, which only an fp32 weight rounds alike)."""

    class_path: str
    eps_attr: str | None = "variance_epsilon"
    mode: str = "llama"
    bias_attr: str | None = None
    weight_attr: str | None = "weight"
    eps: float | None = None
    weight_offset: float = 0.0

    def argument_reader(self) -> Callable[[nn.Module], tuple[Tensor | None, float, Tensor | None]]:
        """A function of a norm ``module`` of this kind giving ``(weight, eps, bias)`` as the kernels take them, read
        at every call (the user may replace or edit them between calls); this kind's names and constants are held by
        the function rather than read from the kind each time (a decode call is bound by host time)."""
        eps_attr, weight_attr, bias_attr = self.eps_attr, self.weight_attr, self.bias_attr
        constant_eps, weight_offset = self.eps, self.weight_offset

        def arguments(module: nn.Module) -> tuple[Tensor | None, float, Tensor | None]:
            eps = constant_eps if eps_attr is None else getattr(module, eps_attr)
            weight = None if weight_attr is None else registered_parameter(module, weight_attr)
            if weight_offset:
                weight = weight + weight_offset
            bias = None if bias_attr is None else registered_parameter(module, bias_attr)
            return weight, eps, bias

        return arguments


# nn.LayerNorm is everywhere, so it is not matched through a family: every one gets the exact fused add + LayerNorm
# of the kernels (``hf_rmsnorm.patch.conversion``); the explicit conversion of a pre-LN model to RMSNorm gives the
# readers of a LayerNorm family's stream (``ResidualStream.norms``) the last.
LAYERNORM = NormKind("torch.nn.modules.normalization.LayerNorm", eps_attr="eps", mode="layernorm", bias_attr="bias")
LAYERNORM_WITHOUT_AFFINE = dataclasses.replace(LAYERNORM, weight_attr=None, bias_attr=None)
LAYERNORM_AS_RMSNORM = dataclasses.replace(LAYERNORM, mode="layernorm_as_rmsnorm")
# What the report calls the family of an nn.LayerNorm outside a registered LayerNorm stack.
EXACT_LAYERNORM_FAMILY = "LayerNorm"


# The decoder layers' cache argument is ``cache`` since transformers 5.24 and ``past_key_values`` before. Either
# way the layer hands it to its attention under the same name, which is all the fused bodies rely on: they pass
# every argument on by the installed class's own names (``fused.py``).
CACHE_PARAM = "cache"
CACHE_PARAM_SPELLINGS = (CACHE_PARAM, "past_key_values")


@dataclass(frozen=True)
class TokenMixer:
    """One token mixer of a hybrid layer: the module at ``attribute`` runs when the layer's switch attribute is
    ``switch_value``; the layer passes it every argument but ``dropped_args``; ``returns_pair``: it returns
    ``(states, attention weights)``. ``takes_cache_by_name``: the mixer's forward must have a parameter named as
    the layer's cache argument (transformers before 5.24 renamed it on the way, ``cache_params=past_key_values``,
    which a body passing arguments on by name would not do: such a layer keeps its own forward)."""

    switch_value: str
    attribute: str
    dropped_args: tuple[str, ...] = ()
    returns_pair: bool = True
    takes_cache_by_name: bool = False


@dataclass(frozen=True)
class LayerKind:
    """A decoder layer of one of the shapes of ``shapes.py`` (sequential pre-norm, post-norm, parallel pre-norm),
    with its attribute names (an attribute set to None is absent: no dropout, no scale, no norm there). The
    shape's docstring gives the forward it stands for, in these names; ``residual_scale`` is the layer attribute
    each sequential branch is multiplied by (Granite), and ``attention_input`` is the keyword the normed states
    go to the attention by, None for positionally.

    ``forward_params`` is the original forward's parameter list, spelt as in transformers 5.24 (see
    ``CACHE_PARAM_SPELLINGS`` for the one name earlier releases spell differently); the patcher checks it at
    patch time (``matches``), so a transformers release that changes the layer turns fusion off for it instead
    of running a stale body.
    ``unsupported_if`` names instance attributes that, when present and truthy, mean the layer does more than
    this body (GPT-2's cross-attention, GPT-NeoX's parallel residual): such a layer keeps its own forward.
    ``requires`` names instance attributes that must be present and truthy (GPT-NeoX's parallel kind requires
    ``use_parallel_residual``). ``mlp_output``: ``"tensor"``; ``"pair"`` when the mlp returns ``(states, router
    scores)`` and the layer keeps the first (GPT-OSS); ``"pair if tuple"`` when the layer unpacks only a tuple
    (Qwen3-Next's MoE and dense layers share a body). A hybrid layer (Qwen3-Next, Qwen3.5) picks its token mixer
    by the instance attribute ``mixer_switch`` among ``mixers``, instead of ``attention``.
    ``attention_dropped_args``: layer arguments the original does not pass to its attention (Llama4's
    ``position_ids``). ``mlp_output_as_residual``: the mlp output is viewed in the residual's shape before the add
    (Llama4's MoE returns flattened tokens). A class may have several kinds; the patcher takes the first that
    fits.
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
    shape: LayerShape = SEQUENTIAL
    attention_input: str | None = "hidden_states"
    mlp_output: str = "tensor"
    pre_mlp_norm: str | None = None
    post_mlp_norm: str | None = None
    mixer_switch: str | None = None
    mixers: tuple[TokenMixer, ...] = ()
    attention_dropped_args: tuple[str, ...] = ()
    mlp_output_as_residual: bool = False

    def matches(self, params: tuple[str, ...]) -> bool:
        """Whether an installed forward's parameter names (after ``self``) are ``forward_params``, the cache
        argument spelt either way."""
        return tuple(CACHE_PARAM if name in CACHE_PARAM_SPELLINGS else name for name in params) == self.forward_params

    def __post_init__(self) -> None:
        if self.mlp_output not in ("tensor", "pair", "pair if tuple"):
            raise ValueError(f"unknown mlp_output {self.mlp_output!r}")
        self.shape.validate(self)

    def mixer_for(self, switch_value: object) -> TokenMixer | None:
        """The token mixer a hybrid layer runs for ``switch_value``, None for an unknown value."""
        return next((m for m in self.mixers if m.switch_value == switch_value), None)

    # What the planner asks of every layer kind (``derived_sites.DerivedLayerKind`` answers it too).
    @property
    def fuses_inside(self) -> bool:
        """Whether the layer fuses a residual add into one of its own norms."""
        return bool(self.shape.inner_adds(self))

    @property
    def hands_off_last_add(self) -> bool:
        """Whether the layer's last residual add may go into the next norm's kernel."""
        return self.shape.hands_off_last_add(self)

    @property
    def last_add_inside(self) -> str | None:
        """The norm whose kernel computes the layer's last residual add inside the layer (a post-norm layer's), which
        a handoff chains with the next norm; None where the last add is the plain output add."""
        return self.shape.last_add_inside(self)

    @property
    def returns_tuple(self) -> bool:
        """Whether the layer returns a tuple, its hidden states first (the shapes' bodies return a tensor)."""
        return False

    @property
    def handoff_label(self) -> str:
        """What the report calls the add that goes into the next norm's kernel."""
        return self.shape.handoff_label

    @property
    def handoff_dropout(self) -> str | None:
        """The dropout whose activity keeps that add out of the next norm's kernel, if any."""
        return self.shape.handoff_dropout(self)

    @property
    def block(self) -> str:
        return self.shape.block

    @property
    def norms(self) -> tuple[str, ...]:
        """The attribute names of the layer's norms."""
        names = (self.input_norm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm)
        return tuple(n for n in names if n is not None)


def while_inactive(dropout: str | None) -> str:
    """The report's note on an add fused only while a residual dropout is inactive."""
    return "" if dropout is None else f" (while {dropout} is inactive)"


@dataclass(frozen=True)
class ResidualStream:
    """The residual stream of a LayerNorm decoder's layers: ``norms`` are the LayerNorms that read it and
    ``writers`` the modules whose outputs are added to it, as paths inside each layer (a path whose module is
    absent or None is skipped: Falcon and StableLM build different norms per config). ``not_pre_ln`` says why an
    instance is not a pre-LN model (its norms read residual sums), which rules out the conversion to RMSNorm."""

    norms: tuple[str, ...]
    writers: tuple[str, ...]
    not_pre_ln: Callable[[nn.Module], str | None] | None = None


@dataclass(frozen=True)
class StackKind:
    """A module whose forward runs ``for layer in layers[:n]: h = layer(h, ...)`` and then ``final_norm(h)``
    with nothing else touching ``h``: the MLP residual add of layer ``i`` may then be fused with the input norm
    of layer ``i + 1`` (or the final norm; None for a stack whose last layer's output goes elsewhere, as a stack
    derived from its code may have: ``derived_loops.stack_kind``). ``stream`` is set for LayerNorm families."""

    class_path: str
    layers: str = "layers"
    final_norm: str | None = "norm"
    stream: ResidualStream | None = None


@dataclass(frozen=True)
class Family:
    name: str
    norms: tuple[NormKind, ...] = ()
    layers: tuple[LayerKind, ...] = ()
    stacks: tuple[StackKind, ...] = ()

    @property
    def normalises_with_layernorm(self) -> bool:
        return any(stack.stream is not None for stack in self.stacks)


def _opt_not_pre_ln(decoder: nn.Module) -> str | None:
    if not decoder.config.do_layer_norm_before:
        return "it is post-LN (do_layer_norm_before=False, as OPT-350m): its LayerNorms read the residual sums"
    return None


_M = "transformers.models"


def _llama_shaped(
    name: str, package: str, prefix: str, *, dropouts: bool = False, residual_scale: str | None = None
) -> Family:
    """A family laid out like Llama: ``<prefix>RMSNorm``, ``<prefix>DecoderLayer`` and ``<prefix>Model`` in
    ``transformers.models.<package>.modeling_<package>``. ``dropouts`` adds Phi3's residual dropouts and
    ``residual_scale`` names the layer attribute Granite multiplies each residual branch by."""
    module = f"{_M}.{package}.modeling_{package}"
    drop = {"attention_dropout": "resid_attn_dropout", "mlp_dropout": "resid_mlp_dropout"} if dropouts else {}
    return Family(
        name=name,
        norms=(NormKind(f"{module}.{prefix}RMSNorm"),),
        layers=(LayerKind(f"{module}.{prefix}DecoderLayer", residual_scale=residual_scale, **drop),),
        stacks=(StackKind(f"{module}.{prefix}Model"),),
    )


_HYBRID_MIXERS = (
    TokenMixer("linear_attention", "linear_attn", dropped_args=("position_embeddings", "position_ids"),
               returns_pair=False, takes_cache_by_name=True),
    TokenMixer("full_attention", "self_attn"),
)


def _hybrid(name: str, package: str, prefix: str, model: str, mlp_output: str) -> Family:
    """A hybrid family laid out like Qwen3-Next: ``<prefix>DecoderLayer`` and ``model`` in
    ``transformers.models.<package>.modeling_<package>``; its norms are recognised by their numerics."""
    module = f"{_M}.{package}.modeling_{package}"
    return Family(
        name=name,
        layers=(LayerKind(
            f"{module}.{prefix}DecoderLayer", mixer_switch="block_type", mixers=_HYBRID_MIXERS, mlp_output=mlp_output,
            forward_params=("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"),
        ),),
        stacks=(StackKind(f"{module}.{model}"),),
    )


# Each entry was checked against transformers' source: the norm's forward is LlamaRMSNorm's (unless the entry
# names another mode; tests/patch/test_norm_numerics.py probes every entry), the layer's is the LayerKind body, and
# the model runs its layers then the final norm. Qwen3's q_norm / k_norm are Qwen3RMSNorm instances inside the
# attention, matched by class like the others.
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
    # LayerNorm decoders. Their stacks name the LayerNorms on the residual stream, which run the fused LayerNorm
    # kernels; the layers of the ones shaped like a LayerKind also get their residual adds fused.
    # Mixtral and GPT-OSS: Llama's layer body with their own parameter order (the body passes every argument on
    # by name, so the order does not matter); GPT-OSS's MoE returns (states, router scores). Their models run the
    # layers then the final norm. Mixtral's norm is Llama's code; GPT-OSS's multiplies by its weight in fp32 and
    # rounds once, ``(w * n).to(x.dtype)`` (OLMo2's order), and its checkpoints keep the norms in fp32
    # (``_keep_in_fp32_modules``) while the activations are bf16. The patcher checks every entry's mode against
    # the class's own forward at patch time (``recognition.py``).
    Family(
        name="Mixtral",
        norms=(NormKind(f"{_M}.mixtral.modeling_mixtral.MixtralRMSNorm"),),
        layers=(LayerKind(f"{_M}.mixtral.modeling_mixtral.MixtralDecoderLayer", forward_params=(
            "hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache")),),
        stacks=(StackKind(f"{_M}.mixtral.modeling_mixtral.MixtralModel"),),
    ),
    Family(
        name="GPT-OSS",
        norms=(NormKind(f"{_M}.gpt_oss.modeling_gpt_oss.GptOssRMSNorm", mode="fp32_affine"),),
        layers=(LayerKind(f"{_M}.gpt_oss.modeling_gpt_oss.GptOssDecoderLayer", mlp_output="pair"),),
        stacks=(StackKind(f"{_M}.gpt_oss.modeling_gpt_oss.GptOssModel"),),
    ),
    # Llama4's text layers: the feed-forward is an MoE on some layers (a pair, flattened tokens), the attention is
    # not given position_ids.
    Family(
        name="Llama4",
        layers=(LayerKind(
            f"{_M}.llama4.modeling_llama4.Llama4TextDecoderLayer", mlp="feed_forward", mlp_output="pair if tuple",
            mlp_output_as_residual=True, attention_dropped_args=("position_ids",),
        ),),
        stacks=(StackKind(f"{_M}.llama4.modeling_llama4.Llama4TextModel"),),
    ),
    # Hybrid stacks: linear-attention and attention layers share the residual stream; each layer runs one token
    # mixer, chosen by its block_type (the linear one is not given the rotary arguments and returns one tensor).
    # Their gated norms (inside the linear attention) take a second argument and stay unpatched, with the reason.
    _hybrid("Qwen3-Next", "qwen3_next", "Qwen3Next", "Qwen3NextModel", "pair if tuple"),
    _hybrid("Qwen3.5", "qwen3_5", "Qwen3_5", "Qwen3_5TextModel", "tensor"),
    _hybrid("Qwen3.5-MoE", "qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeTextModel", "pair if tuple"),
    # Cohere's parallel block adds the attention to the stream before the MLP, (h + attention) + mlp; its own
    # mean-centred LayerNorm classes are recognised by their numerics (the layernorm mode). Cohere2's layer takes
    # its arguments in another order and gives its attention no position_ids.
    Family(
        name="Cohere",
        layers=(LayerKind(f"{_M}.cohere.modeling_cohere.CohereDecoderLayer", post_attention_norm=None,
                          shape=PARALLEL_RESIDUAL_FIRST),),
        stacks=(StackKind(f"{_M}.cohere.modeling_cohere.CohereModel"),),
    ),
    Family(
        name="Cohere2",
        layers=(LayerKind(
            f"{_M}.cohere2.modeling_cohere2.Cohere2DecoderLayer", post_attention_norm=None,
            shape=PARALLEL_RESIDUAL_FIRST,
            forward_params=("hidden_states", "position_embeddings", "attention_mask", "cache", "use_cache"),
        ),),
        stacks=(StackKind(f"{_M}.cohere2.modeling_cohere2.Cohere2Model"),),
    ),
    # Post-norm layers (OLMo3's and Exaone4's are the same code, recognised by it); the models of these families
    # end their layers with a norm of the branch, so nothing is fused across layers.
    Family(
        name="OLMo2",
        layers=(LayerKind(f"{_M}.olmo2.modeling_olmo2.Olmo2DecoderLayer", input_norm=None, shape=POST_NORM,
                          post_mlp_norm="post_feedforward_layernorm"),),
    ),
    # Sandwich layers: a norm before and after each branch. The adds after the branches are fused with the norms
    # before them; the norms before the branches run alone (fusing them too would take norm, add and norm in one
    # kernel).
    *(
        Family(name=name, layers=(LayerKind(
            f"{_M}.{package}.modeling_{package}.{prefix}DecoderLayer", shape=POST_NORM,
            pre_mlp_norm="pre_feedforward_layernorm", post_mlp_norm="post_feedforward_layernorm",
            forward_params=("hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache"),
        ),))
        for name, package, prefix in (("Gemma2", "gemma2", "Gemma2"), ("Gemma3", "gemma3", "Gemma3"))
    ),
    Family(name="GLM4", layers=(LayerKind(
        f"{_M}.glm4.modeling_glm4.Glm4DecoderLayer", shape=POST_NORM, post_attention_norm="post_self_attn_layernorm",
        pre_mlp_norm="post_attention_layernorm", post_mlp_norm="post_mlp_layernorm",
    ),)),
    # Models whose layers are Llama's code (recognised by it), with a model forward that differs from Llama's only
    # outside the loop (Gemma scales the embeddings, DeepSeek-V3 and Qwen2.5-VL build their masks and positions
    # differently) and runs the layers then the final norm.
    Family(name="Gemma", stacks=(StackKind(f"{_M}.gemma.modeling_gemma.GemmaModel"),)),
    Family(name="DeepSeek-V3", stacks=(StackKind(f"{_M}.deepseek_v3.modeling_deepseek_v3.DeepseekV3Model"),)),
    # Qwen2.5-VL's and Qwen3-VL's language models: Llama's layer body (Qwen2.5-VL's differs only in an
    # annotation, Qwen3-VL's in its parameter order). Qwen3-VL's model adds visual features to the hidden state
    # between layers (deepstack), so its adds across layers are not fused.
    Family(
        name="Qwen2.5-VL",
        layers=(LayerKind(f"{_M}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLDecoderLayer"),),
        stacks=(StackKind(f"{_M}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLTextModel"),),
    ),
    Family(
        name="Qwen3-VL",
        layers=(LayerKind(f"{_M}.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextDecoderLayer", forward_params=(
            "hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache", "use_cache")),),
    ),
    # NanoChat: its layer is Llama's code and its norm (no weight) is recognised by its numerics
    # (``recognition.py``); its model also runs the final norm once before the layers, on the embeddings, which
    # no layer hands anything to, so the handoff of the last layer's sum to the final norm stays exact.
    Family(name="NanoChat", stacks=(StackKind(f"{_M}.nanochat.modeling_nanochat.NanoChatModel"),)),
    Family(
        name="GPT-2",
        layers=(LayerKind(
            f"{_M}.gpt2.modeling_gpt2.GPT2Block", input_norm="ln_1", attention="attn",
            post_attention_norm="ln_2", unsupported_if=("crossattention",),
            forward_params=("hidden_states", "cache", "attention_mask", "encoder_hidden_states",
                            "encoder_attention_mask", "use_cache"),
        ),),
        stacks=(StackKind(
            f"{_M}.gpt2.modeling_gpt2.GPT2Model", layers="h", final_norm="ln_f",
            stream=ResidualStream(norms=("ln_1", "ln_cross_attn", "ln_2"),
                                  writers=("attn.c_proj", "crossattention.c_proj", "mlp.c_proj")),
        ),),
    ),
    Family(
        name="GPT-NeoX",
        # One layer class, two bodies: use_parallel_residual (the default) picks the parallel one.
        layers=tuple(
            LayerKind(
                f"{_M}.gpt_neox.modeling_gpt_neox.GPTNeoXLayer", attention="attention",
                attention_input=None, attention_dropout="post_attention_dropout", mlp_dropout="post_mlp_dropout",
                forward_params=("hidden_states", "attention_mask", "position_ids", "use_cache", "layer_past",
                                "position_embeddings"),
                **gate,
            )
            for gate in ({"unsupported_if": ("use_parallel_residual",)},
                         {"shape": PARALLEL, "requires": ("use_parallel_residual",)})
        ),
        stacks=(StackKind(
            f"{_M}.gpt_neox.modeling_gpt_neox.GPTNeoXModel", final_norm="final_layer_norm",
            stream=ResidualStream(norms=("input_layernorm", "post_attention_layernorm"),
                                  writers=("attention.dense", "mlp.dense_4h_to_h")),
        ),),
    ),
    Family(
        name="OPT",
        stacks=(StackKind(
            f"{_M}.opt.modeling_opt.OPTDecoder", final_norm="final_layer_norm",
            stream=ResidualStream(norms=("self_attn_layer_norm", "final_layer_norm"),
                                  writers=("self_attn.out_proj", "fc2"), not_pre_ln=_opt_not_pre_ln),
        ),),
    ),
    Family(
        name="Phi",
        layers=(LayerKind(
            f"{_M}.phi.modeling_phi.PhiDecoderLayer", post_attention_norm=None, shape=PARALLEL,
            attention_dropout="resid_dropout", mlp_dropout="resid_dropout",
        ),),
        stacks=(StackKind(
            f"{_M}.phi.modeling_phi.PhiModel", final_norm="final_layernorm",
            stream=ResidualStream(norms=("input_layernorm",), writers=("self_attn.dense", "mlp.fc2")),
        ),),
    ),
    Family(
        name="Falcon",
        stacks=(StackKind(
            f"{_M}.falcon.modeling_falcon.FalconModel", layers="h", final_norm="ln_f",
            stream=ResidualStream(norms=("input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp"),
                                  writers=("self_attention.dense", "mlp.dense_4h_to_h")),
        ),),
    ),
    Family(
        name="GPT-J",
        layers=(LayerKind(
            f"{_M}.gptj.modeling_gptj.GPTJBlock", input_norm="ln_1", attention="attn",
            post_attention_norm=None, shape=PARALLEL,
        ),),
        stacks=(StackKind(
            f"{_M}.gptj.modeling_gptj.GPTJModel", layers="h", final_norm="ln_f",
            stream=ResidualStream(norms=("ln_1",), writers=("attn.out_proj", "mlp.fc_out")),
        ),),
    ),
    Family(
        name="StableLM",
        stacks=(StackKind(
            f"{_M}.stablelm.modeling_stablelm.StableLmModel",
            stream=ResidualStream(norms=("input_layernorm", "post_attention_layernorm"),
                                  writers=("self_attn.o_proj", "mlp.down_proj")),
        ),),
    ),
)


def family_names() -> str:
    """Every supported family, in one line."""
    rms = ", ".join(f.name for f in FAMILIES if not f.normalises_with_layernorm)
    layernorm = ", ".join(f.name for f in FAMILIES if f.normalises_with_layernorm)
    return f"{rms}; LayerNorm models: {layernorm}"


def class_at(path: str, *, importing: bool = False) -> type | None:
    """The class defined at ``module.Class``, or ``None`` when this transformers version has no such class or,
    unless ``importing``, when that module is not loaded (then no model can hold an instance of it, so nothing is
    imported: what the registry wants). ``importing`` imports the module: the code of a registered class is
    ``recognition``'s reference even when the model being patched does not use that class.

    A name that another library rebound to its own class (some plugins assign their norm class into
    transformers' modeling modules) does not count: the class must say it was defined there.
    """
    module, _, name = path.rpartition(".")
    if importing:
        try:
            importlib.import_module(module)
        except ImportError:
            return None
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
                cls = class_at(kind.class_path)
                if cls is None:
                    continue
                if table == "layers":
                    tables[table][cls] = tables[table].get(cls, ()) + ((family.name, kind),)
                else:
                    tables[table][cls] = (family.name, kind)
    return Registry(**tables)
