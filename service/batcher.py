"""Dynamic batching: concurrent requests for the same model version, operation and options are merged
into one `ops.run` call over their concatenated sequences (length-sorted, padded size bounded by
`max_batch_tokens`) and the results are split back per request.

One dispatcher task on the event loop forms batches; one inference thread runs them, so the event loop
(and /health) stays responsive while a batch computes. A batch is dispatched when its oldest request has
waited `max_queue_delay`, or earlier when it holds `max_batch_tokens` tokens; while the inference thread
is busy, new requests accumulate and are merged. More than `max_queue` waiting requests -> QueueFull."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from latentlm import ops
from service.metrics import Metrics


class QueueFull(Exception):
    """The queue holds `max_queue` requests; answer 429."""


@dataclass
class _Item:
    seqs: list[list[int]]
    future: asyncio.Future
    enqueued: float
    call: Callable[[], Any] | None = None  # unmergeable work (sampling): run as is

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


@dataclass
class _Queue:
    model: ops.LoadedModel
    op: str
    opts: dict[str, Any]
    items: deque[_Item] = field(default_factory=deque)
    tokens: int = 0


class Batcher:
    """`await submit(model, op, opts, seqs)` -> the per-input result dicts of that request (index from 0)."""

    def __init__(self, metrics: Metrics, *, max_batch_tokens: int = 16384, max_queue_delay_ms: float = 2.0,
                 max_queue: int = 512):
        self.metrics = metrics
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.delay = max_queue_delay_ms / 1000
        self.queues: dict[tuple, _Queue] = {}
        self.depth = 0
        self.arriving = 0  # requests announced by the HTTP layer and not yet queued (or given up)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="latentlm-infer")
        self._counter = itertools.count()
        self._task: asyncio.Task | None = None
        self._has_items: asyncio.Event | None = None
        self._full: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._has_items, self._full = asyncio.Event(), asyncio.Event()
        self._task = asyncio.create_task(self._dispatch_loop(), name="latentlm-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- submitting ---------------------------------------------------------------------------------
    def _enqueue(self, key: tuple, make_queue: Callable[[], _Queue], item: _Item) -> None:
        if self.depth >= self.max_queue:
            raise QueueFull(f"{self.depth} requests are queued (limit {self.max_queue}); retry later")
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = make_queue()
        q.items.append(item)
        q.tokens += item.tokens
        self.depth += 1
        self.metrics.queue_depth.set(self.depth)
        assert self._has_items is not None and self._full is not None
        self._has_items.set()
        if q.tokens >= self.max_batch_tokens:
            self._full.set()

    async def submit(self, model: ops.LoadedModel, op: str, opts: dict[str, Any], seqs: list[list[int]],
                     ticket: list[bool] | None = None) -> list[dict]:
        """Queue a request (raises QueueFull) and wait for its results."""
        key = (id(model), model.content_hash, op, tuple(sorted(opts.items())))
        fut = asyncio.get_running_loop().create_future()
        self.retract(ticket)
        self._enqueue(key, lambda: _Queue(model, op, dict(opts)), _Item(seqs, fut, time.perf_counter()))
        return await fut

    async def call(self, model: ops.LoadedModel, op: str, fn: Callable[[], Any]) -> Any:
        """Run unmergeable work (sampling) on the inference thread, in queue order."""
        key = ("call", next(self._counter))
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(key, lambda: _Queue(model, op, {}), _Item([], fut, time.perf_counter(), call=fn))
        return await fut

    # -- dispatching --------------------------------------------------------------------------------
    def _take(self, key: tuple) -> list[_Item]:
        """Pop the oldest requests of one queue up to max_batch_tokens (always at least one)."""
        q = self.queues[key]
        items: list[_Item] = []
        tokens = 0
        while q.items and (not items or tokens + q.items[0].tokens <= self.max_batch_tokens):
            it = q.items.popleft()
            q.tokens -= it.tokens
            self.depth -= 1
            if it.future.done():  # the client went away
                continue
            items.append(it)
            tokens += it.tokens
        if not q.items:
            del self.queues[key]
        self.metrics.queue_depth.set(self.depth)
        return items

    async def _dispatch_loop(self) -> None:
        assert self._has_items is not None and self._full is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.queues:
                self._has_items.clear()
                await self._has_items.wait()
                continue
            key = min(self.queues, key=lambda k: self.queues[k].items[0].enqueued)
            q = self.queues[key]
            wait = q.items[0].enqueued + self.delay - time.perf_counter()
            if wait > 0 and q.tokens < self.max_batch_tokens and q.items[0].call is None and self._company_coming():
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), wait)
                continue
            self._full.clear()
            items = self._take(key)
            if not items:
                continue
            start = time.perf_counter()
            for it in items:
                self.metrics.queue_wait.labels(q.op).observe(start - it.enqueued)
            try:
                outcomes = await loop.run_in_executor(self.executor, self._run, q, items)
            except BaseException as e:  # cancelled or executor shut down
                for it in items:
                    if not it.future.done():
                        it.future.set_exception(e if isinstance(e, Exception) else RuntimeError("stopped"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            self.metrics.batch_seconds.labels(q.op).observe(time.perf_counter() - start)
            for it, (ok, value) in zip(items, outcomes, strict=True):
                if it.future.done():
                    continue
                if ok:
                    it.future.set_result(value)
                else:
                    it.future.set_exception(value)

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

    def _run(self, q: _Queue, items: list[_Item]) -> list[tuple[bool, Any]]:
        """Inference thread: one merged call; on a model error, each request alone (errors stay per request)."""
        if items[0].call is not None:
            try:
                return [(True, items[0].call())]
            except Exception as e:
                return [(False, e)]
        m = self.metrics
        seqs = [s for it in items for s in it.seqs]
        ntok = sum(len(s) for s in seqs)
        m.batch_requests.labels(q.op).observe(len(items))
        m.batch_sequences.labels(q.op).observe(len(seqs))
        m.batch_tokens.labels(q.op).observe(ntok)
        try:
            results = ops.run(q.model, q.op, seqs, max_batch_tokens=self.max_batch_tokens, **q.opts)
        except Exception as e:  # one bad request must not fail its neighbours: run each alone
            if len(items) == 1:
                return [(False, e)]
            return [self._run(q, [it])[0] for it in items]
        m.tokens.labels(q.model.name, q.op).inc(ntok)
        out, pos = [], 0
        for it in items:
            part = results[pos : pos + len(it.seqs)]
            pos += len(it.seqs)
            out.append((True, [{**r, "index": j} for j, r in enumerate(part)]))
        return out
