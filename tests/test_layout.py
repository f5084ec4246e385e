"""The package's architecture, checked: three wings importing only downward (tools -> patch -> ops), the
development harness outside the package and above it, a public API that imports lazily, one version, and one
place deciding which backend runs."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import hf_rmsnorm
from hf_rmsnorm.ops import backend

PACKAGE = Path(hf_rmsnorm.__file__).resolve().parent
# What each wing may import from the package: itself and the wings below it.
ALLOWED = {"ops": {"ops"}, "patch": {"patch", "ops"}, "tools": {"tools", "patch", "ops"}}


def _pyproject() -> dict:
    """The checkout's pyproject.toml, parsed."""
    return tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, relative imports resolved to absolute names."""
    wing = path.relative_to(PACKAGE).parts[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module or "")
            else:
                parents = ["hf_rmsnorm", wing][: 3 - node.level]
                found.add(".".join([*parents, *filter(None, [node.module])]))
    return found


def _wings_imported(path: Path) -> set[str]:
    return {name.split(".")[1] for name in _imports(path) if name.startswith("hf_rmsnorm.")}


@pytest.mark.parametrize("wing", sorted(ALLOWED))
def test_wings_import_only_downward(wing):
    files = sorted((PACKAGE / wing).glob("*.py"))
    assert files
    for path in files:
        assert _wings_imported(path) <= ALLOWED[wing], (path.name, _wings_imported(path))
        if wing == "ops":  # the kernel library knows nothing of transformers
            assert not any(name.split(".")[0] == "transformers" for name in _imports(path)), path.name


def test_the_harness_lives_outside_the_package_and_above_it():
    """The development harness (GPU suite, benchmarks, inspection, tuning, coverage) imports the package; no module
    of the package imports the harness, and the wheel's packages (pyproject's find rule) leave it out."""
    import fnmatch

    root = PACKAGE.parent
    for path in sorted(PACKAGE.rglob("*.py")):
        assert not any(name.split(".")[0] == "harness" for name in _imports(path)), path
    harness = sorted(p for p in (root / "harness").glob("*.py") if p.name != "__init__.py")
    assert len(harness) > 5 and not any((PACKAGE / "tools" / path.name).exists() for path in harness)
    # setuptools' find rule keeps the packages whose dotted names match an include pattern.
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert any(fnmatch.fnmatchcase("hf_rmsnorm.ops", pattern) for pattern in include)
    assert not any(fnmatch.fnmatchcase(name, pattern) for name in ("harness", "harness.gpu_suite")
                   for pattern in include)


def _fresh_modules(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(sorted(m for m in sys.modules if m.startswith('hf_rmsnorm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_importing_the_package_defines_no_kernel_and_the_library_never_imports_the_tools():
    assert _fresh_modules("import hf_rmsnorm") == ["hf_rmsnorm"]
    assert "hf_rmsnorm.ops.kernels" not in _fresh_modules("from hf_rmsnorm.ops import backend")
    library = _fresh_modules("from hf_rmsnorm import patch_model, rms_norm, fused_add_rms_norm")
    assert "hf_rmsnorm.ops.kernels" in library
    assert not any(m.startswith("hf_rmsnorm.tools") for m in library)


def test_public_api():
    from hf_rmsnorm import (  # noqa: F401
        PatchReport,
        UnconvertibleModelError,
        UnsupportedModelError,
        fused_add_rms_norm,
        patch_model,
        rms_norm,
        unpatch_model,
    )

    assert sorted(hf_rmsnorm.__all__) == sorted(dir(hf_rmsnorm))
    assert issubclass(UnconvertibleModelError, UnsupportedModelError) and issubclass(UnsupportedModelError, ValueError)
    with pytest.raises(AttributeError, match="no attribute 'recentre'"):
        hf_rmsnorm.recentre  # noqa: B018


def test_one_version():
    assert importlib.metadata.version("hf-rmsnorm") == hf_rmsnorm.__version__


def test_the_backend_refuses_to_switch_once_the_kernels_exist():
    other = "cuda" if backend.kernels_interpreted() else "cpu"
    with pytest.raises(RuntimeError, match="already defined .* call hf_rmsnorm.ops.backend.configure"):
        backend.configure(other)


def test_the_backend_rule():
    x = torch.ones(2, 4)
    assert backend.runs_kernels(x) is backend.kernels_interpreted()
    assert not backend.runs_kernels(x.double())  # fp64 takes the PyTorch path
    assert not backend.runs_kernels(torch.ones(2, 4, device="meta"))
    assert "interpreter" in backend.describe("cpu") or not backend.kernels_interpreted()


def test_the_interpreter_refuses_a_numpy_its_triton_cannot_run_with():
    """Triton's interpreter before 3.7 breaks on NumPy 2.4+ in every loop with a runtime bound: one clear line."""
    assert backend.interpreter_problem((3, 6), (2, 4)) == (
        "Triton 3.6's CPU interpreter fails with NumPy 2.4 (NumPy >= 2.4 needs Triton >= 3.7): "
        "pip install 'numpy<2.4', or a newer triton"
    )
    assert backend.interpreter_problem((3, 6), (2, 3)) is None
    assert backend.interpreter_problem((3, 7), (2, 5)) is None
    assert backend._version("2.4.0rc1") == (2, 4) and backend._version("3.10.0+git") == (3, 10)


def test_the_oldest_releases_tested_are_pyprojects_lower_bounds():
    """The second half of the README's test command installs .ci/oldest.txt: its pins must be the lower bounds
    pyproject.toml states, or the range it claims is not the range tested."""
    from packaging.version import Version

    root = PACKAGE.parent
    project = _pyproject()["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    lower_bounds = dict(re.match(r"([\w-]+)>=([\d.]+)", r).groups() for r in requirements if ">=" in r)
    pins = dict(re.match(r"([\w-]+)==([\d.]+)", line).groups()
                for line in (root / ".ci" / "oldest.txt").read_text().splitlines() if "==" in line)
    for name, pinned in pins.items():
        if name in lower_bounds:
            assert Version(pinned) == Version(lower_bounds[name]), (name, pinned, lower_bounds[name])
    # torch: see the file; the test tools and optional extras are not part of what is claimed to work.
    claimed = set(lower_bounds) - {"torch", "pytest", "pytest-timeout", "pytest-xdist", "gguf", "matplotlib"}
    assert claimed <= set(pins), claimed - set(pins)


def test_the_readme_states_pyprojects_python_and_torch_ranges():
    """The README's set-up section names the Python and torch releases pyproject.toml admits, ``>=A,<B`` read as
    "A to" the release before B, so that what users are told is what pip lets them install."""
    project = _pyproject()["project"]
    torch_spec = next(r for r in project["dependencies"] if r.startswith("torch"))
    readme = " ".join((PACKAGE.parent / "README.md").read_text().split())
    for spec, name in ((project["requires-python"], "CPython"), (torch_spec, "torch")):
        bounds = re.fullmatch(r"[a-z]*>=([\d.]+),<(\d+)\.(\d+)", spec)
        assert bounds, f"{spec!r}: a range of the tested releases is written >=A,<B"
        low, major, minor = bounds.groups()
        assert f"{name} {low} to {major}.{int(minor) - 1}" in readme, (spec, name)
