"""The chain engine: forward, backward, posteriors and max-product, written once for every HMM-like
family.

Its length (over 600 lines) is earned: it is the one engine every HMM-like family shares (forward, backward,
posteriors, max-product, chunked long sequences with their error bound), kept in one module so that it is written
and tested once against brute force; the compiled kernels it calls live in `models/kernels/`.

A family describes one batch of sequences to the engine with
  * `init`  (B, K): prior over the first position's (reduced) state space,
  * `emit`  (B, T, K): emission likelihoods p(x_t | z_t) of the observed tokens,
  * `trans`: either one shared (K, K) row-stochastic matrix (dense HMM, rank-space HMM) or a callable
    `t -> (B, K, K)` giving the step from position t-1 to t (blocked HMM: the gathered k x k block),
  * `lengths` (B,): true lengths; positions >= length are padding and never influence a result.

Numerics: probability space with per-step renormalisation (scaled forward), so each step is one GEMM
(shared `trans`) or one batched GEMV (per-step blocks); max-product runs in log space.
Cost per sequence: O(T K^2) for forward, backward and Viterbi.

Engines: every entry point takes `backend=` ("auto", "torch", "single", "groups", "lockstep"; see
`models.backend`, which picks the engine of each call and holds every threshold). The torch recursions are
written here; the compiled ones are in `models.kernels`. Sampling is in `models.sampling`. ("cuda_fused", the
fused Triton scoring of rank_hmm / blocked_hmm in `models.triton_chain`, is chosen per family in
`ChainFamily.score`, not here: these entry points refuse it.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from latentlm.models import backend as dispatch
from latentlm.models.backend import Backend
from latentlm.models.kernels import maxplus as maxplus_kernels
from latentlm.models.kernels import sum_product

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


def _pad_emit(emit: Tensor, lengths: Tensor) -> Tensor:
    """(B, T, K) -> (T, B, K) contiguous emission likelihoods with padding positions set to 1, so
    padding can never produce 0/0 and each step reads one contiguous (B, K) slab."""
    mask = valid_mask(lengths, emit.shape[1])
    return emit.transpose(0, 1).masked_fill(~mask.T.unsqueeze(-1), 1.0).contiguous()


def forward(init: Tensor, emit: Emit, trans: Trans, lengths: Tensor, *, keep_alphas: bool = False,
            out_last: Tensor | None = None, backend: Backend | str = Backend.AUTO, chunk_long: bool = True
            ) -> tuple[Tensor, Tensor | None]:
    """Scaled forward pass.

    Returns `log_cond` (B, T): log p(x_t | x_<t) at real positions and 0 at padding (so
    `log_cond.sum(1)` is log p(x); -inf once a sequence has probability 0), and, with `keep_alphas`,
    the filtered marginals p(z_t | x_<=t) (B, T, K). With `out_last` (B, K), each sequence's filtered
    marginal at its last real position is written there (0 for an impossible sequence).
    O(B T K^2) time; four tensor ops per step on the torch engine. `backend` picks the engine (see
    `models.backend`). With `chunk_long`, a shared matrix and neither output, each sequence of at least
    `backend.LONG_MIN_TOKENS` positions runs as a batch of its own chunks (`forward_chunked`), the others as
    one batch."""
    wants_states = keep_alphas or out_last is not None
    if chunk_long and (long := _long_rows(lengths, trans, wants_states, init, emit, backend)) is not None:
        return _forward_with_long(init, emit, trans, lengths, long, backend), None  # type: ignore[arg-type]
    return _forward_steps(init, emit, trans, lengths, keep_alphas, out_last, backend)


def _long_rows(lengths: Tensor, trans: Trans, wants_states: bool, init: Tensor, emit: Emit,
               backend: Backend | str) -> Tensor | None:
    """(B,) bool of the sequences `forward` / `posterior` run in chunks, or None when they chunk none."""
    if not dispatch.chunk_long(backend, emit, trans, init, wants_states=wants_states):
        return None
    long = lengths >= dispatch.LONG_MIN_TOKENS
    return long if bool(long.any()) else None


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """x[idx] along the first dimension; on CPU by numpy (see `projective_distance` for why)."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(x.detach().numpy()[idx.numpy()]))
    return x[idx]


def _rows(emit: Emit, idx: Tensor, T: int) -> Emit:
    """Sequences idx of `emit`, first T positions."""
    if isinstance(emit, RowLookup):
        return RowLookup(emit.table, _take(emit.rows[:, :T], idx))
    return _take(emit[:, :T], idx)


