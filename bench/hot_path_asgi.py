"""The app's own CPU per request, without uvicorn, sockets or the access log: `create_app` driven in process over
ASGI (lifespan started, the same 64 one-sentence /v1/score bodies as bench/hot_path.py, `conc` clients at once on
uvloop, the GIL switch interval `serve` sets). Prints one JSON line: requests/s and the event loop's CPU per request
(`time.thread_time` of the main thread: Guard, FastAPI's stack, the operation route, validation, prepare, batcher
hand-off, JSON). Run by bench/hot_path.py (`--asgi`) for each code state, or alone:

    .venv/bin/python bench/hot_path_asgi.py --store /tmp/defstore --conc 64 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import uvloop

from latentlm.service.app import create_app
from latentlm.service.settings import Settings


def bodies(model: str) -> list[bytes]:
    rng = random.Random(1)
    return [json.dumps({"model": model, "input": [[rng.randrange(10000) for _ in range(50)]]},
                       separators=(",", ":")).encode() for _ in range(64)]


async def request(app, body: bytes) -> None:
    """One POST /v1/score through the ASGI app; the connection stays open until the answer is sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/score", "raw_path": b"/v1/score", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}
    sent: list[dict] = []
    done = asyncio.Event()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await app(scope, receive, send)
    done.set()
    if sent[0]["status"] != 200:
        raise SystemExit(f"status {sent[0]['status']}: {sent[1:]}")


async def main(store: str, model: str, conc: int, seconds: float) -> dict:
    app = create_app(Settings.from_env(store=store, device="cpu"))
    inbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})

    async def noop(msg: dict) -> None:
        pass

    life = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, noop))
    while not app.state.service.registry.ready:
        await asyncio.sleep(0.1)
    items = bodies(model)
    for i in range(256):  # warm-up
        await request(app, items[i % 64])
    count = 0

    async def client(k: int, deadline: float) -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await request(app, items[(k + count) % 64])
            count += 1

    t0, c0 = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(client(k, t0 + seconds) for k in range(conc)))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    await inbox.put({"type": "lifespan.shutdown"})
    await life
    return {"conc": conc, "rps": count / wall, "loop_us": 1e6 * cpu / count}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default="artifacts")
    p.add_argument("--model", default="ptb-hmm")
    p.add_argument("--conc", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    sys.setswitchinterval(Settings.from_env().gil_switch_interval_ms / 1000)
    print(json.dumps(uvloop.run(main(a.store, a.model, a.conc, a.seconds))))
