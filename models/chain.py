"""The chain engine: forward, backward, posteriors, max-product and sampling, written once for every
HMM-like family.

A family describes one batch of sequences to the engine with
  * `init`  (B, K): prior over the first position's (reduced) state space,
  * `emit`  (B, T, K): emission likelihoods p(x_t | z_t) of the observed tokens,
  * `trans`: either one shared (K, K) row-stochastic matrix (dense HMM, rank-space HMM) or a callable
    `t -> (B, K, K)` giving the step from position t-1 to t (blocked HMM: the gathered k x k block),
  * `lengths` (B,): true lengths; positions >= length are padding and never influence a result.

Numerics: probability space with per-step renormalisation (scaled forward), so each step is one GEMM
(shared `trans`) or one batched GEMV (per-step blocks); max-product runs in log space.
Cost per sequence: O(T K^2) for forward, backward and Viterbi.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Trans = Tensor | Callable[[int], Tensor]


def valid_mask(lengths: Tensor, T: int) -> Tensor:
    """(B,) -> (B, T) bool, True at real (non-padding) positions."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def _step(alpha: Tensor, trans: Trans, t: int) -> Tensor:
    """alpha (B, K) -> alpha @ A_t (B, K)."""
    if isinstance(trans, Tensor):
        return alpha @ trans
    return torch.bmm(alpha.unsqueeze(1), trans(t)).squeeze(1)


def _step_back(vec: Tensor, trans: Trans, t: int) -> Tensor:
    """vec (B, K) -> A_t @ vec per row (B, K): the backward step into position t-1."""
    if isinstance(trans, Tensor):
        return vec @ trans.T
    return torch.bmm(trans(t), vec.unsqueeze(2)).squeeze(2)


def _pad_emit(emit: Tensor, lengths: Tensor) -> Tensor:
    """Emission likelihoods with padding positions set to 1, so padding can never produce 0/0."""
    mask = valid_mask(lengths, emit.shape[1])
    return torch.where(mask.unsqueeze(-1), emit, torch.ones((), dtype=emit.dtype, device=emit.device))


def forward(init: Tensor, emit: Tensor, trans: Trans, lengths: Tensor, *, keep_alphas: bool = False
            ) -> tuple[Tensor, Tensor | None]:
    """Scaled forward pass.

    Returns `log_cond` (B, T): log p(x_t | x_<t) at real positions and 0 at padding (so
    `log_cond.sum(1)` is log p(x)), and, with `keep_alphas`, the filtered marginals p(z_t | x_<=t)
    (B, T, K). O(B T K^2) time, O(B K) extra memory unless alphas are kept."""
    B, T, K = emit.shape
    emit = _pad_emit(emit, lengths)
    scales = emit.new_empty(B, T)
    alphas = emit.new_empty(B, T, K) if keep_alphas else None
    alpha = init * emit[:, 0]
    for t in range(T):
        if t > 0:
            alpha = _step(alpha, trans, t)
            alpha.mul_(emit[:, t])
        c = alpha.sum(-1, keepdim=True)
        scales[:, t : t + 1] = c
        alpha = alpha / torch.where(c > 0, c, torch.ones((), dtype=c.dtype, device=c.device))
        if alphas is not None:
            alphas[:, t] = alpha
    log_cond = torch.where(valid_mask(lengths, T), scales.log(), torch.zeros((), dtype=emit.dtype,
                                                                               device=emit.device))
    return log_cond, alphas


def backward(emit: Tensor, trans: Trans, lengths: Tensor, log_cond: Tensor) -> Tensor:
    """Scaled backward pass matching `forward`'s scales: beta_t such that alpha_t * beta_t = p(z_t | x).

    Returns (B, T, K); beta = 1 at each sequence's last position and at padding. O(B T K^2)."""
    B, T, K = emit.shape
    emit = _pad_emit(emit, lengths)
    scales = log_cond.exp()
    betas = emit.new_ones(B, T, K)
    beta = emit.new_ones(B, K)
    last = (lengths - 1)[:, None]
    for t in range(T - 2, -1, -1):
        nxt = _step_back(beta * emit[:, t + 1], trans, t + 1) / scales[:, t + 1 : t + 2]
        beta = torch.where(t >= last, torch.ones((), dtype=beta.dtype, device=beta.device), nxt)
        betas[:, t] = beta
    return betas


