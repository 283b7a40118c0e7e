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

from latentlm.models import backend as dispatch  # noqa: E402
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
    assert (out - ref).abs().max().item() <= dispatch.BF16_TOKEN_ABS_BOUND
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


# -- shape buckets (what keeps CUDA-graph captures rare under dynamic batching); on CPU with `bucket=True` ----
def test_bucket_sizes_are_few_and_hold_n():
    sizes = {tc._bucket(n) for n in range(1, 4097)}
    assert sizes == {8, 16} | {s for j in range(5, 13) for s in (3 << (j - 2), 1 << j)}  # 2 per octave from 16
    for n in range(1, 4097):
        b = tc._bucket(n)
        assert b >= n and b % 8 == 0 and (n <= 8 or b < 2 * n)
    assert len(sizes) == 18  # for B or T up to 4096
    for T in (1, 50, 64, 600, 4096, 10**6):
        cap = tc._rows_cap(T)
        assert tc._bucket(cap) == cap and 8 <= cap <= tc.MAX_GRAPH_ROWS
        assert cap * T <= tc.MAX_GRAPH_SLOTS or cap == 8


def _varied(V, seed, B, T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return ids.to(DEV), lengths.to(DEV)


@needs_triton
@pytest.mark.parametrize("block_rows", [1, 16])
def test_blocked_bucketed_equals_unbucketed_exactly(block_rows):
    model, *_ = blocked_case(M=4, k=8, V=30, seed=11)
    args = (model.start, model.trans, model.emit, model.word_cluster)
    for B, T in ((5, 7), (9, 17), (3, 1)):  # padded to (8, 8), (16, 24), (8, 8)
        ids, lengths = _varied(30, B * T, B, T)
        plain = tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=False, block_rows=block_rows)
        padded = tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=True, block_rows=block_rows)
        assert padded.shape == (B, T)
        assert torch.equal(plain, padded), (plain - padded).abs().max()


@needs_triton
def test_rank_bucketed_equals_unbucketed():
    model, *_ = rank_case(seed=12)
    for B, T in ((5, 7), (9, 17)):
        ids, lengths = _varied(30, B + T, B, T)
        a = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, use_graph=False,
                                 bucket=False)
        b = tc.rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, use_graph=False,
                                 bucket=True)
        # row-independent GEMM: padded rows change nothing (BLAS may pick another kernel for another row count)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@needs_triton
def test_rows_beyond_the_cap_run_as_several_calls(monkeypatch):
    monkeypatch.setattr(tc, "MAX_GRAPH_ROWS", 8)
    model, *_ = blocked_case(M=4, k=8, V=30, seed=13)
    args = (model.start, model.trans, model.emit, model.word_cluster)
    ids, lengths = _varied(30, 3, 21, 6)  # 21 rows: calls of 8 + 8 + 5 (-> 8) rows
    plain = tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=False)
    tc.clear_cache()
    split = tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=True)
    assert torch.equal(plain, split)
    assert tc.stats["runners"] == 1  # all three calls share one (8, 8) runner
    rmodel, *_ = rank_case(seed=14)
    init = rmodel.rank_start.expand(21, -1).contiguous()  # per-row init is sliced with the rows
    a = tc.rank_forward_cuda(init, rmodel.emit, ids, lengths, rmodel.rank_trans, use_graph=False, bucket=False)
    b = tc.rank_forward_cuda(init, rmodel.emit, ids, lengths, rmodel.rank_trans, use_graph=False, bucket=True)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@needs_triton
def test_dynamic_batch_shapes_reuse_a_few_runners():
    """What the service's batcher produces: every batch another (B, T). With buckets, runners (captures on
    CUDA) are made once per bucket, and the cache keeps them all."""
    model, *_ = blocked_case(M=4, k=8, V=30, seed=15)
    args = (model.start, model.trans, model.emit, model.word_cluster)
    shapes = [(b, t) for b in range(1, 41, 3) for t in (45, 50, 52)]
    for B, T in shapes * 2:
        ids, lengths = _varied(30, B, B, T)
        tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=True, impl="torch")
    buckets = {(tc._bucket(b), tc._bucket(t)) for b, t in shapes}
    assert tc.stats["runners"] == len(buckets) == 10 and tc.stats["evictions"] == 0
    assert len(shapes) == 42


def test_graph_cache_is_bounded_by_entries_and_bytes(monkeypatch):
    model, *_ = blocked_case(M=4, k=8, V=30, seed=16)
    args = (model.start, model.trans, model.emit, model.word_cluster)
    monkeypatch.setattr(tc, "GRAPH_CACHE_SIZE", 3)
    for T in (8, 16, 24, 32, 48):
        ids, lengths = _varied(30, T, 4, T)
        tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=True, impl="torch")
    assert len(tc._graph_cache) == 3 and tc.stats["evictions"] == 2
    monkeypatch.setattr(tc, "GRAPH_CACHE_BYTES", 1)  # one entry is always kept
    ids, lengths = _varied(30, 1, 4, 64)
    tc.blocked_forward_cuda(*args, ids, lengths, use_graph=False, bucket=True, impl="torch")
    assert len(tc._graph_cache) == 1


def test_concurrent_calls_share_runners_safely():
    """The batcher's thread and the batch-job thread may score at once: the lock keeps each call's static
    buffers its own until its result is copied out."""
    import threading

    model, *_ = blocked_case(M=4, k=8, V=30, seed=17)
    args = (model.start, model.trans, model.emit, model.word_cluster)
    inputs = [_varied(30, s, 6, 7) for s in range(8)]  # one bucket: every thread uses the same runner
    want = [tc.blocked_forward_cuda(*args, i, n, use_graph=False, bucket=False, impl="torch") for i, n in inputs]
    bad: list[int] = []

    def work(j: int) -> None:
        for _ in range(5):
            for s, (i, n) in enumerate(inputs):
                got = tc.blocked_forward_cuda(*args, i, n, use_graph=False, bucket=True, impl="torch")
                if not torch.equal(got, want[s]):
                    bad.append(j)

    ts = [threading.Thread(target=work, args=(j,)) for j in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
