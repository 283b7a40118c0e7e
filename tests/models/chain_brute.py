"""Brute force over every state path for tiny HMM-like models (float64), the reference for all families.

A family is reduced to `first[z, x] = p(z_1 = z, x_1 = x)` (Z, V) and
`step[z', z, x] = p(z_t = z, x_t = x | z_{t-1} = z')` (Z, Z, V); every quantity is then a sum or max over
all Z^T state paths."""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.family import Family
from latentlm.models.hmm import DenseHMM
from latentlm.models.rank_hmm import RankHMM


def joint_tables(model: Family) -> tuple[Tensor, Tensor]:
    """(first (Z, V), step (Z, Z, V)) in float64 for any HMM family."""
    if isinstance(model, RankHMM):
        W = model.emit.double().T  # (r, V)
        Vo = model.state_out.double()  # (r, m)
        Ui = model.state_in.double()  # (m, r)
        first = torch.einsum("q,qz,qx->zx", model.rank_start.double(), Vo, W)
        step = torch.einsum("pq,qz,qx->pzx", Ui, Vo, W)
        return first, step
    if isinstance(model, BlockedHMM):
        V = model.emit.shape[0]
        E = torch.zeros(model.num_states, V, dtype=torch.float64)
        for w in range(V):
            c = int(model.word_cluster[w])
            E[c * model.k : (c + 1) * model.k, w] = model.emit[w].double()
    elif isinstance(model, DenseHMM):
        E = model.emit.double()
    else:
        raise TypeError(type(model))
    first = model.start.double()[:, None] * E
    step = model.trans.double()[:, :, None] * E[None]
    return first, step


def path_logprobs(first: Tensor, step: Tensor, x: list[int]) -> dict[tuple[int, ...], float]:
    Z = first.shape[0]
    out = {}
    for path in itertools.product(range(Z), repeat=len(x)):
        p = first[path[0], x[0]].item()
        for t in range(1, len(x)):
            p *= step[path[t - 1], path[t], x[t]].item()
        out[path] = math.log(p) if p > 0 else -math.inf
    return out


def brute(model: Family, x: list[int]) -> dict:
    """logprob, token_logprobs, marginals (T, Z), viterbi path + logprob, mbr path."""
    first, step = joint_tables(model)
    Z = first.shape[0]
    lp = path_logprobs(first, step, x)
    probs = {p: math.exp(v) for p, v in lp.items()}
    total = sum(probs.values())
    prefix_lp = []
    for t in range(1, len(x) + 1):
        prefix_lp.append(math.log(sum(math.exp(v) for v in path_logprobs(first, step, x[:t]).values())))
    token_lp = [prefix_lp[0]] + [prefix_lp[t] - prefix_lp[t - 1] for t in range(1, len(x))]
    marg = torch.zeros(len(x), Z, dtype=torch.float64)
    for path, p in probs.items():
        for t, z in enumerate(path):
            marg[t, z] += p / total
    best = max(lp, key=lp.get)
    return {"logprob": math.log(total), "token_logprobs": token_lp, "marginals": marg,
            "viterbi": list(best), "viterbi_logprob": lp[best], "mbr": marg.argmax(1).tolist()}
