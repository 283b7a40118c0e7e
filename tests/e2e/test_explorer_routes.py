"""The explorer's routes without a browser: GET / and its assets (also on servers that require an API key
and under a proxy's path prefix), and GET /v1/models/{id}/curve.png."""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import re
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.service.app import create_app
from latentlm.service.routes.explorer import ASSETS
from latentlm.service.settings import Settings
from tests.service.conftest import V, err, vocab

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "service" / "static"
KEY = "k-explorer"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # the route serves bytes; it does not decode them


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("explorer-store")
    t, c = random_hmm(8, V, seed=0)
    save_artifact(store, "with-curve", "hmm", t, vocab(), config=c, extra_files={"curve.png": PNG},
                  provenance={"best_valid_ppl": 31.5})
    save_artifact(store, "no-curve", "hmm", t, vocab(), config=c)
    return store


def client(store: Path, tmp: Path, keys: str = "") -> TestClient:
    return TestClient(create_app(Settings(store=store, device="cpu", state_dir=tmp, api_keys=keys)))


def wait_ready(c: TestClient) -> None:
    deadline = time.time() + 60
    while c.get("/ready").status_code != 200:
        assert time.time() < deadline, "models did not load"
        time.sleep(0.05)


def page_urls(html: str) -> list[str]:
    """The URLs the page loads: none as src/href attributes but inline data (see explorer.html), all from its
    first script."""
    assert all(u.startswith("data:") for u in re.findall(r'(?:src|href)="([^"]*)"', html))
    return re.findall(r'\.(?:src|href) = "([^"]+)"', html)


def test_page_and_assets(store, tmp_path):
    with client(store, tmp_path) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        assert "<title>latentlm explorer</title>" in r.text
        urls = page_urls(r.text)
        assert sorted(urls) == ["explorer/explorer.css", "explorer/explorer.js"]  # relative: a path prefix works
        for url in urls:
            a = c.get("/" + url)
            name = url.rsplit("/", 1)[1]
            assert a.status_code == 200, (url, a.text)
            assert a.headers["content-type"] == ASSETS[name]
            assert a.content == (STATIC / name).read_bytes()
            again = c.get("/" + url, headers={"If-None-Match": a.headers["etag"]})
            assert again.status_code == 304 and not again.content
        err(c.get("/explorer/app.py"), 404, "name", "no explorer asset 'app.py'")
        err(c.get("/explorer/explorer.html"), 404, "name")
        assert c.get("/explorer/..%2Fapp.py").status_code == 404


def test_the_page_calls_the_api_by_relative_urls():
    """An absolute '/v1/...' in the script would miss a proxy's path prefix."""
    js = (STATIC / "explorer.js").read_text()
    assert not re.search(r"""["'`]/v1""", js)
    for path in ("v1/models", "v1/score", "v1/posterior", "v1/decode", "v1/embed", "v1/sample", "/curve.png"):
        assert f'"{path}' in js, path
    assert "Authorization" in js and "Bearer " in js and "localStorage" in js


def test_static_files_are_package_data():
    """Every file under service/static is matched by pyproject's package-data, so a wheel ships it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = cfg["package-data"]["latentlm.service"]
    files = sorted(p.relative_to(STATIC.parent).as_posix() for p in STATIC.iterdir())
    assert {"static/explorer.html", "static/explorer.js", "static/explorer.css"} <= set(files)
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f


def test_auth_enabled_server_serves_the_page_but_not_the_api(store, tmp_path):
    with client(store, tmp_path, keys=KEY) as c:
        assert c.get("/").status_code == 200
        for name in ASSETS:
            assert c.get(f"/explorer/{name}").status_code == 200, name
        err(c.get("/v1/models"), 401, contains="missing API key")
        err(c.get("/v1/models/with-curve/curve.png"), 401, contains="missing API key")
        err(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, contains="invalid API key")
        wait_ready(c)
        ok = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and {m["id"] for m in ok.json()["data"]} == {"with-curve", "no-curve"}


def test_a_root_path_prefix_does_not_skip_auth(store, tmp_path):
    """Behind `uvicorn --root-path /lm` ASGI's path carries the prefix: /lm/v1/... must still need the key,
    and the page is served at /lm/."""
    app = create_app(Settings(store=store, device="cpu", state_dir=tmp_path, api_keys=KEY))

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, root_path="/lm")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            page = await c.get("/lm/")
            assert page.status_code == 200 and "explorer/explorer.js" in page.text
            assert (await c.get("/lm/explorer/explorer.js")).status_code == 200
            err(await c.get("/lm/v1/models"), 401, contains="missing API key")
            err(await c.post("/lm/v1/score", json={"model": "no-curve", "input": "w1"}), 401)
            r = await c.get("/lm/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text

    asyncio.run(run())


def test_curve_route(store, tmp_path):
    with client(store, tmp_path, keys=KEY) as c:
        wait_ready(c)
        auth = {"Authorization": f"Bearer {KEY}"}
        r = c.get("/v1/models/with-curve/curve.png", headers=auth)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content == PNG
        assert r.headers["etag"] == '"' + hashlib.sha256(PNG).hexdigest() + '"'
        err(c.get("/v1/models/no-curve/curve.png", headers=auth), 404, "model", "has no training curve")
        err(c.get("/v1/models/nope/curve.png", headers=auth), 404, "model", "'nope' not found")
        err(c.get("/v1/models/with-curve/weights.safetensors", headers=auth), 404)  # only curve.png is served
        spec = c.get("/openapi.json", headers=auth).json()["paths"]
        assert "/v1/models/{model_id}/curve.png" in spec and "/" not in spec
        # bytes changed under the loaded model: refused until a reload verifies them
        (store / "with-curve" / "curve.png").write_bytes(PNG + b"x")
        try:
            err(c.get("/v1/models/with-curve/curve.png", headers=auth), 409, "model", "changed since")
        finally:
            (store / "with-curve" / "curve.png").write_bytes(PNG)
        assert c.get("/v1/models/with-curve/curve.png", headers=auth).content == PNG
