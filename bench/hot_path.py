"""Where the service's time per small request goes: `latentlm serve` on the default model under wrk (one 50-token
sentence per POST /v1/score, 64 different inputs, c=1 and c=64), the CPU each request costs the event loop (main
thread) and the other threads (batcher, engines) read from /proc, a py-spy profile of the event loop grouped by
layer, and the in-process `ops.run` time of the same work. Appends a section to bench/results/hot_path.md.

    .venv/bin/python bench/hot_path.py                         # profile this checkout
    .venv/bin/python bench/hot_path.py --before COMMIT         # also A/B: the files of the hot path (HOT_FILES) as
                                                               # at COMMIT vs as now, both servers up at once, wrk
                                                               # runs alternated (ratios from the same run);
                                                               # --before is repeatable, --asgi adds the app alone
                                                               # in process, --variants settings outside HOT_FILES

Needs `wrk` (Debian) and py-spy (`pip install py-spy`, bench/requirements-peers.txt); Linux (/proc). The model:
--store (default $LATENTLM_STORE) --model (default ptb-hmm). Each code state is served from a copy of the
packages (latentlm, models, service, training) put first on PYTHONPATH, so the two states run side by side.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from serving import cpu_name, run_wrk, wrk_script  # bench/serving.py

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"latentlm": "latentlm", "models": "latentlm/models", "service": "latentlm/service",
            "training": "latentlm/training"}  # folder on disk -> where it sits in the import tree
HOT_FILES = ["service/middleware.py", "service/routes/operations.py", "service/batcher.py", "service/errors.py",
             "service/transport.py", "service/server.py", "latentlm/ops/format.py", "latentlm/ops/batching.py",
             "latentlm/ops/inputs.py", "latentlm/ops/spec.py", "latentlm/ops/requests.py"]

# event-loop frames -> layer: for each py-spy stack the innermost frame matching a rule names its layer (a frame's
# own time goes to the layer of the code it runs in; what it calls into is counted where it lands)
LAYERS = [
    ("socket send (kernel write; preemption by the woken client included)", ("CoalescingTransport.write",
                                                                            "CoalescingTransport.flush")),
    ("access log / logging", ("logging/", "uvicorn/logging.py", "service/redact.py")),
    ("metrics (prometheus)", ("prometheus_client/", "Metrics.observe_request", "Metrics.error")),
    ("JSON encoding (ops.format)", ("ops/format.py", "orjson")),
    ("pydantic validation", ("model_validate_json", "parse_json", "ops/requests.py", "pydantic/")),
    ("input encoding, options, limits, cost (ops.spec.prepare)", ("ops/inputs.py", "models/vocab.py", "ops/spec.py",
                                                                  "ops/cost.py", "service/execute.py",
                                                                  "ops/constrain.py", "copy.py")),
    ("batcher hand-off (queue, notify, futures)", ("service/batcher.py", "threading.py", "asyncio/futures.py")),
    ("operation route glue (service/routes/operations.py)", ("service/routes/operations.py",)),
    ("middleware Guard", ("service/middleware.py",)),
    ("FastAPI/Starlette middleware stack, routing, Response", ("fastapi/", "starlette/", "uvicorn/middleware/")),
    ("uvicorn/httptools: parsing, ASGI cycle, response write", ("uvicorn/protocols/", "service/server.py",
                                                                "service/transport.py")),
    ("event loop (uvloop, C: polling, callbacks)", ("Runner.run",)),
]


def snapshot(dest: Path, overrides: dict[str, bytes]) -> Path:
    """A copy of the packages under `dest/site` (as they are installed: `latentlm.service` from `service/`, ...),
    with `overrides` (repo path -> content) written over it; returns the PYTHONPATH entry."""
    site = dest / "site"
    for folder, where in PACKAGES.items():
        shutil.copytree(ROOT / folder, site / where, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                        dirs_exist_ok=True)
    for rel, data in overrides.items():
        folder, _, rest = rel.partition("/")
        (site / PACKAGES[folder] / rest).write_bytes(data)
    return site


def at_commit(commit: str, files: list[str]) -> dict[str, bytes]:
    """The content of `files` at `commit` (those that differ from the working tree)."""
    out = {}
    for rel in files:
        old = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=ROOT, capture_output=True).stdout
        if old and old != (ROOT / rel).read_bytes():
            out[rel] = old
    return out


class Server:
    """`latentlm serve` (its defaults, CPU, no Redis) from the packages at `site`, on `port`."""

    def __init__(self, site: Path, store: Path, port: int, log: Path, env: dict | None = None,
                 args: tuple[str, ...] = ()):
        env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH_FIRST"), str(site)) if p)
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port",
                                      str(port), "--device", "cpu", *args], env=env, cwd=site,
                                     stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self) -> None:
        port, log = self.port, self.log
        for _ in range(3000):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: see {log}")
            time.sleep(0.2)
        raise SystemExit(f"server never ready: see {log}")

    def thread_cpu(self) -> dict[int, float]:
        """CPU seconds (user + system) of each thread of the server."""
        out, tick = {}, os.sysconf("SC_CLK_TCK")
        for t in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(t.name)] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(server: Server, script: Path, conns: int, seconds: float) -> dict:
    """One wrk run with the server's CPU per request: event loop (main thread) and every other thread."""
    before = server.thread_cpu()
    out = run_wrk(f"http://127.0.0.1:{server.port}/v1/score", script, conns, seconds)
    after = server.thread_cpu()
    main = server.proc.pid
    loop = after.get(main, 0) - before.get(main, 0)
    rest = sum(v - before.get(t, 0) for t, v in after.items() if t != main)
    n = max(1, out["requests"])
    return {**out, "loop_ms": 1e3 * loop / n, "other_ms": 1e3 * rest / n}


