"""The training step's GEMM libraries (`models.kernels.gemm`): every product on oneDNN equals float64 to
float32 rounding, with the same gradients as autograd through torch's ops; under "torch", below the size
threshold and for other dtypes the products are torch's own ops bit for bit; the choice is process-wide and
validated."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.kernels import gemm

needs_onednn = pytest.mark.skipif("onednn" not in gemm.BACKENDS, reason="torch built without oneDNN")
dims = st.integers(1, 70)


@contextmanager
def onednn_at_every_size() -> Iterator[None]:
    """The "onednn" backend with no size threshold: every product through oneDNN."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gemm, "ONEDNN_MIN_MACS", 0)
        with gemm.using("onednn"):
            yield


def mats(seed: int, *shapes: tuple[int, ...], dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def close(got: torch.Tensor, want: torch.Tensor, k: int) -> bool:
    """float32 rounding of a length-k dot product of unit normals."""
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6 * max(k, 1) ** 0.5 * 4)


@needs_onednn
@settings(max_examples=60, deadline=None)
@given(m=dims, k=dims, n=dims, seed=st.integers(0, 10_000), bias=st.sampled_from(["none", "col", "row"]))
def test_onednn_products_equal_float64(m, k, n, seed, bias):
    x, w, a, b = mats(seed, (m, k), (n, k), (k, m), (k, n))
    bvec = {"none": None, "col": mats(seed + 1, (n,))[0], "row": mats(seed + 1, (m, 1))[0]}[bias]
    with onednn_at_every_size():
        got_nt = gemm.nt(x, w, bvec)
        got_nn = gemm.nn(x, w.T.contiguous())
        got_tn = gemm.tn(a, b)
        out = torch.full((m, n), float("nan"))
        into = gemm.nt(x, w, out=out)
    want = x.double() @ w.double().T + (0 if bvec is None else bvec.double())
    assert close(got_nt, want, k) and close(got_nn, x.double() @ w.double().T, k)
    assert close(got_tn, a.double().T @ b.double(), k)
    assert into is out and close(out, x.double() @ w.double().T, k)


@needs_onednn
@settings(max_examples=40, deadline=None)
@given(m=dims, k=dims, n=dims, seed=st.integers(0, 10_000), with_bias=st.booleans())
def test_onednn_gradients_equal_autograd(m, k, n, seed, with_bias):
    x, w, bias, up = mats(seed, (m, k), (n, k), (n,), (m, n))
    leaves = [t.requires_grad_() for t in (x, w, bias)]
    b = bias if with_bias else None
    with onednn_at_every_size():
        got = torch.autograd.grad(gemm.linear(x, w, b), leaves[: 3 if with_bias else 2], up)
        got_mm = torch.autograd.grad(gemm.matmul(x, w.T), [x, w], up)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(F.linear(ref[0], ref[1], ref[2] if with_bias else None), ref[: 3 if with_bias else 2],
                               up.double())
    for g1, g2 in zip(got, want, strict=True):
        assert close(g1, g2, max(m, n, k))
    for g1, g2 in zip(got_mm, want[:2], strict=True):
        assert close(g1, g2, max(m, n, k))


@pytest.mark.parametrize("name", gemm.BACKENDS)
def test_torch_ops_themselves_below_the_threshold_for_other_dtypes_and_under_torch(name):
    """Small products, float64 and the "torch" backend run torch's own op: bit for bit."""
    with gemm.using(name):
        for dtype, m in ((torch.float32, 8), (torch.float64, 300)):
            x, w, b = mats(0, (m, 40), (30, 40), (30,), dtype=dtype)
            assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
            assert torch.equal(gemm.matmul(x, w.T), x @ w.T)
            assert torch.equal(gemm.tn(x, x), x.T @ x)
    x, w, b = mats(1, (300, 256), (200, 256), (200,))
    with gemm.using("torch"):
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(gemm.nt(x, w, b[None, :]), torch.addmm(b[None, :], x, w.T))


def test_backend_is_validated_and_restored():
    assert gemm.backend() == "torch"
    with pytest.raises(ValueError, match="GEMM backend 'mkl2'"):
        gemm.set_backend("mkl2")
    with pytest.raises(ValueError, match="GEMM backend 'mkl2'"):
        gemm.choose([(8, 8, 8)], "mkl2")
    with pytest.raises(RuntimeError), gemm.using(gemm.BACKENDS[-1]):
        assert gemm.backend() == gemm.BACKENDS[-1]
        raise RuntimeError
    assert gemm.backend() == "torch"


def test_choose_measures_every_backend_or_takes_the_request():
    name, rates = gemm.choose([(256, 64, 128), (64, 64, 64)])
    assert name in gemm.BACKENDS
    assert (set(rates) == set(gemm.BACKENDS) and all(r > 0 for r in rates.values())) if len(gemm.BACKENDS) > 1 \
        else rates == {}
    assert gemm.choose([(256, 64, 128)], "torch") == ("torch", {})
    assert gemm.choose([], "auto") == ("torch", {})
