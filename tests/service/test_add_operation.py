"""Adding an operation touches one module: a toy operation registered from this test (one `spec.register`) is
answered on REST (its route, its OpenAPI body), on the CLI (its subcommand and flags, derived from its request
model) and in batch-job lines, with limits, errors and the family's support checked as for every operation."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from pydantic import Field, StrictInt

from latentlm.ops import spec
from latentlm.ops.requests import InputRequest
from latentlm.service.settings import Settings


class CountRequest(InputRequest):
    times: StrictInt = Field(1, ge=1, le=10, description="how many times to count each sequence's tokens")
    shout: bool = Field(False, description="answer in capitals")


def run_count(call: spec.Call, max_batch_tokens: int | None) -> list[dict]:
    word = "TOKENS" if call.opts["shout"] else "tokens"
    return [{"index": i, word: len(s) * call.opts["times"]} for i, s in enumerate(call.seqs)]


@pytest.fixture()
def toy_operation():
    """The one place the toy operation is declared; removed again after the test."""
    op = spec.register(spec.Operation("count", "count the tokens of each input", CountRequest, run=run_count,
                                      supports=lambda model: model.family in ("hmm", "blocked_hmm")))
    yield op
    spec.unregister("count")


def test_a_toy_operation_appears_on_rest_cli_and_batch(toy_operation, base_store, tmp_path, capsys, monkeypatch):
    from latentlm.cli import main
    from latentlm.service.app import create_app
    from latentlm.service.jobs import ENDPOINTS, execute_lines
    from latentlm.service.registry import ModelRegistry

    settings = Settings(store=base_store, device="cpu", state_dir=tmp_path)
    with TestClient(create_app(settings)) as c:
        while c.get("/ready").status_code != 200:
            pass
        r = c.post("/v1/count", json={"model": "tiny", "input": ["w1 w2", [1, 2, 3]], "times": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["tokens"] for d in body["data"]] == [2 * 3, 2 * 3]  # "w1 w2" + <eos>, and three ids
        assert body["usage"]["input_tokens"] == 6 and int(r.headers["x-cost"]) > 0  # the family's cost model
        r = c.post("/v1/count", json={"model": "tiny", "input": "w1", "times": 11})
        assert r.status_code == 422 and r.json()["error"]["param"] == "times", r.text
        r = c.post("/v1/count", json={"model": "rank", "input": "w1"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_operation", r.text
        doc = c.get("/openapi.json").json()
        ref = doc["paths"]["/v1/count"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/CountRequest") and "/v1/count" in json.dumps(doc["components"]["schemas"])
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert "count" in models["tiny"]["operations"] and "count" not in models["rank"]["operations"]

    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("1 2\n3\n"))
    rc = main(["count", "--model", "tiny", "--store", str(base_store), "--ids", "--times", "3", "--shout", "-"])
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [r["TOKENS"] for r in rows] == [6, 3], rows
    rc = main(["count", "--model", "tiny", "--store", str(base_store), "--times", "0", "-"])
    assert rc == 2 and "--times" in capsys.readouterr().err

    assert ENDPOINTS["/v1/count"] == "count"  # a batch may name it (`jobs.create_batch` checks the endpoint)
    registry = ModelRegistry.from_settings(settings)
    registry.reload()
    out = execute_lines(registry, "count",
                        [{"model": "tiny", "input": [[1, 2]], "times": 5}, {"model": "tiny", "input": "w1", "bad": 1}],
                        settings)
    assert out[0][0] == 200 and out[0][1]["data"][0]["tokens"] == 10
    assert out[1][0] == 422 and out[1][1]["error"]["param"] == "bad"


def test_every_operation_is_declared_once_and_reachable(base_store):
    """The table is what routes, CLI and batches read: every declared operation has a request model with
    `model`, a route path, and CLI flags for every option (REST-only ones, marked `Cli(hidden=True)`, excepted)."""
    for name, op in spec.OPERATIONS.items():
        assert op.path == f"/v1/{name}" and "model" in op.request.model_fields
        flags = {f.name for f in spec.cli_flags(op)}
        rest_only = {n for n, info in op.request.model_fields.items()
                     if any(getattr(m, "hidden", False) for m in info.metadata)}  # Cli(hidden=True): stream, ...
        options = set(op.request.model_fields) - {"model", "input"} - rest_only
        assert flags == options, (name, flags, options)
