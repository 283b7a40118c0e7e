"""Fairness and budgets (issue 16, items 1-2) against real `latentlm serve` processes: every request's cost is
estimated before any work and refused over the budget (413 naming it); heavy requests run in their own lane, so a
light request answers in under a second while a maximal accepted heavy request computes; a client that goes away
has its work dropped or stopped at the next slice; posteriors stream as NDJSON equal to the non-streamed answer."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from latentlm import ops
from latentlm.models.registry import save_artifact
from latentlm.ops.batching import slices
from latentlm.service import execute
from latentlm.service.schemas import SampleRequest
from latentlm.service.settings import Settings
from tests.service.conftest import Server, V, close, err, metric, vocab

PCFG_WORDS = 40  # sentence length of the heavy PCFG Viterbi requests


@pytest.fixture(scope="module")
def fair_store(base_store, tmp_path_factory):
    """The base store plus a dense PCFG (Viterbi: n^3 x nt x S^2 per sentence) and a 128-state HMM."""
    from latentlm.models.dense_pcfg import random_dense_pcfg

    dst = tmp_path_factory.mktemp("fairstore") / "store"
    shutil.copytree(base_store, dst)
    t, c = random_dense_pcfg(10, 20, V, seed=5)
    save_artifact(dst, "dpcfg", "dense_pcfg", t, vocab(), config=c)
    from latentlm.models.synthetic import random_hmm

    t, c = random_hmm(128, V, seed=7)
    save_artifact(dst, "wide", "hmm", t, vocab(), config=c)
    return dst


@pytest.fixture(scope="module")
def server(fair_store, tmp_path_factory):
    s = Server(fair_store, tmp_path_factory.mktemp("fair"), env={"LATENTLM_POSTERIOR_STREAM_POSITIONS": "7",
                                                                  "LATENTLM_MAX_POSTERIOR_ENTRIES": "5000",
                                                                  # the heavy stream below sends 15.4M entries
                                                                  "LATENTLM_MAX_STREAM_ENTRIES": "20000000"})
    s.fair_store = fair_store
    yield s
    s.stop()


def sentences(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rnd = random.Random(seed)
    return [[rnd.randrange(V - 2) for _ in range(length)] for _ in range(n)]


def heavy_viterbi_body(budget: int = Settings().max_request_cost, fraction: float = 0.9) -> dict:
    """A dense-PCFG Viterbi request whose estimated cost is `fraction` of the budget (maximal, accepted)."""
    return {"model": "dpcfg", "method": "viterbi", "input": sentences(_sentences_for(budget, fraction), PCFG_WORDS)}


def _sentences_for(budget: int, fraction: float) -> int:
    # the estimate per sentence, as ops.operation_cost computes it for dpcfg (nt 10, S 30)
    nt, S, L = 10, 30, PCFG_WORDS
    per = L * (L * L - 1) // 6 * ops.PCFG_VITERBI_FACTOR * nt * S * S + L * L * (S * S + ops.ENTRY_COST // 2) \
        + ops.TOKEN_COST * L
    return max(1, int(budget * fraction // per))


def light_latencies(url: str, seconds: float, model: str = "tiny") -> list[float]:
    """Light score requests one after another for `seconds`; their latencies."""
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            r = c.post("/v1/score", json={"model": model, "input": ["w1 w2 w3 w4", "w5 w6"]})
            out.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            assert int(r.headers["x-cost"]) > 0
    return out


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except Exception as e:  # the test inspects it
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def heavy_lane(server) -> float:
    return metric(server.client.get("/metrics").text, "latentlm_heavy_lane_requests")


def wait_for(cond, timeout: float) -> float:
    start = time.perf_counter()
    while not cond():
        if time.perf_counter() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.05)
    return time.perf_counter() - start


# -- estimates and budgets -------------------------------------------------------------------------------
def test_slices_and_estimates(fair_store):
    assert slices([5, 5, 5, 20, 1], 10) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert slices([], 10) == [] and slices([50], 10) == [(0, 1)]
    tiny = ops.load_model(fair_store, "tiny")
    rank = ops.load_model(fair_store, "rank")
    dp = ops.load_model(fair_store, "dpcfg")
    # chains: tokens x width^2 (+ a floor per token); linear in tokens
    assert ops.operation_cost(tiny, "score", [[1] * 200]) == 2 * ops.operation_cost(tiny, "score", [[1] * 100])
    assert ops.operation_cost(tiny, "score", [[1] * 10]) == 10 * (16 * 16 + ops.TOKEN_COST)
    assert ops.operation_cost(rank, "score", [[1] * 10]) == 10 * (8 * 8 + ops.TOKEN_COST)  # rank r = 8
    # rank Viterbi spans the m states: m^2 (r + 1) per token
    assert ops.operation_cost(rank, "decode", [[1] * 10], method="viterbi") == 10 * (32 * 32 * 9 + 30_000)
    # posterior: more listed states cost more
    assert ops.operation_cost(tiny, "posterior", [[1] * 10]) > ops.operation_cost(tiny, "posterior", [[1] * 10],
                                                                                  top_k=1)
    # PCFGs: cubic in the sentence length
    c1, c2 = (ops.operation_cost(dp, "decode", [[1] * n], method="viterbi") for n in (20, 40))
    assert 7 < c2 / c1 < 9
    # sampling: n x max_tokens steps plus the prefix
    s1 = ops.operation_cost(tiny, "sample", n=1, max_tokens=1000)
    assert ops.operation_cost(tiny, "sample", n=1, max_tokens=2000) == 2 * s1
    assert ops.operation_cost(tiny, "sample", n=1, max_tokens=1000, prefix_tokens=500) > s1
    # the sample check returns the estimate and refuses over the budget, naming it
    req = SampleRequest(model="tiny", n=2, max_tokens=100, prefix="w1 w2")
    cost = execute.check_sample(req, 100_000, model=tiny, max_request_tokens=10, max_cost=10**15)
    assert cost == ops.operation_cost(tiny, "sample", n=2, max_tokens=100, prefix_tokens=2)
    with pytest.raises(Exception) as e:
        execute.check_sample(req, 100_000, model=tiny, max_request_tokens=10, max_cost=cost - 1)
    assert e.value.status == 413 and e.value.param == "max_tokens" and e.value.code == "budget_exceeded"
    assert "LATENTLM_MAX_REQUEST_COST" in e.value.message and f"{cost:,}" in e.value.message


def test_batch_lines_are_held_to_the_same_budget(fair_store, tmp_path):
    """A batch job's line over the cost budget fails alone with 413 budget_exceeded; its neighbours run."""
    from latentlm.service.jobs import execute_lines
    from latentlm.service.registry import ModelRegistry

    models = ModelRegistry(fair_store, calibrate=False)
    models.reload()
    settings = Settings(store=fair_store, state_dir=tmp_path, max_request_cost=10_000_000)
    bodies = [{"model": "wide", "input": [[1, 2, 3]]}, {"model": "wide", "input": [[1] * 2000]}]
    (ok, _), (status, body) = execute_lines(models, "score", bodies, settings)
    assert ok == 200 and status == 413
    assert body["error"]["code"] == "budget_exceeded" and "LATENTLM_MAX_REQUEST_COST" in body["error"]["message"]
    (status, body), = execute_lines(models, "sample", [{"model": "wide", "n": 64, "max_tokens": 200}], settings)
    assert status == 413 and body["error"]["code"] == "budget_exceeded"


