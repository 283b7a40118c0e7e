"""Issue 16: the per-key rate limiter on a hung Redis. Before: every request waited for the Redis timeout and then
went through unlimited (fail open, no circuit breaker). Now: the cache's circuit breaker (same settings) skips
Redis after 3 failures in a row, the limit is kept by an in-process bucket meanwhile, and one probe after the
cool-down puts the shared Redis bucket back. A real `latentlm serve` and a real redis-server, frozen by SIGSTOP."""

from __future__ import annotations

import time

from tests.service.conftest import Server, metric
from tests.service.test_jobs_faults import RedisProc


def test_hung_rate_limit_redis_circuit_breaker(store, tmp_path):
    d = tmp_path / "rl"
    d.mkdir()
    rp = RedisProc(d, aof=False)
    s = Server(store, d, env={"LATENTLM_CACHE_URL": rp.url, "LATENTLM_RATE_LIMIT_PER_KEY": "0.5",
                              "LATENTLM_RATE_LIMIT_BURST": "5", "LATENTLM_CACHE_BREAKER_COOLDOWN_S": "2"})
    c = s.client
    try:
        assert c.get("/v1/models").status_code == 200  # through Redis: 4 tokens left in the shared bucket
        m0 = c.get("/metrics").text
        rp.freeze()
        times, codes = [], []
        for _ in range(20):
            t0 = time.monotonic()
            r = c.get("/v1/models")
            times.append(time.monotonic() - t0)
            codes.append(r.status_code)
            assert r.status_code in (200, 429), r.text
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1
        m1 = c.get("/metrics").text
        ok = codes.count(200)
        # the limit holds through the outage (in-process bucket: burst 5, 0.5/s), it is not lifted
        assert 5 <= ok <= 7 and codes.count(429) == 20 - ok, codes
        assert metric(m1, "latentlm_rate_limit_breaker_trips_total") - metric(
            m0, "latentlm_rate_limit_breaker_trips_total") == 1
        assert metric(m1, "latentlm_rate_limit_errors_total") - metric(m0, "latentlm_rate_limit_errors_total") == 3
        assert metric(m1, "latentlm_rate_limit_skipped_total") - metric(m0, "latentlm_rate_limit_skipped_total") >= 15
        assert sum(times) < 4, times  # three timeouts of 0.5 s, then Redis is not asked
        assert sorted(times)[10] < 0.2, times
        rp.thaw()
        time.sleep(2.3)  # the cool-down: one probe then closes the breaker
        after = [c.get("/v1/models").status_code for _ in range(8)]
        m2 = c.get("/metrics").text
        assert metric(m2, "latentlm_rate_limit_errors_total") == metric(m1, "latentlm_rate_limit_errors_total")
        assert after.count(200) >= 1 and after.count(429) >= 1, after  # the shared Redis bucket decides again
        assert "circuit breaker open" in s.output()
        times.sort()
        print(f"\nFIGURES hung rate-limit Redis: 20 requests in {sum(times):.2f} s, median {times[10] * 1000:.0f} ms, "
              f"max {times[-1] * 1000:.0f} ms; {ok} x 200, {20 - ok} x 429 during the outage; after the thaw "
              f"{after.count(200)} x 200, {after.count(429)} x 429")
    finally:
        s.stop()
        rp.stop()
