"""The q/k norms and RoPE of an attention module fused into one ``qk_norm_rope`` launch (``hf_rmsnorm.patch.
qk_attention``): the site found in the forward's source, each invariant of ``qk_sites``' docstring broken by a toy
(left as written with the reason, computing as unpatched), the RoPE probe accepting the model's function and refusing
others, the checks made at every call, the hooks and wrappers that make the original forward run, and unpatching."""

from __future__ import annotations

import pickle

import pytest
import torch

import qk_toys
from qk_generate import compiled_fullgraph, counting_launches
from qk_toys import (
    HEAD_DIM,
    ClampIfAttention,
    GemmaAttention,
    NormsUnderIfAttention,
    OlmoAttention,
    OneTensorAttention,
    OppositeAngleAttention,
    PartialRotaryAttention,
    QwenAttention,
    RopeFirstAttention,
    toy_attention_model,
    toy_inputs,
)
from hf_rmsnorm import patch_model, unpatch_model
from hf_rmsnorm.patch import qk_probe, qk_runtime, qk_sites
from hf_rmsnorm.patch.qk_attention import UNFUSED


def _run(model, dtype=torch.float32, rotary_dim=HEAD_DIM):
    hidden, trig = toy_inputs(dtype, rotary_dim=rotary_dim)
    with torch.no_grad():
        return model(hidden, trig)


def _qk_skips(report):
    return [reason for name, reason in report.skipped if reason.startswith(UNFUSED)]


# ----------------------------------------------------------------------------------- the three layouts


