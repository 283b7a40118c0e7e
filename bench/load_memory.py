"""Host memory and time of loading the largest models: a 2^15-state blocked_hmm (128 clusters x 256 states, a
4 GiB transition matrix) and a rank-space HMM with 2^14 states and rank 4,096, in float32.

Each load runs in a fresh process (huge pages on, as the CLI and the service ask), which reports its resident
memory before the load, its peak during the load (VmHWM, reset just before through /proc/self/clear_refs), what
it keeps after it and the load's wall time (the file in the page cache after the first run). Paths:
- `latentlm`: `ops.load_model` (the weights read once, straight into their tensors, hashed as they are read;
  checks slice by slice);
- `hash, then load_file`: the former path, kept here as a baseline: SHA-256 of every file, then
  `safetensors.torch.load_file`, then whole-tensor checks (isfinite, a negative check, a float64 copy for the
  row sums).
The bf16 column is the size of the same floating-point tensors stored as bfloat16 (the fused CUDA path's
`LATENTLM_STORAGE_DTYPE=bfloat16`, which keeps its bf16 copy beside the float32 one).
For blocked_hmm two more paths load it for bfloat16 storage on the CPU (its transition matrix kept in bfloat16
only): `latentlm, bfloat16 storage` (`ops.load_model(..., storage_dtype="bfloat16")`: the matrix read straight
into bfloat16, a slab of rows at a time, its rows checked as stored) and `float32, then bfloat16` (the former
path, kept as its baseline: read in float32, then `set_storage_dtype("bfloat16")`). `latentlm, torch-slice
checks` is `latentlm` with the artifact checks made as before the reader took row statistics (every check a
torch pass over slices: isfinite, a negative test, float64 sums), the baseline of the load's time.

    python bench/load_memory.py [--store DIR] [--repeat N] [--out bench/results/load_memory.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hmm_inference import append_section, machine, run_heading  # noqa: E402

from latentlm.models.registry import save_artifact  # noqa: E402
from latentlm.models.vocab import Preprocessing, Vocabulary  # noqa: E402

V = 10_000

PROBE = r"""
import json, sys, time
from pathlib import Path
kib = lambda key: int(open('/proc/self/status').read().split(key + ':')[1].split()[0])
import latentlm
latentlm.huge_pages()
import torch
from latentlm import ops
from latentlm.models import registry, store, checks
store_dir, name, path = sys.argv[1], sys.argv[2], sys.argv[3]
base = kib('VmRSS')
open('/proc/self/clear_refs', 'w').write('5')
t0 = time.perf_counter()
if path == 'latentlm':
    m = ops.load_model(store_dir, name)
elif path == 'latentlm, torch-slice checks':
    checks.screened_stats = lambda t: None
    m = ops.load_model(store_dir, name)
elif path == 'latentlm, bfloat16 storage':
    m = ops.load_model(store_dir, name, storage_dtype='bfloat16')
    assert m.impl.trans.dtype == torch.bfloat16
elif path == 'float32, then bfloat16':
    m = ops.load_model(store_dir, name)
    m.impl.set_storage_dtype('bfloat16')
    assert m.impl.trans.dtype == torch.bfloat16
else:
    from safetensors.torch import load_file
    d = Path(store_dir) / name
    man = store.read_manifest(d)
    for f in man['files']:
        store.sha256_file(d / f)
    t = load_file(str(d / store.WEIGHTS))
    for v in t.values():
        if v.is_floating_point():
            assert bool(torch.isfinite(v).all()) and not bool((v < 0).any())
            v.double().sum(-1)
seconds = time.perf_counter() - t0
print(json.dumps({'base': base / 1024, 'peak': (kib('VmHWM') - base) / 1024, 'kept': (kib('VmRSS') - base) / 1024,
                  'seconds': seconds}))
"""


def vocab() -> Vocabulary:
    return Vocabulary([f"w{i}" for i in range(V - 2)] + ["<unk>", "<eos>"], Preprocessing())


def blocked(M: int, k: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Uniform parameters (the content does not change the memory): Z = M k states, words round-robin."""
    Z = M * k
    wc = torch.arange(V) % M
    sizes = torch.bincount(wc, minlength=M).float()
    emit = (1.0 / sizes[wc]).unsqueeze(1).expand(V, k).contiguous()
    return ({"start": torch.full((Z,), 1.0 / Z), "trans": torch.full((Z, Z), 1.0 / Z), "emit": emit,
             "word_cluster": wc}, {"num_states": Z, "num_clusters": M, "states_per_cluster": k})


def rank(m: int, r: int) -> tuple[dict[str, torch.Tensor], dict]:
    start = torch.full((m,), 1.0 / m)
    state_in, state_out = torch.full((m, r), 1.0 / r), torch.full((r, m), 1.0 / m)
    emit = torch.full((V, r), 1.0 / V)
    return ({"start": start, "state_in": state_in, "state_out": state_out, "emit": emit,
             "rank_start": start @ state_in, "rank_trans": state_out @ state_in}, {"num_states": m, "rank": r})


def probe(store: Path, name: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(store), name, path], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=None, help="where to write the two models (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every path (load times vary between runs)")
    args = ap.parse_args()
    store = args.store or Path(tempfile.mkdtemp(prefix="load-memory-"))
    models = {"blocked-2p15": ("blocked_hmm", "blocked_hmm, 2^15 states (128 x 256)", lambda: blocked(128, 256)),
              "rank-2p14-r4096": ("rank_hmm", "rank_hmm, 2^14 states, rank 4,096", lambda: rank(1 << 14, 4096))}
    lines = run_heading(machine()) + ["Command: `python " + " ".join(sys.argv) + "`", "",
             "| model | float32 tensors MiB | as bf16 MiB | path | RSS before MiB | peak added MiB | kept MiB | "
             "peak / float32 size | load s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (family, label, make) in models.items():
        tensors, config = make()
        fp32 = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
        bf16 = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors.values()) / 2**20
        if not (store / name).is_dir():
            save_artifact(store, name, family, tensors, vocab(), config=config)
        del tensors
        paths = ["latentlm", "latentlm, torch-slice checks", "hash, then load_file"]
        if family == "blocked_hmm":
            paths[2:2] = ["latentlm, bfloat16 storage", "float32, then bfloat16"]
        for path in [p for _ in range(args.repeat) for p in paths]:  # the paths in turn, `--repeat` rounds
            r = probe(store, name, path)
            lines.append(f"| {label} | {fp32:,.0f} | {bf16:,.0f} | {path} | {r['base']:,.0f} | {r['peak']:,.0f} | "
                         f"{r['kept']:,.0f} | {r['peak'] / fp32:.2f} | {r['seconds']:.1f} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out:
        append_section(args.out, "Host memory of loading the largest models", lines + [""])


if __name__ == "__main__":
    main()
