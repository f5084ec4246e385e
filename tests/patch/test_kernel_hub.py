"""patch_model and the kernels hub (``kernels.kernelize``), in both orders, with a plain-PyTorch hub layer from a
local kernel repository mapped to "RMSNorm" on CPU.

transformers decorates its norm classes with ``use_kernel_forward_from_hub("RMSNorm")`` only when the installed
``kernels`` is a release it supports (5.24 needs >= 0.18.2, 5.17 < 0.17); the tests decorate LlamaRMSNorm the
same way themselves (``kernels.replace_kernel_forward_from_hub``, undone after each test). A ``use_kernels=True``
model is kernelized again by ``PreTrainedModel.train()``/``eval()`` through ``set_use_kernels``; the tests run
that path of transformers with ``set_use_kernels`` doing what transformers' own ``kernelize`` does (the rest of
it needs a ``kernels`` release transformers accepts).
"""

import json

import pytest
import torch
from family_cases import CASES
from patch_models import input_ids, tiny_model
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hf_rmsnorm import patch_model, unpatch_model

kernels = pytest.importorskip("kernels", reason="the kernels package is not installed")

# The hub layers: the bodies of transformers' LlamaRMSNorm and LlamaMLP, reading the module's own weights as a
# hub layer must, and counting their calls in their module (a hub layer may have no members of its own).
HUB_LAYER_SOURCE = '''
import torch
from torch import nn

CALLS = []


class layers:
    class LlamaStyleRMSNorm(nn.Module):
        def forward(self, hidden_states):
            CALLS.append(type(self).__name__)
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class LlamaStyleMLP(nn.Module):
        def forward(self, x):
            CALLS.append(type(self).__name__)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
'''
HUB_MODULE = "hfrmsnormtesthub"
NORMS, ADDS = CASES["llama"].norms, CASES["llama"].adds  # the tiny Llama's
TOL = 1e-5  # fp32 logits, relative to the largest, as in test_patcher


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    """A local kernel repository in the layout kernels 0.17 loads: build/torch-<backend>/ with the package's
    ``__init__.py`` and a ``metadata.json``."""
    root = tmp_path_factory.mktemp("hub_repo")
    build = root / "build" / "torch-cpu"
    build.mkdir(parents=True)
    (build / "__init__.py").write_text(HUB_LAYER_SOURCE)
    metadata = dict(name=HUB_MODULE, id=HUB_MODULE, version=1, license="Apache-2.0", backend={"type": "cpu"})
    (build / "metadata.json").write_text(json.dumps(dict(metadata, **{"python-depends": []})))
    return root


@pytest.fixture
def hub(hub_repo, monkeypatch):
    """LlamaRMSNorm made kernelizable as transformers makes it, "RMSNorm" mapped to the hub layer on CPU, and
    the hub layers' call log (emptied): the class name of each module a hub layer ran for."""
    _make_kernelizable(monkeypatch, LlamaRMSNorm, "RMSNorm")
    with _mapped(hub_repo, "RMSNorm", "LlamaStyleRMSNorm"):
        calls = kernels.get_local_kernel(hub_repo).CALLS
        calls.clear()
        yield calls


def _make_kernelizable(monkeypatch, cls, layer_name):
    """``cls`` decorated as transformers' ``use_kernel_forward_from_hub(layer_name)`` does, until the test ends."""
    for name in ("kernel_layer_name", "kernel_condition"):  # registered first so that monkeypatch removes them
        monkeypatch.setattr(cls, name, None, raising=False)
    kernels.replace_kernel_forward_from_hub(cls, layer_name)


def _mapped(hub_repo, layer_name, hub_layer):
    repo = kernels.LocalLayerRepository(repo_path=hub_repo, layer_name=hub_layer)
    return kernels.use_kernel_mapping({layer_name: {"cpu": repo}})


def _kernelize(model):
    return kernels.kernelize(
        model, mode=kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE, device="cpu"
    )


def _logits(model):
    with torch.no_grad():
        return model(input_ids()).logits


def _assert_close_to_eager(logits, eager):
    torch.testing.assert_close(logits, eager, rtol=0, atol=TOL * eager.abs().max().item())


def _norms(model):
    return [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]


def test_kernelize_runs_the_hub_layer(hub):
    model = tiny_model("llama")
    expected = _logits(model)
    _kernelize(model)
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)  # the same maths, op for op
    assert hub.count("LlamaRMSNorm") == len(hub) == NORMS


