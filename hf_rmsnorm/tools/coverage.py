"""Which of the installed transformers' causal LMs ``patch_model`` covers, and with what parity: behind
``scripts/coverage.py``.

For each model type with a causal-LM class, a tiny random model is built from the type's default config with its
sizes shrunk (``TINY``), patched, and checked on one batch:

* fp32: the patched logits within ``FP32_TOLERANCE`` of the eager model's (relative to the largest logit), and
  the same top-1 token everywhere the eager model's top-1 beats its top-2 by more than that tolerance;
* bf16: the patched model no less accurate against an fp64 copy than the eager model: its largest error within
  one bf16 ulp of the largest logit of the eager model's, its mean error within ``BF16_MEAN_SLACK`` of it.

Each model type gets one verdict: ``fused`` (norms patched and residual adds fused), ``norms only`` (norms
patched, adds left alone), ``skipped`` (patch_model refused it: the reason), ``failed`` (patched but parity
broke: a bug), or ``not built`` (no tiny model could be made from its config here: the reason). The kernels run
wherever the process set them up (Triton's interpreter on CPU).
"""

from __future__ import annotations

import copy
import json
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..patch import UnsupportedModelError, patch_model
from ..patch.recognition import is_rms_norm_like

# Config fields shrunk when the default config (or one of its sub-configs: text, vision, ...) has them as ints.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, intermediate_size_mlp=128, sliding_window=4,
    d_model=64, n_embd=64, n_layer=2, n_head=4, num_layers=2, ffn_dim=128, encoder_layers=2, decoder_layers=2,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8,
    n_group=1, topk_group=1, depth=2, num_heads=4, embed_dim=64, projection_dim=64, out_hidden_size=64,
    vision_output_dim=64, text_hidden_size=64,
)
# The largest model built: a type whose sizes the shrinking misses stays small enough for a CPU check.
MAX_PARAMETERS = 20_000_000
FP32_TOLERANCE = 1e-4
BF16_MEAN_SLACK = 1.10
BATCH, SEQ = 2, 8
VERDICTS = ("fused", "norms only", "skipped", "failed", "not built")


@dataclass
class Coverage:
    """The verdict on one model type, with what was measured."""

    model_type: str
    model_class: str
    verdict: str
    reason: str = ""
    norms: int = 0
    fused_adds: int = 0
    skipped_modules: int = 0
    uses_rmsnorm: bool | None = None  # None: not built, unknown
    fp32_max_err: float | None = None
    bf16_mean_err_ratio: float | None = None
    seconds: float = 0.0


class _Timeout(Exception):
    pass


def _shrink(config) -> None:
    """Sets the ``TINY`` sizes on ``config`` and its sub-configs, where they exist and can be set."""
    from transformers import PretrainedConfig

    for name, value in TINY.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except (AttributeError, TypeError, ValueError):  # a derived property, or a validated field
                pass
    layer_types = getattr(config, "layer_types", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layer_types, list) and layer_types and isinstance(n_layers, int):
        # Every kind of layer the full model has, as far as the shrunk depth allows (hybrid models need both).
        distinct = list(dict.fromkeys(layer_types))
        try:
            config.layer_types = (distinct * n_layers)[:n_layers]
        except (AttributeError, TypeError, ValueError):
            pass
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, token, None)
        if isinstance(value, int) and value >= TINY["vocab_size"]:
            setattr(config, token, 0)
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)


def _tiny_config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    return config


