"""The training objectives: a VL-HMM batch's exact negative log-likelihood with its gradient from expected
counts (`BlockedNLL`, `blocked_loss`; BPTT carries and `--reset-eos` sentence pieces) and the rank-space HMM's
(`rank_loss`, autograd through the rank-space forward). Each takes its network (`networks.VLHMM`, `RankNeural`,
whose `step_nll` calls it) as a module: this module does not import them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import Carried, expected_counts, expected_counts_from_logits, logits_gradient_
from latentlm.models.kernels import gemm


class BlockedNLL(torch.autograd.Function):
    """-log p(x) of a batch under a blocked HMM given by its log-potentials (log start (Z',), log trans
    (Z', Z'), log emit (V, k')), differentiable in them: the forward pass is an exact forward-backward
    (`blocked_hmm.expected_counts`), the backward pass hands back minus the expected counts, which are the
    gradient of log p(x) with respect to the log-potentials. Autograd never runs through the DP. With
    `sparse_emit` the emission gradient is a sparse COO tensor (the batch's words' rows), for a log emit made by
    `cluster_log_softmax` (whose backward reads it as such); otherwise dense, for any producer.
    With `trans_logits` the second input holds the transitions' row logits, normalised here
    (`blocked_hmm.expected_counts_from_logits`): the gradient with respect to them is minus (C - trans *
    rowsum(C)) for the counts C, formed in place over the counts (`blocked_hmm.logits_gradient_`: one compiled
    pass on CPU), where a log-softmax before this function costs its output, an exponential here and the
    log-softmax's backward: two more passes over (Z', Z') and one more such matrix in memory. Backward runs once.
    Outputs (nll (), last (B, k')); `last` is not differentiable."""

    @staticmethod
    def forward(ctx, log_start: Tensor, log_trans: Tensor, log_emit: Tensor, word_cluster: Tensor, M: int,
                ids: Tensor, lengths: Tensor, carried: Carried | None, sparse_emit: bool = False,
                trans_logits: bool = False):
        args = (log_emit, word_cluster, M, ids, lengths, carried)
        if trans_logits:
            counts, trans = expected_counts_from_logits(log_start, log_trans, *args)
        else:
            counts, trans = expected_counts(log_start, log_trans, *args), None
        dt = log_trans.dtype
        emit = counts.emit.to(dt)
        saved = (counts.start.to(dt), counts.trans.to(dt), emit if sparse_emit else emit.to_dense())
        ctx.save_for_backward(*saved, *(() if trans is None else (trans,)))
        last = counts.last.to(dt)
        ctx.mark_non_differentiable(last)
        return -counts.log_lik.sum().to(dt), last

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_last: Tensor | None):
        start, counts, emit, *trans = ctx.saved_tensors
        if trans:  # d log p / d logits = C - trans * rowsum(C); the counts are not read again: overwritten
            g_trans = logits_gradient_(counts, trans[0], -grad)
        else:
            g_trans = -grad * counts
        return -grad * start, g_trans, -grad * emit, None, None, None, None, None, None, None


def blocked_loss(model: nn.Module, batch: Batch, active: Tensor, carry: Carried | None = None,
                 want_last: bool = False, eos: int | None = None, trans_logits: bool = True
                 ) -> tuple[Tensor, Carried | None]:
    """Negative log-likelihood summed over the batch's tokens under the state-dropout mask `active`
    (M, k') (`BlockedNLL`: exact, with the gradient from expected counts). `carry` from the previous chunk:
    each row's state before position 0 over all k states of its cluster, restricted here to the active ones
    (rows left with no mass start from the start distribution). With `want_last`, also the next chunk's carry:
    the filtered posterior at each row's last position over all k states of its last token's cluster (BPTT).
    With `eos` (--reset-eos), every token after an `eos` starts from the start distribution: the rows are cut
    into sentence pieces (`sentence_pieces`), the carry enters each row's first piece and leaves its last,
    and a row that ends with `eos` carries nothing on. `trans_logits` False normalises the transitions by a
    log-softmax before `BlockedNLL` instead of inside it (the same values; the path before the fusion, kept
    for `bench/training_throughput.py`'s same-process comparison)."""
    B = batch.ids.shape[0]
    rows = torch.arange(B, device=batch.ids.device)
    carried = None
    if carry is not None:
        kept = carry.state if active.shape[1] == model.k else carry.state.gather(1, active[carry.cluster])
        carried = Carried(kept / kept.sum(1, keepdim=True).clamp_min(1e-30), carry.cluster)
    pieces, first, last_piece = (batch, rows, rows) if eos is None else sentence_pieces(batch, eos)
    if carried is not None and pieces is not batch:  # only each row's first piece continues its carried state
        n = pieces.ids.shape[0]
        carried = Carried(carried.state.new_zeros(n, carried.state.shape[1]).index_copy(0, first, carried.state),
                          carried.cluster.new_zeros(n).index_copy(0, first, carried.cluster))
    # the start distribution is read only by rows with no carried state: where there are none it is not built
    # (its parameters then get no gradient; `fill_missing_grads` gives them the zeros a built one would)
    with_start = carried is None or not bool((carried.state.sum(1) > 0).all())
    ls, lt, le = model.slot_matrices(active, with_start=with_start, trans_logits=trans_logits)
    if ls is None:
        ls = lt.new_zeros(lt.shape[0])  # never read: every row starts from its carried state
    # le from `cluster_log_softmax`: sparse gradient; with `trans_logits` the transitions are normalised inside
    nll, last_k = BlockedNLL.apply(ls, lt, le, model.slot_cluster, model.M, model.word_slot[pieces.ids],
                                   pieces.lengths, carried, True, trans_logits)
    last = None
    if want_last:
        final = batch.ids[rows, batch.lengths - 1]
        lastc = model.word_cluster[final]
        last_k = last_k[last_piece]
        if eos is not None:  # a row whose chunk ends a sentence starts the next chunk afresh
            last_k = last_k.masked_fill((final == eos).unsqueeze(1), 0.0)
        state = last_k if active.shape[1] == model.k else \
            last_k.new_zeros(B, model.k).scatter(1, active[lastc], last_k)
        last = Carried(state, lastc)
    return nll, last


def sentence_pieces(batch: Batch, eos: int) -> tuple[Batch, Tensor, Tensor]:
    """The batch's rows cut after every `eos` token: (the pieces as a batch (S, L) in row order, each row's
    first piece (B,), each row's last piece (B,)). Rows must be non-empty. O(B T)."""
    ids, lengths = batch.ids, batch.lengths
    B, T = ids.shape
    valid = torch.arange(T, device=ids.device) < lengths[:, None]
    starts = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, :-1] == eos], 1) & valid
    tokens, begins = ids[valid], starts[valid]  # (N,) in row order
    piece = torch.cumsum(begins.long(), 0) - 1  # (N,) each token's piece
    offset = torch.arange(len(tokens), device=ids.device) - begins.nonzero().squeeze(1)[piece]
    n = int(piece[-1]) + 1
    piece_len = torch.bincount(piece, minlength=n)
    out = ids.new_zeros(n, int(piece_len.max()))
    out[piece, offset] = tokens
    row_start = torch.cumsum(lengths, 0) - lengths  # each row's first token in `tokens`
    return Batch(out, piece_len), piece[row_start], piece[row_start + lengths - 1]


def rank_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Negative log-likelihood summed over the batch (rank-space forward, O(B T r^2))."""
    start, si, so, emit = model.matrices()
    B = batch.ids.shape[0]
    log_cond, _ = chain.forward_autograd((start @ si).expand(B, -1), emit[batch.ids], gemm.matmul(so, si),
                                         batch.lengths)
    return -log_cond.sum()


