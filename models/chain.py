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

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

Trans = Tensor | Callable[[int], Tensor]


@dataclass(frozen=True)
class RowLookup:
    """Emission likelihoods given as rows of a table: emit[b, t] = table[rows[b, t]], table (N, K), rows
    (B, T) long. Families whose emissions are a per-token row (hmm, rank_hmm) hand this to the engine in place
    of a (B, T, K) tensor: the compiled kernels read each row where it lies, the PyTorch path gathers it."""

    table: Tensor
    rows: Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.rows.shape, self.table.shape[1])  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def requires_grad(self) -> bool:
        return self.table.requires_grad

    def dense(self) -> Tensor:
        """(B, T, K) gathered emissions."""
        return self.table[self.rows]


Emit = Tensor | RowLookup


def dense(emit: Emit) -> Tensor:
    """The (B, T, K) emission tensor of a tensor or a `RowLookup`."""
    return emit if isinstance(emit, Tensor) else emit.dense()


def _table_rows(emit: Emit) -> tuple[Tensor, Tensor | None]:
    return (emit, None) if isinstance(emit, Tensor) else (emit.table, emit.rows)
NATIVE_MAXPLUS_MIN_WORK = 1 << 16  # B*K*K (batches) or T*K*K (one sequence) above which compiled CPU code pays off
COMPILED_MAX_K = 512  # largest shared matrix for the compiled sum-product kernels (beyond it BLAS GEMMs win)


def valid_mask(lengths: Tensor, T: int) -> Tensor:
    """(B,) -> (B, T) bool, True at real (non-padding) positions."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def _step(alpha: Tensor, trans: Trans, t: int, out: Tensor) -> Tensor:
    """out <- alpha @ A_t, alpha (B, K)."""
    if isinstance(trans, Tensor):
        return torch.mm(alpha, trans, out=out)
    return torch.bmm(alpha.unsqueeze(1), trans(t), out=out.unsqueeze(1)).squeeze(1)


def _step_back(vec: Tensor, trans: Trans, t: int, out: Tensor) -> Tensor:
    """out <- A_t @ vec per row, vec (B, K): the backward step into position t-1."""
    if isinstance(trans, Tensor):
        return torch.mm(vec, trans.T, out=out)
    return torch.bmm(trans(t), vec.unsqueeze(2), out=out.unsqueeze(2)).squeeze(2)


def _compiled(emit: Emit, trans: Trans, *more: Tensor, any_size: bool = False) -> bool:
    """Whether the compiled CPU sum-product kernels (`models.kernels.forward_cpu` / `backward_cpu`) run
    this call: a shared matrix on CPU in float32/float64, no autograd, and at most COMPILED_MAX_K states
    unless `any_size` (one sequence: there is no GEMM to hand to BLAS, only per-step dispatch)."""
    if not (isinstance(trans, Tensor) and emit.device.type == "cpu" and trans.device.type == "cpu"
            and emit.dtype in (torch.float32, torch.float64) and trans.dtype == emit.dtype
            and (any_size or trans.shape[-1] <= COMPILED_MAX_K)):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in (emit, trans, *more)):
        return False
    from models import kernels

    return kernels.HAVE_NUMBA


@contextmanager
def plain_torch() -> Iterator[None]:
    """Within this block the engine runs its plain PyTorch recursion (one GEMM per step), never the compiled
    kernels: the baseline for benchmarks and the reference for the kernels' tests. Not thread-safe."""
    global _compiled
    saved = _compiled
    _compiled = lambda *args, **kwargs: False  # noqa: E731
    try:
        yield
    finally:
        _compiled = saved


def _pad_emit(emit: Tensor, lengths: Tensor) -> Tensor:
    """(B, T, K) -> (T, B, K) contiguous emission likelihoods with padding positions set to 1, so
    padding can never produce 0/0 and each step reads one contiguous (B, K) slab."""
    mask = valid_mask(lengths, emit.shape[1])
    return emit.transpose(0, 1).masked_fill(~mask.T.unsqueeze(-1), 1.0).contiguous()


