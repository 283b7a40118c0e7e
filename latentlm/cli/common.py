"""What every `latentlm` subcommand shares: the error type, `--store`, model options, JSON lines out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.models.store import default_store


class CLIError(LatentLMError):
    pass


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
    return ops.load_model(args.store, args.model, device=device, dtype=args.dtype,
                          backend=getattr(args, "backend", "torch"), storage_dtype=getattr(args, "storage_dtype", None))
