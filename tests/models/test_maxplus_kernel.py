"""The compiled Viterbi (models.kernels.maxplus): its (max, +) micro-kernel, source ordering and pruning
against brute force and the plain PyTorch recursion, over random shapes, lengths, dtypes and thread
counts, with impossible transitions and emissions; the chunked (speculative) single-sequence recursion
against one thread."""

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
    from latentlm.models.kernels import blas, maxplus


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
@pytest.mark.parametrize("K", [5, 130, 300, 520])
def test_chunked_single_sequence_equals_one_thread(dtype, K):
    """One sequence cut into chunks run at once from guessed starts, then re-run from the true scores until
    they meet the guessed run bit for bit (`viterbi_chunks`): the same path and score as one thread, for 2
    and 3 threads, lengths that give one chunk or several, and the model's impossible states."""
    log_init, log_emit, log_trans = _model(K, 400, 1, dtype, K)
    for L in (400, 1, 57, 130, 199):
        one = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([L]), 1)
        for threads in (2, 3):
            many = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([L]), threads)
            assert torch.equal(one[0], many[0]), (L, threads)
            assert float(one[1][0]) == float(many[1][0])


def test_chunked_single_sequence_where_the_start_is_never_forgotten():
    """Two disconnected components: the scores of a chunk run from a guessed start never meet the true
    ones, so the re-run covers the whole chunk; and an impossible emission in the middle (every score -inf
    from there on). Both exactly as one thread."""
    K, T = 6, 300
    g = torch.Generator().manual_seed(3)
    log_trans = torch.full((K, K), -math.inf)
    log_trans[:3, :3] = torch.log_softmax(torch.randn(3, 3, generator=g), 1)
    log_trans[3:, 3:] = torch.log_softmax(torch.randn(3, 3, generator=g), 1)
    log_emit = torch.log_softmax(torch.randn(1, T, K, generator=g), 2)
    log_init = torch.log_softmax(torch.randn(1, K, generator=g), 1)
    one = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([T]), 1)
    two = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([T]), 2)
    assert torch.equal(one[0], two[0]) and float(one[1][0]) == float(two[1][0])
    log_emit[0, 200] = -math.inf
    one = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([T]), 1)
    two = maxplus.viterbi_cpu(log_init, log_emit, None, log_trans, torch.tensor([T]), 2)
    assert float(one[1][0]) == float(two[1][0]) == -math.inf
    assert torch.equal(one[0], two[0])


def test_chunks_meet_the_true_scores_within_a_few_steps():
    """What makes the speculation pay: on a dense random HMM, the re-run of the second chunk stops (its
    rows meet the guessed run's) long before the chunk ends."""
    K, L = 64, 400
    log_init, log_emit, log_trans = _model(K, L, 1, torch.float32, 0, holes=False)
    table, ids = log_emit[0].numpy(), np.arange(L)
    a = log_trans.numpy()
    history, tops = np.empty((L, K), np.float32), np.zeros(L)
    maxplus.viterbi_chunks(log_init[0].numpy(), table, ids, blas.padded_array(a), a.max(0), history, tops, 2)
    delta = log_init[0].numpy() + table[0]
    true_history, true_tops = np.empty((L, K), np.float32), np.zeros(L)
    maxplus.viterbi_steps(table, ids, blas.padded_array(a), a.max(0), delta, 1, L, true_history, true_tops, False)
    assert np.array_equal(history[: L - 1], true_history[: L - 1])
    assert np.array_equal(tops[: L - 1], true_tops[: L - 1])
    padded, cm, half = blas.padded_array(a), a.max(0), L // 2
    spec = np.empty((L, K), np.float32)  # the second chunk from its guessed start (all states equal)
    maxplus.viterbi_steps(table, ids, padded, cm, np.zeros(K, np.float32), half, L, spec, np.zeros(L), False)
    delta = log_init[0].numpy() + table[0]  # the true scores at the chunk's start, then the verified re-run
    maxplus.viterbi_steps(table, ids, padded, cm, delta, 1, half, np.empty((L, K), np.float32), np.zeros(L), False)
    met = maxplus.viterbi_steps(table, ids, padded, cm, delta, half, L, spec, np.zeros(L), True)
    assert L // 2 < met < L // 2 + 60


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


def test_padded_rows_spread_power_of_two_widths_over_the_cache_sets():
    """The (max, +) kernels read the matrix with the row stride of `blas.row_stride`: whole cache lines, one
    line more where rows are a multiple of 2 KiB (which would all start in one L1 set); the padded copy holds
    the matrix unchanged, and the product through it equals brute force at padded and unpadded widths."""
    assert blas.row_stride(1024, 4) == 1040 and blas.row_stride(512, 4) == 528 and blas.row_stride(256, 8) == 264
    assert blas.row_stride(256, 4) == 256 and blas.row_stride(64, 4) == 64 and blas.row_stride(1000, 4) == 1008
    for K in (5, 256, 512):
        a = np.random.default_rng(K).standard_normal((K, K)).astype(np.float32)
        padded = blas.padded_array(a)
        assert padded.shape == (K, blas.row_stride(K, 4)) and np.array_equal(padded[:, :K], a)
        delta = torch.from_numpy(np.random.default_rng(1).standard_normal((3, K)).astype(np.float32))
        val, arg = maxplus.maxplus_cpu(delta, torch.from_numpy(a))
        brute = delta[:, :, None] + torch.from_numpy(a)[None]
        assert torch.equal(val, brute.max(1).values)
        assert torch.equal(brute.gather(1, arg[:, None, :])[:, 0], val)
