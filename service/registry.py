"""The set of served models: every artifact in the store, loaded once, swapped atomically on reload.

Requests take a `LoadedModel` reference when they start, so a reload never changes the model under a
request in flight; the old version is dropped when the last request holding it finishes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from latentlm import ops
from latentlm.models import backend as dispatch
from latentlm.models import kernels
from latentlm.models.errors import LatentLMError, ModelNotFound
from latentlm.models.store import (
    MANIFEST,
    VOCAB,
    WEIGHTS,
    check_model_dir,
    content_hash,
    file_signature,
    list_models,
    prune_snapshots,
    read_manifest,
    verify_files,
)
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")


def manifest_hash(path: Path) -> str:
    """Content hash of an artifact from its manifest alone (same value as `Artifact.content_hash`)."""
    return content_hash(read_manifest(path)["files"])


class ModelRegistry:
    """name -> LoadedModel; `reload()` loads new/changed artifacts and drops removed ones."""

    def __init__(self, store: Path, device: torch.device | str = "cpu", dtype: str = "float32",
                 backend: str = "torch", storage_dtype: str | None = None, calibrate: bool | None = None,
                 snapshots: Path | None = None):
        """`storage_dtype`: precision of the fused CUDA scoring path of rank_hmm / blocked_hmm ("float32", "tfloat32",
        "bfloat16"; on CPU, bfloat16 holds blocked_hmm's matrix in bfloat16 only, for every operation); None reads
        the setting (LATENTLM_STORAGE_DTYPE, default float32). `calibrate`: time the CPU batch engines and BLAS
        libraries on each chain model's matrix at load and keep the fastest (`models.calibrate`); None reads
        LATENTLM_CALIBRATE (default on). `snapshots` (several API workers on a CPU): every model's weights are
        mapped from a verified snapshot in that directory (`store.map_weights`), one copy in memory shared by
        the workers; snapshots of models no longer served are deleted after each reload."""
        self.store, self.device, self.dtype, self.backend = Path(store), device, dtype, backend
        self.snapshots = snapshots
        self.calibrate = Settings.from_env().calibrate if calibrate is None else calibrate
        self.precision = Settings.from_env().storage_dtype if storage_dtype is None else storage_dtype
        self.allow_tf32 = str(self.precision).lower() == "tfloat32"
        # an unknown precision is refused here (ValueError naming the choices), not at the first model
        self.storage_dtype = dispatch.storage_dtype("float32" if self.allow_tf32 else self.precision)
        self.models: dict[str, ops.LoadedModel] = {}
        self.failed: dict[str, str] = {}
        self._verified: dict[str, tuple] = {}  # name -> file_signature of the files last verified for it
        self.ready = False
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, device: torch.device | str | None = None) -> ModelRegistry:
        """The registry the API, `latentlm worker` and rq jobs each build: the store, dtype, backend and fused
        precision of `settings`; `device` defaults to the settings' (auto: CUDA when there is one)."""
        return cls(settings.store, device=ops.resolve_device(settings.device) if device is None else device,
                   dtype=settings.dtype, backend=settings.backend, storage_dtype=settings.storage_dtype,
                   calibrate=settings.calibrate, snapshots=settings.snapshot_dir)

    def get(self, name: str) -> ops.LoadedModel:
        m = self.models.get(name)
        if m is None:
            avail = ", ".join(sorted(self.models)) or "none"
            raise ModelNotFound(f"model {name!r} not found (available: {avail})", param="model")
        return m

    def list(self) -> list[ops.LoadedModel]:
        return [self.models[k] for k in sorted(self.models)]

    def identities(self, names: Iterable[str]) -> dict[str, str]:
        """{name: content hash} of each of `names` as this registry's store holds it now: the hash of its manifest's
        per-file hashes (`manifest_hash`, what GET /v1/models reports as `content_hash` once loaded), or the loaded
        version's where the manifest cannot be read; a name the store has no model of is left out. A batch records
        it (`jobs.create_batch`) so that workers on other hosts answer only from the same versions. O(len(names))
        manifest reads, no weights read."""
        out: dict[str, str] = {}
        for name in names:
            try:
                out[name] = manifest_hash(check_model_dir(self.store, name))
            except (LatentLMError, OSError, ValueError, KeyError, TypeError):
                m = self.models.get(name)
                if m is not None:
                    out[name] = m.content_hash
        return out

    def _dir_present(self, name: str) -> bool:
        """Whether the loaded model `name` is still in the store in some form: its directory (or a link of that
        name) exists, or `write_artifact` is swapping a new version in (`.<name>.*` beside it)."""
        path = self.store / name
        if path.exists() or path.is_symlink():
            return True
        try:
            return any(p.name.startswith(f".{name}.") for p in self.store.iterdir())
        except OSError:  # the store itself is unreadable: keep serving what is loaded
            return True

    def reload(self, rehash: bool = True) -> dict[str, list[str]]:
        """Sync with the store; returns {"added", "updated", "removed", "failed"} names. Blocking.

        Verifies like a fresh load: a model whose manifest is unchanged is kept only once every file it lists
        is re-hashed against the manifest (`rehash=False`: only files whose stat signature changed since they
        were last verified), and a model directory or file that is a symbolic link, or a manifest naming a
        file outside the model directory, is refused. A refused model keeps its last good version serving;
        `self.failed` says why ({name: reason}, also logged)."""
        with self._lock:
            current = dict(self.models)
            names = list_models(self.store)
            # A model that is loaded (or a directory that holds model files) but has no readable manifest now is
            # refused, not silently unloaded: a deleted, renamed or half-written manifest keeps the last good
            # version serving. Only a model whose whole directory is gone (and no write of it is under way) is
            # removed.
            names = sorted(set(names) | {n for n in current if self._dir_present(n)}
                           | set(_manifestless_model_dirs(self.store)))
            added, updated, failed = [], [], []
            new: dict[str, ops.LoadedModel] = {}
            errors: dict[str, str] = {}
            verified: dict[str, tuple] = {}
            for name in names:
                old = current.get(name)
                try:
                    path = check_model_dir(self.store, name)
                    manifest = read_manifest(path)
                    sig = file_signature(path, manifest)  # before hashing: a write during it shows next time
                    if old is not None and manifest == old.artifact.manifest:
                        if rehash or self._verified.get(name) != sig:
                            verify_files(path, manifest)
                        new[name], verified[name] = old, sig
                        continue
                    kernels.warm_up(getattr(torch, self.dtype))  # compile now, not in a user's request
                    model = ops.load_model(self.store, name, device=self.device, dtype=self.dtype,
                                           backend=self.backend,
                                           storage_dtype="tfloat32" if self.allow_tf32 else self.storage_dtype,
                                           calibrate=self.calibrate,  # the fastest engine/BLAS here
                                           snapshots=self.snapshots)
                    new[name], verified[name] = model, sig
                    (updated if old is not None else added).append(name)
                except Exception as e:  # a bad artifact must not keep the others from serving
                    msg = e.message if isinstance(e, LatentLMError) else f"{type(e).__name__}: {e}"
                    log.error("cannot load model %s%s: %s", name,
                              " (the previous version keeps serving)" if old is not None else "", msg)
                    errors[name] = msg
                    failed.append(name)
                    if old is not None:  # keep serving the last good version
                        new[name] = old  # (not in `verified`: its files are hashed again next time)
            removed = sorted(set(current) - set(new))
            self.models, self.failed = new, errors  # one reference swap: readers see old or new
            self._verified = verified
            if removed or updated:
                _clear_fused_cache()
                if self.snapshots is not None:
                    prune_snapshots(self.snapshots, {m.artifact.manifest["files"][WEIGHTS] for m in new.values()})
            self.ready = True
            return {"added": added, "updated": updated, "removed": removed, "failed": failed}


def _manifestless_model_dirs(store: Path) -> list[str]:
    """Directories of the store that hold a model's weights or vocabulary but no manifest file: an artifact that
    is half written or lost its manifest (reported as refused by `reload`, never served)."""
    out = []
    try:
        entries = list(store.iterdir()) if store.is_dir() else []
    except OSError:
        return out
    for p in entries:
        if p.name.startswith(".") or not p.is_dir() or (p / MANIFEST).is_file():
            continue
        if any((p / f).exists() or (p / f).is_symlink() for f in (WEIGHTS, VOCAB)):
            out.append(p.name)
    return out


def _clear_fused_cache() -> None:
    """Drop `triton_chain`'s captured CUDA graphs and storage-dtype copies: they hold the tensors of models
    that were just unloaded or replaced (the models still loaded capture theirs again on their next call)."""
    try:
        from latentlm.models import triton_chain

        triton_chain.clear_cache()
    except Exception as e:  # never let a cache sweep fail a reload
        log.warning("cannot clear the fused scoring cache: %s", e)
