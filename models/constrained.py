"""Exact inference on the product of a chain family (hmm, blocked_hmm, rank_hmm, tagging_hmm) and a constraint's
automaton (`models.constraint.WordDFA`): the probability that a continuation satisfies the constraint, exact
conditional sampling, a guide for neural LMs, and a constrained beam search.

Its length (over 600 lines) is earned: the four uses share one set of backward messages and one view of each
family's step, and keeping the recursion, its two samplers, the guide and the beam search beside the messages they
read keeps their exactness argument (below) in one place.

Semantics. With prefix x, a continuation y = y_1 .. y_L is complete when it emits `<eos>` (y_L, the first one);
    P(C | x) = sum over complete y with min_tokens <= L <= max_tokens that satisfy C of p(y | x).
The automaton reads the content words y_1 .. y_{L-1}; `<eos>` is its acceptance test.

Recursion (float64 log-scales; S = the chain's states: Z for hmm / tagging_hmm / blocked_hmm, the rank r for
rank_hmm, which runs as the r-state HMM of its rank variables; Lmax = max_tokens):
    W_j(z, q) = [Lmin <= j+1 <= Lmax] [q accepting] B(z, eos)
                + [j+1 < Lmax] sum_{q' successor of q} e_{q,q'}(z) M_{j+1}(z, q'),     M_{j+1} = A W_{j+1},
where e_{q,q'}(z) = sum of B(z, v) over the words v taking q to q' (the named words one by one, every other word
at once by a masked row sum: OTHER), so a step costs one (S x S) x (S x Q_live) product plus O(E S) for the E
live edges: O(Lmax (Q S^2 + E S)) per request, never a (S Q) x (S Q) matrix. W_j(z, q) is the probability that
the continuation completes validly given state z emits token j+1 and the automaton is in q after j tokens.
Every column is kept as W = What exp(sigma): What's column maximum is 1 (in the model's dtype), sigma float64
(values for different automaton states differ by many orders of magnitude: one scale per step is not enough
in float32); only (j, q) pairs that are reachable and can still accept in the window (`WordDFA.live`) are
computed. A blocked HMM multiplies by its stored Z x Z matrix where it lies (row slabs widened only when it is
stored in bfloat16); its emissions are k-sparse (`e` columns and `B(., word)` touch one cluster's k states) and
its filter after a word is O(k Z) (its own `_condition` / `_propagate`); token scores read each word's k states.
The messages (`Messages`: What_j, sigma_j and M_j over the live states) depend on neither the prefix nor the
samples: computed once per (model, constraint, temperature) and reused by every call below. The stored Z x Z matrix
is read in full at every backward step (the next word is unknown, so no k x k block suffices there): the backward
of a blocked HMM costs what a dense one does; its savings are in the emissions, the filter and the sampler.

With a_j(z) = p(z_{n+j+1} = z | x, y_<=j) (the plain predictive filter: the constraint lives only in W):
    s_j(v)   = P(y_{j+1} = v, C | x, y_<=j) = sum_z a_j(z) B(z, v) M_{j+1}(z, delta(q_j, v))   (v content)
    s_j(eos) = [Lmin <= j+1 <= Lmax] [q_j accepting] sum_z a_j(z) B(z, eos)
    sum_v s_j(v) = P(C | x, y_<=j);   the guide's weight g_j(v) = s_j(v) / p(v | x, y_<=j) = P(C | x, y_<=j, v).
All words of class OTHER share one column of M: their scores are one product (a_j * M(., q_OTHER)) B.
An automaton over the text of a model that carries its LM's tokenizer (`models.text_constraint.TextDFA`) has
classes of any token ids (`class_layout`): their emissions Bc come from one scatter-add pass over B
(`ChainView.class_mass`, never 1 - a sum), next-token scores from one product holding a row per (automaton state,
successor reached by many tokens) (`_class_scores`), and the samplers draw a token within any multi-token class as
within OTHER.

Usage:
    dfa = constraint.compile_constraint(constraint.parse_constraint(spec, vocab), vocab)   # 422 / 413 cases
    msgs = constrained.prepare(model, dfa, temperature=1.0)
    msgs.log_prob(prefix_ids); constrained.sample(msgs, n, generator, prefix=prefix_ids)
    guide = constrained.Guide(msgs, [prefix_ids]); guide.weights(); guide.advance([token])

Entry points (all on the model's device, in its dtype, with float64 where results are reported):
- `prepare(model, dfa, temperature=1.0) -> Messages`: the backward messages. O(Lmax (Q_live S^2 + E S) + S V).
- `Messages.log_prob(prefix) -> float | None`: log P(C | prefix) (None for probability 0). O(prefix S^2).
- `sample(messages, n, generator, prefix, method)`: n continuations drawn exactly from p(y | prefix, y complete,
  y satisfies C); InputError naming `constraint` when P(C | prefix) = 0. "states" (default): state then token,
  O(S + D) per token and sample; "tokens": each token from its marginal s_j, O(S V + S^2) (blocked O(k V + k Z)).
- `Guide(messages, prefixes)`: incremental handle for n sequences: `weights()` -> (n, V) g_j(v), `advance(tokens)`
  one filter step each (no rescan of the tokens so far).
- `beam_search(messages, prefix, beam, n_best)`: hypotheses ranked by p(h | x) P(C | x, h) (model x exact
  lookahead), which bounds every completion's log p(y | x) from above; `certified` when the best found
  completions are provably the most probable constrained strings.
- `estimate_cost(model, dfa, ...)`: the work of a request in multiply-adds, and `table_bytes(model, dfa)` the
  memory of its messages, known before any work.
Temperature tempers the model before conditioning (`tempered`: start, transition rows and emission rows each
raised to 1/T and renormalised; rank_hmm: its rank-space start, step and emissions), so draws are exact from the
constrained distribution of a well-defined HMM. This is not p(y | x)^(1/T), which does not factor over states.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from latentlm.models.base import Batch, ChainFamily, check_continuable
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.constraint import WordDFA
from latentlm.models.errors import InputError, LimitExceeded, UnsupportedOperation
from latentlm.models.hmm import DenseHMM
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.sampling import draw_rows, slot_to_token, tables_at
from latentlm.models.sampling import tempered as tempered_rows

FAMILIES = ("hmm", "blocked_hmm", "rank_hmm", "tagging_hmm")
SLAB_ENTRIES = 1 << 22  # entries of a temporary (rows x S) product before it is cut into slabs
DEFAULT_MAX_TABLE_BYTES = 4 << 30  # messages of one request (a setting of the service)
STEP_OVERHEAD = 3_000_000  # cost units per interpreter-level step (the service's per-step sampling overhead)


# -- each family as the recursions see it ---------------------------------------------------------------
class ChainView:
    """A chain family as S states with a start, a transition (S, S) and emissions B (S, V); subclasses read each
    family's own tensors and hooks. `a` arguments are predictive distributions (n, S)."""

    model: ChainFamily
    S: int
    dtype: torch.dtype
    device: torch.device

    def start(self) -> Tensor:
        """p(z_1) (S,)."""
        raise NotImplementedError

    def predictive(self, prefix: list[int]) -> Tensor:
        """p(z_{n+1} | prefix) (S,), unnormalised (the chain engine's filter)."""
        raise NotImplementedError

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
        """One word per state z (n,) from B(z, .), by the family's sampling tables (built once per model)."""
        raise NotImplementedError


