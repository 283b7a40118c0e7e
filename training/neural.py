"""Neural HMM language models trained by gradient descent through the scaled forward of `models.chain`.

* `blocked_hmm` — VL-HMM (Chiu & Rush 2020, App. A.2): Z = M k states over M Brown clusters; factored
  state embeddings [E_m(cluster); E_z(state)] composed by residual MLPs with LayerNorm into H_out, H_in,
  H_emit; trans = softmax(H_out H_in^T), emission p(w | z) = softmax over z's cluster's words of
  H_emit E_x^T. State dropout: per batch, each cluster keeps exactly k - round(lambda k) states drawn
  without replacement (one mask shared by the batch), which also shrinks the DP to k' x k' blocks.
  Optional BPTT: the corpus as B running streams cut into chunks, carrying the filtered posterior.
* `rank_hmm` — rank-space HMM (Yang et al. 2022, §4.3, App. B): U, V softmaxes of dot products of state and
  rank embeddings, W softmax over words of h2(rank embeddings) . word embeddings; dropout 0.1 on the start
  vector and the U/V embeddings; forward in rank space, O(T r^2).

Both use AdamW, length-bucketed shuffled batches, LR decay on a validation plateau, early stopping,
checkpoints (safetensors + JSON) and `--resume`; export caches the matrices in the family's schema, and
the training-time validation perplexity is computed by the exported family's own scoring code. On the CPU a
step's float32 GEMMs (blocked_hmm: state MLPs, transition logits, each cluster's emission logits; rank_hmm: the
MLPs, U, V, the emission logits and V U^T) run on the faster of torch's BLAS and oneDNN for the model's shapes
(`kernels.gemm`, `gemm_for_run`, `--gemm`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import (
    BlockedHMM,
    Carried,
    expected_counts,
    expected_counts_from_logits,
    logits_gradient_,
)
from latentlm.models.errors import LatentLMError
from latentlm.models.kernels import cluster_emit, gemm
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.registry import save_artifact
from latentlm.models.vocab import Vocabulary
from latentlm.training import common
from latentlm.training.data import load_training_split


# -- building blocks ----------------------------------------------------------------------------------
class TrainingDiverged(LatentLMError):
    """The loss became NaN or infinite: training stops before writing a broken model (exit status 2)."""


class ResBlock(nn.Module):
    """Chiu & Rush eq. 7: f(E) = g(ReLU(E W1)), g(D) = LayerNorm(ReLU(D W2) + D). (n, h) -> (n, h)."""

    def __init__(self, h: int, d_in: int | None = None):
        super().__init__()
        self.w1 = nn.Linear(d_in or h, h)
        self.w2 = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x: Tensor) -> Tensor:
        d = torch.relu(gemm.linear(x, self.w1.weight, self.w1.bias))
        return self.norm(torch.relu(gemm.linear(d, self.w2.weight, self.w2.bias)) + d)


class YangRes(nn.Module):
    """Yang et al. App. B: h(x) = g1(g2(W x)), g(y) = ReLU(V ReLU(U y)) + y. (n, h) -> (n, h)."""

    def __init__(self, h: int):
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
                                     for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        y = gemm.linear(x, self.proj.weight, self.proj.bias)
        for first, _, second, _ in self.layers:  # Linear, ReLU, Linear, ReLU (`kernels.gemm`'s products)
            y = torch.relu(gemm.linear(torch.relu(gemm.linear(y, first.weight, first.bias)), second.weight,
                                       second.bias)) + y
        return y


def sample_state_dropout(M: int, k: int, keep: int, generator: torch.Generator) -> Tensor:
    """(M, keep) sorted within-cluster state indices: each cluster keeps exactly `keep` of its k states,
    drawn uniformly without replacement (Gumbel top-k of i.i.d. uniforms). O(M k log k)."""
    scores = torch.rand(M, k, generator=generator)
    return scores.topk(keep, dim=1).indices.sort(dim=1).values


class VLHMM(nn.Module):
    """VL-HMM parameters; `matrices(active)` gives log start (Z',), log trans (Z', Z') and log emission
    (V, k') over the active states (all states when active is None). O(Z'^2 h + V k' h): each word's
    emission logits are built against its own cluster's states only.

    `state_embedding`:
    * "factored" (App. A.2, eq. 9): [E_m(cluster); E_z(state)] composed by a residual MLP per role, then the
      role's MLP (eq. 7) gives H_out, H_in, H_emit; trans = softmax(H_out H_in^T), start = softmax(H_in w_s),
      emission logits H_emit E_x^T.
    * "independent" (App. A.3, the emission-constraint ablations of Table 3), as the authors' public code
      builds it: one embedding (Z, h) per role, initialised N(0, 1); trans logits = MLP(E_trans) W_next^T with
      W_next (Z, h) a free output vector per next state; start logits = MLP(E_start) w + b; emission logits =
      MLP(E_emit) W_x^T + b_x with a per-word bias b_x (an output layer over the vocabulary). The paper's text
      (eq. 8) feeds one E_z to every role and has no word bias; we follow the code, which reproduces Table 3.
    * "tied": the independent parameterisation with ONE state embedding E (Z, h) for every role, as the authors'
      public command for the paper-scale PTB model ties them (`--state ind --tw slIlrIrp`: start, left, right
      and preterminal share one table): start logits = MLP_s(E) w + b, trans logits = MLP_out(E) E^T (the next
      state's side is its embedding itself), emission logits = MLP_emit(E) W_x^T + b_x. A quarter of the
      independent embeddings' state parameters (Z h instead of 4 Z h). Differs from the code: the table starts
      N(0, 1 / h), not N(0, 1), since it is also the transitions' output side: with N(0, 1) the first transition
      logits have standard deviation ~sqrt(h) (the first check of a 4,096-state model read 2.1e9 perplexity,
      260 after 1,000 steps against 181 with N(0, 1 / h); results/ptb_results.md).
    """

    def __init__(self, V: int, word_cluster: Tensor, M: int, k: int, h: int, state_embedding: str = "factored"):
        super().__init__()
        self.V, self.M, self.k, self.h = V, M, k, h
        self.state_embedding = state_embedding
        Z = M * k
        self.register_buffer("word_cluster", word_cluster.clone())
        if state_embedding == "factored":
            half = max(1, h // 2)
            self.cluster_emb = nn.Parameter(torch.randn(M, half) * 0.1)
            self.state_emb = nn.Parameter(torch.randn(Z, h - half) * 0.1)
            self.compose = nn.ModuleDict({r: ResBlock(h) for r in ("out", "in", "emit")})
            self.mlp = nn.ModuleDict({r: ResBlock(h) for r in ("out", "in", "emit")})
            self.start_vec = nn.Parameter(torch.randn(h) * 0.1)
            self.word_bias_by_slot = None
        elif state_embedding in ("independent", "tied"):
            bound = 1.0 / math.sqrt(h)  # nn.Linear's default initialisation of an output layer
            tied = state_embedding == "tied"
            # independent: start, trans and emit roles, N(0, 1); tied: one table, N(0, 1 / h) (see the docstring)
            self.state_emb = nn.Parameter(torch.randn(Z, h) / math.sqrt(h) if tied else torch.randn(3, Z, h))
            self.mlp = nn.ModuleDict({r: ResBlock(h) for r in ("start", "out", "emit")})
            self.start_out = nn.Linear(h, 1)
            self.next_state = None if tied else nn.Parameter(torch.empty(Z, h).uniform_(-bound, bound))
            self.word_bias_by_slot = nn.Parameter(torch.empty(V).uniform_(-bound, bound))
        else:
            raise ValueError(f"state_embedding: expected one of {common.STATE_EMBEDDINGS}, got {state_embedding!r}")
        # words in cluster order ("slots"): slot i holds word word_order[i]; word_slot is the inverse.
        # The word embeddings are stored by slot, so each cluster's words are one contiguous block.
        order = torch.argsort(word_cluster, stable=True)
        self.register_buffer("word_order", order)
        self.register_buffer("word_slot", torch.argsort(order))
        self.register_buffer("slot_cluster", word_cluster[order])
        self.word_emb_by_slot = nn.Parameter(
            torch.randn(V, h) * 0.1 if state_embedding == "factored"
            else torch.empty(V, h).uniform_(-1.0 / math.sqrt(h), 1.0 / math.sqrt(h)))
        self.cluster_sizes = torch.bincount(word_cluster, minlength=M).tolist()

    def state_axes(self) -> dict[str, int]:
        """The parameters indexed by state, each with its state axis (what `split_states` doubles)."""
        return {"state_emb": 1, "next_state": 0} if self.state_embedding == "independent" else {"state_emb": 0}

    def role_emb(self, role: int) -> Tensor:
        """The state embedding (Z, h) of role 0 (start), 1 (trans) or 2 (emit): the shared table when tied."""
        return self.state_emb if self.state_embedding == "tied" else self.state_emb[role]

    def emission_reprs(self, states: Tensor) -> Tensor:
        """H_emit (n, h) of global state ids `states` (n,): the state vectors `embed` serves."""
        if self.state_embedding != "factored":
            return self.mlp["emit"](rows_of(self.role_emb(2), states))
        e = torch.cat([rows_of(self.cluster_emb, states // self.k), rows_of(self.state_emb, states)], -1)
        return self.mlp["emit"](self.compose["emit"](e))

    def start_and_trans_logits(self, states: Tensor, with_start: bool = True) -> tuple[Tensor | None, Tensor]:
        """Start logits (n,) (None without `with_start`) and transition logits (n, n) among global state ids
        `states` (n,)."""
        start, h_from, h_to = self.start_and_trans_factors(states, with_start)
        return start, gemm.linear(h_from, h_to)

    def start_and_trans_factors(self, states: Tensor, with_start: bool = True
                                ) -> tuple[Tensor | None, Tensor, Tensor]:
        """Start logits (n,) (None without `with_start`) and the transition logits' two factors among global
        state ids `states` (n,): H_from (n, h) and H_to (n, h), logits H_from H_to^T. O(n h^2)."""
        if self.state_embedding != "factored":
            tied = self.state_embedding == "tied"
            e_out = rows_of(self.role_emb(1), states)  # tied: the one table's rows, gathered once for every role
            start = (self.start_out(self.mlp["start"](e_out if tied else rows_of(self.role_emb(0), states)))
                     .squeeze(-1) if with_start else None)
            to = e_out if tied else rows_of(self.next_state, states)
            return start, self.mlp["out"](e_out), to
        e = torch.cat([rows_of(self.cluster_emb, states // self.k), rows_of(self.state_emb, states)], -1)
        h_out, h_in = (self.mlp[r](self.compose[r](e)) for r in ("out", "in"))
        return (h_in @ self.start_vec if with_start else None), h_out, h_in

    def slot_log_emit(self, state_reprs: Tensor) -> Tensor:
        """Log emission (V, k') by slot from the active states' H_emit (M, k', h): per cluster, its words' logits
        against its own k' states, normalised over those words (`cluster_log_softmax`). O(V k' h)."""
        return cluster_log_softmax(self.word_emb_by_slot, state_reprs, self.word_bias_by_slot, self.cluster_sizes)

    def matrices(self, active: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(log start (Z',), log trans (Z', Z'), log emit (V, k') by word id)."""
        ls, lt, le = self.slot_matrices(active)
        assert ls is not None
        return ls, lt, le[self.word_slot]

    def slot_matrices(self, active: Tensor | None = None, with_start: bool = True, trans_logits: bool = False
                      ) -> tuple[Tensor | None, Tensor, Tensor]:
        """`matrices` with the emission rows by slot (cluster order): what training uses (no gather). Without
        `with_start` the start distribution is not built (None): a BPTT step whose rows all continue a
        carried state never reads it (for the independent embeddings that skips a role's whole MLP). With
        `trans_logits` the transitions come back as row logits, not normalised (`BlockedNLL(...,
        trans_logits=True)` normalises them itself, in one pass)."""
        M, k = self.M, self.k
        if active is None:
            active = torch.arange(k, device=self.word_cluster.device).expand(M, k)
        kk = active.shape[1]
        states = (torch.arange(M, device=active.device)[:, None] * k + active).reshape(-1)  # (M kk,)
        start, trans = self.start_and_trans_logits(states, with_start)
        emit = self.slot_log_emit(self.emission_reprs(states).view(M, kk, -1))
        log_start = torch.log_softmax(start, 0) if start is not None else None
        return log_start, trans if trans_logits else torch.log_softmax(trans, -1), emit  # emission by slot

    def export_tensors(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Cached `blocked_hmm` tensors (float64-normalised on the parameters' device, float32 on `device`:
        the CPU for the artifact, the parameters' device for an evaluation during training)."""
        with torch.no_grad():
            Z, dev = self.M * self.k, self.word_cluster.device
            states = torch.arange(Z, device=dev)
            start_logits, h_from, h_to = self.start_and_trans_factors(states)
            assert start_logits is not None
            start = torch.log_softmax(start_logits, 0).double().exp()
            trans = torch.empty(Z, Z, dtype=torch.float32, device=dev)
            for first in range(0, Z, EXPORT_ROWS):  # (Z, Z) by row blocks: see EXPORT_ROWS
                rows = slice(first, first + EXPORT_ROWS)
                block = torch.log_softmax(gemm.linear(h_from[rows], h_to), -1).double().exp()
                trans[rows] = (block / block.sum(1, keepdim=True)).float()
            # each state's emission-side representation H_emit (Z, h), served by `embed`
            state_vectors = self.emission_reprs(states)
            emit = self.slot_log_emit(state_vectors.view(self.M, self.k, -1))[self.word_slot].double().exp()
            per_state = torch.zeros(self.M, self.k, dtype=torch.float64, device=emit.device).index_add_(
                0, self.word_cluster, emit)
            emit = emit / per_state[self.word_cluster]
        out = {"start": start / start.sum(), "trans": trans, "emit": emit,
               "word_cluster": self.word_cluster, "state_vectors": state_vectors}
        return {k: (v.float() if v.is_floating_point() else v.long()).to(device) for k, v in out.items()}


EXPORT_ROWS = 2048  # transition rows `VLHMM.export_tensors` normalises at a time (float64): the whole (Z, Z) matrix
#                    in float64 with its float32 logits took ~30 GB at 2^15 states; by blocks the export holds the
#                    float32 result and one block (0.5 GiB at 2^15)

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


def rows_of(table: Tensor, ids: Tensor) -> Tensor:
    """table[ids] for a parameter table (n, ...) and row ids (m,), as `index_select`: its backward adds the
    gradient rows into place (index_add), where advanced indexing's runs index_put with accumulation, about
    3.6x slower for a 1,024 x 256 table on a 2-core AMD EPYC (bench/results/training_throughput.md: 1.09-1.13x
    on whole training steps). Where `ids` is every row in order (no state dropout) the table itself: no copy
    forward, no zero-filled table and index_add backward."""
    n = table.shape[0]
    if ids.shape[0] == n and bool(torch.equal(ids, torch.arange(n, device=ids.device))):
        return table
    return table.index_select(0, ids)


def split_states(t: Tensor, M: int, k: int, axis: int) -> Tensor:
    """`t` with its state axis `axis` (M k states, cluster-major) doubled to M 2k: state j of cluster m becomes
    states 2j and 2j + 1 of cluster m, both copies of it. O(numel)."""
    before, after = t.shape[:axis], t.shape[axis + 1:]
    pairs = t.reshape(*before, M, k, 1, *after).expand(*before, M, k, 2, *after)
    return pairs.reshape(*before, M * 2 * k, *after)


def split_state_dict(model: VLHMM, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` (a state dict of `model`, or part of one) with every state axis doubled as `split_model`
    splits the model (no noise): the same distribution over twice the states. O(numel)."""
    axes = model.state_axes()
    return {n: split_states(v, model.M, model.k, axes[n]) if n in axes else v for n, v in params.items()}


def split_model(model: VLHMM, opt: torch.optim.Optimizer | None = None, best_state: dict[str, Tensor] | None = None,
                generator: torch.Generator | None = None, noise: float = 0.0
                ) -> tuple[VLHMM, torch.optim.Optimizer | None, dict[str, Tensor] | None]:
    """Every state of `model` split in two within its cluster (k -> 2k states per cluster). Without noise the
    new model is the same distribution: the copies share their parent's outgoing and emission distributions
    and halve its start and incoming transition probabilities (all logits are copied, so each softmax over
    the doubled states gives each copy half). `noise` adds N(0, (noise x std)^2) to the copies' state
    parameters (drawn from `generator`) to break their symmetry. The AdamW moments in `opt` and the
    parameters in `best_state` are split alike (`best_state` without noise: the same model, the same
    perplexity). Returns (model, optimizer over its parameters, best_state). O(Z h)."""
    M, k, axes = model.M, model.k, model.state_axes()
    device, dtype = model.word_cluster.device, model.state_emb.dtype
    new = VLHMM(model.V, model.word_cluster, M, 2 * k, model.h, model.state_embedding).to(device, dtype)
    split_all = functools.partial(split_state_dict, model)
    new.load_state_dict(split_all(model.state_dict()))
    if noise:
        with torch.no_grad():
            for name in axes:
                p = getattr(new, name)
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device) * (noise * float(p.std())))
    new_opt = None
    if opt is not None:
        state = opt.state_dict()
        index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        for name, axis in axes.items():
            moments = state["state"].get(index[name], {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    moments[key] = split_states(moments[key], M, k, axis)
        new_opt = make_optimizer(new, state["param_groups"][0]["lr"], blocked=True)
        new_opt.load_state_dict(state)
    if best_state is not None:
        best_state = split_all(best_state)
    return new, new_opt, best_state


def make_optimizer(model: nn.Module, lr: float, blocked: bool, weight_decay: float | None = None
                   ) -> torch.optim.Optimizer:
    """AdamW as the papers train: blocked_hmm (Chiu & Rush) betas (0.9, 0.999), no weight decay; rank_hmm
    (Yang et al.) betas (0.99, 0.999), weight decay 0.01. `weight_decay` (--weight-decay) replaces the
    family's decoupled weight decay on every parameter."""
    betas = (0.9, 0.999) if blocked else (0.99, 0.999)
    if weight_decay is None:
        weight_decay = 0.0 if blocked else 0.01
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def update_average(average: dict[str, Tensor], model: nn.Module, decay: float, step: int) -> None:
    """One step of the parameters' exponential moving average (--weight-average D): average <- d average +
    (1 - d) params with d = min(D, (1 + step) / (10 + step)), so the first steps are not held at the
    initialisation. `average` maps parameter names to tensors of their shapes. O(parameters)."""
    d = min(decay, (1 + step) / (10 + step))
    pairs = list(model.named_parameters())
    torch._foreach_lerp_([average[n] for n, _ in pairs], [p.detach() for _, p in pairs], 1.0 - d)


@contextlib.contextmanager
def parameters_swapped(model: nn.Module, average: dict[str, Tensor] | None):
    """Within the block the model's parameters hold `average` (nothing happens for None); the trained
    parameters come back on exit, bit for bit."""
    if average is None:
        yield
        return
    params = dict(model.named_parameters())
    kept = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(average[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(kept[n])


class RankNeural(nn.Module):
    """Rank-space HMM parameters (Yang et al. App. B). `matrices()` -> start (m,), state_in U^T (m, r),
    state_out V (r, m), emit W^T (V, r), all probabilities. O(m r h + V r h)."""

    def __init__(self, V: int, m: int, r: int, h: int, dropout: float):
        super().__init__()
        self.V, self.m, self.r = V, m, r
        init = nn.init.xavier_normal_
        self.state_u = nn.Parameter(init(torch.empty(m, h)))  # w_u: state side of U
        self.state_v = nn.Parameter(init(torch.empty(m, h)))  # w_v: state side of V
        self.rank_emb = nn.Parameter(init(torch.empty(r, h)))  # u_H, shared by U and V
        self.start_emb = nn.Parameter(torch.randn(1, h) * 0.1)  # w_s
        self.state_p = nn.Parameter(init(torch.empty(m, h)))  # u_P
        self.word_emb = nn.Parameter(torch.randn(V, h) * 0.1)  # u_W
        self.h1, self.h2 = YangRes(h), YangRes(h)
        self.drop = nn.Dropout(dropout)

    def matrices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        start = torch.softmax(self.state_p @ self.h1(self.drop(self.start_emb))[0], 0)
        su, sv = self.drop(self.state_u), self.drop(self.state_v)
        state_in = torch.softmax(gemm.linear(su, self.rank_emb), dim=1)  # (m, r): p(q | z)
        state_out = torch.softmax(gemm.linear(self.rank_emb, sv), dim=1)  # (r, m): p(z | q)
        emit = torch.softmax(gemm.linear(self.h2(self.rank_emb), self.word_emb), dim=1).T  # (V, r): p(x | q)
        return start, state_in, state_out, emit

    def export_tensors(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Cached `rank_hmm` tensors: float64 on the parameters' device (V U^T is O(m r^2)), float32 on `device`
        (the CPU for the artifact, the parameters' device for an evaluation during training)."""
        with torch.no_grad():
            start, si, so, emit = (t.double() for t in self.matrices())
            start = start / start.sum()
            si = si / si.sum(1, keepdim=True)
            so = so / so.sum(1, keepdim=True)
            emit = emit / emit.sum(0, keepdim=True)
            out = {"start": start, "state_in": si, "state_out": so, "emit": emit, "rank_start": start @ si,
                   "rank_trans": so @ si}
            return {k: v.float().to(device) for k, v in out.items()}


# -- losses -------------------------------------------------------------------------------------------
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


def blocked_loss(model: VLHMM, batch: Batch, active: Tensor, carry: Carried | None = None,
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


def rank_loss(model: RankNeural, batch: Batch) -> Tensor:
    """Negative log-likelihood summed over the batch (rank-space forward, O(B T r^2))."""
    start, si, so, emit = model.matrices()
    B = batch.ids.shape[0]
    log_cond, _ = chain.forward_autograd((start @ si).expand(B, -1), emit[batch.ids], gemm.matmul(so, si),
                                         batch.lengths)
    return -log_cond.sum()


# -- data for BPTT ------------------------------------------------------------------------------------
def bptt_batches(seqs: list[list[int]], streams: int, chunk: int, device, start: int = 0) -> list[Batch]:
    """The concatenated corpus, read from token `start` on (wrapping around), split into `streams` running
    streams and cut into chunks of `chunk` tokens: consecutive batches continue each stream (carry the posterior
    between them)."""
    flat = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long)
    flat = flat.roll(-start)
    n = len(flat) // streams
    if n == 0:
        from latentlm.models.errors import InputError

        raise InputError(f"--batch {streams}: {streams} BPTT streams need at least {streams} training tokens, the "
                         f"training data has {len(flat)}", param="batch")
    flat = flat[: n * streams].view(streams, n)
    out = []
    for i in range(0, n, chunk):
        ids = flat[:, i : i + chunk]
        out.append(Batch(ids.to(device), torch.full((streams,), ids.shape[1], dtype=torch.long, device=device)))
    return out


# -- training loop ------------------------------------------------------------------------------------
def build(ns: argparse.Namespace, vocab: Vocabulary, train_seqs: list[list[int]]) -> tuple[nn.Module, dict]:
    """The model for `ns.family`; Brown clustering (blocked_hmm) runs here. Returns (module, extras)."""
    V = len(vocab)
    if ns.family == "blocked_hmm":
        from latentlm.training.brown import brown_clusters

        states = ns.states >> len(common.split_plan(ns))  # the model grows to ns.states by splitting (--split-at)
        if ns.clusters == 1:  # no emission constraint: every state may emit every word
            model = VLHMM(V, torch.zeros(V, dtype=torch.long), 1, states, ns.hidden, ns.state_embedding)
            return model, {}
        res = brown_clusters(train_seqs, V, ns.clusters, progress=ns.progress)
        wc = torch.from_numpy(res.word_cluster)
        M = int(wc.max()) + 1
        if M != ns.clusters:
            from latentlm.models.errors import InputError

            raise InputError(f"--clusters {ns.clusters}: the training data has only {M} distinct words",
                             param="clusters")
        model = VLHMM(V, wc, M, states // M, ns.hidden, ns.state_embedding)
        return model, {"clusters.txt": res.to_text(vocab.tokens).encode()}
    return RankNeural(V, ns.states, ns.rank, ns.hidden, ns.dropout or 0.0), {}


def exported_tensors(model: nn.Module, ns: argparse.Namespace, train_seqs: list[list[int]], eos: int | None,
                     device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The tensors the artifact stores (on `device`): the family's cached matrices, with a BPTT-trained VL-HMM's
    sentence start replaced by the state distribution after `<eos>` (`fix_start_for_streams`), unless it was
    trained with --reset-eos (then every sentence started from the start distribution, as the artifact's do)."""
    tensors = model.export_tensors(device)
    if ns.family == "blocked_hmm" and ns.bptt and not ns.reset_eos:
        tensors = fix_start_for_streams(model, tensors, train_seqs, eos)
    return tensors


def family_scorer(model: nn.Module, family: str, tensors: dict[str, Tensor] | None = None):
    """Score function over the exported tensors through the family's own inference (what the service runs),
    on the device that holds the model's parameters."""
    t = model.export_tensors() if tensors is None else tensors
    device = next(model.parameters()).device
    if family == "blocked_hmm":
        impl = BlockedHMM.from_tensors(t, {"num_clusters": model.M}, device=device)
    else:
        impl = RankHMM.from_tensors(t, {}, device=device)
    return lambda b: impl.score(b)[0], t


def fix_start_for_streams(model: VLHMM, tensors: dict[str, Tensor], seqs: list[list[int]], eos: int | None
                          ) -> dict[str, Tensor]:
    """After BPTT training the sentence start is p(z | previous token <eos>): average the filtered
    posterior at <eos> over (up to 2,000) training sentences and push it through the transitions."""
    if eos is None:
        return tensors
    device = tensors["trans"].device
    impl = BlockedHMM.from_tensors(tensors, {"num_clusters": model.M}, device=device)
    sample = [s for s in seqs[:2000] if s and s[-1] == eos]
    if not sample:
        return tensors
    acc = torch.zeros(impl.num_states, dtype=torch.float64, device=device)
    for b in common.bucket_batches(sample, 256, device=device):
        last = impl.filtered_last(b).double()  # (B, k) in <eos>'s cluster
        ids = impl.state_ids(b)[torch.arange(len(b.lengths)), b.lengths - 1]
        acc.index_add_(0, ids.reshape(-1), last.reshape(-1))
    weights, trans = acc / acc.sum(), tensors["trans"]
    start = sum(weights[i:i + EXPORT_ROWS] @ trans[i:i + EXPORT_ROWS].double()  # a float64 copy of trans is 8 GiB
                for i in range(0, len(weights), EXPORT_ROWS))                       # at 2^15: by row blocks
    return {**tensors, "start": (start / start.sum()).float()}


def train(ns: argparse.Namespace) -> Path:
    """`latentlm train --family blocked_hmm|rank_hmm`. Returns the artifact directory. The GEMM library the run
    picks (`--gemm`, `gemm_for_run`) is the process's only while it trains."""
    with gemm.using(gemm.backend()):  # whatever `_train` sets is undone on return or error
        return _train(ns)


def gemm_for_run(ns: argparse.Namespace, model: nn.Module, device: torch.device, saved: str | None
                 ) -> tuple[str, dict[str, float]]:
    """The GEMM library of a run's step (`kernels.gemm`): `--gemm` itself, else the checkpoint's choice `saved`
    when resuming (the two libraries round differently, so a resumed run must keep its own), else the faster
    on this model's largest products (blocked_hmm: transition logits, the largest cluster's emission logits, a
    state MLP layer; rank_hmm: U, the emission logits, V U^T). CUDA runs use torch's ops: ("torch", {}).
    Returns (name, GFLOP/s measured)."""
    if device.type != "cpu":
        return "torch", {}
    if ns.gemm == "auto" and saved:
        return (saved if saved in gemm.BACKENDS else "torch"), {}
    if isinstance(model, VLHMM):  # the products of a step: the states state dropout keeps (`blocked_loss`)
        kept = model.k - round(model.k * ns.state_dropout)
        Z, h = model.M * kept, model.h
        return gemm.choose([(Z, h, Z), (max(model.cluster_sizes), h, kept), (Z, h, h)], ns.gemm)
    m, r, h = model.m, model.r, model.rank_emb.shape[1]
    return gemm.choose([(m, h, r), (r, h, model.V), (r, m, r)], ns.gemm)


def _train(ns: argparse.Namespace) -> Path:
    common.check_resume(ns)
    t0 = time.perf_counter()
    gen = common.seed_all(ns.seed)
    device = common.resolve_device(ns.device)
    vocab, train_seqs, valid_seqs = load_training_split(ns)
    model, extra_files = build(ns, vocab, train_seqs)
    model.to(device)
    blocked = ns.family == "blocked_hmm"
    splits = common.split_plan(ns)
    history, pos = common.History(), Position()
    ckdir = common.checkpoint_dir(ns.store, ns.name)
    tensors, state = common.load_checkpoint(ckdir) if ns.resume else ({}, {})
    while blocked and ns.resume and model.M * model.k < _checkpoint_states(model, tensors):
        model = split_model(model)[0]  # splits done before the checkpoint (its parameters follow)
    opt = make_optimizer(model, ns.lr, blocked, ns.weight_decay)
    gemm_name, gemm_rates = gemm_for_run(ns, model, device, state.get("gemm"))
    gemm.set_backend(gemm_name)
    if ns.progress and gemm_rates:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in gemm_rates.items())
        print(f"GEMM: {gemm_name} (GFLOP/s on this model's shapes: {rates})", file=sys.stderr)
    decay = 1.0 / (ns.lr_decay or (4.0 if blocked else 2.0))
    carry, average = None, None
    if ns.resume:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        if not ns.export_only:  # exporting needs only the parameters (a checkpoint may carry no optimizer state)
            common.restore_optimizer(opt, tensors, state["optimizer"])
            common.restore_rng(gen, tensors)
        history = common.History.from_json(state["history"])
        pos = Position.from_json(state, history)
        carry = _carry_from_checkpoint(tensors, device)
        if ns.weight_average:
            average = {n[4:]: v.to(device) for n, v in tensors.items() if n.startswith("avg.")} or None
        t0 -= state.get("seconds", 0.0)
        if state.get("early_stopped") or ns.export_only or (ns.max_steps and pos.step >= ns.max_steps):
            pos.epoch = ns.epochs  # nothing left to do: export the best parameters again
    vbatches = common.bucket_batches(valid_seqs, 256, device=device)
    k = model.k if blocked else 0
    keep = k - round(k * ns.state_dropout) if blocked else 0
    N = common.num_tokens(train_seqs)
    bar = common.Progress(N * max(ns.epochs - pos.epoch, 0), _label(ns, model, splits), ns.progress)
    stop = False
    if ns.weight_average and average is None:  # (a checkpoint written without the average starts it here)
        average = {n: p.detach().clone() for n, p in model.named_parameters()}

    def current_state() -> dict[str, Tensor]:  # what would be exported now: the averaged parameters if any
        return {n: (average[n] if average and n in average else v).detach().clone()
                for n, v in model.state_dict().items()}

    best_state = current_state()
    if history.rows:
        best_state = {k2[5:]: v for k2, v in common.load_checkpoint(ckdir)[0].items() if k2.startswith("best.")} \
            or best_state

    def evaluate() -> float:  # the validation perplexity of exactly what would be exported now
        model.eval()
        with parameters_swapped(model, average):
            score, _ = family_scorer(model, ns.family,
                                     exported_tensors(model, ns, train_seqs, vocab.eos_id, device))
            ppl = common.evaluate(score, vbatches)
        model.train()
        return ppl

    # wall time spent in checks (evaluations) and checkpoint writes, cumulative, in each history row: a row's
    # `seconds` minus it is the time of the steps alone (the save after a row's check counts in the next row)
    check_seconds = history.rows[-1].get("check_seconds", 0.0) if history.rows else 0.0
    if not history.rows:
        tick = time.perf_counter()
        ppl = evaluate()
        check_seconds = time.perf_counter() - tick
        history.add(step=0, epoch=0, tokens=0, seconds=time.perf_counter() - t0, valid_ppl=ppl,
                    lr=opt.param_groups[0]["lr"], check_seconds=check_seconds)
    with common.graceful_interrupt() as interrupt:  # Ctrl-C: stop after this step and export the best
        for epoch in range(pos.epoch, ns.epochs):
            # the batch order is a function of (seed, epoch) alone, so a resumed epoch regenerates it
            egen = torch.Generator().manual_seed(ns.seed * 100003 + epoch)
            if blocked and ns.bptt:
                start = int(torch.randint(N, (1,), generator=egen)) if ns.bptt_rotate else 0
                batches = bptt_batches(train_seqs, ns.batch, ns.bptt, device, start)
            else:
                batches = common.bucket_batches(train_seqs, ns.batch, egen, device)
            eval_at = {round(len(batches) * (i + 1) / ns.evals_per_epoch) for i in range(ns.evals_per_epoch)}
            ntoks = [int(n) for n in torch.stack([b.lengths.sum() for b in batches]).tolist()]  # one sync an epoch
            first = pos.batch if epoch == pos.epoch else 0
            if first == 0:
                carry = None
                used = budget_used(ns, pos.step, epoch, time.perf_counter() - t0)
                if blocked and splits.due(_splits_done(ns, model, splits), epoch, used):
                    # grow: every state splits in two (same distribution, noise breaks ties)
                    if average is not None:
                        average = split_state_dict(model, average)
                    model, opt, best_state = split_model(model, opt, best_state, gen, noise=0.01)
                    keep = model.k - round(model.k * ns.state_dropout)
                    bar.relabel(_label(ns, model, splits))
            model.train()
            for bi in range(first, len(batches)):
                b = batches[bi]
                if blocked:
                    active = sample_state_dropout(model.M, model.k, keep, gen).to(device)
                    nll, carry = blocked_loss(model, b, active, carry, want_last=bool(ns.bptt),
                                              eos=vocab.eos_id if ns.reset_eos else None)
                else:
                    nll = rank_loss(model, b)  # dropout draws from torch's global generator (checkpointed)
                ntok = ntoks[bi]
                loss = nll / ntok
                if ns.lr_anneal:
                    used = budget_used(ns, pos.step, epoch + bi / len(batches), time.perf_counter() - t0)
                    set_lr(opt, anneal_factor(used, ns.lr_anneal))
                grad_norm = backward_clipped(model, opt, loss)
                # the step's one host sync: the loss and the gradient norm read together, before the update
                read = torch.stack([loss.detach().float(), grad_norm.float().to(loss.device)])
                loss_value, norm_value = read.tolist()
                if not math.isfinite(loss_value):
                    raise TrainingDiverged(
                        f"--lr: training diverged at step {pos.step + 1} (loss {loss_value}); nothing was "
                        f"written. Try a lower --lr than {opt.param_groups[0]['lr']:g}, or more states per cluster",
                        param="lr")
                if not math.isfinite(norm_value):
                    raise TrainingDiverged(
                        f"--lr: the gradient became non-finite at step {pos.step + 1}; nothing was written. Try a "
                        f"lower --lr than {opt.param_groups[0]['lr']:g}", param="lr")
                opt.step()
                if average is not None:
                    update_average(average, model, ns.weight_average, pos.step)
                pos.step += 1
                pos.tokens += ntok
                bar.update(ntok, loss_value)
                last_batch = bi == len(batches) - 1
                at_limit = bool(ns.max_steps and pos.step >= ns.max_steps)
                final = last_batch and epoch == ns.epochs - 1
                out_of_time = bool(ns.time_limit and time.perf_counter() - t0 >= ns.time_limit * 60)
                at_limit = at_limit or out_of_time or interrupt.requested
                if ns.eval_every:
                    evaluating = pos.step % ns.eval_every == 0
                else:
                    evaluating = (bi + 1) in eval_at if ns.evals_per_epoch else last_batch
                evaluating = evaluating or final or at_limit
                if evaluating:
                    tick = time.perf_counter()
                    ppl = evaluate()
                    check_seconds += time.perf_counter() - tick
                    bar.update(0, valid_ppl=ppl)
                    if history.add(step=pos.step, epoch=epoch + (bi + 1) / len(batches), tokens=pos.tokens,
                                   seconds=time.perf_counter() - t0, train_ppl=math.exp(loss_value),
                                   valid_ppl=ppl, lr=opt.param_groups[0]["lr"], check_seconds=check_seconds):
                        best_state = current_state()
                    elif ns.patience and history.bad_evals >= ns.patience:
                        stop = True
                    elif not ns.lr_patience or history.bad_evals % ns.lr_patience == 0:
                        # plateau: decay at every evaluation without improvement, or (--lr-patience N) after
                        # every N in a row (Chiu & Rush: x 1/4 after 8 checks)
                        for g in opt.param_groups:
                            g["base_lr"] = g.get("base_lr", g["lr"]) * decay
                            g["lr"] *= decay
                if evaluating or stop or at_limit or (ns.checkpoint_every and pos.step % ns.checkpoint_every == 0):
                    pos.epoch, pos.batch = (epoch + 1, 0) if last_batch else (epoch, bi + 1)
                    tick = time.perf_counter()
                    _save(ckdir, model, opt, best_state, gen, history, pos, time.perf_counter() - t0, stop,
                          carry if ns.bptt and not last_batch else None, ns, average)
                    check_seconds += time.perf_counter() - tick
                if stop or at_limit:
                    stop = True
                    break
            if stop:
                break
    bar.close()
    if blocked and _splits_done(ns, model, splits) < len(splits):  # a share of the budget never reached
        print(f"--split-at: the budget ended before {len(splits) - _splits_done(ns, model, splits)} of the splits; "
              f"the model has {model.M * model.k} states, not {ns.states}", file=sys.stderr)
    model.load_state_dict(best_state)
    model.eval()
    tensors = exported_tensors(model, ns, train_seqs, vocab.eos_id)
    config = ({"num_states": model.M * model.k, "num_clusters": model.M, "states_per_cluster": model.k,
               "hidden": ns.hidden, "state_dropout": ns.state_dropout} if blocked else
              {"num_states": ns.states, "rank": ns.rank, "hidden": ns.hidden, "dropout": ns.dropout})
    prov = common.provenance(ns, history, time.perf_counter() - t0,
                             {"method": "VL-HMM (Chiu & Rush 2020)" if blocked else "rank-space HMM (Yang et al. 2022)",
                              "steps": pos.step, "gemm": gemm_name,
                              "gemm_gflops": {k: round(v, 1) for k, v in gemm_rates.items()}})
    title = f"{ns.family} {ns.states} states" + (f", M={model.M}" if blocked else f", r={ns.rank}")
    extra_files = {**extra_files, "curve.png": common.curve_png(history, title)}
    return save_artifact(ns.store, ns.name, ns.family, tensors, vocab, config=config, provenance=prov,
                         extra_files=extra_files)


MAX_GRAD_NORM = 5.0  # gradient clipping of the neural families (Chiu & Rush's and Yang et al.'s code alike)


def backward_clipped(model: nn.Module, opt: torch.optim.Optimizer, loss: Tensor) -> Tensor:
    """A training step's gradients: zeroed, back-propagated from `loss`, zero-filled where a parameter was not
    used (`fill_missing_grads`) and clipped to MAX_GRAD_NORM. Returns the total norm before clipping (a 0-dim
    tensor on the gradients' device: reading it waits on the device). `opt.step()` is the caller's."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    fill_missing_grads(model)
    return common.clip_grad_norm(model.parameters(), MAX_GRAD_NORM)


def fill_missing_grads(model: nn.Module) -> None:
    """Give every parameter the step did not use a zero gradient, as if it had been used: AdamW then moves it
    by its moments exactly as when the unused part was built and back-propagated zeros (a parameter with no
    gradient it would skip), so leaving out a part no row reads changes nothing in the trajectory."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def budget_used(ns: argparse.Namespace, step: int, epochs_done: float, seconds: float) -> float:
    """The fraction of the training budget spent: the largest of epochs, steps and wall time against their
    limits (a limit of 0 is no limit). Wall time makes it depend on the machine, as --time-limit does."""
    fractions = [epochs_done / ns.epochs if ns.epochs else 0.0]
    if ns.max_steps:
        fractions.append(step / ns.max_steps)
    if ns.time_limit:
        fractions.append(seconds / (ns.time_limit * 60))
    return min(max(fractions), 1.0)


def anneal_factor(used: float, fraction: float) -> float:
    """LR multiplier of the budget-aware schedule (--lr-anneal F): 1 until 1 - F of the budget is spent, then
    a linear fall to 0 at its end ("warmup-stable-decay" without the warm-up)."""
    return min(1.0, (1.0 - used) / fraction) if fraction > 0 else 1.0


def set_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's LR to its plateau-decayed base LR (`base_lr`, kept in the checkpointed groups) x factor."""
    for g in opt.param_groups:
        g["lr"] = g.setdefault("base_lr", g["lr"]) * factor


def _splits_done(ns: argparse.Namespace, model: VLHMM, splits: common.Splits) -> int:
    """How many of `splits` the model has made: ns.states = its states x 2^(splits still to come)."""
    return len(splits) - (ns.states // (model.M * model.k)).bit_length() + 1


def _label(ns: argparse.Namespace, model: nn.Module, splits: common.Splits) -> str:
    """The progress bar's label: family and current state count, and the splits still to come."""
    if not isinstance(model, VLHMM):
        return f"{ns.family} Z={ns.states}"
    return f"{ns.family} Z={model.M * model.k}" + splits.describe(_splits_done(ns, model, splits))


def _checkpoint_states(model: VLHMM, tensors: dict[str, Tensor]) -> int:
    """The number of states of the VL-HMM parameters in checkpoint `tensors`."""
    return int(tensors["model.state_emb"].shape[model.state_axes()["state_emb"]])


@dataclass
class Position:
    """Where training stands: `batch` batches of epoch `epoch` done, `step` optimiser steps and `tokens`
    training tokens in all (what a checkpoint needs to continue at the next batch)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    tokens: int = 0

    @classmethod
    def from_json(cls, state: dict, history: common.History) -> Position:
        tokens = state.get("tokens", history.rows[-1].get("tokens", 0) if history.rows else 0)
        return cls(int(state["epoch"]), int(state.get("batch", 0)), int(state["step"]), int(tokens))


def _carry_from_checkpoint(tensors: dict[str, Tensor], device: torch.device | str) -> Carried | None:
    """The BPTT carry a checkpoint holds: `carry` (B, k) with its `carry_cluster` (B,), or from a checkpoint
    written before the carry was kept by cluster, `carry` (B, M, k) over every cluster (mass in one of them)."""
    state = tensors.get("carry")
    if state is None:
        return None
    if "carry_cluster" in tensors:
        return Carried(state.to(device), tensors["carry_cluster"].long().to(device))
    cluster = state.sum(2).argmax(1)
    return Carried(state[torch.arange(state.shape[0]), cluster].to(device), cluster.to(device))


def _save(ckdir: Path, model: nn.Module, opt, best_state: dict, gen: torch.Generator, history,
          pos: Position, seconds: float, early_stopped: bool, carry: Carried | None = None,
          ns: argparse.Namespace | None = None, average: dict[str, Tensor] | None = None) -> None:
    """Checkpoint everything a resume needs to continue bit-for-bit: parameters, best parameters, AdamW
    state, both generators (state dropout; torch's global one, used by nn.Dropout), the position in the
    epoch, the BPTT carry, the parameters' moving average (--weight-average), the GEMM library in use (and,
    given the run's settings `ns`, its shape settings)."""
    ot, ometa = common.optimizer_tensors(opt)
    tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()},
               **{f"best.{k}": v for k, v in best_state.items()}, **ot, **common.rng_tensors(gen)}
    if carry is not None:
        tensors["carry"], tensors["carry_cluster"] = carry.state, carry.cluster
    if average is not None:
        tensors.update({f"avg.{n}": v for n, v in average.items()})
    common.save_checkpoint(ckdir, tensors, {"epoch": pos.epoch, "batch": pos.batch, "step": pos.step,
                                            "tokens": pos.tokens, "history": history.to_json(),
                                            "optimizer": ometa, "seconds": seconds,
                                            "early_stopped": early_stopped, "gemm": gemm.backend()}, ns)
