"""Interleaved A/B of the blocked HMM's compiled Viterbi (`models.kernels.blocked.viterbi_cpu`): the working
tree's kernel against the same file at an earlier git revision, in one process (`viterbi_ab.load_revision`).

Written for the move from log space (the revision before 42c3444: max of log delta + log trans, over a log
matrix made once per model, Z^2 x 4 bytes, and log emissions) to probabilities (max of delta x trans over the
matrix itself, rescaled every step, times the emission probabilities): the baseline gets `trans.log()` and the
log emissions, the working tree `trans` and `emit`. Random VL-HMMs (V =
10,000, M clusters x k states) or a stored blocked_hmm (`--store DIR --model NAME`); two batches, 64 x 50 random
ids and 256 PTB-like sentences of 5-45 random ids; 1 and 2 threads. Huge pages for torch's allocator, as the
service and the CLI ask for them (`latentlm.huge_pages`): without them a matrix read from disk in chunks lies
on scattered 4 KiB pages and its blocks cost ~1.6x more to read than a fresh copy's, which would charge the
baseline's fresh log matrix less than the loaded one. Reports the best of alternating calls in
tokens/s, and whether both give the same paths (ties and float32 rounding of the log matrix may flip a
near-tie: the count of differing positions is shown).

    python bench/blocked_viterbi_ab.py --baseline 8109884 [--shapes 128x32,128x64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import latentlm

latentlm.huge_pages()  # as `latentlm serve` does, before torch loads (THP_MEM_ALLOC_ENABLE=0 to compare without)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import append_section, machine, run_heading  # noqa: E402
from viterbi_ab import load_revision  # noqa: E402

from latentlm import ops  # noqa: E402
from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.kernels import blocked  # noqa: E402
from latentlm.models.synthetic import random_blocked_hmm  # noqa: E402

V = 10_000


def best_of_alternating(calls: list, rounds: int) -> list[float]:
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision of models/kernels/blocked.py to compare against")
    ap.add_argument("--shapes", default="128x32,128x64", help="clusters x states per cluster, comma-separated")
    ap.add_argument("--store", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench/results/blocked_viterbi_ab.md")
    args = ap.parse_args()
    old = load_revision(args.baseline, "models/kernels/blocked.py")
    models = ({args.model: lambda: ops.load_model(args.store, args.model).impl} if args.store else
              {s: partial(lambda s: BlockedHMM.from_tensors(*random_blocked_hmm(*map(int, s.split("x")), V)), s)
               for s in args.shapes.split(",")})
    lines = run_heading(machine())
    lines += [f"Command: `python {' '.join(sys.argv)}`; A = {args.baseline} (log space), B = working tree "
              "(probabilities); tokens/s, best of alternating calls; THP_MEM_ALLOC_ENABLE="
              f"{os.environ.get('THP_MEM_ALLOC_ENABLE')}", "",
              "| model | batch | threads | A | B | B / A | positions that differ |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    for name, build in models.items():
        m = build()
        log_trans = m.trans.float().log()
        lengths = torch.randint(5, 46, (256,), generator=g).tolist()
        batches = {"64 x 50": Batch(torch.randint(V, (64, 50), generator=g), torch.full((64,), 50)),
                   "256 x 5-45": Batch.from_lists([torch.randint(V, (n,), generator=g).tolist() for n in lengths])}
        for bname, b in batches.items():
            log_init, log_emit, _ = m.log_chain(b)
            init, table, rows = m._decode_emissions(b)
            tail = (m._clusters(b), b.lengths)
            for threads in (1, 2):
                calls = [partial(old.viterbi_cpu, log_init, log_emit.table, b.ids, *tail, log_trans, threads),
                         partial(blocked.viterbi_cpu, init, table, rows, *tail, m.trans, threads)]
                (pa, _), (pb, _) = calls[0](), calls[1]()
                ta, tb = best_of_alternating(calls, args.rounds)
                ntok = int(b.lengths.sum())
                row = (f"| {name} | {bname} | {threads} | {ntok / ta:,.0f} | {ntok / tb:,.0f} | {ta / tb:.2f}x | "
                       f"{int((pa != pb).sum())} of {ntok} |")
                print(row, flush=True)
                lines.append(row)
        del m, log_trans
    append_section(Path(args.out), "Blocked Viterbi, log space against probabilities (bench/blocked_viterbi_ab.py)",
                   lines + [""])


if __name__ == "__main__":
    main()