class DenseView(ChainView):
    """hmm and tagging_hmm (the tag factor sums to 1 for word constraints): start, trans (Z, Z), emit (Z, V);
    rank_hmm in rank space: rank_start, rank_trans (r, r), emissions emit.T (r, V)."""

    def __init__(self, model: ChainFamily):
        self.model = model
        if isinstance(model, RankHMM):
            self.init, self.trans, self.emit_by_word = model.rank_start, model.rank_trans, model.emit  # (V, r)
            self.emit = model.emit.T  # (r, V)
        else:
            assert isinstance(model, DenseHMM)
            self.init, self.trans, self.emit, self.emit_by_word = model.start, model.trans, model.emit, \
                model.emit_by_word
        self.S, self.dtype, self.device = self.trans.shape[0], self.trans.dtype, self.trans.device

    def start(self) -> Tensor:
        return self.init

    def predictive(self, prefix: list[int]) -> Tensor:
        if isinstance(self.model, RankHMM):  # the chain engine runs rank_hmm in rank space
            return self.model.filtered_last(Batch.from_lists([prefix], self.device))[0] @ self.trans
        return self.model.predictive(prefix)

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
        return _normalised(alpha) @ self.trans

    def trans_rows(self, z: Tensor) -> Tensor:
        return self.trans[z]

    def draw_words(self, z: Tensor, generator: torch.Generator) -> Tensor:
        if isinstance(self.model, RankHMM):  # the rank variables' word table (rank_hmm's own sampler's)
            words = tables_at(self.model, 1.0, self.model._tables)[0]
            return words.draw(z, generator)
        _, emit_table, slot_token = self.model.sampling_tables(1.0)
        return slot_to_token(emit_table.draw(z, generator), z, slot_token)


