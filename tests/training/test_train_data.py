"""PTB loading (MD5-checked), vocabularies, text files and encoding."""

from __future__ import annotations

import pytest

from latentlm.models.errors import InputError
from latentlm.models.vocab import Preprocessing
from latentlm.training.data import (
    build_vocab,
    encode_corpus,
    load_corpus,
    ptb_sentences,
    ptb_text,
    ptb_vocab,
    read_text_files,
)


def test_ptb_splits_match_the_standard_files():
    for split, words, lines in (("train", 887521, 42068), ("valid", 70390, 3370), ("test", 78669, 3761)):
        text = ptb_text(split)
        assert len(text.split()) == words
        assert len(ptb_sentences(split)) == lines
    assert not ptb_text("train").endswith("\n\n")


def test_ptb_vocab_and_eos_counts():
    v = ptb_vocab()
    assert len(v) == 10000 and v.unk_id is not None and v.eos_id is not None
    assert v.preprocessing.add_eos and not v.preprocessing.lowercase
    assert sum(map(len, encode_corpus(ptb_sentences("valid"), v))) == 73760
    with pytest.raises(InputError, match="split"):
        ptb_text("dev")


def test_text_files_vocab_cutoff_and_unk(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("The cat sat\n\nthe dog SAT\nthe cat\n", encoding="utf-8")
    sents = read_text_files([f], lowercase=True)
    assert sents == [["the", "cat", "sat"], ["the", "dog", "sat"], ["the", "cat"]]
    pre = Preprocessing(lowercase=True)
    v = build_vocab(sents, min_count=2, preprocessing=pre)
    assert v.tokens == ["<eos>", "<unk>", "the", "cat", "sat"]
    assert build_vocab(sents, max_size=4, preprocessing=pre).tokens == ["<eos>", "<unk>", "the", "cat"]
    ids = encode_corpus(sents, v)
    assert ids[1] == [v.index["the"], v.unk_id, v.index["sat"], v.eos_id]
    # the service's tokenisation gives the same ids
    assert v.encode("The DOG sat") == ids[1]
    with pytest.raises(InputError, match="no such file"):
        read_text_files([tmp_path / "missing.txt"])


def test_load_corpus_files_split_deterministically(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("".join(f"w{i % 7} w{i % 3}\n" for i in range(100)), encoding="utf-8")
    vocab, data = load_corpus([str(f)])
    assert len(data["valid"]) == 5 and len(data["train"]) == 95
    assert vocab.tokens[:2] == ["<eos>", "<unk>"]
