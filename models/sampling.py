"""Sampling shared by every family: categorical tables (O(1) or O(sqrt C) per draw), and the ancestral
sampling loop of the HMM-like families.

`CategoricalTable` draws from many categorical distributions at once: alias tables built by a compiled
kernel (`kernels.alias`) for tables up to `ALIAS_MAX_ENTRIES`, otherwise (or without numba) an inverse CDF
that reads the probabilities where they lie (`ChunkedCDF`: a 32,768-state transition matrix needs 45 MiB
besides itself, where its alias tables would hold 16 GiB). `run_sampler`
is the generic loop token_t = emit(z_t), z_{t+1} = nxt(z_t) for n samples at once; the tree engine
(`models.tree`) draws its rules from the same tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from latentlm.models.kernels import alias as alias_kernels
from latentlm.models.kernels.jit import HAVE_NUMBA

T = TypeVar("T")


# Alias tables hold 16 bytes per entry (float64 acceptance, int64 alias) and need 16 more while they are built;
# a larger table is drawn by `ChunkedCDF`, which holds 8 bytes per sqrt(C) entries besides the probabilities.
ALIAS_MAX_ENTRIES = 1 << 22  # 64 MiB of alias tables (a 2,048-state transition matrix)
# At a temperature other than 1 tables are built per request (`tables_at`): an alias table's O(R C) build then
# costs more than the O(C) draws of the chunked sampler's whole-row weighing unless the table is small (a
# single row drawn many times: the start of every sample) or the draws outnumber its rows.
TEMPERED_ALIAS_MAX_ENTRIES = 1 << 16
SLAB_ENTRIES = 1 << 23  # entries per slab when `ChunkedCDF` sums a table (64 MiB of float64 at a time)


class CategoricalTable:
    """Draws from many categorical distributions at once: probs (R, C), rows summing to 1 (any positive
    scale is fine) -> `draw(rows (n,), generator) -> (n,)` column indices.

    `alias=None` (the default) picks the method by size: alias tables (Walker/Vose, built once in O(R C) by a
    compiled kernel) when numba is present and R C <= `ALIAS_MAX_ENTRIES` (a draw is one uniform column and
    one biased coin, O(1) whatever C is), or `TEMPERED_ALIAS_MAX_ENTRIES` at a temperature other than 1 (a
    table built per request); otherwise `ChunkedCDF` (O(sqrt C) per draw, O(C) at a temperature other than 1,
    O(R sqrt C) memory besides `probs`, which it keeps a reference to and reads in place). `alias=True` /
    `False` forces one.
    `temperature` sharpens (< 1) or flattens (> 1) every row: p^(1/temperature), renormalised. Works on the
    device of `probs`."""

    def __init__(self, probs: Tensor, temperature: float = 1.0, *, alias: bool | None = None):
        self.num_cols = probs.shape[1]
        if alias is None:
            limit = ALIAS_MAX_ENTRIES if temperature == 1.0 else TEMPERED_ALIAS_MAX_ENTRIES
            alias = HAVE_NUMBA and probs.shape[0] * probs.shape[1] <= limit
        elif alias and not HAVE_NUMBA:
            raise ValueError("alias tables need numba")
        self.cdf: ChunkedCDF | None = None
        if alias:
            accept, table = alias_kernels.alias_tables(tempered(probs.double().clamp_min(0), temperature))
            self.accept, self.alias = accept.to(probs.device), table.to(probs.device)
        else:
            self.cdf = ChunkedCDF(probs, temperature)

    def draw(self, rows: Tensor, generator: torch.Generator) -> Tensor:
        if self.cdf is not None:
            u = torch.rand(rows.shape, dtype=torch.float64, device=rows.device, generator=generator)
            return self.cdf.invert(rows, u)
        u = torch.rand((2, *rows.shape), dtype=torch.float64, device=rows.device, generator=generator)
        col = (u[0] * self.num_cols).long().clamp_(max=self.num_cols - 1)
        keep = u[1] < self.accept[rows, col]
        return torch.where(keep, col, self.alias[rows, col])


class ChunkedCDF:
    """The inverse CDF of every row of probs (R, C), read where it lies (no copy of `probs`).

    At temperature 1 each row's C columns are cut into chunks of w = ceil(sqrt C) and the table keeps the
    cumulative mass of the chunks, `cum` (R, ceil(C / w)) float64, summed once in O(R C) (by a compiled pass
    over rows on threads, `kernels.alias.chunk_masses`, where numba is present): `invert(rows, u)`
    finds a draw's chunk by binary search on its row's `cum` and its column by a float64 cumulative sum over
    that chunk's w entries, O(sqrt C) per draw. At another temperature (a table built per request,
    `tables_at`) it keeps nothing and weighs each draw's whole row, exp((log p - max log p) / T) (the
    renormalised p^(1/T) without overflow): O(C) per draw, nothing to build (by a compiled pass over the draws on
    threads, `kernels.alias.tempered_draws`, where numba is present). A zero-probability column is never drawn."""

    def __init__(self, probs: Tensor, temperature: float = 1.0):
        C = probs.shape[1]
        self.probs, self.temperature = probs, temperature
        self.cum: Tensor | None = None
        if temperature != 1.0:
            self.width = C
            return
        self.width = math.isqrt(C - 1) + 1  # ceil(sqrt C)
        if self._compiled():
            mass = alias_kernels.chunk_masses(probs, self.width, torch.get_num_threads())
        else:
            mass = self._masses(probs)
        self.cum = mass.cumsum(1)
        self.last_chunk = last_positive(mass)

    def _compiled(self) -> bool:
        """Whether the compiled passes (`kernels.alias`) can read `probs` where it lies."""
        return HAVE_NUMBA and self.probs.device.type == "cpu" and self.probs.dtype in alias_kernels.CHUNK_MASS_DTYPES

    def _masses(self, probs: Tensor) -> Tensor:
        """(R, ceil(C / width)) float64 chunk masses by torch, a slab of rows at a time (any device, dtype)."""
        R, C = probs.shape
        w, full, step = self.width, C // self.width, max(1, SLAB_ENTRIES // C)
        masses = []
        for lo in range(0, R, step):
            slab = probs[lo: lo + step].double().clamp_min(0)
            parts = [slab[:, : full * w].reshape(len(slab), full, w).sum(-1), slab[:, full * w:].sum(1, keepdim=True)]
            masses.append(torch.cat(parts if C % w else parts[:1], 1))
        return torch.cat(masses)

    @property
    def num_cols(self) -> int:
        return self.probs.shape[1]

    def invert(self, rows: Tensor, u: Tensor) -> Tensor:
        """Columns (n,) of the draws u (n,) in [0, 1) from rows `rows` (n,): the first column whose cumulative
        weight exceeds u times the row's total. Draws are taken a slab of rows at a time (bounded memory)."""
        step = max(1, SLAB_ENTRIES // self.width)
        return torch.cat([self._invert(rows[lo: lo + step], u[lo: lo + step]) for lo in range(0, len(rows), step)])

    def _invert(self, rows: Tensor, u: Tensor) -> Tensor:
        if self.cum is None and self._compiled():  # the whole row, weighed now, by a compiled pass
            return alias_kernels.tempered_draws(self.probs, rows, u, self.temperature, torch.get_num_threads())
        if self.cum is None:  # the whole row, weighed now
            chunk = torch.zeros_like(rows)
            w = tempered(self.probs[rows].double().clamp_min(0), self.temperature)
            rest = u * w.sum(1)
        else:
            cum = self.cum[rows]  # (n, chunks)
            target = u * cum[:, -1]
            chunk = torch.searchsorted(cum, target[:, None], right=True).squeeze(1)
            chunk = torch.minimum(chunk, self.last_chunk[rows])  # u * total rounded up to the total
            before = cum.gather(1, (chunk - 1).clamp_min(0)[:, None]).squeeze(1)
            rest = target - torch.where(chunk > 0, before, torch.zeros_like(before))
            cols = chunk[:, None] * self.width + torch.arange(self.width, device=rows.device)  # (n, w)
            w = self.probs[rows[:, None], cols.clamp(max=self.num_cols - 1)].double().clamp_min(0)
            w = torch.where(cols < self.num_cols, w, torch.zeros_like(w))
        col = torch.searchsorted(w.cumsum(1), rest[:, None], right=True).squeeze(1)
        return chunk * self.width + torch.minimum(col, last_positive(w))


def last_positive(w: Tensor) -> Tensor:
    """Index (R,) of the last positive entry of each row of w (R, C) (C - 1 for a row without one): where an
    inverse CDF must stop when u times a row's total rounds up to the total."""
    return (w.shape[1] - 1) - (w > 0).flip(1).int().argmax(1)


def tempered(w: Tensor, temperature: float) -> Tensor:
    """Non-negative weights w (n, C) raised to 1 / temperature per row without overflow or underflow of the
    largest: exp((log w - log max w) / temperature), 0 where w is 0 (unnormalised; w itself at temperature 1)."""
    if temperature == 1.0:
        return w
    return torch.where(w > 0, ((w.log() - w.amax(1, keepdim=True).log()) / temperature).exp(), 0.0)


def draw_rows(w: Tensor, generator: torch.Generator) -> Tensor:
    """One column (n,) per row of non-negative weights w (n, C) (any positive total), by a float64 inverse CDF:
    a zero-weight column is never drawn. O(n C)."""
    cum = w.double().cumsum(1)
    u = torch.rand(len(w), dtype=torch.float64, device=w.device, generator=generator)
    col = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True).squeeze(1)
    return torch.minimum(col, last_positive(w))


