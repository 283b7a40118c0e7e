"""`--backend onnx` end to end: `latentlm export-onnx`, `latentlm score --backend onnx` and the service's
`backend=onnx` give what the torch backend gives; families without a graph fall back to torch, said in
/v1/models."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fastapi.testclient import TestClient

from latentlm.cli import main
from latentlm.models.base import Batch
from latentlm.models.hmm import DenseHMM
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_blocked_hmm, random_hmm
from latentlm.models.vocab import Preprocessing, Vocabulary
from latentlm.onnx_backend import OnnxScorer
from latentlm.service.app import create_app
from latentlm.service.settings import Settings

V = 12
LINES = "0 1 2 3\n4 5\n6 7 8 9 10 11 0 1\n"


@pytest.fixture()
def store(tmp_path):
    vocab = Vocabulary([f"w{i}" for i in range(V)], Preprocessing(lowercase=False, unk=None, eos=None, add_eos=False))
    t, c = random_hmm(6, V, seed=1)
    save_artifact(tmp_path / "store", "dense", "hmm", t, vocab, config=c)
    t, c = random_blocked_hmm(3, 2, V, seed=2)
    save_artifact(tmp_path / "store", "blocked", "blocked_hmm", t, vocab, config=c)
    return tmp_path / "store"


def score(capsys, monkeypatch, store, model, *extra):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(LINES))
    assert main(["score", "--model", model, "--store", str(store), "--ids", "--token-logprobs", *extra, "-"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("model", ["dense", "blocked"])
def test_cli_onnx_backend_matches_torch(store, capsys, monkeypatch, model):
    ref = score(capsys, monkeypatch, store, model)
    got = score(capsys, monkeypatch, store, model, "--backend", "onnx")
    assert len(got) == 3
    for a, b in zip(got, ref, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-5)
        assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], rel=1e-5, abs=1e-6)
        assert a["tokens"] == b["tokens"]
    assert list((store / ".onnx").glob(f"{model}-*.onnx"))  # the graph is cached in the store


def test_export_onnx_writes_a_checked_graph(store, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export-onnx", "--model", "dense", "--store", str(store), "--out", str(out)]) == 0
    scorer = OnnxScorer(out)
    assert scorer.family == "hmm" and scorer.name == "dense"
    lp, _ = scorer.score([[0, 1, 2, 3]])
    assert math.isfinite(lp[0]) and lp[0] < 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_service_onnx_backend(store, tmp_path):
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, backend="onnx"))
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["dense"]["backend"]["score"] == "onnx"
        assert "posterior" not in models["dense"]["backend"]  # every other operation: the torch engines
        got = c.post("/v1/score", json={"model": "blocked", "input": [[0, 1, 2], [3, 4]]}).json()["data"]
    ref = create_app(Settings(store=store, device="cpu", state_dir=tmp_path))
    with TestClient(ref) as c:
        while c.get("/ready").status_code != 200:
            pass
        assert c.get("/v1/models/dense").json()["backend"]["score"] in ("lockstep", "groups", "single", "torch")
        want = c.post("/v1/score", json={"model": "blocked", "input": [[0, 1, 2], [3, 4]]}).json()["data"]
    assert [g["logprob"] for g in got] == pytest.approx([w["logprob"] for w in want], rel=1e-5)


def test_fused_precision_setting_reaches_the_models(store, tmp_path):
    """LATENTLM_STORAGE_DTYPE=tfloat32: float32 storage with TF32 products on the fused CUDA path; on CPU the
    chain engine answers as before (exact), and an unknown precision is refused when the registry starts."""
    from latentlm.service.registry import ModelRegistry

    reg = ModelRegistry(store, device="cpu", storage_dtype="tfloat32")
    reg.reload()
    impl = reg.get("blocked").impl
    assert impl.allow_tf32 and impl.storage_dtype == torch.float32
    ref = ModelRegistry(store, device="cpu")
    ref.reload()
    batch = Batch.from_lists([[0, 1, 2, 3], [4, 5]])
    assert torch.equal(impl.score(batch)[0], ref.get("blocked").impl.score(batch)[0])
    with pytest.raises(ValueError, match="storage dtype"):
        ModelRegistry(store, device="cpu", storage_dtype="float16")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_service_with_bfloat16_storage_answers_every_operation(store, tmp_path):
    """LATENTLM_STORAGE_DTYPE=bfloat16 on CPU: the blocked model holds its matrix in bfloat16 only and answers
    score, posterior, decode and sample from it (as the float32 model of the rounded matrix would), says so in
    /v1/models, and the dense model (no bfloat16 CPU path) answers exactly as before."""
    from latentlm.models.blocked_hmm import BlockedHMM

    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, storage_dtype="bfloat16"))
    body = {"model": "blocked", "input": [[0, 1, 2, 3], [4, 5]]}
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        assert c.get("/v1/models/blocked").json()["backend"]["storage_dtype"] == "bfloat16"
        got = {op: c.post(f"/v1/{op}", json=body).json() for op in ("score", "posterior", "decode")}
        sample = c.post("/v1/sample", json={"model": "blocked", "n": 3, "max_tokens": 6, "seed": 5,
                                            "stop_at_eos": False})
        assert sample.status_code == 200 and len(sample.json()["data"]) == 3
        dense = c.post("/v1/score", json=dict(body, model="dense")).json()
        assert app.state.registry.get("blocked").impl.trans.dtype == torch.bfloat16
    t, cfg = random_blocked_hmm(3, 2, V, seed=2)
    ref = BlockedHMM.from_tensors(dict(t, trans=t["trans"].to(torch.bfloat16).float()), cfg)
    batch = Batch.from_lists(body["input"])
    assert [d["logprob"] for d in got["score"]["data"]] == pytest.approx(ref.score(batch)[0].tolist(), abs=1e-5)
    path, vlogp = ref.viterbi(batch)
    assert [d["states"] for d in got["decode"]["data"]] == [path[0].tolist(), path[1, :2].tolist()]
    assert [d["logprob"] for d in got["decode"]["data"]] == pytest.approx(vlogp.tolist(), abs=1e-5)
    ids, probs = ref.posterior(batch)
    first = got["posterior"]["data"][0]["marginals"][0]
    assert dict(zip(first["states"], first["probs"], strict=True)) == pytest.approx(
        dict(zip(ids[0, 0].tolist(), probs[0, 0].tolist(), strict=True)), abs=1e-6)
    ref_dense = DenseHMM.from_tensors(*random_hmm(6, V, seed=1)).score(Batch.from_lists(body["input"]))[0]
    assert [d["logprob"] for d in dense["data"]] == pytest.approx(ref_dense.tolist(), abs=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("calibrate", [True, False])
def test_service_calibrates_each_chain_model_and_shows_the_choice(store, tmp_path, calibrate):
    """At load the service times the batch engines and BLAS libraries on each chain model's matrix
    (LATENTLM_CALIBRATE, on by default) and /v1/models shows what it chose and what each candidate took."""
    from latentlm.models import backend as dispatch

    saved = dict(dispatch.CHOICES)
    dispatch.CHOICES.clear()
    try:
        app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, calibrate=calibrate))
        with TestClient(app) as c:
            while c.get("/ready").status_code != 200:
                pass
            info = c.get("/v1/models/dense").json()["backend"]
            assert info["calibrated"] is calibrate
            if calibrate:
                for op in ("score", "posterior"):
                    assert info["engines"][op] in info["calibration_ms"][op]
                    assert "torch" in info["calibration_ms"][op]
            assert c.post("/v1/score", json={"model": "dense", "input": [[0, 1, 2], [3, 4]]}).status_code == 200
    finally:
        dispatch.CHOICES.clear()
        dispatch.CHOICES.update(saved)
