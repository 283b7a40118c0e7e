"""What every `latentlm` subcommand shares: the error type, `--store`, model options, JSON lines out."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.models.store import default_store
from latentlm.ops.model import calibration_on


class CLIError(LatentLMError):
    pass


PIP_NAMES = {"yaml": "pyyaml"}  # import name -> package name, where they differ


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module without a spec (taken as present)
        return "." not in module


def require_extra(extra: str, modules: Iterable[str], command: str) -> None:
    """Before any work: raise CLIError (one line, exit status 2) naming the packages of the optional
    dependencies `extra` that `command` (what is being run, e.g. "training blocked_hmm") needs among `modules`
    (import names) and are not installed, with the `pip install` that adds them. Nothing is imported
    (`importlib.util.find_spec`)."""
    missing = [PIP_NAMES.get(m, m) for m in dict.fromkeys(modules) if not _installed(m)]
    if missing:
        names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
        raise CLIError(f"{command} needs {names}, {'which are' if len(missing) > 1 else 'which is'} not installed "
                       f"(the [{extra}] extra); run: pip install 'latentlm[{extra}]'", param=extra)


def add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", type=Path, default=default_store(),
                   help="model store directory (default: $LATENTLM_STORE or ./artifacts)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name in the store")
    add_store(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--dtype", choices=sorted(ops.DTYPES), default="float32")


def add_backend(p: argparse.ArgumentParser) -> None:
    """The scoring engine's options: `--backend`, `--storage-dtype`."""
    p.add_argument("--backend", choices=ops.BACKENDS, default="torch",
                   help="onnx: score through onnxruntime (hmm, blocked_hmm, rank_hmm; graph cached in the store)")
    p.add_argument("--storage-dtype", choices=ops.STORAGE_DTYPES, default="float32",
                   help="precision of the scoring path: float32 (exact, the default); bfloat16 (opt-in: the "
                        "transition matrix in bfloat16, half the bytes read per step, within 0.02 nats per token; "
                        "blocked_hmm on CPU, where it replaces the float32 matrix for every operation, and rank_hmm "
                        "and blocked_hmm on CUDA); tfloat32 (CUDA: TF32 tensor cores). "
                        "The service's LATENTLM_STORAGE_DTYPE")


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def emit_json(rows: list[dict]) -> None:
    """One JSON object per line on stdout, written by `ops.dumps` (non-finite numbers as null)."""
    out = sys.stdout
    for r in rows:
        out.write(ops.dumps(r).decode() + "\n")
    out.flush()


def load(args: argparse.Namespace) -> ops.LoadedModel:
    device = ops.resolve_device(getattr(args, "device", "cpu"))
    return ops.load_model(args.store, args.model, device=device, dtype=args.dtype, calibrate=calibration_on(None),
                          backend=getattr(args, "backend", "torch"), storage_dtype=getattr(args, "storage_dtype", None))
