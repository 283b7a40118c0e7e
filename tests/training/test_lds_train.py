"""LDS training: streaming lag statistics, subspace identification on a simulated LDS, ASOS EM
(monotone objective, agreement with running the smoother over the data), SPD covariances, a 50k-word
vocabulary without any V x V dense matrix, and `train()` end to end with `latentlm embed`."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import scipy.linalg as sl
import scipy.sparse as sp

from latentlm.models.lds import LDS, lowrank_noise_info, smoother_matrices, spd_inv, spd_power, steady_state
from latentlm.training.lds import LagStats, asos_em, collect_lag_stats, export, ssid, token_chunks


def simulate(T: int = 60_000, V: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian LDS with a rotation-and-decay A (eigenvalues 0.9 e^{+-0.3i}); returns (A, C, w (T, V))."""
    rng = np.random.default_rng(seed)
    th = 0.3
    A = 0.9 * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    C = rng.standard_normal((V, 2))
    eta = rng.standard_normal((T, 2))
    x = np.zeros((T, 2))
    for t in range(1, T):
        x[t] = A @ x[t - 1] + eta[t]
    w = x @ C.T + 0.7 * rng.standard_normal((T, V))
    return A, C, w - w.mean(0)


@pytest.fixture(scope="module")
def sim():
    A, C, w = simulate()
    T, V = w.shape
    Wh = spd_power(w.T @ w / T, -0.5)                     # dense whitening (small V): Psi_0 = I
    y = w @ Wh
    N = [np.eye(V)] + [y[k:].T @ y[:-k] / (T - k) for k in range(1, 6)]
    stats = LagStats(N=N, s=np.zeros(V), mu=np.full(V, 1.0 / V), num_tokens=T)
    return A, Wh @ C, y, stats


def test_ssid_recovers_simulated_lds(sim):
    A, C, _, stats = sim
    P = ssid(stats, 2)
    assert sl.subspace_angles(P.C, C).max() < 0.05
    np.testing.assert_allclose(np.sort_complex(np.linalg.eigvals(P.A)), np.sort_complex(np.linalg.eigvals(A)),
                               atol=0.03)


def test_em_monotone_and_matches_data(sim):
    A, C, y, stats = sim
    P0 = ssid(stats, 2)
    # start EM from a deliberately perturbed SSID so it has work to do
    P0.A = 0.7 * P0.A
    P, mom, trace = asos_em(stats, P0, 25)
    assert len(trace) > 3
    assert all(b >= a for a, b in zip(trace, trace[1:], strict=False))
    assert trace[-1] > trace[0] + 1e-3
    assert sl.subspace_angles(P.C, C).max() < 0.05
    # ASOS statistics equal those of running the steady-state smoother over the data itself
    R, info = lowrank_noise_info(P.C, P.U, P.Lam)
    S1, S0 = steady_state(P.A, info)
    K = S0 @ R.T @ spd_inv(np.eye(2) - P.Lam)
    F = P.A - K @ R @ P.A
    J, L, _ = smoother_matrices(P.A, S1, S0)
    yy = y @ P.U
    xf = np.zeros_like(yy)
    x = np.zeros(2)
    for t in range(len(yy)):
        x = F @ x + K @ yy[t]
        xf[t] = x
    xs = xf.copy()
    for t in range(len(yy) - 2, -1, -1):
        xs[t] = J @ xs[t + 1] + L @ xf[t]
    np.testing.assert_allclose(mom.M, xs.T @ xs / len(xs), rtol=2e-3)
    np.testing.assert_allclose(mom.Sxw, xs.T @ y / len(xs), atol=2e-3 * np.abs(mom.Sxw).max())


def hmm_text(V: int = 30, T: int = 40_000, seed: int = 0) -> list[list[int]]:
    """Sentences of word ids from a small random HMM (a stand-in for one-hot text)."""
    from latentlm.models.synthetic import random_hmm

    t, _ = random_hmm(4, V, seed=seed, concentration=0.3)
    g = np.random.default_rng(seed)
    trans, emit = t["trans"].numpy(), t["emit"].numpy()
    z, out, sent = 0, [], []
    for _ in range(T):
        z = g.choice(4, p=trans[z])
        sent.append(int(g.choice(V, p=emit[z])))
        if len(sent) == 20:
            out.append(sent)
            sent = []
    return out


