"""`lds` — Gaussian linear dynamical system on whitened one-hot words (Belanger & Kakade 2015).

Model (whitened coordinates, h latent dims, V words, W = diag(mu)^-1/2):
    x_t = A x_{t-1} + eta,  eta ~ N(0, I)          (Q = I fixes the latent coordinate system)
    w_t = W (e_{word_t} - mu) = C x_t + eps,  eps ~ N(0, D)
D is never dense: D + s s^T = I - U Lam U^T with s = sqrt(mu) (the data's null direction, see §4) and U an
orthonormal basis of col(C) (V, h), so D^-1 and log det D cost O(V h^2) by Sherman-Woodbury-Morrison.

Artifact tensors (float): `A` (h,h), `C` (V,h), `mu` (V,) word frequencies (sums to 1), `noise_basis` U (V,h),
`noise_lowrank` Lam (h,h), `sigma_pred` Sigma_1 = P(x_t | w_<t) and `sigma_filt` Sigma_0 = P(x_t | w_<=t) and
`sigma_smooth` P(x_t | w) (h,h) steady-state covariances, `filter_trans` F = A - K C A (h,h), `gain_table`
(V,h) row i = K W (e_i - mu) (the only data-dependent term of the filter: a row lookup per token),
`smooth_J` J = Sigma_0 A^T Sigma_1^-1 and `smooth_L` I - J A (h,h), `embed_whiten` M^-1/2 (h,h) (on M's positive
part, `whitening`) where M is the training-set second moment of the smoothed means.
Config: `dim` (h), `lags`, `em_iterations`, optionally `objective` (ASOS log-likelihood per token).

Inference (steady state, eqs. 4-5): filtered x_t = F x_{t-1} + gain_table[w_t] with x_0 = 0; smoothed
xbar_T = x_T, xbar_t = J xbar_{t+1} + L x_t. O(T h^2) per sequence, exact in the middle of long sequences.
`embed` returns M^-1/2 xbar_t projected to the unit sphere (causal: the filtered means instead).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from latentlm.models.base import Batch
from latentlm.models.chain import valid_mask
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.cost import ENTRY_COST, OUTPUT_TOKEN_COST, Work
from latentlm.models.errors import ArtifactError
from latentlm.models.family import Family, Recipe
from latentlm.models.results import Embedding

SQUARE = ("A", "noise_lowrank", "sigma_pred", "sigma_filt", "sigma_smooth", "filter_trans", "smooth_J",
          "smooth_L", "embed_whiten")
SPD = ("sigma_pred", "sigma_filt", "sigma_smooth")


# -- steady-state Kalman algebra (numpy float64, h x h only) --------------------------------------------
def sym(X: np.ndarray) -> np.ndarray:
    """(X + X^T) / 2."""
    return (X + X.T) / 2


def spd(X: np.ndarray, jitter: float = 1e-10) -> np.ndarray:
    """Symmetrise and add a relative jitter so X stays positive definite. O(h^2)."""
    X = sym(X)
    return X + jitter * max(1.0, float(np.trace(X)) / len(X)) * np.eye(len(X))


def spd_inv(X: np.ndarray) -> np.ndarray:
    """Inverse of an SPD matrix via Cholesky, symmetrised. O(h^3)."""
    L = np.linalg.cholesky(spd(X, 0.0))
    Li = np.linalg.solve(L, np.eye(len(X)))
    return sym(Li.T @ Li)


def spd_power(X: np.ndarray, p: float, floor: float = 1e-12) -> np.ndarray:
    """X^p for symmetric PSD X via eigh (eigenvalues floored at floor * max). O(h^3)."""
    w, U = np.linalg.eigh(sym(X))
    w = np.maximum(w, floor * max(w.max(), floor))
    return sym((U * w**p) @ U.T)


def whitening(M: np.ndarray, rel_tol: float = 1e-6) -> np.ndarray:
    """M^-1/2 on M's positive part: directions whose eigenvalue is at most rel_tol * the largest (or
    negative: an ASOS moment can be indefinite) are dropped (0), not amplified. O(h^3)."""
    w, U = np.linalg.eigh(sym(M))
    keep = w > rel_tol * max(float(w.max()), 0.0)
    inv_sqrt = np.where(keep, 1.0 / np.sqrt(np.where(keep, w, 1.0)), 0.0)
    return sym((U * inv_sqrt) @ U.T)


def stein(A: np.ndarray, Q: np.ndarray, B: np.ndarray | None = None, iters: int = 64) -> np.ndarray:
    """Solve X = A X B^T + Q (B = A: discrete Lyapunov) by doubling. O(h^3 log(1/(1-rho)))."""
    B = A if B is None else B
    X, Ak, Bk = Q.copy(), A.copy(), B.copy()
    for _ in range(iters):
        inc = Ak @ X @ Bk.T
        X = X + inc
        if np.abs(inc).max() <= 1e-15 * max(1.0, np.abs(X).max()):
            break
        Ak, Bk = Ak @ Ak, Bk @ Bk
    return X


def steady_state(A: np.ndarray, info: np.ndarray, Q: np.ndarray | None = None, tol: float = 1e-13,
                 max_iter: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Solve the filtering Riccati equation for (Sigma_1, Sigma_0), the predicted and filtered steady-state
    covariances, given the observation information info = C^T D^-1 C (h,h):
    Sigma_1 = A (Sigma_1^-1 + info)^-1 A^T + Q = A Sigma_1 (I + info Sigma_1)^-1 A^T + Q, Sigma_0 = (Sigma_1^-1
    + info)^-1. Structure-preserving doubling (Chu, Fan & Lin 2005) on X = Ab^T X (I + G X)^-1 Ab + H with
    Ab = A^T, G = info, H = Q: each step squares the horizon covered, so it converges quadratically (about
    10 steps at spectral radius 0.999, where the plain fixed-point iteration needs ~10^4). O(h^3) per step."""
    h = A.shape[0]
    eye = np.eye(h)
    Ak, G, H = A.T.copy(), sym(info), sym(np.eye(h) if Q is None else Q)
    for _ in range(max_iter):
        W = np.linalg.solve(eye + G @ H, np.hstack([Ak, G]))  # (I + G_k H_k)^-1 [A_k, G_k]
        WA, WG = W[:, :h], W[:, h:]
        new = sym(H + Ak.T @ H @ WA)
        G = sym(G + Ak @ WG @ Ak.T)
        Ak = Ak @ WA
        done = np.abs(new - H).max() <= tol * max(1.0, np.abs(new).max())
        H = new
        if done:
            break
    S1 = spd(H, 0.0)
    return S1, spd_inv(spd_inv(S1) + sym(info))