def posterior(init: Tensor, emit: Tensor, trans: Trans, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Per-position marginals p(z_t | x) (B, T, K) (zeros at padding) and `log_cond` (B, T)."""
    log_cond, alphas = forward(init, emit, trans, lengths, keep_alphas=True)
    betas = backward(emit, trans, lengths, log_cond)
    gamma = alphas * betas
    gamma = gamma / gamma.sum(-1, keepdim=True).clamp_min(torch.finfo(gamma.dtype).tiny)
    gamma = torch.where(valid_mask(lengths, emit.shape[1]).unsqueeze(-1), gamma, torch.zeros((), dtype=gamma.dtype,
                                                                                              device=gamma.device))
    return gamma, log_cond


def maxplus(delta: Tensor, log_trans: Tensor, block_elems: int = 1 << 22) -> tuple[Tensor, Tensor]:
    """(max, +) product: out[b, j] = max_i delta[b, i] + log_trans[i, j], with argmax.

    delta (B, K), log_trans (K, K) shared -> values (B, K), argmax (B, K). Processed in blocks of
    source states so memory stays O(block_elems), not O(B K^2)."""
    B, K = delta.shape
    step = max(1, block_elems // max(1, B * K))
    best = None
    arg = None
    for i0 in range(0, K, step):
        i1 = min(K, i0 + step)
        cand = delta[:, i0:i1, None] + log_trans[None, i0:i1, :]
        v, a = cand.max(1)
        if best is None:
            best, arg = v, a + i0
        else:
            better = v > best
            best = torch.where(better, v, best)
            arg = torch.where(better, a + i0, arg)
    return best, arg


def viterbi(log_init: Tensor, log_emit: Tensor, log_trans: Trans, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Max-product in log space. log_init (B, K), log_emit (B, T, K), log_trans (K, K) or t -> (B, K, K).

    Returns the best path (B, T) (padding positions repeat nothing meaningful: -1) and its joint log
    probability (B,). O(B T K^2) time, O(B T K) backpointers."""
    B, T, K = log_emit.shape
    mask = valid_mask(lengths, T)
    back = torch.empty(B, T, K, dtype=torch.long, device=log_emit.device)
    ident = torch.arange(K, device=log_emit.device).expand(B, K)
    delta = log_init + log_emit[:, 0]
    for t in range(1, T):
        if isinstance(log_trans, Tensor):
            v, a = maxplus(delta, log_trans)
        else:
            v, a = (delta.unsqueeze(2) + log_trans(t)).max(1)
        live = mask[:, t : t + 1]
        delta = torch.where(live, v + log_emit[:, t], delta)
        back[:, t] = torch.where(live, a, ident)
    best, state = delta.max(-1)
    path = torch.empty(B, T, dtype=torch.long, device=log_emit.device)
    path[:, T - 1] = state
    for t in range(T - 1, 0, -1):
        state = back[:, t].gather(1, state[:, None]).squeeze(1)
        path[:, t - 1] = state
    path = torch.where(mask, path, torch.full((), -1, dtype=torch.long, device=path.device))
    return path, best


class CategoricalTable:
    """Draws from many categorical distributions at once by inverse CDF on one flat, monotone array.

    probs (R, C), rows summing to 1 -> `draw(rows (n,), generator) -> (n,)` column indices.
    Row r's cumulative sums are shifted by r, so a single `searchsorted` serves every row: O(log(R C))
    per draw and no per-step gather of whole rows. `temperature` sharpens (<1) or flattens (>1) rows."""

    def __init__(self, probs: Tensor, temperature: float = 1.0):
        p = probs.double()
        if temperature != 1.0:
            logp = p.clamp_min(0).log() / temperature
            p = torch.softmax(logp, dim=-1)
        cum = p.cumsum(-1)
        total = cum[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
        cum = cum / total
        cum[:, -1] = 1.0
        R, C = p.shape
        self.num_cols = C
        self.flat = (cum + torch.arange(R, dtype=torch.float64, device=p.device)[:, None]).reshape(-1)

    def draw(self, rows: Tensor, generator: torch.Generator) -> Tensor:
        u = torch.rand(rows.shape, dtype=torch.float64, device=self.flat.device, generator=generator)
        idx = torch.searchsorted(self.flat, rows.double() + u, right=True)
        col = idx - rows * self.num_cols
        return col.clamp_(0, self.num_cols - 1)


def filtered_last(alphas_or_init: Tensor, lengths: Tensor) -> Tensor:
    """Pick each sequence's filtered marginal at its last real position: (B, T, K) -> (B, K)."""
    idx = (lengths - 1).clamp_min(0)
    return alphas_or_init[torch.arange(len(lengths), device=lengths.device), idx]