class BlockedView(ChainView):
    """blocked_hmm: Z = M k states; B(z, v) = emit[v, i] for z = cluster(v) k + i, else 0."""

    def __init__(self, model: BlockedHMM):
        self.model = model
        self.S, self.dtype, self.device = model.num_states, model.dtype, model.device
        self.k = model.k

    def start(self) -> Tensor:
        return self.model.start

    def predictive(self, prefix: list[int]) -> Tensor:
        return self.model.predictive(prefix)

    def trans_apply(self, X: Tensor) -> Tensor:
        trans = self.model.trans
        if trans.dtype == self.dtype:
            return trans @ X
        out = torch.empty(self.S, X.shape[1], dtype=self.dtype, device=self.device)
        step = max(self.k, SLAB_ENTRIES // self.S)  # rows widened a slab at a time (bfloat16 storage)
        for lo in range(0, self.S, step):
            out[lo: lo + step] = trans[lo: lo + step].to(self.dtype) @ X
        return out

    def _states(self, words: Tensor) -> Tensor:
        """(R, k) state ids of each word's cluster."""
        return self.model.word_cluster[words][:, None] * self.k + torch.arange(self.k, device=self.device)

    def emission(self, word: int) -> Tensor:
        col = torch.zeros(self.S, dtype=self.dtype, device=self.device)
        c = int(self.model.word_cluster[word])
        col[c * self.k: (c + 1) * self.k] = self.model.emit[word]
        return col

    def masked_mass(self, mask: Tensor) -> Tensor:
        m = self.model
        mass = torch.zeros(m.M, self.k, dtype=torch.float64, device=self.device)  # float64 sums
        mass.index_add_(0, m.word_cluster[mask], m.emit[mask].double())
        return mass.view(-1).to(self.dtype)

    def class_mass(self, cls: Tensor, C: int) -> Tensor:
        m = self.model
        keep = (cls >= 0).nonzero().squeeze(1)
        states = self._states(keep)  # (n, k): B(z, v) != 0 only on v's cluster
        flat = (states * C + cls[keep][:, None]).reshape(-1)
        mass = torch.zeros(self.S * C, dtype=torch.float64, device=self.device)
        mass.index_add_(0, flat, m.emit[keep].double().reshape(-1))
        return mass.view(self.S, C).to(self.dtype)

    def token_probs(self, a: Tensor) -> Tensor:
        return self.model._token_probs(a)

    def scores_at(self, a: Tensor, words: Tensor, M: Tensor, cols: Tensor) -> Tensor:
        idx = self._states(words)
        return (a.gather(1, idx) * self.model.emit[words].to(self.dtype) * M[idx, cols[:, None]]).sum(-1)

    def condition(self, a: Tensor, words: Tensor) -> Tensor:
        alpha, ids = self.model._condition(a, words)
        return self.model._propagate(_normalised(alpha), ids)

    def trans_rows(self, z: Tensor) -> Tensor:
        return self.model.trans[z].to(self.dtype)

    def draw_words(self, z: Tensor, generator: torch.Generator) -> Tensor:
        _, emit_table, slot_token = self.model.sampling_tables(1.0)
        return slot_to_token(emit_table.draw(z, generator), z, slot_token)


def _normalised(alpha: Tensor) -> Tensor:
    total = alpha.sum(1, keepdim=True)
    return torch.where(total > 0, alpha / torch.where(total > 0, total, 1), 0)


def view_of(model: Any) -> ChainView:
    """The `ChainView` of a chain family; UnsupportedOperation naming the family otherwise."""
    if isinstance(model, BlockedHMM):
        return BlockedView(model)
    if isinstance(model, (DenseHMM, RankHMM)):
        return DenseView(model)
    family = getattr(model, "family", type(model).__name__)
    raise UnsupportedOperation(f"constraints are answered by the chain families ({', '.join(FAMILIES)}), not by "
                               f"{family!r}", param="constraint")


# -- temperature: a tempered copy of the model ---------------------------------------------------------------
def tempered(model: ChainFamily, temperature: float) -> ChainFamily:
    """The model with each factor tempered: start, each transition row and each state's emission distribution
    raised to 1 / temperature and renormalised (blocked: a state's distribution over its cluster's words;
    rank_hmm: the rank-space start, step and emissions, which define the HMM its chain runs). The model itself
    at temperature 1. O(size of the model's tensors)."""
    if temperature == 1.0:
        return model
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InputError(f"temperature: must be a positive number, got {temperature}", param="temperature")
    dtype = model.dtype

    def rows(w: Tensor) -> Tensor:
        t = tempered_rows(w.to(torch.float64).clamp_min(0), temperature)
        return (t / t.sum(1, keepdim=True)).to(dtype)

    if isinstance(model, BlockedHMM):
        emit = model.emit.to(torch.float64)
        logs = torch.where(emit > 0, emit.log(), -math.inf) / temperature
        top = torch.full((model.M, model.k), -math.inf, dtype=torch.float64, device=model.device)
        top = top.scatter_reduce(0, model.word_cluster[:, None].expand(-1, model.k), logs, "amax")
        w = (logs - top[model.word_cluster]).exp()
        sums = torch.zeros_like(top).index_add_(0, model.word_cluster, w)
        emit_t = (w / sums[model.word_cluster]).to(dtype)
        return BlockedHMM(rows(model.start[None])[0], rows(model.trans), emit_t, model.word_cluster, model.M)
    if isinstance(model, RankHMM):
        t = {"start": model.start, "state_in": model.state_in, "state_out": model.state_out,
             "rank_start": rows(model.rank_start[None])[0], "rank_trans": rows(model.rank_trans),
             "emit": rows(model.emit.T).T.contiguous()}
        return RankHMM(t)
    if isinstance(model, DenseHMM):
        return DenseHMM(rows(model.start[None])[0], rows(model.trans), rows(model.emit))
    return model


def class_layout(dfa: WordDFA) -> tuple[np.ndarray, bool]:
    """(words (C,): the word of each one-word class, -1 for a class of several words; general: the classes are any
    sets of token ids (a `models.text_constraint.TextDFA`, which says `class_words`), not a word-level automaton's K
    one-word classes and OTHER (class K), whose next-token scores go through OTHER's column for every word at once
    and then fix the named words)."""
    words = getattr(dfa, "class_words", None)
    if words is None:
        return np.concatenate([dfa.special, [-1]]).astype(np.int64), False
    return words, True


def eos_allowed(j: int, lo: int, hi: int) -> bool:
    """Whether `<eos>` may be token j+1: the continuation's length j+1 (counting it) lies in [lo, hi]."""
    return lo <= j + 1 <= hi


# -- the backward messages ---------------------------------------------------------------------------------
@dataclass
class Messages:
    """Backward messages of one (model, constraint, temperature), shared by every prefix, sample and guide.

    For j = 0 .. Lmax-1 over the live states of step j (column `col[j][q]`, -1 when (j, q) is not live):
    `W[j]` (S, C_j) = What_j and `sigma[j]` (Q,) float64 with W_j(., q) = What_j(., q) exp(sigma[j][q]) (-inf:
    dead); for j >= 1 `M[j]` (S, C_j) = A What_j. `eos` (S,) = B(., eos); `Bc` (S, K+1) the emission of each
    class (OTHER: summed); edges (q, q') in `pair_src`, `pair_dst` with emission `edge_emit` (S, P) = the sum of
    the classes' columns taking q to q', listed per state in `out_pairs` (Q, D) (-1 padded). Memory: about
    2 S sum_j C_j + S P entries."""

    view: ChainView
    dfa: WordDFA
    temperature: float
    M: list[Tensor | None]
    W: list[Tensor]
    col: list[np.ndarray]
    sigma: list[np.ndarray]
    eos: Tensor
    Bc: Tensor
    edge_emit: Tensor
    pair_src: np.ndarray
    pair_dst: np.ndarray
    delta: Tensor = field(init=False)
    accept: Tensor = field(init=False)
    cls: Tensor = field(init=False)
    special: Tensor = field(init=False)
    out_pairs: Tensor = field(init=False)
    col_t: list[Tensor] = field(init=False)
    sigma_t: list[Tensor] = field(init=False)
    pair_dst_t: Tensor = field(init=False)
    class_words: Tensor = field(init=False)
    general: bool = field(init=False)

    def __post_init__(self) -> None:
        dev = self.view.device
        words, self.general = class_layout(self.dfa)
        self.class_words = torch.as_tensor(words, device=dev)
        self.delta = torch.as_tensor(self.dfa.delta, device=dev)
        self.accept = torch.as_tensor(self.dfa.accept, device=dev)
        self.cls = torch.as_tensor(self.dfa.cls, device=dev)
        self.special = torch.as_tensor(self.dfa.special, device=dev)
        Q = self.dfa.num_states
        degree = np.bincount(self.pair_src, minlength=Q)
        out = np.full((Q, max(1, int(degree.max(initial=0)))), -1, dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(degree)[:-1]])
        out[self.pair_src, np.arange(len(self.pair_src)) - first[self.pair_src]] = np.arange(len(self.pair_src))
        self.out_pairs = torch.as_tensor(out, device=dev)
        self.col_t = [torch.as_tensor(c, device=dev) for c in self.col]  # per step, on the device once
        self.sigma_t = [torch.as_tensor(x, device=dev) for x in self.sigma]
        self.pair_dst_t = torch.as_tensor(self.pair_dst, device=dev)

    @property
    def W0(self) -> Tensor:
        """What_0(., start) (S,)."""
        return self.W[0][:, int(self.col[0][0])]

    @property
    def sigma0(self) -> float:
        return float(self.sigma[0][0])

    @property
    def model(self) -> ChainFamily:
        return self.view.model

    @property
    def vocab_size(self) -> int:
        return int(self.dfa.cls.shape[0])

    def initial(self, prefix: Sequence[int] | None = None) -> Tensor:
        """a_0 = p(z_{n+1} | prefix) (S,) normalised, from the chain engine's filter of the (tempered) model;
        InputError naming `prefix` when the model gives the prefix probability 0."""
        prefix = list(prefix or [])
        first = self.view.predictive(prefix) if prefix else self.view.start()
        check_continuable(first, prefix)
        return (first / first.sum()).to(self.view.dtype)

    def log_prob(self, prefix: Sequence[int] | None = None) -> float | None:
        """log P(C | prefix) in float64, None for probability 0. O(prefix filter + S)."""
        a0 = self.initial(prefix)
        value = float(a0.double() @ self.W0.double())
        if not (value > 0) or self.sigma0 == -math.inf:
            return None
        return math.log(value) + self.sigma0

    def nbytes(self) -> int:
        tables = [m for m in self.M if m is not None] + self.W + [self.edge_emit]
        return sum(m.numel() * m.element_size() for m in tables)


