"""scripts/coverage.py: verdicts per model type, and the page it writes (merged across chunked runs)."""

import subprocess
import sys

import torch
from launching import SCRIPTS

from harness import coverage

SCRIPT = SCRIPTS / "coverage.py"


def test_verdicts_of_known_model_types():
    types = coverage.causal_lm_types()
    fused = coverage.check_model_type("nanochat", types["nanochat"], 60)
    assert (fused.verdict, fused.uses_rmsnorm) == ("fused", True) and fused.norms and fused.fused_adds
    assert fused.fp32_max_err <= coverage.FP32_TOLERANCE and fused.bf16_mean_err_ratio <= coverage.BF16_MEAN_SLACK
    # The census: 2 layers x 2 adds, every one next to a norm and fused in the forward, compiled and
    # checkpointed alike.
    assert fused.adds_next_to_norms == fused.adds_fused_in_forward == 4 and fused.fuses_every_add
    assert (fused.adds_fused_compiled, fused.adds_fused_checkpointed, fused.unmeasured) == (4, 4, "")
    assert not fused.fuses_fewer_than_eager()
    # NanoChat applies its RoPE before its q/k norms: one qk_rope_norm launch in each of its 2 attention modules.
    assert fused.qk_fused == 2 and not fused.qk_unfused
    # Zamba's mamba layers add the shared transformer's output in a conditional expression, and hand their output
    # to hybrid wrapper layers: adds next to its norms, none of them in a pattern the derived forwards rewrite.
    norms_only = coverage.check_model_type("zamba", types["zamba"], 60)
    assert norms_only.verdict == "norms only" and norms_only.norms and not norms_only.fused_adds
    assert norms_only.adds_fused_in_forward == 0 < norms_only.adds_next_to_norms and not norms_only.fuses_every_add
    sites = norms_only.unfused_add_sites
    assert sites and all(site.startswith("modeling_zamba.py:") for site in sites)
    # BERT's LM head model, post-LN: every LayerNorm patched, the adds of its sublayers fused into them.
    post_ln = coverage.check_model_type("bert", types["bert"], 60)
    assert (post_ln.verdict, post_ln.uses_rmsnorm, post_ln.uses_layernorm) == ("fused", False, True)
    assert post_ln.adds_next_to_norms == post_ln.adds_fused_in_forward == 4 and post_ln.fuses_every_add


def test_encoder_table_builds_base_models_with_their_own_inputs():
    types = coverage.encoder_types()
    assert {"bert", "vit", "whisper", "siglip_text_model", "bart"} <= types.keys()
    for model_type, class_name in (("bert", "BertModel"), ("vit", "ViTModel")):
        result = coverage.check_model_type(model_type, types[model_type], 60, coverage.ENCODER)
        assert (result.table, result.model_class, result.verdict) == (coverage.ENCODER, class_name, "fused")
        assert result.adds_next_to_norms == result.adds_fused_in_forward > 0 and result.fuses_every_add
        assert result.fp32_max_err <= coverage.FP32_TOLERANCE


def test_a_parity_failure_is_reported_as_failed(monkeypatch):
    """A patched model that drifts from its eager self is a failure, never a pass."""
    from hf_rmsnorm.ops.functional import BoundNorm

    real = BoundNorm.norm

    def drifting(self, x, weight, eps, bias):
        return real(self, x, weight, eps, bias) * 1.01

    monkeypatch.setattr(BoundNorm, "norm", drifting)
    result = coverage.check_model_type("gemma2", coverage.causal_lm_types()["gemma2"], 60)
    assert result.verdict == "failed" and "fp32 logits" in result.reason


