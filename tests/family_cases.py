"""What the tests expect of each model family's tiny model, in one table: ``CASES``, keyed by case name (the
model type, or a variant's own name such as ``gpt_neox_sequential``).

A row gives the transformers model type, the config fields its tiny model is built with, the norms patch_model
patches and the residual adds it fuses, and the groups of tests that run it. The tiny models have 2 layers.
Builders: ``patch_models.tiny_model`` (RMSNorm decoders), test_layernorm's ``tiny`` (the ``LAYERNORM`` group, whose
config gives the whole shape), harness.coverage's tiny config (the ``DERIVED`` group, of no config here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import transformers
from packaging.version import Version

# The groups of tests a case belongs to.
MAIN = "main"  # Llama, Mistral, Qwen2 and Qwen3: the most used, tested in every dtype
OTHER = "other"  # the other families of the registry's table, in bf16 only (same code paths, other classes)
RECOGNISED = "recognised"  # reached through recognition and the newer registry entries (test_families.py)
LAYERNORM = "layernorm"  # LayerNorm decoders (test_layernorm.py)
DERIVED = "derived"  # model types of no registered layer shape, fused through derived forwards (test_derived.py)


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    """The expectations of one tiny model, built with ``config``, for the tests of its ``groups``:

    ``norms`` patched and ``adds`` fused by a plain ``patch_model``; ``mode`` the casting mode its norms are
    recognised in (docs/numerics.md's table; None: not checked); ``qk`` the attention modules whose q/k norms and RoPE
    run as one launch (``hf_rmsnorm.patch.qk_attention``), ``qk_unrotated`` of them in layers that skip the RoPE
    (their norms run apart: ``qk_launches`` launch per forward); ``parallel``: a parallel block (one add per layer,
    into the next norm's kernel); ``derived_forward``: its layers fused through the forward derived from their own
    code (``hf_rmsnorm.patch.derived_rewrite``), no registered shape fitting them.
    """

    model_type: str
    groups: frozenset[str]
    config: Mapping[str, object] = dataclasses.field(default_factory=dict)
    norms: int | None = None
    adds: int | None = None
    mode: str | None = None
    qk: int = 0
    qk_unrotated: int = 0
    parallel: bool = False
    derived_forward: bool = False

    @property
    def qk_launches(self) -> int:
        """The ``qk_norm_rope`` launches of one forward."""
        return self.qk - self.qk_unrotated

    def __post_init__(self) -> None:
        # Read-only: every test shares the one row.
        object.__setattr__(self, "groups", frozenset(self.groups))
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))


def _derived(model_type: str, adds: int) -> FamilyCase:
    """A case of the DERIVED group only, built from harness.coverage's config."""
    return FamilyCase(model_type, {DERIVED}, adds=adds, derived_forward=True)


# Before transformers 5.24 a hybrid layer renames its cache argument for the linear attention
# (cache_params=past_key_values), which the registered body would not do: those layers run their derived forward
# (their own code, renaming included), so every add is fused on both ends of the supported releases.
HYBRID_ADDS = 4
HYBRID = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# GPT-NeoX's shape, which Phi's and StableLM's tiny models share.
NEOX_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

CASES: dict[str, FamilyCase] = {
    # RMSNorm decoders: the final norm and those of both layers (2 each, more with per-head q/k norms or
    # post-norms); 4 adds when the layer shape is known and the stack runs the layers then the final norm, 2 when
    # only the layer is known.
    "llama": FamilyCase("llama", {MAIN}, norms=5, adds=4),
    "mistral": FamilyCase("mistral", {MAIN}, norms=5, adds=4),
    "qwen2": FamilyCase("qwen2", {MAIN}, norms=5, adds=4),
    "qwen3": FamilyCase("qwen3", {MAIN}, norms=9, adds=4, qk=2),
    # Phi3 has its own tests too.
    "phi3": FamilyCase("phi3", {OTHER}, norms=5, adds=4),
    "ministral": FamilyCase("ministral", {OTHER}, norms=5, adds=4),
    "smollm3": FamilyCase("smollm3", {OTHER}, norms=5, adds=4),
    "qwen2_moe": FamilyCase("qwen2_moe", {OTHER}, dict(**MOE, shared_expert_intermediate_size=32), norms=5, adds=4),
    "qwen3_moe": FamilyCase("qwen3_moe", {OTHER}, MOE, norms=9, adds=4, qk=2),
    "granite": FamilyCase("granite", {OTHER}, dict(residual_multiplier=0.5), norms=5, adds=4),
    # Reached through recognition, and the newer registry entries (MoE, post-norm and hybrid layers).
    "mixtral": FamilyCase("mixtral", {RECOGNISED}, dict(num_local_experts=4, num_experts_per_tok=2), norms=5,
                          adds=4, mode="llama"),
    "ministral3": FamilyCase("ministral3", {RECOGNISED}, norms=5, adds=4),
    # Every other layer an MoE (a pair of flattened tokens and router logits), the other dense.
    "llama4_text": FamilyCase("llama4_text", {RECOGNISED}, dict(
        num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, interleave_moe_layer_step=2
    ), norms=5, adds=4),
    "qwen3_next": FamilyCase("qwen3_next", {RECOGNISED}, dict(**MOE, shared_expert_intermediate_size=32, **HYBRID),
                             norms=7, adds=HYBRID_ADDS, mode="gemma", qk=1),
    "qwen3_5_text": FamilyCase("qwen3_5_text", {RECOGNISED}, HYBRID, norms=7, adds=HYBRID_ADDS, mode="gemma",
                               qk=1),
    "qwen3_5_moe_text": FamilyCase("qwen3_5_moe_text", {RECOGNISED}, dict(
        **MOE, shared_expert_intermediate_size=32, **HYBRID
    ), norms=7, adds=HYBRID_ADDS, qk=1),
    # The RoPE before the q/k norms (NanoChat's by the opposite angle): one qk_rope_norm launch an attention.
    "nanochat": FamilyCase("nanochat", {RECOGNISED}, norms=9, adds=4, mode="llama", qk=2),
    "hunyuan_v1_dense": FamilyCase("hunyuan_v1_dense", {RECOGNISED}, norms=9, adds=4, mode="llama", qk=2),
    "gemma": FamilyCase("gemma", {RECOGNISED}, norms=5, adds=4),
    "gemma2": FamilyCase("gemma2", {RECOGNISED}, dict(sliding_window=4), norms=9, adds=4),
    "gemma3_text": FamilyCase("gemma3_text", {RECOGNISED}, dict(sliding_window=4), norms=13, adds=4, mode="gemma",
                              qk=2),
    "glm4": FamilyCase("glm4", {RECOGNISED}, norms=9, adds=4),
    "olmo2": FamilyCase("olmo2", {RECOGNISED}, norms=9, adds=4, qk=2),
    "olmo3": FamilyCase("olmo3", {RECOGNISED}, norms=9, adds=4, mode="fp32_affine", qk=2),
    # OLMoE's q/k site is split at its ``if clip_qkv`` (skipped where the site fuses), GLM-4.5's at its ``if
    # use_qk_norm`` (holding the norms; off in the config's defaults, on in the released checkpoints).
    "olmoe": FamilyCase("olmoe", {RECOGNISED}, dict(num_experts=4, num_experts_per_tok=2), norms=9, adds=4, qk=2),
    "glm4_moe": FamilyCase("glm4_moe", {RECOGNISED}, dict(
        use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_shared_experts=1, partial_rotary_factor=0.5), norms=9, adds=4, mode="llama", qk=2),
    "gpt_oss": FamilyCase("gpt_oss", {RECOGNISED}, dict(num_local_experts=4, num_experts_per_tok=2), norms=5,
                          adds=4),
    # A sliding layer, whose attention applies the RoPE, and a global one, which skips it (an if around the RoPE): both
    # attention modules are fused, the global one running its norms alone.
    "exaone4": FamilyCase("exaone4", {RECOGNISED}, dict(layer_types=["sliding_attention", "full_attention"]), norms=9,
                          adds=4, qk=2, qk_unrotated=1),
    # Cohere's own LayerNorm class (mean-centred, no bias), recognised in the layernorm mode; its parallel layer
    # adds (residual + attention) + mlp: the second add of each layer goes into the next norm's kernel.
    "cohere": FamilyCase("cohere", {RECOGNISED}, norms=3, adds=2, mode="layernorm_fp32"),
    "cohere2": FamilyCase("cohere2", {RECOGNISED}, dict(sliding_window=4), norms=3, adds=2, mode="layernorm_fp32"),
    # Multi-head latent attention: the rotary part of a head is head_dim.
    "deepseek_v3": FamilyCase("deepseek_v3", {RECOGNISED}, dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, first_k_dense_replace=1, n_group=1,
        topk_group=1, num_key_value_heads=4,
    ), norms=9, adds=4, mode="llama"),
    # LayerNorm decoders: the norms patched are the LayerNorms on the residual stream, two layers of (norms per
    # layer) plus the final norm. The sequential pre-LN blocks fit the generic layer body (the attention add
    # always, the MLP add in inference), the parallel blocks the generic parallel body (their one add, in
    # inference); StableLM's layer, of no registered shape, fuses through its derived forward (derived_*.py), and
    # OPT's too (its norms under `if self.do_layer_norm_before` read the sum flattened, its output is a view of the
    # sum: derived_sites' "Norms under tests"). Falcon's (parallel attention) derived forward inlines its
    # `dropout_add` (derived_inline.py): each layer's output add goes into the next norm (the next layer's input
    # norm sits in one branch of an `if`, whose other branch calls other norms).
    "gpt2": FamilyCase("gpt2", {LAYERNORM}, dict(n_embd=64, n_layer=2, n_head=4, n_positions=64), norms=5, adds=4),
    "gpt_neox": FamilyCase("gpt_neox", {LAYERNORM}, NEOX_SHAPE, norms=5, adds=2, parallel=True),
    "gpt_neox_sequential": FamilyCase("gpt_neox", {LAYERNORM}, dict(NEOX_SHAPE, use_parallel_residual=False), norms=5,
                                      adds=4),
    "opt": FamilyCase("opt", {LAYERNORM}, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64
    ), norms=5, adds=4, derived_forward=True),
    "phi": FamilyCase("phi", {LAYERNORM}, NEOX_SHAPE, norms=3, adds=2, parallel=True),
    "falcon": FamilyCase("falcon", {LAYERNORM}, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
                         norms=3, adds=2, parallel=True, derived_forward=True),
    # GPT-J's block took the generic parallel shape in transformers 5.24; before, no registered shape fits it and
    # it runs its derived forward (the report says why), handing its one add to the next norm all the same.
    "gptj": FamilyCase("gptj", {LAYERNORM}, dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8),
                       norms=3, adds=2, parallel=True,
                       derived_forward=Version(transformers.__version__) < Version("5.24")),
    # Also a derived type, built there from coverage's config.
    "stablelm": FamilyCase("stablelm", {LAYERNORM, DERIVED}, dict(NEOX_SHAPE, num_key_value_heads=4), norms=5, adds=4,
                           derived_forward=True),
    # Model types of no registered layer shape, fused through their derived forwards (docs/coverage.md), with the
    # residual adds their tiny model (coverage's config) fuses: every add next to a patched norm, as the residual
    # census counts them (checked too). Types a transformers release lacks are skipped.
    "granitemoe": _derived("granitemoe", 4),
    "jamba": _derived("jamba", 4),
    "lfm2": _derived("lfm2", 8),
    "falcon_h1": _derived("falcon_h1", 4),
    "nemotron_h": _derived("nemotron_h", 4),
    "minimax": _derived("minimax", 4),
    "gemma4_text": _derived("gemma4_text", 6),
    # Gemma 4's attention normalises and rotates its queries and keys each on its own (a RoPE function of one tensor):
    # one launch each; the last layer reads the keys of the layer before it (KV sharing) and normalises its queries
    # only. Its global layers rotate a quarter of each head (proportional RoPE: cos is 1 on the rest).
    "gemma4_text_qk": FamilyCase("gemma4_text", set(), dict(
        num_hidden_layers=3, num_kv_shared_layers=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "full_attention"]), norms=24, adds=9, qk=3),
    "apertus": _derived("apertus", 4),
    "mamba": _derived("mamba", 2),
    "bamba": _derived("bamba", 4),
    "flex_olmo": _derived("flex_olmo", 4),
    "vaultgemma": _derived("vaultgemma", 4),
    "jetmoe": _derived("jetmoe", 4),
    "longcat_flash": _derived("longcat_flash", 8),
    "glm_moe_dsa": _derived("glm_moe_dsa", 4),
    "xlstm": _derived("xlstm", 4),
    # BLOOM's adds sit in its attention and MLP (``dropout_add``, inlined), whose sums the block's own norm reads
    # or the block returns (derived_sites' "Sublayer outputs"); test_layernorm's BLOOM tests build it from this
    # config, the derived parity test from coverage's.
    "bloom": FamilyCase("bloom", {DERIVED}, dict(hidden_size=64, n_layer=2, n_head=4), norms=6, adds=4,
                        derived_forward=True),
    # MPT's MLP returns its add too (``output + residual``), which its block returns: into the next block's norm.
    "mpt": _derived("mpt", 4),
    # AFMoE's MoE returns its experts' sum too, which post_mlp_layernorm reads; that norm's output goes into the
    # residual add, fused with it: the sublayer's sum stays apart (a norm call is fused with one add).
    "afmoe": _derived("afmoe", 6),
}


def names(group: str) -> list[str]:
    """The names of the cases of ``group``, in the table's order."""
    return [name for name, case in CASES.items() if group in case.groups]
