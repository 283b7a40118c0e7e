"""Throughput (tokens/s) and p50/p99 latency of POST /v1/score at concurrency 1, 8 and 64 against a real
`latentlm serve` process, compared with the batched inference (`latentlm.ops.run`) called in-process on
the same inputs. Writes bench/results/service_throughput.md.

Usage: python bench/service_throughput.py [--store DIR] [--model NAME] [--tokens 50] [--requests 640]
An empty --store first gets the default model (training.default.build_default_model, a few minutes)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from latentlm import ops  # noqa: E402
from latentlm.models.store import list_models  # noqa: E402
from latentlm.service.settings import Settings  # noqa: E402

CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: Path, port: int, log: Path, threads: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
    env["LATENTLM_TORCH_THREADS"] = str(threads)
    p = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", str(port),
                          "--device", "cpu", "--log-level", "warning"], env=env, stdout=open(log, "wb"),
                         stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return p
        except httpx.TransportError:
            pass
        if p.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.2)
    p.kill()
    raise SystemExit("server did not become ready")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection driven like wrk: requests are pre-encoded bytes; when a response
    is complete (header block + Content-Length bytes) its status, body and latency are recorded and the
    next request is written from the data callback (no coroutine or future per request). The client shares
    the 2 cores with the server, so it has to be much lighter than the server per request."""

    def __init__(self, requests: list[bytes], it, out: list, done: asyncio.Future, remaining: list[int]):
        self.requests, self.it, self.out, self.done, self.remaining = requests, it, out, done, remaining
        self.buf = bytearray()
        self.need = -1  # bytes of the current response (head + body) once its head is parsed
        self.head = 0
        self.i = -1
        self.t0 = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send_next(self) -> None:
        self.i = next(self.it, -1)
        if self.i < 0:
            self.remaining[0] -= 1
            if self.remaining[0] == 0 and not self.done.done():
                self.done.set_result(None)
            return
        self.t0 = time.perf_counter()
        self.transport.write(self.requests[self.i])

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                length = int(CONTENT_LENGTH.search(buf, 0, end + 2).group(1))
                self.head, self.need = end + 4, end + 4 + length
            if len(buf) < self.need:
                return
            status, body = int(buf[9:12]), bytes(buf[self.head : self.need])
            del buf[: self.need]
            self.need = -1
            self.out[self.i] = (status, body, time.perf_counter() - self.t0)
            self.send_next()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("server closed the connection"))


def encode_request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def drive(port: int, requests: list[bytes], concurrency: int) -> tuple[float, list[tuple[int, bytes, float]]]:
    """`concurrency` connections sending `requests` back to back (each takes the next unsent one); returns
    (wall seconds, [(status, body, latency seconds)] in request order). One warm-up request per
    connection first."""
    loop = asyncio.get_running_loop()

    async def run(reqs: list[bytes]) -> list:
        out: list = [None] * len(reqs)
        done, remaining, it = loop.create_future(), [concurrency], iter(range(len(reqs)))
        conns = [Conn(reqs, it, out, done, remaining) for _ in range(concurrency)]
        for c in conns:
            await loop.create_connection(lambda c=c: c, "127.0.0.1", port)
        for c in conns:
            c.send_next()
        await done
        for c in conns:
            c.transport.close()
        return out

    await run([requests[0]] * concurrency)  # warm-up (connections, server caches)
    t0 = time.perf_counter()
    out = await run(requests)
    return time.perf_counter() - t0, out


def run_clients(port: int, model: str, inputs: list[list[int]], concurrency: int, per_request: int = 1
                ) -> tuple[float, list[float], list[dict]]:
    """`concurrency` clients each sending requests (of `per_request` inputs) back to back; returns (wall
    seconds, latencies, per-input result dicts in input order)."""
    import uvloop

    bodies = [json.dumps({"model": model, "input": inputs[i : i + per_request]}).encode()
              for i in range(0, len(inputs), per_request)]
    wall, out = uvloop.run(drive(port, [encode_request("/v1/score", b) for b in bodies], concurrency))
    bad = [(st, body) for st, body, _ in out if st != 200]
    assert not bad, bad[:3]
    results = [r for _, body, _ in out for r in json.loads(body)["data"]]
    return wall, [lat for _, _, lat in out], results


def in_process(m: ops.LoadedModel, inputs: list[list[int]], batch: int) -> tuple[float, list[dict]]:
    """ops.run over the inputs in groups of `batch` requests (what the batcher does, minus HTTP); returns
    (wall seconds, per-input results)."""
    ops.run(m, "score", inputs[:batch])
    results = []
    t0 = time.perf_counter()
    for i in range(0, len(inputs), batch):
        results += ops.run(m, "score", inputs[i : i + batch])
    return time.perf_counter() - t0, results


