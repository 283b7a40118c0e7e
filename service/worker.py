"""`latentlm worker`: an rq SimpleWorker (no fork, so CUDA and loaded models stay valid) that runs batch
jobs from Redis, plus a reaper thread that re-enqueues live batches whose worker died (lease expired) and
deletes expired jobs.

A Redis outage never ends the process: rq's work loop quits on some Redis errors, so it runs under a
supervisor loop that waits for Redis (reconnecting with exponential backoff up to `redis_retry_max_s`, each
attempt logged) and starts the work loop again; a batch running when Redis went away waits for it inside
`jobs.process_batch` and resumes from its committed chunks. SIGTERM/SIGINT stop the worker (after the
running batch, as rq does; a second signal stops at once).

Workers on several hosts share one Redis and nothing else: each loads the models from its own store
(`LATENTLM_STORE`: the same artifacts on every host), files and batches live in Redis, and a worker is named by
its identity (`LATENTLM_WORKER_NAME`, default "<host>:<pid>") in rq, in leases and claims, and in its logs."""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time

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
        if b is None:  # deleted or expired
            store.forget_active(bid)
            continue
        if b["status"] not in jobs.LIVE or bid in waiting or store.lease_held(bid):
            continue
        if store.claim_requeue(bid, 2 * settings.job_lease_s):
            jobs.enqueue(queue, bid, " (requeued)")
            requeued.append(bid)
            log.warning("batch %s had no live worker; re-enqueued", bid)
    return requeued


def _reaper(store: jobs.RedisJobStore, queue, settings: Settings, stop: threading.Event) -> None:
    next_sweep = 0.0
    while not stop.wait(max(0.2, settings.job_lease_s / 2)):
        try:
            reap_once(store, queue, settings)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + max(1.0, settings.job_sweep_interval_s)
                if n := store.sweep():
                    log.info("deleted %d expired files and batches", n)
        except Exception as e:  # Redis blip: try again next round
            log.warning("reaper: %s: %s", type(e).__name__, e)


def _worker_class():
    from rq import SimpleWorker

    class Worker(SimpleWorker):
        """rq's SimpleWorker whose stop request also sets `stop_event` (and survives Redis being down)."""

        stop_event: threading.Event

        def request_stop(self, signum, frame):
            self.stop_event.set()
            try:
                super().request_stop(signum, frame)
            except jobs.REDIS_DOWN:  # rq records the request in Redis; stop all the same
                self._stop_requested = True

    return Worker


def _retire(w) -> None:
    """Stop the pubsub thread of an rq worker whose teardown failed (Redis down): the next one has its own."""
    t = getattr(w, "pubsub_thread", None) if w is not None else None
    if t is not None:
        t.stop()
        try:
            w.pubsub.close()
        except Exception:  # nothing to close properly without Redis
            pass


def run_worker(settings: Settings, burst: bool = False) -> None:
    """Blocking: process batch jobs until stopped (SIGTERM/SIGINT); survives Redis outages."""
    import redis
    from rq import Queue

    if not settings.redis_url:
        raise SystemExit("latentlm worker: REDIS_URL is not set (batch jobs without Redis run inside `serve`)")
    stop = threading.Event()
    store = jobs.RedisJobStore(settings.redis_url)
    # rq blocks on BLPOP for minutes: its connection has no read timeout (the store's commands have one)
    conn = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=jobs.REDIS_TIMEOUT_S)
    models = ModelRegistry.from_settings(settings)
    models.reload()
    identity = jobs.worker_identity(settings.worker_name)
    log.info("worker %s: %d models from %s", identity, len(models.models), settings.store)
    jobs.WORKER_CONTEXT.update(settings=settings, store=store, models=models, stop=stop)
    queue = Queue(jobs.QUEUE_NAME, connection=conn)
    reaper_queue = Queue(jobs.QUEUE_NAME, connection=store.redis)
    t = threading.Thread(target=_reaper, args=(store, reaper_queue, settings, stop), daemon=True)
    t.start()
    worker_cls = _worker_class()

    def on_signal(signum, frame) -> None:
        stop.set()

    try:
        while not stop.is_set():
            for sig in (signal.SIGTERM, signal.SIGINT):  # rq installs its own handlers inside work()
                signal.signal(sig, on_signal)
            if not jobs.wait_for_redis(conn, settings.redis_retry_max_s, stop):
                break
            w = None
            try:
                # rq's name must be unique among live workers: a restarted container keeps its host name and pid
                w = worker_cls([queue], connection=conn, name=f"{identity}-{secrets.token_hex(3)}")
                w.stop_event = stop
                w.max_connection_wait_time = settings.redis_retry_max_s  # rq's reconnect backoff (default 60 s)
                w.work(burst=burst, logging_level="WARNING")
            except jobs.REDIS_DOWN as e:
                log.warning("worker: lost Redis (%s: %s); reconnecting", type(e).__name__, e)
                _retire(w)
                continue
            except Exception:  # never exit on an error of rq's loop: log it and start the loop again
                log.exception("worker: rq's work loop failed; starting it again")
                _retire(w)
                stop.wait(1.0)
                continue
            if stop.is_set() or getattr(w, "_stop_requested", False):
                break
            try:
                if burst and not len(queue):
                    break
            except jobs.REDIS_DOWN:
                continue
            log.warning("worker: rq's work loop ended (see above); starting it again")
            stop.wait(0.5)
    finally:
        stop.set()