def test_default_budget_passes_maximal_requests_on_the_default_model_shape():
    """The previous default model (1,024-state rank HMM, rank 256): the largest score, posterior (top_k 1), MBR
    decode and sample the other limits allow are within the default budget; a 200k-token Viterbi over its states
    is not."""
    from latentlm.models.rank_hmm import RankHMM

    class Impl(RankHMM):  # the shape only (no tensors): what operation_cost reads
        def __init__(self):
            pass
        num_states, rank, states_per_token, extras = 1024, 256, 1024, {}
        operations = frozenset({"score", "posterior", "decode", "sample"})
        default_method = "viterbi"

    m = type("M", (), {"impl": Impl(), "vocab": range(10_000)})()
    s = Settings()
    T = s.max_request_tokens
    assert ops.operation_cost(m, "score", [[1] * T]) <= s.max_request_cost
    assert ops.operation_cost(m, "posterior", [[1] * T], top_k=1) <= s.max_request_cost
    assert ops.operation_cost(m, "decode", [[1] * T], method="mbr") <= s.max_request_cost
    assert ops.operation_cost(m, "sample", n=1, max_tokens=s.max_sample_tokens, prefix_tokens=T) <= s.max_request_cost
    assert ops.operation_cost(m, "sample", n=s.max_sample_tokens, max_tokens=1, prefix_tokens=T) <= s.max_request_cost
    assert ops.operation_cost(m, "decode", [[1] * T], method="viterbi") > s.max_request_cost
    # the lane threshold sits far below the budget, above a full light batch of the tiny test model
    assert s.heavy_request_cost < s.max_request_cost


