"""The blocked HMM's training E-step (`blocked_hmm.expected_counts`, `neural.BlockedNLL`): its
log-likelihood equals brute-force enumeration of every state path, its gradient equals autograd through the
differentiable forward (`chain.forward_autograd`), the compiled sweep equals the PyTorch path, and near-one-hot
transitions (whose blocks underflow in float32) still give finite, exact values."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models import blocked_hmm, chain
from latentlm.models.kernels import blocked as blocked_kernels
from latentlm.training import neural


def random_model(M: int, kk: int, V: int, seed: int, scale: float = 2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    Z = M * kk
    wc = torch.arange(V) % M
    wc = wc[torch.randperm(V, generator=g)]
    ls = torch.log_softmax(torch.randn(Z, generator=g, dtype=dtype) * scale, 0)
    lt = torch.log_softmax(torch.randn(Z, Z, generator=g, dtype=dtype) * scale, 1)
    le = torch.empty(V, kk, dtype=dtype)
    raw = torch.randn(V, kk, generator=g, dtype=dtype) * scale
    for m in range(M):
        le[wc == m] = torch.log_softmax(raw[wc == m], 0)
    return ls, lt, le, wc


def brute_log_lik(ls, lt, le, wc, M, ids, lengths, prior):
    """log p(x_b) by summing over every state path (float64)."""
    Z, kk = lt.shape[0], le.shape[1]
    full_emit = torch.zeros(le.shape[0], Z, dtype=torch.float64)
    for v in range(le.shape[0]):
        c = int(wc[v])
        full_emit[v, c * kk:(c + 1) * kk] = le[v].double().exp()
    trans, start = lt.double().exp(), ls.double().exp()
    out = []
    for b in range(ids.shape[0]):
        L = int(lengths[b])
        x = ids[b, :L].tolist()
        has = prior is not None and float(prior.state[b].sum()) > 0
        first = spread(prior, M)[b] @ trans if has else start
        total = 0.0
        for path in itertools.product(range(Z), repeat=L):
            p = first[path[0]] * full_emit[x[0], path[0]]
            for t in range(1, L):
                p = p * trans[path[t - 1], path[t]] * full_emit[x[t], path[t]]
            total += float(p)
        out.append(torch.tensor(total, dtype=torch.float64).log())
    return torch.stack(out)


def autograd_nll(ls, lt, le, wc, M, ids, lengths, prior):
    """-log p(x) by autograd through the differentiable scaled forward (the reference for the gradient)."""
    kk = le.shape[1]
    B = ids.shape[0]
    clusters = wc[ids]
    trans = lt.exp()
    blocks = trans.view(M, kk, M, kk)
    rows = torch.arange(B)
    init = ls.exp().view(M, kk)[clusters[:, 0]]
    if prior is not None:
        has = prior.state.sum(1) > 0
        init = torch.where(has[:, None], (spread(prior, M) @ trans).view(B, M, kk)[rows, clusters[:, 0]], init)
    def block(t: int):
        return blocks[clusters[:, t - 1], :, clusters[:, t], :]

    log_cond, _ = chain.forward_autograd(init, le.exp()[ids], block, lengths)
    return -log_cond.sum()


def batch(V: int, B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return ids, lengths


def dense(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor (the emission counts) as a strided one; others unchanged."""
    return t.to_dense() if t.is_sparse else t


def a_prior(B: int, M: int, kk: int, seed: int) -> blocked_hmm.Carried:
    """A carried state for each row, in a random cluster; the last row carries nothing."""
    g = torch.Generator().manual_seed(seed)
    state = torch.softmax(torch.randn(B, kk, generator=g, dtype=torch.float64) * 2, 1)
    state[-1] = 0.0  # a row with no carried mass starts from the start distribution
    return blocked_hmm.Carried(state, torch.randint(0, M, (B,), generator=g))


def spread(prior: blocked_hmm.Carried, M: int) -> torch.Tensor:
    """The carried state as a distribution over all M k' states (B, M k') (float64): zeros outside its cluster."""
    B, kk = prior.state.shape
    full = torch.zeros(B, M, kk, dtype=torch.float64)
    full[torch.arange(B), prior.cluster] = prior.state.double()
    return full.view(B, M * kk)


@pytest.mark.parametrize("M,kk", [(1, 3), (2, 2), (3, 1)])
@pytest.mark.parametrize("with_prior", [False, True])
def test_log_likelihood_equals_enumeration_of_all_paths(M, kk, with_prior):
    V, B, T = 7, 3, 4
    ls, lt, le, wc = random_model(M, kk, V, seed=M * 10 + kk)
    ids, lengths = batch(V, B, T, seed=1)
    prior = a_prior(B, M, kk, 2) if with_prior else None
    counts = blocked_hmm.expected_counts(ls, lt, le, wc, M, ids, lengths, prior)
    want = brute_log_lik(ls, lt, le, wc, M, ids, lengths, prior)
    assert torch.allclose(counts.log_lik, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 4), kk=st.integers(1, 6), B=st.integers(1, 4), T=st.integers(1, 7),
       seed=st.integers(0, 10_000), with_prior=st.booleans())
