"""scripts/prepare_gpu.py and the wheels it fetches: the carried wheels (with the GPU image's own packages) cover
every module the suite's commands import and every pytest plugin they name; the download is idempotent, keeps
one version of each wheel and fails in one line."""

import ast
import email
import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from launching import ROOT, SCRIPTS
from packaging.requirements import Requirement

from harness import gpu_suite, gpu_wheels

pytestmark = pytest.mark.harness  # the newest-releases leg only (pyproject.toml, markers)

FIRST_PARTY = {"hf_rmsnorm", "harness", "scripts"}
SHARED_TEST_MODULES = {path.stem for path in (ROOT / "tests").glob("*.py")}
# Markers as the GPU image's interpreter evaluates them (Python 3.12 on Linux).
GPU_PYTHON = {"python_version": gpu_wheels.PYTHON_VERSION, "python_full_version": f"{gpu_wheels.PYTHON_VERSION}.0",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def _requirements(metadata) -> list[str]:
    """The distributions a distribution's metadata requires on the GPU image (extras and other platforms left out)."""
    names = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(GPU_PYTHON):
            names.append(gpu_wheels.normalized(requirement.name))
    return names


def _image_distributions() -> set[str]:
    """The image's packages with their dependencies, as far as this environment's metadata tells (a package not
    installed here counts alone)."""
    seen, todo = set(), [gpu_wheels.normalized(name) for name in gpu_wheels.IMAGE_PACKAGES]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += _requirements(importlib.metadata.metadata(name))
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def _provided_modules() -> set[str]:
    """Top-level modules the GPU machine has once the wheels are installed: the image's (by this environment's
    metadata, plus each image package's own name), the carried wheels', and pip's (every venv has it)."""
    image = _image_distributions()
    modules = {module for module, dists in importlib.metadata.packages_distributions().items()
               if any(gpu_wheels.normalized(d) in image for d in dists)}
    modules |= {name.replace("-", "_") for name in gpu_wheels.IMAGE_PACKAGES}
    return modules | {m for wheel in gpu_wheels.WHEELS for m in wheel.modules} | {"pip"}


def _source_of(module: str) -> Path | None:
    """The checkout's file of a first-party module (the package, the harness, the scripts, tests' shared
    modules); None for any other."""
    parts = module.split(".")
    if parts[0] in SHARED_TEST_MODULES:
        return ROOT / "tests" / f"{parts[0]}.py"
    if parts[0] not in FIRST_PARTY:
        return None
    path = ROOT.joinpath(*parts)
    return path / "__init__.py" if (path / "__init__.py").is_file() else path.with_suffix(".py")


def _third_party_imports(entries: list[Path]) -> dict[str, Path]:
    """Every top-level module outside the checkout and the standard library that ``entries`` import, directly or
    through the checkout's modules, at any depth (lazy imports inside functions too), with a file importing it."""
    found, seen, todo = {}, set(), list(entries)
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        package = path.parent.relative_to(ROOT).parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, (base, node.module)))
                modules = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for module in modules:
                source = _source_of(module)
                top = module.split(".")[0]
                if source is not None:
                    todo.append(source)
                elif top not in FIRST_PARTY | SHARED_TEST_MODULES and top not in sys.stdlib_module_names:
                    found.setdefault(top, path)
    return found


def _entries(section: gpu_suite.Section) -> tuple[list[Path], list[str]]:
    """A section's real command as the files it runs (scripts, test files with pytest's conftest) and the modules
    it runs with ``-m`` or loads with ``-p``."""
    argv = section.argv(False, py="python3", work="/work", repo=str(ROOT))
    files = [ROOT / item for item in argv if item.endswith(".py") and (ROOT / item).is_file()]
    if any(f.name.startswith("test_") for f in files):
        files.append(ROOT / "tests" / "conftest.py")
    modules = [argv[2]] if argv[1] == "-m" else []
    modules += [argv[i + 1] for i, item in enumerate(argv[:-1]) if item == "-p" and not argv[i + 1].startswith("no:")]
    return files, modules


def test_the_wheels_cover_every_module_the_sections_import():
    provided = _provided_modules()
    for section in gpu_suite.SECTIONS:
        files, modules = _entries(section)
        missing = {m: "the command" for m in modules if m.split(".")[0] not in provided | FIRST_PARTY}
        missing |= {m: str(p.relative_to(ROOT)) for m, p in _third_party_imports(files).items() if m not in provided}
        assert not missing, f"{section.name} needs modules no carried wheel or image package provides: {missing}"