def test_default_budget_passes_every_maximal_request_on_the_blocked_default_model():
    """The default model since 2026-11-27 (a VL-HMM, 4,096 states in 128 clusters of 32): the largest
    request of every operation the other limits allow, Viterbi included (k^2 per token), is within the
    default budget."""
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.synthetic import random_blocked_hmm

    t, c = random_blocked_hmm(128, 32, 10_000)
    m = type("M", (), {"impl": BlockedHMM.from_tensors(t, c), "vocab": range(10_000)})()
    s = Settings()
    T = s.max_request_tokens
    for op, kw in (("score", {}), ("posterior", {"top_k": 1}), ("decode", {"method": "mbr"}),
                   ("decode", {"method": "viterbi"})):
        assert ops.operation_cost(m, op, [[1] * T], **kw) <= s.max_request_cost, (op, kw)
    assert ops.operation_cost(m, "sample", n=1, max_tokens=s.max_sample_tokens, prefix_tokens=T) <= s.max_request_cost


def test_budget_refused_before_any_work(server):
    c = server.client
    body = heavy_viterbi_body(fraction=1.5)
    t = time.perf_counter()
    r = c.post("/v1/decode", json=body)
    took = time.perf_counter() - t
    e = err(r, 413, "input", "above the budget of 2,000,000,000,000 per request")
    assert e["code"] == "budget_exceeded" and "LATENTLM_MAX_REQUEST_COST" in e["message"]
    assert "estimated cost of this decode request is" in e["message"]
    assert took < 2.0  # refused on the estimate; the work would take minutes
    assert heavy_lane(server) == 0
    # an accepted request says its estimate
    r = c.post("/v1/score", json={"model": "tiny", "input": "w1 w2"})
    assert r.status_code == 200 and int(r.headers["x-cost"]) == ops.operation_cost(
        ops.load_model(server_store(server), "tiny"), "score", [[1, 2, 39]])


def server_store(server):
    return server.fair_store


