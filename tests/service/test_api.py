"""End-to-end tests of `latentlm serve` (a real uvicorn process on a free port, no Redis)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from latentlm import ops
from tests.service.conftest import WORDS, Server, add_model, close, err, metric


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("api"),
               env={"LATENTLM_JOB_CHUNK_SIZE": "2", "LATENTLM_JOB_CHUNK_PAUSE_S": "0.05"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(server) -> httpx.Client:
    return server.client


def sentence(rng: random.Random, lo: int = 3, hi: int = 30) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


# -- health, docs, models -------------------------------------------------------------------------------
def test_health_ready_docs(c):
    assert c.get("/health").json() == {"status": "ok"}
    r = c.get("/ready")
    assert r.status_code == 200 and set(r.json()["models"]) >= {"tiny", "blocked", "rank"}
    spec = c.get("/openapi.json").json()
    for path in ("/v1/score", "/v1/posterior", "/v1/decode", "/v1/sample", "/v1/embed", "/v1/models",
                 "/v1/models/reload", "/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel"):
        assert path in spec["paths"], path
    assert c.get("/docs").status_code == 200


def test_models(c, store):
    r = c.get("/v1/models").json()
    assert r["object"] == "list"
    by_id = {m["id"]: m for m in r["data"]}
    assert by_id["tiny"]["family"] == "hmm" and by_id["tiny"]["num_states"] == 16
    assert by_id["tiny"]["vocab_size"] == len(WORDS) + 2
    assert by_id["blocked"]["family"] == "blocked_hmm" and by_id["rank"]["family"] == "rank_hmm"
    one = c.get("/v1/models/tiny").json()
    assert one == by_id["tiny"]
    assert one["content_hash"] == ops.load_model(store, "tiny").content_hash
    err(c.get("/v1/models/nope"), 404, "model", "'nope' not found")


# -- operations match the in-process ops ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "blocked", "rank"])
def test_operations_match_ops(c, store, name):
    m = ops.load_model(store, name)
    texts = ["w1 w2 w3", "w5 w6 zzz w7"]
    ids = [[1, 2, 3], [4]]
    seqs = ops.encode_inputs(m.vocab, texts) + ids
    r = c.post("/v1/score", json={"model": name, "input": texts + ids, "token_logprobs": True}).json()
    assert r["object"] == "list" and r["model"] == name
    assert r["usage"]["input_tokens"] == sum(len(s) for s in seqs)
    close(r["data"], ops.run(m, "score", seqs, token_logprobs=True))
    assert r["data"][0]["tokens"][-1] == "<eos>" and r["data"][2]["tokens"] == ["w1", "w2", "w3"]  # ids: no <eos>
    r = c.post("/v1/posterior", json={"model": name, "input": texts, "top_k": 3}).json()
    close(r["data"], ops.run(m, "posterior", seqs[:2], top_k=3))
    r = c.post("/v1/posterior", json={"model": name, "input": "w1 w2", "top_k": "all"}).json()
    close(r["data"], ops.run(m, "posterior", ops.encode_inputs(m.vocab, ["w1 w2"]), top_k=None))
    for method in ("viterbi", "mbr"):
        r = c.post("/v1/decode", json={"model": name, "input": ids, "method": method}).json()
        close(r["data"], ops.run(m, "decode", ids, method=method))
    r = c.post("/v1/sample", json={"model": name, "n": 3, "max_tokens": 6, "seed": 5, "prefix": "w1 w2"}).json()
    close(r["data"], ops.sample(m, n=3, max_tokens=6, seed=5, prefix="w1 w2"))
    assert r["usage"]["input_tokens"] == 2 and r["usage"]["output_tokens"] == sum(len(d["ids"]) for d in r["data"])


def test_single_string_input(c):
    r = c.post("/v1/score", json={"model": "tiny", "input": "w1 w2"}).json()
    assert len(r["data"]) == 1 and r["data"][0]["index"] == 0 and r["data"][0]["num_tokens"] == 3


def test_sample_stream(c):
    with c.stream("POST", "/v1/sample", json={"model": "tiny", "n": 3, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    plain = c.post("/v1/sample", json={"model": "tiny", "n": 3, "max_tokens": 5}).json()
    assert [{k: v for k, v in ch.items() if k not in ("object", "model")} for ch in chunks[:3]] == plain["data"]
    assert chunks[3]["usage"] == plain["usage"]


def test_sample_stop_sequences(c):
    """`stop` through the service: each sample is the one drawn without it (same seed), cut before the first
    place its tokens spell a stop sequence, with `finish_reason`; the stop list is checked field by field."""
    body = {"model": "tiny", "n": 24, "max_tokens": 12, "seed": 5}
    plain = c.post("/v1/sample", json=body).json()["data"]
    assert {d["finish_reason"] for d in plain} <= {"eos", "length"}
    assert all((d["finish_reason"] == "eos") == (d["tokens"][-1] == "<eos>") for d in plain)
    long = next(d for d in plain if len(d["tokens"]) >= 5)
    stops = [long["tokens"][3], " ".join(long["tokens"][1:3])]  # a word, and a two-word sequence before it
    got = c.post("/v1/sample", json={**body, "stop": stops}).json()["data"]
    words = [s.split() for s in stops]
    for d, g in zip(plain, got, strict=True):
        ends = [e for e in range(1, len(d["tokens"]) + 1) if any(d["tokens"][e - len(w): e] == w for w in words
                                                                  if len(w) <= e)]
        if not ends:
            assert g == d
            continue
        e = ends[0]
        keep = e - max(len(w) for w in words if len(w) <= e and d["tokens"][e - len(w): e] == w)
        assert g == {**d, "tokens": d["tokens"][:keep], "ids": d["ids"][:keep], "states": d["states"][:keep],
                     "finish_reason": "stop"}
    assert got[plain.index(long)]["tokens"] == long["tokens"][:1]  # the two-word stop completes first
    err(c.post("/v1/sample", json={**body, "stop": ["w1"] * 5}), 422, "stop", "at most 4")
    err(c.post("/v1/sample", json={**body, "stop": ["w1 nosuchword"]}), 422, "stop", "stop[0]: 'nosuchword'")
    err(c.post("/v1/sample", json={**body, "stop": [[1, 400]]}), 422, "stop", "[0, 40)")
    err(c.post("/v1/sample", json={**body, "stop": [""]}), 422, "stop", "1 to 64 tokens")
    err(c.post("/v1/sample", json={**body, "stop": 5}), 422, "stop")
    err(c.post("/v1/sample", json={"model": "pcfg", "stop": "w1"}), 400, "stop", "whole sentences")


def test_other_families(c, store):
    names = {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert {"lds", "pcfg"} <= names, names  # the fixture store always holds both
    m = ops.load_model(store, "lds")
    for causal in (False, True):
        r = c.post("/v1/embed", json={"model": "lds", "input": ["w1 w2 w3", [4, 5]], "causal": causal}).json()
        close(r["data"], ops.run(m, "embed", ops.encode_inputs(m.vocab, ["w1 w2 w3"]) + [[4, 5]], causal=causal))
        assert r["data"][1]["dim"] == 3 and len(r["data"][1]["embeddings"]) == 2
    err(c.post("/v1/score", json={"model": "lds", "input": "w1"}), 400, "model", "does not support 'score'")
    m = ops.load_model(store, "pcfg")
    seqs = [[1, 2, 3], [4, 5], [6]]
    r = c.post("/v1/score", json={"model": "pcfg", "input": seqs}).json()
    close(r["data"], ops.run(m, "score", seqs))
    assert all(d["logprob"] < 0 for d in r["data"]), r["data"]
    r = c.post("/v1/decode", json={"model": "pcfg", "input": seqs, "method": "mbr"}).json()
    close(r["data"], ops.run(m, "decode", seqs, method="mbr"))
    err(c.post("/v1/decode", json={"model": "pcfg", "input": "w1", "method": "viterbi"}), 400, "method")


def test_embed_unsupported(c):
    e = err(c.post("/v1/embed", json={"model": "tiny", "input": "w1"}), 400, "model", "does not support 'embed'")
    assert e["code"] == "unsupported_operation"


# -- bad inputs: status, field, message; never 500 ---------------------------------------------------------
BAD = [
    ({"model": "tiny", "input": [[1, 2, 99]]}, 422, "input[0]", "outside [0, 40)"),
    ({"model": "tiny", "input": [[1, True]]}, 422, "input", "not an integer"),
    ({"model": "tiny", "input": [[1, 2.5]]}, 422, "input", "not an integer"),
    ({"model": "tiny", "input": ["w1", 3]}, 422, "input", "item 1 is int"),
    ({"model": "tiny", "input": []}, 422, "input", "empty list"),
    ({"model": "tiny", "input": [[]]}, 422, "input[0]", "empty sequence"),
    ({"model": "tiny", "input": "   "}, 422, "input[0]", "empty sequence"),
    ({"model": "tiny", "input": {"a": 1}}, 422, "input", "expected a string"),
    ({"model": "tiny"}, 422, "input", "field required"),
    ({"input": "w1"}, 422, "model", "field required"),
    ({"model": "tiny", "input": "w1", "bogus": 1}, 422, "bogus", "unknown field"),
    ({"model": "tiny", "input": "w1", "token_logprobs": "yes"}, 422, "token_logprobs", ""),
    ({"model": "nope", "input": "w1"}, 404, "model", "not found"),
    ({"model": "../etc", "input": "w1"}, 404, "model", "not found"),
    ({"model": 5, "input": "w1"}, 422, "model", ""),
]


@pytest.mark.parametrize(("body", "status", "param", "msg"), BAD)
def test_bad_score_inputs(c, body, status, param, msg):
    err(c.post("/v1/score", json=body), status, param, msg)


@pytest.mark.parametrize(("path", "body", "status", "param", "msg"), [
    ("/v1/posterior", {"model": "tiny", "input": "w1", "top_k": 0}, 422, "top_k", ">= 1"),
    ("/v1/posterior", {"model": "tiny", "input": "w1", "top_k": "some"}, 422, "top_k", ""),
    ("/v1/decode", {"model": "tiny", "input": "w1", "method": "beam"}, 400, "method", "no decode method 'beam'"),
    ("/v1/sample", {"model": "tiny", "n": 0}, 422, "n", ""),
    ("/v1/sample", {"model": "tiny", "max_tokens": -1}, 422, "max_tokens", ""),
    ("/v1/sample", {"model": "tiny", "temperature": 0}, 422, "temperature", "positive finite"),
    ("/v1/sample", {"model": "tiny", "prefix": "w1 qq"}, 200, None, ""),  # unknown word -> <unk>
    ("/v1/sample", {"model": "tiny", "prefix": [1, 77]}, 422, "prefix", "outside [0, 40)"),
    ("/v1/sample", {"model": "tiny", "n": 1000, "max_tokens": 1000}, 413, "max_tokens", "exceeds the limit"),
    ("/v1/sample", {"model": "tiny", "input": "w1"}, 422, "input", "unknown field"),
])
def test_bad_option_values(c, path, body, status, param, msg):
    r = c.post(path, json=body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        err(r, status, param, msg)


def test_malformed_bodies(c):
    e = err(c.post("/v1/score", content=b'{"model": "tiny", "input":'), 400, None, "not valid JSON")
    assert e["code"] == "invalid_json"
    err(c.post("/v1/score", content=b"[1, 2]"), 422, "body", "expected a JSON object")
    err(c.post("/v1/score", content=b""), 422, "body", "empty request body")
    err(c.post("/v1/score", content=b"\xff\xfe"), 400, None, "not valid JSON")
    # curl -d sends a form content type: the body is still read as JSON
    r = c.post("/v1/score", content=b'{"model": "tiny", "input": "w1"}',
               headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    err(c.get("/v1/score"), 405, None, "not allowed")
    err(c.get("/v1/nothing"), 404, None, "no route")


def test_token_limit(c):
    err(c.post("/v1/score", json={"model": "tiny", "input": [[1] * 200_001]}), 413, "input", "exceed the limit")


def test_metrics_count_errors(c):
    c.post("/v1/score", json={"model": "nope", "input": "w1"})
    text = c.get("/metrics").text
    assert metric(text, "latentlm_errors_total", status="404", type="model_not_found") >= 1
    assert metric(text, "latentlm_request_duration_seconds_count", route="/v1/score") >= 1
    for name in ("latentlm_queue_wait_seconds_count", "latentlm_batch_tokens_count", "latentlm_queue_depth",
                 "latentlm_tokens_processed_total", "latentlm_batch_sequences_count"):
        assert name in text, name


# -- dynamic batching ------------------------------------------------------------------------------------
def test_64_concurrent_clients_match_sequential(c, server):
    rng = random.Random(0)
    bodies = [{"model": "tiny", "input": [sentence(rng), [rng.randrange(40) for _ in range(rng.randint(1, 25))]],
               "token_logprobs": True} for _ in range(64)]
    before = c.get("/metrics").text
    sequential = [c.post("/v1/score", json=b).json() for b in bodies]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*(ac.post("/v1/score", json=b) for b in bodies))

    concurrent = asyncio.run(burst())
    assert all(r.status_code == 200 for r in concurrent)
    for seq, conc in zip(sequential, concurrent, strict=True):
        close(conc.json(), seq, rel=1e-5)  # float32 batch-composition rounding only
    after = c.get("/metrics").text
    n_batches = metric(after, "latentlm_batch_requests_count", operation="score") - metric(
        before, "latentlm_batch_requests_count", operation="score")
    n_single = metric(after, "latentlm_batch_requests_bucket", operation="score", le="1.0") - metric(
        before, "latentlm_batch_requests_bucket", operation="score", le="1.0")
    assert n_batches - n_single >= 1, "no batch merged more than one request"
    assert n_batches < 128  # 64 sequential + fewer than 64 for the burst


def test_health_answers_during_a_big_batch(c, server, store):
    rng = random.Random(1)
    big = {"model": "tiny", "input": [[rng.randrange(40) for _ in range(100_000)]]}
    done = threading.Event()
    result: dict = {}

    def run():
        with httpx.Client(base_url=server.url, timeout=120) as cl:
            result["r"] = cl.post("/v1/score", json=big)
        done.set()

    # (that /health answers while a batch is held inside the model call, deterministically, is
    # tests/service/test_units.py::test_health_answers_while_a_batch_computes; here: the real server)
    t = threading.Thread(target=run)
    t.start()
    with httpx.Client(base_url=server.url, timeout=30) as hc:
        while not done.is_set():
            assert hc.get("/health").json() == {"status": "ok"}
            done.wait(0.01)
    t.join()
    assert result["r"].status_code == 200, result["r"].text
    m = ops.load_model(store, "tiny")
    close(result["r"].json()["data"], ops.run(m, "score", big["input"]), rel=1e-4)


# -- reload --------------------------------------------------------------------------------------------------
def test_reload_add_change_remove(c, store):
    err(c.post("/v1/score", json={"model": "extra", "input": "w1"}), 404, "model")
    add_model(store, "extra", "hmm", seed=10)
    r = c.post("/v1/models/reload").json()
    assert r["added"] == ["extra"] and "extra" in {m["id"] for m in r["data"]}
    first = c.post("/v1/score", json={"model": "extra", "input": "w1 w2"}).json()["data"][0]["logprob"]
    add_model(store, "extra", "hmm", seed=11)
    r = c.post("/v1/models/reload").json()
    assert r["updated"] == ["extra"] and r["added"] == []
    second = c.post("/v1/score", json={"model": "extra", "input": "w1 w2"}).json()["data"][0]["logprob"]
    new = ops.load_model(store, "extra")
    assert second != first
    close(second, ops.run(new, "score", ops.encode_inputs(new.vocab, ["w1 w2"]))[0]["logprob"])
    import shutil

    shutil.rmtree(store / "extra")
    r = c.post("/v1/models/reload").json()
    assert r["removed"] == ["extra"]
    err(c.post("/v1/score", json={"model": "extra", "input": "w1"}), 404, "model")
    assert c.post("/v1/models/reload").json()["removed"] == []


# -- batch jobs without Redis (in-process, files on local disk) -----------------------------------------------
def upload(c, lines: list[dict | str]) -> str:
    data = "\n".join(ln if isinstance(ln, str) else json.dumps(ln) for ln in lines) + "\n"
    r = c.post("/v1/files", files={"file": ("in.jsonl", data.encode(), "application/jsonl")},
               data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["object"] == "file" and f["bytes"] == len(data.encode())
    return f["id"]


def wait_batch(c, bid: str, statuses=("completed", "failed", "cancelled"), timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        b = c.get(f"/v1/batches/{bid}").json()
        if b["status"] in statuses:
            return b
        assert time.time() < deadline, b
        time.sleep(0.05)


def score_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/score",
             "body": {"model": "tiny", "input": sentence(rng), "token_logprobs": True}} for i in range(n)]


def test_batch_job_local(c):
    lines = score_lines(9)
    lines[4]["body"]["input"] = [[1, 500]]  # a bad request: fails alone, with its error
    fid = upload(c, lines)
    assert c.get(f"/v1/files/{fid}").json()["id"] == fid
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    assert b["object"] == "batch" and b["status"] in ("validating", "in_progress")
    b = wait_batch(c, b["id"])
    assert b["status"] == "completed", b
    assert b["request_counts"] == {"total": 9, "completed": 8, "failed": 1}
    out = [json.loads(ln) for ln in c.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()]
    bad = [json.loads(ln) for ln in c.get(f"/v1/files/{b['error_file_id']}/content").text.splitlines()]
    assert sorted(o["custom_id"] for o in out + bad) == sorted(ln["custom_id"] for ln in lines)
    assert bad[0]["custom_id"] == "req-4" and bad[0]["response"]["status_code"] == 422
    assert "outside [0, 40)" in bad[0]["error"]["message"]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        i = int(o["custom_id"].split("-")[1])
        close(o["response"]["body"], c.post("/v1/score", json=lines[i]["body"]).json())
    listed = c.get("/v1/batches").json()
    assert b["id"] in {x["id"] for x in listed["data"]}


def test_batch_job_invalid_files(c):
    fid = upload(c, ['{"custom_id": "a", "url": "/v1/score", "body": {}}', "not json",
                     {"custom_id": "a", "url": "/v1/decode", "body": {"model": "tiny", "input": "w1"}}])
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    assert b["status"] == "failed"
    msgs = [e["message"] for e in b["errors"]["data"]]
    assert any("line 2: not valid JSON" in m for m in msgs)
    assert any("line 3: duplicate custom_id" in m for m in msgs)
    assert any("line 3: url '/v1/decode' does not match" in m for m in msgs)
    err(c.post("/v1/batches", json={"input_file_id": "file_nope", "endpoint": "/v1/score"}), 404, "input_file_id")
    err(c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat"}), 422, "endpoint")
    err(c.post("/v1/batches", json={"endpoint": "/v1/score"}), 422, "input_file_id", "field required")
    err(c.get("/v1/batches/batch_nope"), 404, "batch_id")
    err(c.get("/v1/files/file_nope/content"), 404, "file_id")
    err(c.post("/v1/files", files={"file": ("a", b"x")}, data={"purpose": "fine-tune"}), 422, "purpose")
    err(c.post("/v1/files", data={"purpose": "batch"}), 422, "file", "field required")


def test_batch_cancel_local(c):
    fid = upload(c, score_lines(400, seed=3))
    b = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()
    r = c.post(f"/v1/batches/{b['id']}/cancel").json()
    assert r["status"] in ("cancelling", "cancelled")
    b = wait_batch(c, b["id"])
    assert b["status"] == "cancelled"
    done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
    assert done < 400
    out = c.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()
    assert len(out) == b["request_counts"]["completed"]
    assert c.post(f"/v1/batches/{b['id']}/cancel").json()["status"] == "cancelled"
    err(c.post("/v1/batches/batch_nope/cancel"), 404, "batch_id")


def test_sample_top_k_top_p(c):
    """top_k / top_p through the service: a model that offers them answers (each token among the k most
    probable next tokens: with top_k 1 every sample of a seed is the greedy continuation), the others answer 400
    naming the field, bad values 422."""
    one = c.post("/v1/sample", json={"model": "blocked", "n": 4, "max_tokens": 6, "seed": 1, "top_k": 1,
                                     "stop_at_eos": False}).json()["data"]
    assert len({tuple(d["ids"]) for d in one}) == 1 and all(len(d["states"]) == 6 for d in one)
    r = c.post("/v1/sample", json={"model": "tiny", "n": 3, "max_tokens": 5, "seed": 2, "top_p": 0.5,
                                   "temperature": 0.8, "stop": "w1"})
    assert r.status_code == 200 and len(r.json()["data"]) == 3
    err(c.post("/v1/sample", json={"model": "rank", "top_k": 3}), 400, "top_k", "ancestrally")
    err(c.post("/v1/sample", json={"model": "tiny", "top_p": 1.5}), 422, "top_p")
    err(c.post("/v1/sample", json={"model": "tiny", "top_p": True}), 422, "top_p")
    err(c.post("/v1/sample", json={"model": "tiny", "top_k": 0}), 422, "top_k")