def max_rel_diff(service: list[dict], ref: list[dict]) -> float:
    """Largest relative logprob difference between the service's and the in-process results."""
    assert len(service) == len(ref)
    worst = 0.0
    for a, b in zip(service, ref, strict=True):
        assert a["num_tokens"] == b["num_tokens"]
        worst = max(worst, abs(a["logprob"] - b["logprob"]) / max(1.0, abs(b["logprob"])))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--model", default=None, help="default: the first model in the store")
    ap.add_argument("--tokens", type=int, default=50, help="tokens per request")
    ap.add_argument("--requests", type=int, default=640, help="requests per concurrency level")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, server and in-process alike")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "service_throughput.md")
    args = ap.parse_args()
    if not list_models(args.store):
        from latentlm.training.default import build_default_model

        build_default_model(args.store)
    model = args.model or list_models(args.store)[0]
    m = ops.load_model(args.store, model)
    rng = random.Random(0)
    V = len(m.vocab)
    inputs = [[rng.randrange(V) for _ in range(args.tokens)] for _ in range(args.requests)]
    ntok = args.tokens * args.requests

    port = free_port()
    log = Path("/tmp") / f"bench-serve-{port}.log"
    torch.set_num_threads(args.threads)
    server = start_server(args.store, port, log, args.threads)
    rows = []
    diff = 0.0
    try:
        for c, per in ((1, 1), (8, 1), (64, 1), (64, 8)):
            n = args.requests * per if c > 1 else min(args.requests, 300)
            batch_inputs = [inputs[i % len(inputs)] for i in range(n)]
            before = batch_counts(port)
            wall, lat, got = run_clients(port, model, batch_inputs, c, per)
            after = batch_counts(port)
            ref_wall, ref_results = in_process(m, batch_inputs, c * per)
            diff = max(diff, max_rel_diff(got, ref_results))
            tput, ref = args.tokens * n / wall, args.tokens * n / ref_wall
            per_batch = (after[1] - before[1]) / max(1.0, after[0] - before[0])  # includes the warm-up
            label = str(c) if per == 1 else f"{c} ({per} inputs per request)"
            rows.append((label, tput, pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, per_batch, ref, tput / ref))
            print(f"c={label}: {tput:,.0f} tok/s p50 {rows[-1][2]:.2f} ms p99 {rows[-1][3]:.2f} ms, "
                  f"{per_batch:.1f} requests/batch | in-process {ref:,.0f} tok/s ratio {tput / ref:.2f}", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    d = m.describe()
    lines = [
        "# /v1/score throughput and latency vs in-process batched inference",
        "",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; machine: {platform.machine()} "
        f"{os.cpu_count()}-core CPU sandbox (shared with other work; ~10-30% run-to-run noise), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- model: `{model}` ({d['family']}, {d['num_states']} states, V = {V}); {args.tokens}-token requests "
        "(token ids), one sequence per request; server defaults (`latentlm serve`: max_queue_delay 2 ms, waited "
        f"only while other requests are arriving; max_batch_tokens 16384; LATENTLM_TORCH_THREADS={args.threads}; "
        f"GIL switch interval {Settings().gil_switch_interval_ms:g} ms)",
        "- client: wrk-style load generator in the benchmark process (uvloop, one keep-alive HTTP/1.1 connection "
        "per concurrent client, `asyncio.Protocol` callbacks, request bytes encoded before the clock starts, "
        "responses framed by Content-Length, the next request written from the data callback; ~25 us of CPU "
        "per request). The server is a separate process; all share the 2 cores.",
        "- in-process: `ops.run` over the same inputs in groups of `concurrency` requests' sequences, in the "
        "benchmark process after the HTTP run",
        "",
        "| concurrency | service tokens/s | p50 ms | p99 ms | requests/batch | in-process tokens/s "
        "| service / in-process |",
        "|---|---|---|---|---|---|---|",
        *[f"| {c} | {t:,.0f} | {p50:.2f} | {p99:.2f} | {b:.1f} | {r:,.0f} | {ratio:.2f} |"
          for c, t, p50, p99, b, r, ratio in rows],
        "",
        f"Requests per level: {args.requests} ({ntok:,} tokens; concurrency 1: {min(args.requests, 300)}); "
        "the last row sends 8 inputs per request (the in-process side then runs groups of 512). "
        "requests/batch: mean requests merged per batch during the level (server metrics). Every response is "
        "checked against the in-process result: max relative logprob difference "
        f"{diff:.1e} (float32 batches sum in a different order).",
        "",
        "Reading: the batcher merges concurrent requests, so the model compute per request is the in-process "
        "batched cost; what the service adds per request is HTTP parsing, validation, JSON and scheduling on the "
        "event loop, on the same 2 cores as the inference thread and the client. The batched operations skip "
        "the FastAPI middleware stack (a plain ASGI path, `service/app.py`), the inference thread takes the "
        "next batch itself as soon as it is free (`service/batcher.py`), and the response head and body go "
        "out in one write (`service/transport.py`). What remains at concurrency 64 is mostly the GIL: the inference "
        "thread needs it around every compiled call and torch op of a batch while the event loop holds it about "
        "half the time, so a batch takes longer in the server than the same call on an idle interpreter (the "
        "model path keeps interpreter work per batch small: one numpy conversion per batch, id checks at C speed, "
        "no tensor op on the chunking check, an MKL thread-count call that keeps the GIL). The event loop spends "
        "~60 us of CPU per request (~25 of them in uvicorn's protocol and ASGI cycle). Run to run the "
        "concurrency-64 ratio varies by about 10% (0.49-0.57 over four runs on 2026-11-26, the in-process side "
        "at 760-800k tokens/s). Several inputs per request "
        "amortise the HTTP cost (last row).",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def batch_counts(port: int) -> tuple[float, float]:
    """(batches, requests merged) of /v1/score so far, from the server's metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    get = {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines() if not ln.startswith("#")}
    return (get.get('latentlm_batch_requests_count{operation="score"}', 0.0),
            get.get('latentlm_batch_requests_sum{operation="score"}', 0.0))


if __name__ == "__main__":
    main()
