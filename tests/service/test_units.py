"""In-process tests of the service parts: batcher (merging, queue limit), registry versions, settings,
error mapping, JSON output and the `serve` default-model step."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from latentlm import ops
from latentlm.cli.serve import ServeError, ensure_default_model
from latentlm.models.errors import InputError, LimitExceeded, ModelNotFound, UnsupportedOperation
from latentlm.ops import dumps
from latentlm.service.batcher import Batcher, QueueFull
from latentlm.service.errors import describe_validation, from_model_error
from latentlm.service.jobs import parse_input_file
from latentlm.service.metrics import Metrics
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings
from tests.service.conftest import add_model, blocking_call, close, prepared


def test_batcher_merges_and_splits(base_store):
    m = ops.load_model(base_store, "tiny")
    reqs = [[[1, 2, 3], [4, 5]], [[6] * 7], [[7, 8], [9], [10, 11, 12]]]

    async def go():
        b = Batcher(Metrics(), max_queue_delay_ms=50)
        await b.start()
        try:
            return await asyncio.gather(*(b.submit(prepared(m, "score", r, token_logprobs=True)) for r in reqs))
        finally:
            await b.stop()

    outs = asyncio.run(go())
    for r, out in zip(reqs, outs, strict=True):
        assert [o["index"] for o in out] == list(range(len(r)))
        close(out, ops.run(m, "score", r, token_logprobs=True))


def test_batcher_queue_full_and_per_request_errors(base_store):
    m = ops.load_model(base_store, "tiny")
    started, gate = threading.Event(), threading.Event()

    def block() -> None:  # occupies the inference thread until the gate opens
        started.set()
        assert gate.wait(30)

    async def go():
        b = Batcher(Metrics(), max_queue=2, max_queue_delay_ms=0)
        await b.start()
        try:
            blocker = asyncio.ensure_future(b.submit(blocking_call(m, block)))
            assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
            assert b.depth == 0  # the blocker left the queue: the thread is busy with it
            waiting = [asyncio.ensure_future(b.submit(prepared(m, "score", [[1, 2]]))) for _ in range(2)]
            await asyncio.sleep(0)  # one loop turn: both tasks run up to their await, i.e. are queued
            assert b.depth == 2
            with pytest.raises(QueueFull):
                await b.submit(prepared(m, "score", [[3]]))
            gate.set()
            await blocker
            ok = await asyncio.gather(*waiting)
            # one bad request in a merged batch fails alone
            bad_call = prepared(m, "score", [[1, 2]])
            bad_call.seqs = [[1, 999]]  # past the checks prepare makes: the model itself fails on it
            bad = b.submit(bad_call)
            good = b.submit(prepared(m, "score", [[1, 2]]))
            res = await asyncio.gather(bad, good, return_exceptions=True)
            return ok, res
        finally:
            await b.stop()

    ok, (bad, good) = asyncio.run(go())
    assert len(ok) == 2 and ok[0] == ok[1]
    assert isinstance(bad, Exception) and isinstance(good, list)


def test_registry_versions(tmp_path):
    add_model(tmp_path, "a", seed=1)
    reg = ModelRegistry(tmp_path)
    assert reg.reload() == {"added": ["a"], "updated": [], "removed": [], "failed": []}
    old = reg.get("a")
    add_model(tmp_path, "a", seed=2)
    assert reg.reload()["updated"] == ["a"]
    new = reg.get("a")
    assert new is not old and new.content_hash != old.content_hash
    # a request holding the old version still computes with it
    r_old = ops.run(old, "score", [[1, 2]])[0]["logprob"]
    assert r_old != ops.run(new, "score", [[1, 2]])[0]["logprob"]
    assert reg.reload() == {"added": [], "updated": [], "removed": [], "failed": []}
    import json

    mpath = tmp_path / "a" / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"]["weights.safetensors"] = "0" * 64  # a half-written update: hash mismatch on load
    mpath.write_text(json.dumps(manifest))
    out = reg.reload()
    assert out["failed"] == ["a"] and reg.get("a") is new  # the last good version keeps serving
    with pytest.raises(ModelNotFound):
        reg.get("b")


def test_settings_from_env(monkeypatch):
    s = Settings()
    assert s.max_payload_bytes == 2_000_000 and s.api_keys == "" and s.redis_url == ""
    monkeypatch.setenv("LATENTLM_MAX_BATCH_TOKENS", "123")
    monkeypatch.setenv("LATENTLM_MAX_QUEUE_DELAY_MS", "7.5")
    monkeypatch.setenv("LATENTLM_API_KEYS", " a, b ,")
    monkeypatch.setenv("REDIS_URL", "redis://x:1/0")
    s = Settings.from_env(port=None, device="cpu")
    assert (s.max_batch_tokens, s.max_queue_delay_ms, s.keys, s.device) == (123, 7.5, ["a", "b"], "cpu")
    assert s.cache_redis_url == "redis://x:1/0"
    monkeypatch.setenv("LATENTLM_MAX_QUEUE", "many")
    with pytest.raises(ValueError, match="LATENTLM_MAX_QUEUE"):
        Settings.from_env()


def test_error_mapping():
    assert from_model_error(InputError("x", param="input")).status == 422
    assert from_model_error(ModelNotFound("x")).status == 404
    assert from_model_error(LimitExceeded("x")).status == 413
    assert from_model_error(UnsupportedOperation("x")).status == 400
    e = describe_validation([{"type": "int_parsing", "loc": ("body", "top_k", "int"), "msg": "bad"}])
    assert e.param == "top_k" and e.message == "top_k: bad"


def test_dumps_non_finite():
    assert dumps({"a": [1.0, math.inf, -math.inf, math.nan]}) == b'{"a":[1.0,null,null,null]}'


def test_parse_input_file():
    reqs, errs = parse_input_file(b'{"custom_id": "a", "method": "POST", "url": "/v1/score", "body": {}}\n\n',
                                  "/v1/score")
    assert len(reqs) == 1 and errs == []
    _, errs = parse_input_file(b"\xff", "/v1/score")
    assert "UTF-8" in errs[0]["message"]
    _, errs = parse_input_file(b"", "/v1/score")
    assert errs[0]["code"] == "empty_file"
    _, errs = parse_input_file(b'{"custom_id": "a", "url": "/v1/score", "body": {}, "x": 1}', "/v1/score")
    assert errs[0]["param"] == "x"


def test_serve_builds_default_model_into_empty_store(tmp_path):
    calls = []

    def builder(store):
        calls.append(store)
        add_model(store, "default")

    store = tmp_path / "empty"
    assert ensure_default_model(store, builder) == ["default"]
    assert ensure_default_model(store, builder) == ["default"] and len(calls) == 1  # not rebuilt
    with pytest.raises(ServeError, match="no model"):
        ensure_default_model(tmp_path / "other", lambda s: None)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_ready_503_until_models_load(base_store, tmp_path):
    from fastapi.testclient import TestClient

    from latentlm.service.app import create_app

    app = create_app(Settings(store=base_store, device="cpu", state_dir=tmp_path))
    reg = app.state.registry
    gate = threading.Event()
    real = reg.reload

    def slow_reload():
        gate.wait(30)
        return real()

    reg.reload = slow_reload
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = c.post("/v1/score", json={"model": "tiny", "input": "w1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        gate.set()
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "not ready 60 s after the models could load"
            threading.Event().wait(0.05)
        assert c.post("/v1/score", json={"model": "tiny", "input": "w1"}).status_code == 200


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_health_answers_while_a_batch_computes(base_store, tmp_path, monkeypatch):
    """The batch is held inside the model call until /health has answered: no timing involved."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from latentlm.service.app import create_app

    entered, release = threading.Event(), threading.Event()
    real = ops.run

    def held_run(model, op, seqs, **kw):
        entered.set()
        assert release.wait(60), "the test never released the batch"
        return real(model, op, seqs, **kw)

    from latentlm.ops import batching

    monkeypatch.setattr(batching, "run", held_run)  # where the batcher's merged run calls it
    app = create_app(Settings(store=base_store, device="cpu", state_dir=tmp_path))
    with TestClient(app) as c, ThreadPoolExecutor(1) as pool:
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "models not loaded after 60 s"
            threading.Event().wait(0.05)
        pending = pool.submit(c.post, "/v1/score", json={"model": "tiny", "input": [[1, 2, 3]]})
        try:
            assert entered.wait(60), "the batch never reached the model call"
            assert not pending.done()
            assert c.get("/health").json() == {"status": "ok"}  # answered while the batch is held
            assert not pending.done()
        finally:
            release.set()
        r = pending.result(60)
    assert r.status_code == 200, r.text
    close(r.json()["data"], real(ops.load_model(base_store, "tiny"), "score", [[1, 2, 3]]))


