"""The DenseHMM paper's synthetic experiment (Sicking et al. §5, "Synthetic sequences", App. C).

For each n in {3, 5, 10} a ground-truth HMM H_syn with m = n symbols: rows of A and B ~ Dir(0.1), pi the
stationary distribution of A. For each (n, l) and each of `--runs` experiments, 10 training and 10 test
sequences of length 200 are re-drawn from H_syn and four models are fitted:
  dense_em      DenseHMM, EM with a gradient M-step (§3.1)
  dense_direct  DenseHMM, co-occurrence fit (§3.2), start = stationary distribution
  stand         standard HMM with n states, Baum-Welch
  stand_fair    standard HMM with n_fair states, n_fair^2 + n_fair (m - 1) - 1 = l (3n + m + 1), rounded
Measures (median and 25/75 percentiles over the runs):
  MAD   1/m^2 sum |Omega_model - Omega_gt|, Omega_gt from eq. 3 (analytic), Omega_model estimated from
        sequences sampled from the trained model, as long and as many as the test set (App. C);
        `MAD_an` uses the model's analytic Omega (eq. 3 with its stationary distribution) instead
  NLL   -sum_i log p(o_i^test) / (number of test sequences x longest test sequence) (App. C)
The l values per n are those of the paper's Table 1 (its Fig. 4 does not list them).

    OMP_NUM_THREADS=1 python bench/densehmm_synthetic.py [--runs 5] [--sizes 3 5 10] [--out runs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

from latentlm.models.base import Batch
from latentlm.training import baum_welch as bw
from latentlm.training import densehmm as dh

SIZES = {3: [1, 2, 3, 5], 5: [1, 3, 5, 10], 10: [1, 5, 10, 15]}
MODELS = ("dense_em", "dense_direct", "stand", "stand_fair")


def ground_truth(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H_syn: A (n, n), B (n, n) with Dir(0.1) rows, pi stationary. O(n^3)."""
    A = torch.as_tensor(rng.dirichlet([0.1] * n, size=n)).clamp_min(1e-12)
    B = torch.as_tensor(rng.dirichlet([0.1] * n, size=n)).clamp_min(1e-12)
    A, B = A / A.sum(1, keepdim=True), B / B.sum(1, keepdim=True)
    return A, B, dh.stationary(A).clamp_min(0)


