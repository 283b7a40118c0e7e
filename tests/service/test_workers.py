"""`latentlm serve` with several API workers (`service.supervisor`): one copy of each model's weights in memory,
answers from every worker, metrics summed over them, SIGTERM passed on; and refused without Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from latentlm.models.registry import save_artifact
from latentlm.models.store import WEIGHTS, read_manifest

from .conftest import Server, V, add_model, clean_env, metric, vocab

Z_BIG = 11_585  # a 512 MiB transition matrix: far above what a worker holds besides the weights


def _big_model(store: Path) -> int:
    """A dense HMM whose weights are ~512 MiB of float32; returns the weights file's size in bytes."""
    g = torch.Generator().manual_seed(0)

    def rows(n: int, m: int) -> torch.Tensor:
        x = torch.rand(n, m, generator=g) + 0.01
        return x / x.sum(-1, keepdim=True)

    tensors = {"start": rows(1, Z_BIG)[0], "trans": rows(Z_BIG, Z_BIG), "emit": rows(Z_BIG, V)}
    save_artifact(store, "big", "hmm", tensors, vocab(), config={"num_states": Z_BIG})
    return (store / "big" / WEIGHTS).stat().st_size


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return sorted(out)


def _mapping(pid: int, path: Path) -> dict[str, int]:
    """Rss, Pss, Private_Clean and Private_Dirty (bytes) of `pid`'s mappings of `path`, from /proc/PID/smaps."""
    out = {"Rss": 0, "Pss": 0, "Private_Clean": 0, "Private_Dirty": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and head[0].rstrip(":") in out:
            out[head[0].rstrip(":")] += int(head[1]) * 1024
    return out


def _anonymous(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Anonymous line")


def _fresh_connections_ready(server: Server, n: int) -> bool:
    """Whether `n` fresh connections in a row (spread over the workers by the kernel) all find /ready 200."""
    for _ in range(n):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            if c.get("/ready").status_code != 200:
                return False
    return True


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> tuple[Path, int]:
    store = tmp_path_factory.mktemp("bigstore")
    return store, _big_model(store)


def test_two_workers_hold_one_copy_of_the_weights(big_store, redis_url, tmp_path):
    store, size = big_store
    digest = read_manifest(store / "big")["files"][WEIGHTS]
    server = Server(store, tmp_path, env={"REDIS_URL": redis_url, "LATENTLM_WORKERS": "2",
                                          "LATENTLM_CALIBRATE": "0"})
    try:
        workers = _children(server.p.pid)
        assert len(workers) == 2, server.output()
        snap = tmp_path / "state" / "weights" / f"{digest}.safetensors"
        deadline = time.time() + 180
        while not all(_mapping(w, snap)["Rss"] >= 0.9 * size for w in workers):  # each has loaded and checked it
            assert time.time() < deadline, server.output()
            time.sleep(0.5)
        maps = {w: _mapping(w, snap) for w in workers}
        # one copy: the pages are the snapshot's, shared (each worker's proportional share is half of them)
        assert sum(m["Pss"] for m in maps.values()) <= 1.05 * size, maps
        for w, m in maps.items():
            assert m["Private_Clean"] + m["Private_Dirty"] <= 0.02 * size, (w, m)
            # and no private copy besides: a worker's anonymous memory is below the weights' size
            assert _anonymous(w) < size, (w, _anonymous(w), size)

        # every worker answers, alike, once each has loaded the model (its mapping is read before its checks end):
        # fresh connections in a row, spread by the kernel, all find /ready 200
        deadline, streak = time.time() + 120, 0
        while streak < 8:
            assert time.time() < deadline, server.output()
            with httpx.Client(base_url=server.url, timeout=60) as c:
                streak = streak + 1 if c.get("/ready").status_code == 200 else 0
            if not streak:
                time.sleep(0.2)
        # the metrics of whichever worker answers count both
        body = {"model": "big", "input": "w1 w2 w3 w4"}
        answers = set()
        for _ in range(24):
            with httpx.Client(base_url=server.url, timeout=60) as c:  # a new connection each: spread by the kernel
                r = c.post("/v1/score", json=body)
                assert r.status_code == 200, r.text
                answers.add(r.json()["data"][0]["logprob"])
        assert len(answers) == 1
        deadline = time.time() + 10
        while True:  # the other worker's counts are written as they happen
            text = server.client.get("/metrics").text
            if metric(text, "latentlm_request_duration_seconds_count", route="/v1/score", method="POST",
                      status="200") == 24:
                break
            assert time.time() < deadline, text
            time.sleep(0.2)
        assert metric(text, "latentlm_models_loaded") == 1

        # a reload through one worker reaches the other (through Redis): fresh connections in a row all list it
        add_model(store, "small")
        assert server.client.post("/v1/models/reload").status_code == 200
        deadline, streak = time.time() + 30, 0
        while streak < 8:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            streak = streak + 1 if "small" in ids else 0
            assert time.time() < deadline, ids
            time.sleep(0.05 if streak else 0.3)
        assert len(list(snap.parent.glob("*.safetensors"))) == 2  # each served model's weights, once
    finally:
        server.stop()
    assert server.p.returncode == 0, server.output()
    for w in workers:
        assert not Path(f"/proc/{w}").exists() or "zombie" in Path(f"/proc/{w}/status").read_text().lower()
    assert server.output().count("drained after") == 2, server.output()


def test_several_workers_need_redis(tmp_path, store):
    r = subprocess.run([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", "1"],
                       env=clean_env(LATENTLM_WORKERS="2", LATENTLM_STATE_DIR=str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "LATENTLM_WORKERS=2 needs REDIS_URL" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_one_process_without_redis_by_default(store, tmp_path):
    """The automatic count: one process (no supervisor) without Redis, as before."""
    server = Server(store, tmp_path)
    try:
        assert _children(server.p.pid) == [], "no worker processes without Redis"
        assert server.client.get("/ready").status_code == 200
    finally:
        server.stop()
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None


def test_a_dead_worker_is_started_again(store, redis_url, tmp_path):
    server = Server(store, tmp_path, env={"REDIS_URL": redis_url, "LATENTLM_WORKERS": "2",
                                          "LATENTLM_CALIBRATE": "0"})
    try:
        before = _children(server.p.pid)
        assert len(before) == 2
        os.kill(before[0], 9)
        deadline = time.time() + 120
        while True:  # a new worker in its place, and both answer
            now = _children(server.p.pid)
            if len(now) == 2 and before[0] not in now and _fresh_connections_ready(server, 12):
                break
            assert time.time() < deadline and server.alive(), server.output()
            time.sleep(0.5)
        assert "exited with status -9; starting it again" in server.output()
        r = server.client.post("/v1/score", json={"model": "tiny", "input": "w1 w2"})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert server.p.returncode == 0


def test_workers_that_cannot_listen_stop_the_service(store, redis_url, tmp_path):
    """A port held by another program (without SO_REUSEPORT): every worker fails to bind it, twice, and the
    supervisor exits 1 saying so instead of restarting them forever."""
    import socket

    from .conftest import Proc

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = Proc([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", str(port),
                  "--device", "cpu", "--log-level", "warning"],
                 clean_env(REDIS_URL=redis_url, LATENTLM_WORKERS="2", LATENTLM_CALIBRATE="0",
                           LATENTLM_STATE_DIR=str(tmp_path / "state")), tmp_path / "serve.log")
        try:
            p.p.wait(240)
        finally:
            p.kill()
    out = p.output()
    assert p.p.returncode == 1, out
    assert "twice within 30 s of its start; stopping" in out and f"cannot listen on 127.0.0.1:{port}" in out, out


def test_workers_calibrate_once_and_use_the_same_engines(store, redis_url, tmp_path):
    """Two workers loading the same dense HMM: one times the CPU engines, the other reads its choice
    (`models.calibrate.share_with`), so /v1/models shows the same measured timings whichever worker answers
    (two separate measurements would differ in their timings)."""
    from latentlm.models.kernels.jit import HAVE_NUMBA

    if not HAVE_NUMBA:
        pytest.skip("numba unavailable: nothing compiled to calibrate")
    server = Server(store, tmp_path, env={"REDIS_URL": redis_url, "LATENTLM_WORKERS": "2"})
    try:
        deadline = time.time() + 120
        while not _fresh_connections_ready(server, 8):  # one worker may still wait for the other's measurement
            assert time.time() < deadline and server.alive(), server.output()
            time.sleep(0.5)
        seen = []
        for _ in range(12):  # fresh connections: spread over both workers by the kernel
            with httpx.Client(base_url=server.url, timeout=30) as c:
                models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            backend = models["tiny"]["backend"]
            assert backend["calibrated"] is True, backend
            seen.append(backend["calibration_ms"])
        assert all(s == seen[0] for s in seen), seen
    finally:
        server.stop()
