"""Exact inference on the product of a chain family and a constraint's automaton (`models.constraint.WordDFA`): the
probability that a continuation satisfies the constraint, a guide for neural LMs, a constrained beam search, and the
messages exact conditional sampling draws from (`models.constrained_sampling`).

A family takes part by listing `constraint` in its operations and supplying its step as a view
(`ChainFamily.constraint_view`: a `models.chain_view.ChainView`), a tempered copy (`ChainFamily.tempered`) and its
sizes (`ChainFamily.constraint_sizes`, read by its `cost`); nothing here names a family.

Semantics. With prefix x, a continuation y = y_1 .. y_L is complete when it emits `<eos>` (y_L, the first one);
    P(C | x) = sum over complete y with min_tokens <= L <= max_tokens that satisfy C of p(y | x).
The automaton reads the content words y_1 .. y_{L-1}; `<eos>` is its acceptance test.

Recursion (float64 log-scales; S = the states of the view's chain: Z for hmm / tagging_hmm / blocked_hmm, the rank r
for rank_hmm, which runs as the r-state HMM of its rank variables; Lmax = max_tokens):
    W_j(z, q) = [Lmin <= j+1 <= Lmax] [q accepting] B(z, eos)
                + [j+1 < Lmax] sum_{q' successor of q} e_{q,q'}(z) M_{j+1}(z, q'),     M_{j+1} = A W_{j+1},
where e_{q,q'}(z) = sum of B(z, v) over the words v taking q to q' (the named words one by one, every other word
at once by a masked row sum: OTHER), so a step costs one (S x S) x (S x Q_live) product plus O(E S) for the E
live edges: O(Lmax (Q S^2 + E S)) per request, never a (S Q) x (S Q) matrix. W_j(z, q) is the probability that
the continuation completes validly given state z emits token j+1 and the automaton is in q after j tokens.
Every column is kept as W = What exp(sigma): What's column maximum is 1 (in the model's dtype), sigma float64
(values for different automaton states differ by many orders of magnitude: one scale per step is not enough
in float32); only (j, q) pairs that are reachable and can still accept in the window (`WordDFA.live`) are
computed. A blocked HMM's view (`blocked_hmm.BlockedView`) multiplies by its stored Z x Z matrix where it lies;
its emissions are k-sparse (`e` columns and `B(., word)` touch one cluster's k states) and its filter after a word
is O(k Z); token scores read each word's k states. The messages (`Messages`: What_j, sigma_j and M_j over the live
states) depend on neither the prefix nor the samples: computed once per (model, constraint, temperature) and reused
by every call below. The stored Z x Z matrix is read in full at every backward step (the next word is unknown, so no
k x k block suffices there): the backward of a blocked HMM costs what a dense one does; its savings are in the
emissions, the filter and the sampler.

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
    msgs.log_prob(prefix_ids); constrained_sampling.sample(msgs, n, generator, prefix=prefix_ids)
    guide = constrained.Guide(msgs, [prefix_ids]); guide.weights(); guide.advance([token])

Entry points (all on the model's device, in its dtype, with float64 where results are reported):
- `prepare(model, dfa, temperature=1.0) -> Messages`: the backward messages. O(Lmax (Q_live S^2 + E S) + S V).
- `Messages.log_prob(prefix) -> float | None`: log P(C | prefix) (None for probability 0). O(prefix S^2).
- `constrained_sampling.sample(messages, n, generator, prefix, method)`: n continuations drawn exactly from
  p(y | prefix, y complete, y satisfies C); InputError naming `constraint` when P(C | prefix) = 0. "states"
  (default): state then token, O(S + D) per token and sample; "tokens": each token from its marginal s_j,
  O(S V + S^2) (blocked O(k V + k Z)).
- `Guide(messages, prefixes)`: incremental handle for n sequences: `weights()` -> (n, V) g_j(v), `advance(tokens)`
  one filter step each (no rescan of the tokens so far).
- `beam_search(messages, prefix, beam, n_best)`: hypotheses ranked by p(h | x) P(C | x, h) (model x exact
  lookahead), which bounds every completion's log p(y | x) from above; `certified` when the best found
  completions are provably the most probable constrained strings.
- `estimate_cost(model, dfa, ...)`: the work of a request in multiply-adds (the family's `cost` of a "constraint"
  `Work`), and `table_bytes(model, dfa)` the memory of its messages, known before any work.
Temperature tempers the model before conditioning (`ChainFamily.tempered`: start, transition rows and emission rows
each raised to 1/T and renormalised; rank_hmm: its rank-space start, step and emissions), so draws are exact from
the constrained distribution of a well-defined HMM. This is not p(y | x)^(1/T), which does not factor over states.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from latentlm.models.base import ChainFamily, check_continuable
from latentlm.models.chain_view import ChainView
from latentlm.models.constraint import WordDFA
from latentlm.models.cost import ProductWork, Work
from latentlm.models.errors import InputError, LimitExceeded, UnsupportedOperation

DEFAULT_MAX_TABLE_BYTES = 4 << 30  # messages of one request (a setting of the service)


def view_of(model: Any) -> ChainView:
    """The family's `ChainView` (`ChainFamily.constraint_view`) where its declaration lists `constraint`;
    UnsupportedOperation naming the family otherwise."""
    if "constraint" in getattr(model, "operations", ()):
        return model.constraint_view()
    family = getattr(model, "family", type(model).__name__)
    raise UnsupportedOperation(f"constraints are answered by the families whose operations list 'constraint', not "
                               f"by {family!r}", param="constraint")



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
    view = view_of(model.tempered(temperature))
    if dfa.cls.shape[0] != view.vocab_size:
        raise InputError(f"constraint: compiled for a vocabulary of {dfa.cls.shape[0]} words, the model has "
                         f"{view.vocab_size}", param="constraint")
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
def table_bytes(model: ChainFamily, dfa: WordDFA) -> int:
    """Memory of the messages `prepare` keeps (M and What over the live states, the edges' emissions), known
    before any work."""
    S = model.constraint_sizes()[0]
    live = sum(int(m.sum()) for m in dfa.live())
    item = torch.finfo(model.dtype).bits // 8
    return (2 * live + dfa.num_states * dfa.num_classes + dfa.num_classes) * S * item


def product_work(dfa: WordDFA, *, n_samples: int = 0, method: str = "states", guide_rows: int = 0, beam: int = 0
                 ) -> ProductWork:
    """What the cost of the product recursion reads of the automaton (live states per step, live edges, classes,
    the successor rows of a token-class automaton) and of the request. O(max_tokens Q (K+1))."""
    succ_rows = 0
    if class_layout(dfa)[1]:  # classes of any token ids: a row per distinct live successor in the token product
        succ_rows = max(1, int(max((len(set(r[r >= 0].tolist())) for r in dfa.delta), default=1)))
    return ProductWork(tuple(int(m.sum()) for m in dfa.live()), int((dfa.delta >= 0).sum()), dfa.num_classes,
                       succ_rows, n_samples, method, guide_rows, beam)


def estimate_cost(model: ChainFamily, dfa: WordDFA, *, n_samples: int = 0, method: str = "states",
                  guide_rows: int = 0, beam: int = 0, prefix_tokens: int = 0) -> int:
    """Multiply-adds (the units of the service's cost model) of preparing the messages and then drawing
    `n_samples` (by `method`), guiding `guide_rows` sequences over max_tokens steps, or a beam search of width
    `beam`, after a prefix of `prefix_tokens` tokens, as the family states it (`Family.cost` of a "constraint"
    `Work`: `cost.product_cost` over its `constraint_sizes`); from the automaton's live states and edges, known
    before any inference (compiling the automaton is the only work before it). Raises UnsupportedOperation for a
    family without constraints."""
    view_of(model)  # the family check
    work = product_work(dfa, n_samples=n_samples, method=method, guide_rows=guide_rows, beam=beam)
    return int(model.cost(Work("constraint", prefix_tokens=prefix_tokens, vocab_size=int(dfa.cls.shape[0]),
                               product=work)))
