"""Which of the installed transformers' causal LMs, encoders and encoder-decoders ``patch_model`` covers, and with
what parity: behind ``scripts/coverage.py``.

Two tables. For each model type with a causal-LM class (``CAUSAL_LM``), a tiny random model is built from the
type's default config, patched, and checked on one batch (a forward without cache), on its logits. For each
encoder and encoder-decoder type (``ENCODER``: every masked-LM and seq2seq type, and ``NAMED_ENCODER_TYPES``), the
same with its base model, on its first output (the last hidden state), given token ids, images or audio features
as its main input takes (``_inputs``). The tiny config is the default's fields with the ``TINY`` sizes,
cut to one layer of each kind the full model has (per-layer lists and overrides with it), made again through the
config class, so that its ``__post_init__`` derives the sizes that depend on others and its validation runs; a few
model types whose default config is unusable as shipped get ``DEFAULT_OVERRIDES`` / ``OVERRIDES`` (data, each with
why). Before the check every norm gets trained-like parameters (``randomise_norms``): a fresh model's weight of
ones and bias of zeros would hide a norm run in the wrong casting order. The check:

* fp32: the patched logits within ``FP32_TOLERANCE`` of the eager model's (relative to the largest logit), and
  the same top-1 token everywhere the eager model's top-1 beats its top-2 by more than that tolerance;
* bf16: the patched model no less accurate against an fp64 copy than the eager model: its largest error within
  one bf16 ulp of the largest logit of the eager model's, its mean error within ``BF16_MEAN_SLACK`` of it.

Each model type gets one verdict: ``fused`` (norms patched and residual adds fused), ``norms only`` (norms
patched, adds left alone), ``skipped`` (patch_model refused it: the reason), ``failed`` (patched but parity
broke: a bug), ``not run`` (built, but its own eager model failed on the check's inputs, or the check ran out of
time: the reason), or ``not built`` (no tiny model could be made from its config here: the reason). The page's
headline is over every model type that uses an RMSNorm, built or not: one that could not be built counts when its
modeling code names an RMSNorm class (``modeling_has_rmsnorm``); the model types that normalise with a LayerNorm
and no RMSNorm are counted apart (``norm_type``). The encoder table's headline (``encoder_headline``) is over the
types ``NAMED_ENCODER_TYPES`` lists, then every type of that table by norm type. The kernels run wherever the
process set them up (Triton's interpreter on CPU).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import json
import re
import signal
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from hf_rmsnorm.patch import UnsupportedModelError, check_model, patch_model
from hf_rmsnorm.patch.classify import Role, norm_role
from hf_rmsnorm.patch.qk_attention import UNFUSED

from . import residual_census

# Config fields shrunk when the default config (or one of its sub-configs: text, vision, ...) has them as positive
# ints (0 often means "none of these"); never grown (a default of one expert per token, or one KV head, stays).
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, intermediate_size_mlp=128, sliding_window=4,
    d_model=64, n_embd=64, n_layer=2, n_head=4, num_layers=2, ffn_dim=128, encoder_layers=2, decoder_layers=2,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8,
    n_group=1, topk_group=1, depth=2, num_heads=4, embed_dim=64, projection_dim=64, out_hidden_size=64,
    vision_output_dim=64, text_hidden_size=64, index_n_heads=4, index_head_dim=16, mamba_n_heads=8, mamba_d_head=16,
    mamba_d_state=16, state_size=16, n_groups=1, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
    n_heads=4, ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2, zero_expert_num=2, embedding_dim=64,
    num_blocks=2, adapter_in_dim=64, adapter_out_dim=64, adapter_input_size=64, hidden_size_global=64,
    encoder_hash_byte_group_vocab=128, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
    decoder_ffn_dim=128, d_head=16, emb_dim=64, mamba_d_ssm=64,
)
# Sizes a default config may leave None where the modeling code reads them unguarded.
TINY_WHEN_NONE = ("head_dim", "num_key_value_heads", "num_experts_per_tok")
# Pairs of fields kept equal where the default has them equal: a key and value per query head (MLA needs one), the
# rotary dims of MLA's head_dim.
TIED = (("num_key_value_heads", "num_attention_heads"), ("head_dim", "qk_rope_head_dim"))
# The fields counting a config's layers, by family.
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Fields counting the first or last layers that are of another kind (dense before MoE ones, layers sharing the KV
# cache of earlier ones): recounted over the layers kept.
LAYER_SUBSETS = {"first_k_dense_replace": "first", "num_dense_layers": "first", "num_kv_shared_layers": "last"}
# The most layers a tiny model keeps: one of each kind the full model has (attention, MLP, per-layer overrides).
MAX_LAYERS = 4
# Fields set on a model type's default config where it is not valid as transformers ships it.
DEFAULT_OVERRIDES: dict[str, dict] = {
    # Its text config's defaults are Gemma 4's, which the assistant's validation refuses.
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
}
# Qwen4-Exp's indexed-attention layers need the QSA indexer's sizes, which its default leaves unset.
QWEN4_EXP_INDEXER = dict(
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
# Fields set on a model type's shrunk config where no generic rule makes it consistent.
OVERRIDES: dict[str, dict] = {
    # Its rotary embedding reads one set of rope parameters per layer type; its default has one for all.
    "cohere_compass_text": dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e4))),
    # Its attention reads the rope theta and the qkv clip from its attention config: the default has neither.
    "dbrx": dict(attn_config=dict(rope_theta=1e4, clip_qkv=8.0)),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),  # its default has MoE layers but no experts
    # Its default leaves the q/k norms out; GLM-4.5, 4.6 and 4.7 as released have them (use_qk_norm true).
    "glm4_moe": dict(use_qk_norm=True),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # its layers' kinds, as (pattern, repeats)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # its default has no layer types
    "mamba2": dict(expand=1),  # heads x head dim must be expand x hidden: TINY's 4 x 16 = 1 x 64
    # Its embeddings keep the default's 768 wide, projected into the shrunk stream (project_in), which the census
    # would take for the stream's width: every OPT but 350m has them as wide as the stream.
    "opt": dict(word_embed_proj_dim=64),
    "qwen4_exp": dict(text_config=QWEN4_EXP_INDEXER),
    "qwen4_exp_text": QWEN4_EXP_INDEXER,
    # Its LM head refuses an encoder (the default); its axial position embeddings add up to the hidden size.
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32]),
    # Its hybrid layers share one transformer block, which transformers cannot tie with a single hybrid layer.
    # Its attention runs over the hidden state and the embeddings side by side: twice the width, split over 4 heads.
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=8),
}
# The encoder and encoder-decoder types the page's second table checks besides every masked-LM and seq2seq type:
# those issue 30 names (the vision and text towers of CLIP and SigLIP are types of their own). T5 normalises with an
# RMSNorm of its own casting order: it is named here, and counted with the RMSNorm types in the table's other lines.
NAMED_ENCODER_TYPES = (
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "mpnet",
    "modernbert", "camembert", "vit", "clip_vision_model", "clip_text_model", "siglip_vision_model",
    "siglip_text_model", "whisper", "bart", "mbart", "marian", "pegasus", "t5",
)
# The base-model classes of the towers that no auto mapping names.
TOWER_CLASSES = {"siglip_text_model": "SiglipTextModel"}
# Fields set on an encoder type's shrunk config: images and audio as small as the sizes TINY sets.
ENCODER_OVERRIDES: dict[str, dict] = {
    **{t: dict(image_size=32, patch_size=8) for t in ("vit", "clip_vision_model", "siglip_vision_model")},
    "whisper": dict(max_source_positions=16, num_mel_bins=16),  # its encoder reads 2 x 16 frames of 16 bins
    "squeezebert": dict(embedding_size=64),  # its embeddings must be as wide as its (shrunk) stream
    "esm": dict(vocab_size=33, pad_token_id=1, mask_token_id=32),  # its default has no vocabulary (ESM-2's is 33)
}
# The largest model built: a type whose sizes the shrinking misses stays small enough for a CPU check.
MAX_PARAMETERS = 20_000_000
FP32_TOLERANCE = 1e-4
# How the checkpointed census forward checkpoints every layer: transformers' default kind.
CHECKPOINTING = {"use_reentrant": False}
BF16_MEAN_SLACK = 1.10
BATCH, SEQ = 2, 8
# Spread of a trained checkpoint's norm parameters around their initial values (``randomise_norms``).
TRAINED_STD = 0.3
VERDICTS = ("fused", "norms only", "skipped", "failed", "not run", "not built")
CAUSAL_LM, ENCODER = "causal LM", "encoder"
NORM_TYPES = ("RMSNorm", "LayerNorm", "neither")


@dataclass
class Coverage:
    """The verdict on one model type, with what was measured."""

    model_type: str
    model_class: str
    verdict: str
    reason: str = ""
    # Which table: ``CAUSAL_LM`` (logits of the causal-LM class) or ``ENCODER`` (the base model's first output,
    # its last hidden state, for the encoder and encoder-decoder types).
    table: str = "causal LM"
    norms: int = 0
    fused_adds: int = 0
    skipped_modules: int = 0
    uses_rmsnorm: bool | None = None  # an RMSNorm module in the model built; None: not built, unknown
    uses_layernorm: bool | None = None  # a LayerNorm module (``_is_layer_norm``) in the model built; None: unknown
    rmsnorm_in_code: bool | None = None  # an RMSNorm in its modeling code, read not run (``modeling_has_rmsnorm``)
    fp32_max_err: float | None = None
    bf16_mean_err_ratio: float | None = None
    seconds: float = 0.0
    # In one fp32 forward (``residual_census``): the adds next to a patched norm in the unpatched model, and the
    # adds the patched model's norm kernels made instead. None: not measured.
    adds_next_to_norms: int | None = None
    adds_fused_in_forward: int | None = None
    # The adds the patched model's kernels made in a compiled forward (``torch.compile``, Dynamo with its eager
    # backend, graph breaks allowed) and in a checkpointed training forward (``CHECKPOINTING`` on every layer).
    # None: not measured, ``unmeasured`` says why.
    adds_fused_compiled: int | None = None
    adds_fused_checkpointed: int | None = None
    unmeasured: str = ""
    # The code sites (file:line, one per add run) of those adds still run apart in the patched model.
    unfused_add_sites: list[str] = dataclasses.field(default_factory=list)
    # Attention modules calling two patched norms (``hf_rmsnorm.patch.qk_attention``): those whose q/k norms and
    # RoPE run as one launch, and why the others do not (each reason once).
    qk_fused: int = 0
    qk_unfused: list[str] = dataclasses.field(default_factory=list)

    @property
    def fuses_every_add(self) -> bool:
        """Patched with parity, with every add next to a patched norm fused (none counts): at least as many adds
        fused as counted, none of those counted still run apart (an embedding sum, which the census does not count
        as a residual add, may be fused besides)."""
        return (self.verdict in ("fused", "norms only") and self.adds_fused_in_forward is not None
                and self.adds_fused_in_forward >= self.adds_next_to_norms and not self.unfused_add_sites)

    def fuses_fewer_than_eager(self) -> list[str]:
        """The compiled and checkpointed forwards that fuse fewer adds than the eager one (or were not measured)."""
        counts = (("compiled", self.adds_fused_compiled), ("checkpointed", self.adds_fused_checkpointed))
        return [f"{run} {'not measured' if n is None else n}" for run, n in counts if n != self.adds_fused_in_forward]


# A line of modeling code (not a comment) naming an RMSNorm class: its own, an import, or torch.nn.RMSNorm.
_RMSNORM_IN_CODE = re.compile(r"^(?!\s*#).*?\b\w*RMSNorm\b", re.MULTILINE)


class _Timeout(Exception):
    pass


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_count(spec: dict) -> tuple[str, int] | None:
    """The field of ``spec`` that counts its layers, and the count."""
    return next(((name, spec[name]) for name in LAYER_COUNTS if _is_int(spec.get(name))), None)


def _per_layer_overrides(spec: dict) -> dict[int, dict]:
    """A heterogeneous config's per-layer overrides, by layer index."""
    overrides = spec.get("per_layer_config")
    return {int(i): o for i, o in overrides.items()} if isinstance(overrides, dict) else {}


