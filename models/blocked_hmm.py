"""`blocked_hmm` — the VL-HMM of Chiu & Rush (2020): emission-sparse HMM over Brown clusters.

The vocabulary is partitioned into M clusters; cluster c owns the k states c*k .. c*k+k-1 (Z = M k) and
only they may emit its words. At position t only the k states of cluster(x_t) can be active, so exact
inference gathers the k x k block trans[cluster(x_{t-1}) states, cluster(x_t) states] per step:
O(T k^2) per sequence, never O(T Z^2).

Artifact tensors: `start` (Z,), `trans` (Z, Z) rows sum to 1 (the cached matrix, states ordered by cluster),
`emit` (V, k): emit[w, i] = p(w | state cluster(w)*k + i) (for each state, its words' column sums to 1),
`word_cluster` (V,) int64 in [0, M). Optional `state_vectors` (Z, d) for embeddings.
Config: `num_states` Z, `num_clusters` M, `states_per_cluster` k.

Its length (over 600 lines) is earned: the family, its exact EM statistics (`expected_counts`) and its view for
constrained inference (`BlockedView`) all read the same cluster layout of `trans` and `emit` (a word's k states,
a block per cluster pair), and keeping them beside the class keeps that layout's one definition in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from latentlm.models import backend as dispatch
from latentlm.models import chain, triton_chain
from latentlm.models.backend import Backend
from latentlm.models.base import Batch, ChainFamily, ChainOperations, tempered_rows
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.chain_view import SLAB_ENTRIES, ChainView, normalised
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.family import Recipe
from latentlm.models.kernels import blocked as blocked_kernels
from latentlm.models.sampling import CategoricalTable, tables_at


class BlockedHMM(ChainFamily):
    family = "blocked_hmm"
    operations = ChainOperations(ChainFamily.operations | {"constraint"})  # type: ignore[assignment]
    onnx_layout = "blocked"
    has_fused_score = True  # on CUDA `score` runs `triton_chain.blocked_forward_cuda` (see `models.backend.score`)
    recipes = (Recipe("blocked_hmm", {"states": 1024, "clusters": 128, "hidden": 256, "epochs": 10, "batch": 64,
                                      "lr": 1e-2, "checkpoint_every": 200},
                      positive=("states", "epochs", "batch", "clusters", "hidden"), check=lambda s: check_recipe(s),
                      shape=("states", "clusters", "hidden", "split_at"),
                      options=frozenset({"bptt", "split_at", "export_only", "weight_decay", "weight_average"}),
                      needs=("scipy", "matplotlib"), trainer="latentlm.training.neural"),)  # scipy: Brown clusters

    def __init__(self, start: Tensor, trans: Tensor, emit: Tensor, word_cluster: Tensor, num_clusters: int,
                 extras: dict[str, Tensor] | None = None):
        self.start, self.trans, self.emit, self.word_cluster = start, trans, emit, word_cluster
        self.M = num_clusters
        self.k = emit.shape[1]
        self.extras = extras or {}
        self.device, self.dtype = trans.device, start.dtype  # trans may be stored in bfloat16 (`set_storage_dtype`)
        self.trans_blocks = trans.view(self.M, self.k, self.M, self.k)  # [c_prev, i, c_next, j]

    def set_storage_dtype(self, value: torch.dtype | str | None) -> None:
        """`ChainFamily.set_storage_dtype`. On CPU with more than one cluster, bfloat16 storage replaces `trans`
        by its bfloat16 rounding (half the memory: 2 GiB instead of 4 at 2^15 states; the float32 matrix is
        dropped, so a model cannot go back to float32 without a reload). Every path then serves that rounded
        matrix: the compiled sweeps (score, posterior, Viterbi, `filtered_last`) widen each entry to float32 as
        they read it (half the bytes of memory traffic per step, which bounds a large model's scoring; alpha,
        the emissions and the sums stay float32/float64: error bound `backend.BF16_TOKEN_ABS_BOUND` per token
        against the float32 model), sampling draws from it, and the torch steps widen the blocks they gather.
        `self.dtype` stays the dtype of the computation."""
        super().set_storage_dtype(value)
        bf16 = self._trans_in_bf16(self.storage_dtype, self.device, self.M)
        if bf16 and self.trans.dtype != torch.bfloat16:
            self.trans = self.trans.to(torch.bfloat16)
            self.trans_blocks = self.trans.view(self.M, self.k, self.M, self.k)
            self.__dict__.pop("_log_blocks", None)
            self.__dict__.pop("_sampling_tables_t1", None)
        elif not bf16 and self.trans.dtype != self.dtype:
            raise ValueError("this model's transition matrix is stored in bfloat16 (its float32 matrix was "
                             "dropped): reload it for another storage dtype")

    @staticmethod
    def _trans_in_bf16(storage_dtype: torch.dtype | str | None, device: torch.device, num_clusters: Any) -> bool:
        """Whether bfloat16 storage holds `trans` in bfloat16 only: on CPU, with more than one cluster."""
        tf32 = isinstance(storage_dtype, str) and storage_dtype.lower() == "tfloat32"  # float32 storage
        return (not tf32 and dispatch.storage_dtype(storage_dtype) == torch.bfloat16 and device.type == "cpu"
                and isinstance(num_clusters, int) and num_clusters > 1)

    @classmethod
    def read_dtypes(cls, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype,
                    storage_dtype: torch.dtype | str | None = None) -> dict[str, torch.dtype]:
        """`Family.read_dtypes`: `trans` as bfloat16 when bfloat16 storage keeps it so (`set_storage_dtype`; the
        2^15-state model then loads in 2.1 GiB instead of peaking at 6.2), otherwise in `dtype`."""
        bf16 = cls._trans_in_bf16(storage_dtype, torch.device(device), config.get("num_clusters"))
        return {"trans": torch.bfloat16 if bf16 else dtype}

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        for key in ("num_states", "num_clusters", "states_per_cluster"):
            if not isinstance(config.get(key), int) or config[key] <= 0:
                raise ArtifactError(f"{where}: config needs a positive integer {key!r}", param=key)
        Z, M, k = config["num_states"], config["num_clusters"], config["states_per_cluster"]
        if Z != M * k:
            raise ArtifactError(f"{where}: num_states {Z} != num_clusters {M} x states_per_cluster {k}",
                                param="num_states")
        check_distribution(check_shape(tensors, "start", (Z,), where), "start", 0, where)
        check_distribution(check_shape(tensors, "trans", (Z, Z), where), "trans", 1, where)
        emit = check_shape(tensors, "emit", (vocab_size, k), where)
        wc = check_shape(tensors, "word_cluster", (vocab_size,), where)
        if wc.dtype != torch.int64:
            raise ArtifactError(f"{where}: tensor 'word_cluster' must be int64, got {wc.dtype}", param="word_cluster")
        if bool(((wc < 0) | (wc >= M)).any()):
            raise ArtifactError(f"{where}: tensor 'word_cluster' has ids outside [0, {M})", param="word_cluster")
        if "state_vectors" in tensors:
            sv = tensors["state_vectors"]
            check_shape(tensors, "state_vectors", (Z, sv.shape[1] if sv.ndim == 2 else 0), where)
        per_state = torch.zeros(M, k, dtype=torch.float64, device=emit.device).index_add_(0, wc, emit.double())
        if bool((emit < 0).any()) or not bool(torch.isfinite(emit).all()):
            raise ArtifactError(f"{where}: tensor 'emit' has negative or non-finite entries", param="emit")
        bad = (per_state - 1).abs() > 1e-4
        if bool(bad.any()):
            c, i = bad.nonzero()[0].tolist()
            raise ArtifactError(
                f"{where}: tensor 'emit' is not normalised: state {c * k + i} (cluster {c}) sums to "
                f"{per_state[c, i].item():.6g} over its cluster's words (tolerance 0.0001)", param="emit")

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> BlockedHMM:
        """`storage_dtype` ("float32" default, "tfloat32", "bfloat16"): `score`'s precision (`set_storage_dtype`)."""
        keep_bf16 = cls._trans_in_bf16(storage_dtype, torch.device(device), config["num_clusters"])
        t = {k: (v.to(device=device, dtype=torch.bfloat16 if k == "trans" and keep_bf16 else dtype)
                 if v.is_floating_point() else v.to(device)) for k, v in tensors.items()}
        extras = {k: v for k, v in t.items() if k not in ("start", "trans", "emit", "word_cluster")}
        model = cls(t["start"], t["trans"], t["emit"], t["word_cluster"], config["num_clusters"], extras)
        model.set_storage_dtype(storage_dtype)
        return model

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    def describe(self) -> dict[str, Any]:
        return {"num_states": self.num_states, "num_clusters": self.M, "states_per_cluster": self.k,
                "backend": self.backends()}

    def score_fused(self, batch: Batch) -> tuple[Tensor, Tensor]:
        return triton_chain.score_blocked(self, batch, storage_dtype=self.storage_dtype, allow_tf32=self.allow_tf32)

    def _clusters(self, batch: Batch) -> Tensor:
        return self.word_cluster[batch.ids]

    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        init, clusters = self._first(batch)
        if self.M == 1:  # no emission constraint: one shared matrix (GEMM steps, compiled engines)
            return init, RowLookup(self.emit, batch.ids), self.trans
        return init, RowLookup(self.emit, batch.ids), self._block_fn(self.trans_blocks, clusters, self.dtype)

    @staticmethod
    def _block_fn(blocks: Tensor, clusters: Tensor, dtype: torch.dtype | None = None):
        def trans_at(t: int) -> Tensor:  # (B, k, k): block (cluster(x_{t-1}), cluster(x_t)), in `dtype` if given
            block = blocks[clusters[:, t - 1], :, clusters[:, t], :]
            return block if dtype is None else block.to(dtype)
        return trans_at

    @cached_property
    def _log_start_emit(self) -> tuple[Tensor, Tensor]:
        """log start (M, k) and log emit (V, k)."""
        return self.start.log().view(self.M, self.k), self.emit.log()

    @cached_property
    def _log_blocks(self) -> Tensor:
        """log trans (M, k, M, k): a second Z x Z matrix, made only for the torch steps (`log_chain`'s step when
        it is called); the compiled Viterbi reads `trans` itself."""
        return self.trans_blocks.to(self.dtype).log()

    def log_chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        log_start, log_emit = self._log_start_emit
        clusters = self._clusters(batch)
        first, emit = log_start[clusters[:, 0]], RowLookup(log_emit, batch.ids)
        if self.M == 1:
            return first, emit, self._log_blocks.view(self.k, self.k)

        def step(t: int) -> Tensor:  # takes the log blocks on first use only
            return self._block_fn(self._log_blocks, clusters, self.dtype)(t)
        return first, emit, step

    @property
    def states_per_token(self) -> int:
        """Only the k states of a token's cluster can emit it."""
        return self.k

    def state_ids(self, batch: Batch) -> Tensor:
        return self._clusters(batch).unsqueeze(-1) * self.k + torch.arange(self.k, device=self.device)

    # -- compiled sweeps on CPU (`kernels.blocked`) ----------------------------------------------------
    def _compiled(self) -> bool:
        """Whether `score`, `posterior`, `viterbi` and `filtered_last` run the compiled blocked sweeps: more than
        one cluster (one cluster is a shared matrix: the chain engine's compiled engines), on CPU,
        float32/float64, numba, no autograd."""
        return (self.M > 1 and blocked_kernels.HAVE_NUMBA and self.device.type == "cpu"
                and self.dtype in (torch.float32, torch.float64) and not self._grad())

    def score(self, batch: Batch, *, backend: Backend | str = Backend.AUTO) -> tuple[Tensor, Tensor]:
        """`ChainFamily.score`. With more than one cluster on CPU, "auto" and "groups" run the compiled sweep
        (`kernels.blocked.score_cpu`: each step reads its k x k block where it lies, rows split over threads; in
        bfloat16 with that storage dtype, `set_storage_dtype`);
        "torch" runs the chain engine's torch steps (a gathered (B, k, k) block per step)."""
        if self.score_backend(backend, batch.ids.shape[1]) in (Backend.AUTO, Backend.GROUPS) and self._compiled():
            log_cond, _ = self._sweep(self.to(batch), want_last=False)
            return log_cond.double().sum(1), log_cond
        return super().score(batch, backend=backend)

    def posterior(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """`ChainFamily.posterior`; with more than one cluster on CPU by the compiled forward-backward sweep
        (`kernels.blocked.posterior_cpu`)."""
        if not self._compiled():
            return super().posterior(batch)
        batch = self.to(batch)
        init, clusters = self._first(batch)
        gamma, _ = blocked_kernels.posterior_cpu(init, self.emit[batch.ids], clusters, batch.lengths, self.trans,
                                                 self._threads(batch))
        return self.state_ids(batch), gamma

    def filtered_last(self, batch: Batch) -> Tensor:
        """`ChainFamily.filtered_last` over the last token's cluster's states (B, k) (the state a BPTT stream
        carries past it; `predictive` builds on it); on CPU by the compiled sweep."""
        if not self._compiled():
            return super().filtered_last(batch)
        return self._sweep(self.to(batch), want_last=True)[1]  # type: ignore[return-value]

    def predictive(self, prefix: list[int]) -> Tensor:
        """`ChainFamily.predictive` from the k rows of `trans` of the last token's cluster (Z,): O(k Z)."""
        batch = Batch.from_lists([prefix], self.device)
        last = self.filtered_last(batch)[0]
        return last @ self.trans[self.state_ids(batch)[0, -1]].to(self.dtype)

    def _first(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """(init (B, k): the start distribution over each sequence's first cluster, clusters (B, T))."""
        clusters = self._clusters(batch)
        return self.start.view(self.M, self.k)[clusters[:, 0]], clusters

    def _sweep(self, batch: Batch, want_last: bool) -> tuple[Tensor, Tensor | None]:
        init, clusters = self._first(batch)
        return blocked_kernels.score_cpu(init, self.emit, batch.ids, clusters, batch.lengths, self.trans,
                                         self._threads(batch), want_last)

    def _threads(self, batch: Batch) -> int:
        return dispatch.blocked_threads(batch.ids.shape[0], int(batch.lengths.sum()), self.k)

    def backends(self) -> dict[str, str]:
        if not self._compiled():
            return super().backends()
        return {"score": Backend.GROUPS.value, "storage_dtype": str(self.trans.dtype).removeprefix("torch.")}

    def _decode_emissions(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """What the compiled Viterbi decodes with, as probabilities: (init (B, k), a table (R, k), the row of it
        for each token (B, T)); here the start distribution and `emit` read by token id. `log_chain` is the
        same chain in logs (for the torch Viterbi): a subclass that changes the emissions it decodes with
        overrides both (as `training.tagging_vlhmm.BlockedTagger` does)."""
        init, _ = self._first(batch)
        return init, self.emit, batch.ids

    def viterbi(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """`ChainFamily.viterbi` with global state ids; with more than one cluster on CPU by the compiled
        sweep (`kernels.blocked.viterbi_cpu`: on the probabilities of `trans` and `emit` where they lie, no log
        of either)."""
        batch = self.to(batch)
        clusters = self._clusters(batch)
        if self._compiled():
            init, table, rows = self._decode_emissions(batch)
            path, logp = blocked_kernels.viterbi_cpu(init, table, rows, clusters, batch.lengths, self.trans,
                                                     self._threads(batch))
        else:
            path, logp = super().viterbi(batch)
        glob = clusters * self.k + path
        return torch.where(path >= 0, glob, path), logp

    # -- sampling -----------------------------------------------------------------------------------
    @cached_property
    def _cluster_words(self) -> Tensor:
        """(M, W) word ids of each cluster, right-padded with -1."""
        order = torch.argsort(self.word_cluster, stable=True)
        counts = torch.bincount(self.word_cluster, minlength=self.M)
        W = int(counts.max())
        offsets = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order), device=self.device) - offsets[self.word_cluster[order]]
        words = torch.full((self.M, W), -1, dtype=torch.long, device=self.device)
        words[self.word_cluster[order], slot] = order
        return words

    def sampling_tables(self, temperature: float):
        return tables_at(self, temperature, self._tables)

    @cached_property
    def _emission_slots(self) -> tuple[Tensor, Tensor]:
        """(per_state (Z, W): p(word | state) over its cluster's W word slots, 0 past the cluster's words;
        slot_token (Z, W) int32: each slot's token id, -1 past them). Built once (O(Z W); at 2^15 states with
        480-word clusters 63 + 63 MiB): the emission tables of every temperature draw from it, so a request at a
        temperature other than 1 does not rebuild it."""
        words = self._cluster_words  # (M, W)
        probs = self.emit[words.clamp_min(0)]  # (M, W, k)
        probs = torch.where((words >= 0).unsqueeze(-1), probs, torch.zeros((), dtype=probs.dtype))
        per_state = probs.permute(0, 2, 1).reshape(self.num_states, -1)  # (Z, W)
        return per_state, words.to(torch.int32).repeat_interleave(self.k, dim=0)

    # hooks of `ChainFamily.sample_predictive`: a token is emitted only by the k states of its cluster
    predictive_sampling = True

    def _token_probs(self, pi: Tensor) -> Tensor:
        """q[:, x] = sum_i pi[:, c(x) k + i] emit[x, i], one (n, k) x (k, words) product per cluster over its
        emission slots (`_emission_slots`): O(n k V)."""
        q = torch.empty(len(pi), len(self.word_cluster), dtype=pi.dtype, device=self.device)
        blocks = pi.view(len(pi), self.M, self.k)
        slots = self._emission_slots[0].view(self.M, self.k, -1)  # (M, k, W)
        words = self._cluster_words
        for c, size in enumerate(torch.bincount(self.word_cluster, minlength=self.M).tolist()):
            q[:, words[c, :size]] = blocks[:, c] @ slots[c, :, :size].to(pi.dtype)
        return q

    def _condition(self, pi: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        c = self.word_cluster[x]
        alpha = pi.view(len(pi), self.M, self.k)[torch.arange(len(x), device=self.device), c] * self.emit[x]
        return alpha, c[:, None] * self.k + torch.arange(self.k, device=self.device)

    def _propagate(self, alpha: Tensor, ids: Tensor) -> Tensor:
        """pi = alpha @ the rows of its cluster, one product per cluster present: O(n k Z)."""
        c = ids[:, 0] // self.k
        pi = torch.empty(len(alpha), self.num_states, dtype=alpha.dtype, device=self.device)
        for cl in torch.unique(c).tolist():
            rows = (c == cl).nonzero().squeeze(1)
            pi[rows] = alpha[rows] @ self.trans[cl * self.k: (cl + 1) * self.k].to(alpha.dtype)
        return pi

    def _trans_into(self, ids: Tensor, z_next: Tensor) -> Tensor:
        return self.trans[ids, z_next[:, None]].to(self.dtype)

    def _tables(self, temperature: float):
        per_state, slot_token = self._emission_slots
        return CategoricalTable(self.trans, temperature), CategoricalTable(per_state, temperature), slot_token

    def onnx_tensors(self) -> dict[str, Tensor]:
        return {"start": self.start, "trans_blocks": self.trans_blocks, "emit": self.emit,
                "word_cluster": self.word_cluster}

    # -- constrained inference: k-sparse emissions over the stored Z x Z matrix --------------------------
    def constraint_view(self) -> BlockedView:
        return BlockedView(self)

    def tempered_copy(self, temperature: float) -> BlockedHMM:
        """start and transition rows tempered; each state's emission distribution over its cluster's words."""
        emit = self.emit.to(torch.float64)
        logs = torch.where(emit > 0, emit.log(), -math.inf) / temperature
        top = torch.full((self.M, self.k), -math.inf, dtype=torch.float64, device=self.device)
        top = top.scatter_reduce(0, self.word_cluster[:, None].expand(-1, self.k), logs, "amax")
        w = (logs - top[self.word_cluster]).exp()
        sums = torch.zeros_like(top).index_add_(0, self.word_cluster, w)
        emit_t = (w / sums[self.word_cluster]).to(self.dtype)
        return BlockedHMM(tempered_rows(self.start[None], temperature, self.dtype)[0],
                          tempered_rows(self.trans, temperature, self.dtype), emit_t, self.word_cluster, self.M)


class BlockedView(ChainView):
    """blocked_hmm: Z = M k states; B(z, v) = emit[v, i] for z = cluster(v) k + i, else 0. The backward multiplies by
    the stored Z x Z matrix where it lies (row slabs widened only when it is stored in bfloat16); emissions touch
    one cluster's k states; the filter after a word is O(k Z) (the family's own `_condition` / `_propagate`)."""

    def __init__(self, model: BlockedHMM):
        self.model = model
        self.S, self.dtype, self.device = model.num_states, model.dtype, model.device
        self.k = model.k

    @property
    def vocab_size(self) -> int:
        return int(self.model.word_cluster.shape[0])

    def start(self) -> Tensor:
        return self.model.start

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
        keep = (cls >= 0).nonzero().squeeze(1)
        flat = (self._states(keep) * C + cls[keep][:, None]).reshape(-1)  # B(z, v) != 0 only on v's cluster
        mass = torch.zeros(self.S * C, dtype=torch.float64, device=self.device)
        mass.index_add_(0, flat, self.model.emit[keep].double().reshape(-1))
        return mass.view(self.S, C).to(self.dtype)

    def token_probs(self, a: Tensor) -> Tensor:
        return self.model._token_probs(a)

    def scores_at(self, a: Tensor, words: Tensor, M: Tensor, cols: Tensor) -> Tensor:
        idx = self._states(words)
        return (a.gather(1, idx) * self.model.emit[words].to(self.dtype) * M[idx, cols[:, None]]).sum(-1)

    def condition(self, a: Tensor, words: Tensor) -> Tensor:
        alpha, ids = self.model._condition(a, words)
        return self.model._propagate(normalised(alpha), ids)

    def trans_rows(self, z: Tensor) -> Tensor:
        return self.model.trans[z].to(self.dtype)


@dataclass(frozen=True)
class BlockCounts:
    """Exact expected sufficient statistics of one batch (what `expected_counts` returns).

    `start` (Z',): first-state counts of the rows that begin from the start distribution; `trans` (Z', Z'):
    transition counts (including the step from a carried state into position 0); `emit` (V, k'): emission
    counts of each word by its cluster's states, a sparse COO tensor (only the batch's words have rows);
    `log_lik` (B,): log p(x_b | carried state); `last` (B, k'):
    filtered p(z | x) at each row's last position, over its last token's cluster."""

    start: Tensor
    trans: Tensor
    emit: Tensor
    log_lik: Tensor
    last: Tensor


@dataclass(frozen=True)
class Carried:
    """The state before each row's position 0, carried over from the previous chunk of a running stream (BPTT):
    the filtered posterior at that chunk's last token, which lies in the token's cluster. `state` (B, k'): a
    distribution over the cluster's k' states (a row of zeros carries nothing: that row starts from the start
    distribution); `cluster` (B,) int64: the cluster. Position 0 is drawn by the one (k', k') transition block
    from `cluster` into the first token's cluster: the carried step costs what any other step costs."""

    state: Tensor
    cluster: Tensor


def expected_counts(log_start: Tensor, log_trans: Tensor, log_emit: Tensor, word_cluster: Tensor, M: int,
                    ids: Tensor, lengths: Tensor, carried: Carried | None = None,
                    dtype: torch.dtype = torch.float64) -> BlockCounts:
    """Forward-backward expected counts of a blocked HMM over M clusters with k' states each (Z' = M k').

    log_start (Z',), log_trans (Z', Z'), log_emit (V, k') in log space (no gradient is taken); ids, lengths:
    the batch; `carried` optional state before position 0 (a BPTT carry, `Carried`): position 0 is then drawn
    by the transitions from it (rows with no mass use `log_start`). The gradient of
    log p(x) with respect to each log-potential is its expected count, so these counts are the exact
    gradient of the log-likelihood without differentiating through the dynamic program. Counts come back in
    `log_trans`'s dtype; `log_lik` and `last` in `dtype`.

    Numerics: the recursion accumulates in `dtype` (float64 by default; M == 1 first tries `log_trans`'s
    dtype), each position's emission row shifted by its maximum; the transition matrix is exponentiated in
    `log_trans`'s dtype, and if anything underflows or overflows (a zero scale, non-finite counts), the
    batch is recomputed in `dtype` throughout. On CPU
    with numba, M > 1 runs the compiled sweep (`kernels.blocked`); M == 1 (no emission constraint) runs
    the shared-matrix GEMM path. O(B T k'^2) for the DP and the counts (the carried step is one more step:
    O(B k'^2)), plus O(Z'^2) to exponentiate and weight the transition matrix."""
    with torch.no_grad():
        counts, _ = _counts_with_fallback(lambda d: log_trans.detach().to(d).exp(), log_trans.dtype, log_start,
                                          log_emit, word_cluster, M, ids, lengths, carried, dtype)
        return counts


def expected_counts_from_logits(log_start: Tensor, trans_logits: Tensor, log_emit: Tensor, word_cluster: Tensor,
                                M: int, ids: Tensor, lengths: Tensor, carried: Carried | None = None,
                                dtype: torch.dtype = torch.float64) -> tuple[BlockCounts, Tensor]:
    """`expected_counts` with the transitions given as row logits (Z', Z'): trans = softmax(trans_logits) by
    rows, one pass from the logits to the probabilities (instead of a log-softmax and then an exponential, two
    passes over the largest matrix a step makes, and a third matrix in memory). Returns (the counts, trans in
    `trans_logits`' dtype): with the counts C, the gradient of log p(x) with respect to the logits is
    C - trans * rowsum(C). Same numerics and fallback as `expected_counts` (the float64 attempt normalises the
    logits in float64)."""
    with torch.no_grad():
        counts, trans = _counts_with_fallback(lambda d: torch.softmax(trans_logits.detach().to(d), -1),
                                              trans_logits.dtype, log_start, log_emit, word_cluster, M, ids, lengths,
                                              carried, dtype)
        return counts, trans.to(trans_logits.dtype)


def logits_gradient_(counts: Tensor, trans: Tensor, scale: Tensor) -> Tensor:
    """In place over the transition counts C (Z', Z') of `expected_counts_from_logits`: scale * (C - trans *
    rowsum(C)), the gradient of scale * log p(x) with respect to the row logits of trans = softmax(logits).
    On CPU with numba one pass over memory (`kernels.blocked.logit_grad_cpu`: each row summed and rewritten
    while it is in cache, rows split over torch's threads from 2^20 entries); elsewhere three tensor ops. O(Z'^2).
    """
    if counts.device.type == "cpu" and blocked_kernels.HAVE_NUMBA and counts.is_contiguous() \
            and trans.is_contiguous() and counts.dtype == trans.dtype:
        threads = torch.get_num_threads() if counts.numel() >= 2**20 else 1
        return blocked_kernels.logit_grad_cpu(counts, trans, float(scale), threads)
    return counts.addcmul_(trans, counts.sum(1, keepdim=True), value=-1.0).mul_(scale)


def _counts_with_fallback(trans_in: Callable[[torch.dtype], Tensor], out_dtype: torch.dtype, log_start: Tensor,
                          log_emit: Tensor, word_cluster: Tensor, M: int, ids: Tensor, lengths: Tensor,
                          carried: Carried | None, dtype: torch.dtype) -> tuple[BlockCounts, Tensor]:
    """The attempts of `expected_counts`: `trans_in(d)` gives the transition probabilities in dtype d. Returns
    the counts (in `out_dtype`; `log_lik`, `last` in `dtype`) and the transition matrix the accepted attempt
    used."""
    # (matrix dtype, DP dtype) tried in turn; with one cluster every row of the shared matrix has an entry
    # >= 1/Z', so the DP runs in the matrix's own dtype first (GEMM steps at full speed)
    attempts = [(out_dtype, out_dtype if M == 1 else dtype), (dtype, dtype)]
    for trans_dtype, dp_dtype in dict.fromkeys(attempts):
        trans = trans_in(trans_dtype)
        res = _expected_counts(log_start, trans, log_emit, word_cluster, M, ids, lengths, carried, dp_dtype)
        # a sum is finite only if every term is (counts are at most the token count: no overflow)
        if bool(torch.isfinite(res.log_lik).all()) and bool(torch.isfinite(res.trans.sum())):
            break
    counts = BlockCounts(res.start.to(out_dtype), res.trans.to(out_dtype), res.emit.to(out_dtype), res.log_lik,
                         res.last)
    return counts, trans


def _expected_counts(log_start: Tensor, trans: Tensor, log_emit: Tensor, word_cluster: Tensor, M: int,
                     ids: Tensor, lengths: Tensor, carried: Carried | None, dtype: torch.dtype) -> BlockCounts:
    """`expected_counts` with the transition matrix `trans` (Z', Z') given as probabilities."""
    B, T = ids.shape
    Zp = trans.shape[0]
    kk = Zp // M
    mask = chain.valid_mask(lengths, T)
    le = log_emit.detach()[ids].to(dtype)  # (B, T, k'): converted after the gather, not the whole (V, k') table
    shift = le.amax(-1).masked_fill(~mask, 0.0)  # (B, T)
    emit = (le - shift.unsqueeze(-1)).exp()
    clusters = word_cluster[ids]
    first = clusters[:, 0]
    init = log_start.detach().to(dtype).exp().view(M, kk)[first]
    has_prior = torch.zeros(B, dtype=torch.bool, device=ids.device)
    prior = None
    if carried is not None:
        prior = carried.state.to(dtype)  # (B, k')
        has_prior = prior.sum(1) > 0
        # the carried step: prior_b @ the block from its cluster into the first token's, in the DP's dtype
        block = trans.view(M, kk, M, kk)[carried.cluster, :, first, :].to(dtype)  # (B, k', k')
        init = torch.where(has_prior[:, None], (prior.unsqueeze(1) @ block).squeeze(1), init)
    compiled = M > 1 and ids.device.type == "cpu" and blocked_kernels.HAVE_NUMBA
    if compiled:
        log_cond, alphas, gamma, right = blocked_kernels.forward_backward_cpu(
            init, emit, clusters, lengths, trans, dispatch.blocked_threads(B, int(lengths.sum()), kk))
    else:
        step: Trans = trans if M == 1 else BlockedHMM._block_fn(trans.view(M, kk, M, kk), clusters)
        step = step.to(dtype) if isinstance(step, Tensor) else (lambda t, f=step: f(t).to(dtype))
        log_cond, alphas = chain.forward(init, emit, step, lengths, keep_alphas=True, chunk_long=False)
        cap = blocked_kernels.BIG if dtype == torch.float64 else torch.finfo(dtype).max * 1e-8
        betas = chain.backward(emit, step, lengths, log_cond).clamp_max(cap)
        gamma = alphas * betas
        gamma = gamma / gamma.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
        gamma = gamma.masked_fill(~mask.unsqueeze(-1), 0.0)
        right = (emit * betas / log_cond.exp().unsqueeze(-1)).clamp_max(cap)
        right = right.masked_fill(~mask.unsqueeze(-1), 0.0)
    log_cond = log_cond.masked_fill(~mask, 0.0)
    # the steps' sources (alpha_{t-1}, and the carried state before position 0) and their clusters
    carried_from = carried.cluster.masked_fill(~has_prior, -1) if carried is not None else None
    if M == 1:
        sums = alphas[:, :-1].reshape(-1, kk).T @ right[:, 1:].reshape(-1, kk)
        if prior is not None:  # rows carrying nothing have a prior of zeros
            sums = sums + prior.T @ right[:, 0]
        trans_counts = (trans * sums).to(trans.dtype)
    elif compiled:  # with the carried step's counts
        trans_counts = blocked_kernels.counts_cpu(alphas, right, clusters, lengths, trans, M, prior, carried_from,
                                                  dispatch.blocked_threads(M * M, int(lengths.sum()), kk))
    elif carried_from is None:
        trans_counts = _block_counts(alphas[:, :-1], right[:, 1:], clusters, mask[:, 1:], trans, M)
    else:  # the carried step as a step 0 from the carried state, in its cluster
        trans_counts = _block_counts(torch.cat([prior.unsqueeze(1), alphas[:, :-1]], 1), right,
                                     torch.cat([carried_from.clamp_min(0).unsqueeze(1), clusters], 1),
                                     torch.cat([has_prior.unsqueeze(1), mask[:, 1:]], 1), trans, M)
    start_counts = torch.zeros(M, kk, dtype=dtype, device=ids.device)
    start_counts.index_add_(0, first, gamma[:, 0] * (~has_prior).unsqueeze(1))  # rows with a prior add zeros
    # in the output dtype: a count is a sum of at most as many posteriors as there are tokens
    words, where = torch.unique(ids[mask], return_inverse=True)  # sorted: the sparse tensor is coalesced
    per_word = torch.zeros(len(words), kk, dtype=log_emit.dtype, device=ids.device)
    per_word.index_add_(0, where, gamma[mask].to(log_emit.dtype))
    emit_counts = torch.sparse_coo_tensor(words[None], per_word, (log_emit.shape[0], kk), is_coalesced=True,
                                          check_invariants=False)
    return BlockCounts(start_counts.reshape(Zp), trans_counts, emit_counts, log_cond.sum(1) + shift.sum(1),
                       chain.filtered_last(alphas, lengths))


def _block_counts(prev: Tensor, right: Tensor, clusters: Tensor, valid: Tensor, trans: Tensor, M: int,
                  chunk_elems: int = 1 << 25) -> Tensor:
    """Expected transition counts (Z', Z') in trans's dtype: for each (cluster, cluster) block the batch steps
    through, (sum over those steps of prev_t (x) right_t) * the block, where prev (B, T-1, k) = alpha_{t-1},
    right (B, T-1, k) = emit_t beta_t / c_t, valid (B, T-1). The steps' outer products are summed into their
    blocks by `index_add_` over chunks of at most `chunk_elems` elements: a fixed number of kernels per batch
    whatever the number of distinct blocks (a loop of one GEMM per block launched thousands of small kernels
    per step on a GPU). O(B T k^2) multiply-adds, O(P k^2) memory for the P distinct blocks."""
    k = prev.shape[-1]
    pair = (clusters[:, :-1] * M + clusters[:, 1:])[valid]
    a, r = prev[valid], right[valid]  # kept in the DP's dtype: right can exceed float32's range
    pairs, inverse = torch.unique(pair, return_inverse=True)
    sums = a.new_zeros(len(pairs), k, k)
    step = max(1, chunk_elems // (k * k))
    for lo in range(0, len(pair), step):
        sums.index_add_(0, inverse[lo:lo + step], a[lo:lo + step, :, None] * r[lo:lo + step, None, :])
    i, j = pairs // M, pairs % M
    out = torch.zeros_like(trans)
    blocks, out_blocks = trans.view(M, k, M, k), out.view(M, k, M, k)
    out_blocks[i, :, j, :] = (sums * blocks[i, :, j, :]).to(trans.dtype)  # (P, k, k): the indexed axes come first
    return out


def check_recipe(s: Any) -> None:
    """Training settings of a blocked HMM: states split evenly over clusters, and state dropout keeps at
    least one state of each cluster."""
    if s.states % s.clusters:
        raise InputError(f"--states {s.states} must be divisible by --clusters {s.clusters}", param="states")
    if s.clusters > s.max_vocab:
        raise InputError(f"--clusters {s.clusters} exceeds the vocabulary size", param="clusters")
    k = s.states // s.clusters
    keep = k - round(k * s.state_dropout)
    if not 0 <= s.state_dropout < 1 or keep < 1:
        raise InputError(f"--state-dropout: must be in [0, 1) and keep >= 1 of the {k} states per cluster, "
                         f"got {s.state_dropout}", param="state_dropout")
