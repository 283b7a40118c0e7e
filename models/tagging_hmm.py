"""`tagging_hmm` — an HMM whose states emit a word and a tag independently (the factorisation of the VL-HMM
draft §5.2, here with dense scalar tables; the draft's blocked neural model is `training.tagging_vlhmm`):
p(w, y, z) = prod_t p(z_t | z_{t-1}) p(w_t | z_t) p(y_t | z_t).

Artifact tensors: `start` (Z,), `trans` (Z, Z), `emit` (Z, V) as in `hmm`, plus `tag_emit` (Z, Y) rows summing
to 1. Config: `num_states`, `tags` (list of Y tag names, index = tag id). Scoring, posteriors and sampling
see words only (the tag factor sums to 1); `decode` returns tags:
  * `viterbi`: the jointly most probable (states, tags): Viterbi over states with emission weight
    p(w | z) max_y p(y | z), then y_t = argmax_y p(y | z_t) — exact MAP of (z, y) since tags are independent
    given the state. Returns `tags`, `states`, `logprob` (log max_{z,y} p(w, y, z)).
  * `mbr`: per-token argmax of the tag marginals p(y_t | w) = sum_z p(z_t | w) p(y | z); returns `tags`,
    `tag_probs` (the chosen marginals), `states` (per-token most probable state), `expected_correct`.
O(T Z^2) per sequence, like `hmm`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from latentlm.models.base import Batch
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.errors import ArtifactError
from latentlm.models.hmm import DenseHMM
from latentlm.models.results import Decoded, Path


class TaggingHMM(DenseHMM):
    family = "tagging_hmm"
    onnx_layout = None  # scored by torch: no ONNX graph is exported for it (its words-only graph would be hmm's)
    recipes = ()  # trained by `latentlm train-tagger` (latentlm.training.tagging)
    importers = ()

    def __init__(self, start: Tensor, trans: Tensor, emit: Tensor, tag_emit: Tensor, tags: list[str],
                 extras: dict[str, Tensor] | None = None):
        super().__init__(start, trans, emit, extras)
        self.tag_emit, self.tags = tag_emit, list(tags)

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        DenseHMM.validate_tensors({k: v for k, v in tensors.items() if k != "tag_emit"}, config, vocab_size, where)
        tags = config.get("tags")
        if not isinstance(tags, list) or not tags or not all(isinstance(t, str) and t for t in tags):
            raise ArtifactError(f"{where}: config needs `tags`, a non-empty list of tag names", param="tags")
        if len(set(tags)) != len(tags):
            raise ArtifactError(f"{where}: config `tags` has duplicates", param="tags")
        Z = tensors["trans"].shape[0]
        check_distribution(check_shape(tensors, "tag_emit", (Z, len(tags)), where), "tag_emit", 1, where)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> TaggingHMM:
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        extras = {k: v for k, v in t.items() if k not in ("start", "trans", "emit", "tag_emit")}
        model = cls(t["start"], t["trans"], t["emit"], t["tag_emit"], config["tags"], extras)
        model.set_storage_dtype(storage_dtype)
        return model

    def describe(self) -> dict[str, Any]:
        return {"num_states": self.num_states, "tags": self.tags}

    @cached_property
    def _best_tag(self) -> tuple[Tensor, Tensor]:
        """(log max_y p(y | z) (Z,), argmax_y (Z,))."""
        p, y = self.tag_emit.max(-1)
        return p.log(), y

    @cached_property
    def _tagged_log_emit(self) -> Tensor:
        """log p(x | z) + log max_y p(y | z) by word (V, Z): the emission rows of the joint word-and-tag decode."""
        return self._logs[2] + self._best_tag[0]

    def log_chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        log_start, _, log_trans = super().log_chain(batch)
        return log_start, RowLookup(self._tagged_log_emit, batch.ids), log_trans

    def tag_marginals(self, batch: Batch) -> Tensor:
        """p(y_t | w) (B, T, Y), zeros at padding. O(B T (Z^2 + Z Y))."""
        _, gamma = self.posterior(batch)
        return gamma @ self.tag_emit

    def op_decode(self, seqs: list[list[int]], *, method: str = "viterbi") -> list[Path] | list[Decoded]:
        batch = Batch.from_lists(seqs, self.device)
        if method == "viterbi":
            path, logp = self.viterbi(batch)
            tag_ids = self._best_tag[1][path.clamp_min(0)].cpu()
            path, logp = path.cpu(), logp.double().cpu()
            return [Path(path[i, : len(s)].tolist(), float(logp[i]),
                         tags=[self.tags[j] for j in tag_ids[i, : len(s)].tolist()]) for i, s in enumerate(seqs)]
        _, gamma = self.posterior(batch)
        p, y = (gamma @ self.tag_emit).max(-1)
        states = gamma.argmax(-1).cpu()
        p, y = p.double().cpu(), y.cpu()
        return [Decoded(states[i, : len(s)].tolist(), float(p[i, : len(s)].sum()),
                        tags=[self.tags[j] for j in y[i, : len(s)].tolist()], tag_probs=p[i, : len(s)].tolist())
                for i, s in enumerate(seqs)]
