"""Brown clustering (Brown et al. 1992) with Liang's (2005) windowed algorithm.

Words enter by descending frequency; the window holds at most `m` clusters. Each new word gets its own
cluster, then the pair whose merge loses the least average mutual information (AMI)
    AMI = sum_{a,b} p(a, b) log p(a, b) / (p(a) p(b))
(p(a, b): bigram frequency between clusters, p(a): unigram frequency) is merged. After the last word,
the m clusters are merged on to one, giving each word a bit-string code (Liang's `paths` format).

Merge losses come from row/column sums; the only non-separable part, S(a, b) = sum_k g(P[a,k] + P[b,k])
with g(p) = p log p, is kept up to date incrementally: O(m^2) per added word, O(V m^2 + nnz) in all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse


def _g(x: np.ndarray) -> np.ndarray:
    """x log x with 0 log 0 = 0, elementwise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


@dataclass
class BrownResult:
    """word_cluster (V,) int64 in [0, m) (clusters numbered by their most frequent word's rank),
    codes: bit string per word id (Liang's hierarchy), merges: (kept slot, merged slot) per merge."""

    word_cluster: np.ndarray
    codes: list[str]
    merges: list[tuple[int, int]]
    counts: np.ndarray

    def to_text(self, tokens: list[str]) -> str:
        """Liang's `paths` format: `code<TAB>word<TAB>count`, one line per word, grouped by code."""
        order = sorted(range(len(tokens)), key=lambda i: (self.codes[i], -self.counts[i], i))
        return "".join(f"{self.codes[i]}\t{tokens[i]}\t{int(self.counts[i])}\n" for i in order)


def bigram_matrix(seqs: list[list[int]], V: int) -> sparse.csr_matrix:
    """Sparse (V, V) counts of adjacent token pairs within each sequence. O(N)."""
    left = np.concatenate([np.asarray(s[:-1], dtype=np.int64) for s in seqs] or [np.zeros(0, np.int64)])
    right = np.concatenate([np.asarray(s[1:], dtype=np.int64) for s in seqs] or [np.zeros(0, np.int64)])
    return sparse.csr_matrix((np.ones(len(left)), (left, right)), shape=(V, V))