def prepare(model: ChainFamily, dfa: WordDFA, *, temperature: float = 1.0,
            max_bytes: int = DEFAULT_MAX_TABLE_BYTES) -> Messages:
    """The backward messages of `model` (tempered first) under `dfa` and its length window (module docstring).
    O(Lmax (Q_live S^2 + E S) + S V) time (S V: the OTHER words' emission mass, a masked row sum), O(Lmax Q_live S)
    memory (`table_bytes`; LimitExceeded naming `constraint` above `max_bytes`, before any work)."""
    view_of(model)
    need = table_bytes(model, dfa)
    if need > max_bytes:
        raise LimitExceeded(f"constraint: its messages would hold {need / 2**20:,.0f} MiB for this model, above the "
                            f"limit of {max_bytes / 2**20:,.0f} MiB (fewer automaton states or max_tokens)",
                            param="constraint")
    view = view_of(tempered(model, temperature))
    if dfa.cls.shape[0] != _vocab_size(view):
        raise InputError(f"constraint: compiled for a vocabulary of {dfa.cls.shape[0]} words, the model has "
                         f"{_vocab_size(view)}", param="constraint")
    S, dtype, dev = view.S, view.dtype, view.device
    lo, hi = dfa.min_tokens, dfa.max_tokens
    K = dfa.num_classes - 1
    live = dfa.live()
    # emission columns per class: the named words, then OTHER (every other word but <eos>, one masked row sum)
    cls = torch.as_tensor(dfa.cls, device=dev)
    if class_layout(dfa)[1]:  # classes of any token ids: one scatter-add pass over B
        Bc = view.class_mass(cls, K + 1)
    else:
        Bc = torch.empty(S, K + 1, dtype=dtype, device=dev)
        for c, w in enumerate(dfa.special.tolist()):
            Bc[:, c] = view.emission(w)
        Bc[:, K] = view.masked_mass(cls == K) if dfa.has_other else 0
    eos = view.emission(dfa.eos_id) if dfa.eos_id is not None else torch.zeros(S, dtype=dtype, device=dev)
    # edges (q, q') with e_{q,q'} = sum of the classes' columns taking q to q' (0/1 indicator: no cancellation)
    classes = K + 1 if dfa.has_other else K
    src = np.repeat(np.arange(dfa.num_states), classes)
    dst = dfa.delta[:, :classes].ravel()
    cl = np.tile(np.arange(classes), dfa.num_states)
    keep = dst >= 0
    pairs, pair_of = np.unique(np.stack([src[keep], dst[keep]], 1), axis=0, return_inverse=True)
    ind = torch.zeros(K + 1, len(pairs), dtype=dtype, device=dev)
    ind[torch.as_tensor(cl[keep], device=dev), torch.as_tensor(pair_of.reshape(-1), device=dev)] = 1
    edge_emit = Bc @ ind  # (S, P)

    Q = dfa.num_states
    M: list[Tensor | None] = [None] * hi
    Ws: list[Tensor] = [torch.zeros(S, 0, dtype=dtype, device=dev)] * hi
    cols: list[np.ndarray] = [np.full(Q, -1, dtype=np.int64) for _ in range(hi)]
    sigmas: list[np.ndarray] = [np.full(Q, -math.inf) for _ in range(hi)]
    W_next: Tensor | None = None  # What_{j+1} over live[j+1]
    for j in range(hi - 1, -1, -1):
        states = np.flatnonzero(live[j])
        cols[j][states] = np.arange(len(states))
        m = np.full(len(states), -math.inf)
        eos_ok = eos_allowed(j, lo, hi)
        acc = dfa.accept[states] if eos_ok else np.zeros(len(states), dtype=bool)
        m[acc] = 0.0
        if j + 1 < hi and W_next is not None:
            Mj = view.trans_apply(W_next)  # (S, C_{j+1})
            M[j + 1] = Mj
            sel = live[j][pairs[:, 0]] & live[j + 1][pairs[:, 1]] & (sigmas[j + 1][pairs[:, 1]] > -math.inf)
            e_idx = np.flatnonzero(sel)
            e_src = cols[j][pairs[e_idx, 0]]
            e_dst = cols[j + 1][pairs[e_idx, 1]]
            e_scale = sigmas[j + 1][pairs[e_idx, 1]]
            np.maximum.at(m, e_src, e_scale)
        else:
            e_idx = np.zeros(0, dtype=np.int64)
        shift = np.where(np.isfinite(m), m, 0.0)
        W = torch.zeros(S, len(states), dtype=dtype, device=dev)
        if acc.any():
            w_eos = torch.as_tensor(np.exp(-shift[acc]), dtype=dtype, device=dev)
            W[:, torch.as_tensor(np.flatnonzero(acc), device=dev)] += eos[:, None] * w_eos
        if len(e_idx):
            w_e = torch.as_tensor(np.exp(e_scale - shift[e_src]), dtype=dtype, device=dev)
            d = torch.as_tensor(e_dst, device=dev)
            W.index_add_(1, torch.as_tensor(e_src, device=dev),
                         edge_emit[:, torch.as_tensor(e_idx, device=dev)] * M[j + 1][:, d] * w_e)  # type: ignore
        top = W.amax(0) if len(states) else W.new_zeros(0)
        alive = top > 0
        W = W / torch.where(alive, top, 1)
        with np.errstate(divide="ignore"):
            sigmas[j][states] = np.where(alive.cpu().numpy(), shift + np.log(top.double().cpu().numpy()), -math.inf)
        W_next = Ws[j] = W
    # live[0] holds the start state (checked when the constraint was compiled)
    return Messages(view, dfa, temperature, M, Ws, cols, sigmas, eos, Bc, edge_emit, pairs[:, 0].copy(),
                    pairs[:, 1].copy())


