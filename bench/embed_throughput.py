"""Throughput of `embed`: LDS steady-state smoother (O(T h^2)) vs, in the same process, the dense-HMM posterior
(forward-backward, O(T Z^2)) with Z = h and its posterior-weighted state-vector embedding. CPU, float32,
one thread. Writes bench/embed_results.md.

    python bench/embed_throughput.py [--out bench/embed_results.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.hmm import DenseHMM  # noqa: E402
from latentlm.models.lds import LDS  # noqa: E402
from latentlm.models.synthetic import random_hmm  # noqa: E402
from latentlm.training.lds import random_lds_tensors  # noqa: E402


def random_lds(V: int, h: int, seed: int = 0) -> LDS:
    t = random_lds_tensors(V, h, seed, emission_scale=0.05)
    return LDS.from_tensors({k: torch.from_numpy(v) for k, v in t.items()}, {"dim": h})


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(h: int, V: int, seqs: list[list[int]], g: torch.Generator) -> list[tuple[int, str, float, float]]:
    """(h, operation, tokens/s, speed ratio vs the HMM posterior) rows for one latent size."""
    lds = random_lds(V, h)
    t, cfg = random_hmm(h, V, seed=0)
    t["state_vectors"] = torch.randn(h, h, generator=g, dtype=torch.float64)
    hmm = DenseHMM.from_tensors(t, cfg)
    batch = Batch.from_lists(seqs)
    with torch.no_grad():
        res = {"LDS embed (smoothed)": best_of(lambda: lds.embed(batch)),
               "LDS embed (causal)": best_of(lambda: lds.embed(batch, causal=True)),
               "LDS op_embed (JSON lists)": best_of(lambda: lds.op_embed(seqs), 3),
               f"HMM posterior Z={h} (baseline)": best_of(lambda: hmm.posterior(batch)),
               f"HMM op_embed Z={h}": best_of(lambda: hmm.op_embed(seqs), 3)}
    base = res[f"HMM posterior Z={h} (baseline)"]
    n = len(seqs) * len(seqs[0])
    return [(h, name, n / sec, base / sec) for name, sec in res.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/embed_results.md")
    a = ap.parse_args()
    torch.set_num_threads(1)
    V, B, T = 10_000, 256, 35
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, V, (B, T), generator=g).tolist()
    rows = []
    for h in (50, 100):
        rows += measure(h, V, seqs, g)
    lines = ["# embed throughput", "",
             f"Machine: 2-core CPU sandbox ({platform.machine()}), one torch thread, float32, {dt.date.today()}; "
             f"`bench/embed_throughput.py`. Batch of {B} random sequences x {T} tokens, V = {V}. Ratio = speed "
             "relative to the dense-HMM forward-backward posterior with Z = h run in the same process (shared "
             "machine: ~30% run-to-run noise).", "",
             "| h | operation | tokens/s | ratio vs HMM posterior |", "|---|---|---|---|"]
    lines += [f"| {h} | {n} | {tps:,.0f} | {r:.2f} |" for h, n, tps, r in rows]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
