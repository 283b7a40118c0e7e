"""`lds` family: steady-state Kalman filter/RTS smoother against an exact time-varying smoother (dense,
float64), artifact validation, embeddings, and batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.base import Batch
from latentlm.models.errors import ArtifactError
from latentlm.models.lds import LDS, spd_power, steady_state, sym, whitening
from latentlm.models.registry import load_artifact, save_artifact
from latentlm.models.vocab import Vocabulary
from latentlm.training.lds import random_lds_tensors

random_lds = random_lds_tensors


def exact_smoother(A: np.ndarray, C: np.ndarray, D: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Textbook time-varying Kalman filter + RTS smoother, x_0 = 0, Q = I, dense V x V algebra."""
    T, h = len(w), A.shape[0]
    m, P = np.zeros(h), np.zeros((h, h))
    mf, Pf, mp, Pp = [], [], [], []
    for t in range(T):
        m_, P_ = A @ m, A @ P @ A.T + np.eye(h)
        S = C @ P_ @ C.T + D
        K = np.linalg.solve(S, C @ P_).T
        m, P = m_ + K @ (w[t] - C @ m_), P_ - K @ C @ P_
        mf.append(m), Pf.append(P), mp.append(m_), Pp.append(P_)
    ms = [None] * T
    ms[-1] = mf[-1]
    for t in range(T - 2, -1, -1):
        J = Pf[t] @ A.T @ np.linalg.inv(Pp[t + 1])
        ms[t] = mf[t] + J @ (ms[t + 1] - mp[t + 1])
    return np.array(mf), np.array(ms)


@pytest.mark.parametrize("seed", [0, 1])
def test_steady_state_matches_exact_smoother_mid_sequence(seed):
    V, h, T = 9, 3, 160
    t = random_lds(V, h, seed)
    model = LDS.from_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": h}, dtype=torch.float64)
    ids = np.random.default_rng(seed).integers(0, V, T)
    mu, U, Lam = t["mu"], t["noise_basis"], t["noise_lowrank"]
    w = (np.eye(V)[ids] - mu) / np.sqrt(mu)
    D = np.eye(V) - U @ Lam @ U.T                       # D~ (the null direction sqrt(mu) carries no data)
    mf, ms = exact_smoother(t["A"], t["C"], D, w)
    batch = Batch.from_lists([ids.tolist()])
    filt = model.means(batch, causal=True)[0].numpy()
    smooth = model.means(batch)[0].numpy()
    mid = slice(T // 3, 2 * T // 3)
    np.testing.assert_allclose(filt[mid], mf[mid], atol=1e-9, rtol=1e-7)
    np.testing.assert_allclose(smooth[mid], ms[mid], atol=1e-9, rtol=1e-7)
    # the last position is a filtered mean in both
    np.testing.assert_allclose(smooth[-1], ms[-1], atol=1e-8)


def test_exported_covariances_spd_and_stable():
    t = random_lds(12, 4, 3)
    for k in ("sigma_pred", "sigma_filt", "sigma_smooth"):
        S = t[k]
        np.testing.assert_allclose(S, S.T, atol=1e-12)
        assert np.linalg.eigvalsh(S).min() > 0
    assert np.abs(np.linalg.eigvals(t["filter_trans"])).max() < 1
    # smoothing shrinks uncertainty: P_smooth <= Sigma_filt <= Sigma_pred
    assert np.linalg.eigvalsh(t["sigma_filt"] - t["sigma_smooth"]).min() > -1e-10
    assert np.linalg.eigvalsh(t["sigma_pred"] - t["sigma_filt"]).min() > -1e-10


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=12), min_size=1, max_size=5), st.booleans())
def test_batch_equals_one_at_a_time(seqs, causal):
    t = random_lds(8, 3, 5)
    model = LDS.from_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": 3}, dtype=torch.float64)
    together = model.op_embed(seqs, causal=causal)
    for s, res in zip(seqs, together, strict=True):
        alone = model.op_embed([s], causal=causal)[0]
        np.testing.assert_allclose(res.embeddings, alone.embeddings, atol=1e-10)
        assert res.dim == 3 and len(res.embeddings) == len(s)
        np.testing.assert_allclose(np.linalg.norm(res.embeddings, axis=1), 1.0, atol=1e-9)


def test_embeddings_whitened_by_M(tmp_path):
    t = random_lds(10, 3, 7)
    M = sym(np.array([[2.0, 0.3, 0.0], [0.3, 1.0, 0.1], [0.0, 0.1, 0.5]]))
    t["embed_whiten"] = spd_power(M, -0.5)
    model = LDS.from_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": 3}, dtype=torch.float64)
    batch = Batch.from_lists([[1, 2, 3, 4]])
    z = model.means(batch)[0].numpy() @ spd_power(M, -0.5).T
    np.testing.assert_allclose(model.embed(batch)[0].numpy(), z / np.linalg.norm(z, axis=1, keepdims=True))


