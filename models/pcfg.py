"""`pcfg` — the rank-space PCFG of Yang, Liu & Tu (2022), §4.2 and App. A.

Symbols: NT nonterminals (binary rules only), PT preterminals (words only), S = NT + PT. The binary-rule
tensor is a CPD of rank r, read as a Bayesian network A -> q -> (B, C):
    p(A -> B C) = sum_q U[A, q] V[q, B] W[q, C]
with U = `parent` (NT, r) rows over ranks, V = `left` (r, S) and W = `right` (r, S) rows over symbols,
E = `emit` (PT, V) rows over words and s = `start` (S,) the start rule (its preterminal entries generate
one-word sentences). Marginalising every state node leaves a grammar over rank variables only, with the
cached products of §4.2 (exported with the artifact, checked against the factors on load):
    rank_left  = V[:, :NT] U   (r, r)   H: left child that is itself a constituent
    rank_right = W[:, :NT] U   (r, r)   I: right child that is a constituent
    word_left  = (V[:, NT:] E)^T (V, r) J: left child that is a word
    word_right = (W[:, NT:] E)^T (V, r) K: right child that is a word
    rank_root  = s[:NT] U      (r,)     L
Inside in rank space: alpha_{i,j} = sum_k left_{i,k} * right_{k,j} with left = H alpha (J for words) and
right = I alpha (K for words), log Z = log(L alpha_{0,n}): O(n^3 r + n^2 r^2) per sentence.
Span marginals by autograd (same order), MBR trees by CKY over them. There is no exact Viterbi: see
`decode_viterbi`. Config: `nt`, `pt`, `rank`, optional `max_length` (default 200).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from latentlm.models.checks import check_distribution, check_positive_ints, check_shape
from latentlm.models.errors import ArtifactError, UnsupportedOperation
from latentlm.models.family import Family, Recipe
from latentlm.models.sampling import CategoricalTable, tables_at
from latentlm.models.tree import DEFAULT_MAX_LENGTH, PCFGOps

FACTORS = ("start", "parent", "left", "right", "emit")
CACHED = ("rank_left", "rank_right", "word_left", "word_right", "rank_root")


def rank_space(start: Tensor, parent: Tensor, left: Tensor, right: Tensor, emit: Tensor) -> dict[str, Tensor]:
    """The cached rank-space products (H, I, J^T, K^T, L) of the factors. O(r^2 NT + V r PT)."""
    nt = parent.shape[0]
    return {"rank_left": left[:, :nt] @ parent, "rank_right": right[:, :nt] @ parent,
            "word_left": (left[:, nt:] @ emit).T.contiguous(), "word_right": (right[:, nt:] @ emit).T.contiguous(),
            "rank_root": start[:nt] @ parent}


def pcfg_tensors(start: Tensor, parent: Tensor, left: Tensor, right: Tensor, emit: Tensor
                 ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Artifact tensors and config of a rank-space PCFG from its factors."""
    t = {"start": start, "parent": parent, "left": left, "right": right, "emit": emit,
         **rank_space(start, parent, left, right, emit)}
    return t, {"nt": parent.shape[0], "pt": emit.shape[0], "rank": parent.shape[1]}