def _per_layer_lists(spec: dict, n_layers: int) -> dict[str, list]:
    """The fields of ``spec`` holding one entry per layer (layer kinds, per-layer flags or sizes)."""
    return {name: value for name, value in spec.items() if isinstance(value, list) and len(value) == n_layers > 1}


def _in_subset(field: str, value: int, layer: int, n_layers: int) -> bool:
    return layer < value if LAYER_SUBSETS[field] == "first" else layer >= n_layers - value


def _kept_layers(spec: dict, n_layers: int) -> list[int]:
    """The layers of the full model the tiny one is made of: the first of each distinct kind of layer (its entries
    in the per-layer fields but the sizes ``TINY`` sets anyway, its overrides, the ``LAYER_SUBSETS`` it is in),
    cycled to ``TINY``'s depth or as many kinds as there are, up to ``MAX_LAYERS`` (hybrid models need each)."""
    lists = [v for k, v in _per_layer_lists(spec, n_layers).items() if k not in TINY]
    overrides = _per_layer_overrides(spec)
    subsets = {k: v for k, v in spec.items() if k in LAYER_SUBSETS and _is_int(v)}
    firsts: dict[str, int] = {}
    for i in range(n_layers):
        kind = [v[i] for v in lists] + [overrides.get(i)] + [_in_subset(k, v, i, n_layers) for k, v in subsets.items()]
        firsts.setdefault(repr(kind), i)
    depth = min(max(TINY["num_hidden_layers"], len(firsts)), MAX_LAYERS, n_layers)
    return (list(firsts.values()) * depth)[:depth]


