"""Constraints over text for a served model that carries its LM's tokenizer (a tiny dense HMM over a byte-level BPE
trained in the test), in process: `POST /v1/constraint`'s probability that a keyword occurs as a whole word agrees
with the keyword's frequency among unconstrained samples (the independent text checker of
tests/models/test_text_constraint.py on their decoded text); every constrained sample's and completion's text
satisfies its constraint; min_words / max_words are refused for a word-level model; errors name the field."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.tokenizer import TextTokenizer, tokenizer_files, vocab_for
from latentlm.models.vocab import Vocabulary
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from tests.helpers_tokenizer import EOS, make_bpe_tokenizer
from tests.models.test_text_constraint import satisfies

TOK = TextTokenizer.from_hf(make_bpe_tokenizer(400))
FAVOURED = [b" apple", b" a", b"pple", b"p", b"le", b" river", b" the", b".", b" ", b"s"]


def peaked_hmm(Z: int = 4, seed: int = 0) -> tuple[dict, dict]:
    """A dense HMM over the tokenizer's 400 ids that ends often (eos 0.15 per state) and spells " apple" whole or in
    pieces: 0.75 of each state's emission on FAVOURED (Dirichlet), 0.1 spread over every other id."""
    g = torch.Generator().manual_seed(seed)
    V = TOK.vocab_size
    fav = [TOK.token_bytes.index(b) for b in FAVOURED]
    emit = torch.full((Z, V), 0.10 / (V - 1 - len(fav)), dtype=torch.float64)
    emit[:, 0] = 0.15
    d = torch.distributions.Gamma(torch.full((len(fav),), 0.8, dtype=torch.float64), 1.0).sample((Z,))
    emit[:, fav] = 0.75 * d / d.sum(1, keepdim=True)
    trans = torch.rand(Z, Z, generator=g, dtype=torch.float64) + 0.2
    start = torch.rand(Z, generator=g, dtype=torch.float64) + 0.2
    return {"start": start / start.sum(), "trans": trans / trans.sum(1, keepdim=True), "emit": emit}, {"num_states": Z}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = tmp_path_factory.mktemp("text-constraint-store")
    torch.manual_seed(0)
    t, c = peaked_hmm()
    save_artifact(store, "bpe", "hmm", t, vocab_for(TOK, eos=EOS), config=c, extra_files=tokenizer_files(TOK))
    t, c = random_hmm(3, 5, seed=2)
    save_artifact(store, "words", "hmm", t, Vocabulary(["a", "b", "c", "<unk>", "<eos>"]), config=c)
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=tmp_path_factory.mktemp("st")))
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        yield c


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(ids: list[int]) -> str:
    return TOK.decode([i for i in ids if i != 0])  # eos is id 0


def test_keyword_probability_matches_its_frequency_among_free_samples(client):
    window = {"max_tokens": 10}
    spec = {"include": [["apple"]], **window}
    p_window = math.exp(post(client, "/v1/constraint", {"model": "bpe", "constraint": window})["log_prob"])
    p_c = math.exp(post(client, "/v1/constraint", {"model": "bpe", "constraint": spec})["log_prob"])
    n = 4000
    free = post(client, "/v1/sample", {"model": "bpe", "n": n, "max_tokens": 10, "seed": 11})["data"]
    done = [d for d in free if d["finish_reason"] == "eos"]
    hits = sum(satisfies(spec, text_of(d["ids"]), len(d["ids"])) for d in done)
    assert len(done) / n == pytest.approx(p_window, abs=4 * math.sqrt(p_window * (1 - p_window) / n))
    assert hits / n == pytest.approx(p_c, abs=4 * math.sqrt(p_c * (1 - p_c) / n) + 1e-3)
    assert hits > 100


SPECS = [
    {"include": [["river"], ["apple"]], "ordered": True, "max_words": 6, "max_tokens": 14},
    {"include": [["café", "apple"]], "exclude": ["the"], "suffix": ".", "max_tokens": 12},
    {"regex": "( [a-z]+)+\\.", "min_words": 2, "max_tokens": 10},
]


@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_constrained_samples_and_completions_satisfy(client, spec):
    data = post(client, "/v1/sample", {"model": "bpe", "n": 30, "seed": 1, "prefix": "The", "constraint": spec})
    for d in data["data"]:
        assert d["ids"][-1] == 0 and satisfies(spec, text_of(d["ids"]), len(d["ids"])), d
        assert d["text"] == text_of(d["ids"])
    r = post(client, "/v1/completions", {"model": "bpe", "prompt": "The", "n": 3, "seed": 2, "constraint": spec,
                                         "max_tokens": spec["max_tokens"]})
    for ch in r["choices"]:
        assert satisfies(spec, ch["text"], spec["max_tokens"]), ch["text"]
    answer = post(client, "/v1/constraint", {"model": "bpe", "constraint": spec, "weights": True, "prefix": "The"})
    assert answer["log_prob"] is not None and len(answer["weights"]) == 400
    assert answer["automaton"]["states"] >= 2 and "byte_states" in answer["automaton"]


def test_errors_name_the_field(client):
    cases = [
        ("words", {"include": [["a"]], "max_words": 3}, 422, "constraint.max_words"),
        ("words", {"min_words": 1}, 422, "constraint.min_words"),
        ("bpe", {"include": [["apple"]], "exclude": ["apple"]}, 422, "constraint"),
        ("bpe", {"include": [["\ufffd"]]}, 422, "constraint.include"),
        ("bpe", {"include": [[""]]}, 422, "constraint.include"),
        ("bpe", {"min_words": 5, "max_words": 2}, 422, "constraint.max_words"),
        ("bpe", {"regex": ".*a.{15}"}, 413, "constraint.regex"),
    ]
    for model, spec, status, param in cases:
        r = client.post("/v1/constraint", json={"model": model, "constraint": spec})
        assert r.status_code == status and r.json()["error"]["param"] == param, (spec, r.text)
