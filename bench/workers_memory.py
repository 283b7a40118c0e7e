"""Memory of `latentlm serve` with 1 and N API workers on one model: is the model held once?

    python bench/workers_memory.py --store STORE --model NAME [--workers 1,2] [--out bench/results/load_memory.md]

For each worker count, a real `latentlm serve` (CPU, calibration on as by default; with more than one worker a
redis-server this script starts) is started on a store holding only the model; once every worker has loaded it
(one worker: /ready; several: each worker maps the weights snapshot whole), the script reads /proc/PID/smaps_rollup
of every serving process: RSS, PSS (shared pages divided among their sharers) and anonymous memory, and the PSS of
the weights snapshot mapping. Sums over the workers are what the machine pays. Appends a section to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving import children, cpu_name, free_port, start_redis  # bench/serving.py

HERE = Path(__file__).resolve().parent


def rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def mapping_pss(pid: int, suffix: str) -> int:
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(suffix)
        elif inside and head[0] == "Pss:":
            total += int(head[1]) * 1024
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "load_memory.md")
    args = ap.parse_args()
    from latentlm.models.store import WEIGHTS, read_manifest

    digest = read_manifest(args.store / args.model)["files"][WEIGHTS]
    size = (args.store / args.model / WEIGHTS).stat().st_size
    work = Path(tempfile.mkdtemp(prefix="latentlm-mem-"))
    store = work / "store"
    store.mkdir()
    shutil.copytree(args.store / args.model, store / args.model)  # a store of this model only (links are refused)
    rows, redis = [], None
    started = dt.datetime.now(dt.UTC)
    try:
        for n in [int(x) for x in args.workers.split(",")]:
            env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
            env.update(LATENTLM_STATE_DIR=str(work / f"state{n}"), LATENTLM_WORKERS=str(n))
            if n > 1:
                if redis is None:
                    redis, redis_url = start_redis(work)
                env["REDIS_URL"] = redis_url
            port = free_port()
            log = work / f"serve{n}.log"
            with open(log, "wb") as fh:
                proc = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store),
                                         "--port", str(port), "--device", "cpu", "--log-level", "warning"], env=env,
                                        stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                snap = f"{digest}.safetensors"
                deadline = time.time() + 900
                while True:
                    if proc.poll() is not None or time.time() > deadline:
                        sys.exit(f"serve did not come up:\n{log.read_text()}")
                    pids = children(proc.pid) if n > 1 else [proc.pid]
                    try:
                        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
                    except httpx.TransportError:
                        ready = False
                    if ready and len(pids) == n and (n == 1 or all(
                            mapping_pss(p, snap) * n >= 0.9 * size for p in pids)):
                        break
                    time.sleep(0.5)
                time.sleep(2)  # calibration and warm-up settle
                stats = [rollup(p) for p in pids]
                maps = [mapping_pss(p, snap) for p in pids] if n > 1 else [0]
                rows.append((n, sum(s["Rss"] for s in stats), sum(s["Pss"] for s in stats),
                             sum(s["Anonymous"] for s in stats), sum(maps)))
                print(rows[-1], flush=True)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(60)
    finally:
        if redis is not None:
            redis.terminate()
        shutil.rmtree(work, ignore_errors=True)
    cpu = cpu_name()
    mib = 1 << 20
    lines = [f"\n## API workers on one model ({started:%Y-%m-%d %H:%M} UTC, {cpu}, {len(os.sched_getaffinity(0))} "
             "cores)\n",
             f"Command: `python bench/workers_memory.py --store STORE --model {args.model} --workers {args.workers}`; "
             f"weights file {size / mib:,.0f} MiB. Sums over the serving processes (one worker: the one process, "
             "weights read into its memory; several: the workers, weights mapped from one snapshot).\n",
             "| workers | RSS MiB | PSS MiB | anonymous MiB | PSS of the weights mapping MiB |",
             "|---|---|---|---|---|"]
    for n, rss, pss, anon, mp in rows:
        mapped = f"{mp / mib:,.0f}" if n > 1 else "–"
        lines.append(f"| {n} | {rss / mib:,.0f} | {pss / mib:,.0f} | {anon / mib:,.0f} | {mapped} |")
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
