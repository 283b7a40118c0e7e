"""One long sequence scored as a batch of chunks (`models.chain.forward_chunked`) against the sequential
recursion: mixing models (the guessed runs are kept), models whose restarts never meet their guesses (the
sequential fallback), impossible positions anywhere, both dtypes, both emission layouts, and the dispatch
from `chain.forward`. Also `forward(out_last=...)` on every path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models import backend, chain

pytestmark = pytest.mark.usefixtures("one_thread")


def mixing_chain(T: int, K: int, N: int, seed: int, dtype=torch.float64):
    """init (1, K), emission table (N, K), rows (1, T), trans (K, K): a dense random HMM."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.rand(K, K, generator=g, dtype=dtype) ** 2 + 1e-3
    trans /= trans.sum(1, keepdim=True)
    init = torch.rand(1, K, generator=g, dtype=dtype)
    init /= init.sum()
    table = torch.rand(N, K, generator=g, dtype=dtype)
    rows = torch.randint(0, N, (1, T), generator=g)
    return init, table, rows, trans


def chunked_calls(monkeypatch, name: str) -> list[int]:
    """Small long-sequence thresholds, and the lengths of the sequences `chain.<name>` is called on."""
    calls: list[int] = []
    real = getattr(chain, name)
    monkeypatch.setattr(chain, name, lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    monkeypatch.setattr(backend, "LONG_MIN_TOKENS", 600)
    monkeypatch.setattr(chain, "CHUNK_MIN_LEN", 100)
    monkeypatch.setattr(backend, "CHUNK_MIN_STATES", 2)
    return calls


def sequential(init, emit, trans, T):
    return chain._forward_sequential(init, emit, trans, T)


def assert_close_logprob(chunked, seq, chunks, dtype):
    """Per position within the meeting tolerance (plus rounding); the total within (C - 1) tolerances."""
    tol = chain.meet_tolerance(dtype)
    rounding = 1e-5 if dtype == torch.float32 else 1e-11
    assert torch.equal(torch.isneginf(chunked), torch.isneginf(seq))
    live = ~torch.isneginf(seq)
    c, s = chunked[live].double(), seq[live].double()
    assert (c - s).abs().max().item() <= tol + rounding if live.any() else True
    assert abs(c.sum() - s.sum()).item() <= (chunks - 1) * tol + rounding * max(1.0, abs(s.sum().item()))


@settings(max_examples=20, deadline=None)
@given(T=st.integers(64, 400), K=st.integers(1, 24), chunks=st.integers(2, 6), window=st.integers(2, 12),
       single=st.booleans(), dense=st.booleans(), engine=st.sampled_from(["auto", "torch"]),
       seed=st.integers(0, 10_000))
def test_chunked_matches_sequential(T, K, chunks, window, single, dense, engine, seed):
    """On the engine auto picks (compiled on CPU) and on torch ops (what a GPU runs)."""
    dtype = torch.float32 if single else torch.float64
    init, table, rows, trans = mixing_chain(T, K, 7, seed, dtype)
    emit = table[rows] if dense else chain.RowLookup(table, rows)
    got = chain.forward_chunked(init, emit, trans, chunks=chunks, window=window, backend=engine)
    assert got.shape == (1, T) and got.dtype == dtype
    assert_close_logprob(got, sequential(init, emit, trans, T), chunks, dtype)


def test_guesses_are_kept_when_the_model_mixes(monkeypatch):
    """A mixing model: every restart meets its guess, so the sequential fallback never runs."""
    init, table, rows, trans = mixing_chain(2000, 16, 50, 0)
    monkeypatch.setattr(chain, "_forward_sequential", lambda *a: pytest.fail("fell back to sequential"))
    got = chain.forward_chunked(init, chain.RowLookup(table, rows), trans, chunks=8, window=32)
    monkeypatch.undo()
    assert_close_logprob(got, sequential(init, chain.RowLookup(table, rows), trans, 2000), 8, torch.float64)


def non_mixing(kind: str, K: int):
    """(init (1, K), trans (K, K)) that never forget their start ("cycle": a deterministic cycle) or never
    reach the uniform guess's support ("sparse": only states 0 and 1 after the first step)."""
    if kind == "cycle":
        init = torch.zeros(1, K, dtype=torch.float64)
        init[0, 2] = 1.0
        return init, torch.roll(torch.eye(K, dtype=torch.float64), 1, dims=1)
    trans = torch.zeros(K, K, dtype=torch.float64)
    trans[:, :2] = 0.5
    return torch.full((1, K), 1.0 / K, dtype=torch.float64), trans


@pytest.mark.parametrize("kind", ["cycle", "sparse"])
def test_restarts_that_never_meet_fall_back_to_sequential(kind):
    """A deterministic cycle with uninformative emissions never forgets its start, and a chain whose
    transitions keep the support small never reaches the uniform guess's support: the chunks after the
    first run sequentially, and the result is the sequential one."""
    K, T = 6, 900
    init, trans = non_mixing(kind, K)
    table = torch.full((3, K), 0.5, dtype=torch.float64)
    rows = torch.randint(0, 3, (1, T), generator=torch.Generator().manual_seed(1))
    emit = chain.RowLookup(table, rows)
    got = chain.forward_chunked(init, emit, trans, chunks=5, window=8)
    assert torch.allclose(got, sequential(init, emit, trans, T), rtol=0, atol=1e-12)
    assert torch.allclose(got.sum(), torch.tensor(T * math.log(0.5), dtype=torch.float64))


@pytest.mark.parametrize("where", [0, 5, 199, 200, 203, 450, 899])
def test_impossible_position_anywhere(where):
    """A token no state can emit makes that position and every later one -inf, whichever chunk, restart
    window or guessed tail it falls in (chunks of 180 positions, windows of 8)."""
    init, table, rows, trans = mixing_chain(900, 5, 4, 3)
    table = torch.cat([table, torch.zeros(1, 5, dtype=table.dtype)])
    rows = rows.clone()
    rows[0, where] = 4
    emit = chain.RowLookup(table, rows)
    got = chain.forward_chunked(init, emit, trans, chunks=5, window=8)
    seq = sequential(init, emit, trans, 900)
    assert torch.isneginf(got[0, where:]).all() and torch.isfinite(got[0, :where]).all()
    assert torch.allclose(got[0, :where], seq[0, :where], rtol=0, atol=1e-12)


def test_forward_dispatches_long_single_sequences(monkeypatch):
    init, table, rows, trans = mixing_chain(700, 8, 20, 5, torch.float32)
    emit = chain.RowLookup(table, rows)
    lengths = torch.tensor([700])
    calls = chunked_calls(monkeypatch, "forward_chunked")
    got, _ = chain.forward(init, emit, trans, lengths)
    assert calls == [700]
    assert_close_logprob(got, sequential(init, emit, trans, 700), 7, torch.float32)
    chain.forward(init, emit, trans, lengths, keep_alphas=True)  # marginals wanted: sequential
    chain.forward(init, emit, trans, lengths, chunk_long=False)  # the baseline: step by step
    chain.forward(init, emit, trans, lengths, backend="single")  # one compiled recursion
    assert calls == [700]
    chain.forward(init, emit, trans, lengths, backend="torch")  # torch ops chunk too (what a GPU runs)
    assert calls == [700, 700]


def test_long_sequences_in_a_batch_are_chunked_one_by_one(monkeypatch):
    """A batch mixing long and short sequences: each long one as its own chunks, the short ones as one batch;
    every row as when scored alone step by step, zeros at padding."""
    g = torch.Generator().manual_seed(7)
    init, table, _, trans = mixing_chain(1, 8, 20, 6, torch.float64)
    lengths = torch.tensor([700, 50, 650, 3])
    rows = torch.randint(0, 20, (4, 700), generator=g)
    init = init.expand(4, -1)
    calls = chunked_calls(monkeypatch, "forward_chunked")
    got, _ = chain.forward(init, chain.RowLookup(table, rows), trans, lengths)
    assert sorted(calls) == [650, 700]
    for b, n in enumerate(lengths.tolist()):
        ref = sequential(init[b : b + 1], chain.RowLookup(table, rows[b : b + 1, :n]), trans, n)
        assert_close_logprob(got[b : b + 1, :n], ref, 7, torch.float64)
        assert (got[b, n:] == 0).all()


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_out_last_is_the_filtered_marginal_at_each_last_position(engine):
    g = torch.Generator().manual_seed(2)
    B, T, K = 6, 9, 5
    init, table, _, trans = mixing_chain(T, K, 7, 4)
    init = init.expand(B, K).contiguous()
    rows = torch.randint(0, 8, (B, T), generator=g)
    table = torch.cat([table, torch.zeros(1, K, dtype=table.dtype)])  # row 7: impossible
    rows[rows == 7] = 0
    rows[2, 1] = 7  # sequence 2 dies at position 1
    lengths = torch.tensor([9, 1, 5, 9, 3, 7])
    emit = chain.RowLookup(table, rows)

    last = torch.full((B, K), -1.0, dtype=table.dtype)
    _, alphas = chain.forward(init, emit, trans, lengths, keep_alphas=True, backend=engine)
    chain.forward(init, emit, trans, lengths, out_last=last, backend=engine)
    for b in range(B):
        want = torch.zeros(K, dtype=table.dtype) if b == 2 else alphas[b, lengths[b] - 1]
        assert torch.allclose(last[b], want, atol=1e-12), b


def test_projective_distance():
    u = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    v = torch.tensor([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 0.0], [0.5, 0.25, 0.25]])
    d = chain.projective_distance(u, v)
    assert d[0].item() == pytest.approx(math.log(2) - math.log(2 / 3))
    assert d[1].item() == 0.0
    assert math.isinf(d[2].item()) and math.isinf(d[3].item())  # empty support; different supports