def _cut_to_layers(spec: dict, out: dict) -> None:
    """Cuts ``out`` (``spec`` shrunk) to the layers ``_kept_layers`` keeps: the layer count, per-layer lists and
    overrides, and the ``LAYER_SUBSETS`` counts."""
    name, n_layers = _layer_count(spec)
    kept = _kept_layers(spec, n_layers)
    out[name] = len(kept)
    for field, values in _per_layer_lists(spec, n_layers).items():
        out[field] = [TINY[field] if field in TINY and _is_int(values[i]) else values[i] for i in kept]
    for field, value in spec.items():
        if field in LAYER_SUBSETS and _is_int(value):
            out[field] = sum(_in_subset(field, value, i, n_layers) for i in kept)
    if "per_layer_config" in spec:
        overrides = _per_layer_overrides(out)
        out["per_layer_config"] = {str(new): overrides[old] for new, old in enumerate(kept) if old in overrides}


def _shrunk(spec: dict) -> dict:
    """``spec`` (a config's fields, or a part of them) with the ``TINY`` sizes and cut to the layers kept,
    recursively into sub-configs and per-layer overrides."""
    out = {name: _shrunk(value) if isinstance(value, dict) else value for name, value in spec.items()}
    for name, tiny in TINY.items():
        value = out.get(name)
        if _is_int(value) and value > 0:
            out[name] = min(value, tiny)
        elif name in out and value is None and name in TINY_WHEN_NONE:
            out[name] = tiny
    if _layer_count(spec) is not None:
        _cut_to_layers(spec, out)
    for field, other in TIED:
        if _is_int(spec.get(field)) and spec[field] == spec.get(other):
            out[field] = out[other]
    if _is_int(spec.get("qk_head_dim")) and _is_int(spec.get("qk_nope_head_dim")):  # MLA's, where it is a field
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if _is_int(out.get(token)) and out[token] >= TINY["vocab_size"]:
            out[token] = 0
    return out


def _merged(spec: dict, overrides: dict) -> dict:
    """``spec`` with ``overrides`` set, into its sub-configs where an override is a dict for one."""
    out = dict(spec)
    for name, value in overrides.items():
        is_sub = isinstance(value, dict) and isinstance(spec.get(name), dict) and "model_type" in spec[name]
        out[name] = _merged(spec[name], value) if is_sub else value
    return out


