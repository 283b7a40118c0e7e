"""Faults of the batch/job side, against real processes: redis-server instances the tests stop, kill, freeze
and restart; `latentlm serve` (uvicorn) and `latentlm worker` processes.

- a worker survives a Redis outage (mid-job and idle) and resumes, every line exactly once; the batch and file
  routes answer 503 + Retry-After meanwhile, and a hung job Redis answers 503 after one timeout;
- a frozen worker that resumes does not rewrite a batch another worker completed;
- Redis mode: the output limit fails a batch early and deletes its chunks; crafted ids answer 404;
- DELETE of files and batches (409 while live), retention (`expires_at`, TTLs, lazy expiry, sweep);
- tenancy: two API keys see only their own files and batches;
- the in-process runner on a read-only or full jobs directory: the batch fails visibly, no .tmp files, the
  runner goes on;
- a hung cache Redis: short timeouts and a circuit breaker keep requests fast (counted in /metrics).

Its length (over 600 lines) is the real processes' harness (servers, workers, Redis instances stopped and frozen)
shared by every fault above: split across files, each would start its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from latentlm.service import jobs
from latentlm.service.app import create_app
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings
from tests.service.conftest import Proc, Server, clean_env, err, free_port, metric
from tests.service.test_api import score_lines, upload, wait_batch
from tests.service.test_reliability import crafted_ids_404, ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
JOB_ENV = {"LATENTLM_JOB_CHUNK_SIZE": "2", "LATENTLM_JOB_LEASE_S": "1", "LATENTLM_REDIS_RETRY_MAX_S": "1"}


class RedisProc:
    """A redis-server on a fixed port that a test can kill, restart (same port, same data directory), freeze
    (SIGSTOP: a hung Redis) and thaw. `aof`: append-only file with fsync always, so a SIGKILL loses nothing."""

    def __init__(self, d: Path, aof: bool = True):
        self.dir, self.aof, self.port = d, aof, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None
        self.start()

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
                "--maxmemory-policy", "noeviction"]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        self.proc = Proc(args, clean_env(), self.dir / "redis.log")
        r = redis.Redis(port=self.port)
        deadline = time.time() + 20
        while True:
            try:
                if r.ping():
                    break
            except redis.exceptions.ConnectionError:  # refused, or still loading the AOF
                assert time.time() < deadline and self.proc.alive(), self.proc.output()
                time.sleep(0.05)
        r.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill(signal.SIGKILL)

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.p.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.p.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.alive():
            self.thaw()
            self.proc.kill()


def start_worker(store: Path, tmp: Path, name: str, env: dict[str, str]) -> Proc:
    """`latentlm worker` with its own log file (tmp/<name>.log)."""
    return Proc([sys.executable, "-m", "latentlm.cli", "worker", "--store", str(store), "--device", "cpu",
                 "--log-level", "warning"], clean_env(**env), tmp / f"{name}.log")


def outputs(c, b: dict) -> list[dict]:
    lines = []
    for key in ("output_file_id", "error_file_id"):
        if b.get(key):
            r = c.get(f"/v1/files/{b[key]}/content")
            assert r.status_code == 200, r.text
            lines += [json.loads(ln) for ln in r.text.splitlines()]
    return lines


def exactly_once(c, b: dict, lines: list[dict]) -> None:
    assert b["status"] == "completed", b
    n = len(lines)
    assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}, b
    ids = [o["custom_id"] for o in outputs(c, b)]
    assert len(ids) == n and sorted(ids) == sorted(ln["custom_id"] for ln in lines)


def wait_for(pred, timeout: float, what: str, step: float = 0.05):
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


def backend_503(r: httpx.Response) -> None:
    e = err(r, 503, None, "Redis")
    assert e["code"] == "backend_unavailable" and r.headers["retry-after"] == "1", r.headers


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("jobs_faults")


# == a Redis outage: the worker reconnects and resumes, the routes answer 503 ==========================
def test_worker_survives_redis_outage_and_resumes(store, tmp):
    d = tmp / "outage"
    d.mkdir()
    rp = RedisProc(d)
    env = {"REDIS_URL": rp.url, **JOB_ENV, "LATENTLM_JOB_CHUNK_PAUSE_S": "0.3"}
    server = Server(store, d, env=env)
    w = start_worker(store, d, "worker", env)
    c = server.client
    try:
        lines = score_lines(30, seed=11)
        fid = upload(c, lines)
        b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
        wait_for(lambda: c.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] >= 4, 120,
                 "the first chunks")
        rp.kill()  # mid-job
        t_down = time.monotonic()
        r = c.get(f"/v1/batches/{b['id']}")
        t_503 = time.monotonic() - t_down
        backend_503(r)
        for r in (c.get("/v1/batches"), c.get(f"/v1/files/{fid}"), c.get(f"/v1/files/{fid}/content"),
                  c.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"}),
                  c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}),
                  c.post(f"/v1/batches/{b['id']}/cancel"), c.delete(f"/v1/batches/{b['id']}"),
                  c.delete(f"/v1/files/{fid}")):
            backend_503(r)
        assert c.post("/v1/score", json={"model": "tiny", "input": "w1 w2"}).status_code == 200  # sync path serves
        time.sleep(max(0.0, 3 - (time.monotonic() - t_down)))  # longer than the lease (1 s)
        assert w.alive(), w.output()
        rp.start()
        t_up = time.monotonic()
        done = wait_batch(c, b["id"], timeout=120)
        resumed_s = time.monotonic() - t_up
        exactly_once(c, done, lines)
        assert w.alive() and "Redis unavailable" in w.output(), w.output()

        # an outage while the worker waits for work (rq's loop used to quit on it)
        rp.kill()
        time.sleep(3)
        assert w.alive(), w.output()
        rp.start()
        lines2 = score_lines(6, seed=12)
        b2 = wait_for(lambda: _try_create(c, lines2), 30, "the API to reach Redis again")
        exactly_once(c, wait_batch(c, b2["id"], timeout=120), lines2)
        assert w.alive(), w.output()

        # a hung job Redis: one timeout (5 s), then 503; never the default 10 retries
        rp.freeze()
        t0 = time.monotonic()
        backend_503(c.get(f"/v1/batches/{b2['id']}"))
        hung_s = time.monotonic() - t0
        rp.thaw()
        assert hung_s < jobs.REDIS_TIMEOUT_S + 2.5, hung_s
        print(f"\nFIGURES outage: first 503 after {t_503 * 1000:.0f} ms; batch completed {resumed_s:.1f} s after "
              f"Redis returned; hung Redis answered 503 after {hung_s:.1f} s")
    finally:
        w.kill()
        server.stop()
        rp.stop()


def test_full_redis_answers_503(store, tmp_path):
    """A noeviction Redis at maxmemory refuses writes: the routes answer 503, not 500."""
    rp = RedisProc(tmp_path, aof=False)
    try:
        r = redis.Redis(port=rp.port)
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + (1 << 20))
        app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, redis_url=rp.url))
        with TestClient(app) as c:
            ready(c)
            upload(c, score_lines(2, seed=25))  # a small file fits
            big = c.post("/v1/files", files={"file": ("x.jsonl", b"{}\n" * 1_000_000)}, data={"purpose": "batch"})
            e = err(big, 503, None, "out of memory")
            assert e["code"] == "backend_unavailable" and big.headers["retry-after"] == "1"
        r.close()
    finally:
        rp.stop()


def _try_create(c, lines: list[dict]) -> dict | None:
    try:
        fid = upload(c, lines)
    except AssertionError:
        return None
    r = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"})
    return r.json() if r.status_code == 200 else None


# == shared Redis and server for the Redis-mode tests below ============================================
@pytest.fixture(scope="module")
def rserver(store, redis_url, tmp):
    d = tmp / "rserver"
    d.mkdir()
    s = Server(store, d, env={"REDIS_URL": redis_url, **JOB_ENV, "LATENTLM_JOB_RETENTION_S": "3600"})
    yield s
    s.stop()


def test_frozen_worker_does_not_rewrite_a_completed_batch(store, tmp, rserver, redis_url):
    c = rserver.client
    d = tmp / "frozen"
    d.mkdir()
    lines = score_lines(16, seed=13)
    b = c.post("/v1/batches", json={"input_file_id": upload(c, lines), "endpoint": "/v1/score"}).json()
    env = {"REDIS_URL": redis_url, **JOB_ENV}
    a = start_worker(store, d, "a", {**env, "LATENTLM_JOB_CHUNK_PAUSE_S": "1.5"})
    bw = None
    try:
        wait_for(lambda: c.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] >= 2, 120,
                 "worker A's first chunk")
        os.kill(a.p.pid, signal.SIGSTOP)  # frozen mid-job: its lease lapses
        bw = start_worker(store, d, "b", env)
        done = wait_batch(c, b["id"], timeout=120)
        exactly_once(c, done, lines)
        out = c.get(f"/v1/files/{done['output_file_id']}").json()
        content = c.get(f"/v1/files/{done['output_file_id']}/content").content
        time.sleep(1.2)  # a rewrite would now carry another second
        os.kill(a.p.pid, signal.SIGCONT)
        # A gives the batch up (logged), or rewrites it (the bug: its remaining chunks are done in ~10 s)
        wait_for(lambda: "finished by another worker" in a.output() or
                 c.get(f"/v1/batches/{b['id']}").json() != done, 60, "worker A to act", 0.2)
        time.sleep(0.5)
        after = c.get(f"/v1/batches/{b['id']}").json()
        assert after == done
        assert c.get(f"/v1/files/{done['output_file_id']}").json() == out
        assert c.get(f"/v1/files/{done['output_file_id']}/content").content == content
        assert a.alive(), a.output()
        print(f"\nFIGURES frozen worker: resumed {time.time() - done['completed_at']:.1f} s after the batch completed; "
              "batch and output unchanged")
    finally:
        os.kill(a.p.pid, signal.SIGCONT)
        a.kill()
        if bw is not None:
            bw.kill()


def test_stale_worker_writes_are_refused(store, redis_url, tmp_path):
    """The store-level guards behind the test above: after a batch completed, a worker holding an old token can
    neither commit a chunk nor finish the batch again."""
    s = jobs.RedisJobStore(redis_url)
    settings = Settings(store=store, device="cpu", job_chunk_size=2, job_lease_s=1)
    f = jobs.create_file(s, "\n".join(json.dumps(ln) for ln in score_lines(4, seed=14)).encode(), "in.jsonl",
                         "batch", retention_s=600)
    b = jobs.create_batch(s, f["id"], "/v1/score", retention_s=600)
    assert s.acquire_lease(b["id"], "stale", 1)  # worker A, then frozen
    time.sleep(1.1)  # its lease lapses
    reg = ModelRegistry(store)
    assert jobs.process_batch(s, reg, b["id"], settings) == "completed"  # worker B
    done = s.get_batch(b["id"])
    assert s.commit_chunk(b["id"], 0, ["{}"], 1, 0) == -2
    assert not s.transition(b["id"], {"status": "completed", "completed_at": 1}, "stale",
                            files=[({"id": f"file-{b['id']}-output", "bytes": 2, "created_at": 1, "filename": "x",
                                     "purpose": "batch_output"}, b"{}")])
    assert s.get_batch(b["id"]) == done
    assert s.file_content(f"file-{b['id']}-output").count(b"\n") == 4
    assert not s.redis.exists(f"latentlm:batch:{b['id']}:chunks")  # chunks deleted once the output is written
    assert jobs.batch_object(s, done)["request_counts"] == {"total": 4, "completed": 4, "failed": 0}


def test_output_limit_fails_early_and_deletes_chunks(store, tmp, rserver, redis_url):
    c = rserver.client
    d = tmp / "limit"
    d.mkdir()
    lines = score_lines(30, seed=15)
    b = c.post("/v1/batches", json={"input_file_id": upload(c, lines), "endpoint": "/v1/score"}).json()
    w = start_worker(store, d, "w", {"REDIS_URL": redis_url, **JOB_ENV, "LATENTLM_JOB_MAX_OUTPUT_BYTES": "3000"})
    try:
        done = wait_batch(c, b["id"], timeout=120)
    finally:
        w.kill()
    assert done["status"] == "failed", done
    e = done["errors"]["data"][0]
    assert e["code"] == "output_too_large" and "LATENTLM_JOB_MAX_OUTPUT_BYTES" in e["message"], e
    processed = done["request_counts"]["completed"] + done["request_counts"]["failed"]
    assert 0 < processed < 30 and f"after {processed} of 30 lines" in e["message"], done
    r = redis.Redis.from_url(redis_url)
    assert not r.exists(f"latentlm:batch:{b['id']}:chunks", f"latentlm:batch:{b['id']}:counts")
    assert done["output_file_id"] is None and not r.exists(f"latentlm:file:file-{b['id']}-output:content")
    print(f"\nFIGURES output limit: failed after {processed} of 30 lines, chunks deleted")


def test_crafted_ids_and_delete_redis(store, tmp, rserver, redis_url):
    c = rserver.client
    d = tmp / "delete"
    d.mkdir()
    lines = score_lines(4, seed=16)
    fid = upload(c, lines)
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    bid = b["id"]
    crafted_ids_404(c, bid, fid)
    for bad in (f"{bid}:chunks", f"{bid}:lease", "batch_nope", f"{fid}"):
        err(c.delete(f"/v1/batches/{bad}"), 404, "batch_id")
    for bad in (f"{fid}:meta", f"{fid}:content", "file_nope", bid):
        err(c.delete(f"/v1/files/{bad}"), 404, "file_id")

    # no worker runs yet: the batch is live
    e = err(c.delete(f"/v1/batches/{bid}"), 409, "batch_id", "cancel it")
    assert e["code"] == "batch_in_progress"
    assert err(c.delete(f"/v1/files/{fid}"), 409, "file_id")["code"] == "file_in_use"
    assert c.post(f"/v1/batches/{bid}/cancel").json()["status"] == "cancelling"
    err(c.delete(f"/v1/batches/{bid}"), 409, "batch_id")  # cancelling is still live
    w = start_worker(store, d, "w", {"REDIS_URL": redis_url, **JOB_ENV})
    try:
        done = wait_batch(c, bid, timeout=120)
    finally:
        w.kill()
    assert done["status"] == "cancelled"
    r = redis.Redis.from_url(redis_url)
    # retention: 3600 s on every key of the batch and its files
    assert done["expires_at"] == done["created_at"] + 3600
    assert c.get(f"/v1/files/{fid}").json()["expires_at"] is not None
    for key in (f"latentlm:batch:{bid}", f"latentlm:file:{fid}:content", f"latentlm:file:{fid}:meta",
                f"latentlm:file:{done['output_file_id']}:content"):
        assert 0 < r.ttl(key) <= 3600, key
    assert c.delete(f"/v1/batches/{bid}").json() == {"id": bid, "object": "batch", "deleted": True}
    err(c.get(f"/v1/batches/{bid}"), 404, "batch_id")
    err(c.get(f"/v1/files/{done['output_file_id']}/content"), 404, "file_id")
    err(c.delete(f"/v1/batches/{bid}"), 404, "batch_id")
    assert not r.keys(f"latentlm:batch:{bid}*") and not r.keys(f"latentlm:file:file-{bid}*")
    assert bid not in {x["id"] for x in c.get("/v1/batches", params={"limit": 100}).json()["data"]}
    assert c.delete(f"/v1/files/{fid}").json() == {"id": fid, "object": "file", "deleted": True}
    err(c.get(f"/v1/files/{fid}"), 404, "file_id")
    err(c.delete(f"/v1/files/{fid}"), 404, "file_id")
    assert not r.keys(f"latentlm:file:{fid}*")


# == retention: lazy expiry and the sweep, both stores =================================================
@pytest.mark.parametrize("backend", ["local", "redis"])
def test_retention_expires_files_and_batches(store, tmp_path, redis_url, backend):
    extra = {"redis_url": other_db(redis_url)} if backend == "redis" else {}
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, job_retention_s=2, **extra))
    with TestClient(app) as c:
        ready(c)
        fid = upload(c, score_lines(2, seed=17))
        f = c.get(f"/v1/files/{fid}").json()
        assert f["expires_at"] == f["created_at"] + 2
        b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
        assert b["expires_at"] == b["created_at"] + 2
        if backend == "local":
            done = wait_batch(c, b["id"], timeout=60)
            assert done["status"] == "completed"
            out = done["output_file_id"]
        else:  # no worker: the batch stays live and still expires
            out = None
        time.sleep(3.1)
        err(c.get(f"/v1/files/{fid}"), 404, "file_id")  # lazily, on access
        err(c.get(f"/v1/batches/{b['id']}"), 404, "batch_id")
        assert b["id"] not in {x["id"] for x in c.get("/v1/batches").json()["data"]}
        if out:
            err(c.get(f"/v1/files/{out}/content"), 404, "file_id")
        js = app.state.service.jobs
        if backend == "local":
            root = tmp_path / "jobs"
            assert not list(root.rglob(f"*{b['id']}*")) and not list(root.rglob(f"{fid}*"))
            # the sweep: a file nobody asks for again
            fid2 = upload(c, score_lines(1, seed=18))
            assert (root / "files" / f"{fid2}.json").exists()
            assert js.sweep(now=time.time() + 10) == 1 and not (root / "files" / f"{fid2}.json").exists()
        else:
            r = js.redis
            assert not r.exists(*(f"latentlm:batch:{b['id']}{k}" for k in ("", ":chunks", ":counts")))
            assert not r.keys(f"latentlm:file:{fid}*")
            fid2 = upload(c, score_lines(1, seed=18))
            assert r.zscore("latentlm:expiry", f"file:{fid2}") is not None
            assert js.sweep(now=time.time() + 10) >= 1
            assert r.zscore("latentlm:expiry", f"file:{fid2}") is None and not r.keys(f"latentlm:file:{fid2}*")


# == tenancy ==========================================================================================
def _tenancy(c, k1: dict, k2: dict, run_batch: bool) -> dict:
    fid = upload_with(c, score_lines(3, seed=19), k1)
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}, headers=k1).json()
    if run_batch:
        b = wait_for(lambda: (x := c.get(f"/v1/batches/{b['id']}", headers=k1).json())["status"] == "completed"
                     and x, 60, "the batch")
    bid = b["id"]
    assert c.get(f"/v1/files/{fid}", headers=k1).status_code == 200
    for r in (c.get(f"/v1/files/{fid}", headers=k2), c.get(f"/v1/files/{fid}/content", headers=k2),
              c.delete(f"/v1/files/{fid}", headers=k2)):
        err(r, 404, "file_id")
    err(c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}, headers=k2), 404,
        "input_file_id")
    for r in (c.get(f"/v1/batches/{bid}", headers=k2), c.post(f"/v1/batches/{bid}/cancel", headers=k2),
              c.delete(f"/v1/batches/{bid}", headers=k2)):
        err(r, 404, "batch_id")
    assert bid not in {x["id"] for x in c.get("/v1/batches", headers=k2).json()["data"]}
    assert bid in {x["id"] for x in c.get("/v1/batches", headers=k1).json()["data"]}
    if run_batch:
        out = b["output_file_id"]
        assert c.get(f"/v1/files/{out}/content", headers=k1).text.count("\n") == 3
        err(c.get(f"/v1/files/{out}/content", headers=k2), 404, "file_id")
        err(c.delete(f"/v1/files/{out}", headers=k2), 404, "file_id")
    # the second key's own batch is its own
    fid2 = upload_with(c, score_lines(2, seed=20), k2)
    b2 = c.post("/v1/batches", json={"input_file_id": fid2, "endpoint": "/v1/score"}, headers=k2).json()
    assert {x["id"] for x in c.get("/v1/batches", headers=k2).json()["data"]} == {b2["id"]}
    err(c.get(f"/v1/batches/{b2['id']}", headers=k1), 404, "batch_id")
    return b


def other_db(url: str) -> str:
    """The same redis-server, database 1 (its own rq queue)."""
    return url.rsplit("/", 1)[0] + "/1"


def redis_bytes(r: redis.Redis) -> bytes:
    """Every key name and value of the database, concatenated."""
    out = []
    for k in r.keys("*"):
        t = r.type(k).decode()
        vals = ([r.get(k)] if t == "string" else [x for kv in r.hgetall(k).items() for x in kv] if t == "hash"
                else r.zrange(k, 0, -1) if t == "zset" else list(r.smembers(k)) if t == "set"
                else r.lrange(k, 0, -1) if t == "list" else [])
        out += [k, *(v for v in vals if v)]
    return b"".join(out)


def upload_with(c, lines: list[dict], headers: dict) -> str:
    data = "\n".join(json.dumps(ln) for ln in lines) + "\n"
    r = c.post("/v1/files", files={"file": ("in.jsonl", data.encode())}, data={"purpose": "batch"}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_tenancy_two_keys_local_server(store, tmp):
    d = tmp / "tenancy"
    d.mkdir()
    s = Server(store, d, env={"LATENTLM_API_KEYS": "key-one-s3cret,key-two-s3cret"})
    try:
        k1, k2 = ({"Authorization": f"Bearer key-{n}-s3cret"} for n in ("one", "two"))
        _tenancy(s.client, k1, k2, run_batch=True)
    finally:
        s.stop()
    stored = b"".join(p.read_bytes() for p in (d / "state").rglob("*") if p.is_file())
    assert b"s3cret" not in stored  # only hashes of the keys


def test_tenancy_two_keys_redis(store, tmp_path, redis_url):
    redis_url = other_db(redis_url)  # its batches stay queued: not for the workers of other tests
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, redis_url=redis_url,
                              api_keys="rk-one-s3cret,rk-two-s3cret"))
    with TestClient(app) as c:
        ready(c)
        k1, k2 = ({"Authorization": f"Bearer rk-{n}-s3cret"} for n in ("one", "two"))
        b = _tenancy(c, k1, k2, run_batch=False)
        r = app.state.service.jobs.redis
        assert b"latentlm:batch:" in redis_bytes(r) and b"s3cret" not in redis_bytes(r)
        owner = json.loads(r.hget(f"latentlm:batch:{b['id']}", "owner"))
        assert owner == jobs.owner_of("Bearer rk-one-s3cret", ["x"]) and len(owner) == 64
    # without keys everything stays shared, as before
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, redis_url=redis_url))
    with TestClient(app) as c:
        ready(c)
        assert c.get(f"/v1/batches/{b['id']}").status_code == 200


# == the in-process runner on a read-only or full jobs directory ======================================
def _serve_unprivileged(store: Path, d: Path, env: dict[str, str]) -> Server:
    """`latentlm serve` that file permissions apply to: as root, without CAP_DAC_OVERRIDE (setpriv)."""
    if os.geteuid() != 0:
        return Server(store, d, env=env)
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: chmod would not stop the server writing")
    real = subprocess.Popen

    def popen(args, *a, **kw):
        return real(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *args], *a, **kw)

    subprocess.Popen = popen  # type: ignore[misc]
    try:
        return Server(store, d, env=env)
    finally:
        subprocess.Popen = real  # type: ignore[misc]


def _no_tmp(root: Path) -> None:
    assert not [p for p in root.rglob("*.tmp")], list(root.rglob("*.tmp"))


def test_local_runner_read_only_jobs_dir(store, tmp):
    d = tmp / "readonly"
    d.mkdir()
    s = _serve_unprivileged(store, d, {"LATENTLM_JOB_CHUNK_SIZE": "2", "LATENTLM_JOB_CHUNK_PAUSE_S": "0.3"})
    c = s.client
    jobs_dir = d / "state" / "jobs"
    try:
        lines = score_lines(30, seed=21)
        b = c.post("/v1/batches", json={"input_file_id": upload(c, lines), "endpoint": "/v1/score"}).json()
        wait_for(lambda: c.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] >= 2, 60,
                 "the first chunks")
        dirs = [p for p in jobs_dir.rglob("*") if p.is_dir()] + [jobs_dir]
        for p in dirs:
            p.chmod(0o555)
        try:
            failed = wait_batch(c, b["id"], timeout=60)
            assert failed["status"] == "failed", failed
            e = failed["errors"]["data"][0]
            assert e["code"] == "storage_unavailable" and "Permission denied" in e["message"], e
            assert 2 <= failed["request_counts"]["completed"] < 30 and failed["output_file_id"] is None
            print(f"\nFIGURES read-only jobs dir: failed after {failed['request_counts']['completed']} of 30 lines: "
                  f"{e['message']}")
            r = c.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"})
            assert err(r, 503, None, "Permission denied")["code"] == "storage_unavailable"
            assert r.headers["retry-after"] == "1"
            _no_tmp(jobs_dir)
        finally:
            for p in dirs:
                p.chmod(0o755)
        # the disk takes writes again: the runner goes on, the failure is written down
        lines2 = score_lines(8, seed=22)
        b2 = c.post("/v1/batches", json={"input_file_id": upload(c, lines2), "endpoint": "/v1/score"}).json()
        exactly_once(c, wait_batch(c, b2["id"], timeout=60), lines2)
        assert json.loads((jobs_dir / "batches" / f"{b['id']}.json").read_text())["status"] == "failed"
        assert c.get(f"/v1/batches/{b['id']}").json()["status"] == "failed"
        _no_tmp(jobs_dir)
        assert s.alive()
    finally:
        s.stop()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only): a real 'No space left on device'."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write until the filesystem is full (unbuffered, down to the last byte)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def test_local_runner_full_disk(store, small_disk):
    app = create_app(Settings(store=store, device="cpu", state_dir=small_disk, job_chunk_size=2,
                              job_chunk_pause_s=0.3))
    with TestClient(app) as c:
        ready(c)
        jobs_dir = small_disk / "jobs"
        lines = score_lines(30, seed=23)
        b = c.post("/v1/batches", json={"input_file_id": upload(c, lines), "endpoint": "/v1/score"}).json()
        wait_for(lambda: c.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] >= 2, 60,
                 "the first chunks")
        _fill(small_disk / "filler")
        failed = wait_batch(c, b["id"], timeout=60)
        assert failed["status"] == "failed", failed
        e = failed["errors"]["data"][0]
        assert e["code"] == "storage_unavailable" and "No space left on device" in e["message"], e
        assert failed["request_counts"]["completed"] < 30 and failed["output_file_id"] is None
        print(f"\nFIGURES full disk: failed after {failed['request_counts']['completed']} of 30 lines: {e['message']}")
        _no_tmp(jobs_dir)
        r = c.post("/v1/files", files={"file": ("x.jsonl", b"{}\n" * 40000)}, data={"purpose": "batch"})
        assert err(r, 503, None, "No space left")["code"] == "storage_unavailable"
        _no_tmp(jobs_dir)
        (small_disk / "filler").unlink()
        lines2 = score_lines(8, seed=24)
        b2 = c.post("/v1/batches", json={"input_file_id": upload(c, lines2), "endpoint": "/v1/score"}).json()
        exactly_once(c, wait_batch(c, b2["id"], timeout=60), lines2)
        assert c.get(f"/v1/batches/{b['id']}").json()["status"] == "failed"
        assert json.loads((jobs_dir / "batches" / f"{b['id']}.json").read_text())["status"] == "failed"
        _no_tmp(jobs_dir)


# == a hung cache Redis ===============================================================================
def test_hung_cache_circuit_breaker(store, tmp):
    d = tmp / "cache"
    d.mkdir()
    rp = RedisProc(d, aof=False)
    s = Server(store, d, env={"LATENTLM_CACHE_URL": rp.url, "LATENTLM_CACHE_BREAKER_COOLDOWN_S": "2"})
    c = s.client
    try:
        body = {"model": "tiny", "input": "w1 w2 w3"}
        assert c.post("/v1/score", json=body).headers["x-cache"] == "miss"
        assert c.post("/v1/score", json=body).headers["x-cache"] == "hit"
        m0 = c.get("/metrics").text
        rp.freeze()
        times = []
        for i in range(20):
            t0 = time.monotonic()
            r = c.post("/v1/score", json={"model": "tiny", "input": f"w{i % 30} w{i % 7}"})
            times.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
        m1 = c.get("/metrics").text
        assert metric(m1, "latentlm_cache_breaker_trips_total") - metric(m0, "latentlm_cache_breaker_trips_total") == 1
        assert metric(m1, "latentlm_cache_skipped_total") - metric(m0, "latentlm_cache_skipped_total") >= 30
        assert metric(m1, "latentlm_cache_errors_total") - metric(m0, "latentlm_cache_errors_total") == 3
        assert sum(times) < 5, times  # (the default timeout of 0.25 s, three times, then skipped)
        assert sorted(times)[10] < 0.2, times  # the median request does not touch the cache
        rp.thaw()
        time.sleep(2.2)  # the cool-down: then one probe closes the breaker
        assert c.post("/v1/score", json=body).headers["x-cache"] == "hit"
        assert c.post("/v1/score", json=body).headers["x-cache"] == "hit"
        times.sort()
        print(f"\nFIGURES hung cache: 20 requests in {sum(times):.2f} s, median {times[10] * 1000:.0f} ms, "
              f"max {times[-1] * 1000:.0f} ms")
    finally:
        s.stop()
        rp.stop()
