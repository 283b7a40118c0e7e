"""Valid JSON everywhere: a sentence the model gives probability 0 prints `null` (never -Infinity) from the
CLI, and a PCFG decoded without `method` answers with its family's default (the MBR parse)."""

from __future__ import annotations

import io
import json
import sys

from latentlm.cli import main

GRAMMAR = """S -> A B 1.0
A -> 'a' 0.5
A -> 'c' 0.5
B -> 'b' 1.0
"""


def strict_rows(text: str) -> list[dict]:
    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def run(capsys, monkeypatch, argv: list[str], stdin: str) -> tuple[int, list[dict], str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, strict_rows(out), err


def test_impossible_sentence_prints_null_and_pcfg_decodes_by_default(tmp_path, capsys, monkeypatch):
    (tmp_path / "g.txt").write_text(GRAMMAR)
    store = str(tmp_path / "store")
    assert main(["import-pcfg", str(tmp_path / "g.txt"), "--name", "g", "--store", store]) == 0
    capsys.readouterr()
    rc, rows, err = run(capsys, monkeypatch, ["score", "--model", "g", "--store", store], "a b\nb a\n")
    assert rc == 0, err
    assert rows[0]["logprob"] < 0 and rows[0]["perplexity"] > 1
    assert rows[1]["logprob"] is None and rows[1]["perplexity"] is None
    rc, rows, err = run(capsys, monkeypatch, ["decode", "--model", "g", "--store", store], "c b\n")
    assert rc == 0, err
    assert "tree" in rows[0], rows[0]
    assert rows[0]["tree"] == "(S (X 1) (X 2))" and rows[0]["spans"] == [[0, 2]], rows[0]  # MBR: leaves are ids
    assert rows[0]["expected_correct"] == 1.0
