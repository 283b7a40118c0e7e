"""Issue 16, item 6: `POST /v1/models/reload` refuses a corrupted, half-written or manifest-less artifact with a
logged reason, and the previous version keeps serving; only a model whose whole directory is gone is unloaded."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from fastapi.testclient import TestClient

from latentlm.service.app import create_app
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings
from tests.service.conftest import add_model, err, ready, reload_models

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_reload_refuses_missing_or_broken_manifest(tmp_path, caplog):
    store = tmp_path / "store"
    add_model(store, "a", seed=1)
    add_model(store, "b", seed=2)
    mpath = store / "a" / "manifest.json"
    good_manifest = mpath.read_bytes()
    weights = store / "a" / "weights.safetensors"
    good_weights = weights.read_bytes()
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path / "state"))
    body = {"model": "a", "input": [[1, 2, 3]]}

    caplog.set_level(logging.ERROR, logger="latentlm.service")
    with TestClient(app) as c:
        ready(c)
        first = c.post("/v1/score", json=body).json()

        def refused(why: str) -> dict:
            caplog.clear()
            r = reload_models(c)
            assert set(r["failed"]) == {"a"} and why in r["failed"]["a"], r["failed"]
            assert r["removed"] == [] and r["updated"] == [] and r["added"] == []
            assert c.post("/v1/score", json=body).json() == first  # the previous version keeps serving
            assert {m["id"] for m in r["data"]} == {"a", "b"}
            logged = [rec.getMessage() for rec in caplog.records if "cannot load model a" in rec.getMessage()]
            assert logged and why in logged[0] and "previous version keeps serving" in logged[0], logged
            return r

        mpath.unlink()  # the manifest deleted: refused, was silently unloaded
        refused("missing manifest")
        mpath.write_bytes(good_manifest[: len(good_manifest) // 2])  # a half-written manifest
        refused("not valid JSON")
        mpath.write_bytes(b"")  # created, nothing written yet
        refused("not valid JSON")
        m = json.loads(good_manifest)
        del m["files"]
        mpath.write_text(json.dumps(m))
        refused("missing field 'files'")
        m = json.loads(good_manifest)
        m["shapes"] = {k: [d + 1 for d in v] for k, v in m["shapes"].items()}  # edited shapes
        mpath.write_text(json.dumps(m))
        refused("shape")
        mpath.write_bytes(good_manifest)
        weights.write_bytes(good_weights[:-1] + bytes([good_weights[-1] ^ 0x80]))  # a flipped bit
        refused("SHA-256 mismatch")
        weights.write_bytes(good_weights[: len(good_weights) // 3])  # truncated
        refused("SHA-256 mismatch")
        weights.write_bytes(good_weights)
        mpath.rename(tmp_path / "elsewhere.json")
        os.symlink(tmp_path / "elsewhere.json", mpath)  # the manifest a symbolic link to outside the store
        refused("symbolic link")
        mpath.unlink()
        (tmp_path / "elsewhere.json").rename(mpath)
        m = json.loads(good_manifest)
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "file").write_text("x\n")
        m["files"]["../../outside/file"] = "0" * 64  # a manifest path out of the model directory
        mpath.write_text(json.dumps(m))
        refused("not a plain name")
        mpath.write_bytes(good_manifest)

        # an update under way (`write_artifact` has moved the old directory aside): refused, keeps serving
        moved = store / f".a.old.{os.getpid()}"
        (store / "a").rename(moved)
        refused("no such model directory")
        moved.rename(store / "a")

        r = reload_models(c)
        assert r["failed"] == {} and r["removed"] == [] and c.get("/ready").json()["failed"] == {}
        assert c.post("/v1/score", json=body).json() == first

        # a directory with model files but no manifest is reported, never served
        shutil.copytree(store / "b", store / "c")
        (store / "c" / "manifest.json").unlink()
        r = reload_models(c)
        assert set(r["failed"]) == {"c"} and "missing manifest" in r["failed"]["c"] and r["added"] == []
        err(c.get("/v1/models/c"), 404, "model")
        shutil.rmtree(store / "c")

        # the whole directory deleted: the model is removed, as before
        shutil.rmtree(store / "a")
        r = reload_models(c)
        assert r["removed"] == ["a"] and r["failed"] == {}
        err(c.post("/v1/score", json=body), 404, "model")


def test_registry_refuses_deleted_manifest_without_rehash(tmp_path):
    store = tmp_path / "store"
    add_model(store, "a", seed=1)
    reg = ModelRegistry(store)
    reg.reload()
    kept = reg.get("a")
    (store / "a" / "manifest.json").unlink()
    out = reg.reload(rehash=False)
    assert out["failed"] == ["a"] and out["removed"] == [] and reg.get("a") is kept
    assert "missing manifest" in reg.failed["a"]