@pytest.mark.parametrize("attention, per_head", [(QwenAttention, True), (GemmaAttention, True),
                                                 (OlmoAttention, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_layout_runs_one_launch_and_computes_as_unpatched(attention, per_head, dtype, monkeypatch):
    """Fused, the toy's output equals the unpatched one's to the norms' rounding (bitwise in half precision where
    the norms' statistics agree, which on these rows they do)."""
    model = toy_attention_model(attention, dtype)
    expected = _run(model, dtype)
    report = patch_model(model)
    layout = "per head" if per_head else "over each token's heads"
    assert report.fused_qk == [f"attention: q_norm, k_norm ({layout}) and apply_rotary_pos_emb at line "
                               f"{_rope_line(attention)} -> one qk_norm_rope launch (full rotary)"]
    with counting_launches(monkeypatch) as launches:
        got = _run(model, dtype)
    assert launches[0] == 1
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 0.0, torch.float16: 0.0}[dtype]
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()
    unpatch_model(model)
    assert type(model.attention) is attention
    assert torch.equal(_run(model, dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tensor_sites_run_one_launch_each_and_compute_as_unpatched(dtype, monkeypatch):
    """Gemma 4's layout (``qk_sites``' "One tensor at a time"): the queries' and the keys' norm and RoPE one launch
    each, the output the unpatched one's to the norms' rounding (bitwise in bf16 on these rows); a hook on the keys'
    norm runs the original forward."""
    model = toy_attention_model(OneTensorAttention, dtype)
    expected = _run(model, dtype)
    report = patch_model(model)
    lines = [_line(OneTensorAttention, f"rotary_one({x}_states") for x in ("query", "key")]
    assert report.fused_qk == [f"attention: q_norm (per head) and rotary_one at line {lines[0]}; k_norm (per head) "
                               f"and rotary_one at line {lines[1]} -> one qk_norm_rope launch each (full rotary)"]
    with counting_launches(monkeypatch) as launches:
        got = _run(model, dtype)
    assert launches[0] == 2
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 0.0}[dtype]
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()
    loaded = pickle.loads(pickle.dumps(model))  # its kind probes the function again
    with counting_launches(monkeypatch) as launches:
        assert torch.equal(_run(loaded, dtype), got)
    assert launches[0] == 2
    seen = []
    model.attention.k_norm.register_forward_hook(lambda module, args, output: seen.append(output))
    with counting_launches(monkeypatch) as launches:
        hooked = _run(model, dtype)
    assert launches[0] == 0 and len(seen) == 1
    assert (hooked.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()
    unpatch_model(model)
    assert type(model.attention) is OneTensorAttention


class _OneTensorStatementBetween(QwenAttention):
    """One tensor: a statement between the norm and the RoPE."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = rotary_one(query_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
        key_states = rotary_one(key_states, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        return self.attend(query_states, key_states, value_states)


class _OneTensorOtherAxis(QwenAttention):
    """One tensor: the RoPE broadcast over another axis than the heads (the default unsqueeze_dim=1 on
    ``[batch, tokens, heads, head_dim]``)."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = self.q_norm(query_states)
        query_states = rotary_one(query_states, cos, sin)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_norm(key_states)
        key_states = rotary_one(key_states, cos, sin)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        return self.attend(query_states, key_states, value_states)


@pytest.mark.parametrize("attention", [_OneTensorStatementBetween, _OneTensorOtherAxis])
def test_one_tensor_statements_of_another_form_run_as_written(attention, monkeypatch):
    """Only ``X = self.x_norm(A)`` directly followed by ``X = F(X, C, S, unsqueeze_dim=2)`` is a one-tensor site: a
    statement in between, a RoPE chained with a transpose, or another broadcast axis leave the attention as written,
    with the reason."""
    model = toy_attention_model(attention)
    expected = _run(model)
    report = patch_model(model)
    assert not report.fused_qk and _qk_skips(report), report
    with counting_launches(monkeypatch) as launches:
        got = _run(model)
    assert launches[0] == 0 and torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention, label", [
    (RopeFirstAttention, "apply_rotary_pos_emb at line {line}, then q_norm, k_norm (per head) -> one qk_rope_norm "
                         "launch (full rotary)"),
    (OppositeAngleAttention, "opposite_rotary_pos_emb at line {line}, then q_norm, k_norm (per head) -> one "
                             "qk_rope_norm launch (full rotary, the opposite angle)"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rope_before_the_norms_runs_one_launch_and_computes_as_unpatched(attention, label, dtype, monkeypatch):
    """HunYuan's and NanoChat's order (``qk_sites``' "The RoPE before the norms"), the norms' statements in either
    order: one ``qk_rope_norm`` launch, the output the unpatched one's to the norms' rounding (bitwise in half
    precision on these rows); pickled, the kind probes its function again; a hook on a norm runs the original."""
    model = toy_attention_model(attention, dtype)
    expected = _run(model, dtype)
    report = patch_model(model)
    assert report.fused_qk == [f"attention: {label.format(line=_rope_line(attention))}"]
    with counting_launches(monkeypatch) as launches:
        got = _run(model, dtype)
        assert torch.equal(_run(pickle.loads(pickle.dumps(model)), dtype), got)
    assert launches[0] == 2
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 0.0, torch.float16: 0.0}[dtype]
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()
    seen = []
    model.attention.q_norm.register_forward_hook(lambda module, args, output: seen.append(output))
    with counting_launches(monkeypatch) as launches:
        hooked = _run(model, dtype)
    assert launches[0] == 0 and len(seen) == 1
    assert (hooked.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()
    unpatch_model(model)
    assert type(model.attention) is attention and torch.equal(_run(model, dtype), expected)


def test_the_rope_before_the_norms_runs_as_written_where_a_call_cannot_fuse(monkeypatch):
    """Tables that require a gradient (which the kernels do not compute): the RoPE, then the norms in the
    forward's order (the keys' first here), as unpatched."""
    model = toy_attention_model(OppositeAngleAttention)
    hidden, (cos, sin) = toy_inputs()
    cos.requires_grad_(True)
    expected = model(hidden, (cos, sin))
    patch_model(model)
    order = []
    for name in ("q_norm", "k_norm"):
        getattr(model.attention, name).register_forward_pre_hook(lambda module, args, name=name: order.append(name))
    monkeypatch.setattr(qk_runtime, "_watched", lambda attention, paths: False)  # the hooks only record the order
    with counting_launches(monkeypatch) as launches:
        got = model(hidden, (cos, sin))
    assert launches[0] == 0 and order == ["k_norm", "q_norm"]
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


class _RopeFirstStatementBetween(QwenAttention):
    """The RoPE first, a statement between it and the norms."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = qk_toys.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        return self.attend(query_states, key_states, value_states)


class _RopeFirstCrossedNorms(QwenAttention):
    """The RoPE first, the keys' norm given the queries."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = qk_toys.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(query_states[:, : key_states.shape[1]])
        return self.attend(query_states, key_states, value_states)


class _RopeFirstInALoop(QwenAttention):
    """The RoPE and the norms inside a loop (which could run them again with other values)."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        for _ in range(1):
            query_states, key_states = qk_toys.apply_rotary_pos_emb(query_states, key_states, cos, sin)
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        return self.attend(query_states, key_states, value_states)


@pytest.mark.parametrize("attention", [_RopeFirstStatementBetween, _RopeFirstCrossedNorms, _RopeFirstInALoop])
def test_rope_first_statements_of_another_form_run_as_written(attention, monkeypatch):
    """Only ``Q, K = F(Q, K, C, S)`` directly followed by ``Q = self.q_norm(Q)`` and ``K = self.k_norm(K)``, in a
    block of the forward's body or of its ``if`` statements, is a RoPE-first site: the attention is left as
    written, with the reason."""
    model = toy_attention_model(attention)
    expected = _run(model)
    report = patch_model(model)
    assert not report.fused_qk and _qk_skips(report)[0].endswith(qk_sites.NO_ROPE_FIRST), report
    with counting_launches(monkeypatch) as launches:
        got = _run(model)
    assert launches[0] == 0 and torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_rope_first_training_gradients_match_unpatched(monkeypatch):
    grads = {}
    for label in ("eager", "patched"):
        model = toy_attention_model(OppositeAngleAttention, torch.float32).train()
        if label == "patched":
            patch_model(model)
        hidden, trig = toy_inputs()
        with counting_launches(monkeypatch) as launches:
            model(hidden, trig).square().sum().backward()
        assert launches[0] == (label == "patched")
        grads[label] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["eager"].items():
        scale = grad.abs().max().item()
        assert (grads["patched"][name] - grad).abs().max().item() <= 1e-4 * scale, name


def _line(cls, text: str) -> int:
    import inspect
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _rope_line(cls) -> int:
    import inspect
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if "_rotary_pos_emb(query_states" in line)


def test_partial_rotary_is_fused_where_the_function_rotates_part_of_the_head(monkeypatch):
    model = toy_attention_model(PartialRotaryAttention, torch.bfloat16)
    expected = _run(model, torch.bfloat16, rotary_dim=HEAD_DIM // 2)
    report = patch_model(model)
    assert report.fused_qk[0].endswith("(full and partial rotary)")
    with counting_launches(monkeypatch) as launches:
        assert torch.equal(_run(model, torch.bfloat16, rotary_dim=HEAD_DIM // 2), expected)
    assert launches[0] == 1


def test_a_full_rotary_function_given_partial_tables_runs_as_written(monkeypatch):
    """Qwen3's function cannot take a narrower cos: the original statements run, and raise as they would."""
    model = toy_attention_model(QwenAttention)
    patch_model(model)
    with counting_launches(monkeypatch) as launches, pytest.raises(RuntimeError):
        _run(model, rotary_dim=HEAD_DIM // 2)
    assert launches[0] == 0


# ----------------------------------------------------------------------------------- the probe


@pytest.mark.parametrize("function, reason", [
    (qk_toys.interleaved_rotary_pos_emb, "does not compute the kernel's rotate_half RoPE"),
    (qk_toys.fp32_rotary_pos_emb, "bit for bit in bf16"),
])
def test_the_probe_refuses_other_ropes(function, reason):
    verdict = qk_probe.probe_rope(function)
    assert isinstance(verdict, str) and reason in verdict


def test_the_probe_accepts_hugging_faces_rope_in_every_dtype_pair():
    verdict = qk_probe.probe_rope(qk_toys.apply_rotary_pos_emb)
    assert {pair for pair, cast in verdict.dtypes} == set(qk_probe.DTYPE_PAIRS)
    assert not any(cast for _, cast in verdict.dtypes) and not verdict.partial and not verdict.negate_sin
    assert qk_probe.probe_rope(qk_toys.partial_rotary_pos_emb).partial


def test_the_probe_finds_the_opposite_angle_of_nanochats_rope():
    from transformers.models.nanochat import modeling_nanochat

    for function in (qk_toys.opposite_rotary_pos_emb, modeling_nanochat.apply_rotary_pos_emb):
        verdict = qk_probe.probe_rope(function)
        assert verdict.negate_sin and {pair for pair, _ in verdict.dtypes} == set(qk_probe.DTYPE_PAIRS)


def test_olmo2s_rope_casting_back_is_probed_so():
    from transformers.models.olmo2 import modeling_olmo2

    verdict = dict(qk_probe.probe_rope(modeling_olmo2.apply_rotary_pos_emb).dtypes)
    assert verdict[torch.bfloat16, torch.float32] is True and verdict[torch.bfloat16, torch.bfloat16] is False


# ----------------------------------------------------------------------------------- checks at every call


def test_a_rope_function_replaced_after_patching_runs_instead(monkeypatch):
    """Liger-Kernel replaces a modeling module's apply_rotary_pos_emb: the replacement runs, unfused."""
    model = toy_attention_model(QwenAttention)
    patch_model(model)
    seen, original = [], qk_toys.apply_rotary_pos_emb

    def replacement(q, k, cos, sin):
        seen.append(q.shape)
        return original(q, k, cos, sin)

    with counting_launches(monkeypatch) as launches:
        monkeypatch.setattr(qk_toys, "apply_rotary_pos_emb", replacement)
        _run(model)
    assert launches[0] == 0 and len(seen) == 1


def test_a_rotate_half_replaced_after_patching_runs_instead(monkeypatch):
    model = toy_attention_model(QwenAttention)
    expected = _run(model)
    patch_model(model)
    with counting_launches(monkeypatch) as launches:
        monkeypatch.setattr(qk_toys, "rotate_half", lambda x: torch.zeros_like(x))
        got = _run(model)
    assert launches[0] == 0 and not torch.allclose(got, expected)


def test_a_dtype_pair_not_probed_runs_as_written(monkeypatch):
    """fp32 activations with bf16 tables: the norms' fp32 output and bf16 cos are no pair the probe tried."""
    model = toy_attention_model(QwenAttention)
    hidden, (cos, sin) = toy_inputs()
    with torch.no_grad():
        expected = model(hidden, (cos.bfloat16(), sin.bfloat16()))
        patch_model(model)
        with counting_launches(monkeypatch) as launches:
            got = model(hidden, (cos.bfloat16(), sin.bfloat16()))
    assert launches[0] == 0 and torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------- hooks and wrappers


_HOOKED = ["attention", "attention.q_norm", "attention.k_norm", "attention.v_proj", "attention.k_proj"]


@pytest.mark.parametrize("path", _HOOKED)
@pytest.mark.parametrize("hook", ["forward", "forward_pre", "full_backward"])
def test_a_hook_on_the_site_runs_the_original_forward(path, hook, monkeypatch):
    """A hook on the attention, its q/k norms or a module called between them and the RoPE sees the unpatched
    calls: the original forward runs; removed, the next call is fused again."""
    model = toy_attention_model(QwenAttention)
    patch_model(model)
    module = model.get_submodule(path)
    seen = []
    if hook == "forward":
        handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    elif hook == "forward_pre":
        handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    else:
        handle = module.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].shape))
    hidden, trig = toy_inputs()
    hidden.requires_grad_(True)
    with counting_launches(monkeypatch) as launches:
        model(hidden, trig).sum().backward()
        assert launches[0] == 0 and seen
        handle.remove()
        model(hidden, trig).sum().backward()
        assert launches[0] == 1


def test_a_norm_hook_sees_what_it_sees_unpatched():
    model = toy_attention_model(QwenAttention)
    hidden, trig = toy_inputs()
    seen = {}
    for label in ("eager", "patched"):
        outputs = []
        handle = model.attention.q_norm.register_forward_hook(lambda m, args, out: outputs.append(out))
        with torch.no_grad():
            model(hidden, trig)
        handle.remove()
        seen[label] = outputs[0]
        patch_model(model)
    assert seen["eager"].shape == seen["patched"].shape
    assert torch.allclose(seen["eager"], seen["patched"], rtol=1e-6, atol=1e-6)


def test_a_wrapper_set_on_the_attention_class_after_patching_runs_unfused(monkeypatch):
    model = toy_attention_model(QwenAttention)
    patch_model(model)
    wrapped = []
    original = QwenAttention.forward

    def wrapper(self, *args, **kwargs):
        wrapped.append(True)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QwenAttention, "forward", wrapper)
    with counting_launches(monkeypatch) as launches:
        _run(model)
    assert wrapped and launches[0] == 0


def test_a_foreign_wrapper_before_patching_leaves_the_site_alone(monkeypatch):
    import functools

    original = QwenAttention.forward

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QwenAttention, "forward", wrapper)
    report = patch_model(toy_attention_model(QwenAttention))
    assert not report.fused_qk and _qk_skips(report)


def test_the_fused_attention_keeps_state_dict_deepcopies_and_pickles():
    import copy
    import pickle

    model = toy_attention_model(QwenAttention)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model)
    assert model.state_dict().keys() == keys.keys()
    assert all(torch.equal(v, keys[k]) for k, v in model.state_dict().items())
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(twin.attention) is type(model.attention)
        assert torch.equal(_run(twin), _run(model))


