"""Fixtures for the service tests: a small model store, free ports, a real redis-server and real uvicorn
processes (`latentlm serve`, `latentlm worker`) started and stopped by the tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.models.vocab import Vocabulary

V = 40
WORDS = [f"w{i}" for i in range(V - 2)]


def vocab() -> Vocabulary:
    return Vocabulary([*WORDS, "<unk>", "<eos>"])


def add_model(store: Path, name: str, kind: str = "hmm", seed: int = 0) -> None:
    if kind == "hmm":
        t, c = random_hmm(16, V, seed=seed)
    elif kind == "blocked_hmm":
        t, c = random_blocked_hmm(4, 4, V, seed=seed)
    else:
        t, c = random_rank_hmm(32, 8, V, seed=seed)
    save_artifact(store, name, kind, t, vocab(), config=c)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
    return env


class Proc:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._fh = open(log, "ab")
        self.p = subprocess.Popen(args, env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if self.alive():
            os.killpg(self.p.pid, sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


PORT_TAKEN = ("address already in use", "errno 98")  # what serve logs when its port was taken after free_port()


class Server(Proc):
    """`latentlm serve` on a free port (another one if that port was taken between `free_port()` and the bind);
    `client` is an httpx.Client on it. Waits for /ready."""

    def __init__(self, store: Path, tmp: Path, env: dict[str, str] | None = None, *, log_level: str = "warning",
                 timeout: float = 60):
        e = clean_env(LATENTLM_STATE_DIR=str(tmp / "state"), **(env or {}))
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            args = [sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", str(self.port),
                    "--device", "cpu", "--log-level", log_level]
            super().__init__(args, e, tmp / f"serve-{self.port}.log")
            self.client = httpx.Client(base_url=self.url, timeout=timeout)
            if self._wait_ready() or attempt == 2:
                return
            self.client.close()  # the port was taken: try another
            self.kill()

    def _wait_ready(self) -> bool:
        """True once /ready is 200; False if serve exited because its port was taken; RuntimeError otherwise."""
        deadline = time.time() + 90
        while True:
            if not self.alive():
                out = self.output()
                if any(t in out.lower() for t in PORT_TAKEN):
                    return False
                raise RuntimeError(f"server exited:\n{out}")
            try:
                if self.client.get("/ready").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not ready:\n{self.output()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.client.close()
        self.kill()


def worker(store: Path, tmp: Path, env: dict[str, str]) -> Proc:
    return Proc([sys.executable, "-m", "latentlm.cli", "worker", "--store", str(store), "--device", "cpu",
                 "--log-level", "warning"], clean_env(**env), tmp / "worker.log")


def add_other_families(store: Path) -> list[str]:
    """A rank-space PCFG and an LDS (embeddings). Both families are part of the package: an ImportError
    here is a broken install and fails the tests that use the store."""
    import torch

    from latentlm.models.pcfg import random_pcfg
    from latentlm.training.lds import random_lds_tensors

    t, c = random_pcfg(3, 4, 4, V, seed=3)
    save_artifact(store, "pcfg", "pcfg", t, vocab(), config=c)
    t = {k: torch.from_numpy(v) for k, v in random_lds_tensors(V, 3, 4).items()}
    save_artifact(store, "lds", "lds", t, vocab(), config={"dim": 3, "lags": 3})
    return ["pcfg", "lds"]


@pytest.fixture(scope="session")
def base_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("store")
    add_model(store, "tiny", "hmm", seed=0)
    add_model(store, "blocked", "blocked_hmm", seed=1)
    add_model(store, "rank", "rank_hmm", seed=2)
    add_other_families(store)
    return store


@pytest.fixture(scope="module")
def store(base_store, tmp_path_factory) -> Path:
    """A per-module copy (reload tests add and remove models)."""
    dst = tmp_path_factory.mktemp("modstore") / "store"
    shutil.copytree(base_store, dst)
    return dst


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    p = Proc([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
              "--maxmemory-policy", "noeviction", "--dir", str(d)], clean_env(), d / "redis.log")
    import redis

    r = redis.Redis(port=port)
    deadline = time.time() + 20
    while True:
        try:
            if r.ping():
                break
        except redis.ConnectionError:
            if time.time() > deadline or not p.alive():
                raise RuntimeError(p.output()) from None
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    r.close()
    p.kill()


def ready(c) -> None:
    """Wait (at most 60 s) until an in-process app (a TestClient) has loaded its models."""
    deadline = time.monotonic() + 60
    while c.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "models not loaded after 60 s"
        time.sleep(0.02)


def reload_models(c) -> dict:
    """POST /v1/models/reload on a TestClient; asserts 200 and returns the body."""
    r = c.post("/v1/models/reload")
    assert r.status_code == 200, r.text
    return r.json()


def err(resp: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    """Assert an error response: status, the error shape, the field named, the message."""
    assert resp.status_code == status, resp.text
    e = resp.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    if param is not None:
        assert e["param"] == param, e
    assert contains in e["message"], e
    return e


def close(a, b, rel: float = 1e-5, path: str = "") -> None:
    """Structures equal; floats within a relative/absolute tolerance (float32 batch rounding)."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= rel * max(1.0, abs(a), abs(b)), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            close(a[k], b[k], rel, f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, rel, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over series whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sname, _, rest = head.partition("{")
        if sname != name:
            continue
        lab = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        lab = {k: v.strip('"') for k, v in lab.items()}
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def prepared(model, op: str, seqs, **opts):
    """A prepared call (`ops.spec.prepare`) of `op` over token-id `seqs`, as the service hands it to the batcher."""
    from latentlm.ops import spec

    return spec.prepare(model, op, spec.get(op).request(model=model.name, input=seqs, **opts))


def blocking_call(model, fn):
    """A prepared call of an unmergeable toy operation whose run is `fn()` (occupies a lane's thread)."""
    from latentlm.ops import spec
    from latentlm.ops.requests import SampleRequest

    op = spec.Operation("block", "blocks a lane", SampleRequest, run=lambda call, cap: fn(), merge=False)
    return spec.Call(model, op, {}, [], SampleRequest(model=model.name))