def random_pcfg(nt: int, pt: int, r: int, V: int, seed: int = 0, concentration: float = 1.0
                ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Random rank-space PCFG (Dirichlet-like rows, float64), for tests, benchmarks and demos."""
    from latentlm.models.synthetic import _dirichlet

    g = torch.Generator().manual_seed(seed)
    S = nt + pt
    return pcfg_tensors(_dirichlet((S,), g, concentration), _dirichlet((nt, r), g, concentration),
                        _dirichlet((r, S), g, concentration), _dirichlet((r, S), g, concentration),
                        _dirichlet((pt, V), g, concentration))


class RankPCFG(PCFGOps, Family):
    family = "pcfg"
    operations = frozenset({"score", "posterior", "decode", "sample"})
    decode_methods = frozenset({"mbr"})
    default_method = "mbr"
    recipes = (Recipe("pcfg", {"nt": 30, "pt": 60, "rank": 64, "hidden": 256, "epochs": 5, "batch": 64, "lr": 2e-3},
                      positive=("nt", "pt", "rank", "hidden", "epochs", "batch"), shape=("nt", "pt", "rank", "hidden"),
                      trainer="latentlm.training.pcfg"),)

    def __init__(self, t: dict[str, Tensor], config: dict[str, Any]):
        for k in FACTORS + CACHED:
            setattr(self, k, t[k])
        self.nt, self.pt, self.rank = config["nt"], config["pt"], config["rank"]
        self.max_length = config.get("max_length", DEFAULT_MAX_LENGTH)
        self.device, self.dtype = self.rank_left.device, self.rank_left.dtype
        self.rank_left_t, self.rank_right_t = self.rank_left.T.contiguous(), self.rank_right.T.contiguous()

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        check_positive_ints(config, ("nt", "pt", "rank"), where)
        nt, pt, r = config["nt"], config["pt"], config["rank"]
        S = nt + pt
        for key, shape, dim in (("start", (S,), 0), ("parent", (nt, r), 1), ("left", (r, S), 1),
                                ("right", (r, S), 1), ("emit", (pt, vocab_size), 1)):
            check_distribution(check_shape(tensors, key, shape, where), key, dim, where)
        for key, shape in (("rank_left", (r, r)), ("rank_right", (r, r)), ("word_left", (vocab_size, r)),
                           ("word_right", (vocab_size, r)), ("rank_root", (r,))):
            check_shape(tensors, key, shape, where)
        # the cached products must match the factors (checked on a deterministic subset of rows: O(r S))
        rows = torch.linspace(0, r - 1, steps=min(r, 8)).long().unique()
        words = torch.linspace(0, vocab_size - 1, steps=min(vocab_size, 8)).long().unique()
        f = {k: tensors[k].double() for k in FACTORS}
        sub = rank_space(f["start"], f["parent"], f["left"][rows], f["right"][rows], f["emit"][:, words])
        sub["word_left"], sub["word_right"] = sub["word_left"].T, sub["word_right"].T
        got = {"rank_left": tensors["rank_left"][rows], "rank_right": tensors["rank_right"][rows],
               "word_left": tensors["word_left"][words][:, rows].T,
               "word_right": tensors["word_right"][words][:, rows].T, "rank_root": tensors["rank_root"]}
        for key in CACHED:
            err = (got[key].double() - sub[key]).abs().max().item()
            if not err <= 1e-4:
                raise ArtifactError(f"{where}: cached tensor {key!r} does not match the product of the stored "
                                    f"factors (max error {err:.3g})", param=key)

    @property
    def chart_width(self) -> int:
        return self.rank

    def describe(self) -> dict[str, Any]:
        return {"num_states": self.num_states, "nt": self.nt, "pt": self.pt, "rank": self.rank,
                "max_length": self.max_length}

    # -- rank-space contraction -----------------------------------------------------------------------
    def leaves(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(B, n) -> J and K columns of the words, (B, n, r) each."""
        return self.word_left[ids], self.word_right[ids]

    def project(self, alpha: Tensor) -> tuple[Tensor, Tensor]:
        """(B, m, r) -> (H alpha, I alpha): two (B m, r) x (r, r) GEMMs."""
        return alpha @ self.rank_left_t, alpha @ self.rank_right_t

    def combine(self, left: Tensor, right: Tensor) -> Tensor:
        """sum_k left_k * right_k: O(k r) per span."""
        return (left * right).sum(2)

    def root(self, alpha: Tensor) -> Tensor:
        return alpha @ self.rank_root

    def root_leaf(self, ids: Tensor) -> Tensor:
        return self.start[self.nt :] @ self.emit[:, ids]

    def decode_viterbi(self, seqs: list[list[int]]) -> list[dict]:
        raise UnsupportedOperation(NO_VITERBI, param="method")

    # -- sampling: A -> q ~ U[A] -> (B ~ V[q], C ~ W[q]) ------------------------------------------------
    def _tables(self, temperature: float):
        return tuple(CategoricalTable(t, temperature)
                     for t in (self.start[None], self.parent, self.left, self.right, self.emit))

    def sampling_tables(self, temperature: float):
        root, parent, left, right, emit = tables_at(self, temperature, self._tables)

        def expand(a: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
            q = parent.draw(a, g)
            return left.draw(q, g), right.draw(q, g)

        return root, expand, lambda t, g: emit.draw(t, g)


__all__ = ["RankPCFG", "pcfg_tensors", "random_pcfg", "rank_space"]


NO_VITERBI = (
    "method: a rank-space PCFG has no exact Viterbi decoding. Its chart holds sums over the rank variables, and "
    "max does not distribute over those sums (max over trees of sum over q is not sum over q of max), so the best "
    "labelled tree needs the state-space chart (O(n^3 S^2 NT) via the full rule tensor), which this family never "
    "builds. Use method 'mbr' (CKY over span marginals, as in Yang et al. 2022).")
RankPCFG.decode_notes = {"viterbi": NO_VITERBI}
