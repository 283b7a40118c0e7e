"""`models.triton_chain`: the CUDA scoring path of rank_hmm and blocked_hmm (fused Triton kernels, CUDA graphs).

Without a GPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported) on tiny CPU tensors; with a GPU the same tests run the compiled kernels on CUDA, and the tests
marked `cuda` add CUDA graphs and larger shapes. Reference: a float64 scaled forward written out here (one
sequence at a time), and the family's own `.score()` (the chain engine).

Bounds: float32 storage within 1e-5 relative of float64 on log p(x) (and 1e-5 absolute per token for
|log p| <= 1); bfloat16 storage within `BF16_TOKEN_ABS_BOUND` (2e-2) per token and 2e-3 relative on log p(x).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from latentlm.models import chain  # noqa: E402
from latentlm.models import triton_chain as tc  # noqa: E402
from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.rank_hmm import RankHMM  # noqa: E402
from latentlm.models.synthetic import random_blocked_hmm, random_rank_hmm  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(not tc.available(DEV), reason="triton not installed (pip install triton)")
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
IMPLS = [pytest.param("triton", marks=needs_triton), "torch"]
F32_REL = 1e-5
BF16_SEQ_REL = 2e-3


@pytest.fixture(autouse=True)
def _fresh_cache():
    tc.clear_cache()
    tc.graph_errors.clear()
    yield
    tc.clear_cache()


def ref_forward(init_of, emit: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, step) -> torch.Tensor:
    """float64 scaled forward, one sequence at a time: log_cond (B, T), 0 at padding."""
    B, T = ids.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    ids, lengths, emit = ids.cpu(), lengths.cpu(), emit.cpu().double()
    for b in range(B):
        a = None
        for t in range(int(lengths[b])):
            a = init_of(b).double() * emit[ids[b, t]] if t == 0 else step(a, b, t) * emit[ids[b, t]]
            c = a.sum()
            a = a / c
            out[b, t] = c.log()
    return out


def rank_case(m=24, r=16, V=30, seed=1, B=5, T=7):
    t, c = random_rank_hmm(m, r, V, seed=seed)
    model = RankHMM.from_tensors(t, c, device=DEV)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    ref = ref_forward(lambda b: model.rank_start.cpu(), model.emit, ids, lengths,
                      lambda a, b, t: a @ model.rank_trans.cpu().double())
    return model, ids.to(DEV), lengths.to(DEV), ref


def blocked_case(M=4, k=8, V=30, seed=2, B=6, T=7):
    t, c = random_blocked_hmm(M, k, V, seed=seed)
    model = BlockedHMM.from_tensors(t, c, device=DEV)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1] = ids[0]  # two sequences share every (prev cluster, cluster) pair: groups of more than one row
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    cl = model.word_cluster.cpu()[ids]
    blocks = model.trans_blocks.cpu().double()
    ref = ref_forward(lambda b: model.start.cpu().view(M, k)[cl[b, 0]], model.emit, ids, lengths,
                      lambda a, b, t: a @ blocks[cl[b, t - 1], :, cl[b, t], :])
    return model, ids.to(DEV), lengths.to(DEV), ref


def family_score(model, batch):
    """The family's scoring on the chain engine's plain PyTorch recursion (its reference path)."""
    init, emit, trans = model.chain(model.to(batch))
    log_cond, _ = chain.forward(init, emit, trans, batch.lengths.to(model.device), backend="torch")
    return log_cond.double().sum(1), log_cond


def check_f32(out: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor) -> None:
    out = out.cpu().double()
    assert out.dtype == torch.float64 and out.shape == ref.shape
    mask = torch.arange(ref.shape[1])[None, :] < lengths.cpu()[:, None]
    assert bool((out[~mask] == 0).all()), "padding positions must be 0"
    tok_err = (out - ref).abs() / ref.abs().clamp_min(1.0)
    assert tok_err.max().item() <= F32_REL, tok_err.max().item()
    seq_err = (out.sum(1) - ref.sum(1)).abs() / ref.sum(1).abs()
    assert seq_err.max().item() <= F32_REL, seq_err.max().item()


def check_bf16(out: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor) -> None:
    out = out.cpu().double()
    mask = torch.arange(ref.shape[1])[None, :] < lengths.cpu()[:, None]
    assert bool((out[~mask] == 0).all())
    assert (out - ref).abs().max().item() <= tc.BF16_TOKEN_ABS_BOUND
    seq_err = (out.sum(1) - ref.sum(1)).abs() / ref.sum(1).abs()
    assert seq_err.max().item() <= BF16_SEQ_REL, seq_err.max().item()


# -- rank_hmm ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_rank_fp32_matches_float64(impl):
    model, ids, lengths, ref = rank_case()
    out = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, impl=impl)
    check_f32(out, ref, lengths)


@needs_triton
def test_rank_bf16_storage_within_bound():
    model, ids, lengths, ref = rank_case(r=32, seed=3)
    out = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans,
                               storage_dtype=torch.bfloat16, impl="triton")
    check_bf16(out, ref, lengths)


@needs_triton
def test_rank_matches_family_score_and_one_at_a_time():
    model, ids, lengths, _ = rank_case(seed=4)
    logp, lc = tc.score_rank(model, Batch(ids, lengths), impl="triton")
    want_logp, want_lc = family_score(model, Batch(ids, lengths))
    assert torch.allclose(lc.double().cpu(), want_lc.double().cpu(), rtol=F32_REL, atol=F32_REL)
    assert torch.allclose(logp.cpu(), want_logp.double().cpu(), rtol=F32_REL, atol=0)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        one = tc.rank_forward_cuda(model.rank_start, model.emit, ids[b : b + 1, :n], lengths[b : b + 1],
                                   model.rank_trans, impl="triton")
        assert torch.allclose(one[0].cpu(), lc[b, :n].cpu(), rtol=F32_REL, atol=1e-6)


@needs_triton
def test_rank_zero_probability_is_minus_inf_from_there_on():
    model, ids, lengths, _ = rank_case(seed=5, B=2, T=6)
    emit = model.emit.clone()
    emit[ids[0, 2]] = 0.0  # token at position 2 of sequence 0 impossible
    lengths = torch.tensor([6, 4], device=DEV)
    out = tc.rank_forward_cuda(model.rank_start, emit, ids, lengths, model.rank_trans, impl="triton").cpu()
    assert torch.isfinite(out[0, :2]).all()
    assert (out[0, 2:] == -float("inf")).all()


# -- blocked_hmm -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl,block_rows", [pytest.param("triton", 1, marks=needs_triton),
                                             pytest.param("triton", 16, marks=needs_triton), ("torch", 1)])
def test_blocked_fp32_matches_float64(impl, block_rows):
    model, ids, lengths, ref = blocked_case()
    out = tc.blocked_forward_cuda(model.start, model.trans, model.emit, model.word_cluster, ids, lengths,
                                  impl=impl, block_rows=block_rows)
    check_f32(out, ref, lengths)


@needs_triton
@pytest.mark.parametrize("block_rows", [1, 16])
def test_blocked_bf16_storage_within_bound(block_rows):
    model, ids, lengths, ref = blocked_case(seed=3)
    out = tc.blocked_forward_cuda(model.start, model.trans, model.emit, model.word_cluster, ids, lengths,
                                  storage_dtype=torch.bfloat16, block_rows=block_rows, impl="triton")
    check_bf16(out, ref, lengths)


@needs_triton
def test_blocked_matches_family_score_and_one_at_a_time():
    model, ids, lengths, _ = blocked_case(seed=4, B=4, T=6)
    logp, lc = tc.score_blocked(model, Batch(ids, lengths), impl="triton")
    want_logp, want_lc = family_score(model, Batch(ids, lengths))
    assert torch.allclose(lc.double().cpu(), want_lc.double().cpu(), rtol=F32_REL, atol=F32_REL)
    assert torch.allclose(logp.cpu(), want_logp.double().cpu(), rtol=F32_REL, atol=0)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        one = tc.blocked_forward_cuda(model.start, model.trans, model.emit, model.word_cluster,
                                      ids[b : b + 1, :n], lengths[b : b + 1], impl="triton")
        assert torch.allclose(one[0].cpu(), lc[b, :n].cpu(), rtol=F32_REL, atol=1e-6)


def test_tiles_cover_each_group_in_chunks():
    sk = torch.tensor([[-1, 3, 3, 3, 5, 7, 7, 7, 7, 7]])
    assert tc._tiles(sk, 2).tolist() == [[0, 1, 3, 4, 5, 7, 9, -1, -1, -1]]
    assert tc._tiles(sk, 1).tolist() == [list(range(10))]


def test_imports_without_triton_use_torch(monkeypatch):
    monkeypatch.setattr(tc, "_triton", lambda: None)
    assert not tc.available("cpu") and not tc.available("cuda")
    model, ids, lengths, ref = rank_case(seed=6, B=2, T=4)
    out = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans)  # impl auto
    check_f32(out, ref, lengths)
    with pytest.raises(RuntimeError, match="triton"):
        tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, impl="triton")


# -- CUDA only: graphs, bucketed shapes, larger models --------------------------------------------------------
@cuda
@needs_triton
def test_cuda_graph_replay_equals_eager_rank():
    model, ids, lengths, ref = rank_case(m=300, r=256, V=500, seed=7, B=37, T=29)
    kw = dict(impl="triton")
    eager = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, use_graph=False, **kw)
    first = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, **kw)  # capture
    again = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, **kw)  # replay
    check_f32(eager, ref, lengths)
    assert not tc.graph_errors, tc.graph_errors
    assert torch.allclose(first, again, rtol=1e-6, atol=1e-6)  # eager (first call) vs graph replay
    assert torch.allclose(first, eager, rtol=1e-6, atol=1e-6)
    # new inputs of the same bucket replay the same graph
    ids2 = torch.flip(ids, [1])
    lengths2 = torch.full_like(lengths, ids.shape[1])
    eager2 = tc.rank_forward_cuda(model.rank_start, model.emit, ids2, lengths2, model.rank_trans, use_graph=False,
                                  **kw)
    assert torch.allclose(tc.rank_forward_cuda(model.rank_start, model.emit, ids2, lengths2, model.rank_trans, **kw),
                          eager2, rtol=1e-6, atol=1e-6)
    bf = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans,
                              storage_dtype=torch.bfloat16, **kw)
    check_bf16(bf, ref, lengths)


@cuda
@needs_triton
@pytest.mark.parametrize("block_rows", [1, 16])
def test_cuda_graph_blocked(block_rows):
    model, ids, lengths, _ = blocked_case(M=16, k=64, V=400, seed=8, B=45, T=21)
    ids[2:12] = ids[12:22]  # some repeated pairs
    cl = model.word_cluster.cpu()[ids.cpu()]
    blocks = model.trans_blocks.cpu().double()
    ref = ref_forward(lambda b: model.start.cpu().view(16, 64)[cl[b, 0]], model.emit, ids.cpu(), lengths,
                      lambda a, b, t: a @ blocks[cl[b, t - 1], :, cl[b, t], :])
    args = (model.start, model.trans, model.emit, model.word_cluster, ids, lengths)
    eager = tc.blocked_forward_cuda(*args, use_graph=False, block_rows=block_rows)
    check_f32(eager, ref, lengths)
    g1 = tc.blocked_forward_cuda(*args, block_rows=block_rows)
    g2 = tc.blocked_forward_cuda(*args, block_rows=block_rows)
    assert not tc.graph_errors, tc.graph_errors
    assert torch.allclose(g1, g2, rtol=1e-6, atol=1e-6) and torch.allclose(g1, eager, rtol=1e-6, atol=1e-6)
    g3 = tc.blocked_forward_cuda(*args, block_rows=block_rows)
    assert torch.allclose(g2, g3, rtol=1e-6, atol=1e-6)
    bf = tc.blocked_forward_cuda(*args, block_rows=block_rows, storage_dtype=torch.bfloat16)
    check_bf16(bf, ref, lengths)
    tf = tc.blocked_forward_cuda(*args, block_rows=16, allow_tf32=True)
    check_bf16(tf, ref, lengths)  # tf32 inputs: at least as close as bf16
