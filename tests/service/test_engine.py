"""The engine process (`service.engine`, LATENTLM_ENGINE=process): one process owns the models and the batcher, the
API workers hand it their prepared requests over a Unix socket. On the CPU here, as on a GPU: its answers equal one
process's, requests from both workers share its batches, cancellation reaches it, it survives being killed, and it
follows reloads; the wire carries every error as the worker's own."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from latentlm import ops
from latentlm.models.errors import InputError, LimitExceeded, ModelNotFound
from latentlm.service import engine
from latentlm.service.batcher import Batcher, CancelScope, QueueFull
from latentlm.service.errors import APIError, ShuttingDown
from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

from .conftest import Server, add_model, close, metric, prepared

ENGINE = {"LATENTLM_ENGINE": "process"}


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of `pid`'s children."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(d.name)] = cmd
    return out


def _engine_pid(server: Server) -> int:
    pids = [p for p, cmd in _children(server.p.pid).items() if " engine " in cmd]
    assert len(pids) == 1, _children(server.p.pid)
    return pids[0]


REQUESTS = [
    ("/v1/score", {"model": "tiny", "input": ["w1 w2 w3", "w4 w5"], "token_logprobs": True}),
    ("/v1/score", {"model": "rank", "input": "w1 w2 w3 w9"}),
    ("/v1/posterior", {"model": "blocked", "input": ["w1 w2", "w3"], "top_k": 2}),
    ("/v1/posterior", {"model": "pcfg", "input": "w1 w2 w3"}),
    ("/v1/decode", {"model": "tiny", "input": "w1 w2 w3", "method": "mbr"}),
    ("/v1/embed", {"model": "lds", "input": "w1 w2 w3"}),
    ("/v1/sample", {"model": "tiny", "n": 3, "max_tokens": 6, "seed": 3}),
    ("/v1/sample", {"model": "tiny", "n": 2, "max_tokens": 8, "seed": 4,
                    "constraint": {"keywords": ["w3"]}}),
    ("/v1/constraint", {"model": "tiny", "prefix": "w1", "constraint": {"keywords": ["w5"]}, "max_tokens": 6,
                        "weights": True}),
    ("/v1/completions", {"model": "tiny", "prompt": ["w1 w2", "w3"], "max_tokens": 4, "seed": 1, "logprobs": 2,
                         "echo": True}),
    # errors: the engine's own (prepared again there) and the worker's, the same statuses and bodies
    ("/v1/score", {"model": "nope", "input": "w1"}),
    ("/v1/score", {"model": "tiny", "input": ""}),
    ("/v1/decode", {"model": "lds", "input": "w1"}),
    ("/v1/constraint", {"model": "tiny", "constraint": {"regex": "("}, "max_tokens": 4}),
]


def _comparable(path: str, r: httpx.Response) -> tuple[int, object]:
    body = r.json()
    if path == "/v1/completions" and r.status_code == 200:
        for k in ("id", "created"):
            body.pop(k)
    return r.status_code, body


def test_the_engine_answers_as_one_process_does(store, redis_url, tmp_path):
    for d in ("one", "engine"):
        (tmp_path / d).mkdir()
    # byte-for-byte answers need the same CPU engine in both: each process would calibrate on its own, and two
    # engines' float32 sums can differ in the last bit (every engine's numbers are tested equal within rounding)
    same_engine = {"LATENTLM_CALIBRATE": "0"}
    alone = Server(store, tmp_path / "one", env=same_engine)
    split = Server(store, tmp_path / "engine", env={**ENGINE, **same_engine, "REDIS_URL": redis_url,
                                                   "LATENTLM_WORKERS": "2", "LATENTLM_CACHE_TTL_S": "0"})
    try:
        kids = _children(split.p.pid)
        assert sorted(" engine " in c for c in kids.values()) == [False, False, True], kids
        for path, body in REQUESTS:
            want = _comparable(path, alone.client.post(path, json=body))
            got = _comparable(path, split.client.post(path, json=body))
            assert got == want, (path, body, got, want)
            assert got[0] == 200 or body["model"] in ("nope", "tiny", "lds"), (path, got)
        # streams: NDJSON posterior (computed slice by slice in the engine, sent as it comes) and SSE samples
        for body in ({"model": "tiny", "input": ["w1 w2 w3"] * 5, "stream": True},
                     {"model": "pcfg", "input": ["w1 w2 w3", "w4 w5"], "stream": True}):
            a, b = (s.client.post("/v1/posterior", json=body) for s in (alone, split))
            assert (b.status_code, b.headers["content-type"], b.text) == (a.status_code, a.headers["content-type"],
                                                                          a.text)
        body = {"model": "tiny", "n": 2, "max_tokens": 4, "seed": 9, "stream": True}
        a, b = (s.client.post("/v1/sample", json=body) for s in (alone, split))
        assert b.status_code == 200 and b.text == a.text
        body = {"model": "tiny", "prompt": "w1", "max_tokens": 3, "seed": 2, "stream": True}
        a, b = (s.client.post("/v1/completions", json=body) for s in (alone, split))
        strip = [ln.split('"object"', 1)[1] for ln in a.text.splitlines() if ln.startswith("data: {")]
        assert [ln.split('"object"', 1)[1] for ln in b.text.splitlines() if ln.startswith("data: {")] == strip
        # the engine's models are the only ones that ran: the workers calibrate nothing and hold no batcher threads
        assert "engine: 5 models on cpu" in split.output()
    finally:
        alone.stop()
        split.stop()
    assert split.p.returncode == 0, split.output()  # SIGTERM: the workers drain, then the engine stops


def test_requests_from_both_workers_share_the_engines_batches(store, redis_url, tmp_path):
    server = Server(store, tmp_path, env={**ENGINE, "REDIS_URL": redis_url, "LATENTLM_WORKERS": "2",
                                          "LATENTLM_CACHE_TTL_S": "0", "LATENTLM_MAX_QUEUE_DELAY_MS": "200"})
    n = 48
    try:
        barrier = threading.Barrier(n)
        answers: list[float] = []

        def one(i: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:  # a connection each: spread over the workers
                c.get("/health")
                barrier.wait()
                r = c.post("/v1/score", json={"model": "tiny", "input": f"w{i % 30} w{(i + 1) % 30} w3"})
                assert r.status_code == 200, r.text
                answers.append(r.json()["data"][0]["logprob"])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) == n
        deadline = time.time() + 10
        while True:
            text = server.client.get("/metrics").text
            if metric(text, "latentlm_batch_requests_sum", operation="score") == n:
                break
            assert time.time() < deadline, text
            time.sleep(0.2)
        batches = metric(text, "latentlm_batch_requests_count", operation="score")
        assert batches < n, (batches, n)  # merged: requests of both workers in the engine's batches
        served = [p for p, cmd in _children(server.p.pid).items() if " engine " not in cmd]
        assert len(served) == 2
    finally:
        server.stop()


def test_the_engine_is_started_again_and_follows_reloads(store, tmp_path):
    store2 = tmp_path / "store"
    shutil.copytree(store, store2)
    server = Server(store2, tmp_path, env={**ENGINE, "LATENTLM_WORKERS": "1"})
    try:
        c = server.client
        body = {"model": "tiny", "input": "w1 w2 w3"}
        before = c.post("/v1/score", json=body).json()["data"][0]["logprob"]
        os.kill(_engine_pid(server), signal.SIGKILL)
        deadline, seen = time.time() + 60, set()
        while True:  # while it is down: 503 engine_unavailable with Retry-After, never a 500
            r = c.post("/v1/score", json=body)
            if r.status_code == 200 and seen:
                break
            if r.status_code != 200:
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
                assert r.headers["retry-after"] == "1"
                assert c.get("/ready").status_code in (200, 503)
            seen.add(r.status_code)
            assert time.time() < deadline, server.output()
            time.sleep(0.05)
        assert r.json()["data"][0]["logprob"] == before
        assert "the engine (pid" in server.output() and "starting it again" in server.output()
        # a reload through the worker reaches the engine: a new model and a changed one are served at once
        add_model(store2, "fresh", "hmm", seed=11)
        shutil.rmtree(store2 / "tiny")
        add_model(store2, "tiny", "hmm", seed=12)
        r = c.post("/v1/models/reload")
        assert r.status_code == 200 and "fresh" in r.json()["added"] and r.json()["updated"] == ["tiny"], r.text
        assert c.post("/v1/score", json={"model": "fresh", "input": "w1"}).status_code == 200
        assert c.post("/v1/score", json=body).json()["data"][0]["logprob"] != before
        after = c.post("/v1/score", json={"model": "tiny", "input": [[1, 2, 3]]}).json()["data"][0]["logprob"]
        want = ops.run(ops.load_model(store2, "tiny"), "score", [[1, 2, 3]])[0]["logprob"]
        assert abs(after - want) < 1e-4
    finally:
        server.stop()
    assert server.p.returncode == 0, server.output()
    assert not _children(server.p.pid)


def test_a_client_that_goes_away_stops_its_stream_in_the_engine(store, tmp_path):
    server = Server(store, tmp_path, env={**ENGINE, "LATENTLM_WORKERS": "1", "LATENTLM_HEAVY_SLICE_COST": "1",
                                          "LATENTLM_POSTERIOR_STREAM_POSITIONS": "1"})
    try:
        body = {"model": "tiny", "input": ["w1 w2 w3 w4 w5 w6"] * 2000, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/posterior", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.time() + 20
        while True:  # the engine stopped it: cancelled at a slice boundary, the rest never computed
            text = server.client.get("/metrics").text
            if metric(text, "latentlm_cancelled_requests_total", lane="heavy") >= 1:
                break
            assert time.time() < deadline, text
            time.sleep(0.2)
        assert metric(text, "latentlm_heavy_slices_total", operation="posterior") < 200
    finally:
        server.stop()


def test_batch_jobs_run_in_the_engine_and_answer_as_one_process(store, tmp_path):
    """Without Redis, batch jobs run in the API worker's runner thread; with an engine process, their lines are
    computed there (merged, on its device), with the same output as one process, failing lines included."""
    from .test_api import upload, wait_batch

    lines = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/score",
              "body": {"model": "tiny" if i % 3 else "rank", "input": f"w{i % 30} w{(i * 7) % 30} w3",
                       "token_logprobs": True}} for i in range(40)]
    lines[5]["body"]["input"] = ""  # a line that fails alone: its own 422, the others still merged
    lines[9]["body"]["model"] = "nope"
    samples = [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/sample",
                "body": {"model": "tiny", "n": 2, "max_tokens": 5, "seed": i}} for i in range(4)]
    outs = []
    for d, env in (("one", {}), ("engine", {**ENGINE, "LATENTLM_WORKERS": "1", "LATENTLM_JOB_CHUNK_SIZE": "16"})):
        (tmp_path / d).mkdir()
        server = Server(store, tmp_path / d, env=env)
        try:
            got = {}
            for batch, endpoint in ((lines, "/v1/score"), (samples, "/v1/sample")):
                fid = upload(server.client, batch)
                b = server.client.post("/v1/batches", json={"input_file_id": fid, "endpoint": endpoint}).json()
                b = wait_batch(server.client, b["id"], timeout=120)
                assert b["status"] == "completed", b
                for key in ("output_file_id", "error_file_id"):
                    if b.get(key) is None:  # no line failed
                        continue
                    text = server.client.get(f"/v1/files/{b[key]}/content").text
                    for ln in text.splitlines():
                        row = json.loads(ln)
                        got[row["custom_id"]] = row["response"]
            if d == "engine":
                text = server.client.get("/metrics").text
                assert metric(text, "latentlm_batch_requests_count", operation="score") >= 1  # the engine ran them
            outs.append(got)
        finally:
            server.stop()
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) == 44
    for cid, want in outs[0].items():
        got = outs[1][cid]
        assert got["status_code"] == want["status_code"], (cid, got, want)
        if want["status_code"] == 200:
            close(got["body"], want["body"], path=cid)
        else:
            assert got["body"] == want["body"], cid
    assert outs[1]["s5"]["status_code"] == 422 and outs[1]["s9"]["status_code"] == 404


# -- in one process: the wire, the version a request was prepared on, arriving requests --------------------------
@pytest.mark.parametrize("error", [
    InputError("input[0]: empty", param="input[0]"), LimitExceeded("too long", param="input"),
    ModelNotFound("no model", param="model"), QueueFull("full"), ShuttingDown(),
    APIError(503, "reloading", param="model", code="model_reloading", headers={"Retry-After": "1"})])
def test_errors_cross_the_wire_as_themselves(error):
    back = engine.decode_error(engine.encode_error(error))
    assert type(back) is type(error)
    for attr in ("message", "param", "status", "code", "headers"):
        assert getattr(back, attr, None) == getattr(error, attr, None)


def test_an_unexpected_error_is_a_500_that_names_no_internals():
    back = engine.decode_error(engine.encode_error(KeyError("secret")))
    assert isinstance(back, APIError) and back.status == 500 and "secret" not in back.message


async def _with_engine(store: Path, tmp: Path, fn, **settings):
    """Run `fn(server, client_a, client_b)` with an engine on a socket in `tmp` and two clients (two workers)."""
    s = Settings(store=store, device="cpu", calibrate=False, state_dir=tmp / "state", **settings)
    server = engine.EngineServer(s, tmp / "e.sock")
    stop = asyncio.Event()
    task = asyncio.create_task(server.serve(stop))
    clients = [engine.EngineClient(tmp / "e.sock", Metrics()) for _ in range(2)]
    for c in clients:
        await c.start()
    deadline = time.monotonic() + 60
    while not all(c.ready for c in clients):
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
    try:
        return await fn(server, *clients)
    finally:
        for c in clients:
            await c.stop()
        stop.set()
        await task


def test_waiting_requests_of_two_workers_are_merged_and_answered_exactly(store, tmp_path):
    model = ops.load_model(store, "tiny")
    seqs = [[i % 30, (i * 7) % 30, 3] for i in range(40)]
    want = ops.run(model, "score", seqs, token_logprobs=True)

    async def go(server, a, b):
        # each worker has announced requests it has not sent: the engine's batch waits for them (max_queue_delay)
        tickets = [a.announce() for _ in range(20)] + [b.announce() for _ in range(20)]
        calls = [prepared(model, "score", [s], token_logprobs=True) for s in seqs]
        first = asyncio.create_task(b.submit(calls[20], tickets[20]))  # the engine hears of b's 19 others
        await asyncio.sleep(0.3)
        rest = await asyncio.gather(*[(a if i < 20 else b).submit(c, tickets[i]) for i, c in enumerate(calls)
                                      if i != 20])
        results = rest[:20] + [await first] + rest[20:]
        return results, server.metrics

    results, m = asyncio.run(_with_engine(store, tmp_path, go, max_queue_delay_ms=5000))
    for i, (r, w) in enumerate(zip(results, want, strict=True)):
        assert r[0]["index"] == 0
        assert r[0]["logprob"] == pytest.approx(w["logprob"], rel=1e-5, abs=1e-5), i
    assert m.batch_requests.labels("score")._sum.get() == 40
    assert sum(b.get() for b in m.batch_requests.labels("score")._buckets) == 1  # one batch of all 40


def test_the_engine_runs_each_call_as_prepared_and_compiles_nothing(store, tmp_path, monkeypatch):
    """One wire form for every operation (`ops.wire`): the engine runs the call a worker prepared (its options, the
    compiled automaton, a completion's prompts) as it is. Automaton compilations are counted at their one entry
    point (`Compiled.compile`, word-level and text constraints alike): one per constrained request, in the worker
    (a completion's three prompts share it), none in the engine; the answers equal the same calls run here."""
    from latentlm.models import constraint as automata
    from latentlm.ops import format, spec
    from latentlm.ops.requests import CompletionRequest, ConstraintRequest, SampleRequest
    from latentlm.service import execute

    compiled: list[tuple] = []
    real = automata.Compiled.compile

    def counted(self, key, budget, build):
        compiled.append(key)
        return real(self, key, budget, build)

    monkeypatch.setattr(automata.Compiled, "compile", counted)
    model = ops.load_model(store, "tiny")
    spec_c = {"include": [["w5"]], "max_tokens": 6}
    requests = [
        SampleRequest(model="tiny", n=3, max_tokens=8, seed=4, prefix="w1", constraint=spec_c),
        ConstraintRequest(model="tiny", prefix="w1", constraint=spec_c, weights=True, beam=4, n_best=2),
        CompletionRequest(model="tiny", prompt=["w1", "w2 w3", "w4"], max_tokens=6, n=2, seed=1, constraint=spec_c,
                          logprobs=2, echo=True),
        CompletionRequest(model="tiny", prompt="w1 w2", max_tokens=4, seed=3, logprobs=1)]
    ops_of = ["sample", "constraint", "completions", "completions"]
    limits = execute.limits(Settings(store=store, device="cpu", state_dir=tmp_path / "w"))

    async def go(server, a, b):
        out = []
        for op, req in zip(ops_of, requests, strict=True):
            call = execute.prepare(model, op, req, 1 << 20, limits=limits)
            before = len(compiled)
            out.append((call, await a.submit(call)))
            assert len(compiled) == before, (op, compiled[before:])  # the engine compiled nothing
        return out

    answered = asyncio.run(_with_engine(store, tmp_path, go))
    assert len(compiled) == 3, compiled  # one per constrained request
    for op, (call, got) in zip(ops_of, answered, strict=True):
        want = spec.get(op).run(call, None)
        if op == "completions":
            got, want = [format.fields(c) for c in got], [format.fields(c) for c in want]
        close(got, want, path=op)


def test_a_request_runs_on_the_version_it_was_prepared_on(store, tmp_path):
    store2 = tmp_path / "store"
    shutil.copytree(store, store2)
    old = ops.load_model(store2, "tiny")
    call = prepared(old, "score", [[1, 2, 3]])
    want_old = ops.run(old, "score", [[1, 2, 3]])[0]["logprob"]

    async def go(server, a, b):
        shutil.rmtree(store2 / "tiny")
        add_model(store2, "tiny", "hmm", seed=5)
        await a.models_changed()  # a worker reloaded: the engine now serves the new version
        assert server.registry.get("tiny").content_hash != old.content_hash
        first = await b.submit(call)  # prepared on the old one (the other worker has not reloaded yet)
        new = ops.load_model(store2, "tiny")
        second = await a.submit(prepared(new, "score", [[1, 2, 3]]))
        server.retired.clear()  # past RETIRED_S: the old version is gone
        with pytest.raises(APIError) as e:
            await b.submit(call)
        return first, second, new, e.value

    first, second, new, e = asyncio.run(_with_engine(store2, tmp_path, go))
    assert first[0]["logprob"] == pytest.approx(want_old, abs=1e-5)
    assert second[0]["logprob"] == pytest.approx(ops.run(new, "score", [[1, 2, 3]])[0]["logprob"], abs=1e-5)
    assert e.status == 503 and e.code == "model_reloading" and e.param == "model"


def test_a_model_the_engine_cannot_load_is_a_503_naming_why(store, tmp_path):
    store2 = tmp_path / "store"
    shutil.copytree(store, store2)
    call = prepared(ops.load_model(store2, "tiny"), "score", [[1, 2, 3]])
    weights = store2 / "tiny" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\xff" * 8  # the file no longer matches its manifest's hash
    weights.write_bytes(bytes(data))

    async def go(server, a, b):
        with pytest.raises(APIError) as e:
            await a.submit(call)
        return e.value, server.registry.failed

    e, failed = asyncio.run(_with_engine(store2, tmp_path, go))
    assert "tiny" in failed
    assert e.status == 503 and e.code == "model_unavailable" and e.param == "model"
    assert "sha-256 mismatch" in e.message.lower()


def test_a_cancelled_request_is_dropped_in_the_engine(store, tmp_path):
    model = ops.load_model(store, "tiny")

    async def go(server, a, b):
        scope = CancelScope()
        mine, other = a.announce(), a.announce()  # company announced: the engine's batch waits for it
        task = asyncio.create_task(a.submit(prepared(model, "score", [[1, 2]]), mine, scope=scope))
        await asyncio.sleep(0.2)
        scope.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        a.retract(other)  # none is coming now: the engine takes the batch at once, and drops the cancelled request
        ok = await b.submit(prepared(model, "score", [[3, 4]]))
        deadline = time.monotonic() + 10
        while server.batcher.cancelled.labels("light", "queued")._value.get() < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        return ok, a.pending

    ok, pending = asyncio.run(_with_engine(store, tmp_path, go, max_queue_delay_ms=2000))
    assert ok[0]["num_tokens"] == 2 and not pending


def test_the_engine_and_a_batcher_share_one_interface():
    import inspect

    from latentlm.service.batcher import Lanes

    members = [n for n in vars(Lanes) if not n.startswith("_")] + list(Lanes.__annotations__)
    assert {"submit", "stream", "ready", "fail_pending"} <= set(members)
    for name in members:
        for cls in (Batcher, engine.EngineClient):
            assert hasattr(cls, name), (cls, name)
            if inspect.isfunction(getattr(Lanes, name, None)):
                def params(f):
                    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

                assert params(getattr(cls, name)) == params(getattr(Lanes, name)), (cls, name)