@pytest.mark.parametrize("attention", [QwenAttention, NormsUnderIfAttention, ClampIfAttention])
def test_training_gradients_match_unpatched(attention, monkeypatch):
    torch.manual_seed(0)
    grads = {}
    for label in ("eager", "patched"):
        model = toy_attention_model(attention, torch.float32).train()
        if label == "patched":
            patch_model(model)
        hidden, trig = toy_inputs()
        with counting_launches(monkeypatch) as launches:
            model(hidden, trig).square().sum().backward()
        assert launches[0] == (label == "patched")
        grads[label] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["eager"].items():
        scale = grad.abs().max().item()
        assert (grads["patched"][name] - grad).abs().max().item() <= 1e-4 * scale, name


# ----------------------------------------------------------------------------------- the invariants, broken


class _ReadBetweenAttention(QwenAttention):
    """2: the normed queries read between the norms and the RoPE."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2) + query_states[:, :1, :, :1]
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _RebindShapeAttention(OlmoAttention):
    """2: the view's shape rebound before the RoPE reads it again."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        hidden_shape = input_shape
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _CallBetweenAttention(QwenAttention):
    """3: a function of unknown effect called between the norms and the RoPE."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = torch.tanh(self.v_proj(hidden_states)).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _OtherLayoutAttention(QwenAttention):
    """4: the normed heads reach the RoPE through another rearrangement."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).permute(0, 2, 1, 3)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _LocalRopeAttention(QwenAttention):
    """5: the RoPE called through a local name."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        rope = apply_rotary_pos_emb
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = rope(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _InterleavedAttention(QwenAttention):
    """The probe: a RoPE of interleaved pairs."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = interleaved_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _CallingTestAttention(QwenAttention):
    """6: the RoPE under an if whose test calls a function."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if torch.is_grad_enabled() or True:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _TestReadsQueriesAttention(QwenAttention):
    """6: the if around the RoPE reads the queries, which are normed before it only in the original."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if query_states.dtype == value_states.dtype:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _RopeWithElseAttention(QwenAttention):
    """6: an if around the RoPE with an else, which could do anything with the normed values."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if self.head_dim:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        else:
            key_states = query_states
        return self.attend(query_states, key_states, value_states)


class _SkippedRopeAttention(QwenAttention):
    """6, kept: the RoPE under an if of a flag (``rotary``), its norms run apart where the flag is off."""

    rotary = True

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.rotary is not False:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


@pytest.mark.parametrize("rotary", [True, False])
def test_a_rope_under_an_if_is_fused_where_it_runs_and_the_norms_run_apart_elsewhere(rotary, monkeypatch):
    """Invariant 6: the test decided at every call, after the inputs of the norms are taken; one launch where the
    RoPE runs, the norms as written (no fused launch) where it does not, the unpatched output either way."""
    model = toy_attention_model(_SkippedRopeAttention)
    for module in model.modules():
        if isinstance(module, _SkippedRopeAttention):
            module.rotary = rotary
    expected = _run(model)
    report = patch_model(model)
    assert len(report.fused_qk) == 1 and "(under the if at line" in report.fused_qk[0], report
    with counting_launches(monkeypatch) as launches:
        got = _run(model)
    assert launches[0] == (1 if rotary else 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


_SPLIT = [(NormsUnderIfAttention, "use_qk_norm", True, "with the norms, under the if at line"),
          (NormsUnderIfAttention, "use_qk_norm", False, "with the norms, under the if at line"),
          (ClampIfAttention, "clip_qkv", None, "where the if does not run its body, at line"),
          (ClampIfAttention, "clip_qkv", 0.25, "where the if does not run its body, at line")]


@pytest.mark.parametrize("attention, flag, value, label", _SPLIT,
                         ids=[f"{cls.__name__}-{flag}={value}" for cls, flag, value, _ in _SPLIT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_site_split_at_an_if_is_fused_where_it_runs(attention, flag, value, label, dtype, monkeypatch):
    """Invariant 7: GLM-4.5's norms under ``if self.use_qk_norm:`` (one launch where it holds, neither norm nor
    launch where it does not) and OLMoE's ``if self.clip_qkv is not None:`` clamping the normed values (one launch
    where the clamps do not run, the statements as written where they do); the unpatched output either way, to the
    norms' rounding (bitwise in bf16)."""
    model = toy_attention_model(attention, dtype)
    setattr(model.attention, flag, value)
    expected = _run(model, dtype)
    report = patch_model(model)
    [fused] = report.fused_qk
    assert f"at line {_rope_line(attention)} ({label} " in fused and fused.endswith("-> one qk_norm_rope launch "
                                                                                    "(full rotary)")
    with counting_launches(monkeypatch) as launches:
        got = _run(model, dtype)
    assert launches[0] == (value in (True, None))
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 0.0}[dtype]
    assert (got.float() - expected.float()).abs().max().item() <= tolerance * expected.abs().max().item()


