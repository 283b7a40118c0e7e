"""The compiled CPU sum-product kernels (models.kernels) against the plain PyTorch recursion of
models.chain, over random shapes, lengths, thread counts and dtypes, including impossible sequences and
the two-thread single-sequence forward; and the engine choice of models.backend. Every engine is named
explicitly (`backend=`); one this machine lacks is skipped with the reason."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models import backend, chain
from latentlm.models.backend import Backend
from latentlm.models.kernels import blas, sum_product
from latentlm.models.kernels.jit import HAVE_NUMBA

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba unavailable: no compiled kernels to test")


@pytest.fixture(scope="module", params=["lockstep", "groups"])
def engine(request) -> str:
    """The batch kernel family under test: lockstep (a BLAS GEMM per step) or ROWS groups."""
    if not backend.available(request.param):
        pytest.skip("torch's BLAS is not callable here: no lockstep kernels")
    return request.param


def random_chain(B: int, T: int, K: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    trans = torch.rand(K, K, generator=g, dtype=dtype) ** 3
    trans /= trans.sum(1, keepdim=True)
    init = torch.rand(B, K, generator=g, dtype=dtype)
    init /= init.sum(1, keepdim=True)
    emit = torch.rand(B, T, K, generator=g, dtype=dtype) * 0.01
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return init, emit, trans, lengths


def plain(fn, *args, **kw):
    """Run a models.chain function on its plain PyTorch recursion, never chunked."""
    return partial(fn, backend="torch")(*args, **kw)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 11), T=st.integers(1, 9), K=st.integers(1, 13), threads=st.integers(1, 3),
       seed=st.integers(0, 10_000))
def test_forward_backward_posterior_match_plain(engine, B, T, K, threads, seed):
    init, emit, trans, lengths = random_chain(B, T, K, seed)
    ref_cond, ref_alpha = plain(chain.forward, init, emit, trans, lengths, keep_alphas=True)
    run = partial(sum_product.forward_cpu, engine=engine, threads=threads)
    cond, alpha = run(init, emit, None, trans, lengths, keep_alphas=True)
    mask = chain.valid_mask(lengths, T)
    torch.testing.assert_close(cond, ref_cond, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alpha[mask], ref_alpha[mask], rtol=1e-10, atol=1e-12)
    assert (alpha[~mask] == 0).all()
    last = torch.full((B, K), -1.0, dtype=emit.dtype)
    cond1, _ = run(init, emit, None, trans, lengths, keep_alphas=False, out_last=last)
    torch.testing.assert_close(cond1, ref_cond, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, ref_alpha[torch.arange(B), lengths - 1], rtol=1e-10, atol=1e-12)
    betas = sum_product.backward_cpu(emit, None, trans, lengths, cond, engine=engine, threads=threads)
    torch.testing.assert_close(betas, plain(chain.backward, emit, trans, lengths, ref_cond), rtol=1e-9, atol=1e-12)
    gamma = sum_product.backward_cpu(emit, None, trans, lengths, cond, engine=engine, threads=threads, alphas=alpha)
    ref_gamma, _ = plain(chain.posterior, init, emit, trans, lengths)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-9, atol=1e-12)
    if engine == "lockstep":  # both passes fused per thread
        fused, fused_cond = sum_product.posterior_cpu(init, emit, None, trans, lengths, threads=threads)
        torch.testing.assert_close(fused, ref_gamma, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fused_cond, ref_cond, rtol=1e-12, atol=1e-12)
    one, _ = sum_product.forward_cpu(init[:1], emit[:1], None, trans, lengths[:1], engine="single", threads=threads,
                                     keep_alphas=False)
    torch.testing.assert_close(one[0], ref_cond[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_engine_through_chain_equals_plain(engine, dtype, tol):
    """Each engine named through `models.chain`, as tests and benchmarks name it: same results as the torch
    recursion, and it is the engine that ran (a refusal would raise)."""
    init, emit, trans, lengths = random_chain(7, 15, 33, seed=11, dtype=dtype)
    cond, _ = chain.forward(init, emit, trans, lengths, backend=engine)
    gamma, cond2 = chain.posterior(init, emit, trans, lengths, backend=engine)
    ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, lengths)
    torch.testing.assert_close(cond, ref_cond, rtol=tol, atol=tol)
    torch.testing.assert_close(cond2, ref_cond, rtol=tol, atol=tol)
    torch.testing.assert_close(gamma, ref_gamma, rtol=tol, atol=tol)
    betas = chain.backward(emit, trans, lengths, ref_cond, backend=engine)
    torch.testing.assert_close(betas, plain(chain.backward, emit, trans, lengths, ref_cond), rtol=tol, atol=tol)


def test_large_float32_matrix(engine):
    """float32 with more than GROUPS_MAX_K and PACK_MIN_K states, variable lengths: both engines as the torch
    recursion (lockstep on the packed matrix where MKL exports packing)."""
    K = max(backend.PACK_MIN_K, backend.GROUPS_MAX_K) + 8
    init, emit, trans, lengths = random_chain(6, 20, K, seed=5, dtype=torch.float32)
    gamma, cond = chain.posterior(init, emit, trans, lengths, backend=engine)
    ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, lengths)
    torch.testing.assert_close(cond, ref_cond, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-4, atol=1e-6)
    cond, _ = chain.forward(init, emit, trans, lengths, backend=engine)
    torch.testing.assert_close(cond, ref_cond, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not blas.HAVE_PACK, reason="torch's BLAS exports no MKL packed-GEMM API here")
def test_large_float32_matrix_is_packed_once(monkeypatch):
    """Lockstep on float32 with K >= PACK_MIN_K runs on MKL's packed matrix: packed once per direction while
    the matrix lives unchanged, packed again after an in-place change; results as the torch recursion."""
    init, emit, trans, lengths = random_chain(6, 20, backend.PACK_MIN_K + 8, seed=5, dtype=torch.float32)
    assert backend.packs(Backend.LOCKSTEP, trans.dtype, trans.shape[0])
    packs, pack = [], blas.BLAS.pack
    monkeypatch.setattr(blas, "BLAS", blas.BLAS._replace(pack=lambda *a: packs.append(1) or pack(*a)))
    for _ in range(2):
        gamma, cond = chain.posterior(init, emit, trans, lengths, backend="lockstep")
        ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, lengths)
        torch.testing.assert_close(cond, ref_cond, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gamma, ref_gamma, rtol=1e-4, atol=1e-6)
    assert len(packs) == 2  # forward and backward once each, then from the cache
    trans.copy_(trans.flip(0))  # in place: still row-stochastic, a new version
    cond, _ = chain.forward(init, emit, trans, lengths, backend="lockstep")
    torch.testing.assert_close(cond, plain(chain.forward, init, emit, trans, lengths)[0], rtol=1e-5, atol=1e-5)
    assert len(packs) == 3


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_batch_equals_one_at_a_time(engine, dtype, tol):
    init, emit, trans, lengths = random_chain(9, 40, 70, seed=3, dtype=dtype)
    cond, _ = chain.forward(init, emit, trans, lengths, backend=engine)
    gamma, _ = chain.posterior(init, emit, trans, lengths, backend=engine)
    for b in range(9):
        n = int(lengths[b])
        c1, _ = chain.forward(init[b : b + 1], emit[b : b + 1, :n], trans, lengths[b : b + 1])
        g1, _ = chain.posterior(init[b : b + 1], emit[b : b + 1, :n], trans, lengths[b : b + 1], backend=engine)
        torch.testing.assert_close(cond[b, :n], c1[0], rtol=tol, atol=tol)
        torch.testing.assert_close(gamma[b, :n], g1[0], rtol=tol, atol=tol)
        assert (cond[b, n:] == 0).all() and (gamma[b, n:] == 0).all()


def test_impossible_sequences_are_minus_inf_from_the_first_zero_step(engine):
    init, emit, trans, lengths = random_chain(6, 8, 5, seed=1)
    lengths[:] = 8
    emit[2, 3] = 0.0  # impossible from position 3 on
    emit[4, 0] = 0.0  # impossible from the start
    cond, _ = sum_product.forward_cpu(init, emit, None, trans, lengths, engine=engine, keep_alphas=False, threads=2)
    ref, _ = plain(chain.forward, init, emit, trans, lengths)
    assert torch.equal(torch.isinf(cond), torch.isinf(ref))
    assert torch.isinf(cond[2, 3:]).all() and torch.isfinite(cond[2, :3]).all() and torch.isinf(cond[4]).all()
    ok = torch.tensor([0, 1, 3, 5])
    torch.testing.assert_close(cond[ok], ref[ok])
    gamma, _ = chain.posterior(init, emit, trans, lengths, backend=engine)
    assert torch.isfinite(gamma).all() and (gamma[4] == 0).all()
    one, _ = sum_product.forward_cpu(init[2:3], emit[2:3], None, trans, lengths[2:3], engine="single",
                                     keep_alphas=False, threads=1)
    assert torch.isinf(one[0, 3:]).all() and math.isfinite(one[0, 2].item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("K", [128, 200])
def test_two_thread_single_sequence_forward(dtype, tol, K):
    """The column-split forward (two threads meeting every step) equals the one-thread recursion."""
    init, emit, trans, lengths = random_chain(1, 300, K, seed=K, dtype=dtype)
    lengths[:] = 300
    single = partial(sum_product.forward_cpu, engine="single", keep_alphas=False)
    one, _ = single(init, emit, None, trans, lengths, threads=1)
    two, _ = single(init, emit, None, trans, lengths, threads=2)
    ref, _ = plain(chain.forward, init, emit, trans, lengths)
    torch.testing.assert_close(two, one, rtol=tol, atol=tol)
    torch.testing.assert_close(two, ref, rtol=tol, atol=tol)
    emit[0, 123] = 0.0  # both threads must stop at the same step
    dead, _ = single(init, emit, None, trans, lengths, threads=2)
    assert torch.isinf(dead[0, 123:]).all() and torch.isfinite(dead[0, :123]).all()


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 12), K=st.integers(1, 9), pad=st.integers(0, 3), dtype=st.sampled_from(["f32", "f64"]),
       seed=st.integers(0, 10_000))
def test_meet_in_the_middle_posterior_equals_plain(T, K, pad, dtype, seed):
    """One sequence's posterior on two threads meeting in the middle (forward from the start, backward from
    the end, each finishing the other's half) equals the plain recursion, odd and even lengths, padding."""
    dt, tol = (torch.float32, 1e-5) if dtype == "f32" else (torch.float64, 1e-12)
    init, emit, trans, _ = random_chain(1, T + pad, K, seed, dtype=dt)
    n = torch.tensor([T])
    gamma, cond = sum_product.posterior_halves(init, emit, None, trans, T)
    ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, n)
    torch.testing.assert_close(gamma, ref_gamma, rtol=tol, atol=tol)
    torch.testing.assert_close(cond, ref_cond, rtol=tol, atol=tol)
    assert (gamma[0, T:] == 0).all() and (cond[0, T:] == 0).all()