def _build(model_type: str):
    from transformers import AutoModelForCausalLM

    config = _tiny_config(model_type)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters after shrinking its config")
    torch.manual_seed(0)
    # Eager experts: the grouped-GEMM ones of MoE models have no fp64 kernel for the fp64 reference.
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # norm weights away from their initial ones/zeros, so a misapplied weight would show
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.normal_(float(param.mean()), 0.3)
    return model.eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def check_model_type(model_type: str, class_name: str, limit_s: float) -> Coverage:
    """Builds, patches and checks one model type (module docstring)."""
    start = time.monotonic()
    result = Coverage(model_type, class_name, "not built")

    def on_alarm(*_):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(limit_s)))
    try:
        try:
            model = _build(model_type)
            ids = torch.randint(3, min(TINY["vocab_size"], model.get_input_embeddings().num_embeddings), (BATCH, SEQ),
                                generator=torch.Generator().manual_seed(1))
            result.uses_rmsnorm = any(is_rms_norm_like(m) for m in model.modules())
            truth = _logits(copy.deepcopy(model).double(), ids)
            eager32 = _logits(model, ids)
            bf16 = copy.deepcopy(model).to(torch.bfloat16)
            eager16 = _logits(bf16, ids)
        except _Timeout:
            raise
        except Exception as exc:  # the config or the model itself: recorded, the sweep goes on
            result.reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            return result
        try:
            report = patch_model(model)
        except UnsupportedModelError as exc:
            result.verdict, result.reason = "skipped", str(exc).split(";")[0][:200]
            return result
        result.norms, result.fused_adds, result.skipped_modules = (
            len(report.norms), len(report.fused_adds), len(report.skipped))
        patched32 = _logits(model, ids)
        patch_model(bf16)
        patched16 = _logits(bf16, ids)
        result.verdict, result.reason = _judge(result, truth, eager32, patched32, eager16, patched16)
    except _Timeout:
        result.verdict, result.reason = "not built", f"over the {limit_s:.0f} s limit"
    except Exception as exc:  # patched but then failed to run: a bug
        result.verdict, result.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        result.seconds = time.monotonic() - start
    return result


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


def causal_lm_types() -> dict[str, str]:
    """Model type -> causal-LM class name, for every type of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def render(results: list[Coverage], transformers_version: str) -> str:
    """The Markdown page: counts per verdict, then one row per model type."""
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    built = [r for r in results if r.verdict != "not built"]
    rms = [r for r in built if r.uses_rmsnorm]
    rms_ok = [r for r in rms if r.verdict in ("fused", "norms only")]
    lines = [
        f"# Coverage of transformers {transformers_version}'s causal LMs", "",
        "Written by `python scripts/coverage.py` (see its `--help` and `hf_rmsnorm/tools/coverage.py` for the "
        "method). Each model type is a tiny random model of transformers' own classes, checked in fp32 against "
        "its eager self and in bf16 against an fp64 copy.", "",
        "| verdict | model types |", "|---|---|",
        *(f"| {v} | {counts[v]} |" for v in VERDICTS), "",
        f"Of the {len(built)} model types built here, {len(rms)} use an RMSNorm; {len(rms_ok)} of those are patched "
        f"with parity ({100 * len(rms_ok) / max(len(rms), 1):.0f}%). {counts['not built']} model types could not "
        "be built as tiny models from their default configs here (the reason is in their row): for them nothing "
        "is claimed.", "",
        "| model type | class | verdict | norms | fused adds | skipped modules | fp32 max err | bf16 mean err / "
        "eager | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fp32 = "" if r.fp32_max_err is None else f"{r.fp32_max_err:.1e}"
        bf16 = "" if r.bf16_mean_err_ratio is None else f"{r.bf16_mean_err_ratio:.3f}"
        reason = r.reason.replace("|", "/")
        lines.append(f"| {r.model_type} | {r.model_class} | {r.verdict} | {r.norms} | {r.fused_adds} | "
                     f"{r.skipped_modules} | {fp32} | {bf16} | {reason} |")
    return "\n".join(lines) + "\n"


def read(markdown: Path) -> list[Coverage]:
    """The results an earlier run wrote beside ``markdown`` (none if there is no such file)."""
    path = markdown.with_suffix(".json")
    if not path.is_file():
        return []
    return [Coverage(**r) for r in json.loads(path.read_text())["results"]]


def merged(earlier: list[Coverage], new: list[Coverage]) -> list[Coverage]:
    """``earlier`` with the model types of ``new`` replaced or added, sorted by model type (runs in chunks)."""
    by_type = {r.model_type: r for r in earlier}
    by_type.update({r.model_type: r for r in new})
    return [by_type[t] for t in sorted(by_type)]


def write(results: list[Coverage], markdown: Path, transformers_version: str) -> None:
    """The Markdown page and, beside it, the same results as JSON."""
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(render(results, transformers_version))
    markdown.with_suffix(".json").write_text(json.dumps(
        {"transformers": transformers_version, "results": [asdict(r) for r in results]}, indent=1) + "\n")
