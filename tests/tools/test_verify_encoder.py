"""``scripts/verify.py`` on encoders (``hf_rmsnorm.tools.verify_encoder``): hidden-state and sentence-embedding
parity, the verdict and its exit status, the JSON document, and the choice of the encoder path."""

from __future__ import annotations

import json

import pytest
import torch
from test_verify import IN_PROCESS_DEVICE, QUICK, run_verify
from verify_samples import sample_encoder_report

from hf_rmsnorm.tools import verify, verify_encoder
from hf_rmsnorm.tools.loading import is_encoder, load_encoder
from hf_rmsnorm.tools.speed import ModelState
from hf_rmsnorm.tools.verify_report import EncoderVerifyReport
from hf_rmsnorm.tools.verify_settings import VerifyConfig
from hf_rmsnorm.tools.workload import Prompts


@pytest.mark.parametrize("preset, dtype", [("tiny-t5-encoder", "fp32"), ("tiny-t5-encoder", "bf16"),
                                           ("tiny-bert", "fp32"), ("tiny-bert", "bf16")])
def test_cli_passes_on_each_encoder_preset(preset, dtype, tmp_path):
    report_path = tmp_path / "report.json"
    result = run_verify("--model", preset, "--dtype", dtype, "--json", str(report_path), *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Verdict: PASS" in result.stdout and "needs a GPU" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["kind"] == "encoder" and report["passed"] is True and report["speed"] is None
    assert report["patch"]["norms"] > 0 and report["rule"] == verify_encoder.ENCODER_VERDICT_RULE
    parity = report["parity"]
    assert parity["reference_dtype"] == ("float64" if dtype == "fp32" else "float32")
    assert parity["positions"] < 2 * 12  # the second row is right-padded
    assert parity["patched_hidden_mean_err"] <= 1.10 * parity["unpatched_hidden_mean_err"]
    assert parity["patched_min_cosine"] > 0.999
    assert report["settings"]["speed_batch_size"] == 32 and report["settings"]["speed_tokens"] == 128


def test_an_encoder_decoder_is_checked_through_its_encoder(tmp_path):
    """A saved T5 (encoder-decoder) checkpoint: its encoder is loaded, patched and compared."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                        decoder_start_token_id=0)).save_pretrained(tmp_path)
    assert is_encoder(str(tmp_path))
    config = VerifyConfig(model=str(tmp_path), dtype="bf16", batch_size=2, prompt_len=12, max_new_tokens=2,
                          repeats=1)
    report = verify.run(config, torch.device(IN_PROCESS_DEVICE))
    assert report.passed and report.model_class == "T5Stack" and report.patch.norms == 5


def test_a_wrong_patched_norm_fails_with_exit_status_1(monkeypatch, capsys):
    """A patched norm that computes something else (its weight moved after the unpatched run) fails the verdict,
    and scripts/verify.py turns that into exit status 1."""
    real_patch = verify.patch_model

    def patch_then_break(model):
        report = real_patch(model)
        with torch.no_grad():
            model.get_submodule(report.norms[0]).weight.mul_(1.5)
        return report

    monkeypatch.setattr(verify, "patch_model", patch_then_break)
    config = VerifyConfig(model="tiny-t5-encoder", dtype="fp32", batch_size=2, prompt_len=12, max_new_tokens=2,
                          repeats=1)
    report = verify.run(config, torch.device(IN_PROCESS_DEVICE))
    assert not report.passed and not report.parity.hidden_ok and not report.parity.embeddings_ok
    assert "Verdict: FAIL" in verify.render(report)


def test_decoders_and_encoders_are_told_apart(tmp_path):
    assert is_encoder("tiny-bert") and not is_encoder("tiny-llama") and not is_encoder("Qwen/Qwen3-0.6B")
    for architectures, encoder in ((["BertModel"], True), (["XLMRobertaForMaskedLM"], True),
                                   (["LlamaForCausalLM"], False), (["GPT2LMHeadModel"], False)):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
        assert is_encoder(str(tmp_path)) is encoder, architectures


def test_embeddings_pool_over_real_tokens_only():
    """Padding changes neither a row's pooled embedding nor its norm: the mean runs over the mask's ones."""
    hidden = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    padded = hidden.clone()
    padded[0, 3:] = 1e6  # whatever sits at padded positions
    emb = verify_encoder.sentence_embeddings(padded, mask)
    expected = torch.nn.functional.normalize(hidden[0, :3].mean(0), dim=-1)
    torch.testing.assert_close(emb[0], expected)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(2, dtype=torch.float64))


def test_right_padding_keeps_each_rows_tokens_in_order():
    left = Prompts(torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    right = verify_encoder.right_padded(left, pad_id=0)
    assert right.input_ids.tolist() == [[5, 6, 0, 0], [7, 8, 9, 10]]
    assert right.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_the_embedding_workload_is_timed_interleaved_and_reported_after_every_round(monkeypatch, tmp_path):
    """``measure_forward_states`` (the GPU path, its CUDA calls stubbed so it runs on CPU): every round (a warm-up,
    then the timed ones) runs each state in turn, and after each timed round the figures so far go to
    ``on_round``, which ``verify`` writes as a partial document: a run stopped while timing keeps what it
    measured."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    model, _ = load_encoder("tiny-bert", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    prompts = Prompts(torch.randint(3, 500, (2, 8)), torch.ones(2, 8, dtype=torch.long))
    events, rounds = [], []
    states = [ModelState(name, lambda name=name: events.append(f"enter {name}"),
                         lambda name=name: events.append(f"leave {name}"))
              for name in ("unpatched", "patched", "norm_free")]
    rates = verify_encoder.measure_forward_states(model, states, prompts, repeats=2,
                                                  on_round=lambda r, done: rounds.append((sorted(r), done)))
    assert events == [f"{verb} {name}" for _ in range(3) for name in ("unpatched", "patched", "norm_free")
                      for verb in ("enter", "leave")]
    assert rounds == [(["norm_free", "patched", "unpatched"], 1), (["norm_free", "patched", "unpatched"], 2)]
    assert all(rate > 0 for rate in rates.values())
    # The partial document after round 1 says so, and reads back whole.
    partial = verify_encoder.with_speed(sample_encoder_report(speed=None),
                                        verify_encoder.speed_report(rates, 1, partial=True))
    verify.write_json(partial, tmp_path / "report.json")
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["speed"]["partial"] is True and document["speed"]["rounds"] == 1
    assert EncoderVerifyReport.from_dict(document) == partial