def forward(init: Tensor, emit: Emit, trans: Trans, lengths: Tensor, *, keep_alphas: bool = False
            ) -> tuple[Tensor, Tensor | None]:
    """Scaled forward pass.

    Returns `log_cond` (B, T): log p(x_t | x_<t) at real positions and 0 at padding (so
    `log_cond.sum(1)` is log p(x); -inf once a sequence has probability 0), and, with `keep_alphas`,
    the filtered marginals p(z_t | x_<=t) (B, T, K). O(B T K^2) time; four tensor ops per step."""
    B, T, K = emit.shape
    if _compiled(emit, trans, init, any_size=B == 1 and not keep_alphas):
        from models import kernels

        return kernels.forward_cpu(init, *_table_rows(emit), trans, lengths, keep_alphas=keep_alphas,
                                   threads=torch.get_num_threads())
    emit = dense(emit)
    emit_t = _pad_emit(emit, lengths)  # (T, B, K)
    scales = emit.new_empty(T, B, 1)
    alphas = emit.new_empty(T, B, K) if keep_alphas else emit.new_empty(2, B, K)
    alpha = torch.mul(init, emit_t[0], out=alphas[0])
    for t in range(T):
        if t > 0:
            alpha = _step(alpha, trans, t, alphas[t] if keep_alphas else alphas[t % 2])
            alpha.mul_(emit_t[t])
        torch.sum(alpha, -1, keepdim=True, out=scales[t])
        alpha.div_(scales[t])  # a zero scale (impossible sequence) gives NaN from here on: see below
    log_scales = scales.squeeze(-1).T.log()  # (B, T)
    mask = valid_mask(lengths, T)
    impossible = (log_scales == -math.inf) & mask
    if bool(impossible.any()):  # after a zero-probability step every later conditional is undefined: -inf
        dead = impossible.cumsum(1) > 0
        log_scales = log_scales.masked_fill(dead, -math.inf)
    log_cond = log_scales.masked_fill(~mask, 0.0)
    return log_cond, (alphas.transpose(0, 1) if keep_alphas else None)


def backward(emit: Emit, trans: Trans, lengths: Tensor, log_cond: Tensor, *, alphas: Tensor | None = None
             ) -> Tensor:
    """Scaled backward pass matching `forward`'s scales: beta_t such that alpha_t * beta_t = p(z_t | x).

    Returns the betas (B, T, K), 1 at each sequence's last position and at padding. With `alphas` (the
    filtered marginals (B, T, K) from `forward`), returns instead the posteriors p(z_t | x) (0 at padding),
    written into `alphas` in place step by step: no (B, T, K) beta tensor is kept. O(B T K^2)."""
    B, T, K = emit.shape
    if _compiled(emit, trans):
        from models import kernels

        return kernels.backward_cpu(*_table_rows(emit), trans, lengths, log_cond, threads=torch.get_num_threads(),
                                    alphas=alphas)
    emit = dense(emit)
    # emission divided by that step's scale, so one step is: mul, GEMM, reset rows that have not started
    emit_scaled = _pad_emit(emit, lengths) / log_cond.T.exp().unsqueeze(-1)
    not_started = (torch.arange(T, device=lengths.device)[:, None] >= (lengths - 1)[None, :]).unsqueeze(-1)
    if alphas is None:
        betas = emit.new_ones(T, B, K)
        for t in range(T - 2, -1, -1):
            beta = _step_back(betas[t + 1] * emit_scaled[t + 1], trans, t + 1, betas[t])
            beta.masked_fill_(not_started[t], 1.0)
        return betas.transpose(0, 1)
    gamma = alphas.transpose(0, 1)  # (T, B, K); a view of forward's own (T, B, K) storage
    beta, scaled = emit.new_ones(B, K), emit.new_empty(B, K)
    spare = [emit.new_empty(B, K), emit.new_empty(B, K)]
    tiny = torch.finfo(emit.dtype).tiny
    for t in range(T - 1, -1, -1):
        if t < T - 1:
            torch.mul(beta, emit_scaled[t + 1], out=scaled)
            beta = _step_back(scaled, trans, t + 1, spare[t % 2])
            beta.masked_fill_(not_started[t], 1.0)
        g = gamma[t].mul_(beta)
        g.div_(g.sum(-1, keepdim=True).clamp_min_(tiny))
    gamma.masked_fill_(~valid_mask(lengths, T).T.unsqueeze(-1), 0.0)
    return alphas


