"""What the routes share: one `ServiceState` per app (settings, metrics, model registry, batcher, response
cache, batch-job store and runner), reached from a route through the `get_state` dependency."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from latentlm.service.batcher import Lanes, QueueFull
from latentlm.service.cache import ResponseCache
from latentlm.service.errors import APIError, shutting_down
from latentlm.service.metrics import Metrics
from latentlm.service.preparing import Preparer
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    registry: ModelRegistry
    batcher: Lanes  # a `Batcher` (this process's lanes) or an `engine.EngineClient` (the engine process's)
    loader: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="load"))
    preparer: Preparer = field(default_factory=Preparer)  # constraint compilation, off the event loop
    cache: ResponseCache | None = None
    jobs: Any = None  # jobs.LocalJobStore or jobs.RedisJobStore, set at startup
    runner: Any = None  # jobs.LocalRunner or jobs.RQRunner
    draining: bool = False  # SIGTERM received: /ready 503, new work 503 (`Guard`)
    inflight: int = 0  # HTTP requests inside the app now (counted by `Guard`)

    def shutting_down(self) -> APIError:
        return shutting_down(self.settings.retry_after_s)

    async def drain(self) -> dict[str, float]:
        """After SIGTERM: refuse new work at once, wait up to `shutdown_grace_s` for the requests in flight, then
        answer what is still queued, computing or compiling its constraint with 503. Returns {"waited_s", "left",
        "answered_503"}."""
        self.draining = True
        start = time.monotonic()
        deadline = start + self.settings.shutdown_grace_s
        log.warning("shutting down: %d request(s) in flight, grace %.1f s", self.inflight,
                    self.settings.shutdown_grace_s)
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.inflight
        self.preparer.stop()  # compilations still running stop at their next check; their requests get 503
        answered = self.batcher.fail_pending()
        if answered:
            log.warning("shutdown grace over: %d queued or running request(s) answered 503", answered)
        return {"waited_s": time.monotonic() - start, "left": left, "answered_503": answered}

    def ensure_ready(self) -> None:
        """503 with Retry-After until every model has been loaded (or failed to load)."""
        if not self.registry.ready:
            raise APIError(503, "models are still loading; retry shortly", code="not_ready",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if not self.batcher.ready:
            raise APIError(503, "the inference engine is not reachable (starting or restarting); retry shortly",
                           code="engine_unavailable", headers={"Retry-After": str(self.settings.retry_after_s)})

    def queue_full(self, e: QueueFull) -> APIError:
        return APIError(429, f"server busy: {e}", code="queue_full",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def reload_models(self) -> dict:
        """Blocking (run on `loader`): pick up the store's models (every file re-hashed); `failed` is
        {name: why it was refused} (a refused model's previous version, if any, keeps serving)."""
        out = self.registry.reload()
        out["failed"] = {name: self.registry.failed.get(name, "") for name in out["failed"]}
        self.metrics.models_loaded.set(len(self.registry.models))
        gc.collect()
        gc.freeze()  # long-lived objects (torch, models) out of the collector's way: shorter GC pauses
        return out


def get_state(request: Request) -> ServiceState:
    """FastAPI dependency: the app's `ServiceState`."""
    return request.app.state.service
