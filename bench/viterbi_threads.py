"""The compiled Viterbi (`models.kernels.maxplus.viterbi_cpu`) on one and two threads, on the random HMMs of
bench/hmm_inference.py (V = 10,000): a 64 x 50 batch (threads split the sequences) and one 10,000-token
sequence (two threads split the columns and meet every step), in tokens/s and as a share of the float32 FLOP
limit (2 Z^2 per token at the best GEMM peak measured in the same run).

    python bench/viterbi_threads.py [--sizes 256,512,1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hmm_inference import machine, matmul_peaks  # noqa: E402

from latentlm.models.kernels import maxplus  # noqa: E402
from latentlm.models.synthetic import random_hmm  # noqa: E402

V = 10_000


def best_rate(fn, tokens: int, reps: int) -> float:
    fn()
    return tokens / min(timed(fn) for _ in range(reps))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512,1024")
    args = ap.parse_args()
    torch.set_num_threads(2)
    peak = max(matmul_peaks().values())
    print(f"{machine()}; best float32 GEMM peak {peak / 1e9:.0f} GFLOP/s")
    print("| Z | workload | 1 thread tok/s | % limit | 2 threads tok/s | % limit |")
    print("|---|---|---|---|---|---|")
    for Z in (int(z) for z in args.sizes.split(",")):
        t, _ = random_hmm(Z, V, 0)
        log_trans, log_emit = t["trans"].log().float(), t["emit"].log().float().T.contiguous()
        g = torch.Generator().manual_seed(0)
        limit = peak / (2 * Z * Z)
        for name, B, T in (("batch 64 x 50", 64, 50), ("one 10,000-token sequence", 1, 10_000)):
            emit = log_emit[torch.randint(0, V, (B, T), generator=g)].contiguous()
            init = t["start"].log().float().expand(B, Z).contiguous()
            lengths = torch.full((B,), T)
            call = partial(maxplus.viterbi_cpu, init, emit, None, log_trans, lengths)
            rates = [best_rate(partial(call, th), B * T, 3 if B > 1 else 2) for th in (1, 2)]
            print(f"| {Z} | {name} | {rates[0]:,.0f} | {100 * rates[0] / limit:.0f}% | {rates[1]:,.0f} | "
                  f"{100 * rates[1] / limit:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
