"""Time latentlm's VL-HMM training step (`training.neural.blocked_loss`, backward, gradient clipping, AdamW) at the
shapes of the plain-PyTorch yardstick `gpu_vlhmm_train.py` (2^15 states in 128 clusters of 256, state dropout
keeping 128 per cluster, h = 256, V = 10,000, batches of B x 32 tokens), so that the two can be run in one call
and compared as a ratio. Differences from the yardstick, on purpose: latentlm's own parameterisation
("independent" state embeddings, `--state-embedding`), the exact expected-count gradient instead of autograd
through the forward, a carried BPTT state from the second step on, and float64 in the dynamic program.

    python bench/gpu_train_step.py [--states 32768] [--batches 16,128,512] [--steps 5] [--device cuda] [--profile]

Prints one line per batch size: ms per step (mean of `--steps` after two warm-up steps), tokens/s, peak memory;
with `--profile`, then the operators that took most of one more step's device (or CPU) time, and how many
operator calls the step made.
"""

from __future__ import annotations

import argparse
import time

import torch

from latentlm.models.base import Batch
from latentlm.training import neural


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", type=int, default=2**15)
    ap.add_argument("--clusters", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--batches", default="16,128,512")
    ap.add_argument("--bptt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--state-embedding", default="independent")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="profile one more step at the last batch size")
    a = ap.parse_args()
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    word_cluster = torch.randint(0, a.clusters, (a.vocab,), generator=g)  # stand-in Brown clusters, as the yardstick
    word_cluster[: a.clusters] = torch.arange(a.clusters)
    k = a.states // a.clusters
    model = neural.VLHMM(a.vocab, word_cluster, a.clusters, k, a.hidden, a.state_embedding).to(dev)
    opt = neural.make_optimizer(model, 0.01, blocked=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"# latentlm VL-HMM training step on {name}: {a.states} states, {a.clusters} clusters, h {a.hidden}, "
          f"{a.state_embedding} embeddings, keep {k - k // 2} of {k} per cluster", flush=True)
    for B in (int(x) for x in a.batches.split(",")):
        ids = torch.randint(0, a.vocab, (B, a.bptt), generator=g).to(dev)
        batch = Batch(ids, torch.full((B,), a.bptt, device=dev))
        dt = time_steps(model, opt, batch, k - k // 2, g, a.steps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        print(f"B={B} T={a.bptt}: {dt * 1000:.0f} ms/step, {B * a.bptt / dt / 1e3:.0f} k tokens/s, "
              f"peak {peak:.1f} GiB", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            time_steps(model, opt, batch, k - k // 2, g, 1)  # the last batch size's batch
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        calls = sum(e.count for e in events if e.key.startswith("aten::"))
        print(f"# profile of 3 steps at B={B} (two warm-ups and one timed): {calls} aten calls", flush=True)
        print(events.table(sort_by=key, row_limit=15), flush=True)


def time_steps(model: neural.VLHMM, opt: torch.optim.Optimizer, batch: Batch, keep: int, g: torch.Generator,
               steps: int) -> float:
    """Seconds per training step on `batch` (BPTT: each step carries the last one's state), after two warm-ups."""
    dev = batch.ids.device
    carry = None

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for i in range(steps + 2):
        if i == 2:
            sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        active = neural.sample_state_dropout(model.M, model.k, keep, g).to(dev)
        nll, carry = neural.blocked_loss(model, batch, active, carry, want_last=True)
        neural.backward_clipped(model, opt, nll / batch.ids.numel())
        opt.step()
    sync()
    return (time.perf_counter() - t0) / steps


if __name__ == "__main__":
    main()
