"""`hmm` — dense HMM: start [Z], transitions [Z, Z], emissions [Z, V], all probabilities.

Artifact tensors: `start` (Z,), `trans` (Z, Z) rows sum to 1, `emit` (Z, V) rows sum to 1; optional
`state_vectors` (Z, d) and `word_vectors` (V, d) for DenseHMM models (served by `embed`).
Config: `num_states`. Inference: O(T Z^2) per sequence, one (B, Z) x (Z, Z) GEMM per step.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from latentlm.models.base import Batch, ChainFamily, ChainOperations, tempered_rows
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.chain_view import DenseView
from latentlm.models.checks import check_config, check_distribution, check_shape
from latentlm.models.ctrlg import read_ctrlg
from latentlm.models.errors import InputError
from latentlm.models.family import Importer, Option, Recipe, path_read
from latentlm.models.sampling import CategoricalTable, tables_at
from latentlm.models.vocab import Preprocessing, Vocabulary


class DenseHMM(ChainFamily):
    family = "hmm"
    operations = ChainOperations(ChainFamily.operations | {"constraint"})  # type: ignore[assignment]
    onnx_layout = "shared"
    recipes = (
        Recipe("hmm", {"states": 256, "epochs": 10, "batch": 256, "checkpoint_every": 0},
               positive=("states", "epochs", "batch"), shape=("states",), trainer="latentlm.training.baum_welch"),
        Recipe("densehmm", {"states": 128, "hidden": 64, "epochs": 10, "batch": 256, "lr": 0.05,
                            "checkpoint_every": 0}, positive=("states", "epochs", "batch", "hidden"),
               shape=("states", "hidden"), trainer="latentlm.training.densehmm"),
    )
    importers = (Importer("import-hmm", "import an hmmlearn-style .npz (startprob, transmat, emissionprob)",
                          "FILE.npz", lambda path: read_hmmlearn_npz(path)),
                 Importer("import-ctrlg", "import a Ctrl-G HMM checkpoint (config.json + model.safetensors: alpha_exp, "
                          "beta, gamma) over an LM's tokens", "DIR",
                          path_read(read_ctrlg),
                          (Option("tokenizer", None, "the LM's save_pretrained directory (or its tokenizer.json): the "
                                                     "model carries it and reads text with it", required=True),)))

    def __init__(self, start: Tensor, trans: Tensor, emit: Tensor, extras: dict[str, Tensor] | None = None):
        self.start, self.trans, self.emit = start, trans, emit
        self.extras = extras or {}
        self.device, self.dtype = trans.device, trans.dtype
        self.emit_by_word = emit.T.contiguous()  # (V, Z): row gather per token

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        Z = tensors["trans"].shape[0] if "trans" in tensors else config.get("num_states", 0)
        check_config(where, "num_states", config.get("num_states", Z), Z)
        check_distribution(check_shape(tensors, "start", (Z,), where), "start", 0, where)
        check_distribution(check_shape(tensors, "trans", (Z, Z), where), "trans", 1, where)
        check_distribution(check_shape(tensors, "emit", (Z, vocab_size), where), "emit", 1, where)
        if "state_vectors" in tensors and tensors["state_vectors"].shape[0] != Z:
            check_shape(tensors, "state_vectors", (Z, tensors["state_vectors"].shape[1]), where)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> DenseHMM:
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        extras = {k: v for k, v in t.items() if k not in ("start", "trans", "emit")}
        model = cls(t["start"], t["trans"], t["emit"], extras)
        model.set_storage_dtype(storage_dtype)
        return model

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    # hooks of `ChainFamily.sample_predictive`: every state can emit every token
    predictive_sampling = True

    def _token_probs(self, pi: Tensor) -> Tensor:
        return pi @ self.emit

    def _condition(self, pi: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        ids = torch.arange(self.num_states, device=self.device).expand(len(x), -1)
        return pi * self.emit_by_word[x], ids

    def _propagate(self, alpha: Tensor, ids: Tensor) -> Tensor:
        return alpha @ self.trans

    def _trans_into(self, ids: Tensor, z_next: Tensor) -> Tensor:
        return self.trans[:, z_next].T

    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        B = batch.ids.shape[0]
        return self.start.expand(B, -1), RowLookup(self.emit_by_word, batch.ids), self.trans

    @cached_property
    def _logs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.start.log(), self.trans.log(), self.emit_by_word.log()

    def log_chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        log_start, log_trans, log_emit_by_word = self._logs
        return log_start.expand(batch.ids.shape[0], -1), RowLookup(log_emit_by_word, batch.ids), log_trans

    def state_ids(self, batch: Batch) -> Tensor:
        B, T = batch.ids.shape
        return torch.arange(self.num_states, device=self.device).expand(B, T, -1)

    def sampling_tables(self, temperature: float):
        return tables_at(self, temperature, self._tables)

    def onnx_tensors(self) -> dict[str, Tensor]:
        return {"start": self.start, "step": self.trans, "emit_by_word": self.emit_by_word}

    # -- constrained inference: the dense tensors as they are -------------------------------------------
    def constraint_view(self) -> DenseView:
        return DenseView(self, self.start, self.trans, self.emit, self.emit_by_word)

    def tempered_copy(self, temperature: float) -> DenseHMM:
        """A DenseHMM over the tempered start, transition rows and emission rows (a tagging_hmm's tags, which
        word constraints sum out, are left behind)."""
        start, trans, emit = (tempered_rows(w, temperature, self.dtype)
                              for w in (self.start[None], self.trans, self.emit))
        return DenseHMM(start[0], trans, emit)

    def _tables(self, temperature: float):
        return CategoricalTable(self.trans, temperature), CategoricalTable(self.emit, temperature), None


# -- importers --------------------------------------------------------------------------------------
def read_hmmlearn_npz(path: Path) -> tuple[dict[str, Tensor], Vocabulary, dict[str, Any]]:
    """The `import-hmm` importer: hmmlearn's `CategoricalHMM` attributes in an npz (startprob [Z], transmat
    [Z, Z], emissionprob [Z, V], optional vocab [V]) -> `hmm` tensors (float64), vocabulary, config. Raises
    InputError naming the key and the problem."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file", param="FILE")
    try:
        npz = np.load(path, allow_pickle=False)
        arrays = {k: npz[k] for k in npz.files}
    except Exception as e:
        raise InputError(f"{path}: not a readable .npz file ({e})", param="FILE") from None
    allowed = {"startprob", "transmat", "emissionprob", "vocab"}
    extra = sorted(set(arrays) - allowed)
    if extra:
        raise InputError(f"{path}: unexpected key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})", param=extra[0])
    for key in ("startprob", "transmat", "emissionprob"):
        if key not in arrays:
            raise InputError(f"{path}: missing key {key!r}", param=key)
        a = arrays[key]
        if a.dtype.kind not in "fiu":
            raise InputError(f"{key}: expected numbers, got dtype {a.dtype}", param=key)
    start, trans, emit = (arrays[k].astype(np.float64) for k in ("startprob", "transmat", "emissionprob"))
    if start.ndim != 1 or start.shape[0] == 0:
        raise InputError(f"startprob: expected shape [Z] with Z >= 1, got {list(start.shape)}", param="startprob")
    Z = start.shape[0]
    if trans.shape != (Z, Z):
        raise InputError(f"transmat: expected shape [{Z}, {Z}], got {list(trans.shape)}", param="transmat")
    if emit.ndim != 2 or emit.shape[0] != Z or emit.shape[1] == 0:
        raise InputError(f"emissionprob: expected shape [{Z}, V], got {list(emit.shape)}", param="emissionprob")
    for key, a, axis in (("startprob", start, 0), ("transmat", trans, 1), ("emissionprob", emit, 1)):
        if not np.isfinite(a).all():
            pos = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise InputError(f"{key}: NaN or infinite entry at {list(pos)}", param=key)
        if (a < 0).any():
            pos = tuple(int(i) for i in np.argwhere(a < 0)[0])
            raise InputError(f"{key}: negative entry {a[pos]:.6g} at {list(pos)}", param=key)
        sums = a.sum(axis=axis) if a.ndim > 1 else np.array([a.sum()])
        bad = np.flatnonzero(np.abs(sums - 1) > 1e-4)
        if len(bad):
            what = "sums" if a.ndim == 1 else f"row {int(bad[0])} sums"
            raise InputError(f"{key}: {what} to {sums[bad[0]]:.6g}, not 1 (tolerance 1e-4)", param=key)
    V = emit.shape[1]
    if "vocab" in arrays:
        vocab_arr = arrays["vocab"]
        if vocab_arr.shape != (V,):
            raise InputError(f"vocab: expected shape [{V}], got {list(vocab_arr.shape)}", param="vocab")
        tokens = [str(t) for t in vocab_arr.tolist()]
        bad_tok = next((t for t in tokens if not t or any(c.isspace() for c in t)), None)
        if bad_tok is not None:
            raise InputError(f"vocab: token {bad_tok!r} is empty or contains whitespace", param="vocab")
        if len(set(tokens)) != V:
            raise InputError("vocab: tokens are not unique", param="vocab")
    else:
        tokens = [str(i) for i in range(V)]
    pre = Preprocessing(lowercase=False, unk="<unk>" if "<unk>" in tokens else None,
                        eos="<eos>" if "<eos>" in tokens else None, add_eos="<eos>" in tokens)
    tensors = {"start": torch.from_numpy(start), "trans": torch.from_numpy(trans), "emit": torch.from_numpy(emit)}
    return tensors, Vocabulary(tokens, pre), {"num_states": Z}
