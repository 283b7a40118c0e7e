"""`blocked_hmm` — the VL-HMM of Chiu & Rush (2020): emission-sparse HMM over Brown clusters.

The vocabulary is partitioned into M clusters; cluster c owns the k states c*k .. c*k+k-1 (Z = M k) and
only they may emit its words. At position t only the k states of cluster(x_t) can be active, so exact
inference gathers the k x k block trans[cluster(x_{t-1}) states, cluster(x_t) states] per step:
O(T k^2) per sequence, never O(T Z^2).

Artifact tensors: `start` (Z,), `trans` (Z, Z) rows sum to 1 (the cached matrix, states ordered by cluster),
`emit` (V, k): emit[w, i] = p(w | state cluster(w)*k + i) (for each state, its words' column sums to 1),
`word_cluster` (V,) int64 in [0, M). Optional `state_vectors` (Z, d) for embeddings.
Config: `num_states` Z, `num_clusters` M, `states_per_cluster` k.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from latentlm.models import triton_chain
from latentlm.models.base import Batch, ChainFamily
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.family import Recipe
from latentlm.models.sampling import CategoricalTable, tables_at


class BlockedHMM(ChainFamily):
    family = "blocked_hmm"
    has_fused_score = True  # on CUDA `score` runs `triton_chain.blocked_forward_cuda` (see `models.backend.score`)
    recipes = (Recipe("blocked_hmm", {"states": 1024, "clusters": 128, "hidden": 256, "epochs": 10, "batch": 64,
                                      "lr": 1e-2, "checkpoint_every": 200},
                      positive=("states", "epochs", "batch", "clusters", "hidden"), check=lambda s: check_recipe(s)),)

    def __init__(self, start: Tensor, trans: Tensor, emit: Tensor, word_cluster: Tensor, num_clusters: int,
                 extras: dict[str, Tensor] | None = None):
        self.start, self.trans, self.emit, self.word_cluster = start, trans, emit, word_cluster
        self.M = num_clusters
        self.k = emit.shape[1]
        self.extras = extras or {}
        self.device, self.dtype = trans.device, trans.dtype
        self.trans_blocks = trans.view(self.M, self.k, self.M, self.k)  # [c_prev, i, c_next, j]

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
        per_state = torch.zeros(M, k, dtype=torch.float64).index_add_(0, wc, emit.double())  # (M, k)
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
        """`storage_dtype` ("float32" default, "bfloat16"): precision of the fused CUDA scoring path only."""
        t = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
             for k, v in tensors.items()}
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
        clusters = self._clusters(batch)
        init = self.start.view(self.M, self.k)[clusters[:, 0]]
        return init, RowLookup(self.emit, batch.ids), self._block_fn(self.trans_blocks, clusters)

    @staticmethod
    def _block_fn(blocks: Tensor, clusters: Tensor):
        def trans_at(t: int) -> Tensor:  # (B, k, k): block (cluster(x_{t-1}), cluster(x_t))
            return blocks[clusters[:, t - 1], :, clusters[:, t], :]
        return trans_at

    @cached_property
    def _logs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.start.log().view(self.M, self.k), self.trans_blocks.log(), self.emit.log()

    def log_chain(self, batch: Batch) -> tuple[Tensor, Tensor, Trans]:
        log_start, log_blocks, log_emit = self._logs
        clusters = self._clusters(batch)
        return log_start[clusters[:, 0]], log_emit[batch.ids], self._block_fn(log_blocks, clusters)

    @property
    def states_per_token(self) -> int:
        """Only the k states of a token's cluster can emit it."""
        return self.k

    def state_ids(self, batch: Batch) -> Tensor:
        return self._clusters(batch).unsqueeze(-1) * self.k + torch.arange(self.k, device=self.device)

    def viterbi(self, batch: Batch) -> tuple[Tensor, Tensor]:
        path, logp = super().viterbi(batch)
        batch = self.to(batch)
        glob = self._clusters(batch) * self.k + path
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

    def _tables(self, temperature: float):
        words = self._cluster_words  # (M, W)
        probs = self.emit[words.clamp_min(0)]  # (M, W, k)
        probs = torch.where((words >= 0).unsqueeze(-1), probs, torch.zeros((), dtype=probs.dtype))
        per_state = probs.permute(0, 2, 1).reshape(self.num_states, -1)  # (Z, W)
        slot_token = words.repeat_interleave(self.k, dim=0)  # (Z, W)
        return CategoricalTable(self.trans, temperature), CategoricalTable(per_state, temperature), slot_token


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
