"""The tree engine: inside (scaled sum-product), span marginals, Viterbi, MBR CKY and top-down sampling,
written once for every PCFG family.

Symbols are numbered 0..NT-1 (nonterminals: binary rules only) then NT..NT+PT-1 (preterminals: words
only), so a span of one word is always a preterminal and a wider span always a nonterminal. A family
describes its grammar to the engine with a `Contraction` (what a span's inside vector turns into when it
is the left or right child of a bigger span, and how two children combine); everything else is here.

The chart is one tensor per span width w, (B, n-w+1, C) over the span starts, so a batch is B sentences of
one length n (group by length with `by_length`); span weights and marginals are (B, n, n) at [w-1, start].
Sum-product runs in probability space with per-span scaling ("log-einsum-exp"): each child vector is
divided by its (detached) maximum and the log of that maximum is carried beside it; the split points of
a span are weighted by exp(scale - max scale) before the contraction, so nothing underflows and every
contraction stays a plain product / GEMM.
Max-product (Viterbi) runs in log space. Marginals and the Viterbi tree come from autograd through
these passes (the gradient of log Z with respect to a zero span weight is the span's marginal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from latentlm.models.cost import ENTRY_COST, PCFG_VITERBI_FACTOR, SAMPLE_STEP_COST, TOKEN_COST, Work
from latentlm.models.errors import InputError, LimitExceeded, UnsupportedOperation
from latentlm.models.results import Parse, Sample, Score, Span, SpanMarginals
from latentlm.models.sampling import CategoricalTable

DEFAULT_MAX_LENGTH = 200  # words per sentence a PCFG model accepts unless its config says `max_length`


class Contraction(Protocol):
    """What a PCFG family supplies (shapes: B sentences, m spans, k split points, C child dim, D span dim)."""

    def leaves(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids (B, n) -> left- and right-child messages of the one-word spans, (B, n, C) each."""
        ...

    def project(self, alpha: Tensor) -> tuple[Tensor, Tensor]:
        """Inside vectors (B, m, D) of wider spans -> their left/right-child messages (B, m, C)."""
        ...

    def combine(self, left: Tensor, right: Tensor) -> Tensor:
        """(B, m, k, C) x (B, m, k, C) -> (B, m, D): the binary-rule contraction summed over splits."""
        ...

    def root(self, alpha: Tensor) -> Tensor:
        """(B, D) inside vectors of whole sentences (n >= 2) -> (B,) p(sentence) up to the carried scale."""
        ...

    def root_leaf(self, ids: Tensor) -> Tensor:
        """(B,) the word of one-word sentences -> (B,) p(sentence) (the start rule S -> preterminal)."""
        ...


class MaxContraction(Contraction, Protocol):
    """The log-space / max-product version (only families with exact Viterbi supply it)."""

    def log_leaves(self, ids: Tensor) -> tuple[Tensor, Tensor]: ...
    def log_project(self, alpha: Tensor) -> tuple[Tensor, Tensor]: ...
    def max_combine(self, left: Tensor, right: Tensor) -> Tensor: ...
    def log_root(self, alpha: Tensor) -> Tensor: ...
    def log_root_leaf(self, leaf: Tensor) -> Tensor:
        """(B, C) leaf message of a one-word sentence -> (B,) best log p(x, tree)."""
        ...


