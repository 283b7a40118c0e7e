"""Latent-variable distillation (LVD, Liu et al. 2023), the initialisation `latentlm distill --init lvd` uses:
cluster the LM's hidden states at every position of a subset of the samples into Z clusters by k-means, take each
token's cluster as its hidden state, count start / transition / emission events along the samples and apply the
M-step (`distill_em.m_step`, with its pseudocount).

k-means is written here in torch (Lloyd's algorithm after k-means++ seeding) rather than taken from scikit-learn:
it runs on the device the HMM trains on (a CUDA GPU when there is one: Ctrl-G clusters with faiss on GPU), needs
no new dependency, and its cost is one (M, d) x (d, k) GEMM per iteration, chunked over the M points."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.training.distill_em import PAD, Counts, Params, m_step

CHUNK_ENTRIES = 1 << 24  # distances computed for at most this many (point, centre) pairs at a time


def _sq_dist_min(x: Tensor, centres: Tensor) -> tuple[Tensor, Tensor]:
    """For each row of x (M, d): (squared distance to its nearest centre (M,), that centre's index (M,)).
    O(M k d), in chunks of CHUNK_ENTRIES pairs."""
    c2 = (centres * centres).sum(1)
    best = torch.empty(len(x), dtype=x.dtype, device=x.device)
    idx = torch.empty(len(x), dtype=torch.long, device=x.device)
    step = max(1, CHUNK_ENTRIES // max(len(centres), 1))
    for i in range(0, len(x), step):
        xc = x[i : i + step]
        d = (xc * xc).sum(1, keepdim=True) - 2 * (xc @ centres.T) + c2[None, :]
        best[i : i + step], idx[i : i + step] = d.min(1)
    return best.clamp_min_(0), idx


def kmeans_pp(x: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii 2007): each next centre drawn with probability proportional to its
    squared distance to the centres so far (uniformly when every point is already a centre). (k, d). O(M k d)."""
    M = len(x)
    centres = torch.empty(k, x.shape[1], dtype=x.dtype, device=x.device)
    first = int(torch.randint(M, (1,), generator=generator, device=generator.device))
    centres[0] = x[first]
    d2 = ((x - centres[0]) ** 2).sum(1)
    for j in range(1, k):
        total = d2.sum()
        weights = d2 if bool(total > 0) else torch.ones_like(d2)
        pick = int(torch.multinomial(weights.float(), 1, generator=generator))
        centres[j] = x[pick]
        d2 = torch.minimum(d2, ((x - centres[j]) ** 2).sum(1))
    return centres


def kmeans(x: Tensor, k: int, *, iters: int, generator: torch.Generator, seed_points: int | None = None
           ) -> tuple[Tensor, Tensor, list[float]]:
    """Lloyd's k-means of the rows of x (M, d) into k clusters: k-means++ seeding on at most `seed_points` points
    (default max(10 k, 10000)), then up to `iters` iterations (stopping when no point moves); a cluster left empty
    takes the point farthest from its centre. Returns (centres (k, d), assignment (M,) long, the mean squared
    distance after each iteration). O(iters M k d)."""
    M = len(x)
    pool = seed_points or max(10 * k, 10000)
    sub = x if M <= pool else x[torch.randperm(M, generator=generator, device=generator.device)[:pool]]
    centres = kmeans_pp(sub, k, generator)
    dist, assign = _sq_dist_min(x, centres)
    history = [float(dist.mean())]
    for _ in range(iters):
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        filled = counts > 0
        centres = torch.where(filled[:, None], sums / counts.clamp_min(1)[:, None].to(x.dtype), centres)
        empty = (~filled).nonzero().squeeze(1)
        reseeded = False
        if len(empty):  # reseed from the worst-served points, while some point lies off its centre
            far = dist.topk(min(len(empty), M))
            far_idx = far.indices[far.values > 0]
            centres[empty[: len(far_idx)]] = x[far_idx]
            reseeded = len(far_idx) > 0
        dist, new = _sq_dist_min(x, centres)
        history.append(float(dist.mean()))
        moved = bool((new != assign).any())
        assign = new
        if not moved and not reseeded:
            break
    return centres, assign, history


def lvd_counts(samples: np.ndarray, assign: Tensor, Z: int, V: int) -> Counts:
    """Counts read off cluster assignments: `samples` int32 (n, L), PAD after each end; `assign` (tokens,) the
    cluster of each token in `samples[samples != PAD]` order (row-major). start[z_0] += 1, trans[z_{t-1}, z_t] += 1,
    emit[x_t, z_t] += 1, on `assign`'s device. O(n L)."""
    device = assign.device
    s = torch.from_numpy(np.ascontiguousarray(samples)).to(device).long()
    mask = s != PAD
    z = torch.full(s.shape, -1, dtype=torch.long, device=device)
    z[mask] = assign
    c = Counts.zeros(Z, V, device)
    ones = torch.ones(len(assign), dtype=torch.float64, device=device)
    c.start.index_add_(0, z[:, 0][mask[:, 0]], ones[: int(mask[:, 0].sum())])
    pair = mask[:, 1:]
    flat = z[:, :-1][pair] * Z + z[:, 1:][pair]
    c.trans.view(-1).index_add_(0, flat, ones[: len(flat)])
    c.emit.index_put_((s[mask], z[mask]), ones, accumulate=True)
    c.tokens, c.sequences = int(mask.sum()), len(samples)
    return c


def lvd_params(samples: np.ndarray, vectors: Tensor, Z: int, V: int, *, pseudocount: float, iters: int,
               generator: torch.Generator) -> tuple[Params, dict]:
    """LVD: k-means of the hidden states `vectors` (tokens of `samples`, row-major) into Z clusters, counts off the
    assignments, M-step. Returns the parameters (float32, on the vectors' device) and what to record."""
    _, assign, history = kmeans(vectors, Z, iters=iters, generator=generator)
    c = lvd_counts(samples, assign, Z, V)
    used = int((torch.bincount(assign, minlength=Z) > 0).sum())
    info = {"tokens": c.tokens, "sequences": c.sequences, "kmeans_iterations": len(history) - 1,
            "kmeans_mean_sq_dist": history[-1], "clusters_used": used}
    return m_step(c, pseudocount), info