def test_worker_needs_redis_and_serve_checks_device(tmp_path, capsys):
    import torch

    from latentlm.cli import main
    from latentlm.service.worker import run_worker

    with pytest.raises(SystemExit, match="REDIS_URL"):
        run_worker(Settings(store=tmp_path, redis_url=""))
    if not torch.cuda.is_available():
        assert main(["serve", "--store", str(tmp_path), "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_batcher_waits_only_when_company_is_coming(base_store):
    """The queue delay is a minute, so neither outcome depends on timing: a request that waited for the
    delay would time out; one that did not wait for announced company would be a batch of its own."""
    m = ops.load_model(base_store, "tiny")

    async def go(announced: bool) -> float:
        met = Metrics()
        b = Batcher(met, max_queue_delay_ms=60_000)
        await b.start()
        try:
            t1, t2 = (b.announce(), b.announce()) if announced else (None, None)
            first = asyncio.ensure_future(b.submit(prepared(m, "score", [[1, 2]]), t1))
            if announced:  # the first waits for the second (the sleep only gives a wrong batcher a chance)
                await asyncio.sleep(0.05)
                assert not first.done()
            else:  # nobody is coming: the lone request goes at once, not after the delay
                await asyncio.wait_for(asyncio.shield(first), 30)
            second = asyncio.ensure_future(b.submit(prepared(m, "score", [[3]]), t2))
            await asyncio.wait_for(asyncio.gather(first, second), 30)  # the second completes the batch
            return met.registry.get_sample_value("latentlm_batch_requests_count", {"operation": "score"})
        finally:
            await b.stop()

    assert asyncio.run(go(True)) == 1  # the first request waited for the announced second: one batch
    assert asyncio.run(go(False)) == 2  # two batches of one


def test_coalescing_transport_sends_head_and_body_together():
    from latentlm.service.transport import CoalescingTransport

    class Fake:
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, data):
            self.writes.append(data)

        def close(self):
            self.closed = True

        def is_closing(self):
            return self.closed

    async def go():
        loop = asyncio.get_running_loop()
        fake = Fake()
        t = CoalescingTransport(fake, loop)
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"{}")
        assert fake.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]  # one write
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # a response without a body: flushed on the next turn
        assert len(fake.writes) == 1
        await asyncio.sleep(0)
        assert fake.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.close()  # held bytes go out before the close
        assert fake.writes[-1] == b"HTTP/1.1 200 OK\r\n\r\n" and fake.closed and t.is_closing()
        await asyncio.sleep(0)
        assert len(fake.writes) == 3  # the scheduled flush finds nothing held

    asyncio.run(go())


