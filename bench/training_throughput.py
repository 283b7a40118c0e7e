"""Training-step throughput of the neural HMM trainers on CPU, against the matmul peak and the previous
training path, measured in one process.

    python bench/training_throughput.py [--threads 2] [--steps 8] [--configs t3-brown,t3-none,...]
                                        [--out bench/results/training_throughput.md]

One optimisation step = parameter construction (forward), the loss (blocked_hmm: exact forward-backward
expected counts, `neural.BlockedNLL`; rank_hmm: autograd through the rank-space forward), the backward pass
and AdamW. FLOPs counted are the GEMMs of parameter construction, forward and backward (3x the forward
GEMMs): transition logits Z'^2 h, emission logits V k' h (blocked; V Z h unconstrained; V r h rank), state
MLPs; the DP itself is O(B T k'^2) and not counted. The peak is the float32 GEMM rate at the transition
logits' shape measured in the same run, on the same GEMM library (`--gemm`: each config runs once under each
of torch's BLAS and oneDNN, `latentlm.models.kernels.gemm`). The baseline ("autograd DP") is the previous
blocked_hmm loss: every word's logits against every active state, then autograd through the scaled forward
with per-step gathered blocks. Word clusters are random (sizes balanced), tokens random: the cost does not depend on
the data. Results are appended to --out with the machine, date and command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import latentlm

latentlm.huge_pages()  # as `latentlm train` does, before torch loads (THP_MEM_ALLOC_ENABLE=0 to compare without)
latentlm.tune_openmp_for_training()
latentlm.flush_denormals_for_training()  # and before torch starts its threads

import numpy as np  # noqa: E402
import torch  # noqa: E402

from latentlm.models import chain  # noqa: E402
from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.kernels import gemm  # noqa: E402
from latentlm.training import common, neural  # noqa: E402

V = 10_000
CONFIGS = {
    # name: (family, states, clusters or rank, hidden, batch, bptt, state dropout, state embedding)
    "t3-brown": ("blocked_hmm", 1024, 8, 256, 16, 32, 0.0, "independent"),
    "t3-none": ("blocked_hmm", 1024, 1, 256, 16, 32, 0.0, "independent"),
    "m128-k8": ("blocked_hmm", 1024, 128, 256, 16, 32, 0.5, "factored"),
    "vl-4k": ("blocked_hmm", 4096, 128, 256, 64, 35, 0.5, "factored"),
    "vl-16k": ("blocked_hmm", 16384, 128, 256, 64, 35, 0.5, "factored"),
    # the 2-hour recipes' model (configs/cpu-2h-vlhmm-*.yaml): independent state embeddings, BPTT 32
    "ind-4k": ("blocked_hmm", 4096, 128, 256, 64, 32, 0.5, "independent"),
    "ind-8k": ("blocked_hmm", 8192, 128, 256, 64, 32, 0.5, "independent"),
    "ind-16k": ("blocked_hmm", 16384, 128, 256, 64, 32, 0.5, "independent"),
    # the 2-hour tied recipe's step (configs/cpu-2h-vlhmm-16k-tied.yaml): 512 streams x BPTT 32
    "tied-16k": ("blocked_hmm", 16384, 128, 256, 512, 32, 0.5, "tied"),
    # the same at 2^15 states (the 2-hour recipe grown one split further: configs/cpu-2h-vlhmm-32k-tied.yaml)
    "tied-32k": ("blocked_hmm", 32768, 128, 256, 512, 32, 0.5, "tied"),
    "rank-1k": ("rank_hmm", 1024, 256, 128, 64, 35, 0.0, ""),
    "rank-4k": ("rank_hmm", 4096, 1024, 256, 64, 35, 0.0, ""),
}


def timed_alternating(fns: list, steps: int) -> list[float]:
    """Median seconds per call of each of `fns`, called in turn `steps` times after two warm-up rounds (so a
    drift of the machine falls on all of them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(steps + 2):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                out.append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def timed(fn, steps: int) -> float:
    """Median seconds per call after two warm-up calls."""
    return timed_alternating([fn], steps)[0]


def gemm_peak(m: int, k: int, n: int) -> float:
    """The float32 GEMM rate (FLOP/s) of an (m, k) x (k, n) product on the current `kernels.gemm` backend."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    return 2 * m * k * n / timed(lambda: gemm.nt(a, b), 10)


def old_blocked_loss(model: neural.VLHMM, batch: Batch, active: torch.Tensor) -> torch.Tensor:
    """The previous path: emission logits of every word against every active state (V x Z'), then autograd
    through `chain.forward_autograd` with (B, k', k') blocks gathered per step."""
    M, k = model.M, model.k
    kk = active.shape[1]
    states = (torch.arange(M)[:, None] * k + active).reshape(-1)
    start, trans = model.start_and_trans_logits(states)
    log_trans = torch.log_softmax(trans, dim=-1)
    log_start = torch.log_softmax(start, dim=0)
    word_emb = model.word_emb_by_slot[model.word_slot]
    logits = word_emb @ model.emission_reprs(states).T
    if model.word_bias_by_slot is not None:
        logits = logits + model.word_bias_by_slot[model.word_slot][:, None]
    logits = logits.view(V, M, kk)
    wl = logits[torch.arange(V), model.word_cluster]
    top = wl.max().detach()
    lse = torch.zeros(M, kk).index_add_(0, model.word_cluster, (wl - top).exp()).log() + top
    log_emit = wl - lse[model.word_cluster]
    clusters = model.word_cluster[batch.ids]
    blocks = log_trans.exp().view(M, kk, M, kk)
    init = log_start.exp().view(M, kk)[clusters[:, 0]]
    log_cond, _ = chain.forward_autograd(init, log_emit.exp()[batch.ids],
                                         lambda t: blocks[clusters[:, t - 1], :, clusters[:, t], :], batch.lengths)
    return -log_cond.sum()


def flops(family: str, Z: int, c: int, h: int, keep: float, emb: str) -> float:
    """GEMM flops of one step (forward + backward = 3x forward) for the config."""
    if family == "rank_hmm":
        r = c
        fwd = 2 * (2 * Z * r * h + V * r * h + 3 * r * h * h) + 2 * r * Z * r  # U, V, emission, h2, V U^T
        return 3.0 * fwd
    Zp = int(Z * keep)
    kk = Zp // c
    # ResBlocks (2 linears each) built per step: factored 3 compose + 3 role MLPs; independent the "out" and
    # "emit" roles (a BPTT step whose rows all carry a state builds no start distribution: `blocked_loss`)
    mlp_layers = 6 if emb == "factored" else 2
    fwd = 2 * (Zp * Zp * h + V * kk * h + mlp_layers * 2 * Zp * h * h)
    return 3.0 * fwd


def blocked_step(batch: Batch, Z: int, c: int, h: int, drop: float, emb: str, g: torch.Generator
                 ) -> tuple[Callable[..., None], neural.VLHMM, int]:
    """One blocked_hmm optimisation step on `batch` (BPTT: the carry goes on), as the trainer runs it: a
    VL-HMM over V words in c random balanced clusters, state dropout `drop`, AdamW (fused). Returns (step,
    model, states kept per cluster); `step(trans_logits=False)` normalises the transitions by a log-softmax
    before the loss (`neural.blocked_loss`: the path before the fusion)."""
    B, T = batch.ids.shape
    wc = torch.arange(V) % c
    model = neural.VLHMM(V, wc[torch.randperm(V, generator=g)], c, Z // c, h, emb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    k = Z // c
    keep = k - round(k * drop)
    carry = [None]

    def step(trans_logits: bool = True) -> None:
        active = neural.sample_state_dropout(c, k, keep, g)
        nll, carry[0] = neural.blocked_loss(model, batch, active, carry[0], want_last=True,
                                            trans_logits=trans_logits)
        opt.zero_grad()
        (nll / (B * T)).backward()
        neural.fill_missing_grads(model)  # as the trainer: parameters a step did not use get zeros
        opt.step()

    return step, model, keep


def run_config(name: str, steps: int, baseline: bool, batch_size: int = 0, unfused: bool = False) -> dict:
    """One config's row; `batch_size` > 0 replaces the config's batch (streams x BPTT length for BPTT);
    `unfused`: blocked_hmm steps alternate with steps whose transitions a log-softmax normalises before the loss
    (the path before the fusion; `unfused_ms`)."""
    family, Z, c, h, B, T, drop, emb = CONFIGS[name]
    B = batch_size or B
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, V, (B, T), generator=g), torch.full((B,), T))
    row: dict = {"config": name, "family": family, "states": Z, "hidden": h, "tokens/step": B * T}
    if family == "rank_hmm":
        model = neural.RankNeural(V, Z, c, h, 0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def step():
            loss = neural.rank_loss(model, batch) / (B * T)
            opt.zero_grad()
            loss.backward()
            opt.step()

        row.update(rank=c, clusters="", keep=Z)
        keep_frac = 1.0
    else:
        step, model, keep = blocked_step(batch, Z, c, h, drop, emb, g)
        k = Z // c
        keep_frac = keep / k
        row.update(rank="", clusters=c, keep=c * keep)
    if unfused and family == "blocked_hmm":
        sec, before = timed_alternating([step, lambda: step(trans_logits=False)], steps)
        row.update(unfused_ms=before * 1e3, fused_speedup=before / sec)
    else:
        sec = timed(step, steps)
    fl = flops(family, Z, c, h, keep_frac, emb)
    Zp = int(Z * keep_frac)
    peak = gemm_peak(Zp, h, Zp) if family != "rank_hmm" else gemm_peak(Z, h, c)
    row.update(step_ms=sec * 1e3, tok_s=B * T / sec, gflop=fl / 1e9, gflops=fl / sec / 1e9, peak=peak / 1e9,
               pct=100 * fl / sec / peak, epoch_min=929_589 / (B * T) * sec / 60)
    if baseline and family == "blocked_hmm" and Zp <= 4096:
        opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
        k = Z // c
        keep = k - round(k * drop)

        def old_step():
            active = neural.sample_state_dropout(c, k, keep, g)
            loss = old_blocked_loss(model, batch, active) / (B * T)
            opt2.zero_grad()
            loss.backward()
            opt2.step()

        old = timed(old_step, max(3, steps // 2))
        row.update(old_ms=old * 1e3, speedup=old / sec)
    return row


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
        flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
        ext = [f for f in ("avx512f", "avx2", "fma") if f" {f}" in flags]
        return f"{model} ({', '.join(ext)})"
    except OSError:
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--configs", default="t3-brown,t3-none,m128-k8,vl-4k,rank-1k")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--batches", default="",
                    help="comma-separated batch sizes: run every config once per size instead of at its own batch "
                         "(how the step cost grows with the tokens per step)")
    ap.add_argument("--unfused-baseline", action="store_true",
                    help="blocked_hmm: alternate the step with one whose transitions a log-softmax normalises before "
                         "the loss (the path before `BlockedNLL` normalised them itself) and report both")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's malloc settings (by default the bench keeps freed memory in the heap, as "
                         "`latentlm train` does: `training.common.reuse_freed_memory`)")
    ap.add_argument("--gemm", default=",".join(gemm.BACKENDS),
                    help="comma-separated GEMM libraries (`kernels.gemm`): run every config once under each, in "
                         "turn (default: every one this process has)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/training_throughput.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reuse = False if args.default_malloc else common.reuse_freed_memory()
    rows = []
    sizes = [int(b) for b in args.batches.split(",") if b] or [0]
    backends = [b for b in args.gemm.split(",") if b]
    for name, size in ((n, b) for n in args.configs.split(",") for b in sizes):
        for i, lib in enumerate(backends):
            with gemm.using(lib):
                row = run_config(name, args.steps, not args.no_baseline and i == 0, size, args.unfused_baseline)
            row["gemm"] = lib
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else []
    lines = ["| config | GEMM | family | states (kept per step) | clusters / rank | hidden | tokens/step | ms/step | "
             "tokens/s | GFLOP/step | GFLOP/s | GEMM peak GFLOP/s | % of peak | min/epoch (PTB) | previous path "
             "ms/step | speed-up |" + (" log-softmax path ms/step | fused speed-up |" if args.unfused_baseline else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.unfused_baseline
                                                                                    else "")]
    for r in rows:
        lines.append(f"| {r['config']} | {r['gemm']} | {r['family']} | {r['states']} ({r['keep']}) | "
                     f"{r['clusters'] or r['rank']} "
                     f"| {r['hidden']} | {r['tokens/step']} | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | "
                     f"{r['gflop']:.2f} | {r['gflops']:.1f} | {r['peak']:.1f} | {r['pct']:.0f}% | "
                     f"{r['epoch_min']:.1f} | {_or_dash(r.get('old_ms'), '{:.1f}')} | "
                     f"{_or_dash(r.get('speedup'), '{:.2f}x')} |"
                     + (f" {_or_dash(r.get('unfused_ms'), '{:.1f}')} | {_or_dash(r.get('fused_speedup'), '{:.3f}x')} |"
                        if args.unfused_baseline else ""))
    write_section(args.out, f"{args.threads} torch threads, torch {torch.__version__}, "
                  f"{'freed memory kept in the heap (as the trainer)' if reuse else 'glibc malloc defaults'}, "
                  f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'libgomp default')}, "
                  f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, "
                  f"load average before the run {' '.join(load)}", lines)


def _or_dash(value: float | None, fmt: str) -> str:
    """`value` formatted, or "–" where the run has none (no baseline run: `--no-baseline`, or a family without
    a previous path)."""
    return "–" if value is None or math.isnan(value) else fmt.format(value)


def write_section(out: Path, setting: str, lines: list[str]) -> None:
    """Append one run's section to `out` (heading: date, CPU and `setting`; the command; `lines`) and print it."""
    lines = [f"\n## {dt.date.today().isoformat()}: {cpu_name()}, {setting}\n",
             f"Command: `python {' '.join(sys.argv)}`\n", *lines]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
