"""Brown clustering: the exact merge loss against brute-force AMI, and a tiny corpus's known result."""

from __future__ import annotations

import itertools

import numpy as np

from latentlm.training.brown import _Window, brown_clusters
from latentlm.training.data import build_vocab, encode_corpus


def ami(P: np.ndarray, p1: np.ndarray) -> float:
    m = P > 0
    return float((P[m] * np.log(P[m] / np.outer(p1, p1)[m])).sum())


def merged(P: np.ndarray, p1: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(p1)
    keep = [i for i in range(n) if i not in (a, b)]
    M = np.zeros((n, n - 1))
    for j, i in enumerate(keep):
        M[i, j] = 1
    M[a, n - 2] = M[b, n - 2] = 1
    return M.T @ P @ M, p1 @ M


def test_merge_losses_equal_brute_force_ami_differences():
    rng = np.random.default_rng(0)
    n = 7
    P = rng.random((n, n)) * (rng.random((n, n)) < 0.6)
    P /= P.sum() * 1.3  # bigrams among the window need not sum to 1
    p1 = rng.random(n)
    p1 /= p1.sum()
    w = _Window(n + 1)
    for x in range(n):  # words enter one at a time, seeing only earlier clusters
        row, col = np.zeros(n + 1), np.zeros(n + 1)
        row[:x], col[:x] = P[x, :x], P[:x, x]
        w.add(x, row, col, P[x, x], p1[x])
    L = w.losses()
    for a, b in itertools.combinations(range(n), 2):
        P2, p2 = merged(P, p1, a, b)
        assert abs((ami(P, p1) - ami(P2, p2)) - L[a, b]) < 1e-12
    # after a merge the incrementally updated tables still give exact losses
    w.merge(1, 4)
    P2, p2 = merged(P, p1, 1, 4)  # merged cluster is last in P2; slot 1 in the window
    slots = [0, 2, 3, 5, 6, 1]
    L2 = w.losses()
    for a, b in itertools.combinations(range(n - 1), 2):
        P3, p3 = merged(P2, p2, a, b)
        sa, sb = sorted((slots[a], slots[b]))
        assert abs((ami(P2, p2) - ami(P3, p3)) - L2[sa, sb]) < 1e-12


def test_tiny_corpus_known_clusters_and_codes():
    text = ["the dog runs", "the cat runs", "a dog sleeps", "a cat sleeps", "the cat sleeps", "a dog runs"]
    sents = [s.split() for s in text]
    v = build_vocab(sents)
    r = brown_clusters(encode_corpus(sents, v), len(v), 4)
    groups = {frozenset(v.tokens[i] for i in range(len(v)) if r.word_cluster[i] == c and v.tokens[i] != "<unk>")
              for c in range(4)}
    assert groups == {frozenset({"<eos>"}), frozenset({"the", "a"}), frozenset({"dog", "cat"}),
                      frozenset({"runs", "sleeps"})}
    code = {t: r.codes[i] for i, t in enumerate(v.tokens)}
    assert code["dog"] == code["cat"] and code["runs"] == code["sleeps"] and code["the"] == code["a"]
    assert len(set(code[t] for t in ("<eos>", "the", "dog", "runs"))) == 4
    lines = r.to_text(v.tokens).splitlines()
    assert len(lines) == len(v) and all(len(ln.split("\t")) == 3 for ln in lines)