def test_cache_key_holds_the_scoring_precision(tmp_path):
    """A bfloat16-storage server and a float32 one sharing a Redis never answer with each other's numbers: the
    key holds `LoadedModel.numerics`; everything else about the request keys the same."""
    from latentlm.service import execute
    from latentlm.service.schemas import ScoreRequest

    add_model(tmp_path, "blk", "blocked_hmm")
    req = ScoreRequest(model="blk", input=[[1, 2, 3]])
    keys = {}
    for precision in ("float32", "bfloat16", "tfloat32"):
        m = ops.load_model(tmp_path, "blk")
        m.impl.set_storage_dtype(precision)
        assert m.numerics() == f"float32-{precision}"
        keys[precision] = execute.cache_key(prepared(m, "score", req.input))
    assert len(set(keys.values())) == 3
    assert {k.replace(f"-{p}:", ":") for p, k in keys.items()} == {keys["float32"].replace("-float32:", ":")}


def test_run_calls_merges_what_merges_and_keeps_each_calls_error(base_store):
    """`spec.run_calls` (batch jobs, here or through an engine process): calls of one model version, operation and
    options go as one merged call with their summed cost, a lone call goes as itself, and when a merged call fails
    each call runs alone and only the bad one gets the error."""
    from latentlm.ops import spec

    m = ops.load_model(base_store, "tiny")
    calls = [prepared(m, "score", [[1, 2, 3], [4, 5]]), prepared(m, "score", [[6] * 7]),
             prepared(m, "score", [[7, 8]], token_logprobs=True), prepared(m, "score", [[9], [10, 11, 12]])]
    sent: list[spec.Call] = []

    def run_call(call, cap):
        sent.append(call)
        if any(s == [6] * 7 for s in call.seqs):
            raise InputError("a poisoned line", param="input")
        return spec.run_call_here(call, cap)

    out = spec.run_calls(calls, None, run_call)
    merged = sent[0]
    assert merged.seqs == [[1, 2, 3], [4, 5], [6] * 7, [9], [10, 11, 12]] and merged.request is None
    assert merged.cost == calls[0].cost + calls[1].cost + calls[3].cost and merged.input_tokens == 16
    assert [c.seqs for c in sent[1:4]] == [calls[0].seqs, calls[1].seqs, calls[3].seqs]  # the merged one failed
    assert [c.cost for c in sent[1:4]] == [calls[0].cost, calls[1].cost, calls[3].cost]
    assert sent[4] is calls[2] and len(sent) == 5  # alone in its options: sent as prepared
    assert isinstance(out[1], InputError)
    for j in (0, 2, 3):
        close(out[j], ops.run(m, "score", calls[j].seqs, **calls[j].opts))
    assert spec.run_calls([], None, run_call) == []
    out = spec.run_calls([calls[0], calls[3]], 64)  # in this process, merged, each renumbered from 0
    assert [[r["index"] for r in o] for o in out] == [[0, 1], [0, 1]]
    close(out[1], ops.run(m, "score", calls[3].seqs))
