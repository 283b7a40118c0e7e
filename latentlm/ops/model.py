"""A loaded model: a verified artifact plus its family instance on a device, and how one is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

import torch

from latentlm.models import backend as dispatch
from latentlm.models.errors import InputError
from latentlm.models.family import Family
from latentlm.models.registry import get_family, load_artifact
from latentlm.models.store import Artifact, model_path
from latentlm.models.vocab import Vocabulary


@dataclass
class LoadedModel:
    """A verified artifact plus its family instance on a device."""

    name: str
    artifact: Artifact
    impl: Family
    device: torch.device
    runners: dict[str, Any] = field(default_factory=dict)  # operation -> what runs it instead of `impl`
    backend_notes: dict[str, str] = field(default_factory=dict)  # operation -> why it stayed on torch

    def runner(self, op: str) -> Any:
        """What answers `op`: the ONNX Runtime scorer where one was attached (`use_onnx`), else the family."""
        return self.runners.get(op, self.impl)

    def numerics(self) -> str:
        """What this model's answers depend on besides its content, e.g. "float32-bfloat16-onnx": its dtype, the
        storage precision of its scoring (`set_storage_dtype`: float32, tfloat32, bfloat16) and whether ONNX
        Runtime scores it. Part of the response cache's key: servers set up differently never share answers."""
        dtype = str(getattr(self.impl, "dtype", "")).removeprefix("torch.")
        return "-".join(p for p in (dtype, getattr(self.impl, "precision", ""), "onnx" if self.runners else "") if p)

    def use_onnx(self, cache_dir: Path) -> None:
        """Score through onnxruntime: export the scoring graph once per content hash into `cache_dir` (reused
        while the model is unchanged) and attach an `OnnxScorer` for `score`. Families the graph does not
        cover, and every other operation, stay on torch (said in `describe()`)."""
        from latentlm import onnx_backend
        from latentlm.models import onnx_graph

        if getattr(self.impl, "onnx_layout", None) not in onnx_graph.LAYOUTS:
            self.backend_notes["score"] = f"no ONNX graph for family {self.family}"
            return
        path = Path(cache_dir) / f"{self.name}-{self.content_hash[:16]}.onnx"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.onnx")
            onnx_backend.export_model(self, tmp)
            tmp.rename(path)
        self.runners["score"] = onnx_backend.OnnxScorer(path, expected_hash=self.content_hash)

    @property
    def vocab(self) -> Vocabulary:
        return self.artifact.vocab

    @property
    def family(self) -> str:
        return self.artifact.family

    @property
    def content_hash(self) -> str:
        return self.artifact.content_hash

    def describe(self) -> dict[str, Any]:
        """The `GET /v1/models` entry."""
        m = self.artifact.manifest
        family = self.impl.describe()
        # which engine answers: the family's own report (e.g. score on "lockstep" or "cuda_fused"), with the
        # operations an ONNX Runtime scorer took over marked "onnx"
        backend = {**family.pop("backend", {}), **{op: "onnx" for op in self.runners}}
        return {
            "id": self.name, "object": "model", "family": self.family, "vocab_size": len(self.vocab),
            # text in and out: "whitespace" (words) or the LM's tokenizer.json ({"type", "sha256", "vocab_size",
            # "decoder"})
            "tokenizer": self.vocab.tokenizer.describe() if self.vocab.tokenizer is not None else
            self.vocab.preprocessing.tokenizer,
            **family,
            "operations": sorted(self.impl.operations),
            "decode_methods": sorted(self.impl.decode_methods),
            "default_method": self.impl.default_method,
            "backend": backend,
            **({"backend_notes": self.backend_notes} if self.backend_notes else {}),
            "preprocessing": m.get("preprocessing", {}),
            "content_hash": self.content_hash,
            # OpenAI's model object: `created` in Unix seconds, `owned_by`; the ISO time is `provenance.created`
            "created": unix_time(m.get("provenance", {}).get("created")),
            "owned_by": "latentlm",
            "provenance": m.get("provenance", {}),
        }