def test_artifact_roundtrip_and_validation(tmp_path):
    V, h = 10, 3
    t = {k: torch.from_numpy(v) for k, v in random_lds(V, h, 2).items()}
    vocab = Vocabulary([f"w{i}" for i in range(V)])
    save_artifact(tmp_path, "lds-test", "lds", t, vocab, config={"dim": h, "lags": 3})
    art = load_artifact(tmp_path / "lds-test")
    model = LDS.from_tensors(art.tensors, art.config)
    assert "embed" in model.operations and model.describe()["dim"] == h
    bad = dict(t)
    bad["sigma_pred"] = -torch.eye(h, dtype=torch.float64)
    with pytest.raises(ArtifactError, match="sigma_pred"):
        save_artifact(tmp_path, "bad", "lds", bad, vocab, config={"dim": h})
    bad = dict(t)
    bad["filter_trans"] = 2 * torch.eye(h, dtype=torch.float64)
    with pytest.raises(ArtifactError, match="filter_trans"):
        save_artifact(tmp_path, "bad", "lds", bad, vocab, config={"dim": h})
    bad = dict(t)
    bad["gain_table"] = t["gain_table"][:-1]
    with pytest.raises(ArtifactError, match="gain_table"):
        save_artifact(tmp_path, "bad", "lds", bad, vocab, config={"dim": h})


def test_matches_pykalman_smoother_mid_sequence():
    pykalman = pytest.importorskip("pykalman")
    V, h, T = 8, 3, 120
    t = random_lds(V, h, 4)
    model = LDS.from_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": h}, dtype=torch.float64)
    ids = np.random.default_rng(4).integers(0, V, T)
    w = (np.eye(V)[ids] - t["mu"]) / np.sqrt(t["mu"])
    D = np.eye(V) - t["noise_basis"] @ t["noise_lowrank"] @ t["noise_basis"].T
    kf = pykalman.KalmanFilter(transition_matrices=t["A"], observation_matrices=t["C"], transition_covariance=np.eye(h),
                               observation_covariance=D, initial_state_mean=np.zeros(h),
                               initial_state_covariance=np.eye(h))
    ref, _ = kf.smooth(w)
    ours = model.means(Batch.from_lists([ids.tolist()]))[0].numpy()
    np.testing.assert_allclose(ours[40:80], ref[40:80], atol=1e-8)


@pytest.mark.parametrize("h,rho,scale", [(4, 0.9, 1.0), (30, 0.999, 0.05), (80, 0.9999, 0.002)])
def test_steady_state_solves_the_riccati_equation(h, rho, scale):
    """The doubling solve meets both fixed-point equations to rounding, also near the unit circle with weak
    observations (where the plain iteration needs ~10^4 steps), and is the limit of the covariance recursion."""
    rng = np.random.default_rng(h)
    A = rng.standard_normal((h, h))
    A *= rho / np.abs(np.linalg.eigvals(A)).max()
    C = rng.standard_normal((h, h)) * scale
    info = C.T @ C
    S1, S0 = steady_state(A, info)
    np.testing.assert_allclose(S0, np.linalg.inv(np.linalg.inv(S1) + info), rtol=1e-8, atol=1e-10 * np.abs(S1).max())
    np.testing.assert_allclose(S1, A @ S0 @ A.T + np.eye(h), rtol=1e-8, atol=1e-10 * np.abs(S1).max())
    if h <= 30:  # the covariance recursion from Sigma_1 = I, run until it stops moving
        P = np.eye(h)
        for _ in range(200_000):
            new = A @ np.linalg.inv(np.linalg.inv(P) + info) @ A.T + np.eye(h)
            if np.abs(new - P).max() <= 1e-13 * np.abs(new).max():
                break
            P = new
        np.testing.assert_allclose(S1, new, rtol=1e-7)


def test_whitening_is_the_inverse_square_root_on_the_positive_part():
    """M^-1/2 for a positive definite M; for an indefinite one (ASOS moments can be), the negative and negligible
    directions are dropped instead of being blown up by a floored eigenvalue."""
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    pd = (Q * np.array([5.0, 2.0, 1.0, 0.5, 0.1, 0.01])) @ Q.T
    W = whitening(pd)
    np.testing.assert_allclose(W @ pd @ W, np.eye(6), atol=1e-10)
    indefinite = (Q * np.array([5.0, 2.0, 1.0, 1e-9, -0.3, -3.0])) @ Q.T
    W = whitening(indefinite)
    np.testing.assert_allclose(W @ Q[:, :3], Q[:, :3] / np.sqrt([5.0, 2.0, 1.0]), atol=1e-10)
    np.testing.assert_allclose(W @ Q[:, 3:], 0.0, atol=1e-10)