# -- grouping ---------------------------------------------------------------------------------------
def by_length(seqs: list[list[int]], max_length: int, chart_elems: int, width: int, cube: bool = False
              ) -> list[list[int]]:
    """Indices of equal-length sentences in chunks whose charts stay below `chart_elems` entries
    (B n^2 `width`, or B n^3 `width` / 3 with `cube`: what back-propagation through the inside pass keeps);
    raises LimitExceeded naming `max_length` for a sentence longer than it, and for a single sentence
    whose `cube` cost alone exceeds `chart_elems`."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise InputError(f"input[{i}]: empty sequence", param="input")
        if len(s) > max_length:
            raise LimitExceeded(f"input[{i}]: {len(s)} tokens exceed this model's max_length of {max_length} "
                                "(the inside pass costs O(n^3))", param="max_length")
        if cube and len(s) ** 3 * width // 3 > chart_elems:
            gib = len(s) ** 3 * width / 3 * 4 / 2**30
            raise LimitExceeded(f"input[{i}]: span marginals of {len(s)} tokens at chart width {width} keep "
                                f"~{gib:.1f} GiB for back-propagation, above this model's limit of {chart_elems:,} "
                                "entries (marginal_elems); send shorter sentences", param="input")
        groups.setdefault(len(s), []).append(i)
    out = []
    for n in sorted(groups):
        step = max(1, chart_elems // max(1, n * n * width * (max(1, n // 3) if cube else 1)))
        idx = groups[n]
        out.extend(idx[j : j + step] for j in range(0, len(idx), step))
    return out


# -- inside -----------------------------------------------------------------------------------------
def _normalise(x: Tensor) -> tuple[Tensor, Tensor]:
    """(..., C) -> x / max (detached; all-zero rows kept) and log max (...,)."""
    c = x.detach().amax(-1, keepdim=True)
    c = torch.where(c > 0, c, torch.ones((), dtype=c.dtype, device=c.device))
    return x / c, c.squeeze(-1).log()


def _split_index(n: int, w: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat chart indices ([width-1, start] -> (width-1) n + start) of the children of spans (i, i+w),
    i < n-w+1, split at i+u, u = 1..w-1: left (i, i+u) and right (i+u, i+w), each (m k,) row-major."""
    i = torch.arange(n - w + 1, device=device)[:, None]
    u = torch.arange(1, w, device=device)[None, :]
    return ((u - 1) * n + i).reshape(-1), ((w - u - 1) * n + i + u).reshape(-1)


def _gather(chart: Tensor, idx: Tensor, m: int) -> Tensor:
    """(B, n n, ...) flat chart -> (B, m, k, ...) rows `idx`."""
    out = chart.index_select(1, idx)
    return out.view(chart.shape[0], m, -1, *chart.shape[2:])


def _weights(d: Tensor) -> Tensor:
    """exp(d) for d <= 0, flushed to 0 below the smallest normal number (denormals are slow on CPUs)."""
    lo = math.log(torch.finfo(d.dtype).tiny)
    return torch.where(d < lo, torch.zeros((), dtype=d.dtype, device=d.device), d.clamp_min(lo).exp())


def _children(left: list[Tensor], right: list[Tensor], w: int) -> tuple[Tensor, Tensor]:
    """Children of the spans (i, i+w), i < m = n-w+1, split at i+u, u = 1..w-1, from per-width lists
    (`left[u]` (B, n-u+1, ...) holds the spans of width u): (B, m, k, ...) left (i, i+u) and right (i+u, i+w).
    O(w) slicing ops; autograd sees only slices and one stack (no in-place chart writes)."""
    m = left[1].shape[1] - w + 1
    return (torch.stack([left[u][:, :m] for u in range(1, w)], 2),
            torch.stack([right[w - u][:, u : u + m] for u in range(1, w)], 2))


