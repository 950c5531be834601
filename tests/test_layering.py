"""Layering of the k3ir packages, as the ``[tool.importlinter]`` contracts of pyproject.toml state it:
``k3ir.cli`` > ``k3ir.runtime`` > ``k3ir.backends`` > ``k3ir.passes`` > the core; the frontend imports only the core;
backends and frontend are independent.

The source folders (``frontend/``, ``passes/``, ``backends/``, ``runtime/``, ``cli/``) are subpackages of ``k3ir``
only through pyproject's ``package-dir`` mapping, which import-linter's graph builder does not follow
(it walks the folder of the root package); so the check runs ``lint-imports`` on a copy of the sources
laid out as the wheel installs them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:                      # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
pytest.importorskip("importlinter", reason="import-linter is not installed (the `test` extra)")
#: ``lint-imports`` of this interpreter (its script may not be on PATH in an unactivated venv)
LINT_IMPORTS = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def _installed_layout(dest: Path) -> Path:
    """Copy the ``.py`` files of every package in ``package-dir`` to ``dest/<dotted path>``; returns ``dest``."""
    for package, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        target = dest.joinpath(*package.split("."))
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
    return dest


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject's contracts on the sources laid out at ``tree`` (run from there, so
    the checkout's own ``k3ir/`` folder is not what ``import k3ir`` finds)."""
    return subprocess.run([*LINT_IMPORTS, str(PYPROJECT), "--no-cache", "--no-logo"], check=False, cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=300)


def test_import_contracts_kept(tmp_path):
    r = _lint_imports(_installed_layout(tmp_path / "site"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


#: two-module import circles (direct imports both ways, run-time imports only) not broken yet: the Triton
#: package builds its executable, which reads ``interpreting`` from the package (``triton.config`` has it)
KNOWN_CIRCLES: set[tuple[str, str]] = set()

_CIRCLES = """
import grimp
g = grimp.build_graph("k3ir", cache_dir=None, exclude_type_checking_imports=True)
for a in sorted(g.modules):
    for b in sorted(g.find_modules_directly_imported_by(a)):
        if a < b and a in g.find_modules_directly_imported_by(b):
            print(a, b)
"""


def test_no_new_two_module_circles(tmp_path):
    """No two modules import each other (lazily or not), beyond ``KNOWN_CIRCLES``."""
    tree = _installed_layout(tmp_path / "site")
    r = subprocess.run([sys.executable, "-c", _CIRCLES], check=False, cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tree)}, timeout=300)
    assert r.returncode == 0, r.stderr
    circles = {tuple(line.split()) for line in r.stdout.splitlines()}
    assert circles - KNOWN_CIRCLES == set(), "modules that import each other"


def _core_modules() -> set[str]:
    """The core modules: every module and package directly in k3ir/, without ``__init__``."""
    core = ROOT / "k3ir"
    return ({p.stem for p in core.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in core.iterdir() if (p / "__init__.py").is_file()})


def test_contracts_list_every_core_module():
    contracts = {c["id"]: c for c in _pyproject()["tool"]["importlinter"]["contracts"]}
    layer = {m.strip() for m in contracts["layers"]["layers"][-1].split(":")}
    assert layer == _core_modules(), "the core layer of pyproject.toml's layers contract must list k3ir/'s modules"
    sources = set(contracts["core-below-frontend"]["source_modules"])
    assert sources == {f"k3ir.{m}" for m in _core_modules()}


def test_broken_layer_is_reported(tmp_path):
    """The check can fail: a core module importing the runtime breaks the layers contract."""
    tree = _installed_layout(tmp_path / "site")
    (tree / "k3ir" / "errors.py").write_text((tree / "k3ir" / "errors.py").read_text()
                                             + "\nimport k3ir.runtime.qb  # noqa\n")
    r = _lint_imports(tree)
    assert r.returncode != 0
    assert "k3ir.errors -> k3ir.runtime.qb" in r.stdout, r.stdout



# ---- registration lists: every built-in module is listed, and a listed module that is missing says so ----

def _defining(folder: Path, pattern: str, glob: str = "*.py") -> set[str]:
    """Stems of the ``glob`` files of ``folder`` whose source contains ``pattern``."""
    return {p.stem for p in folder.glob(glob) if pattern in p.read_text(encoding="utf-8")}


def test_op_families_listed():
    from k3ir.ops import FAMILIES
    assert sorted(FAMILIES) == sorted(_defining(ROOT / "k3ir" / "ops", "@op(")), "k3ir/ops/__init__.py FAMILIES"


def test_builtin_passes_listed():
    from k3ir.passes.manager import BUILTIN_PASSES
    assert sorted(BUILTIN_PASSES) == sorted(_defining(ROOT / "passes", "@register_pass("))


def test_builtin_backends_listed():
    from k3ir.backends import BUILTIN
    assert sorted(BUILTIN) == sorted(p.name for p in (ROOT / "backends").iterdir() if (p / "__init__.py").is_file())


def test_command_modules_listed():
    from k3ir.cli.app import COMMAND_MODULES
    listed = sorted(m.rsplit(".", 1)[1] for m in COMMAND_MODULES)
    assert listed == sorted(_defining(ROOT / "cli", "\ndef register("))


@pytest.mark.parametrize("listing, kind", [("k3ir.passes.manager.BUILTIN_PASSES", "pass"),
                                           ("k3ir.backends.BUILTIN", "backend")])
def test_missing_builtin_module_is_a_packaging_error(monkeypatch, listing, kind):
    """A listed module whose file is absent fails with an error naming it, not a later "unknown pass"."""
    import importlib

    import k3ir.backends
    import k3ir.passes.manager
    owner, attr = listing.rsplit(".", 1)
    mod = importlib.import_module(owner)
    monkeypatch.setattr(mod, attr, (*getattr(mod, attr), "absent_module"))
    if kind == "backend":
        monkeypatch.setattr(k3ir.backends, "_LOADED", False)
        load = k3ir.backends._load
    else:
        load = k3ir.passes.manager._load
    pkg = owner if kind == "backend" else "k3ir.passes"
    with pytest.raises(ModuleNotFoundError, match=rf"built-in {kind} module {pkg}\.absent_module .*packaging"):
        load()


def test_import_builtin_names_only_its_own_module():
    """A missing module is reported as a packaging error; a missing parent package (or an import inside a
    present module) propagates unchanged."""
    from k3ir.registration import import_builtin
    with pytest.raises(ModuleNotFoundError, match="absent_module"):
        import_builtin("k3ir.absent_module", "op family")
    with pytest.raises(ModuleNotFoundError) as e:
        import_builtin("k3ir.absent_package.child", "pass")
    assert e.value.name == "k3ir.absent_package" and "packaging" not in str(e.value)
