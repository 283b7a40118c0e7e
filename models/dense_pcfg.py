"""`dense_pcfg` — a small full-rank PCFG (rules stored as one tensor) for grammars a user writes or imports.

Symbols 0..NT-1 are nonterminals (binary rules A -> B C, B and C any symbol), NT..NT+PT-1 preterminals
(T -> word). Artifact tensors: `start` (NT+PT,) the start rule S -> A (preterminal entries generate the
one-word sentences), `rules` (NT, NT+PT, NT+PT) with each rules[A] summing to 1, `emit` (PT, V) rows
summing to 1. Config: `nt`, `pt`, optional `max_length` (default 200) and `symbols` (NT+PT names).

Costs per sentence of n words, S = NT + PT: inside and span marginals O(n^3 S^2 + n^2 NT S^2);
exact Viterbi (max-product) O(n^3 S^2 + n^2 NT S^2) time with O(NT S^2) memory per span.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from latentlm.models.checks import check_distribution, check_positive_ints, check_shape
from latentlm.models.errors import ArtifactError
from latentlm.models.family import Family, Importer, Option
from latentlm.models.grammar_text import read_grammar_file
from latentlm.models.results import Parse
from latentlm.models.sampling import CategoricalTable
from latentlm.models.tree import DEFAULT_MAX_LENGTH, PCFGOps, bracket, by_length, check_possible, viterbi


class DensePCFG(PCFGOps, Family):
    family = "dense_pcfg"
    operations = frozenset({"score", "posterior", "decode", "sample"})
    decode_methods = frozenset({"mbr", "viterbi"})
    default_method = "mbr"
    importers = (Importer("import-pcfg", "import a plain-text PCFG (one 'LHS -> RHS PROB' rule per line)", "FILE",
                          lambda path, start=None: read_grammar_file(path, start),
                          (Option("start", None, "start symbol (default: the first rule's left-hand side)"),)),)
    viterbi_elems = 1 << 24  # B * m * NT * S^2 entries per max-product step


    def split_cost(self) -> int:
        """A dense split contracts every binary rule: nt x S^2."""
        S = self.nt + self.pt
        return self.nt * S * S

    def __init__(self, t: dict[str, Tensor], config: dict[str, Any]):
        self.start, self.rules, self.emit = t["start"], t["rules"], t["emit"]
        self.nt, self.pt = config["nt"], config["pt"]
        self.max_length = config.get("max_length", DEFAULT_MAX_LENGTH)
        self.names = config.get("symbols")
        self.device, self.dtype = self.rules.device, self.rules.dtype
        S = self.nt + self.pt
        self.rules_flat = self.rules.reshape(self.nt, S * S)

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        check_positive_ints(config, ("nt", "pt"), where)
        nt, pt = config["nt"], config["pt"]
        S = nt + pt
        check_distribution(check_shape(tensors, "start", (S,), where), "start", 0, where)
        rules = check_shape(tensors, "rules", (nt, S, S), where)
        check_distribution(rules.reshape(nt, S * S), "rules", 1, where)
        check_distribution(check_shape(tensors, "emit", (pt, vocab_size), where), "emit", 1, where)
        names = config.get("symbols")
        if names is not None and (not isinstance(names, list) or len(names) != S
                                  or not all(isinstance(x, str) and x for x in names)):
            raise ArtifactError(f"{where}: config 'symbols' must list {S} non-empty names", param="symbols")

    @property
    def chart_width(self) -> int:
        return self.nt + self.pt

    def describe(self) -> dict[str, Any]:
        return {"num_states": self.num_states, "nt": self.nt, "pt": self.pt, "max_length": self.max_length}

    def symbol_name(self, i: int) -> str:
        return self.names[i] if self.names else super().symbol_name(i)

    # -- sum-product contraction (probability space, child space = all S symbols) ---------------------
    def leaves(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(B, n) -> (B, n, S) messages [0 (NT), p(word | T) (PT)], same for left and right."""
        e = self.emit.T[ids]
        x = torch.cat([e.new_zeros(*e.shape[:-1], self.nt), e], -1)
        return x, x

    def project(self, alpha: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.cat([alpha, alpha.new_zeros(*alpha.shape[:-1], self.pt)], -1)
        return x, x

    def combine(self, left: Tensor, right: Tensor) -> Tensor:
        """sum_k outer(left_k, right_k) contracted with the rules: O(k S^2 + NT S^2) per span."""
        B, m = left.shape[:2]
        outer = torch.einsum("bmkx,bmky->bmxy", left, right).reshape(B * m, -1)
        return (outer @ self.rules_flat.T).reshape(B, m, self.nt)

    def root(self, alpha: Tensor) -> Tensor:
        return alpha @ self.start[: self.nt]

    def root_leaf(self, ids: Tensor) -> Tensor:
        return self.start[self.nt :] @ self.emit[:, ids]

    # -- max-product contraction (log space) ----------------------------------------------------------
    @cached_property
    def _logs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.start.log(), self.rules.log(), self.emit.log()

    def log_leaves(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        e = self._logs[2].T[ids]
        x = torch.cat([e.new_full((*e.shape[:-1], self.nt), float("-inf")), e], -1)
        return x, x

    def log_project(self, alpha: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.cat([alpha, alpha.new_full((*alpha.shape[:-1], self.pt), float("-inf"))], -1)
        return x, x

    def max_combine(self, left: Tensor, right: Tensor) -> Tensor:
        """max_{k,B,C} left_k[B] + right_k[C] + log R[A,B,C]: O(k S^2 + NT S^2) per span."""
        best = (left.unsqueeze(-1) + right.unsqueeze(-2)).max(2).values  # (B, m, S, S)
        return (best.unsqueeze(2) + self._logs[1]).flatten(-2).max(-1).values

    def log_root(self, alpha: Tensor) -> Tensor:
        return (alpha + self._logs[0][: self.nt]).max(-1).values

    def log_root_leaf(self, leaf: Tensor) -> Tensor:
        return (leaf + self._logs[0]).max(-1).values

    # -- Viterbi --------------------------------------------------------------------------------------
    def decode_viterbi(self, seqs: list[list[int]]) -> list[Parse]:
        """Best labelled tree and log p(x, tree) per sentence (leaves are token ids)."""
        S = self.nt + self.pt
        res: list[Parse | None] = [None] * len(seqs)
        for idx in by_length(seqs, self.max_length, self.viterbi_elems, self.nt * S * S):
            n = len(seqs[idx[0]])
            best, labels, word_labels = viterbi(self, self._ids(seqs, idx))
            check_possible(best, idx)
            labels, word_labels = labels.cpu(), word_labels.cpu()
            for r, i in enumerate(idx):
                spans = {(int(s), int(s) + w + 1): self.symbol_name(int(labels[r, w, s]))
                         for w, s in (labels[r] >= 0).nonzero().tolist() if w >= 1}
                if n == 1:
                    spans = {}
                tree = bracket(n, spans, [str(t) for t in seqs[i]],
                               [self.symbol_name(int(x)) for x in word_labels[r]])
                res[i] = Parse(tree, sorted(spans), logprob=float(best[r]))
        return res  # type: ignore[return-value]

    # -- sampling -------------------------------------------------------------------------------------
    def sampling_tables(self, temperature: float):
        """(root table over S, expand A -> (B, C), emit T -> word) with `temperature` on each table."""
        S = self.nt + self.pt
        root = CategoricalTable(self.start[None], temperature)
        rules = CategoricalTable(self.rules_flat, temperature)
        emit = CategoricalTable(self.emit, temperature)

        def expand(a: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
            bc = rules.draw(a, g)
            return bc // S, bc % S

        return root, expand, lambda t, g: emit.draw(t, g)


def random_dense_pcfg(nt: int, pt: int, V: int, seed: int = 0, concentration: float = 1.0,
                      leaf_bias: float = 0.0) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Random dense PCFG (float64). `leaf_bias` > 0 multiplies the weight of rules whose children are
    preterminals by exp(leaf_bias), keeping sampled sentences short (subcritical grammars)."""
    from latentlm.models.synthetic import _gamma

    g = torch.Generator().manual_seed(seed)
    S = nt + pt
    start = _gamma((S,), g, concentration)
    rules = _gamma((nt, S, S), g, concentration)
    if leaf_bias:
        is_pt = (torch.arange(S) >= nt).double()
        rules = rules * torch.exp(leaf_bias * (is_pt[:, None] + is_pt[None, :]))
    emit = _gamma((pt, V), g, concentration)
    t = {"start": start / start.sum(), "rules": rules / rules.sum((1, 2), keepdim=True),
         "emit": emit / emit.sum(1, keepdim=True)}
    return t, {"nt": nt, "pt": pt}


def dense_from_factors(start: Tensor, parent: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """The rules tensor (NT, S, S) of a rank-space PCFG: R[A, B, C] = sum_q U[A, q] V[q, B] W[q, C].
    O(NT S^2 r) — for tests and small grammars only."""
    del start
    return torch.einsum("aq,qb,qc->abc", parent, left, right)


__all__ = ["DensePCFG", "dense_from_factors", "random_dense_pcfg"]
