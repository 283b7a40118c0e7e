"""Sampling shared by every family: categorical tables drawn in O(1) per sample, and the ancestral sampling
loop of the HMM-like families.

`CategoricalTable` draws from many categorical distributions at once (alias tables built by a compiled
kernel, `kernels.alias`; without numba, inverse CDF by binary search on one flat array). `run_sampler`
is the generic loop token_t = emit(z_t), z_{t+1} = nxt(z_t) for n samples at once; the tree engine
(`models.tree`) draws its rules from the same tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from latentlm.models.kernels import alias as alias_kernels
from latentlm.models.kernels.jit import HAVE_NUMBA

T = TypeVar("T")


class CategoricalTable:
    """Draws from many categorical distributions at once: probs (R, C), rows summing to 1 ->
    `draw(rows (n,), generator) -> (n,)` column indices.

    With alias tables (Walker/Vose, built once in O(R C) by a compiled kernel; the default where numba is
    present) a draw is one uniform column and one biased coin, O(1) per sample whatever C is, on any
    device; `alias=False` (or no numba) draws by inverse CDF, O(log(R C)) per sample. `temperature`
    sharpens (< 1) or flattens (> 1) every row: p^(1/temperature), renormalised."""

    def __init__(self, probs: Tensor, temperature: float = 1.0, *, alias: bool | None = None):
        p = probs.double()
        if temperature != 1.0:
            p = torch.softmax(p.clamp_min(0).log() / temperature, dim=-1)
        self.num_cols = p.shape[1]
        if alias is None:
            alias = HAVE_NUMBA
        elif alias and not HAVE_NUMBA:
            raise ValueError("alias tables need numba")
        if alias:
            accept, table = alias_kernels.alias_tables(p)
            self.accept, self.alias = accept.to(probs.device), table.to(probs.device)
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


def tables_at(owner: object, temperature: float, build: Callable[[float], T]) -> T:
    """A family's sampling tables, `build(temperature)`. Those at temperature 1 (the default) are built once
    and kept on `owner` (alias tables cost O(table size) to build); other temperatures are built per call."""
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
    """Token ids of emission slots drawn in states z (slot_token (Z, W) maps a state's slots to tokens; None:
    the slot is the token)."""
    return slot if slot_token is None else slot_token[z, slot]


def run_sampler(n: int, max_tokens: int, generator: torch.Generator, z: Tensor, stop_id: int | None,
                emit: Callable[[Tensor], Tensor], nxt: Callable[[Tensor], Tensor],
                state_of: Callable[[Tensor], Tensor] = lambda z: z) -> Samples:
    """Generic ancestral sampling loop for n samples from first states z (n,): token_t = emit(z_t),
    z_{t+1} = nxt(z_t), up to `max_tokens` tokens; a sample ends after `stop_id` when given. O(n max_tokens)
    draws."""
    device = z.device
    ids = torch.full((n, max_tokens), -1, dtype=torch.long, device=device)
    states = torch.full((n, max_tokens), -1, dtype=torch.long, device=device)
    lengths = torch.full((n,), max_tokens, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for t in range(max_tokens):
        x = emit(z)
        ids[:, t] = torch.where(done, -1, x)
        states[:, t] = torch.where(done, -1, state_of(z))
        if stop_id is not None:
            newly = (~done) & (x == stop_id)
            lengths = torch.where(newly, t + 1, lengths)
            done |= newly
            if bool(done.all()):
                break
        if t + 1 < max_tokens:
            z = nxt(z)
    return Samples(ids, states, lengths)
