"""The package layout as installed: every module of graphzero (passes/ included, as graphzero.passes) and
graphzero_tools imports in a fresh process, with no import circle and no side effect beyond
registering the backend; and graphzero refuses torch / DeepSpeed versions outside the tested range.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import graphzero
from graphzero import GraphZeroError, VersionError, versions

# graphzero.passes is named as well: under an editable install it lives in passes/, outside
# graphzero/'s directory, where pkgutil does not look (a wheel puts it inside, the walk finds it twice).
PACKAGES = ("graphzero", "graphzero.passes", "graphzero_tools")

# Imports every module of PACKAGES in one fresh interpreter and reports what importing changed.
IMPORT_ALL = textwrap.dedent("""
    import importlib, json, logging, os, pkgutil, sys, threading
    env_before = dict(os.environ)
    root_handlers = list(logging.getLogger().handlers)
    threads = threading.active_count()
    files = {}
    for top in PACKAGES:
        package = importlib.import_module(top)
        files[top] = package.__file__
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            files[info.name] = importlib.import_module(info.name).__file__
    import torch.distributed as dist
    from torch._dynamo import list_backends
    print(json.dumps({
        "files": files,
        "dist_initialized": dist.is_available() and dist.is_initialized(),
        "graphzero_backend": "graphzero" in list_backends(exclude_tags=()),
        "deepspeed_imported": "deepspeed" in sys.modules,
        "env_changed": sorted(k for k in {*env_before, *os.environ}
                              if env_before.get(k) != os.environ.get(k)),
        "root_handlers_added": len(logging.getLogger().handlers) - len(root_handlers),
        "threads_added": threading.active_count() - threads,
    }))
""").replace("PACKAGES", repr(PACKAGES))


@pytest.fixture(scope="module")
def imported_all(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run IMPORT_ALL in an empty directory with its own empty TMPDIR and no bytecode writing."""
    cwd, tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("tmpdir")
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("GRAPHZERO_DUMP_DIR", None)
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["created"] = sorted(str(p) for d in (cwd, tmp) for p in d.rglob("*"))
    return report


def test_every_module_imports(imported_all: dict) -> None:
    files = imported_all["files"]
    # passes/ is installed as graphzero.passes, and every tool is there under graphzero_tools
    assert {"graphzero.passes", "graphzero.passes.bucket", "graphzero.versions"} <= set(files)
    assert Path(files["graphzero.passes"]).parent.name == "passes"
    assert {"graphzero_tools.dump_cli", "graphzero_tools.dump_html", "graphzero_tools.compare"} <= set(files)


def test_import_has_no_side_effect_beyond_registering_the_backend(imported_all: dict) -> None:
    assert imported_all["graphzero_backend"]
    assert not imported_all["dist_initialized"]
    assert not imported_all["deepspeed_imported"]  # slow, and reads DS_ACCELERATOR: only when used
    assert imported_all["env_changed"] == []
    assert imported_all["root_handlers_added"] == 0
    assert imported_all["threads_added"] == 0
    assert imported_all["created"] == []


def _imports(path: Path, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules in `known` that `module` imports anywhere in its source (function bodies too)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known and name != module}
    return found


def test_no_import_circle(imported_all: dict) -> None:
    """Static: a circle through a function-level import would not fail at import, only later."""
    files = imported_all["files"]
    known = set(files)
    graph = {m: _imports(Path(f), m, f.endswith("__init__.py"), known) for m, f in files.items()}
    # A package's __init__ importing its own modules is how packages work; every other edge counts.
    edges = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}

    def circle_from(start: str, path: list[str], done: set[str]) -> list[str] | None:
        for target in sorted(edges[start]):
            if target in path:
                return [*path[path.index(target):], target]
            if target not in done:
                found = circle_from(target, [*path, target], done)
                if found:
                    return found
        done.add(start)
        return None

    done: set[str] = set()
    for module in sorted(edges):
        circle = circle_from(module, [module], done)
        assert circle is None, "import circle: " + " -> ".join(circle)


# ------------------------------------------------------------------------------- version check