def profile(server: Server, script: Path, conns: int, seconds: float, raw: Path) -> dict:
    """py-spy samples of the event loop while wrk runs: {layer: share}, and the top frames."""
    wrk = subprocess.Popen(["wrk", "-t1", f"-c{conns}", f"-d{int(seconds) + 2}s", "-s", str(script),
                            f"http://127.0.0.1:{server.port}/v1/score"], stdout=subprocess.DEVNULL)
    time.sleep(1)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    subprocess.run([pyspy, "record", "-p", str(server.proc.pid), "-d", str(int(seconds)), "-r", "250", "--threads",
                    "--format", "raw", "-o", str(raw)], capture_output=True, timeout=seconds + 60)
    wrk.wait()
    layers: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if f"({server.proc.pid})" not in frames[0]:
            continue  # the event loop (main thread) only
        total += int(n)
        leaves[re.sub(r":\d+\)", ")", frames[-1])] += int(n)
        layers[layer_of(frames)] += int(n)
    return {"samples": total, "layers": {k: v / max(1, total) for k, v in layers.most_common()},
            "leaves": [(k, v / max(1, total)) for k, v in leaves.most_common(15)]}


def layer_of(frames: list[str]) -> str:
    for f in reversed(frames[1:]):
        for name, keys in LAYERS:
            if any(k in f for k in keys):
                return name
    return "other"


