"""Every HMM family against brute-force enumeration (float64), plus batching/padding invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.hmm import DenseHMM
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from tests.models.chain_brute import brute

V = 6


def make(family: str, seed: int, dtype=torch.float64, **kw):
    if family == "hmm":
        t, c = random_hmm(kw.get("Z", 3), V, seed, concentration=kw.get("conc", 1.0))
        return DenseHMM.from_tensors(t, c, dtype=dtype)
    if family == "blocked_hmm":
        t, c = random_blocked_hmm(kw.get("M", 2), kw.get("k", 2), V, seed, concentration=kw.get("conc", 1.0))
        return BlockedHMM.from_tensors(t, c, dtype=dtype)
    t, c = random_rank_hmm(kw.get("m", 3), kw.get("r", 2), V, seed, concentration=kw.get("conc", 1.0))
    return RankHMM.from_tensors(t, c, dtype=dtype)


FAMILIES = ["hmm", "blocked_hmm", "rank_hmm"]
SEQS = [[1], [0, 5], [2, 3, 4], [5, 1, 1, 0], [3, 2, 0, 4, 1]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_against_brute_force(family, seed):
    check_brute(make(family, seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_blocked_with_one_cluster_is_a_dense_hmm_against_brute_force(seed):
    """M = 1 (no emission constraint) runs the shared-matrix path."""
    model = make("blocked_hmm", seed, M=1, k=4)
    assert isinstance(model.chain(Batch.from_lists(SEQS))[2], torch.Tensor)
    check_brute(model)


def check_brute(model):
    batch = Batch.from_lists(SEQS)
    logp, cond = model.score(batch)
    state_ids, probs = model.posterior(batch)
    path, vlogp = model.viterbi(batch)
    mbr, _ = model.mbr(batch)
    Z = model.num_states
    for i, x in enumerate(SEQS):
        ref = brute(model, x)
        T = len(x)
        assert logp[i].item() == pytest.approx(ref["logprob"], abs=1e-10)
        assert cond[i, :T].tolist() == pytest.approx(ref["token_logprobs"], abs=1e-10)
        assert cond[i, T:].abs().sum().item() == 0
        full = torch.zeros(T, Z, dtype=torch.float64)
        full.scatter_add_(1, state_ids[i, :T], probs[i, :T])
        assert torch.allclose(full, ref["marginals"], atol=1e-10)
        assert vlogp[i].item() == pytest.approx(ref["viterbi_logprob"], abs=1e-10)
        assert path[i, :T].tolist() == ref["viterbi"]
        assert (path[i, T:] == -1).all()
        assert mbr[i, :T].tolist() == ref["mbr"]


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_and_batch_composition_change_nothing(family):
    """A batch gives what one-at-a-time gives, in float32 (default) and float64."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        model = make(family, 3, dtype=dtype, Z=5, M=2, k=3, m=5, r=3)
        batch = Batch.from_lists(SEQS)
        logp, cond = model.score(batch)
        _, probs = model.posterior(batch)
        path, vlogp = model.viterbi(batch)
        for i, x in enumerate(SEQS):
            one = Batch.from_lists([x])
            l1, c1 = model.score(one)
            _, p1 = model.posterior(one)
            v1, vl1 = model.viterbi(one)
            T = len(x)
            assert torch.allclose(logp[i], l1[0], rtol=tol, atol=tol)
            assert torch.allclose(cond[i, :T], c1[0], rtol=tol, atol=tol)
            assert torch.allclose(probs[i, :T], p1[0], rtol=tol, atol=tol)
            assert path[i, :T].tolist() == v1[0].tolist()
            assert torch.allclose(vlogp[i], vl1[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_random_shapes(family, data):
    """Random sizes, lengths and paddings: marginals normalised, log p(x) = sum of conditionals,
    Viterbi log-prob <= log p(x), padding-invariance against single-sequence runs."""
    seed = data.draw(st.integers(0, 10_000))
    sizes = dict(Z=data.draw(st.integers(1, 6)), M=data.draw(st.integers(1, 3)), k=data.draw(st.integers(1, 3)),
                 m=data.draw(st.integers(1, 6)), r=data.draw(st.integers(1, 4)),
                 conc=data.draw(st.sampled_from([0.3, 1.0])))
    model = make(family, seed, **sizes)
    seqs = data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=9), min_size=1, max_size=5))
    batch = Batch.from_lists(seqs)
    logp, cond = model.score(batch)
    ids, probs = model.posterior(batch)
    _, vlogp = model.viterbi(batch)
    for i, x in enumerate(seqs):
        T = len(x)
        assert torch.allclose(probs[i, :T].sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-9)
        assert math.isclose(cond[i, :T].sum().item(), logp[i].item(), abs_tol=1e-9)
        assert vlogp[i].item() <= logp[i].item() + 1e-9
        l1, _ = model.score(Batch.from_lists([x]))
        assert math.isclose(l1[0].item(), logp[i].item(), abs_tol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_brute_force_small_property(family):
    """Brute force on random tiny models with spiky rows (concentration 0.3)."""
    for seed in range(4):
        model = make(family, 100 + seed, conc=0.3, Z=2, M=2, k=1, m=2, r=2)
        x = [seed % V, (seed * 7 + 1) % V, 3]
        ref = brute(model, x)
        logp, _ = model.score(Batch.from_lists([x]))
        assert logp[0].item() == pytest.approx(ref["logprob"], abs=1e-10)


def test_empty_sequence_is_an_error():
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="empty"):
        Batch.from_lists([[1, 2], []])


