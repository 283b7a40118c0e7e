"""`latentlm.client` against real `latentlm serve` processes (uvicorn) on a tiny store: every typed call, the
stream iterators, the batch API, errors carrying status/param/code/message, and retries honouring Retry-After on a
server with a tight rate limit (sync and async)."""

from __future__ import annotations

import asyncio
import email.utils
import subprocess
import sys
import time

import httpx
import pytest

from latentlm.client import APIError, AsyncClient, Client, batch_lines, retry_after_s
from tests.service.conftest import Server, add_model, add_other_families, free_port


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("client-store")
    add_model(path, "tiny", "hmm", seed=0)
    add_other_families(path)  # pcfg, lds
    return path


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("client"), {"LATENTLM_CALIBRATE": "0", "LATENTLM_JOB_CHUNK_SIZE": "2",
                                                          "LATENTLM_JOB_CHUNK_PAUSE_S": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def limited(store, tmp_path_factory):
    """One request per second per client, no burst: the second of two quick requests gets 429 + Retry-After: 1."""
    s = Server(store, tmp_path_factory.mktemp("client-limited"), {
        "LATENTLM_CALIBRATE": "0", "LATENTLM_RATE_LIMIT_PER_KEY": "1", "LATENTLM_RATE_LIMIT_BURST": "1"})
    yield s
    s.stop()


def test_import_loads_nothing_of_the_server():
    """The client is httpx and the standard library only: no torch, pydantic, numpy or other latentlm module."""
    code = ("import sys, latentlm.client; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'pydantic', 'numpy', 'fastapi', 'orjson') or m.startswith('latentlm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['latentlm.client']"


def test_operations(server):
    direct = server.client
    with Client(server.url) as c:
        assert {"tiny", "pcfg", "lds"} <= {m["id"] for m in c.models()}
        assert c.model("tiny")["family"] == "hmm"
        s = c.score("tiny", ["w1 w2", "w3"], token_logprobs=True)
        assert s == direct.post("/v1/score", json={"model": "tiny", "input": ["w1 w2", "w3"],
                                                   "token_logprobs": True}).json()
        p = c.posterior("tiny", ["w1 w2 w3", "w4"], top_k=3)
        pieces = list(c.posterior_stream("tiny", ["w1 w2 w3", "w4"], top_k=3))
        assert pieces[-1]["object"] == "posterior.usage"
        streamed = [[] for _ in p["data"]]
        for piece in pieces[:-1]:
            streamed[piece["index"]].extend(piece["marginals"])
        assert streamed == [d["marginals"] for d in p["data"]]
        assert c.decode("tiny", "w1 w2")["data"][0]["states"] == direct.post(
            "/v1/decode", json={"model": "tiny", "input": "w1 w2"}).json()["data"][0]["states"]
        assert c.decode("pcfg", "w1 w2 w3", method="mbr")["data"][0]["index"] == 0
        samples = c.sample("tiny", n=3, max_tokens=5, seed=8, prefix="w1")
        events = list(c.sample_stream("tiny", n=3, max_tokens=5, seed=8, prefix="w1"))
        assert [e["object"] for e in events] == ["sample.chunk"] * 3 + ["sample.usage"]
        assert [{k: v for k, v in e.items() if k not in ("object", "model")} for e in events[:3]] == samples["data"]
        assert len(c.embed("lds", "w1 w2 w3")["data"][0]["embeddings"]) == 4  # <eos> appended
        comp = c.completions("tiny", "w1", max_tokens=4, n=2, seed=8, logprobs=1)
        chunks = list(c.completions_stream("tiny", "w1", max_tokens=4, n=2, seed=8, logprobs=1))
        assert all(ch["object"] == "text_completion" for ch in chunks)
        for choice in comp["choices"]:
            assert "".join(ch["choices"][0]["text"] for ch in chunks
                           if ch["choices"] and ch["choices"][0]["index"] == choice["index"]) == choice["text"]
        assert c.operation("score", {"model": "tiny", "input": "w1 w2"}) == direct.post(
            "/v1/score", json={"model": "tiny", "input": "w1 w2"}).json()


def test_constraint_calls(server):
    """`constraint` and `sample(constraint=...)` send what a hand-written body sends, sync and async."""
    direct = server.client
    cons = {"include": [["w1"]], "max_tokens": 6}
    with Client(server.url) as c:
        got = c.constraint("tiny", cons, prefix="w2", weights=True)
        assert got == direct.post("/v1/constraint", json={"model": "tiny", "constraint": cons, "prefix": "w2",
                                                          "weights": True}).json()
        samples = c.sample("tiny", n=2, seed=3, constraint=cons)
        assert samples == direct.post("/v1/sample", json={"model": "tiny", "n": 2, "seed": 3,
                                                          "constraint": cons}).json()
        assert all("w1" in d["tokens"] for d in samples["data"])

    async def run() -> tuple[dict, dict]:
        async with AsyncClient(server.url) as c:
            return await c.constraint("tiny", cons, prefix="w2", weights=True), await c.sample(
                "tiny", n=2, seed=3, constraint=cons)

    assert asyncio.run(run()) == (got, samples)


@pytest.mark.parametrize("op", ["score", "posterior", "decode", "embed", "sample", "constraint"])
def test_typed_calls_cover_every_request_field(op):
    """Every field of an operation's request model is a parameter of both clients' typed call (a field added to a
    request model and not to the client fails here); `stream` is the `*_stream` call's."""
    import inspect

    from latentlm.ops import spec

    fields = set(spec.get(op).request.model_fields) - {"model", "stream"}
    for cls in (Client, AsyncClient):
        params = set(inspect.signature(getattr(cls, op)).parameters) - {"self", "model"}
        assert fields <= params, (cls.__name__, op, sorted(fields - params))
        assert params <= fields, (cls.__name__, op, sorted(params - fields))


def test_errors_carry_status_param_code_message(server):
    with Client(server.url, max_retries=0) as c:
        cases = [(lambda: c.score("nosuch", "w1"), 404, "model", "model_not_found"),
                 (lambda: c.operation("score", {"model": "tiny", "input": "w1", "extra": 1}), 422, "extra",
                  "unknown_field"),
                 (lambda: c.sample("tiny", n=1000, max_tokens=1000), 413, "max_tokens", "limit_exceeded"),
                 (lambda: c.embed("tiny", "w1"), 400, "model", "unsupported_operation"),
                 (lambda: c.completions("pcfg", "w1"), 400, "model", "unsupported_model"),
                 (lambda: list(c.sample_stream("tiny", temperature=-1)), 422, "temperature", "invalid_value")]
        for call, status, param, code in cases:
            with pytest.raises(APIError) as info:
                call()
            e = info.value
            assert (e.status, e.param, e.code) == (status, param, code), e
            assert e.message and e.type
    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff_s=0.01) as c:
        with pytest.raises(APIError) as info:
            c.models()
        assert info.value.status == 0 and info.value.code == "connection_error"


def test_batches(server):
    reqs = [(f"r{i}", {"model": "tiny", "input": f"w{i} w{i + 1}"}) for i in range(3)]
    with Client(server.url) as c:
        f = c.upload_file(batch_lines(reqs, "/v1/score"), filename="in.jsonl")
        assert c.get_file(f["id"])["filename"] == "in.jsonl"
        assert c.file_content(f["id"]).decode() == batch_lines(reqs, "/v1/score")
        b = c.create_batch(f["id"], "/v1/score", metadata={"why": "test"})
        done = c.wait_batch(b["id"], timeout_s=120, poll_s=0.1)
        assert done["status"] == "completed", done
        lines = list(c.batch_results(b["id"]))
        assert [r["custom_id"] for r in lines] == ["r0", "r1", "r2"]
        for (_, body), r in zip(reqs, lines, strict=True):
            assert r["response"]["body"]["data"] == c.score(**body)["data"]
        assert b["id"] in {x["id"] for x in c.list_batches()["data"]}
        with pytest.raises(APIError) as info:
            c.cancel_batch(b["id"])
        assert (info.value.status, info.value.code) == (409, "batch_finished")
        assert c.delete_batch(b["id"])["deleted"] is True
        many = [(f"m{i}", {"model": "tiny", "input": "w1 w2"}) for i in range(40)]  # 20 chunks, 1 s apart
        long = c.create_batch(c.upload_file(batch_lines(many, "/v1/score"))["id"], "/v1/score")
        assert c.cancel_batch(long["id"])["status"] in ("cancelling", "cancelled")
        assert c.wait_batch(long["id"], timeout_s=60, poll_s=0.1)["status"] == "cancelled"
        assert c.delete_file(f["id"])["deleted"] is True


def test_upload_file_streams_a_path(server, tmp_path):
    """A path is sent in pieces as it is read (tracemalloc's peak a small part of the file), by both clients."""
    import tracemalloc

    reqs = [(f"r{i}", {"model": "tiny", "input": " ".join(["w1"] * 2000)}) for i in range(600)]
    path = tmp_path / "big.jsonl"
    path.write_text(batch_lines(reqs, "/v1/score"))
    size = path.stat().st_size
    with Client(server.url) as c:
        tracemalloc.start()
        try:
            f = c.upload_file(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert (f["bytes"], f["filename"]) == (size, "big.jsonl")
        assert c.file_content(f["id"]) == path.read_bytes()
        assert peak < size / 4, (peak, size)

    async def go():
        async with AsyncClient(server.url) as c:
            return await c.upload_file(path, filename="again.jsonl")

    f2 = asyncio.run(go())
    assert (f2["bytes"], f2["filename"]) == (size, "again.jsonl")


def test_async_client(server):
    async def go():
        async with AsyncClient(server.url) as c:
            models = await c.models()
            s = await c.score("tiny", "w1 w2", token_logprobs=True)
            pieces = [p async for p in c.posterior_stream("tiny", "w1 w2", top_k=2)]
            whole = await c.posterior("tiny", "w1 w2", top_k=2)
            samples = await c.sample("tiny", n=2, max_tokens=3, seed=4)
            events = [e async for e in c.sample_stream("tiny", n=2, max_tokens=3, seed=4)]
            comp = await c.completions("tiny", "w1", max_tokens=3, seed=4)
            chunks = [ch async for ch in c.completions_stream("tiny", "w1", max_tokens=3, seed=4)]
            f = await c.upload_file(batch_lines([("a", {"model": "tiny", "input": "w1"})], "/v1/score"))
            b = await c.wait_batch((await c.create_batch(f["id"], "/v1/score"))["id"], timeout_s=60, poll_s=0.1)
            results = [r async for r in c.batch_results(b["id"])]
            try:
                await c.decode("tiny", "w1", method="nosuch")
            except APIError as e:
                err = e
            return models, s, pieces, whole, samples, events, comp, chunks, results, err

    models, s, pieces, whole, samples, events, comp, chunks, results, err = asyncio.run(go())
    assert "tiny" in {m["id"] for m in models}
    assert s["data"][0]["tokens"] == ["w1", "w2", "<eos>"]
    assert pieces[0]["marginals"] == whole["data"][0]["marginals"]
    assert [e for e in events if e["object"] == "sample.chunk"][1]["ids"] == samples["data"][1]["ids"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == comp["choices"][0]["text"]
    assert results[0]["response"]["status_code"] == 200
    assert (err.status, err.param) == (400, "method")


def test_retries_honour_retry_after(limited):
    seen: list[tuple[int, str | None]] = []

    def record(resp: httpx.Response) -> None:
        seen.append((resp.status_code, resp.headers.get("retry-after")))

    with Client(limited.url, max_retries=4) as c:
        c.http.event_hooks["response"].append(record)
        t0 = time.monotonic()
        results = [c.score("tiny", "w1 w2") for _ in range(3)]
        elapsed = time.monotonic() - t0
    assert all(r["data"][0]["num_tokens"] == 3 for r in results)
    assert (429, "1") in seen and seen[-1][0] == 200
    assert elapsed >= 0.9 * sum(1 for status, _ in seen if status == 429)  # waited Retry-After each time
    with Client(limited.url, max_retries=0) as c:
        with pytest.raises(APIError) as info:
            for _ in range(3):
                c.score("tiny", "w1")
    e = info.value
    assert (e.status, e.code, e.retry_after) == (429, "rate_limited", 1.0)
    with Client(limited.url, max_retries=5, max_retry_wait_s=0.1) as c:  # a Retry-After above the cap: no wait
        t0 = time.monotonic()
        with pytest.raises(APIError) as info:
            for _ in range(3):
                c.score("tiny", "w1")
        assert info.value.status == 429 and time.monotonic() - t0 < 0.9

    async def go() -> list[dict]:
        async with AsyncClient(limited.url, max_retries=4) as c:
            return [await c.sample("tiny", max_tokens=2, seed=i) for i in range(3)]

    assert len(asyncio.run(go())) == 3


def test_retry_after_forms():
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({}) is None and retry_after_s({"retry-after": "soon"}) is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= retry_after_s({"retry-after": later}) <= 31
