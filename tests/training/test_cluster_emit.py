"""The per-cluster emission log-softmax of a VL-HMM: the compiled passes (`training.neural.ClusterLogSoftmax`,
`models.kernels.cluster_emit`) and the in-place GEMMs (`training.neural.ClusterGemmLogSoftmax`): values and
gradients against the PyTorch loop they replace and against finite differences (gradcheck), on random cluster
layouts, with and without the word bias, on 1 and 3 threads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.kernels import cluster_emit, gemm
from latentlm.training.neural import (
    ClusterGemmLogSoftmax,
    ClusterLogSoftmax,
    cluster_log_softmax,
    cluster_log_softmax_padded,
    cluster_log_softmax_reference,
)

pytestmark = pytest.mark.skipif(not cluster_emit.HAVE_NUMBA, reason="numba unavailable: only the PyTorch loop")


def inputs(sizes: list[int], k: int, h: int, bias: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    V, M = sum(sizes), len(sizes)
    words = torch.randn(V, h, generator=g, dtype=dtype).requires_grad_()
    states = torch.randn(M, k, h, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    return words, states, b, offsets


def grads(fn, words, states, bias, upstream):
    out = fn()
    params = [words, states] + ([bias] if bias is not None else [])
    return out, torch.autograd.grad(out, params, upstream)


@pytest.mark.parametrize("path", ["dispatch", "gemm", "gemm-onednn", "padded"])
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), k=st.integers(1, 6), h=st.integers(1, 19),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 1000))
def test_values_and_gradients_equal_the_pytorch_loop(path, sizes, k, h, bias, dtype, seed):
    """`cluster_log_softmax` (the compiled passes at these sizes) and the in-place GEMMs against the loop, the
    GEMMs also on oneDNN (`kernels.gemm`, every size)."""
    if path == "gemm-onednn" and "onednn" not in gemm.BACKENDS:
        pytest.skip("torch built without oneDNN")
    fn = {"dispatch": cluster_log_softmax, "padded": cluster_log_softmax_padded}.get(path, ClusterGemmLogSoftmax.apply)
    words, states, b, offsets = inputs(sizes, k, h, bias, dtype, seed)
    upstream = torch.randn(sum(sizes), k, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    with pytest.MonkeyPatch.context() as m, gemm.using("onednn" if path == "gemm-onednn" else "torch"):
        m.setattr(gemm, "ONEDNN_MIN_MACS", 0)
        out, got = grads(lambda: fn(words, states, b, sizes), words, states, b, upstream)
    ref, want = grads(lambda: cluster_log_softmax_reference(words, states, b, sizes), words, states, b, upstream)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert out.dtype == dtype and torch.allclose(out, ref, rtol=tol, atol=tol)
    for g1, g2 in zip(got, want, strict=True):
        assert torch.allclose(g1, g2, rtol=tol, atol=tol * 10)
    for m in range(len(sizes)):  # each state's column is a distribution over its cluster's words
        block = out[offsets[m] : offsets[m + 1]].double().exp().sum(0)
        assert torch.allclose(block, torch.ones_like(block), atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck(bias):
    words, states, b, offsets = inputs([3, 1, 4, 2], 3, 5, bias, torch.float64, seed=4)
    params = (words, states, *([b] if bias else []))
    assert torch.autograd.gradcheck(lambda w, s, *bb: ClusterLogSoftmax.apply(w, s, bb[0] if bb else None, offsets),
                                    params, eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(
        lambda w, s, *bb: ClusterGemmLogSoftmax.apply(w, s, bb[0] if bb else None, [3, 1, 4, 2]), params,
        eps=1e-6, atol=1e-8)


def test_threads_give_the_same_bits(monkeypatch):
    sizes = [5, 30, 2, 17, 9, 1, 40]
    words, states, b, offsets = inputs(sizes, 4, 16, True, torch.float32, seed=2)
    upstream = torch.randn(sum(sizes), 4, generator=torch.Generator().manual_seed(3))
    runs = []
    for n in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        runs.append(grads(lambda: cluster_log_softmax(words, states, b, sizes), words, states, b, upstream))
    (o1, g1), (o3, g3) = runs
    assert torch.equal(o1, o3) and all(torch.equal(x, y) for x, y in zip(g1, g3, strict=True))


def test_the_gemms_run_where_the_compiled_pass_cannot(monkeypatch):
    """Beyond CLUSTER_EMIT_MAX_K states per cluster (and off CPU) the in-place GEMMs run: same values."""
    from latentlm.training.neural import emission

    words, states, b, offsets = inputs([2, 3], 4, 6, True, torch.float64)
    fast = cluster_log_softmax(words, states, b, [2, 3])
    monkeypatch.setattr(emission, "CLUSTER_EMIT_MAX_K", 3)
    slow = cluster_log_softmax(words, states, b, [2, 3])
    assert slow.grad_fn is not None and "ClusterGemmLogSoftmax" in type(slow.grad_fn).__name__
    assert "ClusterLogSoftmax" in type(fast.grad_fn).__name__
    assert torch.allclose(fast, slow, atol=1e-12)


@pytest.mark.parametrize("path", ["compiled", "gemm", "padded"])
@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), k=st.integers(1, 5), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 1000), data=st.data())
def test_a_sparse_upstream_gradient_gives_what_its_dense_copy_gives(path, sizes, k, bias, dtype, seed, data):
    """`BlockedNLL` hands the emission table a sparse gradient (rows of the batch's words only, some clusters
    with none): both backward passes give what the same gradient made dense gives."""
    words, states, b, offsets = inputs(sizes, k, 7, bias, dtype, seed)
    V = sum(sizes)
    rows = sorted(data.draw(st.sets(st.integers(0, V - 1), min_size=1, max_size=V)))
    values = torch.randn(len(rows), k, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    sparse = torch.sparse_coo_tensor(torch.tensor([rows]), values, (V, k), is_coalesced=True,
                                     check_invariants=False)
    fn = {"compiled": lambda: ClusterLogSoftmax.apply(words, states, b, offsets),
          "gemm": lambda: ClusterGemmLogSoftmax.apply(words, states, b, sizes),
          "padded": lambda: cluster_log_softmax_padded(words, states, b, sizes)}[path]
    _, got = grads(fn, words, states, b, sparse)
    _, want = grads(fn, words, states, b, sparse.to_dense())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for g1, g2 in zip(got, want, strict=True):
        assert not g1.is_sparse and torch.allclose(g1, g2, rtol=tol, atol=tol * 10)
