"""`hmm` — dense HMM: start [Z], transitions [Z, Z], emissions [Z, V], all probabilities.

Artifact tensors: `start` (Z,), `trans` (Z, Z) rows sum to 1, `emit` (Z, V) rows sum to 1; optional
`state_vectors` (Z, d) and `word_vectors` (V, d) for DenseHMM models (served by `embed`).
Config: `num_states`. Inference: O(T Z^2) per sequence, one (B, Z) x (Z, Z) GEMM per step.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from latentlm.models.base import Batch, ChainFamily
from latentlm.models.chain import CategoricalTable, Emit, RowLookup, Trans
from latentlm.models.store import check_distribution, check_shape
from torch import Tensor


class DenseHMM(ChainFamily):
    family = "hmm"

    def __init__(self, start: Tensor, trans: Tensor, emit: Tensor, extras: dict[str, Tensor] | None = None):
        self.start, self.trans, self.emit = start, trans, emit
        self.extras = extras or {}
        self.device, self.dtype = trans.device, trans.dtype
        self.emit_by_word = emit.T.contiguous()  # (V, Z): row gather per token

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        Z = tensors["trans"].shape[0] if "trans" in tensors else config.get("num_states", 0)
        if config.get("num_states", Z) != Z:
            raise_config(where, "num_states", config["num_states"], Z)
        check_distribution(check_shape(tensors, "start", (Z,), where), "start", 0, where)
        check_distribution(check_shape(tensors, "trans", (Z, Z), where), "trans", 1, where)
        check_distribution(check_shape(tensors, "emit", (Z, vocab_size), where), "emit", 1, where)
        if "state_vectors" in tensors and tensors["state_vectors"].shape[0] != Z:
            check_shape(tensors, "state_vectors", (Z, tensors["state_vectors"].shape[1]), where)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32) -> DenseHMM:
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        extras = {k: v for k, v in t.items() if k not in ("start", "trans", "emit")}
        return cls(t["start"], t["trans"], t["emit"], extras)

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        B = batch.ids.shape[0]
        return self.start.expand(B, -1), RowLookup(self.emit_by_word, batch.ids), self.trans

    @cached_property
    def _logs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.start.log(), self.trans.log(), self.emit_by_word.log()

    def log_chain(self, batch: Batch) -> tuple[Tensor, Tensor, Trans]:
        log_start, log_trans, log_emit_by_word = self._logs
        return log_start.expand(batch.ids.shape[0], -1), log_emit_by_word[batch.ids], log_trans

    def state_ids(self, batch: Batch) -> Tensor:
        B, T = batch.ids.shape
        return torch.arange(self.num_states, device=self.device).expand(B, T, -1)

    def sampling_tables(self, temperature: float):
        return self._tables(temperature) if temperature != 1.0 else self._tables_t1

    @cached_property
    def _tables_t1(self):
        return self._tables(1.0)

    def _tables(self, temperature: float):
        return CategoricalTable(self.trans, temperature), CategoricalTable(self.emit, temperature), None


def raise_config(where: str, key: str, declared: Any, actual: Any) -> None:
    from latentlm.models.errors import ArtifactError

    raise ArtifactError(f"{where}: config {key}={declared!r} does not match the tensors ({actual!r})", param=key)