def inside(g: Contraction, ids: Tensor, span_weights: Tensor | None = None) -> Tensor:
    """Scaled inside pass: ids (B, n) (one length) -> log p(x) (B,); `span_weights` (B, n, n) at
    [width-1, start] multiply each span of width >= 2 by exp(weight) (zeros: marginals by autograd).
    O(n^3) `combine` split terms and O(n^2) `project` calls; memory O(B n^2 C)."""
    B, n = ids.shape
    if n == 1:
        return g.root_leaf(ids[:, 0]).log()
    left, right = g.leaves(ids)
    left, sl = _normalise(left)
    right, sr = _normalise(right)
    # per width w: child messages (B, n-w+1, C) and their log scales (B, n-w+1)
    Lw, Rw, Ls, Rs = [left, left], [right, right], [sl, sl], [sr, sr]
    for w in range(2, n + 1):
        lc, rc = _children(Lw, Rw, w)
        ls, rs = _children(Ls, Rs, w)
        s = ls + rs  # (B, m, k)
        top = s.amax(-1)
        alpha = g.combine(lc * _weights(s - top[..., None])[..., None], rc)
        if span_weights is not None:
            alpha = alpha * span_weights[:, w - 1, : n - w + 1].exp()[..., None]
        alpha, sa = _normalise(alpha)
        sa = sa + top
        if w == n:
            return g.root(alpha[:, 0]).log() + sa[:, 0]
        pl, pr = g.project(alpha)
        pl, spl = _normalise(pl)
        pr, spr = _normalise(pr)
        Lw.append(pl)
        Rw.append(pr)
        Ls.append(spl + sa)
        Rs.append(spr + sa)
    raise AssertionError("unreachable")


def check_possible(logz: Tensor, where: list[int]) -> None:
    """Raise InputError naming the first input the grammar cannot generate (log p = -inf)."""
    bad = (~torch.isfinite(logz)).nonzero()
    if len(bad):
        i = where[int(bad[0, 0])]
        raise InputError(f"input[{i}]: the grammar cannot generate this sentence (probability 0)", param="input")


def span_marginals(g: Contraction, ids: Tensor) -> tuple[Tensor, Tensor]:
    """ids (B, n) -> (log p(x) (B,), p(span (i, i+w) is a constituent | x) (B, n, n) at [w-1, i] for
    w >= 2, zeros elsewhere). Autograd through `inside`: the same O(n^3) order of cost."""
    B, n = ids.shape
    with torch.enable_grad():
        dtype = g.dtype if hasattr(g, "dtype") else torch.float32
        weights = torch.zeros(B, n, n, dtype=dtype, device=ids.device, requires_grad=True)
        logz = inside(g, ids, span_weights=weights)
        if n == 1:
            return logz.detach(), torch.zeros(B, 1, 1, dtype=dtype, device=ids.device)
        (grad,) = torch.autograd.grad(logz.sum(), weights)
    return logz.detach(), grad


