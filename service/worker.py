"""`latentlm worker`: an rq SimpleWorker (no fork, so CUDA and loaded models stay valid) that runs batch
jobs from Redis, plus a reaper thread that re-enqueues live batches whose worker died (lease expired)."""

from __future__ import annotations

import logging
import threading

from latentlm.service import jobs
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.worker")


def reap_once(store: jobs.RedisJobStore, queue, settings: Settings) -> list[str]:
    """Re-enqueue live batches that no worker holds a lease on and no queued job will pick up (at most once
    per 2 lease periods)."""
    requeued = []
    active = store.active()
    waiting = jobs.queued_batches(queue) if active else set()
    for bid in active:
        b = store.get_batch(bid)
        if b is None or b["status"] not in jobs.LIVE or bid in waiting or store.lease_held(bid):
            continue
        if store.claim_requeue(bid, 2 * settings.job_lease_s):
            jobs.enqueue(queue, bid, " (requeued)")
            requeued.append(bid)
            log.warning("batch %s had no live worker; re-enqueued", bid)
    return requeued


def _reaper(store: jobs.RedisJobStore, queue, settings: Settings, stop: threading.Event) -> None:
    while not stop.wait(max(0.2, settings.job_lease_s / 2)):
        try:
            reap_once(store, queue, settings)
        except Exception as e:  # Redis blip: try again next round
            log.warning("reaper: %s", e)


def run_worker(settings: Settings, burst: bool = False) -> None:
    """Blocking: process batch jobs until stopped (SIGTERM/SIGINT)."""
    from rq import Queue, SimpleWorker


    if not settings.redis_url:
        raise SystemExit("latentlm worker: REDIS_URL is not set (batch jobs without Redis run inside `serve`)")
    store = jobs.RedisJobStore(settings.redis_url)
    models = ModelRegistry.from_settings(settings)
    models.reload()
    log.info("worker: %d models from %s", len(models.models), settings.store)
    jobs.WORKER_CONTEXT.update(settings=settings, store=store, models=models)
    queue = Queue(jobs.QUEUE_NAME, connection=store.redis)
    stop = threading.Event()
    reap_once(store, queue, settings)
    t = threading.Thread(target=_reaper, args=(store, queue, settings, stop), daemon=True)
    t.start()
    try:
        SimpleWorker([queue], connection=store.redis).work(burst=burst, logging_level="WARNING")
    finally:
        stop.set()
