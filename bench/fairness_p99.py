"""A light request's latency (p50 / p99 / max) while a maximal accepted heavy request of each kind runs, against
`latentlm serve` with the default settings (issue 16: "a maximal accepted request of each kind leaves a concurrent
light request's latency under 1 s").

The store (built in a temporary directory): `ptb-shape`, a random rank-space HMM of the default model's shape
(1,024 states, rank 256, 10,000 words), `light`, a 64-state HMM, and `dpcfg`, a dense PCFG (30 nonterminals, 60
preterminals). Heavy kinds, each the largest request the default limits accept (`max_request_tokens`,
`max_sample_tokens`, `max_request_cost`):

- pcfg-viterbi: dense-PCFG Viterbi over 50-word sentences, as many as fit in 95% of the cost budget;
- posterior: 200,000 tokens (200 x 1,000) on ptb-shape, top_k 1 (top_k null is capped at 2,000,000 entries);
- sample: n 1, max_tokens 100,000, stop_at_eos false on ptb-shape (one slice: runs to its end);
- score: one 200,000-token sequence on ptb-shape, re-sent whenever it completes.

For each kind the heavy request is sent (and re-sent when it completes) for `--window` seconds while one client
sends light score requests (2 sentences of 8 words) back to back, alternating between `light` and `ptb-shape`;
then the heavy client disconnects and the time until the heavy lane is empty is measured. A baseline window with
no heavy request comes first.

    nice -n 19 .venv/bin/python bench/fairness_p99.py --window 20 --out bench/results/fairness.md

`--service-dir DIR` serves with the `latentlm.service` package taken from DIR (e.g. an older commit's `service/`,
from `git archive`) for a before/after comparison; the rest of the code is the working tree's.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

V = 10_000


def build_store(root: Path) -> None:
    from latentlm.models.dense_pcfg import random_dense_pcfg
    from latentlm.models.registry import save_artifact
    from latentlm.models.synthetic import random_hmm, random_rank_hmm
    from latentlm.models.vocab import Vocabulary

    vocab = Vocabulary([f"w{i}" for i in range(V - 2)] + ["<unk>", "<eos>"])
    t, c = random_rank_hmm(1024, 256, V, seed=0)
    save_artifact(root, "ptb-shape", "rank_hmm", t, vocab, config=c)
    t, c = random_hmm(64, V, seed=1)
    save_artifact(root, "light", "hmm", t, vocab, config=c)
    t, c = random_dense_pcfg(30, 60, V, seed=2)
    save_artifact(root, "dpcfg", "dense_pcfg", t, vocab, config=c)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heavy_bodies(store: Path) -> dict[str, tuple[str, dict, int]]:
    """kind -> (path, body, the estimate `ops.operation_cost` gives it)."""
    from latentlm import ops
    from latentlm.service.settings import Settings

    s = Settings()
    rnd = random.Random(0)
    words = lambda n: [rnd.randrange(V - 2) for _ in range(n)]  # noqa: E731
    dp = ops.load_model(store, "dpcfg")
    per = ops.operation_cost(dp, "decode", [[1] * 50], method="viterbi")
    n_pcfg = max(1, int(0.95 * s.max_request_cost // per))
    T = s.max_request_tokens
    out = {
        "pcfg-viterbi": ("/v1/decode", {"model": "dpcfg", "method": "viterbi",
                                        "input": [words(50) for _ in range(n_pcfg)]}),
        "posterior": ("/v1/posterior", {"model": "ptb-shape", "top_k": 1,
                                        "input": [words(1000) for _ in range(T // 1000)]}),
        "sample": ("/v1/sample", {"model": "ptb-shape", "n": 1, "max_tokens": s.max_sample_tokens,
                                  "stop_at_eos": False}),
        "score": ("/v1/score", {"model": "ptb-shape", "input": [words(T)]}),
    }
    big = ops.load_model(store, "ptb-shape")
    costs = {"pcfg-viterbi": per * n_pcfg,
             "posterior": ops.operation_cost(big, "posterior", out["posterior"][1]["input"], top_k=1),
             "sample": ops.operation_cost(big, "sample", n=1, max_tokens=s.max_sample_tokens),
             "score": ops.operation_cost(big, "score", out["score"][1]["input"])}
    return {k: (*v, costs[k]) for k, v in out.items()}


def metric(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def lanes(c: httpx.Client) -> bool:
    return "latentlm_heavy_lane_requests" in c.get("/metrics").text


def wait_started(c: httpx.Client) -> None:
    """Until the heavy request is in the heavy lane (a service without lanes: 1 s after it was sent)."""
    if not lanes(c):
        time.sleep(1.0)
        return
    t0 = time.perf_counter()
    while metric(c.get("/metrics").text, "latentlm_heavy_lane_requests") < 1:
        if time.perf_counter() - t0 > 30:
            raise RuntimeError("the heavy request did not start")
        time.sleep(0.05)


def wait_free(c: httpx.Client) -> None:
    """Until the heavy lane is empty (a service without lanes: until a one-word score answers)."""
    if not lanes(c):
        assert c.post("/v1/score", json={"model": "light", "input": "w1"}, timeout=3600).status_code == 200
        return
    while metric(c.get("/metrics").text, "latentlm_heavy_lane_requests") > 0:
        time.sleep(0.02)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_window(url: str, kind: str, heavy: tuple[str, dict, int] | None, window: float,
               light_timeout: float = 30.0) -> dict:
    stop = threading.Event()
    info: dict = {"kind": kind, "heavy_status": [], "heavy_cost": heavy[2] if heavy else None}

    def heavy_loop():
        path, body, _ = heavy  # type: ignore[misc]
        with httpx.Client(base_url=url, timeout=httpx.Timeout(600, read=window + 1)) as c:
            while not stop.is_set():
                try:
                    r = c.post(path, json=body)
                    info["heavy_status"].append(r.status_code)
                    if "x-cost" in r.headers and int(r.headers["x-cost"]) != info["heavy_cost"]:
                        info["x_cost_mismatch"] = r.headers["x-cost"]
                    if r.status_code != 200:
                        info["heavy_error"] = r.text[:300]
                        return
                except httpx.ReadTimeout:
                    info["heavy_status"].append("gave up")
                    return

    th = None
    if heavy is not None:
        th = threading.Thread(target=heavy_loop, daemon=True)
        th.start()
        with httpx.Client(base_url=url, timeout=10) as c:  # the heavy request is in the lane
            wait_started(c)
            if "heavy_error" in info:
                raise RuntimeError(f"{kind}: the heavy request failed: {info}")
    lat: dict[str, list[float]] = {"light": [], "ptb-shape": []}
    rnd = random.Random(1)
    end = time.perf_counter() + window
    with httpx.Client(base_url=url, timeout=light_timeout) as c:
        i = 0
        while time.perf_counter() < end:
            model = ("light", "ptb-shape")[i % 2]
            i += 1
            body = {"model": model, "input": [[rnd.randrange(V - 2) for _ in range(8)] for _ in range(2)]}
            t = time.perf_counter()
            r = c.post("/v1/score", json=body)
            lat[model].append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
        stop.set()
        gone = None
        if th is not None:
            th.join(window + 5)  # the heavy client's read timeout closes its connection
            t_closed = time.perf_counter()
            wait_free(c)
            gone = time.perf_counter() - t_closed
    both = lat["light"] + lat["ptb-shape"]
    info.update(n=len(both), p50=pct(both, 0.5), p99=pct(both, 0.99), max=max(both),
                p99_light=pct(lat["light"], 0.99), p99_big=pct(lat["ptb-shape"], 0.99), lane_empty_after=gone)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=20.0, help="seconds of light requests per heavy kind")
    ap.add_argument("--kinds", default="pcfg-viterbi,posterior,score,sample")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    ap.add_argument("--service-dir", type=Path, help="serve with latentlm.service from this directory")
    ap.add_argument("--light-timeout", type=float, default=30.0, help="a light request's client timeout (s)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fairness-"))
    store = tmp / "store"
    build_store(store)
    bodies = heavy_bodies(store)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_")}
    env.update(LATENTLM_STATE_DIR=str(tmp / "state"), PYTHONUNBUFFERED="1")
    log = open(tmp / "serve.log", "wb")
    serve = ["serve", "--store", str(store), "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    cmd = [sys.executable, "-m", "latentlm.cli", *serve]
    if args.service_dir:
        cmd = [sys.executable, "-c", "import sys, latentlm.service as s; s.__path__[:] = [sys.argv[1]]; "
               "from latentlm.cli import main; sys.argv = ['latentlm', *sys.argv[2:]]; main()",
               str(args.service_dir.resolve()), *serve]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            t0 = time.time()
            while True:
                try:
                    if c.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() - t0 > 600 or proc.poll() is not None:
                    raise RuntimeError((tmp / "serve.log").read_text())
                time.sleep(0.2)
        for kind in ["none", *args.kinds.split(",")]:
            info = run_window(url, kind, None if kind == "none" else bodies[kind], args.window, args.light_timeout)
            rows.append(info)
            print(info, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    lines = [f"Machine: {cpu.split(':', 1)[-1].strip()} ({os.cpu_count()} CPUs, {platform.system()}); "
             f"load average at the end {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"Command: `nice -n 19 .venv/bin/python bench/{' '.join(['fairness_p99.py', *sys.argv[1:]])}`", "",
             "| heavy request running | its estimate (x-cost) | heavy answers | light requests | p50 ms | p99 ms "
             "| max ms | heavy lane empty after disconnect |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gone = "" if r["lane_empty_after"] is None else f"{r['lane_empty_after']:.2f} s"
        st = ", ".join(map(str, r["heavy_status"])) or "-"
        cost = f"{r['heavy_cost']:.3g}" if r["heavy_cost"] else "-"
        lines.append(f"| {r['kind']} | {cost} | {st} | {r['n']} | {r['p50'] * 1e3:.1f} | "
                     f"{r['p99'] * 1e3:.1f} | {r['max'] * 1e3:.1f} | {gone} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
