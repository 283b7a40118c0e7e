"""EM for a dense HMM over an LM's token ids (`latentlm distill`): Ctrl-G's recipe, on the chain engine.

E-step: `models.chain.expected_counts` (scaled forward-backward, one (Z, B T) x (B T, Z) GEMM for the transition
counts) per batch of samples, accumulated in float64: start [Z], transitions [Z, Z], emissions [V, Z] (the
layout the engine gathers rows of). M-step: a pseudocount spread uniformly over each distribution (`a / Z` per
start and transition entry, `a / V` per emission entry, as Ctrl-G adds it), normalised in place. That is MAP-EM
under Dirichlet(1 + a / dim) priors: the objective log p(samples) + sum (a / dim) log p never decreases (with
a = 0, plain EM: the training log-likelihood never decreases).

Sequences: a sample ending at the LM's EOS includes it (the HMM learns where text ends); a sample cut at L has
no EOS and is trained on as a prefix: its likelihood is the HMM's marginal over every continuation (the chain
engine's forward over its tokens only), exactly the event that the LM's first L tokens were these.

Memory: parameters float32 and counts float64: 12 bytes per entry of Z (Z + V), 16 during the M-step (the new
float32 parameters beside the counts), plus the E-step's O(B L Z) workspace."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.chain import RowLookup

PAD = -1
EM_BYTES_PER_ENTRY = 16  # float64 counts + float32 parameters + the M-step's new float32 parameters
ESTEP_BYTES_PER_CELL = 48  # per (row, position, state) of a batch: the engine's (B, L, Z) tensors, float32/64


@dataclass
class Params:
    """start (Z,), trans (Z, Z) row-stochastic, emit_by_word (V, Z) column-stochastic (p(x | z) = [x, z])."""

    start: Tensor
    trans: Tensor
    emit_by_word: Tensor

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    def to(self, device: torch.device | str) -> Params:
        return Params(self.start.to(device), self.trans.to(device), self.emit_by_word.to(device))

    def tensors(self) -> dict[str, Tensor]:
        return {"start": self.start, "trans": self.trans, "emit_by_word": self.emit_by_word}

    def score(self, batch: Batch) -> Tensor:
        """log p(x) per sequence (B,) by the chain engine's forward. O(B T Z^2)."""
        B = batch.ids.shape[0]
        log_cond, _ = chain.forward(self.start.expand(B, -1), RowLookup(self.emit_by_word, batch.ids), self.trans,
                                    batch.lengths)
        return log_cond.sum(1)

    def log_prior(self, pseudocount: float) -> float:
        """sum over each distribution of sum_j (a / dim) log p_j: MAP-EM's prior term (0 when a = 0)."""
        if pseudocount == 0:
            return 0.0
        Z, V = self.num_states, self.emit_by_word.shape[0]
        total = (pseudocount / Z) * (self.start.double().log().sum() + self.trans.double().log().sum())
        total += (pseudocount / V) * self.emit_by_word.double().log().sum()
        return float(total)

    def export_tensors(self) -> dict[str, Tensor]:
        """The `hmm` artifact's tensors on CPU: start [Z], trans [Z, Z], emit [Z, V], each row renormalised in
        float64 (a few rows at a time) so the store's 1e-4 check holds. O(Z (Z + V))."""
        def rows(t: Tensor) -> Tensor:
            out = torch.empty(t.shape, dtype=torch.float32)
            step = max(1, (1 << 24) // max(t.shape[-1], 1))
            for i in range(0, t.shape[0], step):
                r = t[i : i + step].double().clamp_min(0)
                out[i : i + step] = (r / r.sum(-1, keepdim=True)).cpu()
            return out

        return {"start": rows(self.start[None])[0], "trans": rows(self.trans), "emit": rows(self.emit_by_word.T)}


@dataclass
class Counts:
    """Expected sufficient statistics (float64): start [Z], trans [Z, Z], emit [V, Z]; the log-likelihood of the
    sequences they came from, their tokens and their number."""

    start: Tensor
    trans: Tensor
    emit: Tensor
    loglik: float = 0.0
    tokens: int = 0
    sequences: int = 0

    @classmethod
    def zeros(cls, Z: int, V: int, device: torch.device | str) -> Counts:
        f = torch.float64
        return cls(torch.zeros(Z, dtype=f, device=device), torch.zeros(Z, Z, dtype=f, device=device),
                   torch.zeros(V, Z, dtype=f, device=device))


def accumulate(p: Params, batch: Batch, c: Counts) -> None:
    """Add one batch's expected counts under `p` to `c` (the E-step). O(B T Z^2)."""
    B = batch.ids.shape[0]
    gamma, s, xi, log_cond = chain.expected_counts(p.start.expand(B, -1), p.emit_by_word[batch.ids], p.trans,
                                                   batch.lengths)
    c.start += s.double()
    c.trans += xi.double()
    mask = batch.mask
    c.emit.index_add_(0, batch.ids[mask], gamma[mask].double())
    c.loglik += float(log_cond.double().sum())
    c.tokens += int(batch.lengths.sum())
    c.sequences += B


def _normalise_(c: Tensor, dim: int, pseudocount: float, fallback: Tensor | None) -> Tensor:
    """In place: c + pseudocount / size(dim), normalised along `dim`; a slice with no mass (pseudocount 0, a state
    never visited) takes `fallback`'s (the previous parameters'), or uniform. Returns c."""
    if pseudocount:
        c += pseudocount / c.shape[dim]
    tot = c.sum(dim, keepdim=True)
    empty = tot == 0
    if bool(empty.any()):
        keep = fallback.to(c.dtype) if fallback is not None else torch.full_like(c, 1.0 / c.shape[dim])
        c.copy_(torch.where(empty, keep, c))
        tot = c.sum(dim, keepdim=True)
    return c.div_(tot)


def m_step(c: Counts, pseudocount: float, old: Params | None = None, dtype: torch.dtype = torch.float32) -> Params:
    """The M-step from counts `c` (consumed: normalised in place) with a pseudocount spread over each
    distribution. O(Z (Z + V))."""
    start = _normalise_(c.start, 0, pseudocount, None if old is None else old.start)
    trans = _normalise_(c.trans, 1, pseudocount, None if old is None else old.trans)
    emit = _normalise_(c.emit, 0, pseudocount, None if old is None else old.emit_by_word)
    return Params(start.to(dtype), trans.to(dtype), emit.to(dtype))


def sample_batches(arrays: Iterable[np.ndarray], batch: int, device: torch.device | str) -> Iterator[Batch]:
    """Samples (int32 [n, L] arrays, PAD after each end) as `Batch`es of `batch` rows on `device`, each cut to its
    longest row."""
    for a in arrays:
        for b0 in range(0, len(a), batch):
            block = np.asarray(a[b0 : b0 + batch])
            lengths = (block != PAD).sum(1)
            T = int(lengths.max())
            ids = np.where(block[:, :T] == PAD, 0, block[:, :T]).astype(np.int64)
            yield Batch(torch.from_numpy(ids).to(device), torch.from_numpy(lengths.astype(np.int64)).to(device))


def perplexity(p: Params, batches: Iterable[Batch]) -> tuple[float, float, int]:
    """(per-token perplexity, total log-likelihood, tokens) of `p` on the batches."""
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            total += float(p.score(b).double().sum())
            n += int(b.lengths.sum())
    return (math.exp(-total / n) if n else math.nan), total, n


def unigram_counts(arrays: Iterable[np.ndarray], V: int) -> np.ndarray:
    """Token counts (V,) float64 over the samples."""
    counts = np.zeros(V, dtype=np.float64)
    for a in arrays:
        block = np.asarray(a)
        counts += np.bincount(block[block != PAD], minlength=V)
    return counts


def unigram_perplexity(counts: np.ndarray, arrays: Iterable[np.ndarray]) -> float:
    """Per-token perplexity on `arrays` of the add-one unigram of `counts` (the baseline the HMM must beat)."""
    logp = np.log((counts + 1) / (counts.sum() + len(counts)))
    total, n = 0.0, 0
    for a in arrays:
        block = np.asarray(a)
        ids = block[block != PAD]
        total += float(logp[ids].sum())
        n += len(ids)
    return math.exp(-total / n) if n else math.nan


def random_params(Z: int, unigram: Tensor, generator: torch.Generator, noise: float = 1.0) -> Params:
    """Random initialisation (float32, CPU): start and transition rows softmax(noise N(0, 1)); each state's
    emissions the unigram (V,) times exp(noise N(0, 1)), renormalised, so every state starts near the unigram.
    O(Z (Z + V))."""
    V = unigram.shape[0]
    start = torch.softmax(noise * torch.randn(Z, generator=generator), 0)
    trans = torch.softmax(noise * torch.randn(Z, Z, generator=generator), 1)
    emit = torch.randn(V, Z, generator=generator).mul_(noise).exp_().mul_(unigram.float()[:, None])
    return Params(start, trans, emit.div_(emit.sum(0, keepdim=True)))
