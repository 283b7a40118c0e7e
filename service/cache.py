"""Response cache on Redis for deterministic operations (score, posterior, decode, embed).

Keys hold the model's content hash and numerics (dtype, scoring precision; see `execute.cache_key`), so after
a reload that changes a model no old answer can match, and servers set up with other precisions sharing one
Redis never answer with each other's numbers. Cache failures never fail a request: they are counted and the
request computes.

A slow or hung cache must not slow every request down: each command has a short socket timeout
(`LATENTLM_CACHE_TIMEOUT_S`), and a circuit breaker skips the cache altogether for
`LATENTLM_CACHE_BREAKER_COOLDOWN_S` after `LATENTLM_CACHE_BREAKER_FAILURES` consecutive failures; then one
request probes it (success closes the breaker, failure opens it again). Skips and trips are counted."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")


class CircuitBreaker:
    """Closed until `failures` consecutive failures; then open (calls skipped) for `cooldown_s`; then one probe
    (half-open). `failures` 0 disables it. Event-loop only: no lock needed."""

    def __init__(self, failures: int, cooldown_s: float):
        self.failures, self.cooldown_s = failures, cooldown_s
        self.fails = 0
        self.open_until = 0.0  # monotonic time; 0 = closed
        self.trips = 0

    def allow(self) -> bool:
        """Whether a call may go to Redis now (a single probe is let through once the cool-down is over)."""
        if not self.open_until:
            return True
        now = time.monotonic()
        if now < self.open_until:
            return False
        self.open_until = now + self.cooldown_s  # the probe: others keep skipping until it answers
        return True

    def success(self) -> None:
        if self.open_until:
            log.warning("response cache answers again: circuit breaker closed")
        self.fails, self.open_until = 0, 0.0

    def failure(self) -> bool:
        """Count a failure; True when the breaker (re)opens now."""
        self.fails += 1
        if self.failures <= 0 or (self.fails < self.failures and not self.open_until):
            return False
        self.open_until = time.monotonic() + self.cooldown_s
        self.trips += 1
        return True


class ResponseCache:
    """get/set of response bodies (bytes) with a TTL, behind a circuit breaker."""

    def __init__(self, url: str, ttl_s: int, metrics: Metrics, settings: Settings | None = None):
        s = settings or Settings()
        # no retries (redis-py retries 10 times by default): a hung cache costs one timeout, not eleven
        self.redis = aioredis.Redis.from_url(url, socket_timeout=s.cache_timeout_s,
                                             socket_connect_timeout=s.cache_timeout_s,
                                             retry=Retry(NoBackoff(), 0))
        self.ttl, self.metrics = ttl_s, metrics
        self.breaker = CircuitBreaker(s.cache_breaker_failures, s.cache_breaker_cooldown_s)

    def _failed(self, what: str, e: Exception) -> None:
        self.metrics.cache_errors.inc()
        if self.breaker.failure():
            self.metrics.cache_breaker_trips.inc()
            log.warning("cache %s failed (%s: %s); circuit breaker open: cache skipped for %.0f s", what,
                        type(e).__name__, e, self.breaker.cooldown_s)
        else:
            log.warning("cache %s failed: %s: %s", what, type(e).__name__, e)

    async def get(self, key: str, op: str) -> bytes | None:
        if not self.breaker.allow():
            self.metrics.cache_skipped.inc()
            return None
        try:
            value = await self.redis.get(key)
        except Exception as e:  # Redis down or hung: serve uncached
            self._failed("get", e)
            return None
        self.breaker.success()
        (self.metrics.cache_hits if value is not None else self.metrics.cache_misses).labels(op).inc()
        return value

    async def set(self, key: str, value: bytes) -> None:
        if not self.breaker.allow():
            self.metrics.cache_skipped.inc()
            return
        try:
            await self.redis.set(key, value, ex=self.ttl)
        except Exception as e:  # e.g. OOM on a noeviction instance
            self._failed("set", e)
            return
        self.breaker.success()

    async def close(self) -> None:
        await self.redis.aclose()
