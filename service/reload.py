"""Keeps the API processes on one Redis serving the same models (`ReloadWatcher`): a reload in one process bumps a
generation counter in Redis, the others notice it within a second of their next request and reload the store."""

from __future__ import annotations

import logging
import time

from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")

GENERATION_KEY = "latentlm:models:generation"


class ReloadWatcher:
    """Keeps the API processes on one Redis serving the same models: `POST /v1/models/reload` in any of them
    increments a generation counter in Redis (`bump`); every process looks at it at most once every
    `RELOAD_CHECK_S` while it takes requests (`poke`: in the background, never in a request's way) and, when it
    moved, reloads the store itself (new or changed manifests verified as a fresh load, unchanged files re-hashed
    where their stat changed). A Redis that fails is skipped behind the cache's circuit breaker (logged); the
    process then serves what it has until Redis answers again."""

    RELOAD_CHECK_S = 1.0

    def __init__(self, url: str, state, settings: Settings):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from latentlm.service.cache import CircuitBreaker

        timeout = max(settings.cache_timeout_s, 0.5)
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                             retry=Retry(NoBackoff(), 0))
        self.state = state
        self.breaker = CircuitBreaker(settings.cache_breaker_failures, settings.cache_breaker_cooldown_s)
        self.seen: int | None = None  # the generation this process has loaded
        self.next_check = 0.0
        self.task = None
        self.reloads = 0  # reloads started because another process reloaded

    def poke(self) -> None:
        """Start a background check when the last one is over a second old (and none is running)."""
        import asyncio

        now = time.monotonic()
        if now < self.next_check or (self.task is not None and not self.task.done()):
            return
        self.next_check = now + self.RELOAD_CHECK_S
        self.task = asyncio.get_running_loop().create_task(self._check_logged())

    async def _check_logged(self) -> None:
        try:
            await self.check()
        except Exception as e:  # e.g. the loader shut down meanwhile: never an unretrieved task exception
            log.warning("model generation check failed: %s: %s", type(e).__name__, e)

    async def check(self) -> bool:
        """Reload when the generation in Redis is not the one this process loaded; True when it reloaded."""
        import asyncio

        registry = self.state.registry
        if not registry.ready or not self.breaker.allow():
            return False
        try:
            raw = await self.redis.get(GENERATION_KEY)
        except Exception as e:
            if self.breaker.failure():
                log.warning("model generation check failed (%s); circuit breaker open for %.0f s", type(e).__name__,
                            self.breaker.cooldown_s)
            return False
        self.breaker.fails, self.breaker.open_until = 0, 0.0
        gen = int(raw or 0)
        if gen == self.seen or (self.seen is None and gen == 0):
            self.seen = gen
            return False
        # another process reloaded (or, on the first look, may have since this process loaded the store)
        first = self.seen is None
        self.seen = gen
        self.reloads += 1
        out = await asyncio.get_running_loop().run_in_executor(self.state.loader, self._reload)
        changed = {k: v for k, v in out.items() if v}
        if changed or not first:
            log.warning("models reloaded after a reload by another API process (generation %d): %s", gen,
                        changed or "no change")
        return True

    def _reload(self) -> dict:
        out = self.state.registry.reload(rehash=False)
        out["failed"] = {name: self.state.registry.failed.get(name, "") for name in out["failed"]}
        self.state.metrics.models_loaded.set(len(self.state.registry.models))
        return out

    async def bump(self) -> int | None:
        """After a reload here: tell the other processes (the new generation, or None when Redis failed)."""
        try:
            gen = int(await self.redis.incr(GENERATION_KEY))
        except Exception as e:
            log.warning("reload not announced to other API processes: Redis unavailable (%s: %s)",
                        type(e).__name__, e)
            return None
        self.seen = gen
        return gen
