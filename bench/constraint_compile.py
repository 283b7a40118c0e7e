"""Issue 55: how long an adversarial constraint takes to be refused, before (interegular's unbounded `to_fsm`, on the
event loop) and after (models.automata within a Budget, on a preparation thread), and how a light request fares
on a real server meanwhile.

    python bench/constraint_compile.py [--before-timeout 20] [--repeats 3] [--probe-seconds 3]
                                       [--out bench/results/constraint_compile.md]

1. Compilation alone, in this process: each pattern's `compile_constraint` with the defaults (2,048 states,
   1 s), the fastest of `--repeats` (the compiled-automaton cache cleared each time): the outcome (states, or the
   413 and the field it names) and the time to it.
2. Before: the same patterns through `models/constraint.py` as it was at `ab97675` (interegular's
   `to_fsm().reduce()`), each in a child process killed after `--before-timeout` seconds.
3. A real `latentlm serve` (a 16-state HMM over 40 words, `w5` standing for "stock"): a probe thread sends light
   requests one after another (GET /health, GET /v1/models, POST /v1/score), first alone for `--probe-seconds`,
   then while the patterns are sent back to back (each `--repeats` times to /v1/constraint); the probe's latencies
   (p50, p99, max) in both phases and each pattern's HTTP time to its answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hmm_inference import machine  # noqa: E402

from latentlm.models import constraint as cons  # noqa: E402
from latentlm.models.errors import LatentLMError  # noqa: E402
from latentlm.models.registry import save_artifact  # noqa: E402
from latentlm.models.synthetic import random_hmm  # noqa: E402
from latentlm.models.vocab import Vocabulary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "ab97675"
V = 40
PATTERNS = [". * w5 . {15}", "( w5 . {0,20} ) {0,20}", ". * w5 . {12}", ". * w5 . {8}",
            "( ( w1 . {0,9} ) {0,9} ) {0,9}", "( [ w1 w2 w3 ] . {0,9} w4 ) {0,25}"]
LIGHT = [("GET", "/health", None), ("GET", "/v1/models", None),
         ("POST", "/v1/score", {"model": "tiny", "input": "w1 w2 w3"})]


def vocab() -> Vocabulary:
    return Vocabulary([*(f"w{i}" for i in range(V - 2)), "<unk>", "<eos>"])


def outcome(module, pattern: str) -> str:
    """Compile `pattern` with `module` (a constraint module): "N states" or "413 <param>" / "422 <param>"."""
    vb = vocab()
    try:
        dfa = module.compile_constraint(module.parse_constraint({"regex": pattern}, vb), vb)
        return f"{dfa.num_states} states"
    except LatentLMError as e:
        return f"{413 if type(e).__name__ == 'LimitExceeded' else 422} `{e.param}`"


def after(pattern: str, repeats: int) -> tuple[str, float]:
    best, out = float("inf"), ""
    for _ in range(repeats):
        cons.clear_compiled()
        t = time.perf_counter()
        out = outcome(cons, pattern)
        best = min(best, time.perf_counter() - t)
    return out, best


def _old_module(path: str):
    spec = importlib.util.spec_from_file_location("constraint_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run_old(path: str, pattern: str, q) -> None:
    t = time.perf_counter()
    out = outcome(_old_module(path), pattern)
    q.put((out, time.perf_counter() - t))


def before(pattern: str, timeout: float, path: str) -> tuple[str, float]:
    """The old module in a child process; ("no answer", timeout) when it is killed at `timeout`."""
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_run_old, args=(path, pattern, q))
    t = time.perf_counter()
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return f"no answer after {timeout:g} s (killed)", time.perf_counter() - t
    return q.get(timeout=10)


class Probe(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.bad = url, [], 0
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            i = 0
            while not self.halt.is_set():
                method, path, body = LIGHT[i % len(LIGHT)]
                t = time.perf_counter()
                r = c.request(method, path, json=body)
                self.latencies.append(time.perf_counter() - t)
                self.bad += r.status_code != 200
                i += 1
                time.sleep(0.005)


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return (f"{len(xs)} requests, p50 {1000 * statistics.median(xs):.1f} ms, p99 {1000 * p99:.1f} ms, "
            f"max {1000 * xs[-1]:.1f} ms")


def serve(store: Path, state: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_")}
    env.update(LATENTLM_STATE_DIR=str(state), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", str(port),
                          "--device", "cpu", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    p.kill()
    raise RuntimeError("the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before-timeout", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe-seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/constraint_compile.md")
    args = ap.parse_args()
    m = machine()
    lines = ["# Constraint compilation: time to 413 before and after (issue 55)", "",
             f"CPU: {m['cpu']}, {m['cores']} cores (shared with other jobs while measured). Command: "
             f"`python bench/constraint_compile.py --before-timeout {args.before_timeout:g} --repeats {args.repeats}"
             f" --probe-seconds {args.probe_seconds:g}`. Patterns over words (`w5` plays \"stock\"); defaults: "
             "2,048 states after minimisation, 32,768 while building, 1 s per compilation.", "",
             "## Compilation alone", "",
             f"| pattern | before (`{BEFORE}`, interegular) | after (models.automata, fastest of {args.repeats}) |",
             "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "constraint_before.py"
        old.write_text(subprocess.run(["git", "show", f"{BEFORE}:models/constraint.py"], cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)
        for pattern in PATTERNS:
            b_out, b_t = before(pattern, args.before_timeout, str(old))
            a_out, a_t = after(pattern, args.repeats)
            lines.append(f"| `{pattern}` | {b_out} in {b_t:.2f} s | {a_out} in {a_t:.3f} s |")
            print(lines[-1], flush=True)

        store, state = Path(tmp) / "store", Path(tmp) / "state"
        t, c = random_hmm(16, V, seed=0)
        save_artifact(store, "tiny", "hmm", t, vocab(), config=c)
        proc, url = serve(store, state)
        try:
            probe = Probe(url)
            probe.start()
            time.sleep(args.probe_seconds)
            alone = list(probe.latencies)
            http: dict[str, list[tuple[int, float]]] = {}
            with httpx.Client(base_url=url, timeout=120) as client:
                start = len(probe.latencies)
                for _ in range(args.repeats):
                    for pattern in PATTERNS:
                        t0 = time.perf_counter()
                        r = client.post("/v1/constraint", json={"model": "tiny", "constraint": {"regex": pattern}})
                        http.setdefault(pattern, []).append((r.status_code, time.perf_counter() - t0))
                during = probe.latencies[start:]
            probe.halt.set()
            probe.join(10)
        finally:
            proc.terminate()
            proc.wait(30)
    lines += ["", "## Through a real server (after)", "",
              "A 413 that depends on the pattern only (positions, states) is cached with the compiled automata, so a "
              "repeated pattern is refused in about a millisecond (the min); one that ran out of time is not cached "
              "(it depends on the machine's load) and costs its second again.", "",
              "| pattern | status | HTTP time to the answer (min / max) |", "|---|---|---|"]
    for pattern, rs in http.items():
        lines.append(f"| `{pattern}` | {', '.join(sorted({str(s) for s, _ in rs}))} | "
                     f"{min(x for _, x in rs):.3f} / {max(x for _, x in rs):.3f} s |")
    lines += ["", "Light requests (GET /health, GET /v1/models, POST /v1/score, one after another):", "",
              f"- alone: {summary(alone)}", f"- while the patterns compile back to back: {summary(during)}"
              f"{f' ({probe.bad} not 200)' if probe.bad else ''}", "",
              "Before, the compilation ran on the event loop: no light request was answered until it ended (the issue: "
              "`GET /v1/models` and `POST /v1/score` timed out while `. * stock . {15}` compiled for 150 s and more)."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