def _fields(config) -> dict:
    """The fields ``config`` is made from, its sub-configs' as dicts of theirs: what its ``__post_init__`` derived
    is left out, so that the tiny config derives it again from the shrunk sizes (MLA's ``qk_head_dim``, ...)."""
    from transformers import PretrainedConfig

    config.allow_global_per_layer_attribute_access = True  # heterogeneous configs: every field, in to_dict() too
    values = config.to_dict()
    names = {f.name for f in dataclasses.fields(config)} | {"model_type", "per_layer_config"}
    return {name: _fields(getattr(config, name)) if isinstance(getattr(config, name, None), PretrainedConfig)
            else values[name] for name in values if name in names}


def _tiny_config(model_type: str, table: str = CAUSAL_LM):
    """The default config of ``model_type`` shrunk, made again from its fields, so that its own ``__post_init__``
    derives the sizes that depend on others and its validation runs."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, **DEFAULT_OVERRIDES.get(model_type, {}))
    overrides = OVERRIDES.get(model_type, {}) if table == CAUSAL_LM else ENCODER_OVERRIDES.get(model_type, {})
    return type(default).from_dict(_merged(_shrunk(_fields(default)), overrides))


def _model_class(table: str, class_name: str):
    """What builds a table's model from a config: the auto causal LM, or the base model's class ``class_name`` (any
    head is the base model plus a head; SigLIP's text tower has no auto mapping of its own)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config if table == CAUSAL_LM else getattr(
        transformers, class_name)._from_config


def _build(model_type: str, table: str = CAUSAL_LM, class_name: str = ""):
    config = _tiny_config(model_type, table)
    from_config = _model_class(table, class_name)
    with torch.device("meta"):
        size = sum(p.numel() for p in from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters after shrinking its config")
    torch.manual_seed(0)
    # Eager experts: the grouped-GEMM ones of MoE models have no fp64 kernel for the fp64 reference.
    model = from_config(config, experts_implementation="eager")
    randomise_norms(model)
    return model.eval()


def randomise_norms(model: torch.nn.Module) -> None:
    """Gives every norm of ``model`` the parameters a trained checkpoint has rather than its initial ones (a
    weight of ones and a bias of zeros round alike in every casting order, so a misapplied order would not show):
    a weight ~ N(1, ``TRAINED_STD``), or N(0, ``TRAINED_STD``) where it starts at zeros (Gemma-style norms scale by
    ``1 + w``), and a bias ~ N(0, ``TRAINED_STD``)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if not _is_norm(module):
                continue
            for name, param in module.named_parameters(recurse=False):
                if param.dim() != 1:  # a norm's scale and shift are per channel; anything else is not one
                    continue
                if name == "weight":
                    mean = 0.0 if not param.any() else 1.0
                elif name == "bias":
                    mean = 0.0
                else:
                    continue
                param.copy_(torch.randn(param.shape, generator=gen) * TRAINED_STD + mean)


def _is_norm(module: torch.nn.Module) -> bool:
    # Every norm class says so in its name: nn.LayerNorm, nn.RMSNorm, the models' own *RMSNorm / *LayerNorm.
    return "Norm" in type(module).__name__


def _logits(model, ids) -> torch.Tensor:
    """A causal LM's logits, or an encoder's first output (its last hidden state; a decoder's, of an
    encoder-decoder), for the inputs ``ids`` (``_inputs``: token ids, or a dict of the model's inputs, whose floating
    ones are cast to the model's dtype)."""
    with torch.no_grad():  # no cache: one forward needs none, and some hybrid caches cannot be asked their length
        if isinstance(ids, Tensor):
            return model(ids, use_cache=False).logits.double()
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ids.items()}
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs["use_cache"] = False
        return model(**kwargs)[0].double()


def _inputs(model, table: str) -> Tensor | dict[str, Tensor]:
    """One batch for ``model``: token ids for a causal LM; for an encoder, what its main input is (token ids, images
    or audio features of its config's sizes), and the same ids for the decoder of an encoder-decoder."""
    gen = torch.Generator().manual_seed(1)
    config = model.config
    if table == CAUSAL_LM or model.main_input_name == "input_ids":
        vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) or config.vocab_size
        ids = torch.randint(3, min(TINY["vocab_size"], vocab), (BATCH, SEQ), generator=gen)
        if table == CAUSAL_LM:
            return ids
        return {"input_ids": ids, **({"decoder_input_ids": ids} if config.is_encoder_decoder else {})}
    if model.main_input_name == "pixel_values":
        shape = (BATCH, config.num_channels, config.image_size, config.image_size)
        return {"pixel_values": torch.randn(shape, generator=gen)}
    if model.main_input_name == "input_features":
        features = torch.randn((BATCH, config.num_mel_bins, 2 * config.max_source_positions), generator=gen)
        decoder = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), generator=gen)
        return {"input_features": features, "decoder_input_ids": decoder}
    raise ValueError(f"no inputs for a main input {model.main_input_name!r}")


def _width(model, table: str) -> int:
    """The residual stream's width: a causal LM's token embeddings'; an encoder's hidden size (ALBERT's, ELECTRA's
    and RemBERT's embeddings are narrower or wider, projected into the stream), else its embeddings'."""
    embedding = getattr(model.get_input_embeddings(), "embedding_dim", None)
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "d_model", None)
    return (embedding or hidden) if table == CAUSAL_LM else (hidden or embedding)


