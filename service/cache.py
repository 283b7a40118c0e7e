"""Response cache on Redis for deterministic operations (score, posterior, decode, embed).

Keys hold the model's content hash (see `execute.cache_key`), so after a reload that changes a model no
old answer can match. Cache failures never fail a request: they are counted and the request computes."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from latentlm.service.metrics import Metrics

log = logging.getLogger("latentlm.service")
CACHED_OPS = frozenset({"score", "posterior", "decode", "embed"})


class ResponseCache:
    """get/set of response bodies (bytes) with a TTL."""

    def __init__(self, url: str, ttl_s: int, metrics: Metrics):
        self.redis = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.ttl, self.metrics = ttl_s, metrics

    async def get(self, key: str, op: str) -> bytes | None:
        try:
            value = await self.redis.get(key)
        except Exception as e:  # Redis down: serve uncached
            log.warning("cache get failed: %s", e)
            self.metrics.cache_errors.inc()
            return None
        (self.metrics.cache_hits if value is not None else self.metrics.cache_misses).labels(op).inc()
        return value

    async def set(self, key: str, value: bytes) -> None:
        try:
            await self.redis.set(key, value, ex=self.ttl)
        except Exception as e:  # e.g. OOM on a noeviction instance
            log.warning("cache set failed: %s", e)
            self.metrics.cache_errors.inc()

    async def close(self) -> None:
        await self.redis.aclose()
