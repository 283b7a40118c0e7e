"""The VL-HMM export normalises its transition matrix by row blocks (`neural.EXPORT_ROWS`, so that a 2^15-state
matrix is never held in float64 whole): by blocks it equals the whole-matrix computation from `matrices`, for
every state parameterisation and a block size that does not divide the state count."""

from __future__ import annotations

import pytest
import torch

from latentlm.training import neural


@pytest.mark.parametrize("state_embedding", ["factored", "independent", "tied"])
def test_export_by_row_blocks_equals_the_whole_matrix(monkeypatch, state_embedding):
    torch.manual_seed(0)
    V, M, k = 11, 3, 4  # 12 states: blocks of 5, 5, 2
    wc = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 1])
    model = neural.VLHMM(V, wc, M, k, 8, state_embedding).double()
    with torch.no_grad():
        ls, lt, le = (t.double() for t in model.matrices(None))
    start, trans, emit = ls.exp(), lt.exp(), le.exp()
    emit = emit / torch.zeros(M, k, dtype=torch.float64).index_add_(0, wc, emit)[wc]
    monkeypatch.setattr(neural, "EXPORT_ROWS", 5)
    out = model.export_tensors()
    torch.testing.assert_close(out["start"].double(), start / start.sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out["trans"].double(), trans / trans.sum(1, keepdim=True), rtol=1e-6, atol=0)
    torch.testing.assert_close(out["emit"].double(), emit, rtol=1e-6, atol=0)
    assert out["trans"].dtype == torch.float32 and out["trans"].shape == (M * k, M * k)


def test_stream_start_by_row_blocks_is_the_posterior_pushed_through_trans(monkeypatch):
    """`fix_start_for_streams`: the average filtered posterior at <eos>, times trans, summed by row blocks."""
    torch.manual_seed(1)
    V, M, k = 9, 3, 3
    wc = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    model = neural.VLHMM(V, wc, M, k, 8, "tied")
    tensors = model.export_tensors()
    seqs = [[1, 4, 8], [2, 8], [5, 3, 7, 8]]  # word 8 is <eos>
    whole = neural.fix_start_for_streams(model, tensors, seqs, 8)["start"]
    monkeypatch.setattr(neural, "EXPORT_ROWS", 2)
    blocks = neural.fix_start_for_streams(model, tensors, seqs, 8)["start"]
    torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=0)
    assert abs(float(blocks.double().sum()) - 1) < 1e-6 and not torch.equal(blocks, tensors["start"])
