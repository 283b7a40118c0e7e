"""The compiled Viterbi (models.kernels.maxplus): its (max, +) micro-kernel, source ordering and pruning
against brute force and the plain PyTorch recursion, over random shapes, lengths, dtypes and thread
counts, with impossible transitions and emissions; the two-thread single-sequence split against one
thread."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models import chain
from latentlm.models.kernels.jit import HAVE_NUMBA

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba unavailable: no compiled kernels to test")

if HAVE_NUMBA:
    from latentlm.models.kernels import maxplus


def _model(K: int, T: int, B: int, dtype: torch.dtype, seed: int, sharp: float = 2.0, holes: bool = True):
    """Random log_init (B, K), log_emit (B, T, K), log_trans (K, K); `holes` puts -inf entries in."""
    g = torch.Generator().manual_seed(seed)
    log_trans = torch.log_softmax(torch.randn(K, K, generator=g, dtype=dtype) * sharp, 1)
    log_emit = torch.log_softmax(torch.randn(B, T, K, generator=g, dtype=dtype) * sharp, 2)
    log_init = torch.log_softmax(torch.randn(B, K, generator=g, dtype=dtype), 1)
    if holes and K > 2:
        log_trans[:, 1] = -math.inf  # a state nothing reaches
        log_trans[0, :] = -math.inf  # a state that leads nowhere
        log_trans[0, 0] = 0.0
        log_emit[:, :, 2] = -math.inf  # a state that emits nothing seen
    return log_init, log_emit, log_trans


def _joint(log_init, log_emit, log_trans, path) -> float:
    """float64 log-probability of one path (T,)."""
    li, le, lt = log_init.double(), log_emit.double(), log_trans.double()
    s = li[path[0]] + le[0, path[0]]
    for t in range(1, len(path)):
        s = s + lt[path[t - 1], path[t]] + le[t, path[t]]
    return float(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_viterbi_equals_brute_force_enumeration(dtype):
    """Tiny models: the compiled recursion finds the best of all K^T paths, with its log-probability."""
    for seed, (K, T) in enumerate([(2, 5), (3, 4), (4, 4), (5, 3)]):
        log_init, log_emit, log_trans = _model(K, T, 1, dtype, seed, holes=K > 3)
        best = max(itertools.product(range(K), repeat=T),
                   key=lambda p: _joint(log_init[0], log_emit[0], log_trans, p))
        ref = _joint(log_init[0], log_emit[0], log_trans, best)
        path, score = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([T]), 1)
        assert _joint(log_init[0], log_emit[0], log_trans, path[0].tolist()) == pytest.approx(ref, rel=1e-6)
        assert float(score[0]) == pytest.approx(ref, rel=1e-5 if dtype == torch.float32 else 1e-12)


@settings(max_examples=25, deadline=None)
@given(K=st.integers(1, 300), B=st.integers(1, 6), T=st.integers(1, 12), seed=st.integers(0, 10_000),
       threads=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64]),
       sharp=st.sampled_from([0.1, 2.0, 8.0]))
def test_compiled_viterbi_equals_plain_torch(K, B, T, seed, threads, dtype, sharp):
    """Any shape, padding, dtype, sharpness and thread count: the same paths and scores as the plain
    PyTorch recursion (whose (max, +) is a broadcast, no pruning)."""
    log_init, log_emit, log_trans = _model(K, T, B, dtype, seed, sharp)
    lengths = torch.randint(0, T + 1, (B,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = T
    ref_path, ref_score = chain.viterbi(log_init, log_emit, log_trans, lengths, backend="torch")
    path, score = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, lengths, threads)
    for b in range(B):
        L = int(lengths[b])
        assert (path[b, L:] == -1).all()
        if L == 0:
            continue
        if not math.isfinite(float(ref_score[b])):
            assert float(score[b]) == float(ref_score[b])
            continue
        # paths may differ only between exact ties: the joint log-probabilities agree
        mine = _joint(log_init[b], log_emit[b], log_trans, path[b, :L].tolist())
        theirs = _joint(log_init[b], log_emit[b], log_trans, ref_path[b, :L].tolist())
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert mine == pytest.approx(theirs, rel=tol, abs=tol)
        assert float(score[b]) == pytest.approx(float(ref_score[b]), rel=tol, abs=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [130, 300, 520])
def test_two_thread_split_equals_one_thread(dtype, K):
    """One sequence on two threads that split the columns and meet every step: bit-identical path and
    score to one thread (the same floating-point operations, only distributed)."""
    log_init, log_emit, log_trans = _model(K, 200, 1, dtype, K)
    for L in (200, 1, 57):
        one = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([L]), 1)
        two = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([L]), 2)
        assert torch.equal(one[0], two[0])
        assert float(one[1][0]) == pytest.approx(float(two[1][0]), rel=1e-12)


def test_source_order_bounds_every_later_delta():
    """The counting-sort order: the bound at position n is at least every delta from n on (what makes the
    pruning exact), `scores` holds the (re-centred) deltas by state, and the order is a permutation."""
    rng = np.random.default_rng(0)
    for K in (1, 7, 64, 257):
        for spread in (0.01, 1.0, 40.0):
            d = (rng.standard_normal(K) * spread).astype(np.float32)
            if K > 3:
                d[3] = -np.inf
            for centre in (False, True):
                order, keys = np.empty(K, np.int64), np.empty(K, np.int64)
                bounds = np.empty(maxplus.BUCKETS, np.float32)
                scores = np.empty(K, np.float32)
                top = maxplus.source_order(d, centre, order, bounds, scores, np.empty(maxplus.COUNT_SLOTS, np.int64),
                                           keys)
                assert top == d.max()
                assert sorted(order.tolist()) == list(range(K))
                assert np.array_equal(scores, d - (d.max() if centre else np.float32(0)))  # re-centred
                srt = scores[order]
                suffix_max = np.maximum.accumulate(srt[::-1])[::-1]
                bound = np.array([maxplus.bound_at(order, keys, bounds, n) for n in range(K)])
                assert (bound >= suffix_max).all()
                assert maxplus.bound_at(order, keys, bounds, K) == -np.inf


def test_maxplus_product_with_ties_and_minus_inf():
    """Rows of equal deltas and equal matrix entries: the value is the maximum and the argmax attains it."""
    K = 40
    delta = torch.zeros(3, K)
    delta[1, ::2] = -math.inf
    log_trans = torch.zeros(K, K)
    log_trans[:, 5] = -math.inf
    v, a = maxplus.maxplus_cpu(delta, log_trans)
    cand = delta[:, :, None] + log_trans[None]
    assert torch.equal(v, cand.amax(1))
    assert torch.equal(cand.gather(1, a[:, None, :]).squeeze(1), v)


@pytest.mark.parametrize("B,T", [(5, 9), (1, 40)])
@pytest.mark.parametrize("backend", ["auto", "groups", "torch"])
def test_viterbi_reads_emission_rows_where_they_lie(B, T, backend):
    """Emissions as rows of a table (`RowLookup`, what the families hand over: no gathered (B, T, K) copy) give
    exactly the paths and scores of the gathered tensor, on the compiled engines and on the torch one."""
    K, N = 70, 13
    g = torch.Generator().manual_seed(B * T)
    table = torch.log_softmax(torch.randn(N, K, generator=g) * 2, 1)
    ids = torch.randint(0, N, (B, T), generator=g)
    log_init = torch.log_softmax(torch.randn(B, K, generator=g), 1)
    log_trans = torch.log_softmax(torch.randn(K, K, generator=g) * 2, 1)
    lengths = torch.full((B,), T)
    lengths[-1] = T - 3
    if backend == "groups" and B == 1:
        backend = "single"
    rows = chain.viterbi(log_init, chain.RowLookup(table, ids), log_trans, lengths, backend=backend)
    dense = chain.viterbi(log_init, table[ids], log_trans, lengths, backend=backend)
    assert torch.equal(rows[0], dense[0])
    assert torch.equal(rows[1], dense[1])