@pytest.mark.parametrize("attention, flag, value, label", _SPLIT,
                         ids=[f"{cls.__name__}-{flag}={value}" for cls, flag, value, _ in _SPLIT])
def test_a_split_site_compiles_without_graph_breaks(attention, flag, value, label):
    """torch.compile(fullgraph=True) traces the split site's ``if`` on the flag: the fused operator in the graph
    where the site fuses, not where it does not; the unpatched output either way."""
    model = toy_attention_model(attention)
    setattr(model.attention, flag, value)
    expected = _run(model)
    patch_model(model)
    compiled, graphs = compiled_fullgraph(model)
    hidden, trig = toy_inputs()
    with torch.no_grad():
        got = compiled(hidden, trig)
    assert any("qk_norm_rope_fwd" in graph for graph in graphs) == (value in (True, None))
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


class _ElseAfterNormsAttention(ClampIfAttention):
    """7: the if between the norms and the RoPE has an else."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        if self.clip_qkv is not None:
            query_states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        else:
            key_states.clamp_(min=-1.0, max=1.0)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _ClampTestReadsQueriesAttention(ClampIfAttention):
    """7: the skipped if's test reads the queries, normed before it only in the original."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        if query_states.dtype == torch.float16:
            query_states.clamp_(min=-1.0, max=1.0)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _ClampCallingTestAttention(ClampIfAttention):
    """7: the skipped if's test calls a function."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        if torch.is_grad_enabled():
            query_states.clamp_(min=-1.0, max=1.0)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _NormAfterClampAttention(ClampIfAttention):
    """7: the keys' norm after the skipped if."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        if self.clip_qkv is not None:
            query_states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class _NormOutsideIfAttention(NormsUnderIfAttention):
    """7: the queries' norm before the if holding the keys' norm."""

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        if self.use_qk_norm:
            key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


