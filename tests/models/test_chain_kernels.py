"""The compiled CPU sum-product kernels (models.kernels) against the plain PyTorch recursion of
models.chain, over random shapes, lengths, thread counts and dtypes, including impossible sequences and
the two-thread single-sequence forward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from latentlm.models import chain, kernels

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba unavailable")


@pytest.fixture(scope="module", autouse=True, params=["gemm", "groups"])
def kernel_family(request):
    """Every test runs on both batch kernel families: lockstep (a BLAS GEMM per step) and ROWS groups."""
    if request.param == "gemm" and not kernels.HAVE_GEMM:
        pytest.skip("torch's BLAS is not callable here")
    saved = kernels.USE_GEMM
    kernels.USE_GEMM = request.param == "gemm"
    yield request.param
    kernels.USE_GEMM = saved


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
    """Run a models.chain function on its plain PyTorch path."""
    with chain.plain_torch():
        return fn(*args, **kw)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 11), T=st.integers(1, 9), K=st.integers(1, 13), threads=st.integers(1, 3),
       seed=st.integers(0, 10_000))
def test_forward_backward_posterior_match_plain(B, T, K, threads, seed):
    init, emit, trans, lengths = random_chain(B, T, K, seed)
    ref_cond, ref_alpha = plain(chain.forward, init, emit, trans, lengths, keep_alphas=True)
    cond, alpha = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=True, threads=threads)
    mask = chain.valid_mask(lengths, T)
    torch.testing.assert_close(cond, ref_cond, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alpha[mask], ref_alpha[mask], rtol=1e-10, atol=1e-12)
    assert (alpha[~mask] == 0).all()
    last = torch.full((B, K), -1.0, dtype=emit.dtype)
    cond1, _ = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=False, threads=threads,
                                   out_last=last)
    torch.testing.assert_close(cond1, ref_cond, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, ref_alpha[torch.arange(B), lengths - 1], rtol=1e-10, atol=1e-12)
    betas = kernels.backward_cpu(emit, None, trans, lengths, cond, threads=threads)
    torch.testing.assert_close(betas, plain(chain.backward, emit, trans, lengths, ref_cond), rtol=1e-9, atol=1e-12)
    gamma = kernels.backward_cpu(emit, None, trans, lengths, cond, threads=threads, alphas=alpha)
    ref_gamma, _ = plain(chain.posterior, init, emit, trans, lengths)
    torch.testing.assert_close(gamma, ref_gamma, rtol=1e-9, atol=1e-12)
    if kernels.lockstep(B, K):  # both passes fused per thread
        fused, fused_cond = kernels.posterior_cpu(init, emit, None, trans, lengths, threads=threads)
        torch.testing.assert_close(fused, ref_gamma, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fused_cond, ref_cond, rtol=1e-12, atol=1e-12)


def test_large_float32_matrix_is_packed_once(monkeypatch):
    """float32 with K >= PACK_MIN_K runs the lockstep kernels on MKL's packed matrix (where there is one): same
    results as the plain recursion, variable lengths included; packed once per direction while the matrix
    lives unchanged, packed again after an in-place change."""
    init, emit, trans, lengths = random_chain(6, 20, kernels.PACK_MIN_K + 8, seed=5, dtype=torch.float32)
    packs = []
    can_pack = kernels.HAVE_GEMM and kernels._BLAS[3] is not None
    if can_pack:
        size, pack, compute = kernels._BLAS[3]
        monkeypatch.setattr(kernels, "_BLAS", (*kernels._BLAS[:3], (size, lambda *a: packs.append(1) or pack(*a),
                                                                      compute)))
    for _ in range(2):
        gamma, cond = chain.posterior(init, emit, trans, lengths)
        ref_gamma, ref_cond = plain(chain.posterior, init, emit, trans, lengths)
        torch.testing.assert_close(cond, ref_cond, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gamma, ref_gamma, rtol=1e-4, atol=1e-6)
    gemm = kernels.USE_GEMM and can_pack
    assert len(packs) == (2 if gemm else 0)  # forward and backward once each, then from the cache
    trans.copy_(trans.flip(0))  # in place: still row-stochastic, a new version
    cond, _ = chain.forward(init, emit, trans, lengths)
    torch.testing.assert_close(cond, plain(chain.forward, init, emit, trans, lengths)[0], rtol=1e-5, atol=1e-5)
    assert len(packs) == (3 if gemm else 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_batch_equals_one_at_a_time(dtype, tol):
    init, emit, trans, lengths = random_chain(9, 40, 70, seed=3, dtype=dtype)
    cond, _ = chain.forward(init, emit, trans, lengths)
    gamma, _ = chain.posterior(init, emit, trans, lengths)
    for b in range(9):
        n = int(lengths[b])
        c1, _ = chain.forward(init[b : b + 1], emit[b : b + 1, :n], trans, lengths[b : b + 1])
        g1, _ = chain.posterior(init[b : b + 1], emit[b : b + 1, :n], trans, lengths[b : b + 1])
        torch.testing.assert_close(cond[b, :n], c1[0], rtol=tol, atol=tol)
        torch.testing.assert_close(gamma[b, :n], g1[0], rtol=tol, atol=tol)
        assert (cond[b, n:] == 0).all() and (gamma[b, n:] == 0).all()


def test_impossible_sequences_are_minus_inf_from_the_first_zero_step():
    init, emit, trans, lengths = random_chain(6, 8, 5, seed=1)
    lengths[:] = 8
    emit[2, 3] = 0.0  # impossible from position 3 on
    emit[4, 0] = 0.0  # impossible from the start
    cond, _ = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=False, threads=2)
    ref, _ = plain(chain.forward, init, emit, trans, lengths)
    assert torch.equal(torch.isinf(cond), torch.isinf(ref))
    assert torch.isinf(cond[2, 3:]).all() and torch.isfinite(cond[2, :3]).all() and torch.isinf(cond[4]).all()
    ok = torch.tensor([0, 1, 3, 5])
    torch.testing.assert_close(cond[ok], ref[ok])
    gamma, _ = chain.posterior(init, emit, trans, lengths)
    assert torch.isfinite(gamma).all() and (gamma[4] == 0).all()
    one, _ = kernels.forward_cpu(init[2:3], emit[2:3], None, trans, lengths[2:3], keep_alphas=False, threads=1)
    assert torch.isinf(one[0, 3:]).all() and math.isfinite(one[0, 2].item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("K", [128, 200])
def test_two_thread_single_sequence_forward(monkeypatch, dtype, tol, K):
    """The column-split forward (two threads meeting every step) equals the one-thread recursion."""
    init, emit, trans, lengths = random_chain(1, 300, K, seed=K, dtype=dtype)
    lengths[:] = 300
    one, _ = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=False, threads=1)
    monkeypatch.setattr(kernels, "SPLIT_MIN_WORK", 1)
    two, _ = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=False, threads=2)
    ref, _ = plain(chain.forward, init, emit, trans, lengths)
    torch.testing.assert_close(two, one, rtol=tol, atol=tol)
    torch.testing.assert_close(two, ref, rtol=tol, atol=tol)
    emit[0, 123] = 0.0  # both threads must stop at the same step
    dead, _ = kernels.forward_cpu(init, emit, None, trans, lengths, keep_alphas=False, threads=2)
    assert torch.isinf(dead[0, 123:]).all() and torch.isfinite(dead[0, :123]).all()


def test_autograd_and_other_devices_take_the_plain_path():
    init, emit, trans, lengths = random_chain(3, 4, 5, seed=0)
    trans.requires_grad_(True)
    assert not chain._compiled(emit, trans, init)
    with torch.no_grad():
        assert chain._compiled(emit, trans, init)
    assert not chain._compiled(emit, lambda t: trans)
    assert not chain._compiled(emit.float(), trans.detach())  # mixed dtypes
    big = torch.eye(chain.COMPILED_MAX_K + 1, dtype=emit.dtype)
    assert chain._compiled(emit, big) == (kernels.HAVE_GEMM and kernels.USE_GEMM)  # groups stop at COMPILED_MAX_K
    assert chain._compiled(emit, big, any_size=True)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 9), T=st.integers(1, 8), K=st.integers(1, 9), N=st.integers(1, 12),
       threads=st.integers(1, 2), seed=st.integers(0, 10_000))
def test_row_lookup_equals_the_gathered_tensor(B, T, K, N, threads, seed):
    """Emissions as table rows (what hmm / rank_hmm pass) give exactly what the gathered tensor gives,
    on the compiled and the plain path, for score, posteriors and betas."""
    init, _, trans, lengths = random_chain(B, T, K, seed)
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(N, K, generator=g, dtype=torch.float64)
    rows = torch.randint(0, N, (B, T), generator=g)
    lookup = chain.RowLookup(table, rows)
    assert lookup.shape == (B, T, K)
    gathered = table[rows]
    for run in (lambda f, *a: f(*a), plain):
        c1, _ = run(chain.forward, init, lookup, trans, lengths)
        c2, _ = run(chain.forward, init, gathered, trans, lengths)
        assert torch.equal(c1, c2)
        p1, _ = run(chain.posterior, init, lookup, trans, lengths)
        p2, _ = run(chain.posterior, init, gathered, trans, lengths)
        assert torch.equal(p1, p2)
        b1, b2 = run(chain.backward, lookup, trans, lengths, c1), run(chain.backward, gathered, trans, lengths, c2)
        assert torch.equal(b1, b2)
    one, _ = kernels.forward_cpu(init[:1], table, rows[:1], trans, lengths[:1], keep_alphas=False, threads=threads)
    ref, _ = kernels.forward_cpu(init[:1], gathered[:1], None, trans, lengths[:1], keep_alphas=False, threads=threads)
    assert torch.equal(one, ref)


def test_row_lookup_out_of_range_is_an_error_not_a_read():
    init, _, trans, lengths = random_chain(2, 3, 4, seed=0)
    table = torch.rand(5, 4, dtype=torch.float64)
    for bad in (5, -1):
        rows = torch.tensor([[0, 1, 2], [3, 4, bad]])
        with pytest.raises(IndexError):
            chain.forward(init, chain.RowLookup(table, rows), trans, lengths)
        with pytest.raises(IndexError):
            chain.posterior(init, chain.RowLookup(table, rows), trans, lengths)
