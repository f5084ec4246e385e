"""Tiny models of the real transformers classes for the patcher tests, and a counter of the ops they run.

Shapes are kept tiny (hidden 64, 2 layers, vocab 128) so the kernels stay fast in Triton's interpreter.
"""

from __future__ import annotations

import collections
import copy
import functools
import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from transformers import AutoConfig, AutoModelForCausalLM

from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.ops import library
from hf_rmsnorm.ops.functional import BoundNorm

VOCAB = 128


def tiny_model(family: str, dtype: torch.dtype = torch.float32, *, layers: int = 2, seed: int = 0, **overrides):
    """A randomly initialised model of ``family`` (a transformers model type) in eval mode, with ``overrides`` of
    its config (a family's own in ``family_cases.CASES``). Norm weights are drawn around 1 (not left at ones) so a
    kernel that ignored or misapplied them would show."""
    fields = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    # Eager experts: the grouped-GEMM ones of the MoE families have no fp64 kernel for the fp64 reference.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), experts_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model.to(dtype).eval()


class Parity:
    """The eager references of one fp32 model, taken before it is patched: an fp64 copy's logits (the truth), its
    own fp32 logits, and a bf16 copy with its logits. ``logits(model)`` runs one forward."""

    def __init__(self, model, logits) -> None:
        self.model, self.logits = model, logits
        self.truth = logits(copy.deepcopy(model).double())
        self.eager32 = logits(model)
        self.bf16 = copy.deepcopy(model).to(torch.bfloat16)
        self.eager16 = logits(self.bf16)

    def check_patched(self) -> None:
        """After ``patch_model(self.model)``: its fp32 logits within 1e-5 of the largest logit from eager's; the bf16
        copy, patched, no less accurate than eager bf16 against the truth (within one bf16 ulp of the largest logit
        at worst, on average within verify.py's 10%); unpatching gives the eager logits back exactly."""
        scale = self.truth.abs().max().item()
        assert (self.logits(self.model) - self.eager32).abs().max().item() <= 1e-5 * scale
        patch_model(self.bf16)
        patched16 = self.logits(self.bf16)
        assert (patched16 - self.truth).abs().max() <= (self.eager16 - self.truth).abs().max() + 2**-8 * scale
        assert (patched16 - self.truth).abs().mean() <= 1.10 * (self.eager16 - self.truth).abs().mean()
        unpatch_model(self.model)
        assert (self.logits(self.model) - self.eager32).abs().max().item() == 0


