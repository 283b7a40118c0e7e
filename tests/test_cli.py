"""The command line end to end: import-hmm validation, parity with hmmlearn through the CLI, and errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from hmmlearn.hmm import CategoricalHMM

from latentlm.cli import main
from latentlm.models.synthetic import random_hmm


def write_npz(path, Z=4, V=7, seed=0, vocab=None, **override):
    t, _ = random_hmm(Z, V, seed)
    arrays = {"startprob": t["start"].numpy(), "transmat": t["trans"].numpy(), "emissionprob": t["emit"].numpy()}
    if vocab is not None:
        arrays["vocab"] = np.array(vocab)
    arrays.update(override)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return arrays


def run_cli(capsys, *argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()], err


def hmmlearn_model(arrays) -> CategoricalHMM:
    Z, V = arrays["emissionprob"].shape
    h = CategoricalHMM(n_components=Z, n_features=V)
    h.startprob_, h.transmat_, h.emissionprob_ = arrays["startprob"], arrays["transmat"], arrays["emissionprob"]
    return h


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parity_with_hmmlearn_through_the_cli(tmp_path, capsys, seed):
    Z, V = 5, 9
    arrays = write_npz(tmp_path / "m.npz", Z, V, seed)
    store = str(tmp_path / "store")
    assert main(["import-hmm", str(tmp_path / "m.npz"), "--name", "m", "--store", store]) == 0
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, V, size=n).tolist() for n in (1, 3, 8, 20, 2)]
    (tmp_path / "in.txt").write_text("".join(" ".join(map(str, s)) + "\n" for s in seqs))
    h = hmmlearn_model(arrays)
    common = ["--model", "m", "--store", store, "--ids", "--dtype", "float64", str(tmp_path / "in.txt")]
    _, scores, _ = run_cli(capsys, "score", *common)
    _, decodes, _ = run_cli(capsys, "decode", "--method", "viterbi", *common)
    _, posts, _ = run_cli(capsys, "posterior", "--top-k", "all", *common)
    for i, s in enumerate(seqs):
        X = np.array(s)[:, None]
        assert scores[i]["index"] == i and scores[i]["num_tokens"] == len(s)
        assert scores[i]["logprob"] == pytest.approx(h.score(X), abs=1e-8)
        lp, path = h.decode(X, algorithm="viterbi")
        assert decodes[i]["logprob"] == pytest.approx(lp, abs=1e-8)
        assert decodes[i]["states"] == path.tolist()
        ref = h.predict_proba(X)
        for t, m in enumerate(posts[i]["marginals"]):
            assert m["probs"] == sorted(m["probs"], reverse=True)
            got = np.zeros(Z)
            got[m["states"]] = m["probs"]
            np.testing.assert_allclose(got, ref[t], atol=1e-8)


def test_text_input_tokenised_per_manifest(tmp_path, capsys, monkeypatch):
    vocab = ["the", "cat", "sat", "<unk>", "<eos>"]
    write_npz(tmp_path / "m.npz", 3, 5, vocab=vocab)
    store = str(tmp_path / "s")
    main(["import-hmm", str(tmp_path / "m.npz"), "--name", "m", "--store", store])
    rc, rows, _ = run_cli(capsys, "score", "--model", "m", "--store", store, "--token-logprobs", "-",
                          stdin="the dog sat\n", monkeypatch=monkeypatch)
    assert rc == 0
    assert rows[0]["tokens"] == ["the", "<unk>", "sat", "<eos>"]
    assert rows[0]["num_tokens"] == 4 and len(rows[0]["token_logprobs"]) == 4
    assert rows[0]["perplexity"] == pytest.approx(np.exp(-rows[0]["logprob"] / 4))
    rc, rows, _ = run_cli(capsys, "sample", "--model", "m", "--store", store, "--n", "3", "--seed", "5",
                          "--prefix", "the cat")
    assert rc == 0 and len(rows) == 3
    for r in rows:
        assert set(r) >= {"tokens", "ids", "states"} and len(r["ids"]) == len(r["states"]) >= 1
        assert r["ids"][-1] == 4 or len(r["ids"]) == 32
    _, again, _ = run_cli(capsys, "sample", "--model", "m", "--store", store, "--n", "3", "--seed", "5",
                          "--prefix", "the cat")
    assert again == rows


BAD_NPZ = [
    ({"startprob": None}, "missing key 'startprob'"),
    ({"transmat": np.ones((4, 3)) / 3}, r"transmat: expected shape \[4, 4\]"),
    ({"emissionprob": np.full((4, 7), -1.0)}, "emissionprob: negative entry"),
    ({"startprob": np.array([np.nan, 0.5, 0.25, 0.25])}, "startprob: NaN"),
    ({"transmat": np.full((4, 4), 0.3)}, "transmat: row 0 sums to 1.2, not 1"),
    ({"startprob": np.array([0.5, 0.5, 0.5, 0.5])}, "startprob: sums to 2, not 1"),
    ({"vocab": np.array(["a", "b"])}, r"vocab: expected shape \[7\]"),
    ({"extra": np.zeros(2)}, "unexpected key 'extra'"),
]


@pytest.mark.parametrize("override,message", BAD_NPZ)
def test_import_hmm_rejects_bad_files_and_writes_nothing(tmp_path, capsys, override, message):
    write_npz(tmp_path / "bad.npz", **override)
    store = tmp_path / "store"
    rc = main(["import-hmm", str(tmp_path / "bad.npz"), "--name", "bad", "--store", str(store)])
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err
    assert not (store / "bad").exists()


def test_bad_ids_name_line_and_position(tmp_path, capsys, monkeypatch):
    write_npz(tmp_path / "m.npz", 3, 5)
    store = str(tmp_path / "s")
    main(["import-hmm", str(tmp_path / "m.npz"), "--name", "m", "--store", store])
    capsys.readouterr()
    for stdin, msg in [("1 2\n0 7 1\n", "line 2: token id 7 at position 1 is outside [0, 5)"),
                       ("1 x\n", "line 1: 'x' is not an integer token id"),
                       ("1 2\n\n", "line 2: empty sequence"),
                       ("1 -1\n", "line 1: token id -1 at position 1 is outside")]:
        rc, rows, err = run_cli(capsys, "score", "--model", "m", "--store", store, "--ids", "-",
                                stdin=stdin, monkeypatch=monkeypatch)
        assert rc == 2 and rows == [] and msg in err, err
    rc, _, err = run_cli(capsys, "score", "--model", "nope", "--store", store, "-", stdin="1\n",
                         monkeypatch=monkeypatch)
    assert rc == 2 and "model 'nope' not found" in err


def test_console_script_exit_code(tmp_path):
    write_npz(tmp_path / "bad.npz", transmat=np.full((4, 4), 0.3))
    p = subprocess.run([sys.executable, "-m", "latentlm.cli", "import-hmm", str(tmp_path / "bad.npz"), "--name",
                        "x", "--store", str(tmp_path / "s")], capture_output=True, text=True)
    assert p.returncode == 2 and "transmat: row 0 sums to 1.2" in p.stderr


def test_every_command_prints_its_help(capsys):
    """`latentlm COMMAND --help` for every command exits 0 and names its options (argparse formats help strings
    with %: a literal % in an option's help, e.g. --split-at's 10%,30%, once made `train --help` crash)."""
    from latentlm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "train" in sub.choices
    for name in sub.choices:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert "--" in capsys.readouterr().out, name


@pytest.mark.parametrize("setting", ["1", "0"])
def test_cli_calibrates_its_model_like_the_service(tmp_path, capsys, monkeypatch, setting):
    """`latentlm score` times the CPU engines on the model's matrix as `latentlm serve` does (LATENTLM_CALIBRATE, on
    by default), so both run the same engines; with LATENTLM_CALIBRATE=0 neither does."""
    import torch

    from latentlm.models import backend as dispatch

    write_npz(tmp_path / "m.npz", 24, 9)
    store = str(tmp_path / "s")
    main(["import-hmm", str(tmp_path / "m.npz"), "--name", "m", "--store", store])
    capsys.readouterr()
    saved = dict(dispatch.CHOICES)
    dispatch.CHOICES.clear()
    monkeypatch.setenv("LATENTLM_CALIBRATE", setting)
    try:
        rc, rows, _ = run_cli(capsys, "score", "--model", "m", "--store", store, "--ids", "-", stdin="1 2 3\n",
                              monkeypatch=monkeypatch)
        assert rc == 0 and len(rows) == 1
        chosen = {key for key in dispatch.CHOICES if key[0] == 24 and key[1] == torch.float32}
        assert chosen == ({(24, torch.float32, False), (24, torch.float32, True)} if setting == "1" else set())
    finally:
        dispatch.CHOICES.clear()
        dispatch.CHOICES.update(saved)
