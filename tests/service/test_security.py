"""Security settings (issue 16, item 9) against real uvicorn servers: with API keys, /metrics, /docs, /redoc and
/openapi.json are behind the key unless LATENTLM_OPEN_DOCS=1 (LATENTLM_PROTECT_DOCS=1 is still accepted);
LATENTLM_RATE_LIMIT_PER_KEY limits each key (token bucket with LATENTLM_RATE_LIMIT_BURST) in-process, or atomically
in Redis (shared by API processes) when Redis is configured, answering 429 + Retry-After in the JSON error shape; no
key is ever logged or stored."""

from __future__ import annotations

import asyncio
import time

import httpx
import redis

from latentlm.service.ratelimit import LocalRateLimiter, RedisRateLimiter

from .conftest import Server, err

K1, K2 = "sec-key-one-7f3a", "sec-key-two-91bc"
H1, H2 = {"Authorization": f"Bearer {K1}"}, {"Authorization": f"Bearer {K2}"}
FIGURES: list[str] = []


def test_protect_docs(store, tmp_path):
    s = Server(store, tmp_path, env={"LATENTLM_API_KEYS": f"{K1},{K2}", "LATENTLM_PROTECT_DOCS": "1"})
    try:
        c = s.client
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            e = err(c.get(path), 401)
            assert e["code"] == "missing_api_key"
            err(c.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            assert c.get(path, headers=H1).status_code == 200, path
        for path in ("/health", "/ready", "/"):  # probes and the explorer page stay open
            assert c.get(path).status_code == 200, path
        doc = c.get("/openapi.json", headers=H2).json()
        assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
        assert "401" in doc["paths"]["/metrics"]["get"]["responses"]
        assert K1 not in s.output() and K2 not in s.output()
    finally:
        s.stop()
    # opened explicitly (keys set): LATENTLM_OPEN_DOCS=1, or the older LATENTLM_PROTECT_DOCS=0
    for opened in ({"LATENTLM_OPEN_DOCS": "1"}, {"LATENTLM_PROTECT_DOCS": "0"}):
        s = Server(store, tmp_path, env={"LATENTLM_API_KEYS": K1, **opened})
        try:
            for path in ("/metrics", "/docs", "/openapi.json"):
                assert s.client.get(path).status_code == 200, path
            assert "security" not in s.client.get("/openapi.json").json()["paths"]["/metrics"]["get"]
        finally:
            s.stop()


def _burst(c: httpx.Client, headers: dict, n: int) -> list[httpx.Response]:
    return [c.get("/v1/models", headers=headers) for _ in range(n)]


def _check_limited(rs: list[httpx.Response], allowed: int) -> None:
    codes = [r.status_code for r in rs]
    assert codes.count(200) == allowed, codes
    for r in rs:
        if r.status_code == 429:
            e = err(r, 429)
            assert e["code"] == "rate_limited" and "LATENTLM_RATE_LIMIT_PER_KEY" in e["message"]
            assert int(r.headers["retry-after"]) >= 1


def test_rate_limit_in_process(store, tmp_path):
    env = {"LATENTLM_API_KEYS": f"{K1},{K2}", "LATENTLM_RATE_LIMIT_PER_KEY": "0.5", "LATENTLM_RATE_LIMIT_BURST": "5"}
    s = Server(store, tmp_path, env=env)
    try:
        c = s.client
        t = time.perf_counter()
        rs = _burst(c, H1, 12)
        t_burst = time.perf_counter() - t
        _check_limited(rs, 5)  # 0.5/s refills at most one token during the burst on a slow machine
        assert [r.status_code for r in rs[:5]] == [200] * 5
        _check_limited(_burst(c, H2, 6), 5)  # the other key has its own bucket
        err(c.post("/v1/score", json={"model": "tiny", "input": "w1"}, headers=H1), 429)  # operations too
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200  # probes not limited
        err(c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)  # a bad key: 401, not 429
        time.sleep(2.2)  # one token back
        assert c.get("/v1/models", headers=H1).status_code == 200
        FIGURES.append(f"in-process, 0.5/s burst 5: 12 requests of one key in {t_burst:.2f} s "
                       f"-> {[r.status_code for r in rs].count(200)} x 200, rest 429; other key unaffected")
        out = s.output()
        assert K1 not in out and K2 not in out
    finally:
        s.stop()


def test_rate_limit_redis_shared_by_two_processes(store, tmp_path, redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/3"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    env = {"LATENTLM_API_KEYS": f"{K1},{K2}", "LATENTLM_RATE_LIMIT_PER_KEY": "0.2", "LATENTLM_RATE_LIMIT_BURST": "6",
           "LATENTLM_CACHE_URL": url}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Server(store, tmp_path / "a", env=env)
    b = Server(store, tmp_path / "b", env=env)
    try:
        rs = []
        for _ in range(5):  # alternate between the two API processes: one shared bucket of 6
            rs += _burst(a.client, H1, 1) + _burst(b.client, H1, 1)
        _check_limited(rs, 6)
        _check_limited(_burst(b.client, H2, 3), 3)
        keys = [k.decode() for k in r.keys("*")]
        assert len(keys) == 2 and all(k.startswith("latentlm:ratelimit:k:") for k in keys), keys
        assert all(0 < r.pttl(k) <= 31_000 for k in keys)  # expires once the bucket would be full again
        dump = b"".join(r.dump(k) or b"" for k in r.keys("*"))
        assert K1.encode() not in dump and K2.encode() not in dump and not any(K1 in k or K2 in k for k in keys)
        assert K1 not in a.output() + b.output()
        FIGURES.append(f"Redis, two API processes, 0.2/s burst 6: 10 alternating requests -> "
                       f"{[x.status_code for x in rs].count(200)} x 200, 4 x 429")
    finally:
        a.stop()
        b.stop()
        r.flushdb()
        r.close()


def test_redis_limiter_is_atomic_and_fails_open(redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/4"

    async def run() -> tuple[int, float | None]:
        lim = RedisRateLimiter(url, rate=0.01, burst=20, timeout_s=1.0)
        await lim.redis.flushdb()
        waits = await asyncio.gather(*(lim.take("k:x") for _ in range(200)))  # concurrent: no lost update
        await lim.redis.flushdb()
        await lim.redis.aclose()
        down = RedisRateLimiter("redis://127.0.0.1:1/0", rate=1, burst=1, timeout_s=0.2)
        return sum(w is None for w in waits), await down.take("k:y")

    allowed, down = asyncio.run(run())
    assert allowed == 20
    assert down is None  # Redis unreachable: the request goes through (counted, logged)


def test_local_limiter_refills():
    lim = LocalRateLimiter(rate=10, burst=2)

    async def run() -> list[float | None]:
        first = [await lim.take("a") for _ in range(3)]
        await asyncio.sleep(0.15)
        return [*first, await lim.take("a")]

    w = asyncio.run(run())
    assert w[0] is None and w[1] is None and w[2] is not None and 0 < w[2] <= 0.1 and w[3] is None
    print("\nFIGURES", *FIGURES, sep="\n")
