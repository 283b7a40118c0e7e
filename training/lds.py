"""Fit the `lds` family (Belanger & Kakade 2015, Algorithm 1): one streaming pass for sparse lag
covariances, subspace identification (randomized SVD of the block Hankel matrix through its
sparse-minus-low-rank structure), then EM with approximate second-order statistics (ASOS) that never
touches the data again. Nothing V x V is ever dense: memory is O(nnz + V h) and one EM iteration costs
O(r nnz h + V h^2 + H^2 h^3) (H = impulse-response horizon, <= `MAX_HORIZON`).

Conventions (whitened, §4.3): mu = smoothed word frequencies, s = sqrt(mu), w_t = diag(mu)^-1/2 (e_t - mu),
Psi_k = E[w_{t+k} w_t^T] = N_k - s s^T with N_k sparse (lag-k pair counts / (T_k sqrt(mu_i mu_j))), and
Psi_0 = I - s s^T. Dense numpy N_k (s = 0) are accepted too, for simulated data already whitened.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

from latentlm.models.lds import (
    kalman_tensors,
    lowrank_noise_info,
    smoother_matrices,
    spd,
    spd_inv,
    spd_power,
    steady_state,
    stein,
    sym,
)
from latentlm.training.recipes import trainer

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

MAX_HORIZON = 40
LAM_CEIL = 1 - 1e-3  # eigenvalues of the explained-variance part of D~: keeps D SPD (App. A.1's fix)


# -- streaming lag covariances ------------------------------------------------------------------------
@dataclass
class LagStats:
    """Whitened lag covariances Psi_k = N[k] - s s^T (k = 0..r) of a stationary stream, never dense V x V."""

    N: list            # N[k]: scipy.sparse CSR (V, V) or dense ndarray
    s: np.ndarray      # (V,) sqrt(mu) (unit norm) or zeros
    mu: np.ndarray     # (V,) word frequencies used for whitening
    num_tokens: int
    NT: list = field(default_factory=list)  # transposes, cached as CSR

    def __post_init__(self) -> None:
        self.NT = [n.T.tocsr() if sp.issparse(n) else n.T for n in self.N]

    @property
    def V(self) -> int:
        return len(self.s)

    @property
    def lags(self) -> int:
        return len(self.N) - 1

    def apply(self, k: int, X: np.ndarray) -> np.ndarray:
        """Psi_k X for lag k in [-r, r] (Psi_-k = Psi_k^T); X (V, m) -> (V, m). O(nnz m + V m)."""
        n = self.N[k] if k >= 0 else self.NT[-k]
        return np.asarray(n @ X) - np.outer(self.s, self.s @ X)

    def apply_T(self, k: int, X: np.ndarray) -> np.ndarray:
        """Psi_k^T X = Psi_-k X."""
        return self.apply(-k, X)

    def trace0(self) -> float:
        return float(self.V - self.s @ self.s)


def collect_lag_stats(chunks: Iterable[np.ndarray], V: int, lags: int, pseudocount: float = 0.0,
                      progress: Callable[[int], None] | None = None) -> LagStats:
    """One streaming pass over token-id chunks (pieces of one running text) -> whitened `LagStats`.

    Each chunk is counted with the previous chunk's last `lags` tokens prepended, so pairs across chunk
    boundaries count exactly once and the corpus never sits in memory. O(tokens * lags) time, O(nnz) memory."""
    counts = [sp.csr_matrix((V, V), dtype=np.float64) for _ in range(lags + 1)]
    unigram = np.zeros(V, dtype=np.float64)
    pairs = np.zeros(lags + 1, dtype=np.float64)
    tail = np.zeros(0, dtype=np.int64)
    total = 0
    for chunk in chunks:
        chunk = np.asarray(chunk, dtype=np.int64)
        if chunk.size == 0:
            continue
        if chunk.min() < 0 or chunk.max() >= V:
            raise ValueError(f"token id outside [0, {V})")
        unigram += np.bincount(chunk, minlength=V)
        total += chunk.size
        buf = np.concatenate([tail, chunk])
        start = len(tail)
        for k in range(1, lags + 1):
            lo = max(0, start - k)          # earlier index i; later index i + k must be >= start
            later, earlier = buf[lo + k:], buf[lo: len(buf) - k]
            if later.size:
                counts[k] = counts[k] + sp.coo_matrix((np.ones(later.size), (later, earlier)),
                                                      shape=(V, V)).tocsr()
                pairs[k] += later.size
        tail = buf[-lags:] if lags else tail
        if progress is not None:
            progress(chunk.size)
    if total == 0:
        raise ValueError("no tokens")
    mu = (unigram + pseudocount) / (total + pseudocount * V)
    if (mu <= 0).any():
        raise ValueError("every word needs a positive frequency: use a pseudocount or drop unused words")
    inv = sp.diags(1.0 / np.sqrt(mu))
    N = [sp.identity(V, format="csr", dtype=np.float64)]
    for k in range(1, lags + 1):
        N.append((inv @ counts[k] @ inv).tocsr() / max(pairs[k], 1.0))
    return LagStats(N=N, s=np.sqrt(mu), mu=mu, num_tokens=total)


def token_chunks(seqs: Iterable[list[int]], chunk_tokens: int = 1 << 20) -> Iterable[np.ndarray]:
    """Concatenate sentences (with their `<eos>`) into running-text chunks of about `chunk_tokens`."""
    buf: list[int] = []
    for s in seqs:
        buf.extend(s)
        if len(buf) >= chunk_tokens:
            yield np.asarray(buf, dtype=np.int64)
            buf = []
    if buf:
        yield np.asarray(buf, dtype=np.int64)


# -- subspace identification --------------------------------------------------------------------------
def hankel_ops(stats: LagStats, p: int) -> tuple[Callable, Callable]:
    """Products with the block Hankel matrix H (pV x pV), block (i, j) = Psi_{i+j+1}, and with H^T, each
    as sums of sparse products minus rank-one terms. O(p^2 nnz m) per product with m columns."""
    V = stats.V

    def mul(X: np.ndarray) -> np.ndarray:
        Xs = [X[j * V:(j + 1) * V] for j in range(p)]
        return np.vstack([sum(stats.apply(i + j + 1, Xs[j]) for j in range(p)) for i in range(p)])

    def mul_T(Y: np.ndarray) -> np.ndarray:
        Ys = [Y[i * V:(i + 1) * V] for i in range(p)]
        return np.vstack([sum(stats.apply_T(i + j + 1, Ys[i]) for i in range(p)) for j in range(p)])

    return mul, mul_T


def randomized_svd(mul: Callable, mul_T: Callable, n: int, rank: int, oversample: int = 10, power_iters: int = 3,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Halko et al. (2011) rank-`rank` SVD of an n x n operator given only products. Returns U (n, k),
    S (k,), Vt (k, n). O((power_iters + 2) product cost + n k^2)."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(mul(rng.standard_normal((n, rank + oversample))))
    for _ in range(power_iters):
        Z, _ = np.linalg.qr(mul_T(Q))
        Q, _ = np.linalg.qr(mul(Z))
    B = mul_T(Q).T                                   # Q^T H, (k, n)
    Ub, S, Vt = np.linalg.svd(B, full_matrices=False)
    return Q @ Ub[:, :rank], S[:rank], Vt[:rank]


def stabilise(A: np.ndarray, rho_max: float = 0.999) -> np.ndarray:
    """Scale A so its spectral radius is at most rho_max."""
    rho = float(np.abs(np.linalg.eigvals(A)).max()) if A.size else 0.0
    return A * (rho_max / rho) if rho > rho_max else A


def noise_from_moment(C: np.ndarray, moment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """D~ = I - C moment C^T kept implicit: (U orthonormal basis of col C, Lam = U^T C moment C^T U clipped
    to eigenvalues in [0, LAM_CEIL] so D stays SPD). O(V h^2)."""
    U, Rc = np.linalg.qr(C)
    w, E = np.linalg.eigh(sym(Rc @ moment @ Rc.T))
    return U, sym((E * np.clip(w, 0.0, LAM_CEIL)) @ E.T)


def random_lds_tensors(V: int, h: int, seed: int = 0, emission_scale: float = 0.4) -> dict[str, np.ndarray]:
    """A random stable LDS in the artifact's whitened parameterisation (C orthogonal to sqrt(mu)), for
    tests and benchmarks: the `lds` artifact's tensors (see `models.lds.kalman_tensors`)."""
    rng = np.random.default_rng(seed)
    mu = rng.dirichlet(np.ones(V))
    s = np.sqrt(mu)
    A = stabilise(rng.standard_normal((h, h)) / np.sqrt(h), 0.9)
    C = rng.standard_normal((V, h)) * emission_scale
    C -= np.outer(s, s @ C)
    U, Lam = noise_from_moment(C, np.eye(h) * 0.5)
    return kalman_tensors(A, C, U, Lam, mu)


