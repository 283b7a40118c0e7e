"""A model over an LM's tokenizer, served in process: a tiny dense HMM over a byte-level BPE trained in the test
(multi-byte characters). Text inputs are the tokenizer's ids (+ eos), samples and completions carry the text the
tokenizer decodes (leading spaces, characters split across tokens), `logprobs.tokens` join to exactly `text`,
/v1/models and `latentlm list` name the tokenizer; a word-level model beside it keeps its answers."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from latentlm.cli import main
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.tokenizer import TextTokenizer
from latentlm.models.vocab import Vocabulary
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from tests.helpers_tokenizer import EOS, make_bpe_tokenizer, make_metaspace_tokenizer, make_tokenizer_hmm_store

TEXTS = ["Zürich café 日本", "the river runs past an apple tree", " crème brûlée 🍎.", "東京\nnaïve señora"]


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def store(tmp_path_factory, tok):
    store = tmp_path_factory.mktemp("tokstore")
    make_tokenizer_hmm_store(store, "bpe", tok, states=4, seed=0)
    make_tokenizer_hmm_store(store, "meta", make_metaspace_tokenizer(), states=3, seed=1)
    t, c = random_hmm(3, 5, seed=2)
    save_artifact(store, "words", "hmm", t, Vocabulary(["a", "b", "c", "<unk>", "<eos>"]), config=c)
    return store


@pytest.fixture(scope="module")
def client(store, tmp_path_factory):
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=tmp_path_factory.mktemp("st")))
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        yield c


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_name_the_tokenizer(client, store, tok, capsys):
    by_id = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    sha = json.loads((store / "bpe" / "manifest.json").read_text())["files"]["tokenizer.json"]
    assert by_id["bpe"]["tokenizer"] == {"type": "tokenizer.json", "sha256": sha, "vocab_size": 300,
                                         "decoder": "byte_level"}
    assert by_id["meta"]["tokenizer"]["decoder"] == "metaspace+byte_fallback"
    assert by_id["words"]["tokenizer"] == "whitespace"
    assert by_id["bpe"]["vocab_size"] == tok.get_vocab_size()
    assert main(["list", "--store", str(store)]) == 0
    listed = {d["id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert listed["bpe"]["tokenizer"]["sha256"] == sha and listed["words"]["tokenizer"] == "whitespace"


def test_text_inputs_are_the_tokenizers_ids(client, tok):
    eos = tok.token_to_id(EOS)
    ids = [tok.encode(t).ids + [eos] for t in TEXTS]
    by_text = post(client, "/v1/score", {"model": "bpe", "input": TEXTS, "token_logprobs": True})["data"]
    by_ids = post(client, "/v1/score", {"model": "bpe", "input": ids, "token_logprobs": True})["data"]
    assert by_text == by_ids
    for d, s in zip(by_text, ids, strict=True):
        assert d["num_tokens"] == len(s) and d["tokens"] == [tok.id_to_token(i) for i in s]
    for op in ("posterior", "decode"):
        a = post(client, f"/v1/{op}", {"model": "bpe", "input": TEXTS})["data"]
        assert a == post(client, f"/v1/{op}", {"model": "bpe", "input": ids})["data"]
    assert len(a[0]["states"]) == len(ids[0])


def test_sample_text_is_the_tokenizers_decode(client, tok):
    eos = tok.token_to_id(EOS)
    for prefix in (None, "Zürich café", [tok.token_to_id("æ")]):  # the last: half of a character
        body = {"model": "bpe", "n": 30, "max_tokens": 12, "seed": 3, **({"prefix": prefix} if prefix else {})}
        data = post(client, "/v1/sample", body)["data"]
        pre = [] if prefix is None else tok.encode(prefix).ids if isinstance(prefix, str) else prefix
        for d in data:
            ids = d["ids"][:-1] if d["finish_reason"] == "eos" else d["ids"]
            assert list(d) == ["index", "tokens", "text", "ids", "states", "finish_reason"]
            full = tok.decode(pre + ids)
            if isinstance(prefix, str):  # the text the continuation adds after the prefix's
                assert full.startswith(prefix) and d["text"] == full[len(prefix):]
            else:  # no prefix, or half a character that the continuation's text completes (or replaces)
                assert d["text"] == (full if ids else "")
            if not pre:
                assert d["text"] == tok.decode(d["ids"]) and (d["ids"][-1] == eos) == (d["finish_reason"] == "eos")
    words = post(client, "/v1/sample", {"model": "words", "n": 3, "seed": 1})["data"]
    assert all("text" not in d for d in words)


def test_cli_sample_text(store, tok, capsys):
    assert main(["sample", "--model", "bpe", "--store", str(store), "--n", "5", "--seed", "4", "--prefix",
                 "naïve"]) == 0
    pre = tok.encode("naïve").ids
    for d in map(json.loads, capsys.readouterr().out.splitlines()):
        ids = d["ids"][:-1] if d["finish_reason"] == "eos" else d["ids"]
        assert d["text"] == tok.decode(pre + ids)[len("naïve"):]


def test_stop_text_through_the_tokenizer(client, tok):
    stop = " the"
    data = post(client, "/v1/sample", {"model": "bpe", "n": 40, "max_tokens": 30, "seed": 5, "stop": stop})["data"]
    sid = tok.encode(stop).ids
    assert any(d["finish_reason"] == "stop" for d in data)
    for d in data:
        ids = d["ids"]
        assert not any(ids[k: k + len(sid)] == sid for k in range(len(ids)))


@pytest.mark.parametrize(("prompt", "echo"), [("", False), ("Zürich café", False), ("Zürich café", True),
                                              ("日", False), ("日", True)])
def test_completions_logprob_tokens_join_to_text(client, tok, echo, prompt):
    body = {"model": "bpe", "prompt": prompt, "max_tokens": 10, "n": 6, "seed": 7, "logprobs": 3, "echo": echo}
    r = post(client, "/v1/completions", body)
    pre = tok.encode(prompt).ids
    sampled = post(client, "/v1/sample", {"model": "bpe", "n": 6, "max_tokens": 10, "seed": 7,
                                          **({"prefix": prompt} if prompt else {})})["data"]
    for ch, s in zip(r["choices"], sampled, strict=True):
        lp = ch["logprobs"]
        assert "".join(lp["tokens"]) == ch["text"]
        ids = s["ids"][:-1] if s["finish_reason"] == "eos" else s["ids"]
        full = tok.decode(pre + ids)
        assert ch["text"] == (full if echo else full[len(tok.decode(pre)):])
        if not echo:
            assert ch["text"] == s["text"]
        assert len(lp["bytes"]) == len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        spelled = (pre if echo else []) + ids
        assert b"".join(bytes(b) for b in lp["bytes"]) == b"".join(TextTokenizer.from_hf(tok).token_bytes[i]
                                                                   for i in spelled)
        offsets = lp["text_offset"]
        base = 0 if echo else len(prompt)
        assert offsets == [base + len("".join(lp["tokens"][:t])) for t in range(len(lp["tokens"]))]
        for top in lp["top_logprobs"][1 if echo else 0:]:
            assert 1 <= len(top) <= 4


def test_completions_stream_joins_to_text(client):
    body = {"model": "bpe", "prompt": "café", "max_tokens": 8, "n": 2, "seed": 9, "logprobs": 1}
    whole = post(client, "/v1/completions", body)["choices"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = {0: "", 1: ""}
    for e in events:
        for ch in e["choices"]:
            texts[ch["index"]] += ch["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in whole]


def test_metaspace_model_text(client):
    """SentencePiece-style: a sample's text drops its first "▁" as the tokenizer's decode does."""
    tok = make_metaspace_tokenizer()
    t = TextTokenizer.from_hf(tok)
    data = post(client, "/v1/sample", {"model": "meta", "n": 60, "max_tokens": 4, "seed": 2})["data"]
    checked = 0
    for d in data:
        ids = d["ids"][:-1] if d["finish_reason"] == "eos" else d["ids"]
        assert d["text"] == t.decode_text(ids)
        try:
            b"".join(t.text_bytes(ids)).decode("utf-8")
        except UnicodeDecodeError:  # `tokenizers` writes each byte of an invalid run as U+FFFD
            continue
        assert d["text"] == tok.decode(ids)
        checked += 1
    assert checked >= 5
    r = post(client, "/v1/completions", {"model": "meta", "prompt": "hello", "max_tokens": 6, "seed": 1,
                                         "logprobs": 0, "echo": True})
    ch = r["choices"][0]
    assert ch["text"].startswith("hello") and "".join(ch["logprobs"]["tokens"]) == ch["text"]
    s = post(client, "/v1/score", {"model": "meta", "input": ["hello world"]})["data"][0]
    assert s["num_tokens"] == len(tok.encode("hello world").ids) + 1


def test_word_level_completion_unchanged(client):
    r = post(client, "/v1/completions", {"model": "words", "prompt": "a b", "max_tokens": 4, "seed": 1,
                                         "logprobs": 1})
    lp = r["choices"][0]["logprobs"]
    assert "bytes" not in lp and "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert all(t.startswith(" ") for t in lp["tokens"])