def test_runs_in_chunks_build_one_page(tmp_path):
    out = tmp_path / "coverage.md"
    for chunk in (["llama"], ["bert", "llama"]):
        result = subprocess.run([sys.executable, str(SCRIPT), "--only", *chunk, "--out", str(out)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    page = out.read_text()
    assert "| llama | LlamaForCausalLM | fused |" in page and "| bert | BertLMHeadModel | fused |" in page
    # Both tables: BERT is a causal LM type and an encoder type.
    assert "## Encoders and encoder-decoders" in page and "| bert | BertModel | fused |" in page
    assert page.count("| llama |") == 1
    assert len(coverage.read(out)) == 3


def test_mla_config_shrinks_consistently_and_builds():
    """DeepSeek-V3 (MLA, dense layers before MoE ones) could not be built before its derived head dims were
    derived again from the shrunk ones."""
    config = coverage._tiny_config("deepseek_v3")
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.num_key_value_heads == config.num_attention_heads  # MLA: one key per query head, as the default
    assert (config.num_hidden_layers, config.first_k_dense_replace) == (2, 1)  # one dense layer, one MoE layer
    result = coverage.check_model_type("deepseek_v3", coverage.causal_lm_types()["deepseek_v3"], 120)
    assert result.verdict in ("fused", "norms only"), result.reason
    assert result.uses_rmsnorm and result.rmsnorm_in_code


def test_per_layer_fields_follow_the_layers_kept():
    config = coverage._tiny_config("gemma4_text")  # heterogeneous: per-layer overrides, cut with the layers
    assert config.num_hidden_layers == 2 and config.layer_types == ["sliding_attention", "full_attention"]
    shared = coverage._tiny_config("gemma4_assistant").text_config  # every layer shares the KV cache handed in
    assert shared.num_kv_shared_layers == shared.num_hidden_layers <= coverage.MAX_LAYERS


def test_rmsnorm_in_modeling_code():
    types = coverage.causal_lm_types()
    assert coverage.modeling_has_rmsnorm("llama", types["llama"])
    assert not coverage.modeling_has_rmsnorm("bert", types["bert"])
    if "sarvam_mla" in types:  # transformers >= 5.24
        assert coverage.modeling_has_rmsnorm("sarvam_mla", types["sarvam_mla"])  # DeepSeek-V3's classes, no module
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # Its own code has none, its text model's has; which text model, only transformers >= 5.24 declares.
    if hasattr(CONFIG_MAPPING["gemma4_assistant"], "sub_configs_defaults"):
        assert coverage.modeling_has_rmsnorm("gemma4_assistant", types["gemma4_assistant"])
    # Before, a default config's own sub-configs tell (Mistral3's text model is a Mistral one).
    assert coverage._sub_config_types(CONFIG_MAPPING["mistral3"])[:1] == ["mistral"]


def test_headline_counts_rmsnorm_and_layernorm_types_apart():
    results = [
        coverage.Coverage("a", "A", "fused", uses_rmsnorm=True, uses_layernorm=True, rmsnorm_in_code=True),
        coverage.Coverage("b", "B", "skipped", uses_rmsnorm=False, uses_layernorm=False, rmsnorm_in_code=False),
        coverage.Coverage("c", "C", "not built", rmsnorm_in_code=True),
        coverage.Coverage("d", "D", "not built", rmsnorm_in_code=False),
        coverage.Coverage("e", "E", "not run", uses_rmsnorm=True, uses_layernorm=False, rmsnorm_in_code=True),
        coverage.Coverage("f", "F", "fused", uses_rmsnorm=False, uses_layernorm=True, rmsnorm_in_code=False),
        coverage.Coverage("g", "G", "failed", uses_rmsnorm=False, uses_layernorm=True, rmsnorm_in_code=False),
    ]
    line = coverage.headline(results)
    assert "1 of the 3 model types that use an RMSNorm are patched with parity (33%)" in line
    assert "1 of them built and checked here" in line
    assert "1 built but not run to the end (e)" in line and "1 that could not be built here (c)" in line
    assert "1 of the 2 model types that normalise with a LayerNorm and no RMSNorm" in line
    assert "2 model types use neither (1 of them not built" in line
    page = coverage.render(results, "0")
    # The verdict table counts each norm type in its own column: the LayerNorm model fused is not an RMSNorm one.
    assert "| fused | 1 | 1 | 0 | 2 |" in page and "| not built | 1 | 0 | 1 | 2 |" in page
    assert "| c | C | not built | RMSNorm (in its code) |" in page
    assert "| d | D | not built | unknown (no RMSNorm in its code) |" in page
    assert "| f | F | fused | LayerNorm |" in page and "## Encoders" not in page


def test_encoder_headline_counts_the_named_types():
    results = [
        coverage.Coverage("bert", "BertModel", "fused", table=coverage.ENCODER, uses_rmsnorm=False,
                          uses_layernorm=True, adds_next_to_norms=4, adds_fused_in_forward=4),
        coverage.Coverage("bart", "BartModel", "fused", table=coverage.ENCODER, uses_rmsnorm=False,
                          uses_layernorm=True, adds_next_to_norms=10, adds_fused_in_forward=8),
        coverage.Coverage("deberta", "DebertaModel", "skipped", table=coverage.ENCODER, uses_rmsnorm=False,
                          uses_layernorm=True),
        coverage.Coverage("esm", "EsmModel", "failed", table=coverage.ENCODER, uses_rmsnorm=False,
                          uses_layernorm=True),
    ]
    line = coverage.encoder_headline(results)
    assert "2 of the 3 encoder types issue 30 names are patched with parity (67%), 1 of them fusing" in line
    assert "bart (fused, adds apart), deberta (skipped)" in line and "1 parity failures (esm)" in line
    assert "1 of the 2 LayerNorm model types patched with parity fuse every add" in line
    page = coverage.render(results, "0")
    assert page.index("## Encoders and encoder-decoders") < page.index("| bert | BertModel | fused |")


def test_the_page_counts_the_adds_fused_in_compiled_and_checkpointed_forwards():
    counted = dict(uses_rmsnorm=True, adds_next_to_norms=4, adds_fused_in_forward=4)
    results = [
        coverage.Coverage("a", "A", "fused", **counted, adds_fused_compiled=4, adds_fused_checkpointed=4),
        coverage.Coverage("b", "B", "fused", **counted, adds_fused_compiled=2, adds_fused_checkpointed=4),
        coverage.Coverage("c", "C", "fused", **counted, adds_fused_checkpointed=4,
                          unmeasured="compiled: Unsupported: a graph break"),
    ]
    line = coverage.headline(results)
    assert "1 of the 3 fuse in a compiled forward" in line
    assert "b (compiled 2; 4 eagerly); c (compiled not measured; 4 eagerly)" in line
    page = coverage.render(results, "0")
    assert "| 4, 2, 4 / 4 |" in page and "| 4, –, 4 / 4 |" in page
    assert "not counted: compiled: Unsupported: a graph break |" in page


def test_not_built_only_when_building_fails(monkeypatch):
    """A model that was built but whose own eager forward fails is "not run", with what it knows of its norms;
    "not built" is kept for a config or model that could not be made."""
    llama = coverage._build("llama")

    def failing_forward(*args, **kwargs):
        raise ValueError("inputs_embeds cannot be None")

    monkeypatch.setattr(llama, "forward", failing_forward)
    monkeypatch.setattr(coverage, "_build", lambda model_type, *table_and_class: llama)
    result = coverage.check_model_type("llama", "LlamaForCausalLM", 60)
    assert (result.verdict, result.uses_rmsnorm, result.uses_layernorm) == ("not run", True, False)
    assert result.reason == "its eager model fails: ValueError: inputs_embeds cannot be None"

    def unbuildable(model_type, *table_and_class):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(coverage, "_build", unbuildable)
    result = coverage.check_model_type("llama", "LlamaForCausalLM", 60)
    assert (result.verdict, result.uses_rmsnorm, result.reason) == ("not built", None, "TypeError: unsupported operand")


def test_norms_get_trained_like_parameters():
    """Weights around 1 (around 0 where a Gemma norm scales by 1 + w), biases around 0, never their initial
    ones and zeros, for the LayerNorms of a LayerNorm model too."""
    for model_type, offset in (("llama", 1.0), ("gemma", 0.0), ("gpt2", 1.0)):
        model = coverage._build(model_type)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm) or "RMSNorm" in type(m).__name__]
        assert norms
        for norm in norms:
            for name, param in norm.named_parameters():
                mean = offset if name == "weight" else 0.0
                assert abs(param.mean().item() - mean) < 0.2 and 0.15 < param.std().item() < 0.45, (model_type, name)


