"""A VL-HMM's emission table: each word's logits against its own cluster's states, normalised over the cluster's
words (`cluster_log_softmax`), as three interchangeable autograd paths: the compiled passes of
`kernels.cluster_emit` (CPU), in-place GEMMs per cluster (CPU) and one padded batched GEMM (GPU)."""

from __future__ import annotations

import functools
import itertools

import torch
from torch import Tensor

from latentlm.models.kernels import cluster_emit, gemm

CLUSTER_EMIT_MAX_K = 32  # states per cluster up to which `cluster_log_softmax` runs the compiled passes: at 128
#                         clusters they beat the in-place GEMMs up to 32 states and tie at 64; above, and at 8 large
#                         clusters, the GEMMs win (bench/results/cluster_emit.md, 2026-11-28)


def cluster_log_softmax(words: Tensor, states: Tensor, bias: Tensor | None, sizes: list[int]) -> Tensor:
    """Log-emission table (V, k) by slot: each word's logits against its own cluster's k states, normalised
    over the cluster's words (`kernels.cluster_emit`'s docstring has the formula). words (V, h) in cluster
    order, states (M, k, h), bias (V,) or None, sizes (M,) words per cluster. On CPU with numba
    (float32/float64, up to CLUSTER_EMIT_MAX_K states per cluster) one compiled pass each way
    (`ClusterLogSoftmax`); else one GEMM and one log-softmax per cluster and each way, written in place
    (`ClusterGemmLogSoftmax`; `cluster_log_softmax_reference` is the same as plain PyTorch ops). O(V k h)."""
    if (cluster_emit.HAVE_NUMBA and words.device.type == "cpu" and states.device.type == "cpu"
            and words.dtype in (torch.float32, torch.float64) and states.dtype == words.dtype
            and (bias is None or bias.dtype == words.dtype) and states.shape[1] <= CLUSTER_EMIT_MAX_K):
        return ClusterLogSoftmax.apply(words, states, bias, torch.tensor([0, *itertools.accumulate(sizes)]))
    if words.device.type != "cpu":
        return cluster_log_softmax_padded(words, states, bias, sizes)
    return ClusterGemmLogSoftmax.apply(words, states, bias, sizes)


def cluster_log_softmax_padded(words: Tensor, states: Tensor, bias: Tensor | None, sizes: list[int]) -> Tensor:
    """`cluster_log_softmax` as one batched GEMM and one masked log-softmax over the clusters padded to the
    largest (M, L, k), then the (V, k) rows gathered back: a fixed handful of kernels whatever M (what a GPU
    runs; the per-cluster loop launches ~10 small kernels per cluster each step). Plain autograd; a sparse
    upstream gradient (`BlockedNLL`'s) is made dense first. O(M L k h) for L the largest cluster's words."""
    slot_of, rows = _padded_layout(tuple(sizes), str(words.device))  # (M, L) slot ids, (V,) flat positions
    M, L = slot_of.shape
    read = slot_of.clamp_min(0)
    logits = torch.bmm(words[read], states.transpose(1, 2))  # (M, L, k)
    if bias is not None:
        logits = logits + bias[read].unsqueeze(-1)
    logits = logits.masked_fill((slot_of < 0).unsqueeze(-1), float("-inf"))
    out = torch.log_softmax(logits, 1).reshape(M * L, -1)[rows]
    return _DenseGrad.apply(out)


@functools.lru_cache(maxsize=8)
def _padded_layout(sizes: tuple[int, ...], device: str) -> tuple[Tensor, Tensor]:
    """For clusters of `sizes` words (slots in cluster order): (M, L) the slot at each padded position (-1 for
    padding; read through as slot 0 and masked) and (V,) each slot's flat position m L + j."""
    L = max(sizes)
    offsets = torch.tensor([0, *itertools.accumulate(sizes)])
    j = torch.arange(L)
    slot_of = torch.where(j < torch.tensor(sizes)[:, None], offsets[:-1, None] + j, -1)
    rows = (slot_of.reshape(-1) >= 0).nonzero().squeeze(1)
    return slot_of.to(device), rows.to(device)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes a sparse incoming gradient dense (for producers whose backward needs it)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.to_dense() if grad.is_sparse else grad


def cluster_log_softmax_reference(words: Tensor, states: Tensor, bias: Tensor | None, sizes: list[int]) -> Tensor:
    """`cluster_log_softmax` as PyTorch ops: per cluster a GEMM and a log-softmax, then one cat (any device)."""
    per_cluster = words.split(sizes)
    if bias is None:
        parts = [torch.log_softmax(w @ e.T, dim=0) for w, e in zip(per_cluster, states.unbind(0), strict=True)]
    else:
        # unbind, not states[m]: the backward of M selects would add M zero-filled (M, k, h) tensors
        parts = [torch.log_softmax(torch.addmm(b[:, None], w, e.T), dim=0)
                 for w, e, b in zip(per_cluster, states.unbind(0), bias.split(sizes), strict=True)]
    return torch.cat(parts)


