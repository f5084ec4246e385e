"""Patched modules keep their forward's signature and docstring: stacks and layers exactly the original's, norms
the original's plus ``residual`` and ``add_to``. ``inspect.signature`` of a model's forward is read by Trainer
(``remove_unused_columns``), generation and transformers' own tests."""

import inspect
import types

import pytest
import torch
from family_cases import CASES, LAYERNORM
from patch_models import input_ids, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Trainer, TrainingArguments

from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.patch import fused

# Families of differently patched classes: plain, per-head q/k norms, post-norms, weightless norms, hybrid layers,
# and LayerNorm decoders of sequential and parallel blocks.
FAMILIES = ["llama", "qwen3", "gemma2", "olmo2", "nanochat", "qwen3_next", "gpt2", "gpt_neox"]

# What a fused norm's forward adds to the original's parameters.
ADDED_NORM_PARAMS = [
    ("residual", inspect.Parameter.POSITIONAL_OR_KEYWORD, None), ("add_to", inspect.Parameter.KEYWORD_ONLY, None)
]


def _model(family):
    case = CASES[family]
    if LAYERNORM not in case.groups:
        return tiny_model(case.model_type, **case.config)
    torch.manual_seed(0)
    config = AutoConfig.for_model(case.model_type, vocab_size=128, bos_token_id=1, eos_token_id=2, **case.config)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_patched_class_keeps_the_original_signature_and_docstring(family):
    model = _model(family)
    patch_model(model)
    kinds = set()
    for module in model.modules():
        original = fused.original_class(module)
        if original is None:
            continue
        forward, original_forward = type(module).forward, original.forward
        kind = type(module)._hf_rmsnorm_kind
        kinds.add(type(kind).__name__)
        assert (forward.__name__, forward.__qualname__) == (original_forward.__name__, original_forward.__qualname__)
        expected = inspect.signature(original_forward)
        if isinstance(kind, fused.NormKind):
            signature = inspect.signature(forward)
            params = list(signature.parameters.values())
            assert params[:len(expected.parameters)] == list(expected.parameters.values())
            assert [(p.name, p.kind, p.default) for p in params[len(expected.parameters):]] == ADDED_NORM_PARAMS
            assert signature.return_annotation == expected.return_annotation
            input_name = params[1].name
            x = torch.randn(2, 3, module.weight.shape[-1] if getattr(module, "weight", None) is not None else 64)
            assert torch.equal(module(**{input_name: x}), module(x))  # the input can be passed by its own name
        else:
            assert inspect.signature(forward) == expected
            assert forward.__doc__ == original_forward.__doc__
            # What Trainer and generation read: the bound forward of the instance.
            assert inspect.signature(module.forward) == inspect.signature(types.MethodType(original_forward, module))
    assert {"NormKind", "LayerKind"} <= kinds  # every family has patched norms and layers
    unpatch_model(model)
    assert all(fused.original_class(module) is None for module in model.modules())


def test_a_patched_stack_takes_inputs_embeds():
    model = tiny_model("llama").model
    embeds = model.embed_tokens(input_ids())
    with torch.no_grad():
        expected = model(inputs_embeds=embeds).last_hidden_state
        patch_model(model)
        patched = model(inputs_embeds=embeds).last_hidden_state
    assert "inputs_embeds" in inspect.signature(model.forward).parameters
    torch.testing.assert_close(patched, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_trainer_keeps_the_same_dataset_columns_for_a_patched_base_model(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [[3, 4, 5]], "attention_mask": [[1, 1, 1]], "text": ["a b c"]}
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    ))
    args = TrainingArguments(output_dir=str(tmp_path), remove_unused_columns=True, report_to=[], use_cpu=True)

    def kept_columns():
        return Trainer(model=model, args=args)._remove_unused_columns(dataset).column_names

    expected = kept_columns()
    patch_model(model)
    assert kept_columns() == expected == ["input_ids", "attention_mask"]