def sequential_posterior(init, emit, trans, T):
    lengths = torch.tensor([T])
    cond, alphas = chain._forward_steps(init, emit, trans, lengths, True, None, "auto")
    return chain.backward(emit, trans, lengths, cond, alphas=alphas), cond


@settings(max_examples=15, deadline=None)
@given(T=st.integers(64, 300), K=st.integers(1, 16), chunks=st.integers(2, 6), window=st.integers(2, 10),
       dense=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_posterior_matches_sequential(T, K, chunks, window, dense, seed):
    init, table, rows, trans = mixing_chain(T, K, 7, seed)
    emit = table[rows] if dense else chain.RowLookup(table, rows)
    gamma, cond = chain.posterior_chunked(init, emit, trans, chunks=chunks, window=window)
    ref_gamma, ref_cond = sequential_posterior(init, emit, trans, T)
    assert_close_logprob(cond, ref_cond, chunks, torch.float64)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["cycle", "sparse"])
def test_chunked_posterior_falls_back_where_restarts_never_meet(kind):
    K, T = 6, 900
    init, trans = non_mixing(kind, K)
    g = torch.Generator().manual_seed(2)
    table = torch.rand(3, K, generator=g, dtype=torch.float64)
    rows = torch.randint(0, 3, (1, T), generator=g)
    emit = chain.RowLookup(table, rows)
    gamma, cond = chain.posterior_chunked(init, emit, trans, chunks=5, window=8)
    ref_gamma, ref_cond = sequential_posterior(init, emit, trans, T)
    torch.testing.assert_close(cond, ref_cond, rtol=0, atol=1e-12)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("where", [0, 190, 450, 899])