apply_rotary_pos_emb, interleaved_rotary_pos_emb = qk_toys.apply_rotary_pos_emb, qk_toys.interleaved_rotary_pos_emb
rotary_one = qk_toys.rotary_one

_BROKEN = [
    (_ReadBetweenAttention, "names query_states otherwise than binding it"),
    (_RebindShapeAttention, "rebinds the view's hidden_shape before the RoPE (invariant 2)"),
    (_CallBetweenAttention, "more than module calls and views (invariant 3)"),
    (_OtherLayoutAttention, "nor a view (view, transpose(1, 2)) of one (invariants 1, 4)"),
    (_LocalRopeAttention, "(invariants 1, 5, 6)"),
    (_InterleavedAttention, "does not compute the kernel's rotate_half RoPE"),
    (_CallingTestAttention, "the RoPE runs under a test that does more than read and compare (invariant 6)"),
    (_TestReadsQueriesAttention, "the if around the RoPE names query_states before it (invariant 6)"),
    (_RopeWithElseAttention, "(invariants 1, 5, 6)"),
    (_ElseAfterNormsAttention, "the if naming query_states or key_states before the RoPE has an else (invariant 7)"),
    (_ClampTestReadsQueriesAttention, "the if's test names query_states before it (invariant 7)"),
    (_ClampCallingTestAttention, "the norms would move across a test that does more than read and compare "
                                 "(invariant 7)"),
    (_NormAfterClampAttention, "a norm is after the if naming query_states or key_states (invariant 7)"),
    (_NormOutsideIfAttention, "a norm is outside the if naming query_states or key_states (invariant 7)"),
]


@pytest.mark.parametrize("attention, reason", _BROKEN, ids=[cls.__name__ for cls, _ in _BROKEN])
def test_a_site_breaking_an_invariant_is_left_as_written_with_the_reason(attention, reason, monkeypatch):
    model = toy_attention_model(attention)
    expected = _run(model)
    report = patch_model(model)
    assert not report.fused_qk
    assert any(reason in skip for skip in _qk_skips(report)), _qk_skips(report)
    with counting_launches(monkeypatch) as launches:
        got = _run(model)
    assert launches[0] == 0 and torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