def check_model_type(model_type: str, class_name: str, limit_s: float, table: str = CAUSAL_LM) -> Coverage:
    """Builds, patches and checks one model type (module docstring) for ``table``."""
    start = time.monotonic()
    result = Coverage(model_type, class_name, "not built", table=table,
                      rmsnorm_in_code=modeling_has_rmsnorm(model_type, class_name))
    stage = "building it"

    def on_alarm(*_):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(limit_s)))
    try:
        try:
            model = _build(model_type, table, class_name)
        except _Timeout:
            raise
        except Exception as exc:  # the config or the model itself: recorded, the sweep goes on
            result.reason = _describe(exc, 160)
            return result
        result.uses_rmsnorm = any(norm_role(type(m)) is Role.RMS_NORM_LIKE for m in model.modules())
        result.uses_layernorm = any(_is_layer_norm(m) for m in model.modules())
        result.verdict, stage = "not run", "planning its patch"
        try:  # asked first: whether patch_model takes a model does not depend on its eager forward running here
            planned = check_model(model)
        except UnsupportedModelError as exc:
            result.verdict, result.reason = "skipped", str(exc).split("; supported families")[0][:300]
            return result
        stage = "running its eager model"
        try:
            ids = _inputs(model, table)
            truth = _logits(copy.deepcopy(model).double(), ids)
            eager32 = _logits(model, ids)
            bf16 = copy.deepcopy(model).to(torch.bfloat16)
            eager16 = _logits(bf16, ids)
            norms = {m for name, m in model.named_modules() if name in set(planned.norms)}
            width = _width(model, table)
            next_to_norms = residual_census.adds_next_to_norms(model, functools.partial(_logits, ids=ids), norms, width)
            result.adds_next_to_norms = len(next_to_norms)
        except _Timeout:
            raise
        except Exception as exc:  # transformers' own unpatched model fails on the check: nothing to compare with
            result.reason = "its eager model fails: " + _describe(exc, 160)
            return result
        stage = "checking its patched model"
        report = patch_model(model)
        result.norms, result.fused_adds, result.skipped_modules = (
            len(report.norms), len(report.fused_adds), len(report.skipped))
        result.qk_fused = len(report.fused_qk)
        result.qk_unfused = list(dict.fromkeys(
            reason.removeprefix(UNFUSED) for _, reason in report.skipped if reason.startswith(UNFUSED)))
        patched32 = _logits(model, ids)
        result.adds_fused_in_forward = residual_census.fused_adds(model, functools.partial(_logits, ids=ids))
        if report.fused_adds:
            stage = "counting its compiled and checkpointed adds"
            _count_compiled_and_checkpointed(result, model, ids)
        else:  # no fused class: no forward can run an adding kernel
            result.adds_fused_compiled = result.adds_fused_checkpointed = 0
        # Sites are lines: only where some may be apart (more fused than counted: an embedding sum fused too).
        if result.adds_fused_in_forward != result.adds_next_to_norms:
            result.unfused_add_sites = residual_census.unfused_sites(
                model, functools.partial(_logits, ids=ids), next_to_norms, width)
        patch_model(bf16)
        patched16 = _logits(bf16, ids)
        result.verdict, result.reason = _judge(result, truth, eager32, patched32, eager16, patched16)
    except _Timeout:
        result.reason = f"over the {limit_s:.0f} s limit while {stage}"
    except Exception as exc:  # patched but then failed to run: a bug
        result.verdict, result.reason = "failed", _describe(exc, 200)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        result.seconds = time.monotonic() - start
    return result


def _count_compiled_and_checkpointed(result: Coverage, model, ids) -> None:
    """``result.adds_fused_compiled`` and ``adds_fused_checkpointed`` of the patched ``model``: what each forward
    that fails here says in ``result.unmeasured``. The checkpointed forward runs a copy in training mode with its
    dropouts off (an active residual dropout stops a fusion whatever the checkpointing)."""
    problems = []
    torch._dynamo.reset()
    try:
        result.adds_fused_compiled = residual_census.fused_adds(
            torch.compile(model, backend="eager"), functools.partial(_logits, ids=ids))
    except _Timeout:
        raise
    except Exception as exc:  # the model does not compile here: recorded, the count goes on
        problems.append("compiled: " + _describe(exc, 120))
    finally:
        torch._dynamo.reset()
    checkpointed = copy.deepcopy(model).train()
    for module in checkpointed.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renamed the method
            checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
        result.adds_fused_checkpointed = residual_census.fused_adds(
            checkpointed, lambda m: m(**ids) if isinstance(ids, dict) else m(ids, use_cache=False), grad=True)
    except _Timeout:
        raise
    except Exception as exc:  # no checkpointing, or its training forward fails here
        problems.append("checkpointed: " + _describe(exc, 120))
    result.unmeasured = "; ".join(problems)


def _is_layer_norm(module: torch.nn.Module) -> bool:
    """An ``nn.LayerNorm`` or a model's own ``*LayerNorm`` class (an RMSNorm under that name counts too: T5's)."""
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("LayerNorm")