@pytest.mark.parametrize(("package", "version", "tested"), [
    ("torch", "2.16.0", ">=2.13,<2.16"),
    ("torch", "2.16.0.dev20261120+cu132", ">=2.13,<2.16"),
    ("torch", "2.12.1+cpu", ">=2.13,<2.16"),
    ("deepspeed", "0.20.0", ">=0.19.8,<0.20"),
    ("deepspeed", "0.19.7", ">=0.19.8,<0.20"),
])
def test_version_outside_the_range_is_refused(package: str, version: str, tested: str) -> None:
    found = {"torch": "2.13.0", "deepspeed": "0.19.8", package: version}
    with pytest.raises(VersionError) as info:
        versions.check_versions(found)
    err = info.value
    assert isinstance(err, GraphZeroError) and isinstance(err, ImportError)
    assert (err.package, err.version, err.tested) == (package, version, tested)
    assert f"tested with {package}{tested}, but {package} {version} is installed" in str(err)


@pytest.mark.parametrize(("torch_version", "deepspeed_version"), [
    ("2.13.0", "0.19.8"), ("2.13.1+cpu", "0.19.12"), ("2.13.0a0+git1234", "0.19.8+cuda"), ("2.13.0", None),
    ("2.14.0", "0.19.8"), ("2.14.1+cu130", "0.19.8"), ("2.15.0+cu132", "0.19.8"),
])
def test_versions_inside_the_range_pass(torch_version: str, deepspeed_version: str | None) -> None:
    versions.check_versions({"torch": torch_version, "deepspeed": deepspeed_version})


def test_untested_versions_can_be_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"torch 2\.16\.0 is installed"):
        versions.check_versions({"torch": "2.16.0", "deepspeed": "0.19.8"})


def test_import_graphzero_checks_the_installed_versions(tmp_path: Path) -> None:
    """`import graphzero` with deepspeed's metadata faked to 0.20.1 fails with the named error."""
    code = textwrap.dedent("""
        from importlib import metadata
        real = metadata.version
        metadata.version = lambda name: "0.20.1" if name == "deepspeed" else real(name)
        try:
            import graphzero
        except Exception as e:
            print(type(e).__name__, e)
        else:
            print("imported")
    """)
    env = {k: v for k, v in os.environ.items() if k != versions.ALLOW_ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.startswith("VersionError graphzero is tested with deepspeed>=0.19.8,<0.20, but "
                                  "deepspeed 0.20.1 is installed"), proc.stdout + proc.stderr[-2000:]


def test_tested_ranges_match_the_package_requirements() -> None:
    """graphzero/versions.py and pyproject.toml's dependencies name the same ranges."""
    requirements = pytest.importorskip("packaging.requirements")
    specifiers = pytest.importorskip("packaging.specifiers")
    declared = map(requirements.Requirement, metadata.requires("graphzero") or [])
    required = {r.name: r.specifier for r in declared}
    for package in versions.TESTED:
        assert required[package] == specifiers.SpecifierSet(versions.tested_range(package)), package


def test_pyproject_and_readme_name_the_tested_ranges() -> None:
    """pyproject.toml as written (the installed metadata above may predate an edit) and the README's
    install paragraph name versions.TESTED's ranges: one source of truth, checked everywhere."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parent.parent
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    readme = (root / "README.md").read_text()
    for package in versions.TESTED:
        wanted = f"{package}{versions.tested_range(package)}"
        assert wanted in dependencies, f"pyproject.toml: {dependencies} lacks {wanted}"
        assert f"`{wanted}`" in readme, f"README.md does not name {wanted}"


def test_version_error_is_exported() -> None:
    assert graphzero.VersionError is VersionError and "VersionError" in graphzero.__all__


# ------------------------------------------------------------------------------- the wheel


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    """A plain `pip install graphzero` (not the editable install the suite runs under) gets every
    module: the wheel built from this tree holds each .py of graphzero/, passes/ (as graphzero/passes/)
    and tools/ (as graphzero_tools/). pyproject.toml lists its packages by hand; a subpackage left off
    that list imports here and is missing from the wheel (graphzero/deepspeed_adapter/ once was: its
    first run on a GPU machine, from the wheel, failed at `import graphzero`)."""
    root = Path(__file__).resolve().parent.parent
    # setuptools builds in the source tree (build/), whose leftovers would hide a missing package: a copy.
    source = tmp_path / "src"
    for part in ("graphzero", "passes", "tools"):
        shutil.copytree(root / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(root / part, source / part)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    wheel, = tmp_path.glob("graphzero-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.endswith(".py")}
    expected = set()
    for source, target in (("graphzero", "graphzero"), ("passes", "graphzero/passes"), ("tools", "graphzero_tools")):
        for f in (root / source).rglob("*.py"):
            if "__pycache__" not in f.parts:
                expected.add(f"{target}/{f.relative_to(root / source).as_posix()}")
    assert expected - shipped == set(), f"missing from the wheel: {sorted(expected - shipped)}"