def test_kernelize_after_patching_leaves_the_patched_norms_alone(hub):
    model = tiny_model("llama")
    expected = _logits(model)
    report = patch_model(model)
    _kernelize(model)
    assert all("forward" not in norm.__dict__ for norm in _norms(model))
    _assert_close_to_eager(_logits(model), expected)
    assert hub == [] and len(report.norms) == NORMS and len(report.fused_adds) == ADDS

    unpatch_model(model)
    _kernelize(model)
    _logits(model)
    assert hub.count("LlamaRMSNorm") == len(hub) == NORMS


def test_patching_a_kernelized_model_sets_the_hub_forwards_aside_and_unpatch_puts_them_back(hub):
    model = tiny_model("llama")
    expected = _logits(model)
    _kernelize(model)
    hub_forwards = {norm: norm.__dict__["forward"] for norm in _norms(model)}

    report = patch_model(model)
    assert len(report.norms) == NORMS and len(report.fused_adds) == ADDS and not report.skipped
    assert report.hub_forwards == [
        f"{name}: hub layer {HUB_MODULE}.layers.LlamaStyleRMSNorm (kernel_layer_name 'RMSNorm') set aside, "
        "the fused forward runs" for name in report.norms
    ]
    assert "hub-kernel forwards set aside while patched" in str(report)
    assert all("forward" not in norm.__dict__ for norm in _norms(model))
    _assert_close_to_eager(_logits(model), expected)
    assert hub == []

    unpatch_model(model)
    assert {norm: norm.__dict__["forward"] for norm in _norms(model)} == hub_forwards
    assert all(norm.__dict__["forward"] is hub_forwards[norm] for norm in _norms(model))
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)
    assert hub.count("LlamaRMSNorm") == len(hub) == NORMS


def test_a_use_kernels_model_kernelized_again_by_train_and_eval_stays_patched(hub, monkeypatch):
    model = tiny_model("llama")
    expected = _logits(model)
    kernelized = []

    def set_use_kernels(use_kernels, kernel_config=None, mode=None):
        # What transformers' set_use_kernels(True) does without a kernel_config: kernelize for the current mode.
        kernelized.append(model.training)
        _kernelize(model)
        model._use_kernels = True

    monkeypatch.setattr(model, "set_use_kernels", set_use_kernels)
    model.set_use_kernels(True)
    patch_model(model)
    model.train()
    model.eval()
    assert kernelized == [False, True, False]  # PreTrainedModel.train()/eval() kernelized again
    assert all("forward" not in norm.__dict__ for norm in _norms(model))
    _assert_close_to_eager(_logits(model), expected)
    assert hub == []

    unpatch_model(model)  # the hub forwards of the first kernelize, as they were
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)
    assert hub.count("LlamaRMSNorm") == len(hub) == NORMS


def test_a_forward_replaced_on_the_instance_by_anything_else_is_named_in_the_skip_reason(hub):
    model = tiny_model("llama")
    norm = model.model.norm
    norm.forward = torch.nn.Identity().forward
    report = patch_model(model)
    assert (
        "model.norm",
        "its forward was replaced on the instance by torch.nn.modules.linear.Identity.forward; "
        "call patch_model before wrapping it",
    ) in report.skipped
    assert "model.norm" not in report.norms


@pytest.mark.parametrize("kernelize_first", [True, False], ids=["kernelize-then-patch", "patch-then-kernelize"])
def test_a_hub_mlp_runs_inside_a_patched_layer(hub, hub_repo, monkeypatch, kernelize_first):
    model = tiny_model("llama")
    expected = _logits(model)
    _make_kernelizable(monkeypatch, LlamaMLP, "LlamaStyleMLP")
    with _mapped(hub_repo, "LlamaStyleMLP", "LlamaStyleMLP"):
        if kernelize_first:
            _kernelize(model)
        report = patch_model(model)
        _kernelize(model)
    assert len(report.fused_adds) == ADDS and len(report.hub_forwards) == (NORMS if kernelize_first else 0)
    _assert_close_to_eager(_logits(model), expected)
    assert hub == ["LlamaMLP", "LlamaMLP"]  # the layers' MLPs ran the hub layer, the patched norms their kernels


def test_a_kernelize_that_kept_the_class_forward_is_patched_and_restored(hub, monkeypatch):
    model = tiny_model("llama")
    with kernels.use_kernel_mapping({"RMSNorm": {}}, inherit_mapping=False):
        _kernelize(model)  # no layer for this device: kernelize binds each norm's own class forward to it
    bound = {norm: norm.__dict__["forward"] for norm in _norms(model)}
    assert all(forward.__func__ is LlamaRMSNorm.forward for forward in bound.values())

    report = patch_model(model)
    assert len(report.norms) == NORMS and report.hub_forwards == []
    unpatch_model(model)
    assert all(norm.__dict__["forward"].__func__ is LlamaRMSNorm.forward for norm in _norms(model))
