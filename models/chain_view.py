"""A chain family as the product recursions of `models.constrained` read it: S states with a start, a transition
(S, S) and emissions B (S, V). Each chain family supplies its view (`ChainFamily.constraint_view`): `DenseView` reads
the dense tensors (hmm, tagging_hmm; rank_hmm its rank-space ones), a family with another layout subclasses
`ChainView` next to its class (blocked_hmm's k-sparse emissions). This module imports no family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from latentlm.models.sampling import slot_to_token

SLAB_ENTRIES = 1 << 22  # entries of a temporary (rows x S) product before it is cut into slabs


class ChainView:
    """A chain family as S states with a start, a transition (S, S) and emissions B (S, V); subclasses read each
    family's own tensors and hooks. `a` arguments are predictive distributions (n, S)."""

    model: Any  # the `ChainFamily` it views (`models.base` imports this module, not the other way round)
    S: int
    dtype: torch.dtype
    device: torch.device

    @property
    def vocab_size(self) -> int:
        """V: the words B has a column for."""
        raise NotImplementedError

    def start(self) -> Tensor:
        """p(z_1) (S,)."""
        raise NotImplementedError

    def predictive(self, prefix: list[int]) -> Tensor:
        """p(z_{n+1} | prefix) (S,), unnormalised (the chain engine's filter): the family's `predictive` where the
        view's states are the model's."""
        return self.model.predictive(prefix)

    def trans_apply(self, X: Tensor) -> Tensor:
        """A @ X: (S, n) -> (S, n). O(S^2 n)."""
        raise NotImplementedError

    def emission(self, word: int) -> Tensor:
        """B(., word) (S,)."""
        raise NotImplementedError

    def masked_mass(self, mask: Tensor) -> Tensor:
        """sum of B(., v) over the words v with mask[v] (V,) bool, by a masked row sum (S,)."""
        raise NotImplementedError

    def class_mass(self, cls: Tensor, C: int) -> Tensor:
        """(S, C): column c = sum of B(., v) over the words v of class c (cls (V,), -1 = in no class), accumulated
        in float64 in one pass over B (a scatter-add of its columns by class, never 1 - a sum)."""
        raise NotImplementedError

    def token_probs(self, a: Tensor) -> Tensor:
        """(n, S) -> (n, V): sum_z a(z) B(z, v)."""
        raise NotImplementedError

    def scores_at(self, a: Tensor, words: Tensor, M: Tensor, cols: Tensor) -> Tensor:
        """sum_z a[i, z] B(z, words[i]) M[z, cols[i]] (R,) for a (R, S), words (R,), M (S, C), cols (R,)."""
        raise NotImplementedError

    def condition(self, a: Tensor, words: Tensor) -> Tensor:
        """The next predictive after each row reads its word: (a * B(., w)) A, normalised (n, S); a row whose
        word has probability 0 comes back as zeros."""
        raise NotImplementedError

    def trans_rows(self, z: Tensor) -> Tensor:
        """A[z, :] (n, S) in the view's dtype (read where they lie)."""
        raise NotImplementedError

    def draw_words(self, z: Tensor, generator: torch.Generator) -> Tensor:
        """One word per state z (n,) from B(z, .), by the family's sampling tables (built once per model) where the
        view's states are the model's."""
        _, emit_table, slot_token = self.model.sampling_tables(1.0)
        return slot_to_token(emit_table.draw(z, generator), z, slot_token)


class DenseView(ChainView):
    """S states read from dense tensors: `start` (S,), `trans` (S, S), `emit` (S, V) and `emit_by_word` (V, S) (a row
    per word; default: emit's contiguous transpose). hmm and tagging_hmm give theirs (the tag factor sums to 1 for
    word constraints); rank_hmm its rank-space rank_start, rank_trans and emissions (`rank_hmm.RankView`)."""

    def __init__(self, model: Any, start: Tensor, trans: Tensor, emit: Tensor,
                 emit_by_word: Tensor | None = None):
        self.model = model
        self.init, self.trans, self.emit = start, trans, emit
        self.emit_by_word = emit.T.contiguous() if emit_by_word is None else emit_by_word
        self.S, self.dtype, self.device = self.trans.shape[0], self.trans.dtype, self.trans.device

    @property
    def vocab_size(self) -> int:
        return int(self.emit.shape[1])

    def start(self) -> Tensor:
        return self.init

    def trans_apply(self, X: Tensor) -> Tensor:
        return self.trans @ X

    def emission(self, word: int) -> Tensor:
        return self.emit[:, word]

    def masked_mass(self, mask: Tensor) -> Tensor:
        """Accumulated in float64 a slab of rows at a time (a float32 sum of 10^4 terms loses ~1e-5)."""
        out = torch.empty(self.S, dtype=torch.float64, device=self.device)
        m = mask.to(torch.float64)
        step = max(1, SLAB_ENTRIES // self.emit.shape[1])
        for lo in range(0, self.S, step):
            out[lo: lo + step] = self.emit[lo: lo + step].double() @ m
        return out.to(self.dtype)

    def class_mass(self, cls: Tensor, C: int) -> Tensor:
        keep = (cls >= 0).nonzero().squeeze(1)
        idx = cls[keep]
        out = torch.empty(self.S, C, dtype=torch.float64, device=self.device)
        step = max(1, SLAB_ENTRIES // self.emit.shape[1])
        for lo in range(0, self.S, step):
            rows = self.emit[lo: lo + step][:, keep].double()
            out[lo: lo + step] = torch.zeros(len(rows), C, dtype=torch.float64, device=self.device).index_add_(
                1, idx, rows)
        return out.to(self.dtype)

    def token_probs(self, a: Tensor) -> Tensor:
        return a @ self.emit

    def scores_at(self, a: Tensor, words: Tensor, M: Tensor, cols: Tensor) -> Tensor:
        out = torch.empty(len(a), dtype=self.dtype, device=self.device)
        step = max(1, SLAB_ENTRIES // self.S)
        for lo in range(0, len(a), step):
            sl = slice(lo, lo + step)
            out[sl] = (a[sl] * self.emit_by_word[words[sl]] * M[:, cols[sl]].T).sum(-1)
        return out

    def condition(self, a: Tensor, words: Tensor) -> Tensor:
        alpha = a * self.emit_by_word[words]
        return normalised(alpha) @ self.trans

    def trans_rows(self, z: Tensor) -> Tensor:
        return self.trans[z]


def normalised(alpha: Tensor) -> Tensor:
    """Rows of alpha (n, S) divided by their sums; a row of sum 0 stays zeros."""
    total = alpha.sum(1, keepdim=True)
    return torch.where(total > 0, alpha / torch.where(total > 0, total, 1), 0)