def test_rank_viterbi_refuses_beyond_the_limit_and_mbr_still_works():
    from latentlm.models.errors import LimitExceeded

    model = make("rank_hmm", 0, m=6, r=2)
    model.viterbi_max_elements = 25
    batch = Batch.from_lists([[1, 2, 3]])
    with pytest.raises(LimitExceeded, match=r"6 x 6 state-space matrix .* limit of 25; use method 'mbr'"):
        model.viterbi(batch)
    states, _ = model.mbr(batch)
    assert states.shape == (1, 3)


def test_float32_long_sequence_does_not_underflow():
    """The scaled forward keeps float32 finite over thousands of steps and matches float64."""
    t, c = random_hmm(8, 50, 0)
    m32 = DenseHMM.from_tensors(t, c, dtype=torch.float32)
    m64 = DenseHMM.from_tensors(t, c, dtype=torch.float64)
    x = torch.randint(0, 50, (1, 5000), generator=torch.Generator().manual_seed(0)).tolist()
    l32, _ = m32.score(Batch.from_lists(x))
    l64, _ = m64.score(Batch.from_lists(x))
    assert math.isfinite(l32.item())
    assert l32.item() == pytest.approx(l64.item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_maxplus_equals_broadcast(dtype):
    """The numba (max, +) kernel agrees with the plain broadcast, including -inf entries and ties."""
    from latentlm.models.chain import maxplus
    from latentlm.models.kernels.maxplus import maxplus_cpu

    g = torch.Generator().manual_seed(0)
    for B, K in ((1, 300), (7, 130), (64, 64)):
        delta = torch.randn(B, K, generator=g, dtype=dtype)
        log_trans = torch.randn(K, K, generator=g, dtype=dtype)
        log_trans[:, 3] = -math.inf
        delta[0, 5] = -math.inf
        cand = delta[:, :, None] + log_trans[None]
        ref_v, ref_a = cand.max(1)
        v, a = maxplus_cpu(delta, log_trans)
        assert torch.equal(v, ref_v)
        assert torch.equal(cand.gather(1, a[:, None, :]).squeeze(1), ref_v)  # argmax attains the max
        v2, _ = maxplus(delta, log_trans)
        assert torch.equal(v2, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_single_sequence_viterbi_equals_engine(dtype):
    """One long sequence goes through the compiled recursion; it matches the batched engine path."""
    from latentlm.models import backend

    t, c = random_hmm(40, 30, 4)
    m = DenseHMM.from_tensors(t, c, dtype=dtype)
    x = torch.randint(0, 30, (1, 400), generator=torch.Generator().manual_seed(1)).tolist()
    one = Batch.from_lists(x)
    two = Batch.from_lists(x + [[1, 2, 3]])  # B = 2 takes the per-step engine
    p1, l1 = m.viterbi(one)
    p2, l2 = m.viterbi(two)
    assert torch.equal(p1[0], p2[0]) and l1[0].item() == pytest.approx(l2[0].item(), rel=1e-9)
    assert backend.NATIVE_MAXPLUS_MIN_WORK <= 400 * 40 * 40  # so `one` really took the compiled path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_single_sequence_forward_equals_engine(dtype):
    """One long sequence is scored by the compiled forward; it matches the batched engine."""
    t, c = random_hmm(40, 30, 5)
    m = DenseHMM.from_tensors(t, c, dtype=dtype)
    x = torch.randint(0, 30, (1, 400), generator=torch.Generator().manual_seed(2)).tolist()
    l1, c1 = m.score(Batch.from_lists(x))
    l2, c2 = m.score(Batch.from_lists(x + [[4, 5]]))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(c1[0], c2[0], rtol=tol, atol=tol)
    assert l1[0].item() == pytest.approx(l2[0].item(), rel=tol)
