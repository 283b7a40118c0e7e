"""ONNX Runtime scoring backend for `hmm`, `blocked_hmm` and `rank_hmm` models.

    export_model(loaded, path)                  # a LoadedModel (latentlm.ops.load_model) -> .onnx file
    scorer = OnnxScorer(path, expected_hash=loaded.content_hash)
    logprobs, token_logprobs = scorer.score([[1, 2, 3], [4]])
    scorer.op_score(seqs, token_logprobs=True)  # the same `Score` results as Family.op_score

The graph is built by `latentlm.models.onnx_graph` (see its docstring for the recursion and contract).
This module imports neither torch nor onnx at import time: scoring needs onnxruntime and numpy only
(`export_model` imports the graph builder, which needs onnx).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.family import length_batches
from latentlm.models.results import Score

META = "latentlm."
DEFAULT_MAX_BATCH_TOKENS = 16384


def export_model(loaded: Any, path: str | Path, *, opset: int | None = None) -> Path:
    """Export a `latentlm.ops.LoadedModel` (a family with an `onnx_layout`: hmm, blocked_hmm, rank_hmm) with its
    name, content hash, vocabulary and preprocessing in the metadata. Raises ValueError naming those families for
    any other."""
    from latentlm.models import onnx_graph, registry

    if getattr(loaded.impl, "onnx_layout", None) not in onnx_graph.LAYOUTS:
        names = [n for n, cls in registry.FAMILIES.items() if getattr(cls, "onnx_layout", None) in onnx_graph.LAYOUTS]
        raise ValueError(f"ONNX export supports the families {', '.join(names)}, not {loaded.family!r}")
    return onnx_graph.export_onnx(
        loaded.impl, path, name=loaded.name, content_hash=loaded.content_hash, vocab=list(loaded.vocab.tokens),
        preprocessing=loaded.vocab.preprocessing.to_dict(), opset=opset or onnx_graph.OPSET)


def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it, then CPU."""
    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


class OnnxScorer:
    """An onnxruntime session over an exported scoring graph.

    `expected_hash`: refuse (ArtifactError) a file whose latentlm.content_hash differs (e.g. the served
    model was retrained but the .onnx file is stale). `threads`: onnxruntime intra-op threads (None: its
    default, one per core). `max_batch_tokens`: sequences run in length-sorted batches whose padded size
    B x T stays under this (one sequence longer than it runs alone)."""

    operations = frozenset({"score"})
    decode_methods: frozenset[str] = frozenset()
    decode_notes: dict[str, str] = {}

    def __init__(self, path: str | Path, providers: list[str] | None = None, *, expected_hash: str | None = None,
                 threads: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS):
        self.path = Path(path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path}: no such ONNX file", param="path")
        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.path), sess_options=opts,
                                                providers=providers or default_providers())
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ArtifactError(f"{self.path}: onnxruntime cannot load it: {e}", param="path") from e
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        for key in ("family", "content_hash", "vocab_size"):
            if META + key not in self.metadata:
                raise ArtifactError(f"{self.path}: not a latentlm scoring graph (no {META + key} metadata)",
                                    param="path")
        if expected_hash is not None and self.content_hash != expected_hash:
            raise ArtifactError(
                f"{self.path}: content hash {self.content_hash[:16]}... does not match the model's "
                f"{expected_hash[:16]}... (re-export it)", param="content_hash")
        self.max_batch_tokens = max_batch_tokens

    # -- metadata ------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.metadata[META + "family"]

    @property
    def name(self) -> str:
        return self.metadata.get(META + "name", "")

    @property
    def content_hash(self) -> str:
        return self.metadata[META + "content_hash"]

    @property
    def vocab_size(self) -> int:
        return int(self.metadata[META + "vocab_size"])

    @property
    def num_states(self) -> int:
        return int(self.metadata.get(META + "num_states", 0))

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    # -- scoring -------------------------------------------------------------------------------------
    def _check(self, seqs: list[list[int]]) -> None:
        if not seqs:
            raise InputError("input: no sequences", param="input")
        V = self.vocab_size
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise InputError(f"input[{i}]: empty sequence", param="input")
            a = np.asarray(s)
            if a.dtype.kind not in "iu":
                raise InputError(f"input[{i}]: token ids must be integers", param=f"input[{i}]")
            bad = np.flatnonzero((a < 0) | (a >= V))
            if bad.size:
                p = int(bad[0])
                raise InputError(f"input[{i}]: token id {int(a[p])} at position {p} is outside [0, {V})",
                                 param=f"input[{i}]")

    def run_padded(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The raw graph: ids (B, T) int64 right-padded, lengths (B,) int64 -> logprob (B,) float64,
        token_logprobs (B, T) float32 (0 at padding). No checks."""
        lp, tok = self.session.run(None, {"ids": np.ascontiguousarray(ids, dtype=np.int64),
                                          "lengths": np.ascontiguousarray(lengths, dtype=np.int64)})
        return lp, tok

    def score(self, ids: list[list[int]]) -> tuple[list[float], list[list[float]]]:
        """log p(x) per sequence (natural log, -inf for probability 0) and log p(x_t | x_<t) per token,
        in input order; sequences are padded into length-sorted batches."""
        self._check(ids)
        logps: list[float] = [0.0] * len(ids)
        toks: list[list[float]] = [[] for _ in ids]
        for idx in length_batches(ids, self.max_batch_tokens):
            lens = np.array([len(ids[i]) for i in idx], dtype=np.int64)
            padded = np.zeros((len(idx), int(lens.max())), dtype=np.int64)
            for r, i in enumerate(idx):
                padded[r, : lens[r]] = ids[i]
            lp, tok = self.run_padded(padded, lens)
            lp_list, tok_list = lp.tolist(), tok.astype(np.float64).tolist()
            for r, i in enumerate(idx):
                logps[i] = lp_list[r]
                toks[i] = tok_list[r][: lens[r]]
        return logps, toks

    def op_score(self, seqs: list[list[int]], *, token_logprobs: bool = False) -> list[Score]:
        """The `Score` results `Family.op_score` returns (logprob -inf for probability 0, written as null by
        `latentlm.ops.dumps`), so `latentlm.ops.run` can use this object in place of `model.impl` for scoring."""
        logps, toks = self.score(seqs)
        return [Score(lp, len(s), tk if token_logprobs else None) for s, lp, tk in zip(seqs, logps, toks, strict=True)]