class ClusterGemmLogSoftmax(torch.autograd.Function):
    """`cluster_log_softmax` as the PyTorch loop's GEMMs and fused log-softmax kernels, each writing into its
    cluster's slice of one output (any device): the forward's log-softmax writes the (V, k) table by cluster
    slices, the backward writes the logits', words' and states' gradients likewise. The loop's cat of the
    clusters' tables, the cat its split's backward makes of the word gradients and the stack of the state
    gradients are gone; the flops are the same. A sparse gradient (`BlockedNLL`'s emission counts: the batch's
    words' rows) is never made dense: each cluster's logit gradient is minus the softmax times the gradient's
    column sums, plus its rows. apply(words (V, h), states (M, k, h), bias (V,) or None, sizes (M,) list) -> (V,
    k). O(V k h)."""

    @staticmethod
    def forward(ctx, words: Tensor, states: Tensor, bias: Tensor | None, sizes: list[int]) -> Tensor:
        out = words.new_empty(words.shape[0], states.shape[1])
        for (lo, hi), s in zip(_slices(sizes), states.unbind(0), strict=True):
            logits = gemm.nt(words[lo:hi], s, None if bias is None else bias[lo:hi, None])
            torch._log_softmax(logits, 0, False, out=out[lo:hi])  # each state's logits over the cluster's words
        return _kept(ctx, words, states, out, sizes, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None, None]:
        words, states, out = ctx.saved_tensors
        slices = _slices(ctx.layout)
        d_logits, d_words, d_states = torch.empty_like(out), torch.empty_like(words), torch.empty_like(states)
        sparse = grad.is_sparse  # nonzero on a few words' rows (`BlockedNLL`'s emission counts): no dense grad to read
        if sparse:
            grad = grad.coalesce()
            rows, values = grad.indices()[0], grad.values()
            ends = torch.tensor([hi for _, hi in slices], device=rows.device)
            firsts = [0, *torch.searchsorted(rows, ends).tolist()]  # rows are sorted: each cluster's are a range
        else:
            grad = grad.contiguous()
        for m, (lo, hi) in enumerate(slices):
            d = d_logits[lo:hi]
            if sparse:  # d = grad - softmax * (the column sums of grad over the cluster's words)
                mine = slice(firsts[m], firsts[m + 1])
                torch.exp(out[lo:hi], out=d).mul_(values[mine].sum(0).neg())
                d.index_add_(0, rows[mine] - lo, values[mine])
            else:
                torch._log_softmax_backward_data(grad[lo:hi], out[lo:hi], 0, out.dtype, out=d)
            gemm.nn(d, states[m], out=d_words[lo:hi])
            gemm.tn(d, words[lo:hi], out=d_states[m])
        return d_words, d_states, (d_logits.sum(1) if ctx.has_bias else None), None


def _kept(ctx, words: Tensor, states: Tensor, out: Tensor, layout: object, bias: Tensor | None) -> Tensor:
    """Keep what a cluster emission's backward reads (words, states, the output table; the clusters' layout and
    whether there is a bias) on `ctx`; returns `out`."""
    ctx.save_for_backward(words, states, out)
    ctx.layout, ctx.has_bias = layout, bias is not None
    return out


def _slices(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each cluster's rows, from the clusters' sizes."""
    ends = list(itertools.accumulate(sizes))
    return list(zip([0, *ends[:-1]], ends, strict=True))


class ClusterLogSoftmax(torch.autograd.Function):
    """`cluster_log_softmax` by the compiled passes of `kernels.cluster_emit`, on torch's thread count:
    apply(words (V, h), states (M, k, h), bias (V,) or None, offsets (M + 1,)) -> (V, k)."""

    @staticmethod
    def forward(ctx, words: Tensor, states: Tensor, bias: Tensor | None, offsets: Tensor) -> Tensor:
        states = states.contiguous()
        out = cluster_emit.forward_cpu(words, states, bias, offsets, torch.get_num_threads())
        return _kept(ctx, words, states, out, offsets, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None, None]:
        words, states, out = ctx.saved_tensors
        grad = grad.to_dense() if grad.is_sparse else grad.contiguous()
        d_words, d_states, d_bias = cluster_emit.backward_cpu(grad, out, words, states, ctx.layout,
                                                              torch.get_num_threads())
        return d_words, d_states, (d_bias if ctx.has_bias else None), None