@pytest.mark.parametrize("dead_at", [0, 3, 9, 14])
def test_meet_in_the_middle_impossible_sequence_has_zero_posterior(dead_at):
    """An impossible position in either half: log_cond is -inf from there on (as step by step) and every
    posterior is 0, on both threads' sides of the middle."""
    init, emit, trans, _ = random_chain(1, 15, 6, seed=dead_at)
    emit[0, dead_at] = 0.0
    gamma, cond = sum_product.posterior_halves(init, emit, None, trans, 15)
    ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, torch.tensor([15]))
    assert torch.isinf(cond[0, dead_at:]).all() and torch.isfinite(cond[0, :dead_at]).all()
    torch.testing.assert_close(cond[0, :dead_at], ref_cond[0, :dead_at])
    assert (gamma == 0).all() and (ref_gamma == 0).all()


def test_one_sequence_posterior_runs_halves_where_chosen(monkeypatch):
    """`chain.posterior` of one sequence (alone, or a long one in a batch) takes the meet-in-the-middle path
    exactly where `backend.posterior_halves` says so, and the result is the plain recursion's either way."""
    calls = []
    real = sum_product.posterior_halves
    monkeypatch.setattr(sum_product, "posterior_halves", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(backend, "HALVES_MIN_WORK", 8 * 20)  # T (K^2 + 4) of 160: these tiny inputs qualify
    monkeypatch.setattr(backend, "HALVES_STEP_COST", 4)
    monkeypatch.setattr(backend, "LONG_MIN_TOKENS", 40)
    monkeypatch.setattr(backend, "CHUNK_MIN_STATES", 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    init, emit, trans, lengths = random_chain(3, 60, 4, seed=5)
    lengths[:] = torch.tensor([60, 7, 45])
    assert backend.posterior_halves(Backend.GROUPS, 1, 8, 4) and not backend.posterior_halves(Backend.GROUPS, 1, 7, 4)
    assert not backend.posterior_halves(Backend.LOCKSTEP, 1, 60, 4)
    assert not backend.posterior_halves(Backend.GROUPS, 2, 60, 4)
    assert backend.posterior_halves(Backend.GROUPS, 1, 60, backend.HALVES_MAX_K + 1)  # alone: any size
    one, _ = chain.posterior(init[:1], emit[:1], trans, lengths[:1])
    assert calls == [60]
    torch.testing.assert_close(one, plain(chain.posterior, init[:1], emit[:1], trans, lengths[:1])[0])
    calls.clear()
    many, cond = chain.posterior(init, emit, trans, lengths)  # rows 0 and 2 are long: each alone, in halves
    assert sorted(calls) == [45, 60]
    ref, ref_cond = plain(chain.posterior, init, emit, trans, lengths)
    torch.testing.assert_close(many, ref)
    torch.testing.assert_close(cond, ref_cond)
    with monkeypatch.context() as m:  # long sequences beyond HALVES_MAX_K states: a batch of chunks
        m.setattr(backend, "HALVES_MAX_K", 3)
        chunked, real_chunked = [], chain.posterior_chunked
        m.setattr(chain, "posterior_chunked",
                  lambda i, e, *a, **k: chunked.append(e.shape[1]) or real_chunked(i, e, *a, **k))
        many, _ = chain.posterior(init, emit, trans, lengths)
        assert sorted(chunked) == [45, 60]
        torch.testing.assert_close(many, ref)
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: 1)  # one thread allowed: the step-by-step recursion
        calls.clear()
        chain.posterior(init[:1], emit[:1], trans, lengths[:1])
        assert calls == []


def test_auto_choice():
    """What "auto" picks: the torch recursion under autograd, for per-step matrices and mixed dtypes; the
    single-sequence kernel for one sequence's log_cond; lockstep or groups for batches by size and what this
    machine has. Each expectation is definite on every machine."""
    init, emit, trans, lengths = random_chain(3, 4, 5, seed=0)
    choose = partial(backend.sum_product, "auto")
    batch = Backend.LOCKSTEP if blas.HAVE_GEMM else Backend.GROUPS  # 3 rows of 5 states
    trans.requires_grad_(True)
    assert choose(emit, trans, init, rows=3) is Backend.TORCH
    with torch.no_grad():
        assert choose(emit, trans, init, rows=3) is Backend.GROUPS  # fewer than LOCKSTEP_MIN_ROWS rows
        assert choose(emit, trans, init, rows=backend.LOCKSTEP_MIN_ROWS) is batch
        assert choose(emit, trans, init, rows=1) is Backend.SINGLE
        assert choose(emit, trans, init, rows=1, marginals=True) is Backend.GROUPS
    assert choose(emit, lambda t: trans, rows=3) is Backend.TORCH
    assert choose(emit.float(), trans.detach(), rows=3) is Backend.TORCH  # mixed dtypes
    big = torch.eye(backend.GROUPS_MAX_K + 1, dtype=emit.dtype)
    assert choose(emit, big, rows=3) is (Backend.LOCKSTEP if blas.HAVE_GEMM else Backend.TORCH)
    assert choose(emit, big, rows=1) is Backend.SINGLE
    assert choose(emit, big, rows=1, last=True) is Backend.GROUPS  # one sequence wanting more than log_cond
    assert choose(emit, big, rows=1, marginals=True) is Backend.GROUPS
    assert backend.threads(Backend.LOCKSTEP, 7, 10, 10) == 1  # at least LOCKSTEP_MIN_ROWS rows a thread
    assert backend.threads(Backend.SINGLE, 1, 10, 10) == 1  # too little work to split
    log_emit = emit.log()
    work_rows = -(-backend.NATIVE_MAXPLUS_MIN_WORK // 25)  # rows whose B K^2 reaches the threshold at K = 5
    assert backend.max_product("auto", log_emit, trans.detach(), rows=1, steps=work_rows) is Backend.SINGLE
    assert backend.max_product("auto", log_emit, trans.detach(), rows=2, steps=work_rows) is Backend.TORCH
    assert backend.max_product("auto", log_emit, trans.detach(), rows=work_rows) is Backend.GROUPS
    assert backend.max_product("auto", log_emit, lambda t: trans, rows=work_rows) is Backend.TORCH


def test_named_backends_that_cannot_run_the_call_are_refused(engine):
    init, emit, trans, lengths = random_chain(3, 4, 5, seed=0)
    with pytest.raises(ValueError, match="single"):
        chain.forward(init, emit, trans, lengths, backend="single")  # three sequences
    with pytest.raises(ValueError, match="single"):
        chain.posterior(init[:1], emit[:1], trans, lengths[:1], backend="single")  # marginals
    with pytest.raises(ValueError, match=engine):
        chain.forward(init, emit, lambda t: trans.expand(3, 5, 5), lengths, backend=engine)
    with pytest.raises(ValueError, match=engine):
        chain.forward(init, emit, trans.requires_grad_(True), lengths, backend=engine)
    with pytest.raises(ValueError, match="lockstep"):
        chain.viterbi(init.log(), emit.log(), trans.detach().log(), lengths, backend="lockstep")
    with pytest.raises(ValueError):
        chain.forward(init, emit, trans, lengths, backend="fastest")


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 9), T=st.integers(1, 8), K=st.integers(1, 9), N=st.integers(1, 12),
       threads=st.integers(1, 2), seed=st.integers(0, 10_000))
