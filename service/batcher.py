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
its size).

Two lanes, each with its own thread, so a heavy request never delays a light one by more than the light batch
being computed: requests whose estimated cost (`ops.operation_cost`) is above the service's `heavy_request_cost`
go to the heavy lane. The heavy lane does not merge; it cuts each request into slices of at most `slice_cost`
(whole sequences; one sequence is never cut) and runs the slices of the requests it holds in turn (round robin),
so a long request does not hold back a shorter heavy one either. Cancelled work (the client disconnected: the
request's future is cancelled) is dropped from either queue, and a heavy request stops at its next slice
boundary. Streamed requests (`stream`) run in the heavy lane and hand each slice's output to the event loop as it
is produced, at most `STREAM_AHEAD` payloads ahead of the client.

Its length (over 600 lines) keeps both lanes, their threads and their hand-offs to the event loop in one module:
their invariants (who may touch a queue, when a future is settled) are read together."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

from latentlm import ops
from latentlm.ops import format
from latentlm.ops.batching import slices
from latentlm.ops.spec import Call, Operation, run_merged
from latentlm.service.errors import ShuttingDown
from latentlm.service.metrics import Metrics

log = logging.getLogger("latentlm.service")


LIGHT, HEAVY = "light", "heavy"
STREAM_PAYLOAD_BYTES = 1 << 20  # a streamed operation hands the event loop about this much per payload
STREAM_AHEAD = 2  # payloads a stream may have computed and not yet sent before its slices wait
DEFAULT_SLICE_COST = 1_000_000_000  # heavy-lane slice when the caller names none (~0.05-0.15 s on one CPU core)
DEFAULT_MAX_HEAVY = 16  # heavy requests queued or running at once before 429 (each waits its turn, round robin)
HEAVY_NICE = 10  # the heavy lane's thread (and the torch threads it starts) runs this much nicer (Linux)


class QueueFull(Exception):
    """The queue holds `max_queue` requests; answer 429."""


class Cancelled(BaseException):
    """Raised inside the heavy lane's thread (asynchronously, `interrupt`) when the request whose slice it runs is
    cancelled: a slice that is one long Python-level loop (a 100,000-step sample, the chart of a long sentence)
    stops within one step instead of running to its end. A BaseException, so no `except Exception` in model code
    swallows it."""


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread at its next bytecode boundary (None: clear a pending one). CPython only."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class CancelScope:
    """What one HTTP request waits on: `cancel()` (the client disconnected) cancels its futures, so queued work
    is dropped and running heavy work stops at its next slice boundary; callbacks (stream sinks) run too."""

    __slots__ = ("futures", "callbacks", "cancelled")

    def __init__(self) -> None:
        self.futures: list[asyncio.Future] = []
        self.callbacks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        for f in self.futures:
            f.cancel()
        for cb in self.callbacks:
            cb()


@dataclass(eq=False)
class _Item:
    seqs: list[list[int]]
    future: asyncio.Future
    enqueued: float
    call: Callable[[], Any] | None = None  # unmergeable work (sampling): run as is
    tokens: int = 0
    job: Callable[[], Generator[Any, None, Any]] | None = None  # heavy lane: yields after each slice
    gen: Generator[Any, None, Any] | None = None
    sink: Callable[[Any], None] | None = None  # stream: event-loop callback taking each yielded payload
    ahead: int = 0  # stream payloads posted and not yet taken by the client (backpressure)
    cancelled: bool = False  # set on the event loop when the future is cancelled; read by the lane threads
    op: str = ""  # heavy lane: the operation (metrics labels)


@dataclass
class _Queue:
    model: ops.LoadedModel
    op: str
    opts: dict[str, Any]
    cap: int = 16384  # max_batch_tokens for this model
    items: deque[_Item] = field(default_factory=deque)
    tokens: int = 0
    lane: str = LIGHT
    operation: Operation | None = None  # what a merged batch runs (`Operation.run` over the merged inputs)


def pieces_job(call: Call, slice_cost: int, positions: int) -> Generator[bytes, None, None]:
    """A streamed operation's work for the heavy lane: `op.pieces` of the call's sequences, slice by slice (slices of
    at most `slice_cost`), written as NDJSON `<op>.chunk` lines (`format.chunk`) and handed over in payloads of about
    STREAM_PAYLOAD_BYTES."""
    model, op, seqs = call.model, call.op, call.seqs
    assert op.pieces is not None
    costs = [ops.operation_cost(model, op.name, [q], top_k=call.opts.get("top_k")) for q in seqs]
    for lo, hi in slices(costs, slice_cost):
        part = Call(model, op, call.opts, seqs[lo:hi], call.request)
        lines: list[bytes] = []
        size = 0
        for piece in op.pieces(part, positions, offset=lo):
            line = ops.dumps(format.chunk(call, piece)) + b"\n"
            lines.append(line)
            size += len(line)
            if size >= STREAM_PAYLOAD_BYTES:
                yield b"".join(lines)
                lines, size = [], 0
        if lines:
            yield b"".join(lines)


def sliced_run(call: Call, cap: int, slice_cost: int) -> Generator[None, None, list[dict]]:
    """`call.op.run` over `call.seqs` in slices of at most `slice_cost` (yielding after each): the same results, in
    input order, with a preemption point between slices."""
    model, op, opts, seqs = call.model, call.op, call.opts, call.seqs
    costs = [ops.operation_cost(model, op.name, [s], method=opts.get("method"), top_k=opts.get("top_k"))
             for s in seqs]
    results: list[dict] = []
    for lo, hi in slices(costs, slice_cost):
        part = op.run(Call(model, op, opts, seqs[lo:hi], call.request), cap)
        for r in part:
            r["index"] += lo
        results.extend(part)
        yield None
    return results


class Lanes(Protocol):
    """Where the routes send prepared calls: this process's `Batcher`, or `engine.EngineClient` (the same calls run
    by the engine process)."""

    ready: bool
    arriving: int

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def submit(self, call: Call, ticket: list[bool] | None = None, *, heavy: bool = False,
                     slice_cost: int | None = None, scope: CancelScope | None = None, job: Any = None) -> Any: ...
    async def stream(self, call: Call, *, slice_cost: int, positions: int, scope: CancelScope | None = None
                     ) -> Payloads: ...
    async def models_changed(self) -> None: ...
    def announce(self) -> list[bool]: ...
    def retract(self, ticket: list[bool] | None) -> None: ...
    def fail_pending(self) -> int: ...


class Arrivals:
    """Requests the HTTP layer has seen and not yet submitted: `announce()` when one arrives, `retract(ticket)` when
    it is submitted or given up. A batch waits for them (`max_queue_delay`)."""

    arriving = 0

    def announce(self) -> list[bool]:
        """The HTTP layer saw an operation request; pass the ticket to submit(), retract() it when done."""
        self.arriving += 1
        return [True]

    def retract(self, ticket: list[bool] | None) -> None:
        if ticket and ticket[0]:
            ticket[0] = False
            self.arriving -= 1
            if self.arriving == 0:
                self._none_arriving()

    def _none_arriving(self) -> None:
        """The last announced request was submitted or given up."""


class Batcher(Arrivals):
    """`await submit(call)` -> the per-input result dicts of that request (index from 0)."""

    def __init__(self, metrics: Metrics, *, max_batch_tokens: int | None = None, max_queue_delay_ms: float = 2.0,
                 max_queue: int = 512, max_heavy: int = DEFAULT_MAX_HEAVY):
        self.metrics = metrics
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.delay = max_queue_delay_ms / 1000
        self.queues: dict[tuple, _Queue] = {}  # guarded by _cv (event loop puts, inference thread takes)
        self.depth = 0
        self.arriving = 0  # requests announced by the HTTP layer and not yet queued (or given up)
        self._counter = itertools.count()
        self._lock = threading.Lock()  # a C-level lock: `with self._lock` is safe where `Cancelled` may fire
        self._cv = threading.Condition(self._lock)
        self._idle = True  # the inference thread waits for work without a deadline
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wait_children: dict[str, Any] = {}
        self._refusing = False  # after fail_pending: new work raises ShuttingDown
        self._running: list[_Item] = []  # the batch the inference thread computes now (guarded by _cv)
        self._heavy_cv = threading.Condition(self._lock)
        self._heavy_idle = True
        self._active: deque[_Item] = deque()  # heavy requests started and not finished (guarded by the lock)
        self._heavy_running: _Item | None = None
        self._heavy_count = 0  # heavy requests queued or started and not finished (guarded by the lock)
        self._interruptible: _Item | None = None  # the item whose slice runs now (guarded by the lock)
        self.max_heavy = max_heavy  # more heavy requests than this at once -> QueueFull (429); set at start-up
        self._heavy_thread: threading.Thread | None = None
        metrics.queue_depth.set_function(lambda: self.depth)  # read at scrape time, not set per request
        r = metrics.registry
        self.cancelled = Counter("latentlm_cancelled_requests", "requests whose work was dropped or stopped "
                                 "because the client went away", ["lane", "where"], registry=r)
        self.heavy_active = Gauge("latentlm_heavy_lane_requests", "requests in the heavy lane (queued or "
                                  "running)", registry=r)
        self.heavy_active.set_function(lambda: self._heavy_count)
        self.heavy_slices = Counter("latentlm_heavy_slices", "slices run by the heavy lane", ["operation"],
                                    registry=r)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = self._refusing = False
        self._thread = threading.Thread(target=self._worker, name="latentlm-infer", daemon=True)
        self._thread.start()
        self._heavy_thread = threading.Thread(target=self._heavy_worker, name="latentlm-heavy", daemon=True)
        self._heavy_thread.start()

    async def stop(self) -> None:
        """Stop taking batches; queued requests fail with ShuttingDown (503; a batch in flight finishes, its
        results are dropped)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            self._heavy_cv.notify()
        self.fail_pending()
        loop = asyncio.get_running_loop()
        for t in (self._thread, self._heavy_thread):
            if t is not None:
                await loop.run_in_executor(None, t.join, 1.0)

    def fail_pending(self) -> int:
        """Event loop: answer every queued request and the batch being computed with ShuttingDown (503); a light
        batch runs to its end and its results are dropped, a heavy slice is interrupted. Returns how many were
        answered."""
        with self._cv:
            self._refusing = True
            left = [it for q in self.queues.values() for it in q.items] + self._running + list(self._active)
            if self._heavy_running is not None:
                left.append(self._heavy_running)
            t = self._heavy_thread
            if self._interruptible is not None and t is not None and t.ident is not None:
                _async_raise(t.ident, Cancelled)  # the heavy slice running now stops: its answer would be dropped
            self.queues.clear()
            self._active.clear()
            self.depth = self._heavy_count = 0
        n = 0
        for it in left:
            if it.sink is not None and not it.cancelled:
                it.sink(ShuttingDown())
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
                q = make_queue()
                if q.lane == HEAVY:
                    if self._heavy_count >= self.max_heavy:
                        raise QueueFull(f"{self._heavy_count} heavy requests are running or queued (limit "
                                        f"{self.max_heavy}, max_heavy_requests); retry later")
                    self._heavy_count += 1
                self.queues[key] = q
            q.items.append(item)
            q.tokens += item.tokens
            self.depth += 1
            if q.lane == HEAVY:
                self._heavy_cv.notify()
            # wake the thread when it sleeps without a deadline, or when waiting for company is over
            elif self._idle or q.tokens >= q.cap or self.arriving == 0:
                self._cv.notify()

    def _future(self, scope: CancelScope | None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if scope is not None:
            if scope.cancelled:
                fut.cancel()
            scope.futures.append(fut)
        return fut

    def _watch(self, item: _Item) -> None:
        """Mark the item cancelled when its future is (the lane threads read the flag); a slice of it that is
        running is interrupted."""
        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                item.cancelled = True
                self.interrupt(item)
        item.future.add_done_callback(done)

    def interrupt(self, item: _Item) -> None:
        """Stop the slice of `item` the heavy lane runs now, if it does (`Cancelled` raised in its thread)."""
        with self._lock:
            t = self._heavy_thread
            if self._interruptible is item and t is not None and t.ident is not None:
                _async_raise(t.ident, Cancelled)

    async def submit(self, call: Call, ticket: list[bool] | None = None, *, heavy: bool = False,
                     slice_cost: int | None = None, scope: CancelScope | None = None,
                     job: Callable[[], Generator[Any, None, Any]] | None = None) -> Any:
        """The one way work reaches the lanes: a prepared `call` (`ops.spec.prepare`). Raises QueueFull.

        - `job` given (a stream): the heavy lane runs `job`, a generator yielding payloads, and each payload is
          handed to the returned `StreamReader` as it comes, at most STREAM_AHEAD ahead of the reader;
        - an operation that merges (`Operation.merge`): in the light lane merged with requests of equal model
          version and options into one batched run; `heavy`: alone in the heavy lane, in slices of at most
          `slice_cost` (round robin with the other heavy requests);
        - any other operation (sampling): `Operation.run` on a lane's thread, in queue order (one slice in the
          heavy lane).
        Returns the per-input result dicts (index from 0), or the reader of a stream. `scope`: cancelling it drops
        the work (the await raises CancelledError)."""
        model, op = call.model, call.op.name
        fut = self._future(scope)
        self.retract(ticket)
        if job is not None:
            reader = StreamReader(self, fut)
            item = _Item([], fut, time.perf_counter(), job=job, sink=reader.put)
            reader.item = item
            self._watch(item)
            if scope is not None:
                scope.callbacks.append(reader.close)
            self._enqueue(("heavy", next(self._counter)), lambda: _Queue(model, op, {}, lane=HEAVY), item)
            return reader
        if not call.op.merge:
            cap = self.cap_for(model)
            run = call.op.run
            item = _Item([], fut, time.perf_counter(), call=lambda: run(call, cap))
            if heavy:
                def single() -> Generator[None, None, Any]:
                    return run(call, cap)
                    yield  # a generator of one slice
                item.job = single
                self._watch(item)
            key = ("heavy" if heavy else "call", next(self._counter))
            self._enqueue(key, lambda: _Queue(model, op, {}, lane=HEAVY if heavy else LIGHT), item)
            return await fut
        seqs, opts = call.seqs, call.opts
        item = _Item(seqs, fut, time.perf_counter(), tokens=sum(len(s) for s in seqs))
        if heavy:
            cap, sc = self.cap_for(model), slice_cost or DEFAULT_SLICE_COST
            item.job = lambda: sliced_run(call, cap, sc)
            self._watch(item)
            self._enqueue(("heavy", next(self._counter)), lambda: _Queue(model, op, {}, lane=HEAVY), item)
        else:
            key = (id(model), model.content_hash, op, tuple(sorted(opts.items())))
            self._enqueue(key, lambda: _Queue(model, op, dict(opts), self.cap_for(model), operation=call.op), item)
        return await fut

    async def stream(self, call: Call, *, slice_cost: int, positions: int, scope: CancelScope | None = None
                     ) -> StreamReader:
        """A streamed operation (`Operation.pieces`, e.g. a posterior as NDJSON) in the heavy lane: the reader of its
        payloads (`pieces_job`: lines of at most `positions` tokens, computed in slices of at most `slice_cost`)."""
        return await self.submit(call, job=lambda: pieces_job(call, slice_cost, positions), scope=scope)

    @property
    def ready(self) -> bool:
        """Whether requests can be run (this process runs them itself: always)."""
        return True

    async def models_changed(self) -> None:
        """After this process reloaded the store: nothing to tell (its lanes run its own registry's models)."""

    def _taken(self, item: _Item) -> None:
        """Event loop: the reader took a payload; a stream waiting on its client may go on."""
        with self._cv:
            item.ahead -= 1
            self._heavy_cv.notify()

    def cap_for(self, model: ops.LoadedModel) -> int:
        """Padded tokens of one batch for `model`: max_batch_tokens, or (None, 0) by its device."""
        return ops.batch_tokens(getattr(model, "device", "cpu"), self.max_batch_tokens)

    def _company_coming(self) -> bool:
        """Worth waiting for the queue delay: other requests are on their way to the queue. A lone request
        on an idle server is dispatched at once (no added latency); under load the delay applies."""
        return self.arriving > 0

    def set_arriving(self, n: int) -> None:
        """Requests on their way from elsewhere (an engine's API workers report theirs): a batch waiting for company
        is taken at once when none is coming any more."""
        with self._cv:
            self.arriving = n
            if n == 0:
                self._cv.notify()

    # -- the inference thread ---------------------------------------------------------------------------
    def _next(self) -> tuple[_Queue, list[_Item]] | None:
        """Block until a batch is due; pop it (None when stopping). Holds _cv only while not computing."""
        with self._cv:
            self._running = []  # the previous batch is delivered
            while True:
                if self._stopping:
                    return None
                light = [k for k, q in self.queues.items() if q.lane == LIGHT]
                if not light:
                    self._idle = True
                    self._cv.wait()
                    continue
                self._idle = False
                key = min(light, key=lambda k: self.queues[k].items[0].enqueued)
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
                if it.future.cancelled():
                    self.cancelled.labels(LIGHT, "queued").inc()
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

    # -- the heavy lane's thread ------------------------------------------------------------------------
    def _next_heavy(self) -> _Item | None:
        """Block until a heavy request can run a slice: queued ones join the round robin (`_active`) in arrival
        order; a stream whose client is STREAM_AHEAD payloads behind waits. None when stopping."""
        with self._cv:
            self._heavy_running = None
            while True:
                if self._stopping:
                    return None
                for key in [k for k, q in self.queues.items() if q.lane == HEAVY]:
                    q = self.queues.pop(key)
                    for it in q.items:
                        self.depth -= 1
                        if it.future.done() and it.sink is None:
                            self._heavy_count = max(0, self._heavy_count - 1)
                            if it.future.cancelled():
                                self.cancelled.labels(HEAVY, "queued").inc()
                            continue
                        it.op = q.op
                        self._active.append(it)
                for _ in range(len(self._active)):
                    it = self._active.popleft()
                    if it.cancelled or it.future.done() and it.sink is None:
                        self._drop(it)
                        continue
                    if it.sink is not None and it.ahead >= STREAM_AHEAD:
                        self._active.append(it)  # its client is behind: the next one
                        continue
                    self._heavy_running = it
                    return it
                self._heavy_idle = not self._active
                self._heavy_cv.wait(None if self._heavy_idle else 0.5)

    def _drop(self, it: _Item) -> None:
        """A cancelled heavy request: close its generator (holds the lock; no model work runs here)."""
        self._heavy_count = max(0, self._heavy_count - 1)
        self.cancelled.labels(HEAVY, "running" if it.gen is not None else "queued").inc()
        if it.gen is not None:
            it.gen.close()
            it.gen = None

    def _heavy_worker(self) -> None:
        assert self._loop is not None
        if HEAVY_NICE:  # the kernel favours the light lane and the event loop when the CPUs are contended
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HEAVY_NICE))
            except (OSError, AttributeError):
                pass
        while (it := self._next_heavy()) is not None:
            op = it.op
            outcome: tuple[bool, Any] | None = None
            try:
                if it.gen is None:
                    wait = time.perf_counter() - it.enqueued
                    self.metrics.queue_wait.labels(op).observe(wait)
                    it.gen = it.job()  # type: ignore[misc]
                start = time.perf_counter()
                with self._lock:
                    self._interruptible = it
                try:
                    payload = next(it.gen)
                finally:
                    with self._lock:
                        self._interruptible = None
                    _async_raise(threading.get_ident(), None)  # one set too late is dropped here
                self.heavy_slices.labels(op).inc()
                self.metrics.batch_seconds.labels(op).observe(time.perf_counter() - start)
            except StopIteration as stop:
                outcome = (True, stop.value)
            except Cancelled:  # interrupted mid-slice: its client went away
                with self._cv:
                    self._heavy_count = max(0, self._heavy_count - 1)
                self.cancelled.labels(HEAVY, "interrupted").inc()
                it.gen = None
                continue
            except Exception as e:  # a model or input error: this request fails, the lane goes on
                if not isinstance(e, ops.LimitExceeded | ops.InputError):
                    log.info("heavy %s request failed: %s: %s", op, type(e).__name__, e)
                outcome = (False, e)
            try:
                if outcome is None:
                    with self._cv:
                        if it.sink is not None and payload is not None:
                            it.ahead += 1
                        self._active.append(it)  # round robin: to the back
                    if it.sink is not None and payload is not None:
                        self._loop.call_soon_threadsafe(it.sink, payload)
                    continue
                it.gen = None
                with self._cv:
                    self._heavy_count = max(0, self._heavy_count - 1)
                if it.sink is not None:
                    self._loop.call_soon_threadsafe(it.sink, outcome[1] if not outcome[0] else StreamReader.END)
                    self._loop.call_soon_threadsafe(_deliver, [it], [(True, None)])
                else:
                    self._loop.call_soon_threadsafe(_deliver, [it], [outcome])
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
        assert q.operation is not None
        parts = run_merged(q.operation, q.model, q.opts, [it.seqs for it in items], q.cap)
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


