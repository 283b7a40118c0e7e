"""The service against the model in process, on the three workloads of one-sentence and many-sentence scoring:

    python bench/service_workloads.py --store STORE [--model ptb-hmm] [--workers 1,2] [--engine inline,process]
                                      [--device cpu] [--duration 15] [--out bench/results/service_wrk.md]
    (or: bash bench/service_wrk.sh --workloads ...)

For each worker count and engine (`LATENTLM_ENGINE`: inline, each worker runs the models; process, one engine
process runs them for every worker), a real `latentlm serve` with its default settings otherwise (on `--device`;
with more than one worker a redis-server this script starts, as the service requires) is driven by `wrk` (an
outside C load generator) with
64 different 50-token inputs (token ids drawn from the model's vocabulary, seed 1):
- one sentence per request, 1 connection (c=1);
- one sentence per request, 64 connections (c=64);
- 64 sentences per request, 4 connections (c=4).
The response cache is off (`LATENTLM_CACHE_TTL_S=0`): the inputs repeat, and every answer is computed.
In the same run, the same inputs scored in process (`ops.run`, the model loaded as the service loads it,
calibrated, torch's default threads): one sentence per call (B=1) and all 64 in one call (B=64), the fastest of
`--repeats` passes, measured before the first server and after each one (the model stays loaded in the
benchmark's process); each server's rows are compared with the best of the measurements just before and just
after it, since this VM's speed drifts (2x within an hour). The ratio service / in process is the share of the
model's speed a user gets over HTTP.
Appends a section to `--out` with the machine, date, command and every figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serving import cpu_name, free_port, run_wrk, start_redis, wrk_script  # bench/serving.py

HERE = Path(__file__).resolve().parent
SENTENCES, LENGTH = 64, 50


def inputs(vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(1)
    return [[rng.randrange(vocab_size) for _ in range(LENGTH)] for _ in range(SENTENCES)]


def bodies(model: str, seqs: list[list[int]], per_request: int) -> list[str]:
    """Request bodies for wrk: one sentence each, or all of them in one."""
    if per_request == 1:
        return [json.dumps({"model": model, "input": [s]}) for s in seqs]
    return [json.dumps({"model": model, "input": seqs})]


def in_process(m: Any, seqs: list[list[int]], repeats: int) -> dict:
    """tok/s of `ops.run` on the loaded model `m`: one sentence per call (B1) and all in one call (B64), the
    fastest of `repeats` passes."""
    from latentlm import ops

    ops.run(m, "score", seqs)  # warm-up
    best1 = best64 = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s in seqs:
            ops.run(m, "score", [s])  # each answer is Python floats: the device has finished
        best1 = min(best1, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ops.run(m, "score", seqs)
        best64 = min(best64, time.perf_counter() - t0)
    tokens = SENTENCES * LENGTH
    return {"B1": tokens / best1, "B64": tokens / best64}


WORKLOADS = (("c1", "one sentence per request, c=1", "one", 1, LENGTH),
             ("c64", "one sentence per request, c=64", "one", 64, LENGTH),
             ("many", "64 sentences per request, c=4", "many", 4, LENGTH * SENTENCES))


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:KEY=VALUE,KEY=VALUE' -> (NAME, {KEY: VALUE}); only LATENTLM_ settings."""
    name, sep, pairs = text.partition(":")
    env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
    if not sep or not name or not env or any(not k.startswith("LATENTLM_") for k in env):
        sys.exit(f"--variant {text!r}: expected NAME:LATENTLM_KEY=VALUE[,LATENTLM_KEY=VALUE]")
    return name, env