def assert_patch_keeps_greedy_tokens(model, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy ``generate()`` (prefill and decode with the model's caches), then ``patch_model`` in place and the
    same again: fp32 tokens identical."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        unpatched = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        patch_model(model)
        patched = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    assert torch.equal(patched, unpatched)


def input_ids(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def clone(model):
    return copy.deepcopy(model)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops of a forward, plus one ``hf_rmsnorm.kernel`` per call of the norm kernels (whose
    own internals, in the interpreter, are not counted)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def count_kernels(self, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            self.counts["hf_rmsnorm.kernel"] += 1
            with _disable_current_modes():
                return function(*args, **kwargs)

        return counted


def count_ops(model, ids, monkeypatch, *, grad: bool = False) -> collections.Counter[str]:
    """The ops of one forward of ``model`` (under ``no_grad`` unless ``grad``)."""
    counter = OpCounter()
    with monkeypatch.context() as patch, torch.set_grad_enabled(grad):
        for name in ("norm", "fused_add_norm"):  # what a patched norm calls (its class's BoundNorm)
            patch.setattr(BoundNorm, name, counter.count_kernels(getattr(BoundNorm, name)))
        with counter:
            model(ids)
    return counter.counts


def reachable_modules(root: torch.nn.Module) -> set[int]:
    """Ids of every module reachable from ``root`` through instance state and containers (not through classes,
    functions or tensors): what ``copy.deepcopy(root)`` copies."""
    seen, found, stack = set(), set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, torch.Tensor)) or (
            callable(obj) and not isinstance(obj, torch.nn.Module)
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return found


def without_layer_fusion(monkeypatch, layers: dict | None = None) -> None:
    """Makes patch_model see only the registry's norms (and ``layers``, if given), recognising no layer or stack
    by its code and deriving no fused forward: the unfused baseline of the same kernels."""
    from hf_rmsnorm.patch import patcher
    from hf_rmsnorm.patch.families import Registry, registry

    full = registry()
    monkeypatch.setattr(patcher, "registry", lambda: Registry(full.norms, layers or {}, {} if layers is None
                                                              else full.stacks))
    monkeypatch.setattr(patcher, "recognised_layer_kinds", lambda cls: ())
    monkeypatch.setattr(patcher, "recognised_stack_kind", lambda cls: None)
    monkeypatch.setattr(patcher.derived_loops, "stack_kind", lambda cls: None)
    monkeypatch.setattr(patcher.derived_sites, "module_calls", lambda cls: frozenset())



def unfused_copy(model, monkeypatch):
    """A copy of ``model`` patched with the same kernels but no residual add fused: what the fused adds must match
    bit for bit."""
    copy_ = clone(model)
    patch_unfused(copy_, monkeypatch)
    return copy_


def patch_unfused(model, monkeypatch) -> None:
    """Patches ``model`` in place with the same kernels but no residual add fused."""
    with monkeypatch.context() as patch:
        without_layer_fusion(patch)
        assert not patch_model(model).fused_adds


def fused_and_unfused(model, monkeypatch):
    """``(report, fused, unfused)``: copies of ``model``, one patched (its report), one with the same kernels but
    no residual add fused (``patch_unfused``)."""
    fused, unfused = clone(model), clone(model)
    report = patch_model(fused)
    patch_unfused(unfused, monkeypatch)
    return report, fused, unfused


def assert_outputs_and_gradients_alike(fused, unfused, x: torch.Tensor, gradients: bool = True) -> None:
    """``fused(x)`` and ``unfused(x)`` (``fused_and_unfused``' models) bit for bit, and where ``gradients`` the
    gradients of ``x`` and of every parameter too."""
    results = []
    for m in (fused, unfused):
        inputs = x.clone().requires_grad_()
        out = m(inputs)
        out.float().square().mean().backward()
        results.append((out.detach(), inputs.grad, [p.grad for p in m.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    if gradients:
        assert torch.equal(results[0][1], results[1][1])
        assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))


def training_step(model, ids: torch.Tensor, runner=None) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward of ``runner`` (``model``, or a compiled form of it), counting the norm kernels that add,
    and its backward: ``(fused adds, logits, the gradients of model's parameters)``."""
    from harness import residual_census

    outputs = []
    count = residual_census.fused_adds(
        model if runner is None else runner, lambda m: outputs.append(m(ids, labels=ids, use_cache=False)), grad=True)
    model.zero_grad()
    outputs[0].loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return count, outputs[0].logits.detach(), grads


def recording_aot_eager(graphs: list):
    """torch.compile's ``aot_eager`` backend, keeping each graph Dynamo captured in ``graphs``."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    return backend


def graph_calls(graphs: list, *operators: str) -> int:
    """How many nodes of the graphs ``recording_aot_eager`` kept (and of their submodules: checkpoint regions)
    call one of this package's ``operators`` (``"norm_add_fwd"``: ``library.op("norm_add_fwd")`` or an overload)."""
    prefixes = tuple(f"{library.NAMESPACE}.{name}" for name in operators)
    return sum(str(node.target).startswith(prefixes) for graph in graphs for module in graph.modules()
               if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


def family_model(family: str):
    """The tiny fp32 model of a case of ``family_cases.CASES`` (its config, or coverage's for a derived type), in
    training mode; skips the test when this transformers lacks the type."""
    import pytest
    from family_cases import CASES
    from transformers import CONFIG_MAPPING

    case = CASES[family]
    if case.derived_forward:
        if case.model_type not in CONFIG_MAPPING:
            pytest.skip(f"this transformers has no {case.model_type}")
        from harness.coverage import _build

        return _build(case.model_type).train()
    return tiny_model(case.model_type, **case.config).train()
