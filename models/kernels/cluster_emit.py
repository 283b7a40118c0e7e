"""A VL-HMM's emission logits, normalised within each cluster, and their gradient, in compiled sweeps.

The words are stored in cluster order (cluster m owns rows offsets[m] .. offsets[m+1] of the word table), and
each cluster's words are scored against that cluster's own k states only:

    logits[v, j] = words[v] . states[m, j] (+ bias[v]),   out[v, j] = logits[v, j] - logsumexp_{v' in m} logits[v', j]

for v in cluster m: a (V, k) log-emission table, each state's column a distribution over its cluster's words.
As PyTorch ops this is a loop over the M clusters (a small GEMM and a log-softmax each, a split and a cat):
some 2 M ops forward and 4 M backward, whose fixed costs outweigh their 2 V k h multiply-adds when k is small.
Here one pass does the forward and one the backward (threads take contiguous ranges of clusters, of about
equal word counts; no two write the same row):

    d_logits[v, j] = g[v, j] - exp(out[v, j]) sum_{v' in m} g[v', j]
    d_words[v] = sum_j d_logits[v, j] states[m, j],  d_states[m, j] = sum_{v in m} d_logits[v, j] words[v],
    d_bias[v] = sum_j d_logits[v, j].

O(V k h) each way; float32 or float64 (one dtype). `training.neural.cluster_log_softmax` wraps them as an
autograd function (and keeps the PyTorch loop as its reference and its path off CPU).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels.blas import as_array
from latentlm.models.kernels.jit import BORROWED, FASTMATH, HAVE_NUMBA, njit
from latentlm.models.kernels.threads import run_ranges

if HAVE_NUMBA:

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _forward(words, states, bias, offsets, out, lo, hi, zero):  # pragma: no cover - compiled
        """out (V, k) for clusters lo .. hi - 1; `bias` (V,) or (0,) for none; `zero` (1,) of the data's dtype
        (the accumulators' type)."""
        k, h = states.shape[1], states.shape[2]
        use_bias = bias.shape[0] > 0
        for m in range(lo, hi):
            first, last = offsets[m], offsets[m + 1]
            for v in range(first, last):
                w = words[v]
                for j in range(k):
                    e = states[m, j]
                    acc = zero[0]
                    for t in range(h):
                        acc += w[t] * e[t]
                    out[v, j] = acc + bias[v] if use_bias else acc
            if last == first:
                continue
            for j in range(k):  # log-softmax of column j over the cluster's words
                top = out[first, j]
                for v in range(first + 1, last):
                    top = max(top, out[v, j])
                total = 0.0
                for v in range(first, last):
                    total += np.exp(out[v, j] - top)
                shift = top + np.log(total)
                for v in range(first, last):
                    out[v, j] -= shift

    @njit(nogil=True, fastmath=FASTMATH, cache=True, **BORROWED)
    def _backward(grad, out, words, states, offsets, d_words, d_states, d_bias, lo, hi, col, d_logit
                  ):  # pragma: no cover - compiled
        """d_words (V, h), d_states (M, k, h), d_bias (V,) for clusters lo .. hi - 1 (each written whole);
        scratch col (k,) float64 and d_logit (k,) in the data's dtype (the inner loops stay in it)."""
        k, h = states.shape[1], states.shape[2]
        for m in range(lo, hi):
            first, last = offsets[m], offsets[m + 1]
            for j in range(k):
                s = 0.0
                for v in range(first, last):
                    s += grad[v, j]
                col[j] = s
                for t in range(h):
                    d_states[m, j, t] = 0.0
            for v in range(first, last):
                total = 0.0
                for j in range(k):
                    d = grad[v, j] - np.exp(out[v, j]) * col[j]
                    d_logit[j] = d
                    total += d
                d_bias[v] = total
                dw = d_words[v]
                w = words[v]
                for t in range(h):
                    dw[t] = 0.0
                for j in range(k):
                    dj = d_logit[j]  # in the data's dtype, so the two loops below stay in it
                    e = states[m, j]
                    ds = d_states[m, j]
                    for t in range(h):
                        dw[t] += dj * e[t]
                        ds[t] += dj * w[t]


# -- drivers (threads take contiguous cluster ranges of about equal word counts) -----------------------------
def forward_cpu(words: Tensor, states: Tensor, bias: Tensor | None, offsets: Tensor, threads: int) -> Tensor:
    """out (V, k) (see the module's docstring) for words (V, h) in cluster order, states (M, k, h), bias (V,)
    or None, offsets (M + 1,) int64 (cluster m's words are rows offsets[m] .. offsets[m+1]), on CPU."""
    V, k = words.shape[0], states.shape[1]
    out = torch.empty(V, k, dtype=words.dtype)
    w, s, off, o = as_array(words), as_array(states), as_array(offsets), out.numpy()
    b = as_array(bias) if bias is not None else np.empty(0, dtype=w.dtype)
    zero = np.zeros(1, dtype=w.dtype)
    run_ranges(np.diff(off), threads, lambda lo, hi: _forward(w, s, b, off, o, lo, hi, zero))
    return out


def backward_cpu(grad: Tensor, out: Tensor, words: Tensor, states: Tensor, offsets: Tensor, threads: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(d_words (V, h), d_states (M, k, h), d_bias (V,)) from the gradient `grad` (V, k) of `forward_cpu`'s
    output `out`."""
    d_words, d_states = torch.empty_like(words), torch.empty_like(states)
    d_bias = torch.empty(words.shape[0], dtype=words.dtype)
    g, o, w, s, off = (as_array(x) for x in (grad, out, words, states, offsets))
    dw, ds, db = d_words.numpy(), d_states.numpy(), d_bias.numpy()
    k = s.shape[1]
    run_ranges(np.diff(off), threads, lambda lo, hi: _backward(g, o, w, s, off, dw, ds, db, lo, hi, np.empty(k),
                                                                 np.empty(k, dtype=w.dtype)))
    return d_words, d_states, d_bias
