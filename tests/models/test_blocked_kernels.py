"""The compiled blocked-HMM sweeps (`kernels.blocked`: `BlockedHMM.score`, `.posterior`, `.viterbi` and
`.filtered_last` on CPU) against the chain engine's torch steps, on random shapes, lengths, dtypes and thread
counts, and on impossible sequences.
(Brute-force enumeration of the same family, which now runs these sweeps: tests/models/test_hmm_families.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from latentlm.models import backend as dispatch
from latentlm.models import chain
from latentlm.models.base import Batch, ChainFamily
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.kernels import blocked as blocked_kernels
from latentlm.models.kernels.threads import spans
from latentlm.models.synthetic import random_blocked_hmm

pytestmark = pytest.mark.skipif(not blocked_kernels.HAVE_NUMBA, reason="numba unavailable: only the torch steps")

TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


def model(M: int, k: int, V: int, seed: int, dtype: torch.dtype, conc: float = 1.0) -> BlockedHMM:
    t, c = random_blocked_hmm(M, k, V, seed, concentration=conc)
    return BlockedHMM.from_tensors(t, c, dtype=dtype)


def torch_steps(m: BlockedHMM, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(x), log_cond, posteriors) by the chain engine's torch steps (the reference)."""
    logp, cond = m.score(batch, backend="torch")
    _, probs = ChainFamily.posterior(m, batch)
    return logp, cond, probs


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compiled_sweeps_equal_torch_steps(data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    M, k = data.draw(st.integers(2, 4)), data.draw(st.integers(1, 5))
    V = data.draw(st.integers(M, 9))
    m = model(M, k, V, data.draw(st.integers(0, 10_000)), dtype, data.draw(st.sampled_from([0.3, 1.0])))
    assert m._compiled()
    seqs = data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12), min_size=1, max_size=6))
    batch = Batch.from_lists(seqs)
    logp, cond = m.score(batch)
    _, probs = m.posterior(batch)
    path, vlogp = m.viterbi(batch)
    ref_logp, ref_cond, ref_probs = torch_steps(m, batch)
    ref_path, ref_vlogp = ChainFamily.viterbi(m, batch)
    ref_path = torch.where(ref_path >= 0, m._clusters(batch) * m.k + ref_path, ref_path)
    tol = TOL[dtype]
    assert torch.allclose(vlogp, ref_vlogp, rtol=tol, atol=tol * 10)
    if dtype == torch.float64:  # (float32's rounding may break a near-tie either way: both paths are best)
        assert torch.equal(path, ref_path)
    assert cond.dtype == dtype and probs.dtype == dtype
    assert torch.allclose(cond, ref_cond, rtol=tol, atol=tol)
    assert torch.allclose(logp, ref_logp, rtol=tol, atol=tol)
    assert torch.allclose(probs, ref_probs, rtol=tol, atol=tol)
    for i, x in enumerate(seqs):  # padding is 0, and each row is what it is alone
        assert (cond[i, len(x):] == 0).all() and (probs[i, len(x):] == 0).all()
        one, _ = m.score(Batch.from_lists([x]))
        assert math.isclose(one[0].item(), logp[i].item(), rel_tol=tol, abs_tol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_split_over_threads_give_the_same_results(monkeypatch, dtype):
    m = model(5, 4, 40, 7, dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(40, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (23,), generator=g)]
    batch = Batch.from_lists(seqs)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one_thread = (m.score(batch)[1], m.posterior(batch)[1], *m.viterbi(batch))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(dispatch, "BLOCKED_SPLIT_MIN_WORK", 0)
    assert m._threads(batch) == 3
    three = (m.score(batch)[1], m.posterior(batch)[1], *m.viterbi(batch))
    # the same rows, the same code; only whether LLVM's runtime alias checks take a loop's vector or scalar
    # version (fused multiply-adds or not) can depend on where a thread's scratch lies: within an ulp or two
    tol = TOL[dtype] / 100
    assert torch.equal(one_thread[2], three[2])  # Viterbi paths
    assert all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(one_thread, three, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_impossible_sequence_is_minus_inf_from_its_impossible_step(dtype):
    """Cluster 0 can never be followed by cluster 1: log_cond is -inf from that position on and the
    sequence's posteriors are 0, as on the torch steps; the other rows are untouched."""
    t, c = random_blocked_hmm(2, 3, 6, 3)
    wc = t["word_cluster"]
    trans = t["trans"].clone()
    trans[:3, 3:] = 0.0
    t["trans"] = trans / trans.sum(1, keepdim=True)
    m = BlockedHMM.from_tensors(t, c, dtype=dtype)
    w0, w1 = (int((wc == cl).nonzero()[0]) for cl in (0, 1))
    seqs = [[w1, w0, w0, w1, w0], [w1, w1, w0], [w0, w1]]
    batch = Batch.from_lists(seqs)
    logp, cond = m.score(batch)
    _, probs = m.posterior(batch)
    ref_logp, ref_cond, ref_probs = torch_steps(m, batch)
    assert torch.isneginf(cond[0, 3:]).all() and torch.isfinite(cond[0, :3]).all() and cond[2, 1] == -math.inf
    assert torch.equal(torch.isneginf(cond), torch.isneginf(ref_cond))
    assert torch.isneginf(logp[0]) and torch.isneginf(logp[2]) and torch.isfinite(logp[1])
    assert (probs[0] == 0).all() and (probs[2] == 0).all() and torch.allclose(probs, ref_probs, atol=TOL[dtype])
    finite = torch.isfinite(ref_cond)
    assert torch.allclose(cond[finite], ref_cond[finite], rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_viterbi_on_probabilities_over_long_and_impossible_sequences(dtype):
    """The compiled Viterbi runs on the probabilities of `trans` and `emit` (rescaled every step) and never makes
    the log matrix: over sequences of 400-900 tokens (products far below float64's range without the rescaling) it
    gives the log-space torch steps' paths and scores; an impossible sequence scores -inf on both; and a
    bfloat16 copy of the matrix gives the float32 model's result on the rounded matrix."""
    t, c = random_blocked_hmm(3, 4, 12, 11, concentration=0.3)
    trans = t["trans"].clone()
    trans[:4, 4:8] = 0.0  # cluster 0 is never followed by cluster 1
    t["trans"] = trans / trans.sum(1, keepdim=True)
    m = BlockedHMM.from_tensors(t, c, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    wc = t["word_cluster"]
    w0, w1 = (int((wc == cl).nonzero()[0]) for cl in (0, 1))
    seqs = [torch.randint(12, (int(n),), generator=g).tolist() for n in (900, 400, 650)]
    seqs[2][100:102] = [w0, w1]  # impossible from position 101
    batch = Batch.from_lists(seqs)
    path, logp = m.viterbi(batch)
    assert "_log_blocks" not in m.__dict__  # no Z x Z log matrix was made
    ref_path, ref_logp = ChainFamily.viterbi(m, batch)
    ref_path = torch.where(ref_path >= 0, m._clusters(batch) * m.k + ref_path, ref_path)
    assert torch.isneginf(logp[2]) and torch.isneginf(ref_logp[2])
    assert logp[0] < -900  # p(x, z*) ~ e^-1000: underflows float64 unless rescaled
    tol = TOL[dtype]
    assert torch.allclose(logp[:2], ref_logp[:2], rtol=tol, atol=tol * 10)
    if dtype == torch.float64:
        assert torch.equal(path[:2], ref_path[:2])
    if dtype == torch.float32:  # the kernel on bfloat16 bits = the kernel on the float32 of those bits
        rounded = m.trans.to(torch.bfloat16)
        init, table, rows = m._decode_emissions(batch)
        args = (init, table, rows, m._clusters(batch), batch.lengths)
        got = blocked_kernels.viterbi_cpu(*args, rounded, 1)
        want = blocked_kernels.viterbi_cpu(*args, rounded.float(), 1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_backend_choice_and_what_models_report():
    m = model(3, 2, 8, 0, torch.float32)
    assert m.backends()["score"] == "groups"
    batch = Batch.from_lists([[1, 2, 3], [4]])
    assert torch.allclose(m.score(batch, backend="groups")[1], m.score(batch, backend="torch")[1], atol=1e-6)
    with pytest.raises(ValueError, match="lockstep"):
        m.score(batch, backend="lockstep")
    one_cluster = model(1, 4, 8, 0, torch.float32)
    assert not one_cluster._compiled()  # a shared matrix: the chain engine's own compiled engines


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=20), threads=st.integers(1, 5))
def test_spans_cover_every_row_once(lengths, threads):
    ranges = spans(np.array(lengths, dtype=np.int64), threads)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(lo < hi for lo, hi in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert len(ranges) <= min(threads, len(lengths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_filtered_last_equals_the_chain_engine(dtype):
    """`BlockedHMM.filtered_last` (what a BPTT-trained model's sentence start is built from) against the chain
    engine's `out_last` on the torch steps; an impossible sequence gives zeros on both."""
    t, c = random_blocked_hmm(3, 4, 12, 5)
    trans = t["trans"].clone()
    trans[:4, 4:8] = 0.0  # cluster 0 is never followed by cluster 1
    t["trans"] = trans / trans.sum(1, keepdim=True)
    m = BlockedHMM.from_tensors(t, c, dtype=dtype)
    wc = t["word_cluster"]
    w0, w1 = (int((wc == cl).nonzero()[0]) for cl in (0, 1))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(12, (int(n),), generator=g).tolist() for n in (1, 7, 3, 12)] + [[w0, w1, w0]]
    batch = Batch.from_lists(seqs)
    got = m.filtered_last(batch)
    init, emit, trans_at = m.chain(batch)
    want = torch.zeros_like(got)
    chain.forward(init, emit, trans_at, batch.lengths, out_last=want, backend="torch")
    assert torch.allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert (got[-1] == 0).all()
    sums = got.double().sum(1)
    assert bool((((sums - 1).abs() < 1e-5) | (sums == 0)).all())


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 70), threads=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 1000))
def test_logit_gradient_pass_equals_tensor_ops_for_any_threads(n, threads, dtype, seed):
    """`logit_grad_cpu` (training's transition-logit gradient, one pass in place) against the same formula as
    tensor ops, scale * (C - rowsum(C) * P) in float64; every thread count gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.rand(n, n, generator=g, dtype=torch.float64) * (torch.rand(n, n, generator=g) < 0.5)
    trans = torch.softmax(torch.randn(n, n, generator=g, dtype=torch.float64) * 3, 1)
    want = -0.25 * (counts - counts.sum(1, keepdim=True) * trans)
    got = blocked_kernels.logit_grad_cpu(counts.to(dtype), trans.to(dtype), -0.25, threads)
    assert torch.allclose(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    one = blocked_kernels.logit_grad_cpu(counts.to(dtype), trans.to(dtype), -0.25, 1)
    assert torch.equal(got, one)
    if n > 1:
        with pytest.raises(ValueError, match="contiguous"):
            blocked_kernels.logit_grad_cpu(counts.to(dtype).T, trans.to(dtype), 1.0, 1)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_bfloat16_storage_serves_exactly_the_rounded_matrix_within_the_bound(data):
    """bfloat16 storage on CPU (`set_storage_dtype`) keeps only the bfloat16 matrix (the float32 one is dropped)
    and serves it: the sweeps widen each stored entry exactly, so score, posterior, `filtered_last` and
    Viterbi give the same bits as the float32 model of the bfloat16-rounded matrix, as do the torch steps
    (which widen the blocks they gather), `predictive` and sampling; scores stay within
    `BF16_TOKEN_ABS_BOUND` per token of the float64 model, and a row scores alone what it scores in a padded
    batch. Going back to float32 needs a reload (a clear error)."""
    M, k = data.draw(st.integers(2, 4)), data.draw(st.integers(1, 9))
    V = data.draw(st.integers(M, 12))
    t, c = random_blocked_hmm(M, k, V, data.draw(st.integers(0, 10_000)),
                              concentration=data.draw(st.sampled_from([0.3, 1.0])))
    seqs = data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=15), min_size=1, max_size=6))
    batch = Batch.from_lists(seqs)
    m = BlockedHMM.from_tensors(t, c, storage_dtype="bfloat16")
    assert m.backends()["storage_dtype"] == "bfloat16" and m.trans.dtype == torch.bfloat16
    assert m.dtype == torch.float32 and m.score(batch)[1].dtype == torch.float32
    logp, cond = m.score(batch)
    rounded = dict(t, trans=t["trans"].to(torch.bfloat16).to(torch.float32))
    ref = BlockedHMM.from_tensors(rounded, c)
    want_logp, want_cond = ref.score(batch)
    assert torch.equal(cond, want_cond) and torch.equal(logp, want_logp)
    _, exact = BlockedHMM.from_tensors(t, c, dtype=torch.float64).score(batch)
    assert (cond.double() - exact).abs().max().item() <= dispatch.BF16_TOKEN_ABS_BOUND
    for i, x in enumerate(seqs):
        one, one_cond = m.score(Batch.from_lists([x]))
        assert torch.equal(one_cond[0], cond[i, : len(x)]) and one[0].item() == logp[i].item()
    assert torch.equal(m.posterior(batch)[1], ref.posterior(batch)[1])
    assert torch.equal(m.filtered_last(batch), ref.filtered_last(batch))
    for got, want in zip(m.viterbi(batch), ref.viterbi(batch), strict=True):
        assert torch.equal(got, want)
    assert torch.allclose(m.score(batch, backend="torch")[1], ref.score(batch, backend="torch")[1], atol=1e-6)
    assert torch.equal(ChainFamily.viterbi(m, batch)[0], ChainFamily.viterbi(ref, batch)[0])
    assert torch.equal(m.predictive(seqs[0]), ref.predictive(seqs[0]))
    for a, b in zip(m.sample(5, 8, torch.Generator().manual_seed(1)).ids,
                    ref.sample(5, 8, torch.Generator().manual_seed(1)).ids, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="reload"):
        m.set_storage_dtype("float32")
