"""Who runs batches: `LocalRunner` (without Redis: one thread of the API process, batches one at a time, a
periodic sweep of expired jobs) and `RQRunner` (with Redis: each batch an rq job, run by `latentlm worker`
through `rq_process_batch`; the job's lead enqueues helper jobs for the same batch so that other workers, on any
host, share its chunks), with the helpers the worker's reaper uses (`enqueue`, `queued_batches`)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from latentlm.service.jobs.local_store import LocalJobStore
from latentlm.service.jobs.processing import RunCalls, process_batch
from latentlm.service.jobs.redis_store import RedisJobStore
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.jobs")

QUEUE_NAME = "latentlm-batches"
FAILURE_TTL_S = 7 * 86400     # how long rq keeps a failed job's record


class LocalRunner:
    """Without Redis: batches run one at a time in a thread of the API process; unfinished ones resume
    at startup. The thread survives any error (a full or read-only disk fails the batch, not the thread) and
    deletes expired jobs every `job_sweep_interval_s`."""

    def __init__(self, store: LocalJobStore, models: ModelRegistry, settings: Settings,
                 run_calls: RunCalls | None = None):
        """`run_calls`: where the lines run (an engine process's `EngineClient.run_calls`; default this process)."""
        self.store, self.models, self.settings, self.run_calls = store, models, settings, run_calls
        self._q: list[str] = []
        self._cv = threading.Condition()
        self._stop = False
        self._t = threading.Thread(target=self._loop, name="latentlm-jobs", daemon=True)

    def start(self) -> None:
        with self._cv:
            self._q.extend(self.store.active())
        self._t.start()

    def submit(self, bid: str) -> None:
        with self._cv:
            self._q.append(bid)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _loop(self) -> None:
        next_sweep = time.monotonic()
        while True:
            with self._cv:
                while not self._q and not self._stop and time.monotonic() < next_sweep:
                    self._cv.wait(max(0.01, next_sweep - time.monotonic()))
                if self._stop:
                    return
                bid = self._q.pop(0) if self._q else None
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + max(1.0, self.settings.job_sweep_interval_s)
                    if n := self.store.sweep():
                        log.info("deleted %d expired files and batches", n)
                self.store.flush()
                if bid is not None:
                    if not self.models.ready:
                        self.models.reload()
                    process_batch(self.store, self.models, bid, self.settings, run_calls=self.run_calls)
            except Exception:  # never let the runner thread die: later batches must still run
                log.exception("job runner: error (batch %s); going on", bid)


class RQRunner:
    """With Redis: batches are rq jobs (`service.jobs.rq_process_batch`) run by `latentlm worker`."""

    def __init__(self, store: RedisJobStore, url: str):
        from rq import Queue

        self.store = store
        self.queue = Queue(QUEUE_NAME, connection=store.redis)

    def start(self) -> None:
        return None

    def submit(self, bid: str) -> None:
        enqueue(self.queue, bid)

    def stop(self) -> None:
        return None


def enqueue(queue, bid: str, note: str = "") -> None:
    """One rq job for a batch; the job id starts with the batch id (see `queued_batches`)."""
    queue.enqueue("latentlm.service.jobs.rq_process_batch", bid, job_timeout=-1, result_ttl=3600,
                  failure_ttl=FAILURE_TTL_S, job_id=f"{bid}-{secrets.token_hex(4)}",
                  description=f"latentlm batch {bid}{note}")


def queued_batches(queue) -> set[str]:
    """Batch ids with a job waiting in the rq queue."""
    return {jid.rsplit("-", 1)[0] for jid in queue.get_job_ids()}


# state of a `latentlm worker` process (set by service.worker before rq starts working)
WORKER_CONTEXT: dict[str, Any] = {}


def helpers_wanted(store: RedisJobStore, settings: Settings, chunks_left: int) -> int:
    """How many helper jobs a batch's lead enqueues: one per other worker that may share the batch
    (`job_workers_per_batch`, 0: every worker registered on the queue), at most one per chunk left."""
    from rq import Queue, Worker

    cap = settings.job_workers_per_batch
    workers = cap if cap > 0 else Worker.count(connection=store.redis, queue=Queue(QUEUE_NAME,
                                                                                     connection=store.redis))
    return max(0, min(chunks_left, workers - 1))


def _fan_out(store: RedisJobStore, settings: Settings, bid: str):
    """The `fan_out` of a batch run by rq: helper jobs for the same batch, picked up by idle workers."""
    from rq import Queue

    def ask(chunks_left: int) -> None:
        n = helpers_wanted(store, settings, chunks_left)
        queue = Queue(QUEUE_NAME, connection=store.redis)
        for _ in range(n):
            enqueue(queue, bid, " (helper)")
        if n:
            log.info("batch %s: %d helper jobs enqueued", bid, n)

    return ask


def rq_process_batch(bid: str) -> str | None:
    """rq entry point: runs in the worker process with its own model registry."""
    ctx = WORKER_CONTEXT
    if not ctx:
        settings = Settings.from_env()
        ctx.update(settings=settings, store=RedisJobStore(settings.redis_url),
                   models=ModelRegistry.from_settings(settings, device="cpu"))
    status = process_batch(ctx["store"], ctx["models"], bid, ctx["settings"], stop=ctx.get("stop"),
                           fan_out=_fan_out(ctx["store"], ctx["settings"], bid))
    log.info("batch %s -> %s", bid, status)
    return status