def test_chunked_posterior_of_an_impossible_sequence(where):
    init, table, rows, trans = mixing_chain(900, 5, 4, 3)
    table = torch.cat([table, torch.zeros(1, 5, dtype=table.dtype)])
    rows = rows.clone()
    rows[0, where] = 4
    emit = chain.RowLookup(table, rows)
    gamma, cond = chain.posterior_chunked(init, emit, trans, chunks=5, window=8)
    ref_gamma, ref_cond = sequential_posterior(init, emit, trans, 900)
    assert torch.equal(torch.isneginf(cond), torch.isneginf(ref_cond))
    torch.testing.assert_close(gamma, ref_gamma)


def test_posterior_chunks_long_sequences_in_a_batch(monkeypatch):
    g = torch.Generator().manual_seed(9)
    init, table, _, trans = mixing_chain(1, 6, 12, 8, torch.float64)
    lengths = torch.tensor([40, 700, 650])
    rows = torch.randint(0, 12, (3, 700), generator=g)
    init = init.expand(3, -1)
    calls = chunked_calls(monkeypatch, "posterior_chunked")
    gamma, cond = chain.posterior(init, chain.RowLookup(table, rows), trans, lengths)
    assert sorted(calls) == [650, 700]
    for b, n in enumerate(lengths.tolist()):
        ref_gamma, ref_cond = sequential_posterior(init[b : b + 1], chain.RowLookup(table, rows[b : b + 1, :n]),
                                                   trans, n)
        torch.testing.assert_close(gamma[b : b + 1, :n], ref_gamma, rtol=1e-9, atol=1e-12)
        assert (gamma[b, n:] == 0).all() and (cond[b, n:] == 0).all()


@pytest.mark.parametrize("engine", ["auto", "torch"])
@pytest.mark.parametrize("T,chunks", [(1003, 7), (998, 4), (700, 6), (960, 5)])
def test_chunked_posterior_with_a_prefix_and_many_chunks(monkeypatch, engine, T, chunks):
    """T mod C positions before C equal chunks (run exactly, then carried into chunk 0 and the backward's
    last step), on the compiled engines and on torch ops (what a GPU runs)."""
    monkeypatch.setattr(chain, "CHUNK_MIN_LEN", 32)
    init, table, rows, trans = mixing_chain(T, 12, 9, T)
    emit = chain.RowLookup(table, rows)
    gamma, cond = chain.posterior_chunked(init, emit, trans, chunks=chunks, window=8, backend=engine)
    ref_gamma, ref_cond = sequential_posterior(init, emit, trans, T)
    assert_close_logprob(cond, ref_cond, chunks, torch.float64)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-9, atol=1e-12)
    dense_gamma, _ = chain.posterior_chunked(init, table[rows], trans, chunks=chunks, window=8, backend=engine)
    torch.testing.assert_close(dense_gamma, gamma, rtol=1e-12, atol=1e-14)
