"""Dynamic batching: concurrent requests for the same model version, operation and options are merged
into one `ops.run` call over their concatenated sequences (length-sorted, padded size bounded by
`max_batch_tokens`) and the results are split back per request.

One inference thread forms and runs the batches, so the event loop (and /health) stays responsive while a
batch computes. The event loop only queues requests; the thread takes the next batch the moment it is
free (no hand-off through the event loop, which under load is busy with HTTP work) and posts each batch's
results back with one loop callback. A batch is taken when its oldest request has waited
`max_queue_delay`, or earlier when it holds `max_batch_tokens` tokens or no other request is on its way
(see `announce`); while the thread is busy, new requests accumulate and are merged. More than `max_queue`
waiting requests -> QueueFull. The token cap is per model: `max_batch_tokens`, or where that is None or 0
`ops.batch_tokens` of the model's device (16k on CPU, 256k on CUDA, where one batch costs a graph replay whatever
its size)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from latentlm import ops
from latentlm.service.errors import ShuttingDown
from latentlm.service.metrics import Metrics

log = logging.getLogger("latentlm.service")


class QueueFull(Exception):
    """The queue holds `max_queue` requests; answer 429."""


@dataclass
class _Item:
    seqs: list[list[int]]
    future: asyncio.Future
    enqueued: float
    call: Callable[[], Any] | None = None  # unmergeable work (sampling): run as is
    tokens: int = 0


@dataclass
class _Queue:
    model: ops.LoadedModel
    op: str
    opts: dict[str, Any]
    cap: int = 16384  # max_batch_tokens for this model
    items: deque[_Item] = field(default_factory=deque)
    tokens: int = 0


class Batcher:
    """`await submit(model, op, opts, seqs)` -> the per-input result dicts of that request (index from 0)."""

    def __init__(self, metrics: Metrics, *, max_batch_tokens: int | None = None, max_queue_delay_ms: float = 2.0,
                 max_queue: int = 512):
        self.metrics = metrics
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.delay = max_queue_delay_ms / 1000
        self.queues: dict[tuple, _Queue] = {}  # guarded by _cv (event loop puts, inference thread takes)
        self.depth = 0
        self.arriving = 0  # requests announced by the HTTP layer and not yet queued (or given up)
        self._counter = itertools.count()
        self._cv = threading.Condition(threading.Lock())
        self._idle = True  # the inference thread waits for work without a deadline
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wait_children: dict[str, Any] = {}
        self._refusing = False  # after fail_pending: new work raises ShuttingDown
        self._running: list[_Item] = []  # the batch the inference thread computes now (guarded by _cv)
        metrics.queue_depth.set_function(lambda: self.depth)  # read at scrape time, not set per request

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = self._refusing = False
        self._thread = threading.Thread(target=self._worker, name="latentlm-infer", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop taking batches; queued requests fail with ShuttingDown (503; a batch in flight finishes, its
        results are dropped)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self.fail_pending()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 1.0)

    def fail_pending(self) -> int:
        """Event loop: answer every queued request and the batch being computed with ShuttingDown (503); the
        computation itself runs to its end and its results are dropped. Returns how many were answered."""
        with self._cv:
            self._refusing = True
            left = [it for q in self.queues.values() for it in q.items] + self._running
            self.queues.clear()
            self.depth = 0
        n = 0
        for it in left:
            if not it.future.done():
                it.future.set_exception(ShuttingDown())
                n += 1
        return n

    # -- submitting (event loop) ----------------------------------------------------------------------
    def _enqueue(self, key: tuple, make_queue: Callable[[], _Queue], item: _Item) -> None:
        with self._cv:
            if self._refusing:
                raise ShuttingDown()
            if self.depth >= self.max_queue:
                raise QueueFull(f"{self.depth} requests are queued (limit {self.max_queue}); retry later")
            q = self.queues.get(key)
            if q is None:
                q = self.queues[key] = make_queue()
            q.items.append(item)
            q.tokens += item.tokens
            self.depth += 1
            # wake the thread when it sleeps without a deadline, or when waiting for company is over
            if self._idle or q.tokens >= q.cap or self.arriving == 0:
                self._cv.notify()

    async def submit(self, model: ops.LoadedModel, op: str, opts: dict[str, Any], seqs: list[list[int]],
                     ticket: list[bool] | None = None) -> list[dict]:
        """Queue a request (raises QueueFull) and wait for its results."""
        key = (id(model), model.content_hash, op, tuple(sorted(opts.items())))
        fut = asyncio.get_running_loop().create_future()
        self.retract(ticket)
        item = _Item(seqs, fut, time.perf_counter(), tokens=sum(len(s) for s in seqs))
        self._enqueue(key, lambda: _Queue(model, op, dict(opts), self.cap_for(model)), item)
        return await fut

    def cap_for(self, model: ops.LoadedModel) -> int:
        """Padded tokens of one batch for `model`: max_batch_tokens, or (None, 0) by its device."""
        return ops.batch_tokens(getattr(model, "device", "cpu"), self.max_batch_tokens)

    async def call(self, model: ops.LoadedModel, op: str, fn: Callable[[], Any]) -> Any:
        """Run unmergeable work (sampling) on the inference thread, in queue order."""
        key = ("call", next(self._counter))
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(key, lambda: _Queue(model, op, {}), _Item([], fut, time.perf_counter(), call=fn))
        return await fut

    def _company_coming(self) -> bool:
        """Worth waiting for the queue delay: other requests are on their way to the queue. A lone request
        on an idle server is dispatched at once (no added latency); under load the delay applies."""
        return self.arriving > 0

    def announce(self) -> list[bool]:
        """The HTTP layer saw an operation request; pass the ticket to submit(), retract() it when done."""
        self.arriving += 1
        return [True]

    def retract(self, ticket: list[bool] | None) -> None:
        if ticket and ticket[0]:
            ticket[0] = False
            self.arriving -= 1

    # -- the inference thread ---------------------------------------------------------------------------
    def _next(self) -> tuple[_Queue, list[_Item]] | None:
        """Block until a batch is due; pop it (None when stopping). Holds _cv only while not computing."""
        with self._cv:
            self._running = []  # the previous batch is delivered
            while True:
                if self._stopping:
                    return None
                if not self.queues:
                    self._idle = True
                    self._cv.wait()
                    continue
                self._idle = False
                key = min(self.queues, key=lambda k: self.queues[k].items[0].enqueued)
                q = self.queues[key]
                wait = q.items[0].enqueued + self.delay - time.perf_counter()
                if wait > 0 and q.tokens < q.cap and q.items[0].call is None and (
                        self._company_coming()):
                    self._cv.wait(wait)
                    continue
                items = self._take(key)
                if items:
                    self._running = items
                    return q, items

    def _take(self, key: tuple) -> list[_Item]:
        """Pop the oldest requests of one queue up to its token cap (always at least one); holds _cv."""
        q = self.queues[key]
        items: list[_Item] = []
        tokens = 0
        while q.items and (not items or tokens + q.items[0].tokens <= q.cap):
            it = q.items.popleft()
            q.tokens -= it.tokens
            self.depth -= 1
            if it.future.done():  # the client went away
                continue
            items.append(it)
            tokens += it.tokens
        if not q.items:
            del self.queues[key]
        return items

    def _worker(self) -> None:
        assert self._loop is not None
        while (batch := self._next()) is not None:
            q, items = batch
            try:
                start = time.perf_counter()
                wait = self._wait_children.get(q.op)
                if wait is None:
                    wait = self._wait_children[q.op] = self.metrics.queue_wait.labels(q.op)
                for it in items:
                    wait.observe(start - it.enqueued)
                outcomes = self._run(q, items)
                self.metrics.batch_seconds.labels(q.op).observe(time.perf_counter() - start)
            except Exception as e:  # a bug outside the model call: fail this batch, keep serving
                log.exception("batch failed")
                outcomes = [(False, e)] * len(items)
            try:
                self._loop.call_soon_threadsafe(_deliver, items, outcomes)
            except RuntimeError:  # the event loop is closed
                return

    def _run(self, q: _Queue, items: list[_Item]) -> list[tuple[bool, Any]]:
        """One merged call; on a model error, each request alone (errors stay per request)."""
        if items[0].call is not None:
            try:
                return [(True, items[0].call())]
            except Exception as e:
                return [(False, e)]
        m = self.metrics
        seqs = [s for it in items for s in it.seqs]
        ntok = sum(it.tokens for it in items)
        m.batch_requests.labels(q.op).observe(len(items))
        m.batch_sequences.labels(q.op).observe(len(seqs))
        m.batch_tokens.labels(q.op).observe(ntok)
        parts = ops.run_merged(q.model, q.op, [it.seqs for it in items], max_batch_tokens=q.cap, **q.opts)
        m.tokens.labels(q.model.name, q.op).inc(ntok)
        return [(not isinstance(p, Exception), p) for p in parts]


def _deliver(items: list[_Item], outcomes: list[tuple[bool, Any]]) -> None:
    """Event loop: resolve the futures of one batch (a request whose client went away is skipped)."""
    for it, (ok, value) in zip(items, outcomes, strict=True):
        if it.future.done():
            continue
        if ok:
            it.future.set_result(value)
        else:
            it.future.set_exception(value)
