"""Data-parallel training on one machine: 2 ranks x 1 thread (`torchrun`, gloo) against 1 process x 2 threads and 1
process x 1 thread, on the same global batch and seed, as a user runs them (the `latentlm train` CLI, its defaults).

    python bench/distributed.py [--steps 40] [--repeats 2] [--em-states 256] [--out bench/results/distributed.md]
    python bench/distributed.py --device cuda --workloads vlhmm   # on a GPU: 1 rank under torchrun against 1 process

Workloads:
* `vlhmm`: the Chiu & Rush Table 3 Brown recipe (configs/chiu-rush-table3-brown-m8.yaml: 1,024 states, BPTT 16 x
  32 tokens) for `--steps` optimiser steps. Step time = (training seconds - evaluation and checkpoint seconds) /
  steps, from the manifest; the all-reduce's share = the seconds rank 0 spent in the gradient all-reduce (its wait
  for the other rank included) over that. The validation perplexity after the last step shows the float spread
  between the layouts.
* `hmm-em`: Baum-Welch (`--family hmm`) on PTB, `--em-states` states, one EM iteration (E-step over the whole
  training set, M-step, validation), seconds per iteration from the training curve.

Each (workload, layout) runs `--repeats` times, alternating layouts. Results are appended to --out with the CPU,
the date and the commands.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "chiu-rush-table3-brown-m8.yaml"
LAYOUTS = {  # name -> (ranks, threads per rank)
    "1 process x 2 threads": (1, 2),
    "2 ranks x 1 thread": (2, 1),
    "1 process x 1 thread": (1, 1),
}
GPU_LAYOUTS = {"1 process": (1, 0), "1 rank under torchrun": (-1, 0)}  # -1: torchrun with one rank


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        return f"{model}, {os.cpu_count()} cores"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def command(ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "latentlm.cli", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(abs(ranks)),
            "-m", "latentlm.cli", *args]


def shown(cmd: list[str], threads: int) -> str:
    text = " ".join("latentlm" if c == "latentlm.cli" else c for c in cmd[1:] if c != "-m")
    text = text.replace("torch.distributed.run", "torchrun")
    return f"OMP_NUM_THREADS={threads} {text}" if threads else text


def run(ranks: int, threads: int, args: list[str], store: Path) -> dict:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = command(ranks, [*args, "--store", str(store), "--no-progress"])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{shown(cmd, threads)} failed:\n{done.stderr[-3000:]}")
    (name,) = [p.name for p in store.iterdir() if not p.name.startswith(".")]
    prov = json.loads((store / name / "manifest.json").read_text())["provenance"]
    return {"prov": prov, "command": shown(cmd, threads).replace(str(store), "STORE")}


def vlhmm(ranks: int, threads: int, steps: int, store: Path, device: str = "cpu", batch: int = 0) -> dict:
    r = run(ranks, threads, ["train", "--config", str(CONFIG), "--max-steps", str(steps), "--device", device,
                             *(["--batch", str(batch)] if batch else [])], store)
    prov = r["prov"]
    rows = prov["curve"]
    stepping = prov["train_seconds"] - rows[-1].get("check_seconds", 0.0)
    return {"command": r["command"].replace(str(ROOT) + "/", ""), "step_ms": 1000 * stepping / prov["steps"],
            "allreduce_share": prov.get("allreduce_seconds", 0.0) / stepping if ranks != 1 else 0.0,
            "valid_ppl": rows[-1]["valid_ppl"], "world_size": prov.get("world_size")}


def hmm_em(ranks: int, threads: int, states: int, store: Path) -> dict:
    r = run(ranks, threads, ["train", "--family", "hmm", "--data", "ptb", "--name", "em", "--states", str(states),
                             "--epochs", "1", "--batch", "256"], store)
    rows = r["prov"]["curve"]
    return {"command": r["command"], "iteration_s": rows[1]["seconds"] - rows[0]["seconds"],
            "valid_ppl": rows[-1]["valid_ppl"], "world_size": r["prov"].get("world_size")}


def each(rows: list[dict], key: str, fmt: str) -> str:
    return ", ".join(fmt.format(r[key]) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--em-states", type=int, default=256)
    ap.add_argument("--workloads", default="vlhmm,hmm-em")
    ap.add_argument("--batch", type=int, default=0, help="vlhmm: BPTT streams a step (default: the config's 16)")
    ap.add_argument("--device", default="cpu", help="cuda: 1 rank under torchrun against 1 process on the GPU")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "distributed.md")
    a = ap.parse_args()
    layouts = LAYOUTS if a.device == "cpu" else GPU_LAYOUTS
    results: dict[tuple[str, str], list[dict]] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    try:
        for rep in range(a.repeats):
            for wl in a.workloads.split(","):
                for layout, (ranks, threads) in layouts.items():
                    store = work / f"{wl}-{ranks}x{threads}-{rep}"
                    res = (vlhmm(ranks, threads, a.steps, store, a.device, a.batch) if wl == "vlhmm"
                           else hmm_em(ranks, threads, a.em_states, store))
                    results.setdefault((wl, layout), []).append(res)
                    print(wl, layout, {k: v for k, v in res.items() if k != "command"}, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"\n## {dt.date.today()}: {cpu_name()}\n",
             f"`python bench/distributed.py --steps {a.steps} --repeats {a.repeats} --em-states {a.em_states} "
             f"--workloads {a.workloads} --device {a.device}" + (f" --batch {a.batch}" if a.batch else "")
             + f"`; torch {__import__('torch').__version__}, gloo.\n"]
    if "vlhmm" in a.workloads:
        base = statistics.median(r["step_ms"] for r in results[("vlhmm", next(iter(layouts)))])
        lines += [f"\n### VL-HMM, Chiu & Rush Table 3 Brown (1,024 states, BPTT {a.batch or 16} x 32), {a.steps} "
                  "steps\n",
                  f"| layout | step (ms), each run | median | vs {next(iter(layouts))} | all-reduce share | "
                  "valid ppl after the last step, each run |", "|---|---|---|---|---|---|"]
        for layout in layouts:
            rs = results[("vlhmm", layout)]
            med = statistics.median(r["step_ms"] for r in rs)
            share = each(rs, "allreduce_share", "{:.0%}") if "rank" in layout else "-"
            lines.append(f"| {layout} | {each(rs, 'step_ms', '{:.0f}')} | {med:.0f} | {base / med:.2f}x | {share} | "
                         f"{each(rs, 'valid_ppl', '{:.3f}')} |")
    if "hmm-em" in a.workloads:
        base = statistics.median(r["iteration_s"] for r in results[("hmm-em", "1 process x 2 threads")])
        lines += [f"\n### Baum-Welch, {a.em_states} states on PTB train, one EM iteration\n",
                  "| layout | seconds per iteration, each run | median | vs 1 x 2 threads | valid ppl, each run |",
                  "|---|---|---|---|---|"]
        for layout in LAYOUTS:
            rs = results[("hmm-em", layout)]
            med = statistics.median(r["iteration_s"] for r in rs)
            lines.append(f"| {layout} | {each(rs, 'iteration_s', '{:.1f}')} | {med:.1f} | {base / med:.2f}x | "
                         f"{each(rs, 'valid_ppl', '{:.4f}')} |")
    lines.append("\nCommands:\n")
    for (wl, layout), rs in results.items():
        lines.append(f"- {wl}, {layout}: `{rs[0]['command']}`")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a", encoding="utf-8") as f:
        if a.out.stat().st_size == 0:
            f.write("# Data-parallel training on one machine (`bench/distributed.py`)\n")
        f.write("\n".join(lines) + "\n")
    print(f"appended to {a.out}")


if __name__ == "__main__":
    main()
