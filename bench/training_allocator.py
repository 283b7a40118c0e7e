"""What `training.common.reuse_freed_memory` buys a VL-HMM training step: wall, user and kernel time and
page faults per step with glibc's default malloc settings and with freed memory kept for reuse, in
alternating child processes (the setting is process-wide).

    python bench/training_allocator.py [--states 4096,8192] [--steps 6] [--rounds 3]
                                       [--out bench/results/training_allocator.md]

The step is `bench/training_throughput.py`'s blocked_hmm step with the 2-hour recipe's shapes: 128 clusters,
hidden 256, independent state embeddings, state dropout 0.5, 64 streams x 32 tokens, AdamW; random words
and clusters. Results are appended to --out with the machine, date and command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, sys.argv[4])
from training_throughput import blocked_step
from latentlm.models.base import Batch
from latentlm.training import common
Z, steps, reuse = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "reuse"
if reuse:
    assert common.reuse_freed_memory()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
torch.manual_seed(0)
batch = Batch(torch.randint(0, 10_000, (64, 32), generator=g), torch.full((64,), 32))
step = blocked_step(batch, Z, 128, 256, 0.5, "independent", g)[0]
step(); step()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(steps):
    step()
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
print(json.dumps({"wall_ms": 1e3 * (t1 - t0) / steps, "user_ms": 1e3 * (r1.ru_utime - r0.ru_utime) / steps,
                  "sys_ms": 1e3 * (r1.ru_stime - r0.ru_stime) / steps,
                  "faults": (r1.ru_minflt - r0.ru_minflt) / steps, "maxrss_mb": r1.ru_maxrss / 1024}))
"""


def measure(states: int, steps: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(states), str(steps), mode, str(Path(__file__).parent)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", default="4096,8192")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/training_allocator.md"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from training_throughput import write_section

    rows = []
    for states in (int(s) for s in args.states.split(",")):
        for r in range(args.rounds):  # alternate the two settings so that drift hits both alike
            for mode in ("default", "reuse"):
                m = measure(states, args.steps, mode)
                rows.append({"states": states, "round": r + 1, "mode": mode, **m})
                print(rows[-1], flush=True)
    lines = ["| states (kept per step) | round | malloc | ms/step (wall) | user ms/step | kernel ms/step | page faults "
             "/ step | max RSS MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['states']} ({r['states'] // 2}) | {r['round']} | {r['mode']} | {r['wall_ms']:.0f} | "
                     f"{r['user_ms']:.0f} | {r['sys_ms']:.0f} | {r['faults']:,.0f} | {r['maxrss_mb']:.0f} |")
    for states in sorted({r["states"] for r in rows}):
        wall = {m: sorted(r["wall_ms"] for r in rows if r["states"] == states and r["mode"] == m)
                for m in ("default", "reuse")}
        med = {m: v[len(v) // 2] for m, v in wall.items()}
        lines.append(f"\n{states} states: median wall {med['default']:.0f} ms (default) vs {med['reuse']:.0f} ms "
                     f"(reuse): {med['default'] / med['reuse']:.2f}x")
    write_section(args.out, "2 torch threads", lines)


if __name__ == "__main__":
    main()
