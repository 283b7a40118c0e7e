"""Scoring throughput on CPU: the ONNX Runtime graph (`latentlm.onnx_backend`) against the torch engine,
same process, same model, same thread count.

    python bench/onnx_vs_torch.py [--sizes 256,1024] [--threads 1] [--long 10000] [--out bench/results/onnx_vs_torch.md]

Model: random Dirichlet(1) dense `hmm`, V = 10,000, float32. Workloads as in bench/hmm_inference.py: "batch" =
64 sequences x 50 tokens, "long" = one sequence of --long tokens. Both backends start from token-id lists
(torch: `impl.score(Batch.from_lists(seqs))`, onnx: `OnnxScorer.score(seqs)`, which pads). Timings are the
median of repeated calls after a warm-up, the two backends' calls interleaved so both see the
same load from other processes; the largest relative difference of log p(x) is reported too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from latentlm.models.base import Batch
from latentlm.models.hmm import DenseHMM
from latentlm.models.onnx_graph import export_onnx
from latentlm.models.synthetic import random_hmm
from latentlm.onnx_backend import OnnxScorer

V = 10_000


def timed_pair(f: Callable[[], object], g: Callable[[], object], min_time: float = 2.0, max_reps: int = 15
               ) -> tuple[float, float]:
    """Median seconds per call of f and of g, calls interleaved (f, g, f, g, ...) after one warm-up each, so
    both see the same load from other processes on a shared machine."""
    f(), g()
    tf: list[float] = []
    tg: list[float] = []
    while len(tf) < max_reps and (sum(tf) + sum(tg) < min_time or len(tf) < 3):
        for fn, acc in ((f, tf), (g, tg)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return float(np.median(tf)), float(np.median(tg))


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def run(Z: int, threads: int, long_len: int, tmp: Path) -> list[dict]:
    torch.set_num_threads(threads)
    t, c = random_hmm(Z, V, seed=0)
    impl = DenseHMM.from_tensors(t, c)
    t0 = time.perf_counter()
    path = export_onnx(impl, tmp / f"hmm{Z}.onnx", name=f"bench-{Z}")
    export_s = time.perf_counter() - t0
    scorer = OnnxScorer(path, providers=["CPUExecutionProvider"], threads=threads)
    g = np.random.default_rng(0)
    work = {"batch 64x50": g.integers(0, V, (64, 50)).tolist(),
            f"long 1x{long_len}": [g.integers(0, V, long_len).tolist()]}
    rows = []
    for label, seqs in work.items():
        ntok = sum(len(s) for s in seqs)
        t_torch, t_onnx = timed_pair(lambda seqs=seqs: impl.score(Batch.from_lists(seqs)),
                                     lambda seqs=seqs: scorer.score(seqs))
        ref = impl.score(Batch.from_lists(seqs))[0].numpy()
        got = np.array(scorer.score(seqs)[0])
        rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
        rows.append({"Z": Z, "workload": label, "torch": ntok / t_torch, "onnx": ntok / t_onnx,
                     "ratio": t_torch / t_onnx, "rel": rel, "export_s": export_s})
        print(f"Z={Z} {label}: torch {ntok / t_torch:,.0f} tok/s, onnx {ntok / t_onnx:,.0f} tok/s, "
              f"onnx/torch {t_torch / t_onnx:.2f}x, max rel diff {rel:.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--long", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3, help="repeat everything; the table gives medians and the range")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    load_before = os.getloadavg()
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.runs):
            runs.append([r for Z in (int(s) for s in a.sizes.split(",")) for r in run(Z, a.threads, a.long, Path(d))])
    load_after = os.getloadavg()
    rows = []
    for i, r0 in enumerate(runs[0]):
        rs = [run_rows[i] for run_rows in runs]
        rows.append({**r0, **{k: float(np.median([r[k] for r in rs])) for k in ("torch", "onnx", "ratio")},
                     "lo": min(r["ratio"] for r in rs), "hi": max(r["ratio"] for r in rs),
                     "rel": max(r["rel"] for r in rs)})
    if a.out:
        nproc = os.cpu_count()
        cmd = "python " + " ".join(["bench/onnx_vs_torch.py", *sys.argv[1:]])
        lines = [
            "# Scoring on CPU: ONNX Runtime graph vs the torch engine",
            "",
            f"CPU: {cpu_model()} ({platform.machine()}); {a.threads} thread(s) for each backend; "
            f"torch {torch.__version__}, onnxruntime {ort.__version__}; date {dt.date.today().isoformat()}. "
            f"Command: `{cmd}`. {nproc} cores, shared with other jobs during the run (load average "
            f"{load_before[0]:.1f} before, {load_after[0]:.1f} after): absolute figures are depressed and noisy; "
            f"the two backends' calls are interleaved, so the ratio is the figure to read.",
            "",
            "Dense `hmm`, V = 10,000, float32, same process. Tokens/s (higher is better); "
            "ratio = onnx tokens/s / torch tokens/s (below 1: onnxruntime is slower). `rel` = largest relative "
            "difference of log p(x) between the two.",
            "",
            f"| Z | workload | torch tok/s | onnx tok/s | onnx / torch (median of {a.runs} runs) | range | rel |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(f"| {r['Z']} | {r['workload']} | {r['torch']:,.0f} | {r['onnx']:,.0f} | "
                         f"{r['ratio']:.2f}x | {r['lo']:.2f}-{r['hi']:.2f}x | {r['rel']:.1e} |")
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
