"""The operators' namespace is named after the code that defines them (``library.py``): torch.compile's on-disk
caches key a compiled graph on the operator names in it, so a change to the kernels, their launch or a registered
backward must change the name for a warm cache not to run the old code."""

from __future__ import annotations

import importlib
import shutil
from importlib import resources

import torch

from hf_rmsnorm import rms_norm
from hf_rmsnorm.ops import library


def _copy_of_ops(tmp_path):
    copy = tmp_path / "ops"
    shutil.copytree(resources.files("hf_rmsnorm.ops"), copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_namespace_is_the_digest_of_the_installed_ops(tmp_path):
    assert library.NAMESPACE == f"hf_rmsnorm_{library.source_digest(_copy_of_ops(tmp_path))}"
    importlib.import_module("hf_rmsnorm.ops.qk")  # defines the q/k operators
    for name in ("norm_fwd", "norm_bwd", "norm_fwd_triton", "qk_norm_rope_fwd", "qk_norm_rope_bwd_triton"):
        assert library.op(name).default.name() == library.qualified_name(name)


def test_any_change_to_a_source_or_data_file_changes_the_digest(tmp_path):
    ops = _copy_of_ops(tmp_path)
    digest = library.source_digest(ops)
    functional = ops / "functional.py"
    original = functional.read_bytes()
    functional.write_bytes(original.replace(b"round_before_dsum=True", b"round_before_dsum=False", 1))
    assert original != functional.read_bytes() and library.source_digest(ops) != digest
    functional.write_bytes(original)
    assert library.source_digest(ops) == digest

    plans = ops / "tuned_plans.json"
    plans.write_bytes(plans.read_bytes() + b" ")
    assert library.source_digest(ops) != digest
    plans.unlink()
    assert library.source_digest(ops) != digest  # a file gone


def test_compiled_bytecode_and_other_files_leave_the_digest_alone(tmp_path):
    ops = _copy_of_ops(tmp_path)
    digest = library.source_digest(ops)
    (ops / "__pycache__").mkdir()
    (ops / "__pycache__" / "functional.cpython-311.pyc").write_bytes(b"\0" * 16)
    (ops / "notes.txt").write_text("not code")
    assert library.source_digest(ops) == digest


def test_a_compiled_graph_names_the_operators_by_the_namespace():
    """What dynamo hands the compilers, whose caches hash the graph's code."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    x, weight = torch.randn(3, 16), torch.randn(16)
    torch.compile(lambda a, w: rms_norm(a, w, 1e-6), backend=record, fullgraph=True)(x, weight)
    assert graphs and f"{library.NAMESPACE}.norm_fwd" in graphs[0]
