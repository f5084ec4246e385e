"""Loads a causal LM from a preset name, a ``save_pretrained`` directory or a Hub id, with one-line errors.

A real-weights preset (``presets.REAL_PRESETS``) comes from the local Hugging Face cache, else the Hub when it
answers, else the GGUF copy of a pip package (offline), which transformers dequantizes into a dense model.

Every failure a user can cause (a mistyped path, a directory without a model, no network, an unknown dtype)
is raised as ``ModelLoadError`` with a message that says what to do instead, so command-line scripts can print
it as one line and exit. Whether the patcher *supports* the architecture is not decided here: loading just
loads, and ``patch_model`` raises ``UnsupportedModelError``.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import socket
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .cli import InputError
from .presets import ENCODER_PRESETS, PRESETS, REAL_PRESETS, RealPreset, build_preset, preset_names

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# Seconds to wait for the Hub before declaring it unreachable; transformers alone retries for ~25 s.
_HUB_PROBE_TIMEOUT_S = 3.0


class ModelLoadError(InputError):
    """A model or setting the user named cannot be loaded; the message is one actionable line."""


def _check_dtype(dtype: object) -> None:
    """A ``ModelLoadError`` unless ``dtype`` is one of the ``DTYPES``."""
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES.values():
        raise ModelLoadError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` (or their torch spellings) as a ``torch.dtype``."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def _choices_hint() -> str:
    return f"pass a directory written by save_pretrained or a preset ({', '.join(preset_names())})"


def _closest_preset(name: str) -> str | None:
    """The preset ``name`` most likely misspells (``tiny_llama`` -> ``tiny-llama``), if any is close."""
    matches = difflib.get_close_matches(name.lower().replace("_", "-"), preset_names(), n=1, cutoff=0.7)
    return matches[0] if matches else None


def looks_like_path(name: str) -> bool:
    """True when ``name`` is meant as a filesystem path rather than a Hub id.

    Hub ids are ``name`` or ``org/name``; on POSIX their ``/`` is also the path separator, so a separator alone
    does not make a path. Paths are what exists on disk, starts with ``.``, ``~`` or a root, has a
    backslash separator (Windows) or more than one ``/``.
    """
    if name.startswith((".", "~")) or os.path.isabs(name) or os.path.exists(name):
        return True
    if os.sep != "/" and os.sep in name:
        return True
    return name.count("/") > 1


def _hub_reachable() -> bool:
    """Whether a TCP connection to the Hub endpoint opens within a few seconds.

    Behind a proxy a direct connection proves nothing, so the answer is then yes and transformers decides.
    """
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    if urllib.request.getproxies().get(endpoint.scheme):
        return True
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=_HUB_PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# A save_pretrained directory holds a tokenizer only if it wrote one of these; without them transformers 5
# builds an empty tokenizer from the model type instead of failing.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _from_pretrained(
    source: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    local_only: bool,
    with_tokenizer: bool,
    encoder: bool = False,
    num_labels: int | None = None,
    **file_args,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    # On a GPU, device_map puts the weights straight on the card (one device: no accelerate hooks).
    device_map = {"": device} if device.type != "cpu" else None
    if num_labels is not None:
        auto_class, file_args = AutoModelForSequenceClassification, {**file_args, "num_labels": num_labels}
    else:
        auto_class = AutoModel if encoder else AutoModelForCausalLM
    model = auto_class.from_pretrained(
        source, dtype=dtype, device_map=device_map, local_files_only=local_only, **file_args
    )
    if encoder and model.config.is_encoder_decoder:
        model = model.get_encoder()  # an encoder-decoder is checked through its encoder (verify_encoder.py)
    tokenizer = (
        AutoTokenizer.from_pretrained(source, local_files_only=local_only, gguf_file=file_args.get("gguf_file"))
        if with_tokenizer else None
    )
    return model.to(device).eval(), tokenizer


# The class-name endings of a generative decoder's architecture in a config.json.
_DECODER_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def is_encoder(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names an encoder, which ``verify`` checks on hidden states and embeddings: an
    encoder preset, or a saved model whose config is an encoder-decoder's or names no causal-LM architecture
    (``BertModel``, ``XLMRobertaForMaskedLM``; ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` are decoders). Presets
    of decoders and Hub ids are decoders."""
    if name_or_path in ENCODER_PRESETS:
        return True
    if name_or_path in PRESETS or name_or_path in REAL_PRESETS or not looks_like_path(name_or_path):
        return False
    config_file = Path(name_or_path).expanduser() / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False  # _load_directory says what is wrong with it
    architectures = config.get("architectures") or []
    return bool(config.get("is_encoder_decoder")) or not any(a.endswith(_DECODER_ARCHITECTURES)
                                                              for a in architectures)