def posterior(init: Tensor, emit: Emit, trans: Trans, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Per-position marginals p(z_t | x) (B, T, K) (zeros at padding) and `log_cond` (B, T).
    One (B, T, K) tensor: the filtered marginals are turned into posteriors in place. O(B T K^2)."""
    log_cond, alphas = forward(init, emit, trans, lengths, keep_alphas=True)
    return backward(emit, trans, lengths, log_cond, alphas=alphas), log_cond


def maxplus(delta: Tensor, log_trans: Tensor, block_elems: int = 1 << 22, col_max: Tensor | None = None
            ) -> tuple[Tensor, Tensor]:
    """(max, +) product: out[b, j] = max_i delta[b, i] + log_trans[i, j], with argmax.

    delta (B, K), log_trans (K, K) shared -> values (B, K), argmax (B, K). O(B K^2). On CPU large
    products use the compiled kernel of `models.kernels`; otherwise blocks of source states keep memory
    at O(block_elems), not O(B K^2)."""
    B, K = delta.shape
    if delta.device.type == "cpu" and B * K * K >= NATIVE_MAXPLUS_MIN_WORK:
        from models import kernels

        if kernels.HAVE_NUMBA:
            return kernels.maxplus_cpu(delta, log_trans, col_max)
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

    Returns the best path (B, T) (-1 at padding) and its joint log probability (B,) in float64. Scores are
    re-centred every step (the running maximum moves to a float64 offset), so float32 keeps full
    precision on the differences that decide the path even after 10,000s of steps.
    O(B T K^2) time, O(B T K) int32 backpointers."""
    B, T, K = log_emit.shape
    device = log_emit.device
    if B == 1 and device.type == "cpu" and isinstance(log_trans, Tensor) and T * K * K >= NATIVE_MAXPLUS_MIN_WORK:
        from models import kernels

        if kernels.HAVE_NUMBA:  # one long sequence: the whole recursion in compiled code
            L = int(lengths[0])
            path1, score = kernels.viterbi_one_cpu(log_init[0], log_emit[0, :L], log_trans, log_trans.amax(0))
            path = torch.full((1, T), -1, dtype=torch.long)
            path[0, :L] = path1
            return path, torch.tensor([score], dtype=torch.float64)
    mask = valid_mask(lengths, T)
    back = torch.empty(T, B, K, dtype=torch.int32, device=device)
    ident = torch.arange(K, device=device, dtype=torch.int32).expand(B, K)
    offset = torch.zeros(B, dtype=torch.float64, device=device)
    delta = log_init + log_emit[:, 0]
    col_max = log_trans.amax(0) if isinstance(log_trans, Tensor) else None
    for t in range(T):
        if t > 0:
            if isinstance(log_trans, Tensor):
                v, a = maxplus(delta, log_trans, col_max=col_max)
            else:
                v, a = (delta.unsqueeze(2) + log_trans(t)).max(1)
            live = mask[:, t : t + 1]
            delta = torch.where(live, v + log_emit[:, t], delta)
            back[t] = torch.where(live, a.to(torch.int32), ident)
        top = delta.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        delta = delta - top
        offset += top.squeeze(-1).double()
    best, state = delta.max(-1)
    path = torch.empty(T, B, dtype=torch.long, device=device)
    path[T - 1] = state
    for t in range(T - 1, 0, -1):
        state = back[t].gather(1, state[:, None]).squeeze(1).long()
        path[t - 1] = state
    path = torch.where(mask, path.T, torch.full((), -1, dtype=torch.long, device=device))
    return path, offset + best.double()


class CategoricalTable:
    """Draws from many categorical distributions at once: probs (R, C), rows summing to 1 ->
    `draw(rows (n,), generator) -> (n,)` column indices.

    Uses Walker/Vose alias tables (built once in O(R C) by a compiled kernel): a draw is one uniform
    column and one biased coin, O(1) per sample whatever C is, on any device. `temperature` sharpens
    (< 1) or flattens (> 1) every row: p^(1/temperature), renormalised."""

    def __init__(self, probs: Tensor, temperature: float = 1.0):
        from models import kernels

        p = probs.double()
        if temperature != 1.0:
            p = torch.softmax(p.clamp_min(0).log() / temperature, dim=-1)
        self.num_cols = p.shape[1]
        if kernels.HAVE_NUMBA:
            accept, alias = kernels.alias_tables(p)
            self.accept, self.alias = accept.to(probs.device), alias.to(probs.device)
            self.flat = None
        else:  # inverse CDF on one flat monotone array: row r's cumulative sums shifted by r
            cum = p.cumsum(-1)
            cum = cum / cum[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
            cum[:, -1] = 1.0
            self.flat = (cum + torch.arange(p.shape[0], dtype=torch.float64, device=p.device)[:, None]).reshape(-1)

    def draw(self, rows: Tensor, generator: torch.Generator) -> Tensor:
        if self.flat is not None:
            u = torch.rand(rows.shape, dtype=torch.float64, device=rows.device, generator=generator)
            idx = torch.searchsorted(self.flat, rows.double() + u, right=True)
            return (idx - rows * self.num_cols).clamp_(0, self.num_cols - 1)
        u = torch.rand((2, *rows.shape), dtype=torch.float64, device=rows.device, generator=generator)
        col = (u[0] * self.num_cols).long().clamp_(max=self.num_cols - 1)
        keep = u[1] < self.accept[rows, col]
        return torch.where(keep, col, self.alias[rows, col])


def filtered_last(alphas_or_init: Tensor, lengths: Tensor) -> Tensor:
    """Pick each sequence's filtered marginal at its last real position: (B, T, K) -> (B, K)."""
    idx = (lengths - 1).clamp_min(0)
    return alphas_or_init[torch.arange(len(lengths), device=lengths.device), idx]


def expected_counts(init: Tensor, emit: Tensor, trans: Tensor, lengths: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """E-step sufficient statistics for a shared (K, K) transition matrix (Baum-Welch).

    Returns (gamma (B, T, K) = p(z_t | x), zeros at padding; start counts (K,) = sum_b gamma[b, 0];
    transition counts (K, K) = sum_{b, t >= 1} p(z_{t-1} = i, z_t = j | x); log_cond (B, T)).
    xi summed over positions is trans * (alpha_{t-1}^T (emit_t * beta_t / c_t)): one (K, B T) x (B T, K)
    GEMM. O(B T K^2)."""
    log_cond, alphas = forward(init, emit, trans, lengths, keep_alphas=True)
    betas = backward(emit, trans, lengths, log_cond)
    B, T, K = emit.shape
    mask = valid_mask(lengths, T)
    gamma = alphas * betas
    gamma = gamma / gamma.sum(-1, keepdim=True).clamp_min(torch.finfo(gamma.dtype).tiny)
    gamma = torch.where(mask.unsqueeze(-1), gamma, torch.zeros((), dtype=gamma.dtype, device=gamma.device))
    if T > 1:
        right = emit[:, 1:] * betas[:, 1:] / log_cond[:, 1:].exp().unsqueeze(-1)
        right = torch.where(mask[:, 1:].unsqueeze(-1), right, torch.zeros((), dtype=right.dtype, device=right.device))
        xi = trans * (alphas[:, :-1].reshape(-1, K).T @ right.reshape(-1, K))
    else:
        xi = torch.zeros_like(trans)
    return gamma, gamma[:, 0].sum(0), xi, log_cond


def forward_autograd(init: Tensor, emit: Tensor, trans: Trans, lengths: Tensor, *, keep_alphas: bool = False
                     ) -> tuple[Tensor, Tensor | None]:
    """Differentiable scaled forward for training (same numerics and outputs as `forward`, but no
    `out=`/in-place writes, so autograd can run through it; gradient of log p(x) = expected counts).

    init (B, K), emit (B, T, K), trans (K, K) or t -> (B, K, K) -> log_cond (B, T) (0 at padding) and,
    with `keep_alphas`, filtered marginals (B, T, K). O(B T K^2) time, O(B T K) autograd memory."""
    B, T, K = emit.shape
    mask = valid_mask(lengths, T)
    emit = emit.masked_fill(~mask.unsqueeze(-1), 1.0)
    logs, alphas = [], []
    alpha = init * emit[:, 0]
    for t in range(T):
        if t > 0:
            prev = alpha @ trans if isinstance(trans, Tensor) else torch.bmm(alpha.unsqueeze(1), trans(t)).squeeze(1)
            alpha = prev * emit[:, t]
        c = alpha.sum(-1, keepdim=True)
        alpha = alpha / c
        logs.append(c)
        if keep_alphas:
            alphas.append(alpha)
    log_cond = torch.cat(logs, 1).log().masked_fill(~mask, 0.0)
    return log_cond, (torch.stack(alphas, 1) if keep_alphas else None)