def _describe(exc: Exception, limit: int) -> str:
    """``exc`` on one line: its type and message, whose first line may only name a validator (the cause follows)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def _judge(result: Coverage, truth, eager32, patched32, eager16, patched16) -> tuple[str, str]:
    scale = truth.abs().max().item()
    result.fp32_max_err = (patched32 - eager32).abs().max().item() / scale
    eager_mean = (eager16 - truth).abs().mean().item()
    result.bf16_mean_err_ratio = (patched16 - truth).abs().mean().item() / eager_mean if eager_mean else 1.0
    top2 = eager32.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > FP32_TOLERANCE * scale
    problems = []
    if result.fp32_max_err > FP32_TOLERANCE:
        problems.append(f"fp32 logits {result.fp32_max_err:.1e} from eager's")
    if not torch.equal(patched32.argmax(-1)[decisive], eager32.argmax(-1)[decisive]):
        problems.append("fp32 top-1 token differs where eager's is decisive")
    if (patched16 - truth).abs().max() > (eager16 - truth).abs().max() + 2**-8 * scale:
        problems.append("bf16 max error above eager's by more than an ulp")
    if result.bf16_mean_err_ratio > BF16_MEAN_SLACK:
        problems.append(f"bf16 mean error {result.bf16_mean_err_ratio:.2f}x eager's")
    if problems:
        return "failed", "; ".join(problems)
    return ("fused", "") if result.fused_adds else ("norms only", "")


def _models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


@functools.cache
def _names_rmsnorm(path: Path) -> bool:
    return bool(_RMSNORM_IN_CODE.search(path.read_text(encoding="utf-8")))


def _defining_package(class_name: str, own: Path) -> Path:
    """The package whose modeling code defines ``class_name``: ``own`` unless another's (some model types reuse
    another's classes)."""
    definition = re.compile(rf"^class {re.escape(class_name)}\(", re.MULTILINE)
    for path in [*sorted(own.glob("modeling_*.py")), *sorted(_models_dir().glob("*/modeling_*.py"))]:
        if definition.search(path.read_text(encoding="utf-8")):
            return path.parent
    return own


def _packages(model_type: str) -> set[Path]:
    """The packages of ``model_type`` and of the model types of its sub-configs (a multimodal model's text model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name

    packages, todo = set(), [model_type]
    while todo:
        current = todo.pop()
        package = _models_dir() / model_type_to_module_name(current)
        if package in packages:
            continue
        packages.add(package)
        todo.extend(sub for sub in _sub_config_types(CONFIG_MAPPING[current]) if sub in CONFIG_MAPPING)
    return packages


def _sub_config_types(config_class: type) -> list[str | None]:
    """The model types of a config class's sub-configs: declared (transformers >= 5.24), else those of its default
    instance (before, a sub-config declared as ``AutoConfig`` named no type)."""
    declared = getattr(config_class, "sub_configs_defaults", None)
    if declared is not None:
        return [spec.model_type or getattr(spec.config_class, "model_type", None) for spec in declared.values()]
    try:
        default = config_class()
    except Exception:  # a default its own validation refuses: no sub-config to follow
        return []
    return [getattr(getattr(default, name, None), "model_type", None) for name in getattr(default, "sub_configs", {})]


def modeling_has_rmsnorm(model_type: str, class_name: str) -> bool:
    """Whether the modeling code of ``model_type`` names an RMSNorm class (defines or imports one, or uses
    ``torch.nn.RMSNorm``), read and not run: its package, its sub-configs' and the one defining ``class_name``.
    What the headline counts for a model type that could not be built."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    own = _models_dir() / model_type_to_module_name(model_type)
    packages = _packages(model_type) | {_defining_package(class_name, own)}
    return any(_names_rmsnorm(path) for package in packages for path in package.glob("modeling_*.py"))


def uses_rmsnorm(result: Coverage) -> bool:
    """Whether a model type counts as using an RMSNorm: its model has an RMSNorm module where it was built, else
    its modeling code names one."""
    return result.uses_rmsnorm if result.uses_rmsnorm is not None else bool(result.rmsnorm_in_code)


def encoder_types() -> dict[str, str]:
    """Model type -> base-model class name, for the encoder and encoder-decoder types of the installed transformers:
    every masked-LM and seq2seq type, and ``NAMED_ENCODER_TYPES``."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES,
    )

    names = {**MODEL_MAPPING_NAMES, **TOWER_CLASSES}
    wanted = {*MODEL_FOR_MASKED_LM_MAPPING_NAMES, *MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, *NAMED_ENCODER_TYPES}
    return {t: names[t] for t in sorted(wanted) if isinstance(names.get(t), str)}


def causal_lm_types() -> dict[str, str]:
    """Model type -> causal-LM class name, for every type of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def norm_type(result: Coverage) -> str:
    """What a model type normalises with, as the page counts it: ``RMSNorm`` when it uses one
    (``uses_rmsnorm``, whatever else it has), else ``LayerNorm`` when its model has one, else ``neither`` (also a
    type not built whose modeling code names no RMSNorm: nothing is known of it)."""
    if uses_rmsnorm(result):
        return "RMSNorm"
    return "LayerNorm" if result.uses_layernorm else "neither"


def render(results: list[Coverage], transformers_version: str) -> str:
    """The Markdown page: for the causal LMs, then for the encoders, counts per verdict and norm type, the headline,
    then one row per model type."""
    causal = [r for r in results if r.table == CAUSAL_LM]
    encoders = [r for r in results if r.table == ENCODER]
    lines = [
        f"# Coverage of transformers {transformers_version}'s causal LMs", "",
        "Written by `python scripts/coverage.py` (see its `--help` and `harness/coverage.py` for the "
        "method). Each model type is a tiny random model of transformers' own classes, its norms given "
        "trained-like weights and biases, checked in fp32 against its eager self and in bf16 against an fp64 "
        "copy.", "",
        *_table(causal, headline(causal)),
    ]
    if encoders:
        lines += [
            "", "## Encoders and encoder-decoders", "",
            "Every masked-LM and seq2seq model type, and the encoder towers issue 30 names, as its base model "
            "(`AutoModel`: any task head is the base model plus a head), checked in the same way on the base "
            "model's first output (the last hidden state: the decoder's, for an encoder-decoder) for one batch of "
            "token ids, images or audio features.", "",
            *_table(encoders, encoder_headline(encoders)),
        ]
    return "\n".join(lines) + "\n"


