"""Throughput of one batch job on 1 and N `latentlm worker` processes sharing it through one Redis (lines/s).

    python bench/batch_workers.py [--workers 1,2] [--lines 30000] [--states 512] [--rounds 3]
                                  [--out bench/results/batch_workers.md]

A synthetic HMM (`--states` states, 2,000 words) in a temporary store and a JSONL file of `--lines` score requests
of 40 words each. For each worker count (rounds interleaved: 1, 2, 1, 2, ...), a redis-server this script starts
(one database per run, emptied), that many `latentlm worker` processes with one torch thread each
(`LATENTLM_TORCH_THREADS=1`), started and registered on the queue before the batch is submitted, so that loading the
model is not timed. Timed: from the upload (streamed from disk) to the batch's `completed`. Each run's output is
checked: every line once, in input order. On a shared machine each run also records how many cores other jobs kept
busy meanwhile (the machine's busy time from /proc/stat less this run's processes'). Appends a section to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from serving import cpu_name, start_redis  # bench/serving.py

from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.vocab import Vocabulary
from latentlm.service import jobs

HERE = Path(__file__).resolve().parent
V = 2000


def make_store(root: Path, states: int) -> Path:
    store = root / "store"
    t, c = random_hmm(states, V, seed=0)
    save_artifact(store, "bench", "hmm", t, Vocabulary([f"w{i}" for i in range(V - 2)] + ["<unk>", "<eos>"]),
                  config=c)
    return store


def make_input(path: Path, n: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(f"w{rng.randrange(V - 2)}" for _ in range(40))
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/score",
                                "body": {"model": "bench", "input": text}}) + "\n")
    return path


TICK = os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / TICK  # all but idle and iowait


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def one_run(url: str, store: Path, root: Path, path: Path, n_workers: int, n_lines: int,
            redis_pid: int) -> tuple[float, float]:
    """(seconds from the upload to the batch's completion with `n_workers` worker processes, cores other jobs
    kept busy meanwhile on average: the machine's busy time less this run's processes')."""
    from rq import Queue, Worker

    r = redis.Redis.from_url(url)
    r.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
    env.update(REDIS_URL=url, LATENTLM_TORCH_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for k in range(n_workers):
        d = root / f"w{n_workers}-{k}"
        d.mkdir(exist_ok=True)
        log = open(d / "worker.log", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "latentlm.cli", "worker", "--store", str(store),
                                       "--device", "cpu", "--log-level", "warning"],
                                      env={**env, "LATENTLM_WORKER_NAME": f"bench-{k}"}, cwd=d, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.time() + 300
        while Worker.count(connection=r, queue=Queue(jobs.QUEUE_NAME, connection=r)) < n_workers:
            assert time.time() < deadline and all(p.poll() is None for p in procs), "workers did not start"
            time.sleep(0.1)
        s = jobs.RedisJobStore(url)
        pids = [p.pid for p in procs] + [redis_pid]
        ours0, busy0 = sum(cpu_s(p) for p in pids) + sum(os.times()[:2]), busy_s()
        t0 = time.perf_counter()
        with path.open("rb") as f:
            fid = jobs.create_file(s, f, path.name, "batch")["id"]
        b = jobs.create_batch(s, fid, "/v1/score")
        jobs.RQRunner(s, url).submit(b["id"])
        while (cur := s.get_batch(b["id"]))["status"] not in jobs.TERMINAL:
            time.sleep(0.02)
        took = time.perf_counter() - t0
        others = (busy_s() - busy0 - (sum(cpu_s(p) for p in pids) + sum(os.times()[:2]) - ours0)) / took
        assert cur["status"] == "completed", cur
        ids = [json.loads(ln)["custom_id"] for ln in b"".join(s.iter_file(cur["output_file_id"])).splitlines()]
        assert ids == [f"r{i}" for i in range(n_lines)], "output not every line once in order"
        return took, max(0.0, others)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--lines", type=int, default=30000)
    ap.add_argument("--states", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "batch_workers.md")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="batch-workers-"))
    redis_proc, url = start_redis(root)
    load0 = os.getloadavg()
    try:
        store = make_store(root, args.states)
        path = make_input(root / "in.jsonl", args.lines)
        times: dict[int, list[float]] = {n: [] for n in counts}
        others: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                t, o = one_run(url, store, root, path, n, args.lines, redis_proc.pid)
                times[n].append(t)
                others[n].append(o)
                print(f"{n} workers: {args.lines / t:.0f} lines/s ({t:.2f} s; other jobs {o:.2f} cores)", flush=True)
    finally:
        redis_proc.terminate()
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()
    base = statistics.median(times[counts[0]])
    rows = []
    for n in counts:
        med = statistics.median(times[n])
        per_round = " / ".join(f"{args.lines / t:.0f}" for t in times[n])
        busy = " / ".join(f"{o:.2f}" for o in others[n])
        rows.append(f"| {n} | {per_round} | {args.lines / med:.0f} | {base / med:.2f}x | {busy} |")
    cmd = " ".join(["python", "bench/batch_workers.py", *sys.argv[1:]])
    section = "\n".join([
        f"## {dt.date.today()}: {args.lines} score lines (40 words), HMM K={args.states}, V={V}, chunks of 32",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, shared with other jobs (load average {load0[0]:.2f} before, "
        f"{load1[0]:.2f} after). Command: `{cmd}`",
        "",
        "| workers (1 torch thread each) | lines/s per round | median lines/s | vs 1 worker | cores other jobs used, "
        "per round |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
    with args.out.open("a") as f:
        if args.out.stat().st_size == 0:
            f.write("# One batch job on 1 and N `latentlm worker` processes (bench/batch_workers.py)\n\n"
                    "Timed from the upload to `completed`; workers started and registered first. Every run's "
                    "output checked: each line once, in input order.\n\n")
        f.write(section + "\n")
    print(section)


if __name__ == "__main__":
    main()