def _vocab_size(view: ChainView) -> int:
    m = view.model
    if isinstance(m, BlockedHMM):
        return int(m.word_cluster.shape[0])
    return int(view.emit.shape[1])  # type: ignore[attr-defined]


# -- next-token scores ---------------------------------------------------------------------------------------
def next_log_scores(msgs: Messages, a: Tensor, q: Tensor, j: int, *, with_model: bool = False
                    ) -> Tensor | tuple[Tensor, Tensor]:
    """log s_j(v) (n, V) float64 = log P(y_{j+1} = v, C | x, y_<=j) for rows with predictive a (n, S) in automaton
    states q (n,) (-1: dead) after j continuation tokens; with `with_model`, also log p(v | x, y_<=j) (n, V) from
    the same pass over the emissions (one (2n, S) x (S, V) product). O(n (S V + K S)) (blocked: O(n k (V + K)))."""
    dfa, view = msgs.dfa, msgs.view
    n, V = len(a), msgs.vocab_size
    lo, hi = dfa.min_tokens, dfa.max_tokens
    out = torch.full((n, V), -math.inf, dtype=torch.float64, device=view.device)
    model_probs: Tensor | None = None
    alive_rows = q >= 0
    qs = q.clamp_min(0)
    Mj = msgs.M[j + 1] if j + 1 < hi else None
    if Mj is not None:
        col, sig = msgs.col_t[j + 1], msgs.sigma_t[j + 1]
        succ = torch.where(alive_rows[:, None], msgs.delta[qs], -1)  # (n, classes)
        ok = (succ >= 0) & (col[succ.clamp_min(0)] >= 0)
        succ = torch.where(ok, succ, -1)
        if msgs.general:  # classes of any token ids
            model_probs = _class_scores(msgs, out, a, succ, Mj, col, sig, with_model)
        else:
            model_probs = _word_scores(msgs, out, a, succ, Mj, col, sig, with_model)
    if dfa.eos_id is not None:
        out[:, dfa.eos_id] = -math.inf
        if eos_allowed(j, lo, hi):
            acc = (alive_rows & msgs.accept[qs]).nonzero().squeeze(1)
            if len(acc):
                out[acc, dfa.eos_id] = _log(a[acc] @ msgs.eos)
    if not with_model:
        return out
    if model_probs is None:
        model_probs = view.token_probs(a)
    return out, _log(model_probs)


def _word_scores(msgs: Messages, out: Tensor, a: Tensor, succ: Tensor, Mj: Tensor, col: Tensor, sig: Tensor,
                 with_model: bool) -> Tensor | None:
    """log s_j into `out` (n, V) for a word-level automaton: every word through the OTHER column (one product), then
    the named words that go elsewhere fixed one by one. Returns p(v | x, y_<=j) (n, V) from the same product with
    `with_model`, else None (also when no row has a live OTHER successor)."""
    view = msgs.view
    K = msgs.dfa.num_classes - 1
    model_probs = None
    d = succ[:, K]
    rows = (d >= 0).nonzero().squeeze(1)
    if len(rows):
        u = a[rows] * Mj[:, col[d[rows]]].T
        if with_model:
            both = view.token_probs(torch.cat([u, a]))
            model_probs = both[len(rows):]
            probs = both[: len(rows)]
        else:
            probs = view.token_probs(u)
        out[rows] = _log(probs) + sig[d[rows]].unsqueeze(1)
    r, c = (succ[:, :K] != d[:, None]).nonzero(as_tuple=True)
    if len(r):
        s = succ[r, c]
        words = msgs.special[c]
        vals = torch.full((len(r),), -math.inf, dtype=torch.float64, device=view.device)
        live_pairs = (s >= 0).nonzero().squeeze(1)
        if len(live_pairs):
            rr, ss = r[live_pairs], s[live_pairs]
            vals[live_pairs] = _log(view.scores_at(a[rr], words[live_pairs], Mj, col[ss])) + sig[ss]
        out[r, words] = vals
    return model_probs


SMALL_SUCCESSOR = 16  # a successor reached by fewer than V / 16 words gets their scores word by word, not a GEMM row


def _class_scores(msgs: Messages, out: Tensor, a: Tensor, succ: Tensor, Mj: Tensor, col: Tensor, sig: Tensor,
                  with_model: bool) -> Tensor | None:
    """log s_j into `out` (n, V) for an automaton whose classes are any sets of token ids. Rows in the same automaton
    state share their successors: each such group of rows gets one row a * M(., q') per distinct live successor q'
    reached by many words, all of them (and, with `with_model`, the rows `a` themselves) in one token product, each
    of those words picking its successor's row; the words of the other successors (a keyphrase's pieces: few) are
    scored one by one (`scores_at`); words with no live successor stay -inf. Returns p(v | x, y_<=j) (n, V) with
    `with_model`, else None. O((big successors + n) S V) in one GEMM plus O(S) per (row, word of a small one)."""
    view = msgs.view
    Q, V = msgs.delta.shape[0], len(msgs.cls)
    cls = msgs.cls.clamp_min(0)  # <eos> (-1) is set by the caller afterwards
    dev = a.device
    keys, inv = torch.unique(succ, dim=0, return_inverse=True)  # (G, C): one per automaton state and liveness
    blocks, plan, offset = [], [], 0
    small_rows, small_words, small_succ = [], [], []
    for g in range(len(keys)):
        key = keys[g]
        live = key[key >= 0].unique()
        if not len(live):
            continue  # every word dead: out stays -inf
        rows = (inv == g).nonzero().squeeze(1)
        pos = torch.full((Q + 1,), -1, dtype=torch.long, device=dev)
        pos[live] = torch.arange(len(live), device=dev)
        pick = pos[torch.where(key >= 0, key, Q)[cls]]  # (V,): each word's successor as an index into `live`
        big = torch.bincount(pick[pick >= 0], minlength=len(live)) * SMALL_SUCCESSOR >= V
        rank = torch.full((len(live),), -1, dtype=torch.long, device=dev)
        rank[big] = torch.arange(int(big.sum()), device=dev)
        pick_big = torch.where(pick >= 0, rank[pick.clamp_min(0)], -1)
        if bool(big.any()):
            blocks.append((a[rows][:, None, :] * Mj[:, col[live[big]]].T[None]).reshape(-1, a.shape[1]))
            plan.append((rows, live[big], pick_big, offset))
            offset += len(rows) * int(big.sum())
        words = ((pick >= 0) & (pick_big < 0)).nonzero().squeeze(1)
        if len(words):
            small_rows.append(rows.repeat_interleave(len(words)))
            small_words.append(words.repeat(len(rows)))
            small_succ.append(live[pick[words]].repeat(len(rows)))
    probs = view.token_probs(torch.cat([*blocks, a])) if with_model or blocks else None
    for rows, live, pick, off in plan:
        P = probs[off: off + len(rows) * len(live)].view(len(rows), len(live), -1)  # type: ignore[index]
        chosen = P.gather(1, pick.clamp_min(0).expand(len(rows), 1, -1)).squeeze(1)
        out[rows] = torch.where(pick >= 0, _log(chosen) + sig[live][pick.clamp_min(0)], -math.inf)
    if small_rows:
        r, w, q2 = torch.cat(small_rows), torch.cat(small_words), torch.cat(small_succ)
        out[r, w] = _log(view.scores_at(a[r], w, Mj, col[q2])) + sig[q2]
    return probs[offset:] if with_model else None  # type: ignore[index]