def test_row_lookup_equals_the_gathered_tensor(engine, B, T, K, N, threads, seed):
    """Emissions as table rows (what hmm / rank_hmm pass) give exactly what the gathered tensor gives,
    on the compiled and the plain path, for score, posteriors and betas."""
    init, _, trans, lengths = random_chain(B, T, K, seed)
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(N, K, generator=g, dtype=torch.float64)
    rows = torch.randint(0, N, (B, T), generator=g)
    lookup = chain.RowLookup(table, rows)
    assert lookup.shape == (B, T, K)
    gathered = table[rows]
    for name in (engine, "torch"):
        run = partial(chain.forward, backend=name)
        c1, _ = run(init, lookup, trans, lengths)
        c2, _ = run(init, gathered, trans, lengths)
        assert torch.equal(c1, c2)
        p1, _ = chain.posterior(init, lookup, trans, lengths, backend=name)
        p2, _ = chain.posterior(init, gathered, trans, lengths, backend=name)
        assert torch.equal(p1, p2)
        b1 = chain.backward(lookup, trans, lengths, c1, backend=name)
        b2 = chain.backward(gathered, trans, lengths, c2, backend=name)
        assert torch.equal(b1, b2)
    single = partial(sum_product.forward_cpu, engine="single", keep_alphas=False, threads=threads)
    one, _ = single(init[:1], table, rows[:1], trans, lengths[:1])
    ref, _ = single(init[:1], gathered[:1], None, trans, lengths[:1])
    # the single-sequence kernel's vectorised sums may start at a different element where a row's address has a
    # different alignment (a table row, a gathered row): equal to the last bits or so, not bit for bit
    assert torch.allclose(one, ref, rtol=1e-13, atol=1e-13)


def test_row_lookup_out_of_range_is_an_error_not_a_read(engine):
    init, _, trans, lengths = random_chain(2, 3, 4, seed=0)
    table = torch.rand(5, 4, dtype=torch.float64)
    for bad in (5, -1):
        rows = torch.tensor([[0, 1, 2], [3, 4, bad]])
        with pytest.raises(IndexError):
            chain.forward(init, chain.RowLookup(table, rows), trans, lengths, backend=engine)
        with pytest.raises(IndexError):
            chain.posterior(init, chain.RowLookup(table, rows), trans, lengths, backend=engine)
