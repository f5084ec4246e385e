"""What the q/k norms + RoPE fusion's model tests share (``tests/patch/test_qk_families.py``,
``tests/patch/test_qk_attention.py`` and the GPU-only ``test_qk_offloaded_caches.py``): the tiny model of a family
case, a count of the fused launches, the graphs torch.compile traces, greedy generation's tokens and logits, and the
cache kinds."""

from __future__ import annotations

import contextlib

import torch
from family_cases import CASES
from patch_models import tiny_model

from hf_rmsnorm.patch import qk_runtime

# transformers' cache kinds (``generation_config.cache_implementation``) and where each is tested: "dynamic",
# "static" and "paged" (continuous batching's paged cache) here; "quantized" (optimum-quanto's, in the test extra;
# it skips where that package is missing); "offloaded" and "offloaded_static", which prefetch each layer's keys and
# values on a CUDA stream, on a GPU only. The other names are deprecated aliases of the static cache
# ("sliding_window", "hybrid", "hybrid_chunked") or of the offloaded static one ("offloaded_hybrid",
# "offloaded_hybrid_chunked").
CPU_CACHES = ["dynamic", "static", "paged"]
GPU_CACHES = ["offloaded", "offloaded_static"]
# Exaone 4: a layer without RoPE too; Gemma 4: the queries and keys rotated one at a time, a KV-sharing layer.
GENERATE_QK = ["qwen3", "gemma3_text", "olmo2", "exaone4", "gemma4_text_qk"]


def compiled_fullgraph(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """``model`` under ``torch.compile(fullgraph=True)`` with a backend that records each graph it is given (as text,
    appended to the list returned) and runs it eagerly; Dynamo's caches reset first."""
    graphs: list[str] = []

    def backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True), graphs


def qk_model(name: str, dtype: torch.dtype = torch.float32, **kwargs):
    """The tiny model of the family case ``name``, its config fields overridden by ``kwargs``."""
    case = CASES[name]
    return tiny_model(case.model_type, dtype, **{**case.config, **kwargs})


@contextlib.contextmanager
def counting_launches(monkeypatch):
    """Counts the fused q/k norms + RoPE launches (of either order) made inside the ``with`` block (``calls[0]``)."""
    calls = [0]

    def counting(launch):
        def counted(*args, **kwargs):
            calls[0] += 1
            return launch(*args, **kwargs)
        return counted

    with monkeypatch.context() as patch:
        for name in ("qk_norm_rope", "qk_rope_norm"):
            patch.setattr(qk_runtime, name, counting(getattr(qk_runtime, name)))
        yield calls


def generated(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate()``'s tokens and the logits of every step."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)
