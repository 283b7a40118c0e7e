"""Carry a training checkpoint between machines in files of at most --max-mb each (the GPU machine brings
back only small files): `pack` splits `<store>/.train/<name>/` (tensors.safetensors + state.json) into
shards, `unpack` reassembles it, after which `latentlm train --config ... --name NAME --resume --export-only`
writes the artifact (or `--resume` alone continues training).

    python bench/gpu_params.py pack STORE NAME OUT_DIR [--max-mb 15] [--best-only [--dtype float16]]
    python bench/gpu_params.py unpack OUT_DIR STORE NAME

--best-only keeps only the best parameters (what `--export-only` exports; no optimizer state, so `--resume`
cannot continue training from it), optionally stored in float16 (half the size; unpack restores float32).

Tensors larger than a shard are cut along their first dimension into parts `key@part:i`; `unpack` checks
every shard's SHA-256 against the index (`checkpoint-index.json`) and concatenates the parts in order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def pack(store: Path, name: str, out: Path, max_mb: float, best_only: bool = False,
         dtype: str | None = None, max_total_mb: float = 0.0) -> list[Path]:
    src = store / ".train" / name
    tensors = load_file(str(src / "tensors.safetensors"))
    if best_only:
        tensors = {k: v for k, v in tensors.items() if k.startswith("best.")}
    if dtype:
        tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_total_mb and total > max_total_mb * 2**20:
        raise SystemExit(f"gpu_params.py pack: {total / 2**20:.0f} MiB of parameters is more than --max-total-mb "
                         f"{max_total_mb:g} (what a GPU machine can bring back); rebuild from the recipe instead")
    limit = int(max_mb * 2**20)
    pieces: list[tuple[str, torch.Tensor]] = []
    for key, t in tensors.items():
        t = t.contiguous()
        if t.numel() * t.element_size() <= limit or t.ndim == 0:
            pieces.append((key, t))
            continue
        rows = max(1, limit // max(1, t[0].numel() * t.element_size()))
        for i, part in enumerate(t.split(rows)):
            pieces.append((f"{key}@part:{i}", part.clone()))
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for key, t in pieces:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    if current:
        shards.append(current)
    index = {"name": name, "shards": []}
    paths = []
    for i, shard in enumerate(shards):
        path = out / f"checkpoint-{i:03d}.safetensors"
        save_file(shard, str(path))
        index["shards"].append({"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
        paths.append(path)
    shutil.copy(src / "state.json", out / "checkpoint-state.json")
    (out / "checkpoint-index.json").write_text(json.dumps(index, indent=1))
    return paths


def unpack(src: Path, store: Path, name: str) -> Path:
    index = json.loads((src / "checkpoint-index.json").read_text())
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for entry in index["shards"]:
        path = src / entry["file"]
        if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{path}: SHA-256 does not match checkpoint-index.json")
        for key, t in load_file(str(path)).items():
            if "@part:" in key:
                base, i = key.split("@part:")
                parts.setdefault(base, []).append((int(i), t))
            else:
                tensors[key] = t
    for base, chunks in parts.items():
        tensors[base] = torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])])
    tensors = {k: v.float() if v.dtype in (torch.float16, torch.bfloat16) else v for k, v in tensors.items()}
    if not any(k.startswith("model.") for k in tensors):  # packed --best-only: the model is its best parameters
        tensors.update({"model." + k[5:]: v.clone() for k, v in tensors.items() if k.startswith("best.")})
    dst = store / ".train" / name
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "tensors.safetensors"))
    shutil.copy(src / "checkpoint-state.json", dst / "state.json")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("store", type=Path)
    p.add_argument("name")
    p.add_argument("out", type=Path)
    p.add_argument("--max-mb", type=float, default=15.0)
    p.add_argument("--max-total-mb", type=float, default=0.0, help="refuse (exit 1) above this total (0: no limit)")
    p.add_argument("--best-only", action="store_true", help="only the best parameters (enough to export)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], help="store floating tensors in this type")
    u = sub.add_parser("unpack")
    u.add_argument("src", type=Path)
    u.add_argument("store", type=Path)
    u.add_argument("name")
    args = ap.parse_args()
    if args.cmd == "pack":
        paths = pack(args.store, args.name, args.out, args.max_mb, args.best_only, args.dtype, args.max_total_mb)
        print(f"{len(paths)} shards in {args.out}")
    else:
        print(f"checkpoint restored to {unpack(args.src, args.store, args.name)}")


if __name__ == "__main__":
    main()