def test_a_norm_class_with_and_without_a_weight_is_patched_per_instance():
    """Gemma 4 makes its value norms with ``with_scale=False`` (no weight) and its other norms of the same class
    with one: each instance gets the kind of its own numerics (a shared one read a weight that is not there)."""
    result = coverage.check_model_type("gemma4_text", coverage.causal_lm_types()["gemma4_text"], 60)
    assert result.verdict in ("fused", "norms only"), result.reason
    assert result.fp32_max_err <= coverage.FP32_TOLERANCE


def test_the_page_says_which_q_k_norm_types_fuse_their_rope():
    results = [
        coverage.Coverage("a", "A", "fused", uses_rmsnorm=True, qk_fused=2),
        coverage.Coverage("b", "B", "fused", uses_rmsnorm=True, qk_unfused=["line 3: the RoPE comes first"]),
        coverage.Coverage("c", "C", "fused", uses_rmsnorm=True, qk_fused=1, qk_unfused=["no RoPE"]),
        coverage.Coverage("d", "D", "fused", uses_rmsnorm=True),
    ]
    line = coverage.headline(results)
    assert "**1 of the 3 model types whose attention calls two patched norms (q/k norms) run them" in line
    assert "one launch in every such attention** (" in line and "`fused_qk`): a." in line
    assert "In some attention modules only: c (1 fused; no RoPE)." in line
    assert "b (line 3: the RoPE comes first)." in line
