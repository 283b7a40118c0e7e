"""Exact sampling from a chain family conditioned on a constraint: n continuations drawn from p(y | prefix, y complete,
y satisfies C) under the backward messages of `models.constrained` (`Messages`; its docstring holds the recursion and
the argument for exactness). Split from it along one seam: that module builds the messages and reads them one step at
a time (next-token scores, the guide, the beam search); this one draws whole continuations from them. The helpers it
shares with them (`next_log_scores`, `eos_allowed`, `_advance`) are called through that module, so there is one of
each.

Usage: `sample(constrained.prepare(model, dfa), n, generator, prefix=prefix_ids, method="states")`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from latentlm.models import constrained as product
from latentlm.models.constrained import Messages
from latentlm.models.errors import InputError
from latentlm.models.sampling import draw_rows

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
        log_s = product.next_log_scores(msgs, a, q, j)
        top = log_s.amax(1, keepdim=True)
        v = draw_rows((log_s - top).exp(), generator)
        for i, tok in zip(rows.tolist(), v.tolist(), strict=True):
            out[i].append(tok)
        go = (v != eos).nonzero().squeeze(1)
        a, q = product._advance(msgs, a[go], q[go], v[go])
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
            logw[:, :-1] = torch.where(ok, product._log(term) + sig[dst], -math.inf)
        if eos is not None and product.eos_allowed(j, lo, hi):
            logw[:, -1] = torch.where(msgs.accept[q], product._log(msgs.eos[z]), -math.inf)
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