def truncated(q: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Next-token probabilities q (n, V) as LM samplers shape them: q^(1/temperature), kept on its `top_k` most
    probable entries and on the fewest most probable entries whose mass reaches `top_p` (the most probable
    always kept; ties in index order), renormalised per row (float64). O(n V log V) with either limit."""
    w = tempered(q.double().clamp_min(0), temperature)
    w = w / w.sum(1, keepdim=True)
    if top_k is None and top_p is None:
        return w
    ranked, order = w.sort(dim=1, descending=True, stable=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if top_k is not None:
        keep[:, top_k:] = False
    if top_p is not None:
        keep &= (ranked.cumsum(1) - ranked) < top_p  # mass before this entry short of top_p
    w = torch.zeros_like(w).scatter_(1, order, torch.where(keep, ranked, 0.0))
    return w / w.sum(1, keepdim=True)


def tables_at(owner: object, temperature: float, build: Callable[[float], T]) -> T:
    """A family's sampling tables, `build(temperature)`. Those at temperature 1 (the default) are built once
    and kept on `owner` (alias tables and chunk masses cost O(table size) to build); other temperatures are
    built per call."""
    if temperature != 1.0:
        return build(temperature)
    kept = owner.__dict__
    if "_sampling_tables_t1" not in kept:
        kept["_sampling_tables_t1"] = build(1.0)
    return kept["_sampling_tables_t1"]


@dataclass
class Samples:
    """Sampled continuations: ids and states (n, L) right-padded with -1, lengths (n,)."""

    ids: Tensor
    states: Tensor
    lengths: Tensor


def slot_to_token(slot: Tensor, z: Tensor, slot_token: Tensor | None) -> Tensor:
    """Token ids (int64) of emission slots drawn in states z (slot_token (Z, W), any integer dtype, maps a
    state's slots to tokens; None: the slot is the token)."""
    return slot if slot_token is None else slot_token[z, slot].long()


def run_sampler(n: int, max_tokens: int, generator: torch.Generator, z: Tensor, stop_id: int | None,
                emit: Callable[[Tensor], Tensor], nxt: Callable[[Tensor], Tensor],
                state_of: Callable[[Tensor], Tensor] = lambda z: z,
                stop_seqs: Sequence[Sequence[int]] = ()) -> Samples:
    """Generic ancestral sampling loop for n samples from first states z (n,): token_t = emit(z_t),
    z_{t+1} = nxt(z_t), up to `max_tokens` tokens; a sample ends after `stop_id` when given, or once its
    tokens complete one of `stop_seqs` (which it keeps: `ops.cut_at_stop` cuts it). Every step draws for all n
    samples, so a sample's draws do not depend on when the others end. O(n max_tokens) draws."""
    device = z.device
    ids = torch.full((n, max_tokens), -1, dtype=torch.long, device=device)
    states = torch.full((n, max_tokens), -1, dtype=torch.long, device=device)
    lengths = torch.full((n,), max_tokens, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    seqs = [torch.tensor(s, dtype=torch.long, device=device) for s in stop_seqs]
    for t in range(max_tokens):
        x = emit(z)
        ids[:, t] = torch.where(done, -1, x)
        states[:, t] = torch.where(done, -1, state_of(z))
        ends = [(~done) & (x == stop_id)] if stop_id is not None else []
        ends += [(~done) & (ids[:, t + 1 - len(s): t + 1] == s).all(1) for s in seqs if len(s) <= t + 1]
        if ends:
            newly = torch.stack(ends).any(0)
            lengths = torch.where(newly, t + 1, lengths)
            done |= newly
            if bool(done.all()):
                break
        if t + 1 < max_tokens:
            z = nxt(z)
    return Samples(ids, states, lengths)
