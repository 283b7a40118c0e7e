"""The neural HMMs' parameterisations: `VLHMM` (Chiu & Rush 2020, blocked_hmm) and `RankNeural` (Yang et al. 2022,
rank_hmm), their residual MLPs (`ResBlock`, `YangRes`) and state dropout's draw. Each builds its family's
distributional parameters (`matrices`, `slot_matrices`) and the cached tensors the artifact stores
(`export_tensors`).

Each network also answers what the training loop (`loop`) asks of it, so the loop names no family: `NETWORKS`
maps a recipe to its network; `build` makes one from the run's settings; `step_nll` is a step's loss; `family`,
`method`, `adamw`, `lr_decay` and `carries_state` declare the artifact family, the paper, the optimiser's
settings, the plateau decay and whether running text (--bptt) carries a state; `artifact_config`, `title`,
`kept_states` and `gemm_shapes` describe an instance. A new neural family adds its network here (and its recipe
on its model family) and touches nothing in the loop."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import Carried
from latentlm.models.errors import InputError
from latentlm.models.kernels import gemm
from latentlm.training import common
from latentlm.training.neural import losses
from latentlm.training.neural.emission import cluster_log_softmax

if TYPE_CHECKING:
    from latentlm.models.vocab import Vocabulary
    from latentlm.training.options import TrainSettings


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
    """VL-HMM parameters (`blocked_hmm`); `matrices(active)` gives log start (Z',), log trans (Z', Z') and log emission
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

    family: ClassVar[str] = "blocked_hmm"
    method: ClassVar[str] = "VL-HMM (Chiu & Rush 2020)"
    adamw: ClassVar[dict[str, Any]] = {"betas": (0.9, 0.999), "weight_decay": 0.0}  # Chiu & Rush
    lr_decay: ClassVar[float] = 4.0  # LR / 4 at a plateau (Chiu & Rush)
    carries_state: ClassVar[bool] = True  # --bptt: the filtered posterior carried between chunks

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

    @classmethod
    def build(cls, ns: TrainSettings, vocab: Vocabulary, train_seqs: list[list[int]]) -> tuple[VLHMM, dict]:
        """The network of a run (Brown clustering of the training words runs here): `ns.states` halved once per
        split of --split-at (the model grows to ns.states). Returns (network, files the artifact adds)."""
        from latentlm.training.brown import brown_clusters

        V = len(vocab)
        states = ns.states >> len(common.split_plan(ns))
        if ns.clusters == 1:  # no emission constraint: every state may emit every word
            return cls(V, torch.zeros(V, dtype=torch.long), 1, states, ns.hidden, ns.state_embedding), {}
        res = brown_clusters(train_seqs, V, ns.clusters, progress=ns.progress)
        wc = torch.from_numpy(res.word_cluster)
        M = int(wc.max()) + 1
        if M != ns.clusters:
            raise InputError(f"--clusters {ns.clusters}: the training data has only {M} distinct words",
                             param="clusters")
        model = cls(V, wc, M, states // M, ns.hidden, ns.state_embedding)
        return model, {"clusters.txt": res.to_text(vocab.tokens).encode()}

    @property
    def num_states(self) -> int:
        return self.M * self.k

    def kept_states(self, state_dropout: float) -> int:
        """States per cluster that state dropout keeps in a step."""
        return self.k - round(self.k * state_dropout)

    def step_nll(self, batch: Batch, *, generator: torch.Generator, keep: int, carry: Carried | None,
                 bptt: bool, eos: int | None) -> tuple[Tensor, Carried | None]:
        """A step's loss: the batch's negative log-likelihood under a fresh state-dropout mask (`keep` states per
        cluster, drawn from `generator`), from each stream's `carry` (--bptt); returns (nll, the next carry)."""
        active = sample_state_dropout(self.M, self.k, keep, generator).to(self.word_cluster.device)
        return losses.blocked_loss(self, batch, active, carry, want_last=bptt, eos=eos)

    def artifact_config(self, ns: TrainSettings) -> dict[str, Any]:
        return {"num_states": self.num_states, "num_clusters": self.M, "states_per_cluster": self.k,
                "hidden": ns.hidden, "state_dropout": ns.state_dropout}

    def scoring_config(self) -> dict[str, Any]:
        """What the family's `from_tensors` needs beside the tensors."""
        return {"num_clusters": self.M}

    def title(self, ns: TrainSettings) -> str:
        return f"{ns.family} {ns.states} states, M={self.M}"

    def gemm_shapes(self, state_dropout: float) -> list[tuple[int, int, int]]:
        """A step's largest products (m, k, n), for choosing the GEMM library: the transition logits, the largest
        cluster's emission logits, a state MLP layer, over the states state dropout keeps."""
        kept = self.kept_states(state_dropout)
        Z = self.M * kept
        return [(Z, self.h, Z), (max(self.cluster_sizes), self.h, kept), (Z, self.h, self.h)]

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



class RankNeural(nn.Module):
    """Rank-space HMM parameters (`rank_hmm`; Yang et al. App. B). `matrices()` -> start (m,), state_in U^T (m, r),
    state_out V (r, m), emit W^T (V, r), all probabilities. O(m r h + V r h)."""

    family: ClassVar[str] = "rank_hmm"
    method: ClassVar[str] = "rank-space HMM (Yang et al. 2022)"
    adamw: ClassVar[dict[str, Any]] = {"betas": (0.99, 0.999), "weight_decay": 0.01}  # Yang et al.
    lr_decay: ClassVar[float] = 2.0
    carries_state: ClassVar[bool] = False

    @classmethod
    def build(cls, ns: TrainSettings, vocab: Vocabulary, train_seqs: list[list[int]]) -> tuple[RankNeural, dict]:
        return cls(len(vocab), ns.states, ns.rank, ns.hidden, ns.dropout or 0.0), {}

    @property
    def num_states(self) -> int:
        return self.m

    def kept_states(self, state_dropout: float) -> int:
        return 0  # no state dropout

    def step_nll(self, batch: Batch, *, generator: torch.Generator, keep: int, carry: Carried | None,
                 bptt: bool, eos: int | None) -> tuple[Tensor, None]:
        """A step's loss (dropout draws from torch's global generator, which checkpoints keep)."""
        return losses.rank_loss(self, batch), None

    def artifact_config(self, ns: TrainSettings) -> dict[str, Any]:
        return {"num_states": ns.states, "rank": ns.rank, "hidden": ns.hidden, "dropout": ns.dropout}

    def scoring_config(self) -> dict[str, Any]:
        return {}

    def title(self, ns: TrainSettings) -> str:
        return f"{ns.family} {ns.states} states, r={ns.rank}"

    def gemm_shapes(self, state_dropout: float) -> list[tuple[int, int, int]]:
        """A step's largest products: U, the emission logits, V U^T."""
        m, r, h = self.m, self.r, self.rank_emb.shape[1]
        return [(m, h, r), (r, h, self.V), (r, m, r)]

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




NETWORKS: dict[str, type[VLHMM] | type[RankNeural]] = {net.family: net for net in (VLHMM, RankNeural)}
"""Recipe -> the network its training loop builds."""