def calibration_on(calibrate: bool | None) -> bool:
    """Whether a command calibrates the models it loads (`load_model(calibrate=True)`: the CPU batch engines and
    BLAS libraries timed on a chain model's matrix and the fastest kept, `models.calibrate`, well under a second):
    `calibrate`, or where None the environment's LATENTLM_CALIBRATE (default on, "0" off), as the service does, so
    the CLI, evaluation and the service run the same engines at the same speed."""
    if calibrate is not None:
        return calibrate
    return os.environ.get("LATENTLM_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")


def unix_time(iso: Any) -> int | None:
    """An ISO-8601 time (as manifests record it) in Unix seconds; None when absent or unreadable."""
    from datetime import datetime

    if not isinstance(iso, str):
        return None
    try:
        t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp())


def resolve_device(spec: str | None) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without a GPU is an error."""
    spec = (spec or "auto").lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("device: 'cuda' requested but no CUDA device is available", param="device")
    if spec not in ("cpu",) and not spec.startswith("cuda"):
        raise InputError(f"device: expected auto, cpu or cuda, got {spec!r}", param="device")
    return torch.device(spec)


DTYPES = {"float32": torch.float32, "float64": torch.float64}


BACKENDS = ("torch", "onnx")
# scoring precisions of chain families (`ChainFamily.set_storage_dtype`): float32 (exact), tfloat32 (CUDA: float32
# storage, TF32 tensor-core products), bfloat16 (half the bytes of each matrix read; CUDA, and blocked_hmm on CPU,
# where the bfloat16 matrix replaces the float32 one for every operation)
STORAGE_DTYPES = dispatch.PRECISIONS
ONNX_CACHE = ".onnx"  # inside the store: exported graphs, named by model and content hash


def load_model(store: Path | str, name: str, device: str | torch.device = "cpu",
               dtype: str = "float32", backend: str = "torch",
               storage_dtype: str | torch.dtype | None = None,
               calibrate: bool = False, snapshots: Path | None = None) -> LoadedModel:
    """Verify and load `<store>/<name>` onto `device`; with `backend="onnx"`, scoring runs through
    onnxruntime (the graph exported to `<store>/.onnx/` on first use). `storage_dtype` (`STORAGE_DTYPES`; None:
    float32): the precision of a chain family's scoring (`ChainFamily.set_storage_dtype`; other families have one
    precision, the model's dtype). `calibrate`: time the CPU engines on the model's matrix and keep the
    fastest (`calibration_on` says whether a command should). `snapshots` (CPU): the weights are pages of a
    verified snapshot in that directory, shared by every process serving the model (`store.map_weights`)."""
    if backend not in BACKENDS:
        raise InputError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}", param="backend")
    if dtype not in DTYPES:
        raise InputError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}", param="dtype")
    if isinstance(storage_dtype, str) and storage_dtype not in STORAGE_DTYPES:
        raise InputError(f"storage_dtype: expected one of {', '.join(STORAGE_DTYPES)}, got {storage_dtype!r}",
                         param="storage_dtype")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    # read once, straight onto the device, each tensor in the dtype the family keeps it in
    art = load_artifact(model_path(store, name), device=dev, dtype=DTYPES[dtype], storage_dtype=storage_dtype,
                        snapshots=snapshots)
    fam = get_family(art.family)
    impl = fam.from_tensors(art.tensors, art.config, device=dev, dtype=DTYPES[dtype], storage_dtype=storage_dtype)
    art.tensors.clear()  # the family holds them now (converted, for a dtype other than the file's): one copy
    model = LoadedModel(name=name, artifact=art, impl=impl, device=dev)
    if backend == "onnx":
        model.use_onnx(Path(store) / ONNX_CACHE)
    if calibrate and hasattr(impl, "calibrate"):  # the fastest CPU engine and BLAS on this machine
        impl.calibrate()
    return model