def _table(results: list[Coverage], summary: str) -> list[str]:
    counts = {(v, t): sum(r.verdict == v and norm_type(r) == t for r in results) for v in VERDICTS for t in NORM_TYPES}
    lines = [
        f"| verdict | {' | '.join(f'{t} types' for t in NORM_TYPES)} | all |", "|---|---|---|---|---|",
        *(f"| {v} | {' | '.join(str(counts[v, t]) for t in NORM_TYPES)} | "
          f"{sum(counts[v, t] for t in NORM_TYPES)} |" for v in VERDICTS), "",
        summary, "",
        "| model type | class | verdict | norm type | norms | fused adds | adds next to norms: fused in eager, "
        "compiled, checkpointed / all | skipped modules | fp32 max err | bf16 mean err / eager | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fp32 = "" if r.fp32_max_err is None else f"{r.fp32_max_err:.1e}"
        bf16 = "" if r.bf16_mean_err_ratio is None else f"{r.bf16_mean_err_ratio:.3f}"
        reason = "; ".join(filter(None, (r.reason, r.unmeasured and f"not counted: {r.unmeasured}"))).replace("|", "/")
        census = "" if r.adds_next_to_norms is None else (
            ", ".join("–" if n is None else str(n) for n in (
                r.adds_fused_in_forward, r.adds_fused_compiled, r.adds_fused_checkpointed))
            + f" / {r.adds_next_to_norms}")
        lines.append(f"| {r.model_type} | {r.model_class} | {r.verdict} | {_norm_type_cell(r)} | {r.norms} | "
                     f"{r.fused_adds} | {census} | {r.skipped_modules} | {fp32} | {bf16} | {reason} |")
    return lines


def _sites(sites: list[str]) -> str:
    """``file:line`` sites with how many times each ran: ``modeling_x.py:12 x2, modeling_x.py:20``."""
    counts = collections.Counter(sites)
    return ", ".join(f"{site} x{n}" if n > 1 else site for site, n in sorted(counts.items())) or "none found"


def _norm_type_cell(result: Coverage) -> str:
    if result.uses_rmsnorm is not None:
        return norm_type(result)
    return "RMSNorm (in its code)" if result.rmsnorm_in_code else "unknown (no RMSNorm in its code)"


def headline(results: list[Coverage]) -> str:
    """How many of the model types that use an RMSNorm (``uses_rmsnorm``), built here or not, are patched with
    parity, naming the ones not checked to the end (nothing is claimed for them); then the same for the types
    that normalise with a LayerNorm and no RMSNorm, counted apart."""
    rms = [r for r in results if norm_type(r) == "RMSNorm"]
    ok = [r for r in rms if r.verdict in ("fused", "norms only")]
    unchecked = {v: [r.model_type for r in rms if r.verdict == v] for v in ("not run", "not built")}
    checked = len(rms) - sum(len(names) for names in unchecked.values())
    layernorm = [r for r in results if norm_type(r) == "LayerNorm"]
    layernorm_ok = sum(r.verdict in ("fused", "norms only") for r in layernorm)
    neither = [r for r in results if norm_type(r) == "neither"]
    unknown = sum(r.uses_rmsnorm is None for r in neither)
    full = [r for r in ok if r.fuses_every_add]
    without_adds = [r.model_type for r in full if not r.adds_next_to_norms]
    partly = [f"{r.model_type} ({r.adds_fused_in_forward} of {r.adds_next_to_norms}; apart: "
              f"{_sites(r.unfused_add_sites)})" for r in ok if not r.fuses_every_add]
    fusion = (f"**{len(full)} of the {len(ok)} RMSNorm model types patched with parity fuse every add next to a "
              f"patched norm ({100 * len(full) / max(len(ok), 1):.0f}%)**, counted in one forward (the adds column, "
              f"`harness/residual_census.py`); {len(without_adds)} of them have no such add "
              f"({', '.join(without_adds) or 'none'}). The others, with the adds fused of those next to a norm: "
              f"{'; '.join(partly) or 'none'}. Each add left apart is named by its line in the modeling code (with how "
              "many times a forward runs it): there the add and the norm are not in one of the patterns "
              "`hf_rmsnorm/patch/derived_sites.py` finds (a scaled add through a function, a norm inside a gated "
              "wrapper, an add between two stacks, a model loop that touches the hidden states between layers); "
              "the patch report's skipped modules give the layers' side.")
    fewer = [f"{r.model_type} ({', '.join(r.fuses_fewer_than_eager())}; {r.adds_fused_in_forward} eagerly)"
             for r in ok if r.fuses_fewer_than_eager()]
    runs = (f"\n\n**{len(ok) - len(fewer)} of the {len(ok)} fuse in a compiled forward (`torch.compile`, graph "
            "breaks allowed) and in a checkpointed training forward (non-reentrant activation checkpointing of "
            f"every layer) every add their eager forward fuses** (the two middle counts of the adds column). The "
            f"others, with the adds fused there: {'; '.join(fewer) or 'none'} (a count not measured is a forward that "
            "fails here for another reason: their row says why).")
    return (f"**{len(ok)} of the {len(rms)} model types that use an RMSNorm are patched with parity "
            f"({100 * len(ok) / max(len(rms), 1):.0f}%)**, {checked} of them built and checked here. The others "
            "count against the share and nothing else is claimed for them (the reason is in their row): "
            f"{len(unchecked['not run'])} built but not run to the end ({', '.join(unchecked['not run']) or 'none'})"
            f" and {len(unchecked['not built'])} that could not be built here "
            f"({', '.join(unchecked['not built']) or 'none'}). A model type uses an RMSNorm when its tiny model has "
            "an RMSNorm module or, where none could be built, when its modeling code names an RMSNorm class (read, "
            f"not run: the norm type column). Counted apart: {layernorm_ok} of the {len(layernorm)} model types "
            "that normalise with a LayerNorm and no RMSNorm are patched with parity; "
            f"{len(neither)} model types use neither ({unknown} of them not built, their modeling code naming no "
            "RMSNorm).\n\n" + fusion + runs + "\n\n" + layernorm_fusion(results) + "\n\n" + qk_paragraph(ok))


def qk_paragraph(results: list[Coverage]) -> str:
    """Of the model types patched with parity, those with attention modules calling two patched norms (q/k norms):
    how many run them with their RoPE as one launch, and why each other one does not."""
    with_qk = [r for r in results if r.qk_fused or r.qk_unfused]
    fused = [r.model_type for r in with_qk if r.qk_fused and not r.qk_unfused]
    partly = [f"{r.model_type} ({r.qk_fused} fused; {'; '.join(r.qk_unfused)})" for r in with_qk
              if r.qk_fused and r.qk_unfused]
    apart = [f"{r.model_type} ({'; '.join(r.qk_unfused)})" for r in with_qk if not r.qk_fused]
    return (f"**{len(fused)} of the {len(with_qk)} model types whose attention calls two patched norms (q/k norms) "
            "run them with their RoPE as one launch in every such attention** (`hf_rmsnorm/patch/qk_attention.py`; "
            f"the report's `fused_qk`): {', '.join(fused) or 'none'}. In some attention modules only: "
            f"{'; '.join(partly) or 'none'}. Apart, with the reason the patch report gives (the invariant of "
            "`hf_rmsnorm/patch/qk_sites.py` their code breaks, or what the RoPE probe found): "
            f"{'; '.join(apart) or 'none'}.")


def _patched(results: list[Coverage]) -> list[Coverage]:
    return [r for r in results if r.verdict in ("fused", "norms only")]


def layernorm_fusion(results: list[Coverage]) -> str:
    """How many of the LayerNorm types patched with parity fuse every add next to a patched norm."""
    layernorm = [r for r in _patched(results) if norm_type(r) == "LayerNorm"]
    full = [r for r in layernorm if r.fuses_every_add]
    partly = [f"{r.model_type} ({r.adds_fused_in_forward} of {r.adds_next_to_norms})" for r in layernorm
              if not r.fuses_every_add]
    return (f"**{len(full)} of the {len(layernorm)} LayerNorm model types patched with parity fuse every add next to "
            f"a patched norm ({100 * len(full) / max(len(layernorm), 1):.0f}%)**; the others, with the adds fused of "
            f"those next to a norm: {', '.join(partly) or 'none'}.")


def encoder_headline(results: list[Coverage]) -> str:
    """The encoder table's headline: of the types issue 30 names, how many are patched with parity and fuse every
    add next to a patched norm; then of every type, by norm type; failures named."""
    named = [r for r in results if r.model_type in NAMED_ENCODER_TYPES]
    named_ok = _patched(named)
    named_full = [r for r in named_ok if r.fuses_every_add]
    missing = [f"{r.model_type} ({r.verdict}{', adds apart' if r in named_ok else ''})" for r in named
               if r not in named_full]
    by_type = "; ".join(
        f"{len(_patched(kind))} of the {len(kind)} {t} types patched with parity"
        for t in NORM_TYPES if (kind := [r for r in results if norm_type(r) == t]))
    failed = [r.model_type for r in results if r.verdict == "failed"]
    return (f"**{len(named_ok)} of the {len(named)} encoder types issue 30 names are patched with parity "
            f"({100 * len(named_ok) / max(len(named), 1):.0f}%), {len(named_full)} of them fusing every add next to "
            f"a patched norm ({100 * len(named_full) / max(len(named), 1):.0f}%)**; the others: "
            f"{', '.join(missing) or 'none'}. Of every type in this table: {by_type}; "
            f"{len(failed)} parity failures ({', '.join(failed) or 'none'}).\n\n" + layernorm_fusion(results))


def read(markdown: Path) -> list[Coverage]:
    """The results an earlier run wrote beside ``markdown`` (none if there is no such file)."""
    path = markdown.with_suffix(".json")
    if not path.is_file():
        return []
    return [Coverage(**r) for r in json.loads(path.read_text())["results"]]


def merged(earlier: list[Coverage], new: list[Coverage]) -> list[Coverage]:
    """``earlier`` with the model types of ``new`` replaced or added, per table, sorted by table and model type
    (runs in chunks)."""
    by_type = {(r.table, r.model_type): r for r in earlier}
    by_type.update({(r.table, r.model_type): r for r in new})
    return [by_type[t] for t in sorted(by_type, key=lambda key: (key[0] != CAUSAL_LM, key[1]))]


def write(results: list[Coverage], markdown: Path, transformers_version: str) -> None:
    """The Markdown page and, beside it, the same results as JSON."""
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(render(results, transformers_version))
    markdown.with_suffix(".json").write_text(json.dumps(
        {"transformers": transformers_version, "results": [asdict(r) for r in results]}, indent=1) + "\n")