# -- lanes -----------------------------------------------------------------------------------------------
def test_light_request_answers_while_a_maximal_heavy_request_runs_and_disconnect_cancels_it(server):
    """A maximal accepted dense-PCFG Viterbi (90% of the default budget: minutes of work) runs; light score
    requests to another model answer in under a second; when its client goes away, the heavy lane stops at the
    next slice (the heavy-lane gauge drops to 0 and the cancellation is counted)."""
    body = heavy_viterbi_body()
    before = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")

    def heavy():
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=6)) as c:
            return c.post("/v1/decode", json=body)

    th, box = run_in_thread(heavy)
    wait_for(lambda: heavy_lane(server) >= 1, 20)
    time.sleep(0.5)  # let it compute
    lat = light_latencies(server.url, 4.0)
    assert heavy_lane(server) >= 1, "the heavy request should still be running"
    lat.sort()
    print(f"\nFIGURES light score while a maximal dense-PCFG Viterbi runs: n={len(lat)} "
          f"p50={lat[len(lat) // 2] * 1000:.1f} ms max={lat[-1] * 1000:.1f} ms")
    assert lat[-1] < 1.0, lat[-5:]
    th.join(30)
    assert isinstance(box.get("error"), httpx.ReadTimeout)  # the client gave up after 6 s and closed
    took = wait_for(lambda: heavy_lane(server) == 0, 10)
    print(f"FIGURES heavy lane empty {took:.2f} s after the client's read timeout")
    after = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")
    assert after == before + 1
    # the heavy lane is free again: a small heavy request runs at once
    t = time.perf_counter()
    r = server.client.post("/v1/decode", json={**body, "input": body["input"][:4]})
    assert r.status_code == 200 and len(r.json()["data"]) == 4
    assert time.perf_counter() - t < 10


def test_light_request_answers_while_a_long_sample_runs(server):
    """A long sample (heavy lane, one slice: not cancellable mid-run) leaves light requests under a second."""
    def heavy():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            return c.post("/v1/sample", json={"model": "wide", "n": 1, "max_tokens": 30_000, "stop_at_eos": False})

    th, box = run_in_thread(heavy)
    wait_for(lambda: heavy_lane(server) >= 1, 20)
    lat = light_latencies(server.url, 2.0)
    lat.sort()
    print(f"\nFIGURES light score while a 30,000-token sample runs: n={len(lat)} p50={lat[len(lat) // 2] * 1000:.1f}"
          f" ms max={lat[-1] * 1000:.1f} ms")
    assert lat[-1] < 1.0, lat[-5:]
    th.join(120)
    r = box["result"]
    assert r.status_code == 200 and len(r.json()["data"][0]["ids"]) == 30_000
    assert int(r.headers["x-cost"]) > Settings().heavy_request_cost


def test_disconnect_interrupts_a_running_sample(server):
    """A maximal sample is one slice (one Python loop of 100,000 steps); its client leaving interrupts it within a
    step or so (`Cancelled` raised in the heavy lane's thread), and the lane serves the next request."""
    before = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", where="interrupted")
    body = {"model": "wide", "n": 1, "max_tokens": Settings().max_sample_tokens, "stop_at_eos": False}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=3)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/sample", json=body)
    took = wait_for(lambda: heavy_lane(server) == 0, 10)
    print(f"\nFIGURES 100,000-token sample: heavy lane empty {took:.2f} s after the client left")
    after = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", where="interrupted")
    assert after == before + 1
    r = server.client.post("/v1/sample", json={**body, "max_tokens": 3000, "seed": 3})
    assert r.status_code == 200 and len(r.json()["data"][0]["ids"]) == 3000
    assert r.json() == server.client.post("/v1/sample", json={**body, "max_tokens": 3000, "seed": 3}).json()