def _one_row(emit: Emit, b: int, T: int) -> Emit:
    """Sequence b of `emit`, first T positions, as a batch of one (a view)."""
    if isinstance(emit, RowLookup):
        return RowLookup(emit.table, emit.rows[b : b + 1, :T])
    return emit[b : b + 1, :T]


def _forward_with_long(init: Tensor, emit: Emit, trans: Tensor, lengths: Tensor, long: Tensor,
                       backend: Backend | str) -> Tensor:
    """`forward`'s log_cond (B, T) with the `long` sequences chunked one by one and the rest as one batch."""
    B, T = lengths.shape[0], emit.shape[1]
    log_cond = torch.zeros(B, T, dtype=emit.dtype, device=emit.device)
    short = (~long).nonzero().squeeze(1)
    if short.numel():
        width = int(lengths[short].max())
        log_cond[short, :width] = _forward_steps(init[short], _rows(emit, short, width), trans, lengths[short],
                                                 False, None, backend)[0]
    for b in long.nonzero().squeeze(1).tolist():
        n = int(lengths[b])
        log_cond[b, :n] = forward_chunked(init[b : b + 1], _one_row(emit, b, n), trans, backend=backend)[0]
    return log_cond


def _forward_steps(init: Tensor, emit: Emit, trans: Trans, lengths: Tensor, keep_alphas: bool,
                   out_last: Tensor | None, backend: Backend | str, out_alphas: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None]:
    """`forward` by the step-by-step recursion on the engine `backend` picks for it, never chunked. With
    `keep_alphas` and `out_alphas` (B, T, K) contiguous, the filtered marginals are written there (by the
    compiled engines directly; the torch engine copies them) and it is returned."""
    B, T, K = emit.shape
    engine = dispatch.sum_product(backend, emit, trans, init, rows=B, marginals=keep_alphas,
                                  last=out_last is not None)
    if engine is not Backend.TORCH:
        return sum_product.forward_cpu(init, *_table_rows(emit), trans, lengths, engine=engine,
                                       keep_alphas=keep_alphas, threads=dispatch.threads(engine, B, T, K),
                                       out_last=out_last, pack=dispatch.packs(engine, emit.dtype, K, keep_alphas),
                                       provider=dispatch.provider(K, emit.dtype, keep_alphas),
                                       out_alphas=out_alphas)
    emit = dense(emit)
    emit_t = _pad_emit(emit, lengths)  # (T, B, K)
    scales = emit.new_empty(T, B, 1)
    alphas = emit.new_empty(T, B, K) if keep_alphas else emit.new_empty(2, B, K)
    ends: dict[int, list[int]] = {}
    if out_last is not None:
        for b, n in enumerate(lengths.tolist()):
            ends.setdefault(n - 1, []).append(b)
    alpha = torch.mul(init, emit_t[0], out=alphas[0])
    for t in range(T):
        if t > 0:
            alpha = _step(alpha, trans, t, alphas[t] if keep_alphas else alphas[t % 2])
            alpha.mul_(emit_t[t])
        torch.sum(alpha, -1, keepdim=True, out=scales[t])
        alpha.div_(scales[t])  # a zero scale (impossible sequence) gives NaN from here on: see below
        if t in ends:
            idx = torch.tensor(ends[t], device=alpha.device)
            out_last[idx] = alpha[idx]  # type: ignore[index]
    log_scales = scales.squeeze(-1).T.log()  # (B, T)
    mask = valid_mask(lengths, T)
    impossible = (log_scales == -math.inf) & mask
    if bool(impossible.any()):  # after a zero-probability step every later conditional is undefined: -inf
        dead = impossible.cumsum(1) > 0
        log_scales = log_scales.masked_fill(dead, -math.inf)
        if out_last is not None:
            out_last.masked_fill_(dead.any(1, keepdim=True), 0.0)
        if keep_alphas:  # 0, not NaN, from the impossible step on (as the compiled engines)
            alphas.masked_fill_(dead.T.unsqueeze(-1), 0.0)
    log_cond = log_scales.masked_fill(~mask, 0.0)
    if keep_alphas and out_alphas is not None:
        return log_cond, out_alphas.copy_(alphas.transpose(0, 1))
    return log_cond, (alphas.transpose(0, 1) if keep_alphas else None)