def _log(x: Tensor) -> Tensor:
    return x.double().clamp_min(0).log()


def _advance(msgs: Messages, a: Tensor, q: Tensor, words: Tensor) -> tuple[Tensor, Tensor]:
    """Rows that read content words: (next predictive (n, S), next automaton state (n,))."""
    c = msgs.cls[words]
    q_next = torch.where((q >= 0) & (c >= 0), msgs.delta[q.clamp_min(0), c.clamp_min(0)], -1)
    return msgs.view.condition(a, words), q_next


# -- the guide -------------------------------------------------------------------------------------------
class Guide:
    """Incremental constraint weights for n sequences generated by another model sharing the vocabulary
    (Ctrl-G's factor): after the tokens y_<=j given to `advance`, `weights()` is g_j(v) = P(C | x, y_<=j, v)
    for every next token v (n, V) float64 (exactly 0 where v makes C impossible; for `<eos>` exactly 0 or 1).
    Multiply an LM's next-token probabilities by it and renormalise: the LM then never leaves the constraint.
    Each `advance` is one filter step (O(S^2), blocked O(k Z)); `weights` two token products (O(S V), blocked
    O(k V)) plus O(K S). Rows stay in lockstep (one token each per step); a row past its `<eos>` is ignored."""

    def __init__(self, messages: Messages, prefixes: Sequence[Sequence[int] | None] | None = None, n: int = 1):
        self.msgs = messages
        prefixes = list(prefixes) if prefixes is not None else [None] * n
        self.a = torch.stack([messages.initial(p) for p in prefixes])
        self.q = torch.zeros(len(prefixes), dtype=torch.long, device=messages.view.device)
        self.done = torch.zeros(len(prefixes), dtype=torch.bool, device=messages.view.device)
        self.j = 0

    @property
    def steps(self) -> int:
        """Continuation tokens read so far."""
        return self.j

    def scores(self) -> tuple[Tensor, Tensor]:
        """(log s_j (n, V): log P(v, C | x, y_<=j), log p(v | x, y_<=j) (n, V)), float64."""
        return next_log_scores(self.msgs, self.a, self.q, self.j, with_model=True)  # type: ignore[return-value]

    def weights(self) -> Tensor:
        """g_j(v) (n, V) float64; 0 where the model gives v probability 0."""
        log_s, log_p = self.scores()
        return torch.where(log_p > -math.inf, (log_s - log_p).exp(), 0.0).clamp_max(1.0)

    def log_prob(self) -> list[float | None]:
        """log P(C | x, y_<=j) per row (None: probability 0)."""
        total = torch.logsumexp(next_log_scores(self.msgs, self.a, self.q, self.j), 1).tolist()
        return [t if t > -math.inf else None for t in total]

    def advance(self, tokens: Sequence[int] | Tensor) -> None:
        """Read one token per row (rows already done are ignored; `<eos>` ends a row)."""
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.a.device).reshape(-1)
        if len(t) != len(self.a):
            raise InputError(f"tokens: expected one per sequence ({len(self.a)}), got {len(t)}", param="tokens")
        if bool(((t < 0) | (t >= self.msgs.vocab_size)).any()):
            raise InputError("tokens: id outside the vocabulary", param="tokens")
        eos = self.msgs.dfa.eos_id
        ends = (t == eos) if eos is not None else torch.zeros_like(self.done)
        go = (~self.done & ~ends).nonzero().squeeze(1)
        if len(go):
            self.a[go], self.q[go] = _advance(self.msgs, self.a[go], self.q[go], t[go])
        self.done |= ends
        self.j += 1


# -- exact conditional sampling ---------------------------------------------------------------------------------
SAMPLING_METHODS = ("states", "tokens")
REJECTION_ROUNDS = 32  # draws of an OTHER word from B(z, .) before the rest are drawn by a masked row (O(V))


def sample(msgs: Messages, n: int, generator: torch.Generator, *, prefix: Sequence[int] | None = None,
           method: str = "states") -> list[list[int]]:
    """n continuations (token ids, each ending with `<eos>`) drawn exactly from p(y | prefix, y complete, y
    satisfies C) under the (tempered) model of `msgs`. InputError naming `constraint` when P(C | prefix) = 0 (and
    `prefix` when the prefix has probability 0).

    method "states" (default; CONSTRAINED.md 2.4, state then token): z_1 ~ a_0(z) W_0(z, q_0); then per token,
    the successor q' (or `<eos>`) with weight e_{q,q'}(z) M_{j+1}(z, q') (eos: B(z, eos)), the word within the
    chosen classes from B(z, .) (an OTHER word by drawing from the state's emission table until it is one), and
    z' ~ A(z, z') W_{j+1}(z', q'). O(S + D + V/expected) per token and sample (D: successors of q): no S x V
    product. method "tokens": each token from its exact marginal s_j (the guide's scores with the model as the
    LM), O(S V + S^2) per token and sample (blocked: O(k V + k Z))."""
    if method not in SAMPLING_METHODS:
        raise InputError(f"method: expected one of {', '.join(SAMPLING_METHODS)}, got {method!r}", param="method")
    if msgs.log_prob(prefix) is None:
        raise InputError("constraint: has probability 0 under this model after this prefix: no continuation "
                         "satisfies it", param="constraint")
    if method == "tokens":
        return _sample_tokens(msgs, n, generator, prefix)
    return _sample_states(msgs, n, generator, prefix)