def test_two_heavy_requests_share_the_lane_and_a_gone_one_is_dropped(server):
    """Two heavy requests take turns slice by slice; the one whose client leaves is dropped, the other completes."""
    body = heavy_viterbi_body(fraction=0.02)
    before = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")
    results = {}

    def go(name, read):
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=read)) as c:
            try:
                results[name] = c.post("/v1/decode", json=body).status_code
            except httpx.ReadTimeout:
                results[name] = "gone"

    threads = [threading.Thread(target=go, args=(n, rd)) for n, rd in (("a", 60), ("b", 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results == {"a": 200, "b": "gone"}
    wait_for(lambda: heavy_lane(server) == 0, 10)
    after = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")
    assert after == before + 1


# -- bounded posteriors ----------------------------------------------------------------------------------
def ndjson(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines() if line]


def merge(lines: list[dict]) -> list[dict]:
    """Stream lines -> the non-streamed `data` (marginals concatenated in offset order per index)."""
    assert lines[-1]["object"] == "posterior.usage"
    data: dict[int, dict] = {}
    for ln in lines[:-1]:
        assert ln["object"] == "posterior.chunk"
        d = data.setdefault(ln["index"], {"index": ln["index"]})
        if "spans" in ln:
            d["spans"] = ln["spans"]
        else:
            assert ln["offset"] == len(d.setdefault("marginals", []))
            assert len(ln["marginals"]) <= 7  # LATENTLM_POSTERIOR_STREAM_POSITIONS
            d["marginals"].extend(ln["marginals"])
    return [data[i] for i in sorted(data)]


@pytest.mark.parametrize("model,inputs,top_k", [
    ("tiny", ["w1 w2 w3", [1] * 40, [5, 6]], None),
    ("tiny", [[3] * 23], 2),
    ("blocked", ["w1 w2 w3 w4 w5 w6 w7 w8 w9", "w3"], None),
    ("rank", [[1, 2, 3] * 5], 4),
    ("pcfg", [[1] * 9, [2, 3, 4]], None),
])
def test_ndjson_stream_equals_the_plain_answer(server, model, inputs, top_k):
    c = server.client
    body = {"model": model, "input": inputs, "top_k": top_k}
    plain = c.post("/v1/posterior", json=body)
    assert plain.status_code == 200, plain.text
    for r in (c.post("/v1/posterior", json={**body, "stream": True}),
              c.post("/v1/posterior", json=body, headers={"Accept": "application/x-ndjson"})):
        lines = ndjson(r)
        assert lines[-1]["usage"] == plain.json()["usage"] and all(ln["model"] == model for ln in lines)
        close(merge(lines), plain.json()["data"], rel=1e-6)
        assert int(r.headers["x-cost"]) > 0


def test_posterior_cap_413_unless_streamed(server):
    c = server.client
    body = {"model": "tiny", "input": [[1] * 400]}  # 400 x 16 = 6,400 entries > 5,000
    e = err(c.post("/v1/posterior", json=body), 413, "top_k", "above the limit of 5000")
    assert "LATENTLM_MAX_POSTERIOR_ENTRIES" in e["message"] and '"stream": true' in e["message"]
    lines = ndjson(c.post("/v1/posterior", json={**body, "stream": True}))
    got = merge(lines)
    assert len(got) == 1 and len(got[0]["marginals"]) == 400
    assert all(len(m["states"]) == 16 and abs(sum(m["probs"]) - 1) < 1e-5 for m in got[0]["marginals"])
    # errors before the first line keep their status
    err(c.post("/v1/posterior", json={"model": "tiny", "input": [[99]], "stream": True}), 422, "input[0]")
    err(c.post("/v1/posterior", json={"model": "nope", "input": "w1", "stream": True}), 404, "model")
    err(c.post("/v1/posterior", json={"model": "tiny", "input": "w1", "stream": 1}), 422, "stream")


def test_stream_disconnect_stops_the_work(server):
    """A heavy streamed posterior whose client reads one line and leaves: the heavy lane drops it."""
    before = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")
    body = {"model": "wide", "input": [[1] * 2000] * 60, "stream": True}  # 120,000 tokens x 128 states
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/posterior", json=body) as r:
        assert r.status_code == 200 and int(r.headers["x-cost"]) > Settings().heavy_request_cost
        first = json.loads(next(r.iter_lines()))
        assert first["object"] == "posterior.chunk" and first["index"] == 0 and first["offset"] == 0
    t = time.perf_counter()
    wait_for(lambda: heavy_lane(server) == 0, 10)
    print(f"\nFIGURES streamed posterior: heavy lane empty {time.perf_counter() - t:.2f} s after the client left")
    after = metric(server.client.get("/metrics").text, "latentlm_cancelled_requests_total", lane="heavy")
    assert after == before + 1


def test_openapi_documents_streams_and_budget(server):
    doc = server.client.get("/openapi.json").json()
    post = doc["paths"]["/v1/posterior"]["post"]
    assert set(post["responses"]["200"]["content"]) == {"application/json", "application/x-ndjson"}
    assert "413" in post["responses"]
    for path in ("/v1/score", "/v1/posterior", "/v1/decode", "/v1/embed", "/v1/sample"):
        assert "x-cost" in doc["paths"][path]["post"]["responses"]["200"]["headers"], path
    schema = doc["components"]["schemas"]["PosteriorRequest"]["properties"]["stream"]
    assert schema["type"] == "boolean" and "NDJSON" in schema["description"]


# -- the batcher's lanes, in process ---------------------------------------------------------------------
def test_batcher_heavy_lane_round_robin_limit_and_cancel():
    import asyncio

    from latentlm.service.batcher import Batcher, CancelScope, QueueFull
    from latentlm.service.metrics import Metrics
    from tests.service.conftest import blocking_call

    async def main():
        b = Batcher(Metrics(), max_heavy=4)
        await b.start()
        gate = threading.Event()
        order: list[str] = []
        model = type("M", (), {"name": "m", "content_hash": "h"})()

        def steps(name, n):
            def gen():
                for i in range(n):
                    if name == "blocker":
                        gate.wait(5)
                    order.append(f"{name}{i}")
                    yield f"{name}{i}"
            return gen

        try:
            blocker = await b.submit(blocking_call(model, None), job=steps("blocker", 1))
            await asyncio.sleep(0.05)  # the heavy thread waits in the blocker's slice
            # the light lane answers meanwhile
            assert await asyncio.wait_for(b.submit(blocking_call(model, lambda: "light")), 5) == "light"
            ra = await b.submit(blocking_call(model, None), job=steps("a", 3))
            rb = await b.submit(blocking_call(model, None), job=steps("b", 3))
            scope = CancelScope()
            never = blocking_call(model, lambda: order.append("never"))
            gone = asyncio.ensure_future(b.submit(never, heavy=True, scope=scope))
            await asyncio.sleep(0)
            with pytest.raises(QueueFull):  # blocker, a, b and the call: 4 heavy at once
                await b.submit(blocking_call(model, None), job=steps("c", 1))
            scope.cancel()  # its client leaves before its turn
            gate.set()
            assert [p async for p in ra] == ["a0", "a1", "a2"] and [p async for p in rb] == ["b0", "b1", "b2"]
            assert [p async for p in blocker] == ["blocker0"]
            assert order == ["blocker0", "a0", "b0", "a1", "b1", "a2", "b2"]  # slices in turn
            with pytest.raises(asyncio.CancelledError):
                await gone
            await asyncio.sleep(0.1)
            assert b._heavy_count == 0
            assert [p async for p in await b.submit(blocking_call(model, None), job=steps("c", 1))] == ["c0"]
        finally:
            gate.set()
            await b.stop()

    asyncio.run(main())


def test_batch_line_stream_field_is_ignored_and_capped(fair_store):
    """Batch jobs run `execute.prepare` without streaming: `stream` is not passed to the model and the posterior
    cap applies; the API path takes the cost budget."""
    from latentlm.service.schemas import PosteriorRequest

    tiny = ops.load_model(fair_store, "tiny")
    req = execute.parse("posterior", {"model": "tiny", "input": [[1] * 10], "stream": True})
    assert isinstance(req, PosteriorRequest) and req.stream is True
    prep = execute.prepare(tiny, "posterior", req, 1000, 1000)
    assert "stream" not in prep.opts and prep.cost == ops.operation_cost(tiny, "posterior", [[1] * 10])
    assert len(execute.run_direct(prep, 0)["data"][0]["marginals"]) == 10
    with pytest.raises(Exception) as e:
        execute.prepare(tiny, "posterior", req, 1000, 100)
    assert e.value.param == "top_k"
    with pytest.raises(Exception) as e:
        execute.prepare(tiny, "posterior", req, 1000, 1000, max_cost=prep.cost - 1)
    assert e.value.status == 413 and e.value.code == "budget_exceeded"
    assert execute.prepare(tiny, "posterior", req, 1000, 100, streaming=True).cost == prep.cost