def to_unit_Q(A: np.ndarray, C: np.ndarray, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Change latent coordinates so the state noise is I: x' = Q^-1/2 x (likelihood unchanged)."""
    T, Ti = spd_power(Q, 0.5), spd_power(Q, -0.5)
    return Ti @ A @ T, C @ T


@dataclass
class Params:
    """LDS parameters in whitened coordinates with Q = I: A (h,h), C (V,h), D~ = I - U Lam U^T."""

    A: np.ndarray
    C: np.ndarray
    U: np.ndarray
    Lam: np.ndarray


def ssid(stats: LagStats, h: int, p: int | None = None, seed: int = 0, power_iters: int = 8) -> Params:
    """n4sid-style subspace identification (§3.4): H_p = Gamma Delta, Gamma = [C; CA; ...], Delta = [G, AG, ...]
    with G = E[x_{t+1} w_t^T] = A Pi C^T. A from the shift structure of Gamma, C its first block, Pi from G,
    Q = Pi - A Pi A^T (clipped SPD), then coordinates with Q = I and D = Psi_0 - C Pi C^T (clipped PSD).
    `power_iters` of the randomized SVD: with 3, the trailing singular directions at h = 200 on PTB were
    inaccurate enough that the ASOS moments of the SSID model came out indefinite and EM could not take a
    step (probe accuracy 26%); with 8 they are PSD and EM climbs."""
    p = p if p is not None else (stats.lags + 1) // 2
    if p < 2 or 2 * p - 1 > stats.lags:
        raise ValueError(f"SSID needs 2 <= p and 2p-1 <= lags (p={p}, lags={stats.lags})")
    V = stats.V
    mul, mul_T = hankel_ops(stats, p)
    U, S, Vt = randomized_svd(mul, mul_T, p * V, h, power_iters=power_iters, seed=seed)
    Gam = U * np.sqrt(S)
    Delta = np.sqrt(S)[:, None] * Vt
    C = Gam[:V]
    A = stabilise(np.linalg.lstsq(Gam[:-V], Gam[V:], rcond=None)[0])
    G = Delta[:, :V]
    APi = G @ C @ spd_inv(spd(C.T @ C))
    Pi = spd_power(sym(np.linalg.lstsq(A, APi, rcond=None)[0]), 1.0, floor=1e-6)
    Q = spd_power(Pi - A @ Pi @ A.T, 1.0, floor=1e-3)
    A, C = to_unit_Q(A, C, Q)
    A = stabilise(A)
    C = C - np.outer(stats.s, stats.s @ C)
    Pi = stein(A, np.eye(h))
    Uc, Lam = noise_from_moment(C, Pi)
    return Params(A, C, Uc, Lam)


# -- ASOS E-step -----------------------------------------------------------------------------------------
@dataclass
class Moments:
    """Time-averaged steady-state statistics (per token) the M-step and the embeddings need."""

    Sxx: np.ndarray      # E[x_t x_t^T | all]  (smoothed means' 2nd moment + P)
    Sx1x: np.ndarray     # E[x_{t+1} x_t^T | all]
    Sxw: np.ndarray      # E[xbar_t w_t^T] (h, V)
    M: np.ndarray        # E[xbar_t xbar_t^T] (embedding whitening)
    objective: float     # ASOS log-likelihood per token (up to a constant)


def _powers(X: np.ndarray, n: int) -> np.ndarray:
    out = np.empty((n + 1, *X.shape))
    out[0] = np.eye(len(X))
    for i in range(1, n + 1):
        out[i] = X @ out[i - 1]
    return out


def horizon(F: np.ndarray, J: np.ndarray, tol: float = 1e-7) -> int:
    """Impulse-response length after which F^j and J^i fall below tol (capped at MAX_HORIZON)."""
    X, Y = np.eye(len(F)), np.eye(len(J))
    for H in range(1, MAX_HORIZON + 1):
        X, Y = F @ X, J @ Y
        if max(np.abs(X).max(), np.abs(Y).max()) < tol:
            return H
    return MAX_HORIZON


class YCov:
    """Lag covariances of y_t = U^T w_t: empirical for |k| <= r, implied by the model beyond (ASOS)."""

    def __init__(self, stats: LagStats, U: np.ndarray, R: np.ndarray, A: np.ndarray, Pi: np.ndarray, kmax: int):
        self.r = stats.lags
        self.PU = [stats.apply(k, U) for k in range(self.r + 1)]      # Psi_k U   (V, h)
        self.PTU = [stats.apply_T(k, U) for k in range(self.r + 1)]   # Psi_k^T U (V, h)
        emp = [U.T @ self.PU[k] for k in range(self.r + 1)]
        Ak = _powers(A, max(kmax, self.r) + 1)
        self.Ak, self.R, self.Pi = Ak, R, Pi
        self.G = {k: (emp[k] if k <= self.r else R @ Ak[k] @ Pi @ R.T) for k in range(kmax + 1)}
        self.G[0] = sym(self.G[0])

    def __call__(self, k: int) -> np.ndarray:
        """E[y_{t+k} y_t^T]."""
        return self.G[k] if k >= 0 else self.G[-k].T


def quad(a: np.ndarray, a0: int, b: np.ndarray, b0: int, gam: YCov) -> np.ndarray:
    """sum_{m,n} a_m E[y_{t+m} y_{t+n}^T] b_n^T for filters a (Na,h,h) at offsets a0.., b (Nb,h,h) at b0..
    One GEMM per lag: O((Na + Nb) max(Na, Nb) h^3)."""
    Na, Nb, h = len(a), len(b), a.shape[1]
    out = np.zeros((h, b.shape[1]))
    for k in range(a0 - (b0 + Nb - 1), a0 + Na - 1 - b0 + 1):
        n_lo, n_hi = max(b0, a0 - k), min(b0 + Nb - 1, a0 + Na - 1 - k)
        if n_lo > n_hi:
            continue
        A_ = a[n_lo + k - a0: n_hi + k - a0 + 1] @ gam(k)                 # (n, h, h)
        B_ = b[n_lo - b0: n_hi - b0 + 1]
        out += A_.transpose(1, 0, 2).reshape(h, -1) @ B_.transpose(0, 2, 1).reshape(-1, B_.shape[1])
    return out


def e_step(stats: LagStats, P: Params) -> Moments:
    """ASOS E-step: steady-state smoother written as a two-sided filter xbar_t = sum_m B_m y_{t+m}, applied to
    the time-averaged lag covariances instead of the data. Also the ASOS objective (innovation form):
    -1/2 [log det S + tr(S^-1 E[e e^T]) + E|w_perp|^2 + V log 2 pi] per token."""
    A, C, U, Lam = P.A, P.C, P.U, P.Lam
    h = len(A)
    R, info = lowrank_noise_info(C, U, Lam)
    S1, S0 = steady_state(A, info)
    Ny = np.eye(h) - Lam
    K = S0 @ R.T @ spd_inv(Ny)
    F = A - K @ R @ A
    J, L, Psm = smoother_matrices(A, S1, S0)
    H = horizon(F, J)
    Pi = stein(A, np.eye(h))
    gam = YCov(stats, U, R, A, Pi, kmax=4 * H + 4)
    f = _powers(F, H) @ K                                  # filtered impulse f_j = F^j K, j = 0..H
    JL = _powers(J, H) @ L                                 # J^i L
    B = np.zeros((2 * H + 1, h, h))                        # B_m, m = -H..H
    for j in range(H + 1):
        i = np.arange(H + 1)
        np.add.at(B, i - j + H, JL @ f[j])
    M = quad(B, -H, B, -H, gam)
    # ASOS mixes empirical lag covariances (lags <= r) with the model's (beyond), so these moments can be
    # indefinite (seen at h = 200 on PTB); Sxx is projected onto the PSD cone with a small eigenvalue floor
    Sxx = spd_power(M + Psm, 1.0, floor=1e-8)
    Sx1x = quad(B, -H + 1, B, -H, gam) + Psm @ J.T
    # E[xbar_t w_t^T] = sum_m B_m E[y_{t+m} w_t^T]
    Sxw = np.zeros((h, stats.V))
    tail = np.zeros((h, h))
    for idx, m in enumerate(range(-H, H + 1)):
        if abs(m) <= stats.lags:
            Sxw += B[idx] @ (gam.PTU[m].T if m >= 0 else gam.PU[-m].T)
        elif m > 0:
            tail += B[idx] @ R @ gam.Ak[m] @ Pi
        else:
            tail += B[idx] @ R @ Pi @ gam.Ak[-m].T
    Sxw += tail @ C.T
    # objective: innovations e_t = y_t - R xhat_{t|t-1}, xhat_{t|t-1} = sum_{j>=0} A f_j y_{t-1-j}
    p = (A @ f)[::-1]                                      # offsets -(H+1) .. -1
    X = quad(p, -(H + 1), np.eye(h)[None], 0, gam)        # E[xhat_{t|t-1} y_t^T]
    Spp = quad(p, -(H + 1), p, -(H + 1), gam)
    Eee = sym(gam(0) - R @ X - X.T @ R.T + R @ Spp @ R.T)
    S = spd(R @ S1 @ R.T + Ny, 0.0)
    _, logdet = np.linalg.slogdet(S)
    perp = stats.trace0() - float(np.trace(gam(0)))
    obj = -0.5 * (logdet + float(np.trace(spd_inv(S) @ Eee)) + perp + stats.V * math.log(2 * math.pi))
    return Moments(Sxx=Sxx, Sx1x=Sx1x, Sxw=Sxw, M=spd(M, 0.0), objective=obj)


def m_step(stats: LagStats, mom: Moments) -> Params:
    """Closed-form M-step (least squares for A and C, Q and D from residual moments), then back to
    coordinates with Q = I. D~ = I - C Sxx C^T stays implicit in (U, Lam). O(V h^2)."""
    Sxx_inv = spd_inv(mom.Sxx)
    A = mom.Sx1x @ Sxx_inv
    Q = spd_power(mom.Sxx - A @ mom.Sx1x.T, 1.0, floor=1e-8)
    C = mom.Sxw.T @ Sxx_inv
    C = C - np.outer(stats.s, stats.s @ C)
    U, Lam = noise_from_moment(C, mom.Sxx)
    A, C = to_unit_Q(A, C, Q)
    return Params(stabilise(A), C, U, Lam)


def asos_em(stats: LagStats, P: Params, iters: int, on_iter: Callable[[int, float], None] | None = None
            ) -> tuple[Params, Moments, list[float]]:
    """EM with ASOS from `P`. A step that would lower the ASOS objective is rejected and EM stops, so the
    returned objective trace never decreases. Returns (params, moments at params, objectives)."""
    mom = e_step(stats, P)
    trace = [mom.objective]
    for it in range(iters):
        cand = m_step(stats, mom)
        cmom = e_step(stats, cand)
        if not math.isfinite(cmom.objective) or cmom.objective < mom.objective:
            break
        gain = cmom.objective - mom.objective
        P, mom = cand, cmom
        trace.append(mom.objective)
        if on_iter is not None:
            on_iter(it + 1, mom.objective)
        if gain <= 1e-9 * max(1.0, abs(mom.objective)):
            break
    return P, mom, trace


def export(P: Params, mom: Moments, mu: np.ndarray) -> dict[str, np.ndarray]:
    """Artifact tensors (see models.lds) from fitted parameters and their ASOS moments."""
    return kalman_tensors(P.A, P.C, P.U, P.Lam, mu, embed_moment=mom.M)


# -- command line entry -----------------------------------------------------------------------------
def corpus(spec: list[str], max_vocab: int, lowercase: bool):
    """(vocab, training sentences as ids) for `ptb`, `brown` or text files."""
    from latentlm.training import data

    if spec == ["ptb"]:
        vocab = data.ptb_vocab()
        return vocab, data.encode_corpus(data.ptb_sentences("train"), vocab)
    if spec == ["brown"]:
        from latentlm.training.brown_corpus import brown_split

        sents = [[w.lower() if lowercase else w for w, _ in s] for s in brown_split("train")]
    else:
        sents = data.read_text_files(spec, lowercase=lowercase)
    from latentlm.models.vocab import Preprocessing

    pre = Preprocessing(lowercase=lowercase, unk="<unk>", eos="<eos>", add_eos=True)
    vocab = data.build_vocab(sents, max_size=max_vocab, preprocessing=pre)
    return vocab, data.encode_corpus(sents, vocab)


def fit(seqs: list[list[int]], V: int, dim: int, lags: int, em_iters: int, seed: int = 0,
        pseudocount: float = 1.0, progress: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """Stats -> SSID -> ASOS EM -> exported tensors, with a tqdm bar per stage. Returns (tensors, report)."""
    from tqdm.auto import tqdm

    t0 = time.time()
    total = sum(len(s) for s in seqs)
    with tqdm(total=total, desc="lag covariances", unit="tok", unit_scale=True, disable=not progress) as bar:
        stats = collect_lag_stats(token_chunks(seqs), V, lags, pseudocount=pseudocount, progress=bar.update)
    t1 = time.time()
    P0 = ssid(stats, dim, seed=seed)
    t2 = time.time()
    with tqdm(total=em_iters, desc="ASOS EM", disable=not progress) as bar:
        def on_iter(i: int, obj: float) -> None:
            bar.update(1)
            bar.set_postfix(objective=f"{obj:.4f}")

        P, mom, trace = asos_em(stats, P0, em_iters, on_iter)
    ssid_mom = e_step(stats, P0)
    report = {"objective_trace": trace, "tokens": total, "nnz": [int(sp.csr_matrix(n).nnz) for n in stats.N[1:]],
              "seconds": {"stats": t1 - t0, "ssid": t2 - t1, "em": time.time() - t2},
              "em_iterations": len(trace) - 1}
    return {"ssid": export(P0, ssid_mom, stats.mu), "em": export(P, mom, stats.mu)}, report


def curve_png(trace: list[float]) -> bytes:
    """ASOS objective per EM iteration (iteration 0 = SSID)."""
    from latentlm.training.common import series_png

    return series_png(trace, xlabel="EM iteration (0 = SSID)", ylabel="ASOS log-likelihood / token",
                      title="lds: ASOS EM")


@trainer("lds")
def train(args: TrainSettings) -> Path:
    """`latentlm train --family lds`: writes `<name>` (SSID + EM) and `<name>-ssid` artifacts; returns the first."""
    import torch

    from latentlm.models.registry import save_artifact

    torch.set_num_threads(1)
    dim, lags, em_iters, seed = args.dim, args.lags, args.epochs, args.seed  # the recipe's defaults (`LDS.recipes`)
    data = list(args.data)
    vocab, seqs = corpus(data, args.max_vocab, args.lowercase)
    if args.train_sentences:
        seqs = seqs[: args.train_sentences]
    tensors, report = fit(seqs, len(vocab), dim, lags, em_iters, seed=seed, progress=args.progress)
    config = {"dim": dim, "lags": lags, "em_iterations": report["em_iterations"],
              "objective": report["objective_trace"][-1]}
    prov = {"trainer": "training.lds", "data": data, "seed": seed, **{k: report[k] for k in ("tokens", "seconds")},
            "objective_trace": report["objective_trace"]}
    png = {"curve.png": curve_png(report["objective_trace"])}
    save_artifact(args.store, f"{args.name}-ssid"[:128], "lds",
                  {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors["ssid"].items()}, vocab,
                  config={**config, "em_iterations": 0, "objective": report["objective_trace"][0]},
                  provenance={**prov, "stage": "ssid"})
    return save_artifact(args.store, args.name, "lds",
                         {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors["em"].items()}, vocab,
                         config=config, provenance={**prov, "stage": "ssid+em"}, extra_files=png)