def _sample_tokens(msgs: Messages, n: int, generator: torch.Generator, prefix: Sequence[int] | None
                   ) -> list[list[int]]:
    a = msgs.initial(prefix).expand(n, -1).clone()
    q = torch.zeros(n, dtype=torch.long, device=a.device)
    out: list[list[int]] = [[] for _ in range(n)]
    rows = torch.arange(n, device=a.device)
    eos = msgs.dfa.eos_id
    for j in range(msgs.dfa.max_tokens):
        if not len(rows):
            break
        log_s = next_log_scores(msgs, a, q, j)
        top = log_s.amax(1, keepdim=True)
        v = draw_rows((log_s - top).exp(), generator)
        for i, tok in zip(rows.tolist(), v.tolist(), strict=True):
            out[i].append(tok)
        go = (v != eos).nonzero().squeeze(1)
        a, q = _advance(msgs, a[go], q[go], v[go])
        rows = rows[go]
    return out


def _sample_states(msgs: Messages, n: int, generator: torch.Generator, prefix: Sequence[int] | None
                   ) -> list[list[int]]:
    view, dfa = msgs.view, msgs.dfa
    dev = view.device
    lo, hi = dfa.min_tokens, dfa.max_tokens
    eos = dfa.eos_id
    pair_dst = msgs.pair_dst_t
    a0 = msgs.initial(prefix)
    z = draw_rows((a0 * msgs.W0).double().expand(n, -1), generator)
    q = torch.zeros(n, dtype=torch.long, device=dev)
    rows = torch.arange(n, device=dev)
    out: list[list[int]] = [[] for _ in range(n)]
    for j in range(hi):
        if not len(rows):
            break
        # the successor (or <eos>): weights e_{q,q'}(z) M_{j+1}(z, q') exp(sigma) and B(z, eos), scaled per row
        pid = msgs.out_pairs[q]  # (r, D)
        logw = torch.full((len(rows), pid.shape[1] + 1), -math.inf, dtype=torch.float64, device=dev)
        Mj = msgs.M[j + 1] if j + 1 < hi else None
        if Mj is not None:
            col, sig = msgs.col_t[j + 1], msgs.sigma_t[j + 1]
            dst = torch.where(pid >= 0, pair_dst[pid.clamp_min(0)], 0)
            c = col[dst]
            ok = (pid >= 0) & (c >= 0)
            term = msgs.edge_emit[z[:, None], pid.clamp_min(0)] * Mj[z[:, None], c.clamp_min(0)]
            logw[:, :-1] = torch.where(ok, _log(term) + sig[dst], -math.inf)
        if eos is not None and eos_allowed(j, lo, hi):
            logw[:, -1] = torch.where(msgs.accept[q], _log(msgs.eos[z]), -math.inf)
        pick = draw_rows((logw - logw.amax(1, keepdim=True)).exp(), generator)
        ends = pick == pid.shape[1]
        words = torch.full_like(z, -1)
        if eos is not None:
            words[ends] = eos
        go = (~ends).nonzero().squeeze(1)
        if len(go):
            q_next = pair_dst[pid[go, pick[go]]]
            # the word: a class taking q to q' by its emission weight, then (OTHER) a word of that class
            allowed = msgs.delta[q[go]] == q_next[:, None]  # (g, K+1)
            cw = torch.where(allowed, msgs.Bc[z[go]], 0).double()
            c = draw_rows(cw, generator)
            special = msgs.class_words[c] >= 0  # one-word classes (word-level: c < K)
            words[go[special]] = msgs.class_words[c[special]]
            other = go[~special]
            if len(other):
                if not msgs.general:  # word-level: every such class is OTHER
                    words[other] = _draw_other(msgs, z[other], generator)
                else:
                    words[other] = _draw_other(msgs, z[other], generator, c[~special])
            z_next = draw_rows((view.trans_rows(z[go]) * msgs.W[j + 1][:, msgs.col_t[j + 1][q_next]].T).double(),
                               generator)
        for i, tok in zip(rows.tolist(), words.tolist(), strict=True):
            out[i].append(tok)
        if len(go):
            rows, z, q = rows[go], z_next, q_next
        else:
            rows = rows[:0]
    return out


def _draw_other(msgs: Messages, z: Tensor, generator: torch.Generator, classes: Tensor | None = None) -> Tensor:
    """One word per state z (n,) of its class (n,) (a class of several words; None: OTHER, K, for every row), from
    B(z, .) restricted to that class: draws from the state's emission table until one is (its acceptance is the
    class's mass in the state), then a masked row for the rest."""
    if classes is None:
        classes = torch.full_like(z, msgs.dfa.num_classes - 1)
    words = torch.full_like(z, -1)
    todo = torch.arange(len(z), device=z.device)
    for _ in range(REJECTION_ROUNDS):
        if not len(todo):
            return words
        v = msgs.view.draw_words(z[todo], generator)
        hit = msgs.cls[v] == classes[todo]
        words[todo[hit]] = v[hit]
        todo = todo[~hit]
    if len(todo):
        onehot = torch.zeros(len(todo), msgs.view.S, dtype=msgs.view.dtype, device=z.device)
        onehot[torch.arange(len(todo), device=z.device), z[todo]] = 1
        probs = msgs.view.token_probs(onehot)  # (t, V): B(z, .)
        words[todo] = draw_rows(torch.where(msgs.cls[None] == classes[todo, None], probs, 0).double(), generator)
    return words


# -- constrained beam search ----------------------------------------------------------------------------------
@dataclass
class BeamResult:
    """Completions found, best first: `ids` (ending with `<eos>`), `log_prob` log p(y | x), `log_prob_given`
    log p(y | x, C) = log p(y | x) - log P(C | x); `certified`: they are provably the n_best most probable
    constrained continuations; else `gap` bounds how much better an unseen one could be (in log probability)."""

    results: list[dict[str, Any]]
    certified: bool
    gap: float
    log_prob_constraint: float | None