def asgi_cpu(site: Path, env: dict, store: Path, model: str, conns: int, seconds: float) -> dict:
    """bench/hot_path_asgi.py for the packages at `site`: the app's event-loop CPU per request without uvicorn,
    sockets or the access log (engines not calibrated: the event loop's cost does not depend on them)."""
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "LATENTLM_CALIBRATE": "0", **env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH_FIRST"), str(site)) if p)
    out = subprocess.run([sys.executable, str(ROOT / "bench/hot_path_asgi.py"), "--store", str(store), "--model",
                          model, "--conc", str(conns), "--seconds", str(seconds)], env=env, cwd=site,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def in_process(store: Path, model_name: str, seqs: list[list[int]], seconds: float = 3.0) -> dict:
    """`ops.run(model, "score", ...)` on the same inputs, the model loaded (and calibrated) as the service does:
    one sentence per call and 64 per call, µs per sentence and tokens/s."""
    from latentlm import ops

    model = ops.load_model(store, model_name, calibrate=True)
    out = {}
    for batch in (1, 64):
        groups = [seqs[i:i + batch] for i in range(0, len(seqs), batch)]
        for g in groups:
            ops.run(model, "score", g)  # warm
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for g in groups:
                ops.run(model, "score", g)
                n += len(g)
        dt = time.perf_counter() - start
        out[batch] = {"us_per_sentence": 1e6 * dt / n, "tok_s": n * len(seqs[0]) / dt}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, default=Path(os.environ.get("LATENTLM_STORE", "artifacts")))
    p.add_argument("--model", default="ptb-hmm")
    p.add_argument("--before", action="append", help="commit whose HOT_FILES are a baseline of an A/B run "
                   "(repeatable: each one is a state)")
    p.add_argument("--rounds", type=int, default=3, help="A/B: alternations of the two states")
    p.add_argument("--seconds", type=float, default=8.0, help="each wrk run")
    p.add_argument("--port", type=int, default=8941)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/hot_path.md")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--asgi", action="store_true", help="also the app alone in process (bench/hot_path_asgi.py) for "
                   "each state not told apart by serve flags, alternated the same way")
    p.add_argument("--variants", action="store_true", help="also serve this checkout with the access log off, a "
                   "10x GC threshold and Python's default GIL switch interval (ratios against it)")
    args = p.parse_args()

    rng = random.Random(1)
    seqs = [[rng.randrange(10000) for _ in range(50)] for _ in range(64)]
    bodies = [json.dumps({"model": args.model, "input": [s]}, separators=(",", ":")).encode() for s in seqs]
    work = Path(tempfile.mkdtemp(prefix="hot_path_"))
    script = work / "post.lua"
    wrk_script(bodies, script)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    now = snapshot(work / "now", {})
    arms: dict[str, tuple[Path, dict, tuple[str, ...]]] = {"now": (now, {}, ())}  # name -> (site, env, serve args)
    for i, commit in enumerate(reversed(args.before or [])):
        old = at_commit(commit, HOT_FILES)
        arms = {f"at {commit[:9]}": (snapshot(work / f"before{i}", old), {}, ()), **arms}
        print(f"{commit} differs in:", ", ".join(old) or "nothing", flush=True)
    if args.variants:  # settings outside the hot-path files, measured against "now" in the same run
        gc_dir = work / "gc"
        gc_dir.mkdir()
        (gc_dir / "sitecustomize.py").write_text("import gc\ngc.set_threshold(7000, 10, 10)\n")
        arms["now, access log off (--log-level warning)"] = (now, {}, ("--log-level", "warning"))
        arms["now, GC gen0 threshold 7000 (700)"] = (now, {"PYTHONPATH_FIRST": str(gc_dir)}, ())
        arms["now, GIL switch interval 5 ms (0.1)"] = (now, {"LATENTLM_GIL_SWITCH_INTERVAL_MS": "5"}, ())
    servers = {}
    try:
        for i, (name, (site, env, serve_args)) in enumerate(arms.items()):
            servers[name] = Server(site, args.store, args.port + i, work / f"server{i}.log", env, serve_args)
        for s in servers.values():  # loaded side by side (each calibrates its engines as `serve` does)
            s.wait_ready()
        for s in servers.values():
            run_wrk(f"http://127.0.0.1:{s.port}/v1/score", script, 64, 2)  # warm-up
        runs: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
        for r in range(args.rounds if len(servers) > 1 else 1):
            for conns in (1, 64):
                order = list(servers.items()) if r % 2 == 0 else list(reversed(servers.items()))
                for name, s in order:
                    m = measure(s, script, conns, args.seconds)
                    runs[name, conns].append(m)
                    print(f"round {r} {name} c={conns}: {m['rps']:.0f} req/s, p99 {m['p99']:.2f} ms, event loop "
                          f"{m['loop_ms']:.3f} ms/request, other threads {m['other_ms']:.3f}", flush=True)
        asgi: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
        if args.asgi:
            for s in servers.values():  # the CPUs to the in-process runs
                s.proc.send_signal(signal.SIGSTOP)
            try:
                for r in range(args.rounds):
                    for conns in (1, 64):
                        order = list(arms.items()) if r % 2 == 0 else list(reversed(arms.items()))
                        for name, (site, env, serve_args) in order:
                            if serve_args:
                                continue
                            m = asgi_cpu(site, env, args.store, args.model, conns, args.seconds)
                            asgi[name, conns].append(m)
                            print(f"asgi round {r} {name} c={conns}: {m['rps']:.0f} req/s, event loop "
                                  f"{m['loop_us']:.0f} µs/request", flush=True)
            finally:
                for s in servers.values():
                    s.proc.send_signal(signal.SIGCONT)
        prof = None
        if not args.no_profile:
            now = servers["now"]
            prof = {c: profile(now, script, c, args.seconds, work / f"c{c}.raw") for c in (1, 64)}
    finally:
        for s in servers.values():
            s.stop()
    inproc = in_process(args.store, args.model, seqs)
    write_report(args, head.strip(), runs, prof, inproc, list(arms), asgi)
    print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def write_report(args, head: str, runs: dict, prof: dict | None, inproc: dict, names: list[str],
                 asgi: dict) -> None:
    cpu = cpu_name()
    lines = [f"- machine: {cpu}, {os.cpu_count()} cores; date {datetime.date.today()}; HEAD {head}; "
             f"model {args.model} (store {args.store})",
             f"- command: `{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`",
             "- load: wrk -t1, 64 different 50-token id inputs, one sentence per POST /v1/score, "
             f"{args.seconds:g} s per run; CPU per request from /proc (user + system) of the event loop (main "
             "thread) and of every other thread (inference thread, engines)", "",
             "| state | c | req/s | p50 ms | p99 ms | event loop ms CPU/request | other threads ms/request |",
             "|---|---|---|---|---|---|---|"]
    for conns in (1, 64):
        for name in names:
            ms = runs[name, conns]
            lines.append(f"| {name} | {conns} | {median([m['rps'] for m in ms]):,.0f} | "
                         f"{median([m['p50'] for m in ms]):.2f} | {median([m['p99'] for m in ms]):.2f} | "
                         f"{median([m['loop_ms'] for m in ms]):.3f} | {median([m['other_ms'] for m in ms]):.3f} |")
    pairs = [(n, "now") for n in names if n.startswith("at ")]
    pairs += [("now", n) for n in names if n.startswith("now,")]
    if pairs:
        lines += ["", "Ratios (medians over the rounds; each round runs every state back to back, order alternated):",
                  ""]
    for base, arm in pairs:
        for conns in (1, 64):
            b, a = runs[base, conns], runs[arm, conns]
            total_a = median([m["loop_ms"] + m["other_ms"] for m in a])
            total_b = median([m["loop_ms"] + m["other_ms"] for m in b])
            lines.append(f"- {arm} / {base}, c={conns}: req/s x"
                         f"{median([m['rps'] for m in a]) / median([m['rps'] for m in b]):.2f}, event-loop CPU per "
                         f"request x{median([m['loop_ms'] for m in a]) / median([m['loop_ms'] for m in b]):.2f}, "
                         f"all threads x{total_a / total_b:.2f}, "
                         f"p99 x{median([m['p99'] for m in a]) / median([m['p99'] for m in b]):.2f}")
    if asgi:
        lines += ["", "The app alone in process (bench/hot_path_asgi.py: no uvicorn, sockets or access log), "
                  "event-loop CPU per request, medians:", "",
                  "| state | c | req/s | event loop µs CPU/request | ratio to the first state |",
                  "|---|---|---|---|---|"]
        for conns in (1, 64):
            ref = None
            for name in names:
                ms = asgi.get((name, conns))
                if not ms:
                    continue
                us = median([m["loop_us"] for m in ms])
                ref = ref or us
                rps = median([m["rps"] for m in ms])
                lines.append(f"| {name} | {conns} | {rps:,.0f} | {us:.0f} | x{us / ref:.2f} |")
    lines += ["", "In process (`ops.run(model, \"score\", ...)`, the model calibrated as the service loads it):", ""]
    for batch, v in inproc.items():
        lines.append(f"- {batch} sentence(s) per call: {v['us_per_sentence']:.0f} µs per sentence, "
                     f"{v['tok_s'] / 1e3:,.0f}k tok/s")
    if prof:
        for conns, pr in prof.items():
            lines += ["", f"Event loop at c={conns}, py-spy ({pr['samples']} samples; wall samples of the main thread "
                      "while it is not waiting in epoll), by layer:", "", "| layer | share |", "|---|---|"]
            lines += [f"| {k} | {v:.1%} |" for k, v in pr["layers"].items()]
            lines += ["", "Top leaf frames:", ""] + [f"- {v:.1%} {k}" for k, v in pr["leaves"]]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = args.out.read_text() if args.out.exists() else "# The service's hot path for small requests\n"
    # every run is kept: this one is appended under its own heading
    head = f"\n## Run of {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
    args.out.write_text(old.rstrip("\n") + "\n" + head + text)
    print(text)


if __name__ == "__main__":
    main()