# One long sequence, scored as a batch of chunks. The forward recursion of a single sequence is a chain of
# matrix-vector products: bound by streaming the matrix, one product at a time. Cut the sequence into C
# chunks and run them together as a batch (matrix-matrix products, the arithmetic rate of GEMM):
#   1. guess: every chunk but the first starts from the uniform distribution;
#   2. restart: chunk c >= 1 is run again for its first `window` positions from the exact prior for its first
#      position, the guessed run's filtered marginal at the end of chunk c - 1 pushed through `trans`;
#   3. where the restart's filtered marginal after `window` positions equals the guess's within `tol` in
#      Hilbert's projective metric d(u, v) = max_i log(u_i / v_i) - min_i log(u_i / v_i) (same support), the
#      guess's conditionals are kept for the rest of the chunk. For normalised u, v every later conditional
#      log p(x_t | x_<t) and every later total differ by at most d(u, v), and a nonnegative matrix never
#      increases d (Birkhoff). So log p(x) is off by at most the distances left at the chunk boundaries:
#      about (C - 1) tol when `trans` contracts (any strictly positive matrix over chunks hundreds of
#      positions long), C^2 tol / 2 at worst; tol is a few hundred ulps, and the sequential float32 recursion
#      itself drifts by more over thousands of steps (bench/results/hmm_inference_*.md compares both with a
#      float64 reference).
#   4. from the first chunk whose restart has not met its guess (a model that mixes slowly, sparse
#      transitions), the rest of the sequence runs sequentially from that chunk's exact prior.
# Mixing HMMs meet within 5-20 positions; the extra work is 2 (C - 1) window positions.
# Which sequences are chunked, and into how many chunks by default, is `models.backend`'s (LONG_MIN_TOKENS,
# CHUNK_MIN_STATES, `default_chunks`); the chunks' own geometry is here.
CHUNK_WINDOW = 32  # positions a chunk's restart runs before it must meet the guessed run
CHUNK_MIN_LEN = 8 * CHUNK_WINDOW  # shortest chunk (float32)


def meet_tolerance(dtype: torch.dtype) -> float:
    """Projective distance below which a restarted chunk counts as having met its guess: 2^-17 in float32,
    2^-46 in float64 (a few hundred ulps; rounding alone keeps two runs ~1e-7 resp. 1e-16 apart)."""
    return 2.0**-17 if torch.finfo(dtype).bits <= 32 else 2.0**-46


def projective_distance(u: Tensor, v: Tensor) -> Tensor:
    """Hilbert's projective metric between the rows of nonnegative u, v (N, K) -> (N,) float64: max minus min
    of log(u_i / v_i) over the common support, +inf where the supports differ or are empty. (On CPU in
    numpy: even small torch ops can wake torch's thread pool, which then spins on the cores the next
    compiled kernel needs; see `_times`.)"""
    if u.device.type == "cpu":
        a, b = u.detach().double().numpy(), v.detach().double().numpy()
        su, sv = a > 0, b > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.log(np.where(su, a, 1.0)) - np.log(np.where(sv, b, 1.0))
        hi = np.where(su, ratio, -np.inf).max(-1)
        lo = np.where(su, ratio, np.inf).min(-1)
        same = (su == sv).all(-1) & su.any(-1)
        return torch.from_numpy(np.where(same, hi - lo, np.inf))
    su, sv = u > 0, v > 0
    ratio = u.double().log() - v.double().log()
    hi = ratio.masked_fill(~su, -math.inf).amax(-1)
    lo = ratio.masked_fill(~su, math.inf).amin(-1)
    same = (su == sv).all(-1) & su.any(-1)
    return torch.where(same, hi - lo, torch.full_like(hi, math.inf))


def _times(x: Tensor, trans: Tensor, engine: Backend) -> Tensor:
    """x @ trans for a few rows x (N, K). Where the chunks run on compiled kernels (`engine`), also in
    compiled code on the calling thread: a BLAS call between two kernel calls wakes BLAS's thread pool, which
    then spins for milliseconds on the cores the next kernel needs."""
    return x @ trans if engine is Backend.TORCH else sum_product.rows_times(x, trans)


def _positions(emit: Emit, starts: Tensor, width: int) -> Emit:
    """Rows of one sequence's emissions (1, T, K) at positions starts[c] + [0, width) -> (C, width, K)
    (positions past T repeat the last one; callers mark them as padding)."""
    T = emit.shape[1]
    idx = (starts[:, None] + torch.arange(width, device=starts.device)[None, :]).clamp_(max=T - 1)
    picked = _take((emit.rows if isinstance(emit, RowLookup) else emit)[0], idx)
    return RowLookup(emit.table, picked) if isinstance(emit, RowLookup) else picked