def beam_search(msgs: Messages, *, prefix: Sequence[int] | None = None, beam: int = 16, n_best: int = 1
                ) -> BeamResult:
    """Constrained beam search ranked by log P(h, C | x) = log p(h | x) + log P(C | x, h) (model x exact
    lookahead, as Ctrl-G ranks), an upper bound on log p(y | x) of every valid completion y of h (an admissible
    A* heuristic). Each step expands the live hypotheses over the vocabulary, moves `<eos>` expansions to the
    finished list, keeps the best `beam` and remembers the best pruned score; it stops once the n_best-th
    finished score is at least the best live or pruned score (certified) or nothing is live. Note the most
    probable string is not what Viterbi gives (a best state path; argmax_y p(y | x) is NP-hard in general).
    O(Lmax beam (S V + S^2))."""
    log_pc = msgs.log_prob(prefix)
    if log_pc is None:
        raise InputError("constraint: has probability 0 under this model after this prefix", param="constraint")
    eos = msgs.dfa.eos_id
    a = msgs.initial(prefix)[None]
    q = torch.zeros(1, dtype=torch.long, device=a.device)
    hyp_lp = torch.zeros(1, dtype=torch.float64, device=a.device)  # log p(h | x)
    hyps: list[list[int]] = [[]]
    finished: list[tuple[float, list[int]]] = []
    pruned = -math.inf
    bound = math.inf
    for j in range(msgs.dfa.max_tokens):
        log_s, log_p = next_log_scores(msgs, a, q, j, with_model=True)
        score = hyp_lp[:, None] + log_s  # log P(h v, C | x)
        if eos is not None:
            for i in (score[:, eos] > -math.inf).nonzero().squeeze(1).tolist():
                finished.append((float(score[i, eos]), [*hyps[i], eos]))
            score[:, eos] = -math.inf
        flat = score.reshape(-1)
        finite = int((flat > -math.inf).sum())
        take = min(beam, finite)
        best, idx = flat.topk(take) if take else (flat[:0], flat[:0].long())
        if finite > take:
            rest = flat.clone()
            rest[idx] = -math.inf
            pruned = max(pruned, float(rest.max()))
        finished.sort(key=lambda f: -f[0])
        live_best = float(best[0]) if take else -math.inf
        bound = max(live_best, pruned)
        if not take or (len(finished) >= n_best and finished[n_best - 1][0] >= bound):
            break
        V = flat.shape[0] // len(hyps)
        h, v = idx // V, idx % V
        hyp_lp = hyp_lp[h] + log_p[h, v]
        hyps = [[*hyps[i], t] for i, t in zip(h.tolist(), v.tolist(), strict=True)]
        a, q = _advance(msgs, a[h], q[h], v)
    finished.sort(key=lambda f: -f[0])
    top = finished[:n_best]
    certified = len(top) == n_best and top[-1][0] >= bound if top else False
    gap = 0.0 if certified else (bound - top[-1][0] if top else math.inf)
    return BeamResult([{"ids": ids, "log_prob": lp, "log_prob_given": lp - log_pc} for lp, ids in top],
                      certified, max(gap, 0.0), log_pc)


# -- cost, before any work --------------------------------------------------------------------------------------
def _sizes(model: ChainFamily) -> tuple[int, int, int]:
    """(S: states of the chain the recursion runs, the width of its filter step, the states one word's emission
    touches): dense (Z, Z, Z), blocked (Z, k, k), rank (r, r, r)."""
    if isinstance(model, RankHMM):
        return model.rank, model.rank, model.rank
    if isinstance(model, BlockedHMM):
        return model.num_states, model.k, model.k
    return model.num_states, model.num_states, model.num_states


def table_bytes(model: ChainFamily, dfa: WordDFA) -> int:
    """Memory of the messages `prepare` keeps (M and What over the live states, the edges' emissions), known
    before any work."""
    S = _sizes(model)[0]
    live = sum(int(m.sum()) for m in dfa.live())
    item = torch.finfo(model.dtype).bits // 8
    return (2 * live + dfa.num_states * dfa.num_classes + dfa.num_classes) * S * item


def estimate_cost(model: ChainFamily, dfa: WordDFA, *, n_samples: int = 0, method: str = "states",
                  guide_rows: int = 0, beam: int = 0, prefix_tokens: int = 0) -> int:
    """Multiply-adds (the units of the service's cost model) of preparing the messages and then drawing
    `n_samples` (by `method`), guiding `guide_rows` sequences over max_tokens steps, or a beam search of width
    `beam`, after a prefix of `prefix_tokens` tokens; from the automaton's live states and edges, known before
    any inference (compiling the automaton is the only work before it). Raises UnsupportedOperation for a family
    without constraints."""
    view_of(model)  # the family check
    V = int(dfa.cls.shape[0])
    S, width, emit_width = _sizes(model)
    live_counts = [int(m.sum()) for m in dfa.live()]
    edges = int((dfa.delta >= 0).sum())
    # products A What over the live columns, the edges' terms, the emission columns (OTHER: a masked row sum)
    backward = sum(live_counts[1:]) * S * S + dfa.max_tokens * edges * S + emit_width * V + dfa.num_classes * S
    filt = width * S  # the filter after a word: (a * B(., w)) A over the states that can emit it
    scores = 2 * emit_width * V + filt + dfa.num_classes * emit_width  # guide / token-marginal step (two rows)
    draw = S + dfa.num_classes + 64  # state-then-token step: a row of A, the successors, the word
    if class_layout(dfa)[1]:  # classes of any token ids: a row per distinct live successor in the token product
        succ_rows = max(1, int(max((len(set(r[r >= 0].tolist())) for r in dfa.delta), default=1)))
        scores += (succ_rows - 1) * emit_width * V + 4 * V
    per_sample = draw if method == "states" else scores
    steps = dfa.max_tokens
    total = backward + STEP_OVERHEAD * steps + prefix_tokens * (width * width + 5_000)
    work = n_samples * per_sample + (guide_rows + beam) * scores
    if work:
        total += steps * (work + STEP_OVERHEAD)
    return int(total)