# -- Viterbi (max-product in log space) ---------------------------------------------------------------
def viterbi(g: MaxContraction, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Best labelled tree: ids (B, n) -> (max log p(x, tree) (B,), span labels (B, n, n) at [w-1, i]
    (label index of each constituent of width >= 2, -1 elsewhere), word labels (B, n) (index into the
    child space C of `log_leaves`)). Labels come from autograd through the max-product pass, which routes
    the gradient along the single best derivation. O(n^3) `max_combine` terms."""
    B, n = ids.shape
    with torch.enable_grad():
        left, right = g.log_leaves(ids)
        leaf_w = torch.zeros_like(left, requires_grad=True)
        left, right = left + leaf_w, right + leaf_w
        span_w = None
        if n == 1:
            best = g.log_root_leaf(left[:, 0])
        else:
            Lw, Rw = [left, left], [right, right]
            for w in range(2, n + 1):
                alpha = g.max_combine(*_children(Lw, Rw, w))  # (B, m, D)
                if span_w is None:
                    D = alpha.shape[-1]
                    span_w = torch.zeros(B, n, n, D, dtype=alpha.dtype, device=alpha.device, requires_grad=True)
                alpha = alpha + span_w[:, w - 1, : n - w + 1]
                if w == n:
                    best = g.log_root(alpha[:, 0])
                    break
                pl, pr = g.log_project(alpha)
                Lw.append(pl)
                Rw.append(pr)
        if not bool(torch.isfinite(best).all()):
            return best.detach(), torch.full((B, n, n), -1, dtype=torch.long), torch.full((B, n), -1)
        inputs = [leaf_w] if span_w is None else [leaf_w, span_w]
        grads = torch.autograd.grad(best.sum(), inputs)
    word_labels = grads[0].argmax(-1)
    if span_w is None:
        labels = torch.full((B, n, n), -1, dtype=torch.long, device=ids.device)
    else:
        sg = grads[1]
        labels = torch.where(sg.amax(-1) > 0.5, sg.argmax(-1), torch.full((), -1, device=sg.device))
    return best.detach(), labels, word_labels


# -- MBR CKY ------------------------------------------------------------------------------------------
def mbr_cky(marginals: Tensor) -> tuple[Tensor, list[list[tuple[int, int]]]]:
    """Tree maximising the summed span marginals: (B, n, n) at [w-1, i] -> (score (B,), spans (i, j) of
    width >= 2 per sentence, outermost first). O(B n^3) time (vectorised over the batch and the starts)."""
    B, n, _ = marginals.shape
    marg = marginals.double().cpu()
    best = torch.zeros(B, n, n, dtype=torch.float64)
    split = torch.zeros(B, n, n, dtype=torch.long)
    flat = best.view(B, n * n)
    for w in range(2, n + 1):
        m = n - w + 1
        li, ri = _split_index(n, w, torch.device("cpu"))
        v, k = (_gather(flat, li, m) + _gather(flat, ri, m)).max(-1)  # over the split points
        best[:, w - 1, :m] = v + marg[:, w - 1, :m]
        split[:, w - 1, :m] = k + 1
    spans: list[list[tuple[int, int]]] = []
    for b in range(B):
        out: list[tuple[int, int]] = []
        stack = [(0, n)]
        while stack:
            i, j = stack.pop()
            if j - i < 2:
                continue
            out.append((i, j))
            k = i + int(split[b, j - i - 1, i])
            stack.extend([(k, j), (i, k)])
        spans.append(out)
    return best[:, n - 1, 0], spans


# -- trees as strings ---------------------------------------------------------------------------------
def bracket(n: int, spans: dict[tuple[int, int], str], words: list[str], word_labels: list[str]) -> str:
    """Bracketed string of a binary tree over n words given its constituents of width >= 2 (with labels):
    `(S (X w1) (X (X w2) (X w3)))`. O(n^2)."""
    if n == 1:
        inner = f"({word_labels[0]} {words[0]})"
        root = spans.get((0, 1))
        return f"({root} {inner})" if root else inner
    starts: dict[int, list[int]] = {}
    for i, j in spans:
        starts.setdefault(i, []).append(j)

    def node(i: int, j: int) -> str:
        if j - i == 1:
            return f"({word_labels[i]} {words[i]})"
        k = max([e for e in starts.get(i, []) if e < j], default=i + 1)
        return f"({spans[(i, j)]} {node(i, k)} {node(k, j)})"

    return node(0, n)


def relabel_leaves(tree: str, words: list[str]) -> str:
    """Replace the leaves of a bracketed tree (token ids, left to right) by `words` (e.g. the vocabulary's
    strings); parentheses in words are written as -LRB- / -RRB-."""
    out: list[str] = []
    i = 0
    prev = None
    for t in tree.replace("(", " ( ").replace(")", " ) ").split():
        if t not in "()" and prev != "(":
            out.append(words[i].replace("(", "-LRB-").replace(")", "-RRB-"))
            i += 1
        else:
            out.append(t)
        prev = t
    return " ".join(out).replace("( ", "(").replace(" )", ")")


# -- sampling -----------------------------------------------------------------------------------------
@dataclass
class SampledTrees:
    """Sampled sentences (token ids) and their trees as (symbol, children or word) nested tuples."""

    ids: list[list[int]]
    trees: list[tuple]


def sample_trees(n: int, *, num_nt: int, root: CategoricalTable, expand: Callable[[Tensor], tuple[Tensor, Tensor]],
                 emit: Callable[[Tensor], Tensor], max_tokens: int, generator: torch.Generator,
                 device: torch.device, max_rounds: int = 100) -> SampledTrees:
    """Top-down ancestral sampling of n trees, all frontiers expanded together: `expand(A (N,))` draws the
    children (B, C) of nonterminals, `emit(T (N,))` the words of preterminals (T in 0..PT-1). Trees with more
    than `max_tokens` words are abandoned as soon as their frontier proves it and redrawn (so samples follow
    p(tree | length <= max_tokens)); LimitExceeded after `max_rounds` redraws. O(total nodes) draws."""
    done: dict[int, tuple[list[int], tuple]] = {}
    todo = list(range(n))
    for _ in range(max_rounds):
        if not todo:
            break
        for slot, res in zip(todo, _sample_round(len(todo), num_nt, root, expand, emit, max_tokens, generator,
                                                 device), strict=True):
            if res is not None:
                done[slot] = res
        todo = [s for s in todo if s not in done]
    if todo:
        raise LimitExceeded(f"max_tokens: could not draw sentences of at most {max_tokens} tokens in {max_rounds} "
                            "tries; raise max_tokens", param="max_tokens")
    return SampledTrees([done[i][0] for i in range(n)], [done[i][1] for i in range(n)])


def _sample_round(n: int, num_nt: int, root: CategoricalTable, expand, emit, max_tokens: int,
                  generator: torch.Generator, device: torch.device) -> list[tuple[list[int], tuple] | None]:
    """One attempt per sample: node arrays grown level by level, then assembled into trees."""
    all_sym = root.draw(torch.zeros(n, dtype=torch.long, device=device), generator)
    all_owner = torch.arange(n, device=device)
    children: dict[int, tuple[int, int]] = {}
    words: dict[int, int] = {}
    frontier = torch.arange(n, device=device)  # global node ids
    total = n
    leaves = torch.zeros(n, dtype=torch.long, device=device)
    dead = torch.zeros(n, dtype=torch.bool, device=device)
    while len(frontier):
        fs, fo = all_sym[frontier], all_owner[frontier]
        is_nt = fs < num_nt
        pending = torch.bincount(fo, minlength=n)
        dead |= (leaves + pending) > max_tokens
        keep = ~dead[fo]
        frontier, fs, fo, is_nt = frontier[keep], fs[keep], fo[keep], is_nt[keep]
        pt_nodes, pt_sym = frontier[~is_nt], fs[~is_nt]
        if len(pt_nodes):
            w = emit(pt_sym - num_nt)
            for node, word in zip(pt_nodes.tolist(), w.tolist(), strict=True):
                words[node] = word
            leaves += torch.bincount(fo[~is_nt], minlength=n)
        nt_nodes = frontier[is_nt]
        if not len(nt_nodes):
            break
        b, c = expand(fs[is_nt])
        k = len(nt_nodes)
        new_ids = total + torch.arange(2 * k, device=device)
        for node, lid, rid in zip(nt_nodes.tolist(), new_ids[:k].tolist(), new_ids[k:].tolist(), strict=True):
            children[node] = (lid, rid)
        all_sym = torch.cat([all_sym, b, c])
        all_owner = torch.cat([all_owner, fo[is_nt], fo[is_nt]])
        total += 2 * k
        frontier = new_ids
    syms = all_sym.tolist()
    dead_l = dead.tolist()
    out: list[tuple[list[int], tuple] | None] = []
    for s in range(n):
        if dead_l[s]:
            out.append(None)
            continue
        ids: list[int] = []
        out.append((ids, _assemble(s, syms, children, words, ids)))
    return out


def _assemble(node: int, syms: list[int], children: dict[int, tuple[int, int]], words: dict[int, int],
              ids: list[int]) -> tuple:
    """(symbol, left, right) / (symbol, word) nested tuples, collecting the words left to right."""
    stack: list[tuple[int, int]] = [(node, 0)]
    built: dict[int, tuple] = {}
    while stack:
        x, state = stack.pop()
        if x in words:
            ids.append(words[x])
            built[x] = (syms[x], words[x])
        elif state == 0:
            lc, rc = children[x]
            stack.extend([(x, 1), (rc, 0), (lc, 0)])
        else:
            lc, rc = children[x]
            built[x] = (syms[x], built.pop(lc), built.pop(rc))
    return built[node]


def tree_string(tree: tuple, names: Callable[[int], str]) -> str:
    """Nested (symbol, ...) tuples -> `(A (B 12) (C 7))` with leaves as token ids."""
    parts: list[str] = []
    stack: list[object] = [tree]
    while stack:
        t = stack.pop()
        if isinstance(t, str):
            parts.append(t)
            continue
        if len(t) == 2:
            parts.append(f"({names(t[0])} {t[1]})")
        else:
            stack.extend([")", t[2], " ", t[1]])
            parts.append(f"({names(t[0])} ")
    return "".join(parts)


# -- JSON-level operations shared by the PCFG families ------------------------------------------------
class PCFGOps:
    """The `op_*` methods of `latentlm.ops` for PCFG families, over this engine.

    A family supplies: `nt`, `pt`, `device`, `dtype`, `max_length`, `chart_width` (C), the `Contraction`
    methods, `symbol_name(i)` and `sampling_tables(temperature) -> (root table, expand, emit)`.
    Trees are bracketed strings whose leaves are token ids (the family sees no vocabulary; use
    `relabel_leaves(tree, vocab.decode(ids))` for words); MBR trees label the root `S` and every other node
    `X`; Viterbi trees carry the grammar's symbol names."""

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None):
        """Family instance from verified artifact tensors, moved to `device` / `dtype` (one precision:
        `storage_dtype` is ignored)."""
        return cls({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, config)

    @property
    def num_states(self) -> int:
        """Nonterminals plus preterminals."""
        return self.nt + self.pt

    def split_cost(self) -> int:
        """Rule work of one split point of the inside pass (rank-space: the chart width r)."""
        return int(self.chart_width)

    def cost(self, work: Work) -> int:
        """Per sentence of n tokens: n^3/6 split points x `split_cost` (Viterbi: PCFG_VITERBI_FACTOR times a dense
        split), plus n^2 x chart width x S for the terminals and the spans listed; sampling: n x max_tokens x S^2.
        """
        S = self.nt + self.pt
        if work.op == "sample":
            return int(work.n * work.max_tokens * (S * S + TOKEN_COST) + 8 * SAMPLE_STEP_COST)
        if work.op == "decode" and work.method == "viterbi":
            split = PCFG_VITERBI_FACTOR * self.nt * S * S
        else:
            split = self.split_cost()
        out = ENTRY_COST // 2 if work.op in ("posterior", "decode") else 0  # spans listed per sentence
        chart = int(self.chart_width)
        return int(sum(L * (L * L - 1) // 6 * split + L * L * (chart * S + out) for L in work.lengths)
                   + TOKEN_COST * work.tokens)

    def posterior_entries(self, lengths: tuple[int, ...], top_k: int | None) -> int:
        """Spans listed: per sentence of n tokens min(top_k, n(n-1)/2)."""
        spans = (n * (n - 1) // 2 for n in lengths)
        return sum(n if top_k is None else min(top_k, n) for n in spans)


    max_length: int = 200
    chart_elems: int = 1 << 25  # B * n^2 * C entries per chart of one sub-batch
    marginal_elems: int = 1 << 28  # B * n^3 * C / 3 entries kept for back-propagation (1 GiB in float32)
    nt: int
    pt: int
    device: torch.device
    dtype: torch.dtype

    def groups(self, seqs: list[list[int]]) -> list[list[int]]:
        return by_length(seqs, self.max_length, self.chart_elems, self.chart_width)

    def _ids(self, seqs: list[list[int]], idx: list[int]) -> Tensor:
        return torch.as_tensor([seqs[i] for i in idx], dtype=torch.long, device=self.device)

    def log_prob(self, seqs: list[list[int]]) -> Tensor:
        """log p(x) of each sentence (N,) float64 on CPU (-inf where the grammar cannot generate it)."""
        out = torch.empty(len(seqs), dtype=torch.float64)
        with torch.no_grad():
            for idx in self.groups(seqs):
                out[idx] = inside(self, self._ids(seqs, idx)).double().cpu()
        return out

    def op_score(self, seqs: list[list[int]], *, token_logprobs: bool = False) -> list[Score]:
        if token_logprobs:
            raise UnsupportedOperation(
                "token_logprobs: a PCFG scores whole sentences; per-token conditionals p(x_t | x_<t) would "
                "need prefix probabilities (Jelinek-Lafferty), which this family does not compute",
                param="token_logprobs")
        logp = self.log_prob(seqs)
        return [Score(float(lp), len(s)) for s, lp in zip(seqs, logp, strict=True)]

    def marginals(self, seqs: list[list[int]]) -> list[Tensor]:
        """Span marginals per sentence, (n, n) float64 at [w-1, i]; InputError if p(x) = 0."""
        out: list[Tensor | None] = [None] * len(seqs)
        for idx in by_length(seqs, self.max_length, self.marginal_elems, self.chart_width, cube=True):
            logz, marg = span_marginals(self, self._ids(seqs, idx))
            check_possible(logz, idx)
            marg = marg.double().cpu()
            for r, i in enumerate(idx):
                out[i] = marg[r]
        return out  # type: ignore[return-value]

    def op_posterior(self, seqs: list[list[int]], *, top_k: int | None = None) -> list[SpanMarginals]:
        res = []
        for s, marg in zip(seqs, self.marginals(seqs), strict=True):
            n = len(s)
            spans = [Span(i, i + w, float(marg[w - 1, i])) for w in range(2, n + 1) for i in range(n - w + 1)]
            spans.sort(key=lambda sp: (-sp.prob, sp.end - sp.start, sp.start))
            res.append(SpanMarginals(spans if top_k is None else spans[:top_k]))
        return res

    def op_decode(self, seqs: list[list[int]], *, method: str = "mbr") -> list[Parse]:
        if method == "viterbi":
            return self.decode_viterbi(seqs)
        if method != "mbr":
            raise UnsupportedOperation(f"method: unknown decode method {method!r}", param="method")
        margs = self.marginals(seqs)
        res: list[Parse | None] = [None] * len(seqs)
        by_n: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_n.setdefault(len(s), []).append(i)
        for n, idx in by_n.items():
            score, spans = mbr_cky(torch.stack([margs[i] for i in idx]))
            for r, i in enumerate(idx):
                labels = {sp: "X" for sp in spans[r]}
                labels[(0, n)] = "S"
                res[i] = Parse(bracket(n, labels, [str(t) for t in seqs[i]], ["X"] * n), sorted(spans[r]),
                               expected_correct=float(score[r]))
        return res  # type: ignore[return-value]

    def decode_viterbi(self, seqs: list[list[int]]) -> list[Parse]:
        raise UnsupportedOperation("method: this family has no Viterbi decoding; use 'mbr'", param="method")

    def op_sample(self, *, n: int, max_tokens: int, seed: int, prefix: list[int] | None = None,
                  temperature: float = 1.0, stop_id: int | None = None) -> list[Sample]:
        """n sentences with their trees (`stop_id` is ignored: a PCFG sentence ends with its tree)."""
        if prefix:
            raise UnsupportedOperation("prefix: PCFG sampling draws whole sentences; continuing a prefix would "
                                       "need prefix-conditioned inside scores, which this family does not compute",
                                       param="prefix")
        g = torch.Generator(device=self.device).manual_seed(seed)
        root, expand, emit = self.sampling_tables(temperature)
        out = sample_trees(n, num_nt=self.nt, root=root, expand=lambda a: expand(a, g), emit=lambda t: emit(t, g),
                           max_tokens=max_tokens, generator=g, device=self.device)
        return [Sample(ids, tree=tree_string(t, self.symbol_name)) for ids, t in zip(out.ids, out.trees, strict=True)]

    def symbol_name(self, i: int) -> str:
        return f"NT{i}" if i < self.nt else f"T{i - self.nt}"
