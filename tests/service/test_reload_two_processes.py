"""Issue 16: two API processes on one Redis (how users scale out) see a reload made in either of them. Two real
`latentlm serve` processes on one model store and one redis-server; `POST /v1/models/reload` goes to one, the
other serves the new versions within about a second of its next request (`reload.ReloadWatcher`)."""

from __future__ import annotations

import shutil
import time

from tests.service.conftest import Server, add_model, err


def _until(pred, timeout: float = 15.0) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "not seen in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_reload_seen_by_the_other_process(tmp_path, redis_url):
    store = tmp_path / "store"
    add_model(store, "a", seed=1)
    url = redis_url.rsplit("/", 1)[0] + "/6"  # a database of its own: its generation counter starts at 0
    import redis

    redis.Redis.from_url(url).flushdb()
    (tmp_path / "p1").mkdir()
    (tmp_path / "p2").mkdir()
    env = {"LATENTLM_CACHE_URL": url}
    s1, s2 = Server(store, tmp_path / "p1", env=env), Server(store, tmp_path / "p2", env=env)
    body = {"model": "a", "input": "w1 w2 w3"}
    try:
        first = s1.client.post("/v1/score", json=body).json()["data"][0]["logprob"]
        assert s2.client.post("/v1/score", json=body).json()["data"][0]["logprob"] == first

        add_model(store, "a", seed=2)  # a new version of a, and a new model b
        add_model(store, "b", seed=3)
        r = s1.client.post("/v1/models/reload").json()
        assert r["updated"] == ["a"] and r["added"] == ["b"], r
        new = s1.client.post("/v1/score", json=body).json()["data"][0]["logprob"]
        assert new != first

        def s2_has_b() -> bool:
            return "b" in {m["id"] for m in s2.client.get("/v1/models").json()["data"]}

        seen_add = _until(s2_has_b)
        assert s2.client.post("/v1/score", json=body).json()["data"][0]["logprob"] == new

        shutil.rmtree(store / "b")  # removed, reloaded through the second process this time
        assert s2.client.post("/v1/models/reload").json()["removed"] == ["b"]
        seen_remove = _until(lambda: s1.client.get("/v1/models/b").status_code == 404)
        err(s1.client.post("/v1/score", json={"model": "b", "input": "w1"}), 404, "model")
        assert "models reloaded after a reload by another API process" in s2.output()
        print(f"\nFIGURES two API processes: reload in one seen by the other after {seen_add:.2f} s (added and "
              f"updated) and {seen_remove:.2f} s (removed), polling its /v1/models")
    finally:
        s1.stop()
        s2.stop()
