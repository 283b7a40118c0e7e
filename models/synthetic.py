"""Random models of every HMM family, for tests, benchmarks and demos: (tensors, config) pairs in the
artifact schema. Rows are Dirichlet(concentration) draws."""

from __future__ import annotations

import torch
from torch import Tensor


def _dirichlet(shape: tuple[int, ...], g: torch.Generator, concentration: float = 1.0) -> Tensor:
    x = _gamma(shape, g, concentration)
    return x / x.sum(-1, keepdim=True)


def _gamma(shape: tuple[int, ...], g: torch.Generator, concentration: float) -> Tensor:
    """Seeded positive weights: exactly Gamma(1) = Exp(1) for concentration 1; for other values a
    power of Exp(1) (smaller concentration -> spikier rows), which is all tests and benchmarks need."""
    u = torch.rand(shape, generator=g, dtype=torch.float64).clamp_min(1e-300)
    e = -u.log()
    return e if concentration == 1.0 else e.pow(1.0 / concentration)


def random_hmm(Z: int, V: int, seed: int = 0, concentration: float = 1.0) -> tuple[dict[str, Tensor], dict]:
    g = torch.Generator().manual_seed(seed)
    t = {"start": _dirichlet((Z,), g, concentration), "trans": _dirichlet((Z, Z), g, concentration),
         "emit": _dirichlet((Z, V), g, concentration)}
    return t, {"num_states": Z}


def random_blocked_hmm(M: int, k: int, V: int, seed: int = 0, concentration: float = 1.0
                       ) -> tuple[dict[str, Tensor], dict]:
    """Words are assigned to clusters round-robin after a random permutation (every cluster non-empty)."""
    if V < M:
        raise ValueError("need at least one word per cluster")
    g = torch.Generator().manual_seed(seed)
    Z = M * k
    word_cluster = torch.empty(V, dtype=torch.long)
    word_cluster[torch.randperm(V, generator=g)] = torch.arange(V) % M
    emit = torch.empty(V, k, dtype=torch.float64)
    raw = _gamma((V, k), g, concentration)
    for c in range(M):
        idx = (word_cluster == c).nonzero().squeeze(1)
        emit[idx] = raw[idx] / raw[idx].sum(0, keepdim=True)
    t = {"start": _dirichlet((Z,), g, concentration), "trans": _dirichlet((Z, Z), g, concentration),
         "emit": emit, "word_cluster": word_cluster}
    return t, {"num_states": Z, "num_clusters": M, "states_per_cluster": k}


def random_rank_hmm(m: int, r: int, V: int, seed: int = 0, concentration: float = 1.0
                    ) -> tuple[dict[str, Tensor], dict]:
    g = torch.Generator().manual_seed(seed)
    start = _dirichlet((m,), g, concentration)
    state_in = _dirichlet((m, r), g, concentration)
    state_out = _dirichlet((r, m), g, concentration)
    emit = _dirichlet((r, V), g, concentration).T.contiguous()
    t = {"start": start, "state_in": state_in, "state_out": state_out, "emit": emit,
         "rank_start": start @ state_in, "rank_trans": state_out @ state_in}
    return t, {"num_states": m, "rank": r}


def rank_hmm_from_factors(start: Tensor, state_in: Tensor, state_out: Tensor, emit: Tensor
                          ) -> tuple[dict[str, Tensor], dict]:
    """Assemble a rank_hmm artifact from its factors (computes the cached rank-space matrices)."""
    t = {"start": start, "state_in": state_in, "state_out": state_out, "emit": emit,
         "rank_start": start @ state_in, "rank_trans": state_out @ state_in}
    return t, {"num_states": start.shape[0], "rank": state_in.shape[1]}