def _load_directory(name: str, dtype: torch.dtype, device: torch.device, *, encoder: bool = False,
                    num_labels: int | None = None):
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{name}: no such file or directory; {_choices_hint()}")
    if not path.is_dir():
        raise ModelLoadError(f"{name}: is a file, not a model directory; {_choices_hint()}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{name}: no config.json, so no model saved here; {_choices_hint()}")
    with_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
    try:
        return _from_pretrained(str(path), dtype, device, local_only=True, with_tokenizer=with_tokenizer,
                                encoder=encoder, num_labels=num_labels)
    except (OSError, ValueError, KeyError) as exc:
        # Unknown model_type, a config that is not a causal LM, missing or corrupt weight files.
        what = ("a sequence classifier" if num_labels is not None else "an encoder" if encoder
                else "a causal LM")
        raise ModelLoadError(f"{name}: transformers cannot load it as {what}: {_first_line(exc)}") from exc


class HubUnavailable(ModelLoadError):
    """The Hub id is valid but neither cached nor fetchable now."""


def _load_hub(repo_id: str, dtype: torch.dtype, device: torch.device, *, fallback: str | None = None):
    """``repo_id`` from the local cache, else from the Hub; ``fallback`` (a sentence) is added to the errors
    that say it could not be fetched, and the caller may catch ``HubUnavailable`` to try another source."""
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # A cached snapshot is a save_pretrained directory; loading it as one makes no network request
        # (transformers' own local_files_only still probes the Hub for adapter files).
        return _load_directory(snapshot_download(repo_id, local_files_only=True), dtype, device)
    except HFValidationError as exc:
        raise ModelLoadError(f"{repo_id!r} is neither an existing path nor a valid Hub id; {_choices_hint()}") \
            from exc
    except LocalEntryNotFoundError:
        pass  # not cached: fetch it if the Hub can be reached
    hint = fallback or _choices_hint()
    if is_offline_mode():
        raise HubUnavailable(f"{repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")
    if not _hub_reachable():
        raise HubUnavailable(
            f"{repo_id!r} is not cached and the Hugging Face Hub is unreachable; {hint}"
            + ("" if fallback else ", and set HF_HUB_OFFLINE=1 to skip network attempts")
        )
    try:
        return _from_pretrained(repo_id, dtype, device, local_only=False, with_tokenizer=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HubUnavailable(f"{repo_id!r}: cannot load it from the Hub: {_first_line(exc)}; {hint}") from exc


def gguf_copy(preset: RealPreset) -> Path | None:
    """The GGUF file of ``preset``'s pip package, if that package is installed.

    Found without importing the package: its ``__init__`` imports dependencies that ``--no-deps`` left out.
    """
    spec = importlib.util.find_spec(preset.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / preset.gguf_file
    return path if path.is_file() else None


def _load_gguf(name: str, preset: RealPreset, path: Path, dtype: torch.dtype, device: torch.device):
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"{name}: reading {path.name} needs the gguf package; run: pip install gguf")
    # Dequantize every weight into a plain dense model: transformers versions that can keep GGUF weights
    # packed would otherwise swap nn.Linear for their own quantized layers and a different attention kernel,
    # and the check would no longer compare the model people run.
    file_args = {"gguf_file": path.name}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        file_args["quantization_config"] = gguf_config(dequantize=True)
    try:
        return _from_pretrained(str(path.parent), dtype, device, local_only=True, with_tokenizer=True, **file_args)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"{name}: transformers cannot load {path}: {_first_line(exc)}") from exc