def _chunk_plan(emit: Emit, trans: Tensor, chunks: int | None, window: int | None, backend: Backend | str
                ) -> tuple[int, int, int, int, int, Backend]:
    """(T, K, chunks C, chunk length L, window, engine of the chunk batches) for one sequence; C = 1 when
    chunking does not pay. C defaults to `backend.default_chunks` for that engine; the window to CHUNK_WINDOW
    positions in float32 and twice that in float64 (2^29 times smaller tolerance)."""
    T, K = emit.shape[1], trans.shape[0]
    engine = dispatch.sum_product(backend, emit, trans, rows=dispatch.MAX_CHUNKS)
    window = window or (CHUNK_WINDOW if torch.finfo(emit.dtype).bits <= 32 else 2 * CHUNK_WINDOW)
    C = max(1, min(chunks or dispatch.default_chunks(engine, K), T // CHUNK_MIN_LEN))
    return (T, K, C, T // C, window, engine) if T // C >= 2 * window else (T, K, 1, T, window, engine)


def forward_chunked(init: Tensor, emit: Emit, trans: Tensor, *, chunks: int | None = None,
                    window: int | None = None, backend: Backend | str = Backend.AUTO) -> Tensor:
    """`forward`'s log_cond (1, T) for one sequence (init (1, K), emit (1, T, K), trans (K, K) shared), computed
    as a batch of chunks as described above (error bound there; `window` as in `_chunk_plan`), each batch on
    the engine `backend` picks for it. O(T K^2 + C window K^2) work in batched products."""
    T, _, C, L, window, engine = _chunk_plan(emit, trans, chunks, window, backend)
    if C < 2:
        return _forward_sequential(init, emit, trans, T, backend)
    return _chunked_forward(init, emit, trans, C, L, window, backend=backend, engine=engine)


def _chunk_bounds(T: int, C: int, L: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(starts, ends) (C,) of C chunks: the first L + T mod C positions long, the others L."""
    starts = torch.tensor([0] + [T - (C - c) * L for c in range(1, C)], device=device)
    return starts, torch.cat([starts[1:], torch.tensor([T], device=device)])


def _chunked_forward(init: Tensor, emit: Emit, trans: Tensor, C: int, L: int, window: int, *,
                     backend: Backend | str, engine: Backend) -> Tensor:
    """Steps 1-4 above for one sequence in C chunks of L (the first longer): log_cond (1, T) (-inf from an
    impossible position on). Each batch runs on the engine `backend` picks for it; `engine` (the chunk
    batches') decides where the few-row products run."""
    T, K = emit.shape[1], trans.shape[0]
    device, dtype = trans.device, emit.dtype
    starts, ends = _chunk_bounds(T, C, L, device)
    lens = ends - starts
    win = torch.full((C,), window, device=device)
    # 1. guessed runs: first `window` positions, then the rest of each chunk from there
    head_last, tail_last, met_last = trans.new_empty(C, K), trans.new_empty(C, K), trans.new_empty(C - 1, K)
    guess_init = torch.full((C, K), 1.0 / K, dtype=dtype, device=device)
    guess_init[0] = init[0]
    head = _forward_steps(guess_init, _positions(emit, starts, window), trans, win, False, head_last, backend)[0]
    tail = _forward_steps(_times(head_last, trans, engine), _positions(emit, starts + window, int(lens[0]) - window),
                          trans, lens - window, False, tail_last, backend)[0]
    # 2. restarts of chunks 1.. from the exact prior of their first position
    prior = _times(tail_last[:-1], trans, engine)
    restart = _forward_steps(prior, _positions(emit, starts[1:], window), trans, win[1:], False, met_last,
                             backend)[0]
    met = (projective_distance(met_last, head_last[1:]) <= meet_tolerance(dtype)).tolist()
    # 3. assemble: the restart's head, then the guess's tail, chunk by chunk until one has not met
    out = torch.empty(1, T, dtype=dtype, device=device)
    out[0, :window] = head[0]
    for c in range(C):
        s, e = int(starts[c]), int(ends[c])
        if c > 0 and not met[c - 1]:  # 4. the rest step by step from this chunk's exact prior
            out[0, s:] = _forward_steps(prior[c - 1 : c], _positions(emit, starts[c : c + 1], T - s), trans,
                                        torch.tensor([T - s], device=device), False, None, backend)[0][0]
            break
        if c > 0:
            out[0, s : s + window] = restart[c - 1]
        out[0, s + window : e] = tail[c, : e - s - window]
    dead = torch.isneginf(out).cumsum(1) > 0  # an impossible position makes every later one -inf
    return out.masked_fill(dead, -math.inf)


def _forward_sequential(init: Tensor, emit: Emit, trans: Tensor, T: int, backend: Backend | str = Backend.AUTO
                        ) -> Tensor:
    """log_cond (1, T) of one sequence by the step-by-step recursion (never chunked)."""
    return _forward_steps(init, emit, trans, torch.tensor([T], device=trans.device), False, None, backend)[0]


def backward(emit: Emit, trans: Trans, lengths: Tensor, log_cond: Tensor, *, alphas: Tensor | None = None,
             backend: Backend | str = Backend.AUTO, out: Tensor | None = None) -> Tensor:
    """Scaled backward pass matching `forward`'s scales: beta_t such that alpha_t * beta_t = p(z_t | x).

    Returns the betas (B, T, K), 1 at each sequence's last position and at padding (written into `out`
    (B, T, K) contiguous where given: by the compiled engines directly, the torch engine copies). With
    `alphas` (the filtered marginals (B, T, K) from `forward`), returns instead the posteriors p(z_t | x)
    (0 at padding), written into `alphas` in place step by step: no (B, T, K) beta tensor is kept.
    O(B T K^2). `backend` picks the engine ("single" has no backward)."""
    B, T, K = emit.shape
    engine = dispatch.sum_product(backend, emit, trans, rows=B, marginals=True)
    if engine is not Backend.TORCH:
        return sum_product.backward_cpu(*_table_rows(emit), trans, lengths, log_cond, engine=engine,
                                        threads=dispatch.threads(engine, B, T, K), alphas=alphas,
                                        pack=dispatch.packs(engine, emit.dtype, K, True),
                                        provider=dispatch.provider(K, emit.dtype, True), out=out)
    emit = dense(emit)
    # emission divided by that step's scale, so one step is: mul, GEMM, reset rows that have not started
    # (an impossible position's scale is 0: its inverse is taken as 0, so every beta before it is 0 and an
    # impossible sequence's posteriors are 0, as on the compiled engines, not 0 / 0)
    inv_scale = torch.where(torch.isneginf(log_cond), 0.0, (-log_cond).exp())
    emit_scaled = _pad_emit(emit, lengths) * inv_scale.T.unsqueeze(-1)
    not_started = (torch.arange(T, device=lengths.device)[:, None] >= (lengths - 1)[None, :]).unsqueeze(-1)
    if alphas is None:
        betas = emit.new_ones(T, B, K)
        for t in range(T - 2, -1, -1):
            beta = _step_back(betas[t + 1] * emit_scaled[t + 1], trans, t + 1, betas[t])
            beta.masked_fill_(not_started[t], 1.0)
        return betas.transpose(0, 1) if out is None else out.copy_(betas.transpose(0, 1))
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


def posterior(init: Tensor, emit: Emit, trans: Trans, lengths: Tensor, *, backend: Backend | str = Backend.AUTO,
              chunk_long: bool = True) -> tuple[Tensor, Tensor]:
    """Per-position marginals p(z_t | x) (B, T, K) (zeros at padding) and `log_cond` (B, T).
    One (B, T, K) tensor: the filtered marginals are turned into posteriors in place. O(B T K^2).
    `backend` picks the engine ("lockstep" fuses both passes per thread). One sequence alone runs on two
    threads meeting in the middle where `backend.posterior_halves` says so. With `chunk_long` and a shared
    matrix, each sequence of at least `backend.LONG_MIN_TOKENS` positions runs alone: so, up to
    `backend.HALVES_MAX_K` states, else as a batch of its own chunks in both directions
    (`posterior_chunked`); the others as one batch."""
    B, T, K = emit.shape
    if not chunk_long or (long := _long_rows(lengths, trans, False, init, emit, backend)) is None:
        engine = dispatch.sum_product(backend, emit, trans, init, rows=B, marginals=True)
        if engine is Backend.LOCKSTEP:  # both passes in one kernel call per thread
            return sum_product.posterior_cpu(init, *_table_rows(emit), trans, lengths,  # type: ignore[arg-type]
                                             threads=dispatch.threads(engine, B, T, K),
                                             pack=dispatch.packs(engine, emit.dtype, K, True),
                                             provider=dispatch.provider(K, emit.dtype, True))
        if B == 1 and dispatch.posterior_halves(engine, B, int(lengths[0]), K):  # one sequence: two threads, exact
            return sum_product.posterior_halves(init, *_table_rows(emit), trans, int(lengths[0]))  # type: ignore[arg-type]
        log_cond, alphas = _forward_steps(init, emit, trans, lengths, True, None, engine)
        return backward(emit, trans, lengths, log_cond, alphas=alphas, backend=engine), log_cond  # type: ignore[arg-type]
    halves = (K <= dispatch.HALVES_MAX_K
              and dispatch.sum_product(backend, emit, trans, init, rows=1, marginals=True) is Backend.GROUPS)

    def one_long(b: int, n: int) -> tuple[Tensor, Tensor]:
        if halves and dispatch.posterior_halves(Backend.GROUPS, 1, n, K):  # exact, two threads meeting once
            return sum_product.posterior_halves(init[b : b + 1], *_table_rows(_one_row(emit, b, n)), trans, n)  # type: ignore[arg-type]
        return posterior_chunked(init[b : b + 1], _one_row(emit, b, n), trans, backend=backend)  # type: ignore[arg-type]

    if B == 1 and int(lengths[0]) == T:  # one sequence: its own result, no (T, K) copy
        return one_long(0, T)
    # torch.empty, not zeros: first-touch page faults of a fresh zeroed (B, T, K) cost as much as a posterior
    gamma = torch.empty(B, T, K, dtype=emit.dtype, device=emit.device)
    log_cond = torch.empty(B, T, dtype=emit.dtype, device=emit.device)
    short = (~long).nonzero().squeeze(1)
    if short.numel():
        width = int(lengths[short].max())
        g, c = posterior(init[short], _rows(emit, short, width), trans, lengths[short], backend=backend)
        gamma[short, :width], log_cond[short, :width] = g, c
        gamma[short, width:], log_cond[short, width:] = 0.0, 0.0
    for b in long.nonzero().squeeze(1).tolist():
        n = int(lengths[b])
        g, c = one_long(b, n)
        gamma[b, :n], log_cond[b, :n] = g[0], c[0]
        gamma[b, n:], log_cond[b, n:] = 0.0, 0.0
    return gamma, log_cond


def posterior_chunked(init: Tensor, emit: Emit, trans: Tensor, *, chunks: int | None = None,
                      window: int | None = None, backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor]:
    """`posterior` of one sequence (init (1, K), emit (1, T, K), trans (K, K) shared) as a batch of chunks in
    both directions. The first r = T mod C positions run exactly; C chunks of L then tile the rest, so every
    chunk batch writes its marginals straight into one (T, K) buffer per direction (no copies):
    1. forward guess: chunk 0 from its exact prior, the others from the uniform distribution; restarts of
       chunks 1.. for their first `window` positions from the exact prior (the previous chunk's last
       filtered marginal pushed through `trans`), kept where they meet the guess in Hilbert's metric (as in
       `forward_chunked`);
    2. backward guess from each chunk's end (beta = 1 there); restarts of each chunk's last `window`
       positions from the exact beta, pushed back from the next chunk's first beta through one extra
       position whose emission row is that position's emission times its beta; kept where they meet;
    3. the prefix's betas from chunk 0's first.
    Every marginal is alpha_t beta_t normalised, so each side's scale does not matter and each is off by at
    most the distances left at the boundaries (see the comment above `forward_chunked`). From the first
    chunk that does not meet, each direction falls back to the step-by-step recursion. O(T K^2 + C window
    K^2) work; 2 T K floats of memory (alphas and betas), against T K for the step-by-step posterior. Each
    batch runs on the engine `backend` picks for it."""
    T, K, C, L, window, engine = _chunk_plan(emit, trans, chunks, window, backend)
    device, dtype = trans.device, emit.dtype
    if C < 2:
        return posterior(init, emit, trans, torch.tensor([T], device=device), backend=backend, chunk_long=False)
    lookup = emit if isinstance(emit, RowLookup) else RowLookup(emit[0], torch.arange(T, device=device)[None])
    table, rows = lookup.table, lookup.rows[0, :T]
    r = T - C * L

    def span(lo: int, hi: int) -> RowLookup:  # the emissions at positions [lo, hi), as a batch of one
        return RowLookup(table, rows[None, lo:hi])

    chunk_rows = RowLookup(table, rows[r:].reshape(C, L))
    full = torch.full((C,), L, device=device)
    alphas, betas = (torch.empty(1, T, K, dtype=dtype, device=device) for _ in range(2))
    alpha_view, beta_view = alphas[0, r:].view(C, L, K), betas[0, r:].view(C, L, K)
    log_cond = torch.empty(1, T, dtype=dtype, device=device)
    # 1. forward: the prefix exactly, then the guessed chunks in place, then the restarts
    first = init
    if r:
        log_cond[:, :r] = _forward_steps(init, span(0, r), trans, torch.tensor([r], device=device), True, None,
                                         backend, out_alphas=alphas[:, :r])[0]
        first = _times(alphas[:, r - 1], trans, engine)
    inits = torch.full((C, K), 1.0 / K, dtype=dtype, device=device)
    inits[0] = first[0]
    lc = _forward_steps(inits, chunk_rows, trans, full, True, None, backend, out_alphas=alpha_view)[0].contiguous()
    prior = _times(alpha_view[:-1, L - 1], trans, engine)
    re_lc, re_alphas = _forward_steps(prior, RowLookup(table, chunk_rows.rows[1:, :window]), trans,
                                      torch.full((C - 1,), window, device=device), True, None, backend)
    met = (projective_distance(re_alphas[:, -1], alpha_view[1:, window - 1]) <= meet_tolerance(dtype)).tolist()
    for c in range(1, C):
        if not met[c - 1]:  # the rest step by step from this chunk's exact prior
            s = r + c * L
            rest, _ = _forward_steps(prior[c - 1 : c], span(s, T), trans, torch.tensor([T - s], device=device),
                                     True, None, backend, out_alphas=alphas[:, s:])
            lc.view(-1)[c * L :] = rest[0]
            break
        alpha_view[c, :window] = re_alphas[c - 1]
        lc[c, :window] = re_lc[c - 1]
    log_cond[0, r:] = lc.view(-1)
    dead = torch.isneginf(log_cond).cumsum(1) > 0  # an impossible position makes every later one -inf
    if bool(dead.any()):  # an impossible sequence has no posterior: zeros, as step by step
        return torch.zeros_like(alphas), log_cond.masked_fill(dead, -math.inf)
    # 2. backward: the guessed chunks in place, then exact restarts of each chunk's last window
    lc_view = log_cond[0, r:].view(C, L)
    backward(chunk_rows, trans, full, lc_view, backend=backend, out=beta_view)
    nexts = r + L * torch.arange(1, C, device=device)  # first positions of chunks 1..
    virtual = table[rows[nexts]] * beta_view[1:, 0]  # (C - 1, K): each next chunk's first emission times its beta
    re_emit = torch.cat([dense(RowLookup(table, chunk_rows.rows[:-1, L - window :])), virtual[:, None]], 1)
    re_lc = torch.cat([lc_view[:-1, L - window :], lc_view[1:, :1]], 1)
    restart = backward(re_emit, trans, torch.full((C - 1,), window + 1, device=device), re_lc, backend=backend)
    met_b = (projective_distance(restart[:, 0], beta_view[:-1, L - window]) <= meet_tolerance(dtype)).tolist()
    exact_from = r  # the betas are exact from this position on; the positions before it follow from it
    for c in range(C - 2, -1, -1):
        if not met_b[c]:
            exact_from = r + (c + 1) * L
            break
        beta_view[c, L - window :] = restart[c, :window]
    # 3. positions [0, exact_from) step by step from the exact beta there (the prefix, or a fallback)
    if exact_from:
        e = exact_from
        tail = table[rows[e]] * betas[0, e]
        rows_e = torch.cat([dense(span(0, e)), tail[None, None]], 1)
        betas[:, :e] = backward(rows_e, trans, torch.tensor([e + 1], device=device), log_cond[:, : e + 1],
                                backend=backend)[:, :e]
    if engine is not Backend.TORCH:  # compiled: one pass on the threads the chunk batches had
        sum_product.posteriors_from(alphas[0], betas[0], torch.get_num_threads())
        return alphas, log_cond
    gamma = alphas.mul_(betas)
    return gamma.div_(gamma.sum(-1, keepdim=True).clamp_min_(torch.finfo(dtype).tiny)), log_cond


def maxplus(delta: Tensor, log_trans: Tensor, block_elems: int = 1 << 22, col_max: Tensor | None = None, *,
            backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor]:
    """(max, +) product: out[b, j] = max_i delta[b, i] + log_trans[i, j], with argmax.

    delta (B, K), log_trans (K, K) shared -> values (B, K), argmax (B, K). O(B K^2). `backend`: "groups" is
    the compiled kernel of `kernels.maxplus` (exact pruning; auto on CPU from B K^2 >=
    `backend.NATIVE_MAXPLUS_MIN_WORK`); "torch" broadcasts over blocks of source states, keeping memory at
    O(block_elems), not O(B K^2). `col_max` = log_trans.amax(0) if the caller has it."""
    engine = dispatch.max_product(backend, delta, log_trans, rows=delta.shape[0])
    return _maxplus(delta, log_trans, block_elems, col_max, engine)


def _maxplus(delta: Tensor, log_trans: Tensor, block_elems: int, col_max: Tensor | None, engine: Backend
             ) -> tuple[Tensor, Tensor]:
    """`maxplus` on a chosen engine ("groups" or "torch")."""
    if engine is not Backend.TORCH:
        return maxplus_kernels.maxplus_cpu(delta, log_trans, col_max)
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


# Sum-product and max-product are not written once over a semiring here (as torch-struct does), on purpose.
# The sum-product runs in probability space with per-step renormalisation so that a step is one GEMM (or
# BLAS/compiled equivalent); a log-semiring step would be a B x K x K broadcast with logsumexp, 10-50x slower
# and O(B K^2) memory. The max-product runs in log space, re-centred every step with a float64 offset, so
# float32 finds the float64 path on 10,000-token sequences; a (max, x) step in probability space would
# underflow the scores of states far below the best and break that. With the two recursions in different
# spaces, what they would share is the loop skeleton, while each needs its own state: in-place `out=`
# buffers and the filtered-marginal outputs for the forward; backpointers, rows frozen at padding and the
# float64 offset for Viterbi. A generic version parameterised over all of that is longer than the two loops.
def viterbi(log_init: Tensor, log_emit: Emit, log_trans: Trans, lengths: Tensor, *,
            backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor]:
    """Max-product in log space. log_init (B, K), log_emit (B, T, K) or a `RowLookup` of log-likelihood rows
    (read where they lie by the compiled engines), log_trans (K, K) or t -> (B, K, K).

    Returns the best path (B, T) (-1 at padding) and its joint log probability (B,) in float64. Scores are
    re-centred every step (the running maximum moves to a float64 offset), so float32 keeps full
    precision on the differences that decide the path even after 10,000s of steps.
    O(B T K^2) time, O(B T K) int32 backpointers. `backend`: "single" (one sequence, auto on CPU from
    T K^2 >= `backend.NATIVE_MAXPLUS_MIN_WORK`) and "groups" (a batch, from B K^2) run the whole recursion in
    compiled code (`kernels.maxplus`: a GEMM-like (max, +) micro-kernel with exact pruning), "torch" the
    broadcast (per-step matrices always)."""
    B, T, K = log_emit.shape
    device = log_emit.device
    engine = dispatch.max_product(backend, log_emit, log_trans, rows=B, steps=T)
    if engine in (Backend.SINGLE, Backend.GROUPS) and isinstance(log_trans, Tensor):  # whole in compiled code
        threads = dispatch.max_product_threads(B, T, K)
        return maxplus_kernels.viterbi_cpu(log_init, *_table_rows(log_emit), log_trans, lengths, threads)
    log_emit = dense(log_emit)
    mask = valid_mask(lengths, T)
    back = torch.empty(T, B, K, dtype=torch.int32, device=device)
    ident = torch.arange(K, device=device, dtype=torch.int32).expand(B, K)
    offset = torch.zeros(B, dtype=torch.float64, device=device)
    delta = log_init + log_emit[:, 0]
    for t in range(T):  # here the engine is "torch" (the compiled ones returned above)
        if t > 0:
            if isinstance(log_trans, Tensor):
                v, a = _maxplus(delta, log_trans, 1 << 22, None, Backend.TORCH)
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


def filtered_last(alphas_or_init: Tensor, lengths: Tensor) -> Tensor:
    """Pick each sequence's filtered marginal at its last real position: (B, T, K) -> (B, K)."""
    idx = (lengths - 1).clamp_min(0)
    return alphas_or_init[torch.arange(len(lengths), device=lengths.device), idx]


def expected_counts(init: Tensor, emit: Tensor, trans: Tensor, lengths: Tensor, *,
                    backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """E-step sufficient statistics for a shared (K, K) transition matrix (Baum-Welch).

    Returns (gamma (B, T, K) = p(z_t | x), zeros at padding; start counts (K,) = sum_b gamma[b, 0];
    transition counts (K, K) = sum_{b, t >= 1} p(z_{t-1} = i, z_t = j | x); log_cond (B, T)).
    xi summed over positions is trans * (alpha_{t-1}^T (emit_t * beta_t / c_t)): one (K, B T) x (B T, K)
    GEMM. O(B T K^2)."""
    log_cond, alphas = forward(init, emit, trans, lengths, keep_alphas=True, backend=backend)
    betas = backward(emit, trans, lengths, log_cond, backend=backend)
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