def wait_ready(url: str, proc: subprocess.Popen, log: Path, workers: int) -> None:
    """Until `workers` fresh connections in a row find /ready 200 (each worker answers for itself)."""
    deadline, streak = time.time() + 900, 0
    while streak < 4 * workers:
        if proc.poll() is not None:
            sys.exit(f"serve exited:\n{log.read_text()}")
        if time.time() > deadline:
            sys.exit(f"serve not ready:\n{log.read_text()}")
        try:
            with httpx.Client(timeout=5) as c:
                streak = streak + 1 if c.get(f"{url}/ready").status_code == 200 else 0
        except httpx.TransportError:
            streak = 0
        if streak == 0:
            time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--model", default="ptb-hmm")
    ap.add_argument("--workers", default="1", help="comma-separated worker counts, one server each")
    ap.add_argument("--engine", default="inline", help="comma-separated LATENTLM_ENGINE values (inline, process)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--duration", type=int, default=15, help="seconds of each wrk run (after a 3 s warm-up)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="a server with these settings beside the defaults (e.g. "
                         "'gil5:LATENTLM_GIL_SWITCH_INTERVAL_MS=5'); repeatable; every variant runs after the "
                         "defaults for each worker count and engine")
    ap.add_argument("--workloads", default="c1,c64,many",
                    help="comma-separated subset of c1 (one sentence, c=1), c64 (one sentence, c=64), many "
                         "(64 sentences, c=4)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "service_wrk.md")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install -y wrk)")
    from latentlm.models.store import read_manifest

    vocab_size = read_manifest(args.store / args.model)["vocab_size"]
    seqs = inputs(vocab_size)
    work = Path(tempfile.mkdtemp(prefix="latentlm-wrk-"))
    redis = None
    rows, started = [], dt.datetime.now(dt.UTC)
    load = os.getloadavg()[0]
    try:
        from latentlm import ops

        # the VM's speed drifts by 2x within an hour: each server's rows are compared with the in-process speed
        # measured just before and just after it (the best of both); the model stays loaded in this process
        m = ops.load_model(args.store, args.model, calibrate=True, device=args.device)
        local = in_process(m, seqs, args.repeats)
        passes = [local]
        scripts = {}
        for name, per in (("one", 1), ("many", SENTENCES)):
            scripts[name] = work / f"{name}.lua"
            wrk_script(bodies(args.model, seqs, per), scripts[name])
        variants = [("", {})] + [parse_variant(v) for v in args.variant]
        for n, engine, (vname, venv) in [(int(x), e, v) for x in args.workers.split(",")
                                         for e in args.engine.split(",") for v in variants]:
            env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
            # no response cache: the inputs repeat, and every answer is to be computed
            env.update(LATENTLM_STATE_DIR=str(work / f"state{n}{engine}"), LATENTLM_WORKERS=str(n),
                       LATENTLM_CACHE_TTL_S="0", LATENTLM_ENGINE=engine, **venv)
            if n > 1:
                if redis is None:
                    redis, redis_url = start_redis(work)
                env["REDIS_URL"] = redis_url
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = work / f"serve{n}{engine}{vname}.log"
            with open(log, "wb") as fh:
                proc = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(args.store),
                                         "--port", str(port), "--device", args.device], env=env, stdout=fh,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_ready(url, proc, log, n)
                for key, label, script, conns, tokens_per in WORKLOADS:
                    if key not in args.workloads.split(","):
                        continue
                    run_wrk(f"{url}/v1/score", scripts[script], conns, 3)  # warm-up
                    r = run_wrk(f"{url}/v1/score", scripts[script], conns, args.duration)
                    who = f"{n} ({engine}{', ' + vname if vname else ''})"
                    rows.append([who, label, r, r["rps"] * tokens_per, local])
                    print(who, label, r, flush=True)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(60)
            after = in_process(m, seqs, args.repeats)
            passes.append(after)
            both = {k: max(local[k], after[k]) for k in local}
            for row in rows:
                if row[4] is local:
                    row[4] = both
            local = after
    finally:
        if redis is not None:
            redis.terminate()
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    lines = [f"\n## Three workloads, service against in process ({started:%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
             f"{len(os.sched_getaffinity(0))} cores)\n",
             f"Command: `python bench/service_workloads.py --store STORE --model {args.model} --workers "
             f"{args.workers} --engine {args.engine} --device {args.device} --duration {args.duration}"
             + "".join(f" --variant '{v}'" for v in args.variant)
             + (f" --workloads {args.workloads}" if args.workloads != "c1,c64,many" else "") + "` (code "
             f"{commit}); load average at the start {load:.2f}.",
             "In process (`ops.run`, calibrated, same inputs, the model loaded once in the benchmark's process): "
             "each server's rows are compared with the best of the passes just before and just after it; the "
             "passes, in order: B=1 " + " / ".join(f"{p['B1']:,.0f}" for p in passes) + " tok/s, B=64 "
             + " / ".join(f"{p['B64']:,.0f}" for p in passes) + " tok/s.\n",
             "| workers (engine) | workload | requests/s | tokens/s | p99 ms | non-2xx | in process tok/s "
             "| service / in process |",
             "|---|---|---|---|---|---|---|---|"]
    for n, label, r, tps, base_of in rows:
        base = base_of["B1"] if "c=1" in label else base_of["B64"]
        lines.append(f"| {n} | {label} | {r['rps']:,.0f} | {tps:,.0f} | {r['p99']:.2f} | {r['errors']} | "
                     f"{base:,.0f} (B={'1' if 'c=1' in label else '64'}) | {tps / base:.2f} |")
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
