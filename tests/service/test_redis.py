"""With Redis (a real redis-server started by the tests): response cache, and batch jobs run by real
`latentlm worker` processes, including a worker killed with SIGKILL mid-job and restarted."""

from __future__ import annotations

import json
import signal
import time

import pytest
import redis

from latentlm import ops
from tests.service.conftest import Server, add_model, close, metric, worker
from tests.service.test_api import score_lines, upload, wait_batch

JOB_ENV = {"LATENTLM_JOB_CHUNK_SIZE": "2", "LATENTLM_JOB_CHUNK_PAUSE_S": "0.1", "LATENTLM_JOB_LEASE_S": "1"}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("redis_api")


@pytest.fixture(scope="module")
def server(store, redis_url, tmp):
    s = Server(store, tmp, env={"REDIS_URL": redis_url, "LATENTLM_CACHE_TTL_S": "60", **JOB_ENV})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(server):
    return server.client


def test_cache_hit_identical_and_reload_invalidates(c, store, redis_url):
    add_model(store, "cached", "hmm", seed=20)
    c.post("/v1/models/reload")
    body = {"model": "cached", "input": ["w1 w2 w3", [3, 4]], "token_logprobs": True}
    m0 = c.get("/metrics").text
    r1 = c.post("/v1/score", json=body)
    r2 = c.post("/v1/score", json=body)
    assert r1.headers["x-cache"] == "miss" and r2.headers["x-cache"] == "hit"
    assert r1.content == r2.content
    m1 = c.get("/metrics").text
    assert metric(m1, "latentlm_cache_hits_total", operation="score") - metric(
        m0, "latentlm_cache_hits_total", operation="score") == 1
    assert metric(m1, "latentlm_cache_misses_total", operation="score") - metric(
        m0, "latentlm_cache_misses_total", operation="score") == 1
    # every option is part of the key
    r3 = c.post("/v1/score", json={**body, "token_logprobs": False})
    assert r3.headers["x-cache"] == "miss" and "token_logprobs" not in r3.json()["data"][0]
    keys = redis.Redis.from_url(redis_url).keys("latentlm:cache:*")
    assert len(keys) >= 2
    assert all(0 < redis.Redis.from_url(redis_url).ttl(k) <= 60 for k in keys)
    # a changed model: reload, then no stale answer
    add_model(store, "cached", "hmm", seed=21)
    assert c.post("/v1/models/reload").json()["updated"] == ["cached"]
    r4 = c.post("/v1/score", json=body)
    assert r4.headers["x-cache"] == "miss"
    new = ops.load_model(store, "cached")
    close(r4.json()["data"], ops.run(new, "score", ops.encode_inputs(new.vocab, ["w1 w2 w3"]) + [[3, 4]],
                                     token_logprobs=True))
    assert r4.json()["data"][0]["logprob"] != r1.json()["data"][0]["logprob"]
    assert c.post("/v1/score", json=body).headers["x-cache"] == "hit"


def test_sample_not_cached(c):
    r = c.post("/v1/sample", json={"model": "tiny", "n": 2})
    assert r.status_code == 200 and "x-cache" not in r.headers


def _output(c, b) -> list[dict]:
    lines = []
    for key in ("output_file_id", "error_file_id"):
        if b.get(key):
            lines += [json.loads(ln) for ln in c.get(f"/v1/files/{b[key]}/content").text.splitlines()]
    return lines


def test_batch_job_survives_sigkill(c, store, tmp, redis_url):
    lines = score_lines(30, seed=7)
    fid = upload(c, lines)
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == 30
    env = {"REDIS_URL": redis_url, **JOB_ENV}
    # the first worker sleeps 10 minutes after each chunk: it is killed inside its first pause, so exactly
    # one chunk (2 lines) is committed whatever the machine's speed
    w = worker(store, tmp, {**env, "LATENTLM_JOB_CHUNK_PAUSE_S": "600"})
    try:
        deadline = time.time() + 120
        while c.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] == 0:
            assert w.alive(), w.output()
            assert time.time() < deadline, w.output()
            time.sleep(0.05)
        w.kill(signal.SIGKILL)
        mid = c.get(f"/v1/batches/{b['id']}").json()
        assert mid["status"] == "in_progress"
        assert mid["request_counts"] == {"total": 30, "completed": 2, "failed": 0}
        w = worker(store, tmp, env)  # restarted: the reaper re-enqueues the batch once the lease expires
        done = wait_batch(c, b["id"], timeout=90)
    finally:
        w.kill()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    out = _output(c, done)
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(ln["custom_id"] for ln in lines) and len(set(ids)) == 30  # exactly once
    for o in out[:5]:
        i = int(o["custom_id"].split("-")[1])
        close(o["response"]["body"], c.post("/v1/score", json=lines[i]["body"]).json())


def test_batch_cancel_before_a_worker_runs(c, store, tmp, redis_url):
    fid = upload(c, score_lines(6, seed=8))
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    r = c.post(f"/v1/batches/{b['id']}/cancel").json()
    assert r["status"] == "cancelling"
    w = worker(store, tmp, {"REDIS_URL": redis_url, **JOB_ENV})
    try:
        done = wait_batch(c, b["id"], timeout=60)
    finally:
        w.kill()
    assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 0
    assert c.get(f"/v1/files/{done['output_file_id']}/content").text == ""
    # finished: it can be deleted, with its output file
    assert c.delete(f"/v1/batches/{b['id']}").json() == {"id": b["id"], "object": "batch", "deleted": True}
    assert c.get(f"/v1/batches/{b['id']}").status_code == 404
    assert c.get(f"/v1/files/{done['output_file_id']}").status_code == 404