def sample(p: bw.HMMParams, count: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    """`count` sequences of `length` symbols from an HMM, vectorised over sequences. O(count length (n + m))."""
    start, trans, emit = (t.double().numpy() for t in (p.start, p.trans, p.emit))
    ct, ce = np.cumsum(trans, 1), np.cumsum(emit, 1)

    def draw(cum: np.ndarray) -> np.ndarray:
        return np.minimum((rng.random((cum.shape[0], 1)) > cum).sum(1), cum.shape[1] - 1)

    s = draw(np.tile(np.cumsum(start / start.sum()), (count, 1)))
    out = np.empty((count, length), dtype=np.int64)
    for t in range(length):
        out[:, t] = draw(ce[s])
        s = draw(ct[s])
    return out.tolist()


def empirical_dense(seqs: list[list[int]], m: int) -> torch.Tensor:
    return dh.empirical_cooc(seqs, m, dtype=torch.float64).to_dense()


def nll(p: bw.HMMParams, batch: Batch) -> float:
    """Normalised NLL: -sum log p(o_i) / (sequences x longest sequence)."""
    with torch.no_grad():
        return -float(p.score(batch).sum()) / (batch.ids.shape[0] * int(batch.lengths.max()))


def fit_dense_em(train: Batch, n: int, m: int, l: int, seed: int, iters: int, lr: float) -> bw.HMMParams:
    model = dh.DenseParams(n, m, l, torch.Generator().manual_seed(seed), dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(iters):
        dh.gradient_m_step(model, bw.e_step(model.probs(), [train]), opt, steps=dh.M_STEPS)
    return model.probs()


def fit_dense_direct(train_seqs: list[list[int]], n: int, m: int, l: int, seed: int, steps: int,
                     lr: float) -> bw.HMMParams:
    model = dh.DenseParams(n, m, l, torch.Generator().manual_seed(seed), dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    omega = dh.empirical_cooc(train_seqs, m, dtype=torch.float64)
    sq = float((omega.values() ** 2).sum())
    for _ in range(steps):
        dh.cooc_step(model, opt, omega, sq)
    return model.probs("stationary")


def fit_standard(train: Batch, n: int, m: int, seed: int, iters: int, uni: torch.Tensor) -> bw.HMMParams:
    p = bw.init_params(n, uni, torch.Generator().manual_seed(seed), dtype=torch.float64)
    return bw.baum_welch(p, [train], iters)[0]


def n_fair(n: int, m: int, l: int) -> int:
    """Positive root of x^2 + x (m - 1) - 1 = l (3n + m + 1), rounded (at least 1)."""
    c = l * (3 * n + m + 1) + 1
    return max(1, round((-(m - 1) + math.sqrt((m - 1) ** 2 + 4 * c)) / 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="experiments per (n, l); the paper uses 10")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--em-iters", type=int, default=40, help="EM iterations (dense_em, stand, stand_fair)")
    ap.add_argument("--direct-steps", type=int, default=1000, help="Adam steps of the co-occurrence fit")
    ap.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (both DenseHMM fits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append every run as one JSON line here, as it finishes")
    ap.add_argument("--table", nargs="*", default=None, help="print the markdown tables of these --out files")
    args = ap.parse_args()
    if args.table is not None:
        print_tables([json.loads(x) for path in args.table for x in open(path) if x.strip()])
        return
    torch.set_num_threads(1)
    rows, t0 = [], time.perf_counter()
    for n in args.sizes:
        m = n
        rng = np.random.default_rng([args.seed, n])
        A, B, pi = ground_truth(n, rng)
        gt = bw.HMMParams(pi, A, B)
        omega_gt = dh.model_cooc(A, B)
        for l in SIZES[n]:
            nf = n_fair(n, m, l)
            for r in range(args.runs):
                train_seqs, test_seqs = sample(gt, 10, 200, rng), sample(gt, 10, 200, rng)
                train, test = Batch.from_lists(train_seqs), Batch.from_lists(test_seqs)
                uni = bw.unigram(train_seqs, m)
                seed = 1000 * n + 100 * l + r
                fitted = {
                    "dense_em": fit_dense_em(train, n, m, l, seed, args.em_iters, args.lr),
                    "dense_direct": fit_dense_direct(train_seqs, n, m, l, seed, args.direct_steps, args.lr),
                    "stand": fit_standard(train, n, m, seed, args.em_iters, uni),
                    "stand_fair": fit_standard(train, nf, m, seed, args.em_iters, uni),
                }
                row = {"n": n, "l": l, "run": r, "n_fair": nf, "true_nll": nll(gt, test)}
                for name, p in fitted.items():
                    sampled = empirical_dense(sample(p, 10, 200, rng), m)
                    row[f"{name}_mad"] = float((sampled - omega_gt).abs().mean())
                    row[f"{name}_mad_an"] = float((dh.model_cooc(p.trans, p.emit) - omega_gt).abs().mean())
                    row[f"{name}_nll"] = nll(p, test)
                rows.append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            print(summary_line(n, l, nf, [x for x in rows if x["n"] == n and x["l"] == l]), flush=True)
    print(f"# {len(rows)} runs in {time.perf_counter() - t0:.0f} s")


def q(xs: list[float]) -> str:
    """median (25/75 percentile)."""
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    qs = statistics.quantiles(xs, n=4, method="inclusive")
    return f"{statistics.median(xs):.4f} ({qs[0]:.4f}/{qs[2]:.4f})"


def summary_line(n: int, l: int, nf: int, rows: list[dict]) -> str:
    """One markdown row per (n, l): MAD (sampled), MAD (analytic) and normalised NLL of each model."""
    cells = [f"{n}", f"{l}", f"{nf}", q([r["true_nll"] for r in rows])]
    for key in ("mad", "mad_an", "nll"):
        cells += [q([r[f"{mdl}_{key}"] for r in rows]) for mdl in MODELS]
    return "| " + " | ".join(cells) + " |"


def print_tables(rows: list[dict]) -> None:
    """Summary per (n, l) (median (25/75 percentile)) and one line per run."""
    head = ["n", "l", "n_fair", "NLL of H_syn"] + [f"{k} {mdl}" for k in ("MAD", "MAD_an", "NLL") for mdl in MODELS]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n, l in sorted({(r["n"], r["l"]) for r in rows}):
        sel = [r for r in rows if (r["n"], r["l"]) == (n, l)]
        print(summary_line(n, l, sel[0]["n_fair"], sel))
    print()
    head = ["n", "l", "run", "NLL H_syn"] + [f"{k} {mdl}" for k in ("MAD", "NLL") for mdl in MODELS]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in sorted(rows, key=lambda r: (r["n"], r["l"], r["run"])):
        cells = [r["n"], r["l"], r["run"], f"{r['true_nll']:.4f}"]
        cells += [f"{r[f'{mdl}_mad']:.4f}" for mdl in MODELS] + [f"{r[f'{mdl}_nll']:.4f}" for mdl in MODELS]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