def test_gradient_equals_autograd_through_the_forward(M, kk, B, T, seed, with_prior):
    V = max(M, 9)
    ls, lt, le, wc = random_model(M, kk, V, seed)
    ids, lengths = batch(V, B, T, seed + 1)
    prior = a_prior(B, M, kk, seed + 2) if with_prior else None
    params = [p.clone().requires_grad_() for p in (ls, lt, le)]
    ref = autograd_nll(*params, wc, M, ids, lengths, prior)
    ref_grads = [torch.zeros_like(p) if g is None else g
                 for p, g in zip(params, torch.autograd.grad(ref, params, allow_unused=True), strict=True)]
    params2 = [p.clone().requires_grad_() for p in (ls, lt, le)]
    nll, last = neural.BlockedNLL.apply(*params2, wc, M, ids, lengths, prior, True)
    grads = torch.autograd.grad(nll, params2)
    assert torch.allclose(nll, ref, rtol=1e-10, atol=1e-10)
    assert grads[2].is_sparse  # the emission counts: only the batch's words' rows
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(dense(g), r, rtol=1e-8, atol=1e-10)
    # the carried state: each row's filtered posterior at its last position
    assert torch.allclose(last.sum(1), torch.ones(B, dtype=torch.float64))


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 4), kk=st.integers(1, 6), B=st.integers(1, 4), T=st.integers(1, 7),
       seed=st.integers(0, 10_000), with_prior=st.booleans(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_transition_logits_gradient_equals_autograd_through_log_softmax(M, kk, B, T, seed, with_prior, dtype):
    """`BlockedNLL(..., trans_logits=True)` (what training runs: rows normalised inside, the gradient
    C - trans * rowsum(C) formed in place over the counts) against autograd through a log-softmax of the logits
    and the differentiable forward; rows shifted by arbitrary constants (logits, not log-probabilities)."""
    V = max(M, 9)
    ls, lt, le, wc = random_model(M, kk, V, seed)
    shift = torch.randn(M * kk, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 5
    logits = (lt + shift).to(dtype)
    ids, lengths = batch(V, B, T, seed + 1)
    prior = a_prior(B, M, kk, seed + 2) if with_prior else None
    params = [p.clone().double().requires_grad_() for p in (ls, logits, le)]
    ref = autograd_nll(params[0], torch.log_softmax(params[1], 1), params[2], wc, M, ids, lengths, prior)
    ref_grads = [torch.zeros_like(p) if g is None else g
                 for p, g in zip(params, torch.autograd.grad(ref, params, allow_unused=True), strict=True)]
    params2 = [p.clone().to(dtype).requires_grad_() for p in (ls, logits, le)]
    nll, _ = neural.BlockedNLL.apply(*params2, wc, M, ids, lengths, prior, True, True)
    scale = torch.tensor(0.37, dtype=dtype)  # the loss is scaled (per token) before backward in training
    grads = torch.autograd.grad(nll * scale, params2)
    tol = dict(rtol=1e-8, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    assert torch.allclose(nll.double(), ref, **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(dense(g).double(), r * 0.37, **tol)
    assert torch.allclose(grads[1].double().sum(1), torch.zeros(M * kk, dtype=torch.float64), atol=1e-4)


@pytest.mark.skipif(not blocked_kernels.HAVE_NUMBA, reason="numba unavailable: only the PyTorch path exists")
@pytest.mark.parametrize("with_prior", [False, True])
def test_compiled_sweep_equals_pytorch_path(monkeypatch, with_prior):
    M, kk, V, B, T = 4, 5, 40, 6, 9
    ls, lt, le, wc = random_model(M, kk, V, seed=3)
    ids, lengths = batch(V, B, T, seed=4)
    prior = a_prior(B, M, kk, 5) if with_prior else None
    compiled = blocked_hmm.expected_counts(ls.float(), lt.float(), le.float(), wc, M, ids, lengths, prior)
    monkeypatch.setattr(blocked_kernels, "HAVE_NUMBA", False)
    reference = blocked_hmm.expected_counts(ls.float(), lt.float(), le.float(), wc, M, ids, lengths, prior)
    for field in ("start", "trans", "emit", "log_lik", "last"):
        a, b = dense(getattr(compiled, field)), dense(getattr(reference, field))
        assert a.dtype == b.dtype
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7), field
    # every real position contributes one unit of emission count and T-1 of transition count per row
    assert torch.allclose(dense(compiled.emit).sum().double(), lengths.sum().double())
    n_trans = (lengths - 1).sum() + (int((prior.state.sum(1) > 0).sum()) if with_prior else 0)
    assert torch.allclose(compiled.trans.sum().double(), n_trans.double(), rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 5), kk=st.integers(1, 4), B=st.integers(1, 7), T=st.integers(1, 6), seed=st.integers(0, 500),
       carried=st.sampled_from(["none", "some", "all"]))
def test_batched_counts_with_carried_states_equal_one_row_at_a_time(M, kk, B, T, seed, carried):
    """The PyTorch path (what a GPU runs) and the compiled sweep give, for a variable-length batch with no
    rows, some rows and every row continuing a carried state, the sum of each row's own transition counts;
    each row adds one unit per step, the carried step included. (The carried step's counts themselves are
    checked against autograd above.)"""
    V = max(M, 3 * M)
    ls, lt, le, wc = random_model(M, kk, V, seed=seed)
    ids, lengths = batch(V, B, T, seed=seed + 1)
    prior = None if carried == "none" else a_prior(B, M, kk, seed + 2)
    if carried == "some" and B > 1:
        prior.state[::2] = 0.0  # these rows start from the start distribution
    want = torch.zeros_like(lt)
    for b in range(B):
        L = int(lengths[b])
        one = blocked_hmm.expected_counts(ls, lt, le, wc, M, ids[b:b + 1, :L], lengths[b:b + 1],
                                          None if prior is None else blocked_hmm.Carried(prior.state[b:b + 1],
                                                                                         prior.cluster[b:b + 1]))
        want += one.trans
    with pytest.MonkeyPatch.context() as m:
        m.setattr(blocked_kernels, "HAVE_NUMBA", False)
        torch_path = blocked_hmm.expected_counts(ls, lt, le, wc, M, ids, lengths, prior)
    compiled = blocked_hmm.expected_counts(ls, lt, le, wc, M, ids, lengths, prior)
    for got in (torch_path, compiled):
        assert torch.allclose(got.trans, want, rtol=1e-10, atol=1e-12)
    # each row adds one unit per step, the carried step included
    n = (lengths - 1).sum() + (0 if prior is None else int((prior.state.sum(1) > 0).sum()))
    assert torch.allclose(torch_path.trans.sum(), n.double())


def test_block_counts_sum_each_blocks_outer_products_in_chunks():
    """`_block_counts` (index_add over chunks of outer products) against a loop over the steps, for chunks
    smaller than one step, of a few steps and of all of them."""
    g = torch.Generator().manual_seed(0)
    M, k, B, T = 3, 4, 5, 7
    prev, right = torch.rand(B, T, k, generator=g, dtype=torch.float64), torch.rand(B, T, k, generator=g,
                                                                                       dtype=torch.float64)
    clusters = torch.randint(0, M, (B, T + 1), generator=g)
    valid = torch.rand(B, T, generator=g) > 0.2
    trans = torch.rand(M * k, M * k, generator=g)
    want = torch.zeros(M * k, M * k, dtype=torch.float64)
    for b, t in itertools.product(range(B), range(T)):
        if valid[b, t]:
            i, j = int(clusters[b, t]), int(clusters[b, t + 1])
            want[i * k:(i + 1) * k, j * k:(j + 1) * k] += torch.outer(prev[b, t], right[b, t])
    want = (want * trans).float()
    for chunk in (1, 3 * k * k, 10**6):
        got = blocked_hmm._block_counts(prev, right, clusters, valid, trans, M, chunk_elems=chunk)
        assert got.dtype == trans.dtype and torch.allclose(got, want, rtol=1e-6, atol=1e-7), chunk


@pytest.mark.skipif(not blocked_kernels.HAVE_NUMBA, reason="numba unavailable: only the PyTorch path exists")
def test_compiled_sweep_split_over_threads_gives_the_same_bits(monkeypatch):
    """The forward-backward's rows shared among 3 threads: bit for bit one thread's."""
    from latentlm.models import backend as dispatch

    M, kk, V, B, T = 3, 4, 30, 11, 13
    ls, lt, le, wc = random_model(M, kk, V, seed=5)
    ids, lengths = batch(V, B, T, seed=6)
    prior = a_prior(B, M, kk, 7)
    runs = []
    for n in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        monkeypatch.setattr(dispatch, "BLOCKED_SPLIT_MIN_WORK", 0)
        runs.append(blocked_hmm.expected_counts(ls.float(), lt.float(), le.float(), wc, M, ids, lengths, prior))
    for field in ("start", "trans", "emit", "log_lik", "last"):
        assert torch.equal(dense(getattr(runs[0], field)), dense(getattr(runs[1], field))), field


def test_near_one_hot_transitions_stay_finite_and_exact():
    """Transition logits of std 40 make most of each k x k block underflow to 0 in float32 (what made a
    128-cluster x 8-state run diverge at its second step); the float32 matrix is retried in float64."""
    M, kk, V, B, T = 4, 2, 16, 4, 6
    ls, lt, le, wc = random_model(M, kk, V, seed=7, scale=40.0)
    ids, lengths = batch(V, B, T, seed=8)
    want = brute_log_lik(ls, lt, le, wc, M, ids, lengths, None)
    assert bool((lt.float().exp() == 0).any())
    counts = blocked_hmm.expected_counts(ls.float(), lt.float(), le.float(), wc, M, ids, lengths)
    assert bool(torch.isfinite(counts.log_lik).all())
    assert torch.allclose(counts.log_lik, want, rtol=1e-6)
    assert bool(torch.isfinite(counts.trans).all()) and bool(torch.isfinite(dense(counts.emit)).all())