def _load_real_preset(name: str, dtype: torch.dtype, device: torch.device):
    preset = REAL_PRESETS[name]
    path = gguf_copy(preset)
    try:
        return _load_hub(preset.hub_id, dtype, device, fallback=f"for an offline copy run: {preset.install_command}")
    except HubUnavailable:
        if path is None:
            raise
    return _load_gguf(name, preset, path, dtype, device)


def load_encoder(
    name_or_path: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Loads an encoder (``is_encoder``) in eval mode on ``device``, with its tokenizer when one was saved: an
    encoder preset (random weights, no tokenizer) or a ``save_pretrained`` directory, through ``AutoModel``; of an
    encoder-decoder, its encoder.

    Raises:
        ModelLoadError: with a one-line message saying what to pass instead.
    """
    _check_dtype(dtype)
    device = torch.device(device)
    if name_or_path in ENCODER_PRESETS:
        return build_preset(name_or_path, dtype=dtype, seed=seed, device=device), None
    return _load_directory(name_or_path, dtype, device, encoder=True)


def load_classifier(
    name_or_path: str, *, num_labels: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Loads a model with a sequence-classification head of ``num_labels`` labels (``AutoModelForSequence
    Classification``; a checkpoint without one gets a fresh head), in eval mode on ``device``, with its tokenizer
    when one was saved: an encoder preset (``tiny-bert``: random weights) or a ``save_pretrained`` directory.

    Raises:
        ModelLoadError: with a one-line message saying what to pass instead.
    """
    device = torch.device(device)
    if name_or_path in ENCODER_PRESETS:
        model = build_preset(name_or_path, dtype=dtype, seed=seed, device=device, num_labels=num_labels)
        return model, None
    if not looks_like_path(name_or_path):
        what = "a causal-LM preset" if name_or_path in preset_names() else "not a directory"
        raise ModelLoadError(f"{name_or_path} is {what}: sequence classification takes an encoder preset "
                             f"({', '.join(ENCODER_PRESETS)}) or a save_pretrained directory")
    return _load_directory(name_or_path, dtype, device, num_labels=num_labels)


def weights_source(name_or_path: str, model: PreTrainedModel, seed: int = 0) -> str:
    """Where ``load_model(name_or_path)`` took ``model``'s weights from, for reports."""
    if name_or_path in PRESETS or name_or_path in ENCODER_PRESETS:
        return f"random weights (seed {seed})"
    if name_or_path in REAL_PRESETS:
        preset = REAL_PRESETS[name_or_path]
        if str(model.name_or_path).endswith(preset.module):
            return f"{preset.gguf_file} of the {preset.distribution} package, dequantized ({preset.description})"
        return f"{preset.hub_id} from the Hugging Face Hub ({preset.description})"
    return str(model.name_or_path or name_or_path)


def load_model(
    name_or_path: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Loads a causal LM in eval mode on ``device``, with its tokenizer when one is available.

    Args:
        name_or_path: a random-weight preset (see ``presets.PRESETS``; no tokenizer), a real-weights preset
            (``presets.REAL_PRESETS``; from the cache, the Hub or its pip package's GGUF file), a directory
            written by ``save_pretrained`` (see ``looks_like_path``), or a Hub id such as ``Qwen/Qwen3-0.6B``
            (the local cache is tried first, and the network only when the Hub answers within a few seconds).
        dtype: the dtype of the weights.
        device: where the model goes.
        seed: random seed for a preset's weights; ignored for saved models.

    Raises:
        ModelLoadError: with a one-line message saying what to pass instead.
    """
    _check_dtype(dtype)
    device = torch.device(device)
    if name_or_path in PRESETS:
        return build_preset(name_or_path, dtype=dtype, seed=seed, device=device), None
    if name_or_path in REAL_PRESETS:
        return _load_real_preset(name_or_path, dtype, device)
    if looks_like_path(name_or_path):
        return _load_directory(name_or_path, dtype, device)
    try:
        return _load_hub(name_or_path, dtype, device)
    except HubUnavailable:
        suggestion = _closest_preset(name_or_path) if "/" not in name_or_path else None
        if suggestion is None:
            raise
        raise ModelLoadError(f"{name_or_path!r} is not a preset (did you mean {suggestion!r}?) and not a cached "
                             "Hub model; check the spelling") from None
