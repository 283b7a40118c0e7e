"""Interleaved A/B of the compiled Viterbi kernel: the working tree's `models/kernels/maxplus.py` against the
same file at an earlier git revision, in one process.

The machine this project is measured on (a 2-core cloud VM) changes speed by up to 1.8x within an hour, so two
separate runs cannot compare kernels. Here both versions are compiled in the same process (the old one loaded
from `git show REV:models/kernels/maxplus.py` as a module of its own, with the rest of the package as it is
now), and each pair of calls alternates, A then B, on the same inputs: the bench's random HMMs (Dirichlet(1)
rows, V = 10,000), a 64 x 50 batch and one 10,000-token sequence, on 1 and 2 threads. Reports the best of the
alternating calls for each and checks that both versions return the same paths.

    python bench/viterbi_ab.py --baseline c6a3761 --sizes 256,1024
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from latentlm.models.kernels import maxplus
from latentlm.models.synthetic import random_hmm

ROOT = Path(__file__).resolve().parents[1]
V = 10_000


def load_revision(rev: str, source: str = "models/kernels/maxplus.py"):
    """`source` at git revision `rev`, imported as a separate module (the rest of the package as it is now)."""
    src = subprocess.run(["git", "show", f"{rev}:{source}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{Path(source).stem}_{rev[:12]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision of the kernel to compare against (A)")
    ap.add_argument("--sizes", default="256,1024", help="comma-separated state counts")
    args = ap.parse_args()
    old = load_revision(args.baseline)
    torch.set_num_threads(2)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"A = {args.baseline}, B = working tree; {cpu}; tokens/s, best of alternating calls")
    print("| Z | workload | threads | A | B | B / A | same paths |")
    print("|---|---|---|---|---|---|---|")
    for Z in [int(z) for z in args.sizes.split(",")]:
        t, _ = random_hmm(Z, V, 0)
        log_trans, table = t["trans"].log().float(), t["emit"].log().float().T.contiguous()
        g = torch.Generator().manual_seed(0)
        for name, B, T in (("batch 64 x 50", 64, 50), ("one 10,000-token sequence", 1, 10_000)):
            ids = torch.randint(0, V, (B, T), generator=g)
            init = t["start"].log().float().expand(B, Z).contiguous()
            lengths = torch.full((B,), T)
            for threads in (1, 2):
                calls = [partial(m.viterbi_cpu, init, table, ids, log_trans, lengths, threads) for m in (old, maxplus)]
                (pa, _), (pb, _) = calls[0](), calls[1]()
                times: list[list[float]] = [[], []]
                for _ in range(7 if B > 1 else 3):
                    for k in (0, 1):
                        times[k].append(timed(calls[k]))
                ra, rb = (B * T / min(ts) for ts in times)
                print(f"| {Z} | {name} | {threads} | {ra:,.0f} | {rb:,.0f} | {rb / ra:.2f}x | {torch.equal(pa, pb)} |",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
