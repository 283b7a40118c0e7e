"""A VL-HMM training step's emission table, forward and backward: the compiled passes
(`neural.ClusterLogSoftmax`, `kernels.cluster_emit`), one GEMM per cluster written in place
(`neural.ClusterGemmLogSoftmax`) and the PyTorch loop (a GEMM and a log-softmax per cluster, then a cat:
`neural.cluster_log_softmax_reference`), in one process, interleaved. What decides
`neural.CLUSTER_EMIT_MAX_K`, the number of states per cluster up to which the compiled passes run (above it
the in-place GEMMs run).

    python bench/cluster_emit.py [--clusters 128] [--ks 4,8,16,32,64,128] [--rounds 3] [--out FILE]

V = 10,000 words (PTB's vocabulary) in M clusters of skewed sizes (Brown clusters are: size of rank i
proportional to 1 / i^0.8), h = 256, float32, with the word bias (the "independent" state embeddings of the
configs); k is the number of states per cluster a step builds (after state dropout). Results are appended to
--out (default bench/results/cluster_emit.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, interleaved, machine, run_heading, shown  # noqa: E402

from latentlm.training.neural import (  # noqa: E402
    ClusterGemmLogSoftmax,
    ClusterLogSoftmax,
    cluster_log_softmax_reference,
)

V, H = 10_000, 256


def cluster_sizes(M: int) -> list[int]:
    weight = 1.0 / np.arange(1, M + 1) ** 0.8
    sizes = np.maximum(1, np.floor(weight / weight.sum() * V)).astype(int)
    sizes[0] += V - sizes.sum()
    return sizes.tolist()


def step_fn(fn, words, states, bias, upstream):
    def run() -> None:
        out = fn(words, states, bias)
        torch.autograd.backward(out, upstream)
        words.grad = states.grad = bias.grad = None
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", type=int, default=128)
    ap.add_argument("--ks", default="4,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cluster_emit.md")
    args = ap.parse_args()
    info = machine()
    M = args.clusters
    sizes = cluster_sizes(M)
    offsets = torch.tensor([0, *np.cumsum(sizes).tolist()])
    g = torch.Generator().manual_seed(0)
    lines = []
    for k in (int(x) for x in args.ks.split(",")):
        words = torch.randn(V, H, generator=g).requires_grad_()
        states = torch.randn(M, k, H, generator=g).requires_grad_()
        bias = torch.randn(V, generator=g).requires_grad_()
        upstream = torch.randn(V, k, generator=g)
        paths = {"compiled": step_fn(lambda w, s, b: ClusterLogSoftmax.apply(w, s, b, offsets),
                                     words, states, bias, upstream),
                 "gemm in place": step_fn(lambda w, s, b: ClusterGemmLogSoftmax.apply(w, s, b, sizes),
                                          words, states, bias, upstream),
                 "torch loop": step_fn(lambda w, s, b: cluster_log_softmax_reference(w, s, b, sizes),
                                       words, states, bias, upstream)}
        sec = interleaved(paths, args.rounds, 0.5, 30)
        fast, gemm, slow = (sec[p] * 1e3 for p in ("compiled", "gemm in place", "torch loop"))
        gflop = 6 * V * k * H / 1e9  # forward 2 V k h, backward 4 V k h
        shown(lines, f"| {M} | {k} | {fast:.2f} | {gemm:.2f} | {slow:.2f} | {slow / fast:.2f}x | {slow / gemm:.2f}x | "
                     + " | ".join(f"{gflop / ms * 1e3:.0f}" for ms in (fast, gemm, slow)) + " |")
    text = [*run_heading(info),
            f"Command: `python bench/cluster_emit.py --clusters {M} --ks {args.ks} --rounds {args.rounds}`. "
            f"Milliseconds per forward + backward, median of {args.rounds} interleaved rounds (alternating which "
            "path goes first).", "",
            "| clusters M | states per cluster k | compiled ms | gemm in place ms | torch loop ms | loop / compiled "
            "| loop / gemm | compiled GFLOP/s | gemm GFLOP/s | loop GFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|---|", *lines, ""]
    append_section(args.out, "A VL-HMM's per-cluster emission log-softmax, forward + backward "
                   "(`bench/cluster_emit.py`)", text)


if __name__ == "__main__":
    main()
