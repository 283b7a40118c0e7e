"""Constrained generation through the public REST contract (`POST /v1/constraint`, `POST /v1/sample` with
`constraint`), held against enumeration on tiny stored models of every chain family: `log_prob` equals the
brute-force sum P(C | prefix) (float64 service, 1e-9 relative), every constrained sample satisfies its constraint
and their frequencies follow the brute-force conditional (chi-square); errors name the field."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient

from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from tests.models.test_constrained import (
    EOS,
    VOCAB,
    continuations,
    exact,
    model,
    naive_satisfies,
    prefix_prob,
)
from tests.models.test_sampling import chi_square_pvalue

FAMILIES = ["hmm", "blocked_hmm", "rank_hmm", "tagging_hmm"]
SPECS = [
    {"include": [["a", "b c"], ["d"]], "max_tokens": 6},
    {"include": [["c"], ["a"]], "ordered": True, "exclude": ["d"], "max_tokens": 6},
    {"exclude": ["a b"], "min_tokens": 2, "max_tokens": 5, "suffix": "c"},
    {"regex": "a . * d", "max_tokens": 6},
]


def tensors(family: str, seed: int = 0):
    """The same tiny models as `tests.models.test_constrained.model` (its oracle's tables), as artifacts."""
    V = len(VOCAB)
    if family == "hmm":
        return random_hmm(3, V, seed, concentration=0.7)
    if family == "blocked_hmm":
        return random_blocked_hmm(2, 2, V, seed)
    if family == "rank_hmm":
        return random_rank_hmm(4, 2, V, seed)
    t, c = random_hmm(3, V, seed + 100)
    g = torch.Generator().manual_seed(seed)
    tag = torch.rand(3, 2, generator=g, dtype=torch.float64) + 0.1
    t["tag_emit"] = tag / tag.sum(1, keepdim=True)
    return t, {**c, "tags": ["N", "V"]}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = tmp_path_factory.mktemp("cstore")
    for fam in FAMILIES:
        t, c = tensors(fam)
        save_artifact(store, fam, fam, t, VOCAB, config=c)
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=tmp_path_factory.mktemp("st"),
                              max_constraint_states=64))
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        yield c


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_log_prob_equals_enumeration_over_rest(client, family, spec):
    for prefix in ([], [1], "c a"):
        pre = tuple(VOCAB.encode(prefix, add_eos=False)) if isinstance(prefix, str) else tuple(prefix)
        want, _ = exact(family, spec, pre)
        r = client.post("/v1/constraint", json={"model": family, "prefix": prefix, "constraint": spec})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "constraint" and body["automaton"]["states"] >= 1
        if want == 0:
            assert body["log_prob"] is None
        else:
            assert math.isclose(body["log_prob"], math.log(want), rel_tol=1e-9, abs_tol=1e-12), (body, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_the_conditionals_of_the_next_token(client, family):
    spec = SPECS[0]
    body = client.post("/v1/constraint", json={"model": family, "constraint": spec, "weights": True}).json()
    conts = continuations(family, ())
    for v in range(len(VOCAB)):  # P(C | v) = P(v, C) / p(v) by enumeration
        p_v = prefix_prob(model(family), (v,))
        p_vc = sum(p for y, p in conts.items() if y[0] == v and naive_satisfies(spec, y))
        want = p_vc / p_v if p_v > 0 else 0.0
        assert math.isclose(body["weights"][v], want, rel_tol=1e-9, abs_tol=1e-12), (v, body["weights"][v], want)


@pytest.mark.parametrize("family", FAMILIES)
def test_constrained_samples_satisfy_and_follow_the_conditional(client, family):
    spec, n = SPECS[1], 4000
    r = client.post("/v1/sample", json={"model": family, "n": n, "max_tokens": 6, "seed": 7, "constraint": spec})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    drawn = Counter(tuple(d["ids"]) for d in data)
    assert all(d["finish_reason"] == "eos" and d["ids"][-1] == EOS for d in data)
    assert all(naive_satisfies(spec, y) for y in drawn), [y for y in drawn if not naive_satisfies(spec, y)][:3]
    target = {y: p for y, p in continuations(family, ()).items() if naive_satisfies(spec, y)}
    total = sum(target.values())
    assert chi_square_pvalue(drawn, {k: p / total for k, p in target.items()}, n) > 1e-4
    small = {"model": family, "n": 5, "max_tokens": 6, "seed": 3, "constraint": spec}
    once, again = (client.post("/v1/sample", json=small).json()["data"] for _ in range(2))
    assert [d["ids"] for d in again] == [d["ids"] for d in once]  # seeded: the same draws


def test_errors_name_the_field(client):
    def err(body, path="/v1/constraint"):
        r = client.post(path, json=body)
        return r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]

    status, param, msg = err({"model": "hmm", "constraint": {"include": [["zebra"]]}})
    assert status == 422 and param.startswith("constraint.include") and "zebra" in msg
    assert err({"model": "hmm", "constraint": {"include": [["a"]], "bogus": 1}})[:2] == (422, "constraint.bogus")
    assert err({"model": "hmm", "constraint": {"max_tokens": 0}})[:2] == (422, "constraint.max_tokens")
    # 2^6 unordered groups: more automaton states than this server's LATENTLM_MAX_CONSTRAINT_STATES (64)
    big = {"include": [["a b"], ["b c"], ["c d"], ["d a"], ["a c"], ["b d"]], "max_tokens": 30}
    assert err({"model": "hmm", "constraint": big})[0] == 413
    status, param, _ = err({"model": "hmm", "n": 2, "constraint": {"include": [["a"]]}, "top_k": 2}, "/v1/sample")
    assert (status, param) == (422, "top_k")
    status, param, _ = err({"model": "hmm", "max_tokens": 3, "constraint": {"include": [["a"]], "max_tokens": 5}},
                           "/v1/sample")
    assert (status, param) == (422, "constraint.max_tokens")
    # probability 0: a suffix that no continuation of at most 2 tokens (with <eos>) can end with
    status, param, _ = err({"model": "hmm", "max_tokens": 2, "constraint": {"suffix": "a b"}}, "/v1/sample")
    assert status == 422 and param.startswith("constraint")


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_returns_the_most_probable_satisfying_continuations(client, family):
    """`beam`: the completions, best first, equal the n most probable satisfying continuations by enumeration
    when the search certifies them; `log_prob_given` is log p(y | C)."""
    spec = SPECS[0]
    r = client.post("/v1/constraint", json={"model": family, "constraint": spec, "beam": 64, "n_best": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    ranked = sorted(((p, y) for y, p in continuations(family, ()).items() if naive_satisfies(spec, y)),
                    reverse=True)
    got = body["completions"]
    assert got and all(naive_satisfies(spec, tuple(c["ids"])) for c in got)
    assert [c["log_prob"] for c in got] == sorted((c["log_prob"] for c in got), reverse=True)
    if body["certified"]:
        assert [tuple(c["ids"]) for c in got] == [y for _, y in ranked[: len(got)]]
        for c, (p, _) in zip(got, ranked, strict=False):
            assert math.isclose(c["log_prob"], math.log(p), rel_tol=1e-9)
            assert math.isclose(c["log_prob_given"], math.log(p) - body["log_prob"], rel_tol=1e-9, abs_tol=1e-12)
    else:
        assert body["gap"] > 0
    r = client.post("/v1/constraint", json={"model": family, "constraint": spec, "beam": 2, "n_best": 3})
    assert r.status_code == 422 and r.json()["error"]["param"] == "n_best"


def test_messages_are_reused_across_requests(client):
    """A guide asks once per generated token: the backward messages of the same (model, constraint, temperature)
    are built once and reused (`constrain.MESSAGES`), with the same answers as built afresh."""
    from latentlm.ops.constrain import MESSAGES

    body = {"model": "hmm", "constraint": {"include": [["b"]], "max_tokens": 5}, "weights": True}
    first = client.post("/v1/constraint", json=body).json()
    hits = MESSAGES.hits
    again = client.post("/v1/constraint", json={**body, "generated": [0]}).json()
    assert MESSAGES.hits == hits + 1
    MESSAGES.clear()
    fresh = client.post("/v1/constraint", json={**body, "generated": [0]}).json()
    assert again["weights"] == fresh["weights"] and again["log_prob"] == fresh["log_prob"]
    assert first["log_prob"] != again["log_prob"]  # after "a" the window and the automaton moved on