def smoother_matrices(A: np.ndarray, S1: np.ndarray, S0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steady-state RTS smoother: J = Sigma_0 A^T Sigma_1^-1, L = I - J A, and the smoothed covariance P
    solving P = Sigma_0 + J (P - Sigma_1) J^T. O(h^3)."""
    J = S0 @ A.T @ spd_inv(S1)
    L = np.eye(len(A)) - J @ A
    P = stein(J, S0 - J @ S1 @ J.T)
    return J, L, spd(P, 0.0)


def lowrank_noise_info(C: np.ndarray, U: np.ndarray, Lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For D~ = I - U Lam U^T (U orthonormal (V,h), C in col(U)): R = U^T C and the information
    C^T D~^-1 C = R^T (I - Lam)^-1 R. Returns (R, info). O(V h^2)."""
    R = U.T @ C
    Ny_inv = spd_inv(np.eye(len(Lam)) - Lam)
    return R, sym(R.T @ Ny_inv @ R)


def kalman_tensors(A: np.ndarray, C: np.ndarray, U: np.ndarray, Lam: np.ndarray, mu: np.ndarray,
                   embed_moment: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Every exported matrix of the `lds` artifact from (A, C, U, Lam, mu). O(V h^2 + h^3 log horizon).

    The gain K = Sigma_0 C^T D~^-1 = Sigma_0 R^T (I - Lam)^-1 U^T only ever meets whitened one-hot vectors
    through U^T w, so `gain_table` row i = K U^T W (e_i - mu) is built from U's rows (nothing V x V)."""
    R, info = lowrank_noise_info(C, U, Lam)
    S1, S0 = steady_state(A, info)
    K_y = S0 @ R.T @ spd_inv(np.eye(len(Lam)) - Lam)            # gain on y = U^T w, (h, h)
    F = A - K_y @ R @ A
    J, L, P = smoother_matrices(A, S1, S0)
    sq = np.sqrt(mu)
    Uw = U / sq[:, None] - (sq @ U)[None, :]                      # (V, h): row i = U^T W (e_i - mu)
    gain = Uw @ K_y.T
    M = embed_moment if embed_moment is not None else np.eye(len(A))
    return {"A": A, "C": C, "mu": mu, "noise_basis": U, "noise_lowrank": sym(Lam), "sigma_pred": S1,
            "sigma_filt": S0, "sigma_smooth": P, "filter_trans": F, "gain_table": gain, "smooth_J": J,
            "smooth_L": L, "embed_whiten": whitening(M)}


# -- inference (torch, batched) -------------------------------------------------------------------------
def filter_smooth(F: Tensor, gains: Tensor, J: Tensor, L: Tensor, lengths: Tensor,
                  smooth: bool = True) -> Tensor:
    """Steady-state Kalman filter (and RTS smoother): gains (B, T, h) = gain_table[ids] -> means (B, T, h).

    Filtered x_t = F x_{t-1} + g_t (x_0 = 0); smoothed xbar_{len-1} = x_{len-1}, xbar_t = J xbar_{t+1} + L x_t.
    Padding positions (t >= length) never influence real ones. O(B T h^2)."""
    B, T, h = gains.shape
    filt = gains.new_empty(B, T, h)
    x = gains[:, 0]
    filt[:, 0] = x
    for t in range(1, T):
        x = torch.addmm(gains[:, t], x, F.T)
        filt[:, t] = x
    if not smooth:
        return filt
    # xbar_t = keep_t * (J xbar_{t+1}) + c_t with keep_t = [t < len-1], c_t = L x_t (or x_t at the last
    # position): the restart at each sequence's end is precomputed, so each step is one GEMM + one FMA.
    keep = (torch.arange(T, device=lengths.device)[None, :] < (lengths - 1)[:, None]).to(filt.dtype).unsqueeze(-1)
    c = torch.where(keep.bool(), filt @ L.T, filt)
    out = torch.empty_like(filt)
    xb = c[:, T - 1]
    out[:, T - 1] = xb
    for t in range(T - 2, -1, -1):
        xb = torch.addcmul(c[:, t], keep[:, t], xb @ J.T)
        out[:, t] = xb
    return out


class LDS(Family):
    family = "lds"
    recipes = (Recipe("lds", {"dim": 50, "lags": 7, "epochs": 20}, positive=("dim", "lags"), shape=("dim", "lags"),
                      corpora=("ptb", "brown"), needs=("scipy", "matplotlib"), trainer="latentlm.training.lds"),)
    operations = frozenset({"embed"})
    decode_methods = frozenset()

    def __init__(self, tensors: dict[str, Tensor], config: dict[str, Any]):
        self.t = tensors
        self.config = config
        self.F, self.gain_table = tensors["filter_trans"], tensors["gain_table"]
        self.J, self.L, self.whiten = tensors["smooth_J"], tensors["smooth_L"], tensors["embed_whiten"]
        self.device, self.dtype = self.F.device, self.F.dtype

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        h = tensors["A"].shape[0] if "A" in tensors and tensors["A"].dim() == 2 else config.get("dim", 0)
        if config.get("dim", h) != h:
            raise ArtifactError(f"{where}: config dim={config['dim']!r} does not match the tensors ({h})",
                                param="dim")
        for k in SQUARE:
            check_shape(tensors, k, (h, h), where)
        for k in ("C", "noise_basis", "gain_table"):
            check_shape(tensors, k, (vocab_size, h), where)
        check_distribution(check_shape(tensors, "mu", (vocab_size,), where), "mu", 0, where)
        for k, t in tensors.items():
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ArtifactError(f"{where}: tensor {k!r} must be finite floating point", param=k)
        for k in SPD:
            S = tensors[k].double()
            if float((S - S.T).abs().max()) > 1e-6 * max(1.0, float(S.abs().max())):
                raise ArtifactError(f"{where}: tensor {k!r} is not symmetric", param=k)
            if float(torch.linalg.eigvalsh(S).min()) <= 0:
                raise ArtifactError(f"{where}: tensor {k!r} is not positive definite", param=k)
        for k in ("filter_trans", "smooth_J"):
            rho = float(torch.linalg.eigvals(tensors[k].double()).abs().max()) if h else 0.0
            if rho >= 1:
                raise ArtifactError(f"{where}: tensor {k!r} has spectral radius {rho:.4g} >= 1 (unstable)", param=k)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> LDS:
        return cls({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, config)

    @property
    def num_states(self) -> int:
        return self.F.shape[0]

    def describe(self) -> dict[str, Any]:
        return {"dim": self.num_states, "lags": self.config.get("lags"),
                "em_iterations": self.config.get("em_iterations")}

    def cost(self, work: Work) -> int:
        """Kalman smoothing: per token d^2 x lags, plus the d values listed."""
        d = self.num_states
        lags = int(self.config.get("lags") or 1)
        return int(work.tokens * (d * d * lags + OUTPUT_TOKEN_COST + ENTRY_COST * d))

    def means(self, batch: Batch, causal: bool = False) -> Tensor:
        """Filtered (causal) or smoothed posterior means (B, T, h), zeros at padding. O(B T h^2)."""
        ids, lengths = batch.ids.to(self.device), batch.lengths.to(self.device)
        m = filter_smooth(self.F, self.gain_table[ids], self.J, self.L, lengths, smooth=not causal)
        return m * valid_mask(lengths, ids.shape[1]).unsqueeze(-1)

    def embed(self, batch: Batch, causal: bool = False) -> Tensor:
        """Token embeddings (B, T, h): M^-1/2 xbar_t on the unit sphere (zeros at padding)."""
        z = self.means(batch, causal) @ self.whiten.T
        return z / z.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)

    def op_embed(self, seqs: list[list[int]], *, causal: bool = False) -> list[Embedding]:
        e = self.embed(Batch.from_lists(seqs, self.device), causal).double().cpu()
        return [Embedding(e[i, : len(s)].tolist(), self.num_states) for i, s in enumerate(seqs)]
