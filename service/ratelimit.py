"""Per-key rate limits on /v1 (LATENTLM_RATE_LIMIT_PER_KEY, LATENTLM_RATE_LIMIT_BURST): a token bucket per client,
in this process or shared by every API process in Redis (one atomic Lua script on Redis's clock), answered 429 +
Retry-After by `middleware.Guard`. Never stores or logs a key: clients are named by a SHA-256 of their key."""

from __future__ import annotations

import hashlib
import logging
import math
import time

from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")


def client_id(scope, keyed: bool) -> str:
    """Who a rate limit applies to: a SHA-256 of the bearer key (the key itself is never stored or logged), or
    the client address without keys."""
    if keyed:
        value = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return "k:" + hashlib.sha256(value.partition(b" ")[2].strip()).hexdigest()[:32]
    client = scope.get("client") or ("unknown", 0)
    return f"a:{client[0]}"


class LocalRateLimiter:
    """Token buckets in this process: `rate` tokens per second, at most `burst`; one token per request."""

    MAX_CLIENTS = 100_000  # buckets kept; full ones (idle clients) are dropped beyond it

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.buckets: dict[str, tuple[float, float]] = {}  # id -> (tokens, time)

    async def take(self, ident: str) -> float | None:
        """None when the request may go; else the seconds until a token is free."""
        now = time.monotonic()
        tokens, then = self.buckets.get(ident, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1:
            self.buckets[ident] = (tokens - 1, now)
            if len(self.buckets) > self.MAX_CLIENTS:
                self._prune(now)
            return None
        self.buckets[ident] = (tokens, now)
        return (1 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        full = [k for k, (t, ts) in self.buckets.items() if t + (now - ts) * self.rate >= self.burst]
        for k in full:
            del self.buckets[k]


# One token bucket per client in a Redis hash, updated atomically by one script with Redis's own clock (so API
# processes on several machines share one limit); the key expires once the bucket would be full again.
TOKEN_BUCKET = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(v[1]) or burst, tonumber(v[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisRateLimiter:
    """The token bucket of `LocalRateLimiter`, shared in Redis by every API process (atomic: one Lua script).

    A slow or hung Redis must not slow every request down, nor lift the limit: each check has a short timeout and
    no retries, and the cache's circuit breaker (`cache.CircuitBreaker`, the same settings:
    LATENTLM_CACHE_BREAKER_FAILURES, LATENTLM_CACHE_BREAKER_COOLDOWN_S) skips Redis for the cool-down after that
    many failures in a row, then lets one probe through. A check that fails, and every check while the breaker is
    open, is made by an in-process bucket instead (the same rate and burst, per API process), so the limit holds
    through an outage. Counted: `latentlm_rate_limit_errors`, `latentlm_rate_limit_skipped`,
    `latentlm_rate_limit_breaker_trips`."""

    def __init__(self, url: str, rate: float, burst: int, timeout_s: float, metrics: Metrics | None = None,
                 breaker_failures: int = 3, breaker_cooldown_s: float = 30.0):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from latentlm.service.cache import CircuitBreaker

        self.rate, self.burst, self.metrics = rate, burst, metrics
        # no retries (redis-py retries by default): a hung Redis costs one timeout per check, not several
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=32, timeout=timeout_s,
                                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                        retry=Retry(NoBackoff(), 0))
        self.redis = aioredis.Redis(connection_pool=pool)  # waits for a free connection under concurrency
        self.script = self.redis.register_script(TOKEN_BUCKET)
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.fallback = LocalRateLimiter(rate, burst)
        self.skipped = self.trips = None
        if metrics is not None:
            counters = getattr(metrics, "_rate_limit_breaker", None)
            if counters is None:
                from prometheus_client import Counter

                counters = metrics._rate_limit_breaker = (  # type: ignore[attr-defined]
                    Counter("latentlm_rate_limit_skipped", "rate-limit checks made in-process without Redis while "
                            "the rate limiter's circuit breaker is open", registry=metrics.registry),
                    Counter("latentlm_rate_limit_breaker_trips", "times the rate limiter's circuit breaker opened",
                            registry=metrics.registry))
            self.skipped, self.trips = counters

    async def take(self, ident: str) -> float | None:
        if not self.breaker.allow():
            if self.skipped is not None:
                self.skipped.inc()
            return await self.fallback.take(ident)
        try:
            wait = float(await self.script(keys=[f"latentlm:ratelimit:{ident}"], args=[self.rate, self.burst]))
        except Exception as e:  # Redis down or hung: the in-process bucket decides
            if self.metrics is not None:
                self.metrics.rate_limit_errors.inc()
            if self.breaker.failure():
                if self.trips is not None:
                    self.trips.inc()
                log.warning("rate limit check failed (%s); circuit breaker open: limits kept in this process for "
                            "%.0f s", type(e).__name__, self.breaker.cooldown_s)
            else:
                log.warning("rate limit check failed: Redis unavailable (%s); checked in this process",
                            type(e).__name__)
            return await self.fallback.take(ident)
        if self.breaker.open_until:
            log.warning("rate limiter's Redis answers again: circuit breaker closed")
        self.breaker.fails, self.breaker.open_until = 0, 0.0
        return wait if wait > 0 else None


def make_limiter(settings: Settings, metrics: Metrics | None = None) -> LocalRateLimiter | RedisRateLimiter:
    """Redis-backed where a cache or queue Redis is configured, else in this process."""
    rate = settings.rate_limit_per_key
    burst = settings.rate_limit_burst or max(1, math.ceil(2 * rate))
    if settings.cache_redis_url:
        return RedisRateLimiter(settings.cache_redis_url, rate, burst, max(settings.cache_timeout_s, 0.5), metrics,
                                settings.cache_breaker_failures, settings.cache_breaker_cooldown_s)
    return LocalRateLimiter(rate, burst)