class Payloads:
    """What a stream's reader holds: `async for payload in reader` (an exception put there is raised; END ends it).
    `put` is called on the event loop; `_took` after each payload taken; `close()` stops the work."""

    END = object()

    def __init__(self) -> None:
        self._q: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, payload: Any) -> None:
        if not self.closed:
            self._q.put_nowait(payload)

    def _took(self) -> None:
        """A payload was taken (backpressure: the work may go on)."""

    def close(self) -> None:
        raise NotImplementedError

    def __aiter__(self) -> Payloads:
        return self

    async def __anext__(self) -> Any:
        payload = await self._q.get()
        if payload is self.END:
            self.closed = True
            raise StopAsyncIteration
        if isinstance(payload, BaseException):
            self.closed = True
            raise payload
        self._took()
        return payload


class StreamReader(Payloads):
    """The event-loop side of `Batcher.stream`: `async for payload in reader` (an exception the job raised is
    raised here; `ShuttingDown` when the service stops). `close()` cancels the job (it stops at its next slice)."""

    def __init__(self, batcher: Batcher, future: asyncio.Future) -> None:
        super().__init__()
        self.batcher, self.future = batcher, future
        self.item: _Item | None = None

    def close(self) -> None:
        """Stop: the job is dropped at its next slice boundary; a pending read ends."""
        if not self.closed:
            self.closed = True
            if not self.future.done():
                self.future.cancel()
            self._q.put_nowait(self.END)

    def _took(self) -> None:
        if self.item is not None:
            self.batcher._taken(self.item)