def test_streaming_stats_equal_one_pass():
    seqs = hmm_text(T=4000)
    V = 30
    a = collect_lag_stats(token_chunks(seqs, chunk_tokens=97), V, 3, pseudocount=1.0)
    b = collect_lag_stats(token_chunks(seqs, chunk_tokens=10**9), V, 3, pseudocount=1.0)
    for na, nb in zip(a.N, b.N, strict=True):
        assert abs(na - nb).max() < 1e-12
    stream = np.concatenate([np.asarray(s) for s in seqs])
    pairs = np.zeros((V, V))
    np.add.at(pairs, (stream[2:], stream[:-2]), 1)
    dense = pairs / (len(stream) - 2) / np.sqrt(np.outer(a.mu, a.mu))
    np.testing.assert_allclose(a.N[2].toarray(), dense, atol=1e-12)


def test_one_hot_text_fit_spd_and_monotone():
    seqs = hmm_text()
    stats = collect_lag_stats(token_chunks(seqs), 30, 5, pseudocount=1.0)
    P0 = ssid(stats, 3)
    P, mom, trace = asos_em(stats, P0, 10)
    assert all(b >= a for a, b in zip(trace, trace[1:], strict=False))
    assert np.abs(stats.s @ P.C).max() < 1e-8                        # C stays orthogonal to the null direction
    for M in (mom.Sxx, mom.M):
        np.testing.assert_allclose(M, M.T, atol=1e-12)
        assert np.linalg.eigvalsh(M).min() > 0
    t = export(P, mom, stats.mu)
    assert all(np.isfinite(v).all() for v in t.values())
    import torch

    LDS.validate_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": 3}, 30, "test")


def test_50k_vocabulary_never_dense():
    V, T, h = 50_000, 60_000, 4
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, T) - 1, V - 1)
    tracemalloc.start()
    stats = collect_lag_stats([ids[: T // 2], ids[T // 2:]], V, 3, pseudocount=0.5)
    P0 = ssid(stats, h, p=2)
    P, mom, trace = asos_em(stats, P0, 2)
    t = export(P, mom, stats.mu)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(sp.issparse(n) for n in stats.N)
    assert peak < 400e6, f"peak {peak / 1e6:.0f} MB"                  # one dense V x V float64 is 20 GB
    assert t["gain_table"].shape == (V, h) and np.isfinite(t["gain_table"]).all()


def test_train_end_to_end_and_cli_embed(tmp_path, capsys):
    from latentlm.cli import main
    from latentlm.training.lds import train
    from latentlm.training.settings import resolve_settings
    from tests.training.helpers import train_args

    text = tmp_path / "corpus.txt"
    words = [f"w{i}" for i in range(30)]
    text.write_text("\n".join(" ".join(words[i] for i in s) for s in hmm_text(T=20_000)) + "\n")
    path = train(resolve_settings(train_args(tmp_path / "st", "lds", data=[str(text)], dim=3, lags=5, epochs=5,
                                             name="lds-e2e", max_vocab=100)))
    assert (path / "curve.png").is_file() and (tmp_path / "st" / "lds-e2e-ssid").is_dir()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["family"] == "lds" and manifest["config"]["dim"] == 3
    inp = tmp_path / "in.txt"
    inp.write_text("w1 w2 w3\nw4 w5\n")
    capsys.readouterr()
    assert main(["embed", str(inp), "--model", "lds-e2e", "--store", str(tmp_path / "st")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["embeddings"]) for r in rows] == [4, 3]                # <eos> appended
    assert rows[0]["dim"] == 3
    np.testing.assert_allclose(np.linalg.norm(rows[0]["embeddings"], axis=1), 1.0, atol=1e-5)
    assert main(["embed", str(inp), "--causal", "--model", "lds-e2e", "--store", str(tmp_path / "st")]) == 0
