"""Whole ``verify`` reports of made-up figures, a decoder's and an encoder's, for the tests of what reads one
(``verify.render``, the GPU suite's summary)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from hf_rmsnorm.tools import parity, verify_encoder, workload
from hf_rmsnorm.tools.verify import _speed_report
from hf_rmsnorm.tools.verify_report import (
    EncoderSettings,
    EncoderVerifyReport,
    Environment,
    GeneratedText,
    NormOutputAgreement,
    ParityReport,
    PatchSummary,
    SpeedFigures,
    SpeedReport,
    VerifyReport,
    WorkloadSettings,
)
from hf_rmsnorm.tools.verify_settings import VERDICT_RULE


def identical_parity() -> ParityReport:
    """Parity of a patched model whose logits and greedy tokens are the unpatched model's."""
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    generation = workload.Generation(tokens, torch.zeros(4, 2, 32).scatter_(-1, tokens.T.unsqueeze(-1), 5.0))
    return parity.compare(logits, logits.clone(), logits, torch.bfloat16, generation, generation)


def speed_report(unpatched: SpeedFigures, patched: SpeedFigures, norm_free: SpeedFigures) -> SpeedReport:
    return _speed_report({"unpatched": unpatched, "patched": patched, "norm_free": norm_free}, rounds=2)


def sample_report(**changes) -> VerifyReport:
    """A GPU run's report of a bf16 model that passed, with ``changes`` (``VerifyReport`` fields) applied."""
    report = VerifyReport(
        passed=True, failure=None, model="m", model_class="C", weights="random weights (seed 0)", parameters=10**6,
        dtype="bf16",
        settings=WorkloadSettings(batch_size=1, parity_batch_size=2, parity_prompts="chat", parity_prompt_len=9,
                                  prompt_len=8, max_new_tokens=3, repeats=2, seed=0, compile=None),
        environment=Environment(hf_rmsnorm="0", torch="0", transformers="0", triton="0", python="3", device="cuda",
                                device_name="GPU", triton_interpreter=False, kernels="Triton kernels on the GPU"),
        patch=PatchSummary(norms=5, fused_adds=4, fused_qk=0, qk_apart=0, skipped=1,
                           skipped_modules=[("lm_head", "not a norm")], families=["Llama"]),
        parity=identical_parity(),
        norm_outputs=NormOutputAgreement(norm_calls=5, elements=2_000_000, differing=3, max_ulp=1),
        generations=[GeneratedText(prompt="Q0?", unpatched="A0", patched="A0")],
        rule=VERDICT_RULE,
        speed=speed_report(SpeedFigures(1000.0, 80.0, 2**30), SpeedFigures(1100.0, 100.0, 2**30),
                           SpeedFigures(1250.0, 120.0, 2**30)),
    )
    return dataclasses.replace(report, **changes)


def sample_encoder_report(**changes) -> EncoderVerifyReport:
    """A GPU run's report of a bf16 encoder that passed (patched hidden states equal to the unpatched ones), with
    ``changes`` (``EncoderVerifyReport`` fields) applied."""
    hidden = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    base = sample_report()
    report = EncoderVerifyReport(
        kind="encoder", passed=True, failure=None, model="e", model_class="BertModel",
        weights="random weights (seed 0)", parameters=10**6, dtype="bf16",
        settings=EncoderSettings(parity_batch_size=2, parity_tokens=4, speed_batch_size=32, speed_tokens=128,
                                 repeats=2, seed=0),
        environment=base.environment, patch=replace(base.patch, families=["LayerNorm"]),
        parity=verify_encoder.compare(hidden, hidden.clone(), hidden, mask, torch.bfloat16),
        norm_outputs=base.norm_outputs, rule=verify_encoder.ENCODER_VERDICT_RULE,
        speed=verify_encoder.speed_report({"unpatched": 1000.0, "patched": 1200.0, "norm_free": 1250.0}, rounds=2),
    )
    return dataclasses.replace(report, **changes)
