"""Findings of the reliability review, each pinned by a test (in-process apps through FastAPI's TestClient):
the posterior response budget, sample prefix and seed limits, strict batch/file ids, a Redis outage answered
503, and reload verifying every model like a fresh load."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from latentlm import ops
from latentlm.models.errors import InputError
from latentlm.models.store import sha256_file
from latentlm.service.app import create_app
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings
from tests.service.conftest import add_model, err, free_port, metric, ready, reload_models

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def upload(c: TestClient, lines: list[dict]) -> str:
    data = "\n".join(json.dumps(ln) for ln in lines) + "\n"
    r = c.post("/v1/files", files={"file": ("in.jsonl", data.encode(), "application/jsonl")}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def run_batch(c: TestClient, lines: list[dict], endpoint: str) -> dict[str, dict]:
    """custom_id -> output line of a finished local batch job."""
    b = c.post("/v1/batches", json={"input_file_id": upload(c, lines), "endpoint": endpoint}).json()
    deadline = time.monotonic() + 60
    while (b := c.get(f"/v1/batches/{b['id']}").json())["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.02)
    assert b["status"] == "completed", b
    out = {}
    for key in ("output_file_id", "error_file_id"):
        if b[key]:
            for ln in c.get(f"/v1/files/{b[key]}/content").text.splitlines():
                out[json.loads(ln)["custom_id"]] = json.loads(ln)
    return out


def line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


# -- 1. posterior response budget -------------------------------------------------------------------------------
def test_posterior_budget(store, tmp_path, monkeypatch):
    assert Settings().max_posterior_entries == 2_000_000
    monkeypatch.setenv("LATENTLM_MAX_POSTERIOR_ENTRIES", "123")
    assert Settings.from_env().max_posterior_entries == 123
    monkeypatch.delenv("LATENTLM_MAX_POSTERIOR_ENTRIES")

    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, max_posterior_entries=100))
    with TestClient(app) as c:
        ready(c)
        # tiny: 16 states, so 10 tokens with every state are 160 entries
        for top_k in (None, "all", 11):
            body = {"model": "tiny", "input": [[1] * 10]} if top_k is None else {
                "model": "tiny", "input": [[1] * 10], "top_k": top_k}
            e = err(c.post("/v1/posterior", json=body), 413, "top_k", "above the limit of 100")
            assert e["code"] == "limit_exceeded" and e["type"] == "limit_exceeded"
            assert "max_posterior_entries" in e["message"] and "LATENTLM_MAX_POSTERIOR_ENTRIES" in e["message"]
            assert f"returns {10 * (16 if top_k in (None, 'all') else 11)} entries" in e["message"]
        r = c.post("/v1/posterior", json={"model": "tiny", "input": [[1] * 10], "top_k": 10})
        assert r.status_code == 200 and sum(len(m["states"]) for m in r.json()["data"][0]["marginals"]) == 100

        # the estimate is what each family returns: blocked (the states of a token's cluster), rank, pcfg spans
        for name, seqs in (("blocked", [[1] * 20, [2, 3]]), ("rank", [[1, 2, 3]]), ("pcfg", [[1] * 14, [2, 3]]),
                           ("tiny", [[1] * 6])):
            model = app.state.registry.get(name)
            want = ops.posterior_entries(model, seqs, None)
            r = c.post("/v1/posterior", json={"model": name, "input": seqs})
            assert r.status_code == 200, (name, r.text)
            data = r.json()["data"]
            got = sum(len(d["spans"]) if "spans" in d else sum(len(m["states"]) for m in d["marginals"])
                      for d in data)
            assert got == want <= 100, (name, got, want)
        err(c.post("/v1/posterior", json={"model": "pcfg", "input": [[1] * 15]}), 413, "top_k", "105 entries")

        # batch jobs: the same budget, per line
        out = run_batch(c, [line("big", "/v1/posterior", {"model": "tiny", "input": [[1] * 10]}),
                            line("ok", "/v1/posterior", {"model": "tiny", "input": [[1] * 10], "top_k": 2})],
                        "/v1/posterior")
        assert out["ok"]["response"]["status_code"] == 200
        big = out["big"]["response"]
        assert big["status_code"] == 413 and big["body"]["error"]["code"] == "limit_exceeded"
        assert "max_posterior_entries" in big["body"]["error"]["message"]


# -- 2. sample: prefix tokens against max_request_tokens, seed range --------------------------------------------
def test_sample_prefix_limit_and_seed(store, tmp_path, capsys):
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, max_request_tokens=50))
    with TestClient(app) as c:
        ready(c)
        s = {"model": "tiny", "max_tokens": 2}
        e = err(c.post("/v1/sample", json={**s, "prefix": [1] * 51}), 413, "prefix", "51 tokens exceed the limit of 50")
        assert e["code"] == "limit_exceeded"
        err(c.post("/v1/sample", json={**s, "prefix": "w1 " * 51}), 413, "prefix", "51 tokens")
        r = c.post("/v1/sample", json={**s, "prefix": "w1 " * 50})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == 50

        for seed in (2**64, 2**63, -1):
            err(c.post("/v1/sample", json={**s, "seed": seed}), 422, "seed")
        assert c.post("/v1/sample", json={**s, "seed": 2**63 - 1}).status_code == 200

        out = run_batch(c, [line("seed", "/v1/sample", {**s, "seed": 2**63}),
                            line("prefix", "/v1/sample", {**s, "prefix": [1] * 51}),
                            line("ok", "/v1/sample", {**s, "seed": 5})], "/v1/sample")
        assert out["ok"]["response"]["status_code"] == 200
        assert out["seed"]["response"]["status_code"] == 422
        assert out["seed"]["response"]["body"]["error"]["param"] == "seed"
        assert out["prefix"]["response"]["status_code"] == 413
        assert out["prefix"]["response"]["body"]["error"]["param"] == "prefix"

    model = ops.load_model(store, "tiny")
    for seed in (2**64, 2**63, -1):
        with pytest.raises(InputError) as ei:
            ops.sample(model, seed=seed)
        assert ei.value.param == "seed"
    from latentlm.cli import main

    assert main(["sample", "--store", str(store), "--model", "tiny", "--seed", str(2**64)]) == 2
    assert "seed" in capsys.readouterr().err


# -- 3. strict batch and file ids --------------------------------------------------------------------------------
def crafted_ids_404(c: TestClient, bid: str, fid: str) -> None:
    bad_batches = [f"{bid}:chunks", f"{bid}:counts", f"{bid}:lease", "batch_nope", bid.upper(), f"{bid}x", "x" + bid,
                   fid]
    for b in bad_batches:
        err(c.get(f"/v1/batches/{b}"), 404, "batch_id")
        err(c.post(f"/v1/batches/{b}/cancel"), 404, "batch_id")
    for f in [f"{fid}:meta", f"{fid}:content", "file_nope", f"{fid}0", bid, f"file-{bid}-input", ".." + fid]:
        err(c.get(f"/v1/files/{f}"), 404, "file_id")
        err(c.get(f"/v1/files/{f}/content"), 404, "file_id")
        err(c.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/score"}), 404, "input_file_id")
    assert c.get(f"/v1/batches/{bid}").status_code == 200
    assert c.get(f"/v1/files/{fid}").status_code == 200


def test_crafted_ids_local(store, tmp_path):
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path))
    with TestClient(app) as c:
        ready(c)
        fid = upload(c, [line("a", "/v1/score", {"model": "tiny", "input": "w1"})])
        bid = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()["id"]
        crafted_ids_404(c, bid, fid)


def test_crafted_ids_redis(store, tmp_path, redis_url):
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, redis_url=redis_url))
    with TestClient(app) as c:
        ready(c)
        fid = upload(c, [line("a", "/v1/score", {"model": "tiny", "input": "w1"})])
        bid = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()["id"]
        # what a worker writes beside the batch record (no worker runs here): `<id>:chunks` and `<id>:counts`
        # hashes, which a lax id check reads as batch records (KeyError, JSONDecodeError: 500)
        app.state.service.jobs.commit_chunk(bid, 0, ['{"x": 1}'], 1, 0)
        crafted_ids_404(c, bid, fid)


# -- 4. Redis outage ---------------------------------------------------------------------------------------------
def test_redis_outage_503(store, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, redis_url=url, retry_after_s=3))
    with TestClient(app) as c:
        ready(c)
        for r in (c.get(f"/v1/batches/batch_{secrets.token_hex(12)}"),
                  c.post("/v1/files", files={"file": ("in.jsonl", b"{}\n", "application/jsonl")},
                         data={"purpose": "batch"}),
                  c.get("/v1/batches")):
            e = err(r, 503, None, "Redis")
            assert e["code"] == "backend_unavailable" and e["type"] == "service_unavailable"
            assert r.headers["retry-after"] == "3"
        assert metric(c.get("/metrics").text, "latentlm_errors_total", status="503", type="backend_unavailable") == 3
        assert c.post("/v1/score", json={"model": "tiny", "input": "w1"}).status_code == 200  # cache down: computes


# -- 5. reload verifies like a fresh load ------------------------------------------------------------------------
def test_reload_verifies_files_and_refuses_escapes(tmp_path):
    store = tmp_path / "store"
    add_model(store, "a", seed=1)
    outside = tmp_path / "outside"
    add_model(outside, "ext", seed=2)
    weights = store / "a" / "weights.safetensors"
    good = weights.read_bytes()
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path / "state"))
    body = {"model": "a", "input": [[1, 2, 3]]}

    with TestClient(app) as c:
        ready(c)
        first = c.post("/v1/score", json=body).json()
        assert not reload_models(c)["failed"]

        for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[: len(good) // 2]):  # flipped bits, truncated
            weights.write_bytes(bad)
            r = reload_models(c)
            assert "SHA-256 mismatch" in r["failed"]["a"] and r["updated"] == [] and r["removed"] == []
            assert c.post("/v1/score", json=body).json() == first  # the verified version keeps serving
            assert c.get("/ready").json()["failed"] == r["failed"]
        weights.write_bytes(good)
        r = reload_models(c)
        assert r["failed"] == {} and r["updated"] == [] and r["added"] == []

        os.symlink(outside / "ext", store / "linked")  # a model directory from outside the store
        add_model(store, "evil", seed=3)  # a manifest naming a file outside its directory
        secret = tmp_path / "secret.txt"
        secret.write_text("not a model file\n")
        m = json.loads((store / "evil" / "manifest.json").read_text())
        m["files"]["../../secret.txt"] = sha256_file(secret)
        (store / "evil" / "manifest.json").write_text(json.dumps(m))
        add_model(store, "lnk", seed=4)  # a model file that is a symbolic link
        shutil.copy(store / "lnk" / "vocab.txt", outside / "vocab.txt")
        (store / "lnk" / "vocab.txt").unlink()
        os.symlink(outside / "vocab.txt", store / "lnk" / "vocab.txt")
        r = reload_models(c)
        assert set(r["failed"]) == {"linked", "evil", "lnk"} and r["added"] == []
        assert "symbolic link" in r["failed"]["linked"] and "symbolic link" in r["failed"]["lnk"]
        assert "not a plain name" in r["failed"]["evil"]
        for name in ("linked", "evil", "lnk"):
            err(c.get(f"/v1/models/{name}"), 404, "model")
        assert c.post("/v1/score", json=body).json() == first


def test_registry_rehash_false_uses_stat_signatures(tmp_path):
    add_model(tmp_path, "a", seed=1)
    reg = ModelRegistry(tmp_path)
    reg.reload()
    kept = reg.get("a")
    weights: Path = tmp_path / "a" / "weights.safetensors"
    good = weights.read_bytes()
    st = weights.stat()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the ctime still moves
    out = reg.reload(rehash=False)
    assert out["failed"] == ["a"] and "SHA-256 mismatch" in reg.failed["a"] and reg.get("a") is kept
    weights.write_bytes(good)
    assert reg.reload(rehash=False)["failed"] == [] and reg.get("a") is kept
    assert reg.reload(rehash=False)["failed"] == []  # unchanged signature: nothing hashed, nothing failed