def test_the_tests_section_loads_only_plugins_that_travel_as_wheels():
    tests = next(s for s in gpu_suite.SECTIONS if s.name == "tests")
    argv = tests.argv(False, py="python3", work="/work", repo=str(ROOT))
    plugins = [argv[i + 1] for i, item in enumerate(argv[:-1]) if item == "-p" and not argv[i + 1].startswith("no:")]
    carried = {m: w.name for w in gpu_wheels.WHEELS for m in w.modules}
    assert {carried[p.split(".")[0]] for p in plugins} == {"pytest-xdist", "pytest-timeout"}
    assert "-n" in argv and "--timeout" in argv and argv[1:3] == ["-m", "pytest"] and "pytest" in carried


def test_every_carried_wheel_finds_what_it_requires():
    """Each wheel's requirements (read from the downloaded wheel, else from this environment's install) are
    carried too or come with the image."""
    have = _image_distributions() | {gpu_wheels.normalized(w.name) for w in gpu_wheels.WHEELS}
    checked = 0
    for wheel in gpu_wheels.WHEELS:
        downloaded = sorted(gpu_wheels.WHEEL_DIR.glob(f"{gpu_wheels.normalized(wheel.name)}-{wheel.version}-*.whl"))
        if downloaded:
            with zipfile.ZipFile(downloaded[0]) as archive:
                name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
                metadata = email.message_from_bytes(archive.read(name))
        else:
            try:
                metadata = importlib.metadata.metadata(wheel.name)
            except importlib.metadata.PackageNotFoundError:
                continue
        checked += 1
        assert set(_requirements(metadata)) <= have, wheel.name
    assert checked >= len(gpu_wheels.WHEELS) - 1  # at most Liger unchecked (not installed here, not downloaded)


def _fake_pip(calls: list[list[str]], fail: str | None = None):
    """Stands in for ``subprocess.run`` of ``pip download``: writes the wheel file pip would, or fails."""

    def run(argv, **kwargs):
        calls.append(argv)
        pin = argv[-1]
        if pin.startswith(fail or "\0"):
            return subprocess.CompletedProcess(argv, 1, "", "Collecting x\nERROR: No matching distribution found\n")
        name, version = pin.split("==")
        Path(argv[argv.index("-d") + 1], f"{gpu_wheels.normalized(name)}-{version}-py3-none-any.whl").touch()
        return subprocess.CompletedProcess(argv, 0, "", "")

    return run


def test_prepare_fetches_what_is_missing_keeps_one_version_and_is_idempotent(tmp_path):
    (tmp_path / "pytest-8.0.0-py3-none-any.whl").touch()  # another version of a pinned wheel
    (tmp_path / "unpinned-1.0-py3-none-any.whl").touch()
    calls: list[list[str]] = []
    lines = gpu_wheels.prepare(tmp_path, _fake_pip(calls))
    assert len(calls) == len(gpu_wheels.WHEELS)
    assert {gpu_wheels.wheel_key(p) for p in tmp_path.glob("*.whl")} == {
        (gpu_wheels.normalized(w.name), w.version) for w in gpu_wheels.WHEELS}
    assert "removed pytest-8.0.0-py3-none-any.whl (not pinned in harness/gpu_wheels.py)" in lines
    # Built for the GPU image's interpreter and machine, one wheel at a time, never its dependencies.
    assert all({"--no-deps", "--only-binary=:all:", gpu_wheels.PYTHON_VERSION, "manylinux2014_x86_64"} <= set(c)
               for c in calls)
    calls.clear()
    assert all(line.startswith("kept ") for line in gpu_wheels.prepare(tmp_path, _fake_pip(calls))) and not calls


def test_prepare_says_in_one_line_which_wheel_it_could_not_fetch(tmp_path):
    with pytest.raises(gpu_wheels.PrepareError) as info:
        gpu_wheels.prepare(tmp_path, _fake_pip([], fail="pytest-xdist"))
    message = str(info.value)
    assert "\n" not in message and message.startswith("could not download pytest-xdist==3.8.0 for CPython 3.12")
    assert "No matching distribution found" in message


def test_prepare_script_reports_a_failure_in_one_line(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("prepare_gpu", SCRIPTS / "prepare_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(gpu_wheels.subprocess, "run", _fake_pip([], fail="liger-kernel"))
    assert script.main(["--dest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prepare_gpu.py: error: could not download liger-kernel")
