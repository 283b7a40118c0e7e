"""The families the store can hold, and saving / loading artifacts with each family's schema check.

This module sits at the top of `latentlm.models`: it imports every family module, and nothing inside
`latentlm.models` imports it. Adding a family means adding its class to `FAMILIES` (see the README,
"Adding a family"), or `register(cls)` from the family's own module (a plugin, a test). Every list of families
elsewhere (the families with constraints, the chain families completions serve, the CLI's choices) is read from
`FAMILIES` when it is asked for (`families_with`, `families`), so a family registered later is in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch

from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.checks import Validator
from latentlm.models.dense_pcfg import DensePCFG
from latentlm.models.errors import ArtifactError
from latentlm.models.family import Family
from latentlm.models.hmm import DenseHMM
from latentlm.models.lds import LDS
from latentlm.models.ngram import NGramLM
from latentlm.models.pcfg import RankPCFG
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.store import Artifact, read_artifact, write_artifact
from latentlm.models.tagging_hmm import TaggingHMM
from latentlm.models.vocab import Vocabulary

FAMILIES: dict[str, type[Family]] = {f.family: f for f in (
    DenseHMM, BlockedHMM, RankHMM, TaggingHMM, RankPCFG, DensePCFG, LDS, NGramLM)}

F = TypeVar("F", bound=type[Family])


def register(cls: F) -> F:
    """Add a family class under its `family` name (replacing one of the same name); returns it (a decorator)."""
    FAMILIES[cls.family] = cls
    return cls


def unregister(name: str) -> None:
    FAMILIES.pop(name, None)


def families_with(operation: str) -> list[str]:
    """The registered families whose declaration lists `operation` (the class's `operations`; what an instance adds,
    such as `embed` with state vectors, is not counted), in registration order."""
    return [name for name, cls in FAMILIES.items() if operation in cls.operations]


def families(kind: type[Family] = Family) -> list[str]:
    """The registered families whose class derives from `kind` (e.g. `base.ChainFamily`), in registration order."""
    return [name for name, cls in FAMILIES.items() if issubclass(cls, kind)]


def get_family(name: str) -> type[Family]:
    """The family class declared under `name` (the manifest's `family`)."""
    if name not in FAMILIES:
        raise ArtifactError(f"unknown model family {name!r} (known: {', '.join(sorted(FAMILIES))})", param="family")
    return FAMILIES[name]


def family_names() -> list[str]:
    return sorted(FAMILIES)


def _validator(family: str) -> Validator:
    return get_family(family).validate_tensors


def save_artifact(store: Path | str, name: str, family: str, tensors: dict[str, torch.Tensor], vocab: Vocabulary,
                  **kwargs: Any) -> Path:
    """Check `tensors` against the family's schema and write `<store>/<name>` atomically (see
    `store.write_artifact` for the keyword arguments: config, provenance, extra_files, overwrite)."""
    return write_artifact(store, name, family, tensors, vocab, validate=_validator(family), **kwargs)


def load_artifact(path: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  storage_dtype: str | torch.dtype | None = None, snapshots: Path | None = None) -> Artifact:
    """Read and verify `path`: hashes, shapes, finiteness and the family's own schema checks; the tensors
    are read straight onto `device`. With `dtype` (the computation dtype `from_tensors` will be given) the
    tensors the family keeps in another precision (`Family.read_dtypes`) are converted as they are read;
    None reads every tensor as stored. `snapshots`: map the weights from a shared verified snapshot in that
    directory (`store.map_weights`) instead of reading them into this process's memory."""
    def cast_for(family: str, config: dict[str, Any]) -> dict[str, torch.dtype]:
        return get_family(family).read_dtypes(config, device=torch.device(device), dtype=dtype,
                                              storage_dtype=storage_dtype)

    return read_artifact(path, _validator, device, cast_for if dtype is not None else None, snapshots=snapshots)
