"""GPU scoring throughput of the rank-space HMM (r = 4096, batch 1024) and the blocked HMM (2^15 states,
k = 256, batch 1024) through latentlm's model classes, next to ../shared/bench/gpu_yardstick.py's plain
PyTorch loops on the same shapes, in the same process (report the ratio, not the raw figure).

    python bench/gpu_chain.py [--yardstick ../shared/bench/gpu_yardstick.py] [--out bench/results/gpu_chain.md]
    python bench/gpu_chain.py --small      # tiny shapes, any device: checks that the script runs

One short run (a few minutes with model construction); models are built on the device from random
distributions (softmax of Gaussians, as the yardstick does), so nothing large moves between host and device.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import inspect
import json
import time
from pathlib import Path

import torch

from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.rank_hmm import RankHMM

ROOT = Path(__file__).resolve().parents[1]
FULL = {"rank": dict(r=4096, V=10000, B=1024, T=64, m=16384), "blocked": dict(M=128, k=256, V=10000, B=1024, T=64)}
SMALL = {"rank": dict(r=256, V=1000, B=8, T=8, m=512), "blocked": dict(M=8, k=32, V=1000, B=8, T=8)}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def best_of(fn, dev: torch.device, reps: int = 3) -> float:
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def stochastic(*shape: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, device=dev, generator=g), dim=-1)


def rank_model(r: int, V: int, m: int, dev: torch.device, g: torch.Generator) -> RankHMM:
    """A rank_hmm with m states and rank r: start (m,), state_in (m, r), state_out (r, m), emit (V, r)."""
    start, state_in = stochastic(m, dev=dev, g=g), stochastic(m, r, dev=dev, g=g)
    state_out = stochastic(r, m, dev=dev, g=g)
    emit = stochastic(r, V, dev=dev, g=g).T.contiguous()
    return RankHMM({"start": start, "state_in": state_in, "state_out": state_out, "emit": emit,
                    "rank_start": start @ state_in, "rank_trans": state_out @ state_in})


def blocked_model(M: int, k: int, V: int, dev: torch.device, g: torch.Generator) -> BlockedHMM:
    """A blocked_hmm with M clusters of k states: words assigned round-robin to clusters."""
    Z = M * k
    word_cluster = torch.arange(V, device=dev) % M
    emit = torch.empty(V, k, device=dev)
    raw = torch.rand(V, k, device=dev, generator=g)
    for c in range(M):
        idx = (word_cluster == c).nonzero().squeeze(1)
        emit[idx] = raw[idx] / raw[idx].sum(0, keepdim=True)
    return BlockedHMM(stochastic(Z, dev=dev, g=g), stochastic(Z, Z, dev=dev, g=g), emit, word_cluster, M, {})


def ours(case: str, shape: dict, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    model = rank_model(shape["r"], shape["V"], shape["m"], dev, g) if case == "rank" else \
        blocked_model(shape["M"], shape["k"], shape["V"], dev, g)
    B, T = shape["B"], shape["T"]
    batch = Batch(torch.randint(0, shape["V"], (B, T), device=dev, generator=g), torch.full((B,), T, device=dev))
    with torch.no_grad():
        t = best_of(lambda: model.score(batch), dev)
    return {"tokens_per_s": B * T / t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yardstick", type=Path, default=ROOT.parent / "shared" / "bench" / "gpu_yardstick.py")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on any device)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_chain.md")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = importlib.util.spec_from_file_location("gpu_yardstick", args.yardstick)
    yard = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(yard)  # type: ignore[union-attr]
    shapes = SMALL if args.small or dev.type != "cuda" else FULL
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    rows = []
    for case in ("rank", "blocked"):
        shape = shapes[case]
        accepted = inspect.signature(yard.CASES[case]).parameters
        yard_kw = {k: v for k, v in shape.items() if k in accepted}
        yard_out = yard.CASES[case](**yard_kw)
        mine = ours(case, shape, dev)
        rows.append({"case": case, "shape": shape, "latentlm": mine["tokens_per_s"],
                     "yardstick": yard_out["tokens_per_s"], "ratio": mine["tokens_per_s"] / yard_out["tokens_per_s"]})
        print(json.dumps(rows[-1]), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    lines = [f"# GPU scoring throughput vs the yardstick ({name})", "",
             f"date {dt.date.today().isoformat()}, torch {torch.__version__}; generated by `python bench/gpu_chain.py"
             f"{' --small' if shapes is SMALL else ''}`; yardstick: `gpu_yardstick.py` (plain PyTorch scaled forward, "
             "same shapes, same process).", "",
             "| model | shape | latentlm tokens/s | yardstick tokens/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['shape']} | {r['latentlm']:,.0f} | {r['yardstick']:,.0f} | {r['ratio']:.2f}x |"
              for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