class _Window:
    """The active clusters: bigram probabilities P (n, n), unigram probabilities p1 (n,), the
    incremental S_row / S_col tables and a free-slot list. n = m + 1 slots."""

    def __init__(self, n: int):
        self.P = np.zeros((n, n))
        self.p1 = np.zeros(n)
        self.used = np.zeros(n, dtype=bool)
        self.S_row = np.zeros((n, n))  # sum_k g(P[a,k] + P[b,k]) over all k
        self.S_col = np.zeros((n, n))  # sum_k g(P[k,a] + P[k,b])

    def refresh(self, x: int) -> None:
        """Recompute S_row/S_col for pairs involving slot x from scratch. O(n^2)."""
        P = self.P
        self.S_row[x, :] = self.S_row[:, x] = _g(P[x][None, :] + P).sum(1)
        self.S_col[x, :] = self.S_col[:, x] = _g(P[:, x][:, None] + P).sum(0)

    def add(self, x: int, row: np.ndarray, col: np.ndarray, self_pair: float, p1: float) -> None:
        """Put a new cluster in free slot x with bigram row P[x, :], column P[:, x] (self pair P[x, x])."""
        P = self.P
        P[x, :], P[:, x], P[x, x] = row, col, self_pair
        self.p1[x], self.used[x] = p1, True
        self.S_row += _g(P[:, x][:, None] + P[:, x][None, :])  # the new column k = x for every pair
        self.S_col += _g(P[x, :][:, None] + P[x, :][None, :])
        self.refresh(x)

    def losses(self) -> np.ndarray:
        """AMI lost by merging each pair (a, b), a < b, both used; +inf elsewhere. O(n^2)."""
        P, p1 = self.P, self.p1
        logp = np.log(np.where(self.used, p1, 1.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(P > 0, P * (np.log(np.where(P > 0, P, 1.0)) - logp[:, None] - logp[None, :]), 0.0)
        R, C = q.sum(1), q.sum(0)
        dq = np.diag(q)
        before = R[:, None] + R[None, :] + C[:, None] + C[None, :] - dq[:, None] - dq[None, :] - q - q.T
        pab = p1[:, None] + p1[None, :]
        logpab = np.log(np.where(pab > 0, pab, 1.0))
        rs, cs = P.sum(1), P.sum(0)
        Lr, Lc = P @ logp, logp @ P  # sum_k P[a,k] log p1_k ; sum_k P[k,a] log p1_k
        d = np.diag(P)
        # row part (merged cluster on the left), excluding k in {a, b}
        ra = d[:, None] + P.T  # P[a,a] + P[b,a]  (column a of rows a, b)
        rb = P + d[None, :]  # P[a,b] + P[b,b]
        row = (self.S_row - _g(ra) - _g(rb) - (rs[:, None] + rs[None, :] - ra - rb) * logpab
               - (Lr[:, None] + Lr[None, :] - ra * logp[:, None] - rb * logp[None, :]))
        # column part (merged cluster on the right), excluding k in {a, b}
        ca = d[:, None] + P  # k = a: P[a,a] + P[a,b]
        cb = P.T + d[None, :]  # k = b: P[b,a] + P[b,b]
        col = (self.S_col - _g(ca) - _g(cb) - (cs[:, None] + cs[None, :] - ca - cb) * logpab
               - (Lc[:, None] + Lc[None, :] - ca * logp[:, None] - cb * logp[None, :]))
        self_p = d[:, None] + d[None, :] + P + P.T
        with np.errstate(divide="ignore", invalid="ignore"):
            selfq = np.where(self_p > 0, self_p * (np.log(np.where(self_p > 0, self_p, 1.0)) - 2 * logpab), 0.0)
        loss = before - (row + col + selfq)
        ok = np.triu(self.used[:, None] & self.used[None, :], 1)
        return np.where(ok, loss, np.inf)

    def merge(self, a: int, b: int) -> None:
        """Merge slot b into slot a (slot b becomes free). O(n^2)."""
        P = self.P
        old_ca, old_cb = P[:, a].copy(), P[:, b].copy()
        old_ra, old_rb = P[a, :].copy(), P[b, :].copy()
        new_col = old_ca + old_cb
        new_row = old_ra + old_rb
        new_col[a] = new_row[a] = P[a, a] + P[a, b] + P[b, a] + P[b, b]
        new_col[b] = new_row[b] = 0.0
        # pairs not involving a or b: replace the k = a, b terms
        self.S_row += (_g(new_col[:, None] + new_col[None, :]) - _g(old_ca[:, None] + old_ca[None, :])
                       - _g(old_cb[:, None] + old_cb[None, :]))
        self.S_col += (_g(new_row[:, None] + new_row[None, :]) - _g(old_ra[:, None] + old_ra[None, :])
                       - _g(old_rb[:, None] + old_rb[None, :]))
        P[a, :], P[:, a] = new_row, new_col
        P[b, :], P[:, b] = 0.0, 0.0
        self.p1[a] += self.p1[b]
        self.p1[b], self.used[b] = 0.0, False
        self.S_row[b, :] = self.S_row[:, b] = self.S_col[b, :] = self.S_col[:, b] = 0.0
        self.refresh(a)


def brown_clusters(seqs: list[list[int]], V: int, m: int, progress: bool = False) -> BrownResult:
    """Cluster token ids 0..V-1 into m clusters by Liang's windowed Brown algorithm over the bigrams of
    `seqs`. Words that never occur are appended to the cluster of the least frequent word. O(V m^2 + N)."""
    if m < 1:
        raise ValueError("m must be >= 1")
    counts = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]), minlength=V).astype(float)
    big = bigram_matrix(seqs, V)
    n_big, n_tok = max(big.sum(), 1.0), counts.sum()
    csr, csc = big.tocsr(), big.tocsc()
    order = sorted(range(V), key=lambda w: (-counts[w], w))
    seen = [w for w in order if counts[w] > 0]
    m = min(m, len(seen))
    win = _Window(m + 1)
    slot_words: list[list[int]] = [[] for _ in range(m + 1)]
    slot_of = np.full(V, -1, dtype=np.int64)
    merges: list[tuple[int, int]] = []
    codes = [""] * V
    from tqdm.auto import tqdm

    def add_word(w: int) -> None:
        x = int(np.flatnonzero(~win.used)[0])
        row, col = np.zeros(m + 1), np.zeros(m + 1)
        r0, r1 = csr.indptr[w], csr.indptr[w + 1]
        k, v = csr.indices[r0:r1], csr.data[r0:r1]
        keep = slot_of[k] >= 0
        np.add.at(row, slot_of[k[keep]], v[keep] / n_big)
        c0, c1 = csc.indptr[w], csc.indptr[w + 1]
        k, v = csc.indices[c0:c1], csc.data[c0:c1]
        keep = slot_of[k] >= 0
        np.add.at(col, slot_of[k[keep]], v[keep] / n_big)
        slot_of[w] = x
        slot_words[x] = [w]
        win.add(x, row, col, big[w, w] / n_big, counts[w] / n_tok)

    def merge_best(prefix_codes: bool) -> None:
        L = win.losses()
        a, b = np.unravel_index(int(np.argmin(L)), L.shape)
        a, b = int(a), int(b)
        if prefix_codes:
            for w in slot_words[a]:
                codes[w] = "0" + codes[w]
            for w in slot_words[b]:
                codes[w] = "1" + codes[w]
        win.merge(a, b)
        slot_of[slot_words[b]] = a
        slot_words[a] = slot_words[a] + slot_words[b]
        slot_words[b] = []
        merges.append((a, b))

    for w in tqdm(seen, desc=f"Brown clustering into {m}", disable=not progress, mininterval=0.5):
        add_word(w)
        if win.used.sum() > m:
            merge_best(False)
    clusters = [list(ws) for ws in slot_words if ws]
    while win.used.sum() > 1:
        merge_best(True)
    # number clusters by their most frequent word's rank
    word_cluster = np.zeros(V, dtype=np.int64)
    rank = {w: i for i, w in enumerate(order)}
    clusters.sort(key=lambda ws: min(rank[w] for w in ws))
    for c, ws in enumerate(clusters):
        word_cluster[ws] = c
    unseen = [w for w in order if counts[w] == 0]
    if unseen:
        word_cluster[unseen] = word_cluster[seen[-1]]
        for w in unseen:
            codes[w] = codes[seen[-1]]
    return BrownResult(word_cluster, codes, merges, counts)


def cluster_vocab(seqs: list[list[int]], V: int, m: int, progress: bool = False) -> torch.Tensor:
    """(V,) int64 Brown cluster of every word id."""
    return torch.from_numpy(brown_clusters(seqs, V, m, progress).word_cluster)
