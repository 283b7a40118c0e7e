"""One engine process that owns the device, the models and the batcher; the API workers hand it their requests.

With `LATENTLM_ENGINE=process` (the default on CUDA with several API workers), `serve` starts one engine process
(`latentlm engine`) beside its API workers, as vLLM separates its API server from its engine. The engine loads every
model onto the device and runs the one `Batcher`, so single-sentence requests from all the workers are merged into
the same batches on the device, and the device holds each model once. Each API worker parses, validates, prepares
(inputs encoded, a constraint compiled, limits, cost), caches and answers; instead of its own batcher it holds an
`EngineClient` with the batcher's interface (`submit`, `stream`, `announce`/`retract`, `fail_pending`), which sends
the prepared call over a Unix socket and gets its results back.

The wire: msgpack maps (`ops.wire.pack`), back to back on one connection per worker (msgpack frames itself).
- worker -> engine: `{"t": "call", "id", "arriving" (requests the worker has announced and not yet sent: the batcher
  waits for them, `Batcher.announce`), "heavy", "slice"}` plus the prepared call in the one form of every operation
  (`ops.wire.to_wire`: "op", "model", "hash" (the model version the worker prepared on), "opts", "seqs", "cost",
  "tokens", "prepared" (a constraint's automaton, a completion's prompts), "limits"): the engine runs it as it is
  (`ops.wire.from_wire`), validating, encoding and compiling nothing again; `"stream": {"positions", "slice"}` for a
  streamed operation. `{"t": "cancel", "id"}` when the client went away (queued work is dropped, heavy work stops at
  its next slice); `{"t": "ack", "id"}` when the client took a streamed payload (at most STREAM_AHEAD are in flight
  per stream); `{"t": "arriving", "arriving": 0}` when the requests it announced are all sent or given up;
  `{"t": "reload", "id"}` after the worker reloaded the store.
- engine -> worker: `{"id", "ok": results}` (typed results cross as themselves), `{"id", "err": {...}}` (the same
  error the worker would have raised: `encode_error`), `{"id", "chunk": bytes}` then `{"id", "end": true}` for a
  stream.

Model versions: the engine runs a request on the version the worker prepared it on. When it holds another one it
syncs with the store first (the worker may have reloaded), and keeps the version a reload replaced for
`RETIRED_S`, so requests prepared before a reload finish on it while the other workers catch up.
A worker whose engine connection is down answers 503 `engine_unavailable` and reconnects in the background
(its /ready says so); `serve`'s supervisor starts a dead engine again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from latentlm import ops
from latentlm.models import errors as model_errors
from latentlm.models.errors import LatentLMError
from latentlm.ops import spec, wire
from latentlm.ops.spec import Call
from latentlm.service.batcher import STREAM_AHEAD, Arrivals, Batcher, CancelScope, Payloads, QueueFull
from latentlm.service.errors import APIError, ShuttingDown
from latentlm.service.metrics import Metrics, multiprocess_dir, publish_live_metrics
from latentlm.service.registry import ModelRegistry
from latentlm.service.settings import Settings

log = logging.getLogger("latentlm.engine")

READ_BYTES = 1 << 16
RETIRED_S = 30.0  # a version a reload replaced keeps answering requests prepared on it this long
SYNC_EVERY_S = 1.0  # a request for a version the engine lacks syncs with the store at most this often
RECONNECT_S = 0.1  # a worker tries its engine again this often while it is down
JOB_ENGINE_WAIT_S = 120.0  # a batch job's line waits this long for an engine that is down, before each of
JOB_RETRIES = 3  # its tries (then the line's error is 503 engine_unavailable)


# -- the wire ----------------------------------------------------------------------------------------------------
pack, unpacker = wire.pack, wire.unpacker


ERROR_CLASSES = {c.__name__: c for c in (model_errors.ArtifactError, model_errors.ModelNotFound,
                                         model_errors.InputError, model_errors.UnsupportedOperation,
                                         model_errors.LimitExceeded, LatentLMError)}


def encode_error(e: BaseException) -> dict[str, Any]:
    """An exception raised in the engine as data the worker turns back into the same exception (`decode_error`):
    the worker's handlers then answer exactly as without an engine."""
    if isinstance(e, APIError):
        return {"kind": "api", "status": e.status, "message": e.message, "param": e.param, "code": e.code,
                "type": e.type, "headers": e.headers}
    if isinstance(e, LatentLMError):
        cls = type(e).__name__ if type(e).__name__ in ERROR_CLASSES else "LatentLMError"
        return {"kind": "model", "class": cls, "message": e.message, "param": e.param, "code": e.code}
    if isinstance(e, QueueFull):
        return {"kind": "queue_full", "message": str(e)}
    if isinstance(e, ShuttingDown):
        return {"kind": "shutting_down"}
    return {"kind": "internal", "message": f"{type(e).__name__}"}


def decode_error(err: dict[str, Any]) -> BaseException:
    kind = err.get("kind")
    if kind == "api":
        return APIError(err["status"], err["message"], param=err.get("param"), code=err.get("code"),
                        type=err.get("type"), headers=err.get("headers") or {})
    if kind == "model":
        return ERROR_CLASSES.get(err.get("class", ""), LatentLMError)(err["message"], param=err.get("param"),
                                                                      code=err.get("code"))
    if kind == "queue_full":
        return QueueFull(err["message"])
    if kind == "shutting_down":
        return ShuttingDown()
    return APIError(500, f"internal error in the engine: {err.get('message', '')}", code="internal_error")


def engine_unavailable(retry_after_s: int) -> APIError:
    return APIError(503, "the inference engine is not reachable (starting or restarting); retry shortly",
                    code="engine_unavailable", headers={"Retry-After": str(retry_after_s)})


# -- the engine process ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Connection:
    """One API worker's connection: its requests' cancel scopes and stream credits, and how many it announced."""

    writer: asyncio.StreamWriter
    scopes: dict[int, CancelScope] = field(default_factory=dict)
    credits: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    arriving: int = 0

    def send(self, msg: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(pack(msg))


class EngineServer:
    """The engine process: the registry on the device, one batcher, a Unix socket the API workers connect to."""

    def __init__(self, settings: Settings, path: Path):
        self.settings, self.path = settings, Path(path)
        self.metrics = Metrics()
        snapshots = settings.snapshot_dir if not settings.on_cuda else None  # on a GPU the device holds them
        self.registry = ModelRegistry.from_settings(settings)
        self.registry.snapshots = snapshots
        self.batcher = Batcher(self.metrics, max_batch_tokens=settings.max_batch_tokens,
                               max_queue_delay_ms=settings.max_queue_delay_ms, max_queue=settings.max_queue,
                               max_heavy=settings.max_heavy_requests)
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="engine-load")
        self.connections: set[_Connection] = set()
        self.retired: dict[tuple[str, str], tuple[float, ops.LoadedModel]] = {}  # (name, hash) -> (until, model)
        self._sync: asyncio.Future | None = None
        self._synced = -math.inf  # when the last sync ended
        self.receiving = 0  # call messages read and not yet queued in the batcher

    # -- models
    def reload(self, rehash: bool = True) -> dict:
        """Blocking: sync the registry with the store; the versions it replaced stay for RETIRED_S."""
        before = dict(self.registry.models)
        out = self.registry.reload(rehash=rehash)
        now = time.monotonic()
        self.retired = {k: v for k, v in self.retired.items() if v[0] > now}
        for name, old in before.items():
            if self.registry.models.get(name) is not old:
                self.retired[(name, old.content_hash)] = (now + RETIRED_S, old)
        self.metrics.models_loaded.set(len(self.registry.models))
        return out

    async def sync(self, rehash: bool = False, *, at_most_every_s: float = 0.0) -> None:
        """Reload once for every request waiting on it; none when the last one ended under `at_most_every_s` ago."""
        if self._sync is None or self._sync.done():
            if time.monotonic() - self._synced < at_most_every_s:
                return
            self._sync = asyncio.get_running_loop().run_in_executor(self.loader, self.reload, rehash)
        try:
            await asyncio.shield(self._sync)
        finally:
            self._synced = time.monotonic()

    def _version(self, name: str, digest: str) -> ops.LoadedModel | None:
        m = self.registry.models.get(name)
        if m is not None and m.content_hash == digest:
            return m
        kept = self.retired.get((name, digest))
        return kept[1] if kept is not None and kept[0] > time.monotonic() else None

    async def model(self, name: str, digest: str) -> ops.LoadedModel:
        """The version of `name` the worker prepared on: the one loaded, one a reload replaced moments ago, or after
        syncing with the store; else 503 (the worker itself is about to reload)."""
        m = self._version(name, digest)
        if m is None:  # a model that fails to load here is not tried again for every request
            await self.sync(at_most_every_s=SYNC_EVERY_S)
            m = self._version(name, digest)
        if m is None and name in self.registry.failed and name not in self.registry.models:
            raise APIError(503, f"model {name!r} is not loaded by the engine process: {self.registry.failed[name]}",
                           param="model", code="model_unavailable",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if m is None:
            raise APIError(503, f"model {name!r}: this API worker and the engine hold different versions while a "
                                "reload goes on; retry shortly", param="model", code="model_reloading",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return m

    # -- requests
    def _company(self) -> None:
        """The batcher's requests on their way: those the workers announced and have not sent, and those received
        here and not yet queued (read together, they are batched together)."""
        self.batcher.set_arriving(sum(c.arriving for c in self.connections) + self.receiving)

    async def run_call(self, conn: _Connection, msg: dict[str, Any], scope: CancelScope) -> None:
        rid = msg["id"]
        received = True
        try:
            call = wire.from_wire(msg, await self.model(msg["model"], msg["hash"]))  # as prepared: run as it is
            self.receiving -= 1
            received = False
            self._company()
            if scope.cancelled:  # the client went away meanwhile
                return
            stream = msg.get("stream")
            if stream is not None:
                await self._run_stream(conn, rid, call, stream, scope)
                return
            results = await self.batcher.submit(call, heavy=bool(msg.get("heavy")), slice_cost=msg.get("slice") or None,
                                                scope=scope)
            conn.send({"id": rid, "ok": results})
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the engine stops
        except BaseException as e:  # every error goes back to the worker, which answers it as its own
            if not isinstance(e, LatentLMError | APIError | QueueFull | ShuttingDown):
                log.exception("engine: %s request failed", msg.get("op"))
            conn.send({"id": rid, "err": encode_error(e)})
        finally:
            if received:
                self.receiving -= 1
                self._company()
            conn.scopes.pop(rid, None)
            conn.credits.pop(rid, None)
        try:
            await conn.writer.drain()
        except ConnectionError:
            pass

    async def _run_stream(self, conn: _Connection, rid: int, call: Call, stream: dict[str, int],
                          scope: CancelScope) -> None:
        credit = conn.credits[rid] = asyncio.Semaphore(STREAM_AHEAD)
        reader = await self.batcher.stream(call, slice_cost=stream["slice"], positions=stream["positions"],
                                           scope=scope)
        try:
            while True:
                await credit.acquire()  # the worker's client took all but STREAM_AHEAD - 1 payloads
                try:
                    payload = await reader.__anext__()
                except StopAsyncIteration:
                    break
                conn.send({"id": rid, "chunk": payload})
                await conn.writer.drain()
            conn.send({"id": rid, "end": True})
        finally:
            reader.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One API worker's connection: its messages until it closes (its requests then cancelled)."""
        conn = _Connection(writer)
        self.connections.add(conn)
        unpack = unpacker()
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(READ_BYTES):
                unpack.feed(data)
                for msg in unpack:
                    kind = msg.get("t")
                    rid = msg.get("id")
                    if kind in ("call", "arriving"):
                        conn.arriving = int(msg.get("arriving", 0))
                        self.receiving += kind == "call"
                        self._company()
                    if kind == "call":
                        scope = conn.scopes[rid] = CancelScope()
                        loop.create_task(self.run_call(conn, msg, scope))
                    elif kind == "cancel":
                        if (scope := conn.scopes.pop(rid, None)) is not None:
                            scope.cancel()
                    elif kind == "ack":
                        if (credit := conn.credits.get(rid)) is not None:
                            credit.release()
                    elif kind == "reload":
                        loop.create_task(self._reload_for(conn, rid))
        except (ConnectionError, msgpack.ExtraData, ValueError) as e:
            log.warning("engine: a worker's connection failed: %s: %s", type(e).__name__, e)
        finally:
            self.connections.discard(conn)
            conn.arriving = 0
            self._company()
            for scope in list(conn.scopes.values()):
                scope.cancel()  # the worker went away: its queued work is dropped, heavy work stops
            writer.close()

    async def _reload_for(self, conn: _Connection, rid: int) -> None:
        try:
            await self.sync(rehash=True)
            conn.send({"id": rid, "ok": {"models": sorted(self.registry.models)}})
        except Exception as e:
            conn.send({"id": rid, "err": encode_error(e)})

    # -- lifecycle
    async def serve(self, stop: asyncio.Event) -> None:
        """Load the models, then answer the workers until `stop` is set; what is still queued then gets 503."""
        await self.batcher.start()
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.loader, self.reload)
        if out["failed"]:
            log.error("engine: models refused: %s", {n: self.registry.failed.get(n, "") for n in out["failed"]})
        self.path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self.handle, path=str(self.path), limit=READ_BYTES)
        os.chmod(self.path, 0o600)
        refresher = loop.create_task(publish_live_metrics(self.metrics)) if multiprocess_dir() else None
        log.warning("engine: %d models on %s, listening on %s", len(self.registry.models), self.registry.device,
                    self.path)
        try:
            await stop.wait()
        finally:
            if refresher is not None:
                refresher.cancel()
            server.close()
            self.batcher.fail_pending()
            await self.batcher.stop()
            self.loader.shutdown(wait=False, cancel_futures=True)
            self.path.unlink(missing_ok=True)


def run(settings: Settings, path: Path) -> None:
    """Blocking: the engine process until SIGTERM or SIGINT (`serve`'s supervisor sends it once every API worker
    has drained and exited)."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await EngineServer(settings, path).serve(stop)

    runner(main())


# -- the API worker's side ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Pending:
    future: asyncio.Future
    stream: EngineStream | None = None


class EngineStream(Payloads):
    """A streamed answer from the engine: `async for payload in stream` (an error is raised there), `close()` stops it
    (the engine drops the work). Each payload taken is acknowledged, so the engine computes at most STREAM_AHEAD
    ahead of the client."""

    def __init__(self, client: EngineClient, rid: int) -> None:
        super().__init__()
        self.client, self.rid = client, rid

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client._cancel(self.rid)
            self._q.put_nowait(self.END)

    def _took(self) -> None:
        self.client._send_now({"t": "ack", "id": self.rid})


class EngineClient(Arrivals):
    """An API worker's engine: the batcher's interface (`submit`, `stream`, `announce`/`retract`, `fail_pending`,
    `start`/`stop`), over one Unix connection to the engine process that is kept open (reconnected while the engine
    restarts). Requests in flight when the connection drops are answered 503 `engine_unavailable`."""

    def __init__(self, path: str | Path, metrics: Metrics, *, max_queue: int = 512, retry_after_s: int = 1):
        self.path, self.metrics, self.max_queue, self.retry_after_s = str(path), metrics, max_queue, retry_after_s
        self.pending: dict[int, _Pending] = {}
        self.ids = itertools.count(1)
        self.arriving = 0  # requests announced (`announce`) and not yet sent
        self.reported = 0  # what the engine last heard of `arriving`
        self.writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._refusing = False
        self._stopping = False

    @property
    def ready(self) -> bool:
        """Whether the engine is connected (its models loaded: it listens only then)."""
        return self.writer is not None and not self.writer.is_closing()

    async def start(self) -> None:
        self._refusing = self._stopping = False
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.get_running_loop().create_task(self._keep_connected())

    async def stop(self) -> None:
        self._stopping = True
        self.fail_pending()
        if self._task is not None:
            self._task.cancel()
        if self.writer is not None:
            self.writer.close()

    async def _keep_connected(self) -> None:
        down_since: float | None = None
        while not self._stopping:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path, limit=READ_BYTES)
            except OSError:
                if down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since > 10:
                    log.warning("API worker: the engine at %s has not answered for 10 s; still trying", self.path)
                    down_since = time.monotonic()
                await asyncio.sleep(RECONNECT_S)
                continue
            down_since = None
            self.writer = writer
            try:
                await self._read(reader)
            finally:
                self.writer = None
                writer.close()
                self._lost()
            if not self._stopping:
                log.warning("API worker: lost the engine connection; reconnecting")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        unpack = unpacker()
        try:
            while data := await reader.read(READ_BYTES):
                unpack.feed(data)
                for msg in unpack:
                    self._deliver(msg)
        except (ConnectionError, msgpack.ExtraData, ValueError) as e:
            log.warning("API worker: engine connection failed: %s: %s", type(e).__name__, e)

    def _deliver(self, msg: dict[str, Any]) -> None:
        p = self.pending.get(msg.get("id", -1))
        if p is None:  # cancelled meanwhile
            return
        if "chunk" in msg:
            if p.stream is not None:
                p.stream.put(msg["chunk"])
            return
        del self.pending[msg["id"]]
        if p.stream is not None:
            p.stream.put(decode_error(msg["err"]) if "err" in msg else Payloads.END)
            return
        if p.future.done():
            return
        if "err" in msg:
            p.future.set_exception(decode_error(msg["err"]))
        else:
            p.future.set_result(msg.get("ok"))

    def _lost(self) -> None:
        """The connection dropped: every request in flight is answered 503."""
        pending, self.pending = self.pending, {}
        for p in pending.values():
            err = engine_unavailable(self.retry_after_s)
            if p.stream is not None:
                p.stream.put(err)
            elif not p.future.done():
                p.future.set_exception(err)

    def _send_now(self, msg: dict[str, Any]) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(pack(msg))

    def _cancel(self, rid: int) -> None:
        if self.pending.pop(rid, None) is not None:
            self._send_now({"t": "cancel", "id": rid})

    async def _send(self, msg: dict[str, Any], scope: CancelScope | None, stream: bool = False) -> _Pending:
        if self._refusing:
            raise ShuttingDown()
        if not self.ready:
            raise engine_unavailable(self.retry_after_s)
        if len(self.pending) >= self.max_queue:
            raise QueueFull(f"{len(self.pending)} requests are queued (limit {self.max_queue}); retry later")
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        p = _Pending(fut)
        if stream:
            p.stream = EngineStream(self, rid)
            if scope is not None:
                scope.callbacks.append(p.stream.close)
        elif scope is not None:
            if scope.cancelled:
                fut.cancel()
            scope.futures.append(fut)
        fut.add_done_callback(lambda f: f.cancelled() and self._cancel(rid))
        self.pending[rid] = p
        msg.setdefault("t", "call")
        msg.update(id=rid, arriving=self.arriving)
        self.reported = self.arriving
        assert self.writer is not None
        self.writer.write(pack(msg))
        await self.writer.drain()
        return p

    async def submit(self, call: Call, ticket: list[bool] | None = None, *, heavy: bool = False,
                     slice_cost: int | None = None, scope: CancelScope | None = None, job: Any = None) -> Any:
        """`Batcher.submit` in the engine: the per-input result dicts (or what the operation's `run` returns)."""
        if job is not None:
            raise TypeError("an engine runs no local job; streamed operations go through `stream`")
        self.retract(ticket)
        msg = wire.to_wire(call)
        msg.update(heavy=heavy, slice=slice_cost or 0)
        p = await self._send(msg, scope)
        return await p.future

    async def stream(self, call: Call, *, slice_cost: int, positions: int, scope: CancelScope | None = None
                     ) -> EngineStream:
        """`Batcher.stream` in the engine: the payloads as the engine computes them."""
        msg = wire.to_wire(call)
        msg.update(heavy=True, slice=slice_cost, stream={"positions": positions, "slice": slice_cost})
        p = await self._send(msg, scope, stream=True)
        assert p.stream is not None
        return p.stream

    def run_calls(self, calls: list[Call], *, heavy_cost: int, slice_cost: int) -> list[Any]:
        """Blocking, from a thread other than the event loop's (the local batch-job runner, `jobs.RunCalls`): each
        call's results, or its exception, computed by the engine: `spec.run_calls` (calls of one model version,
        operation and options as one merged call, sent again call by call if it fails, so each gets its own error)
        with each call sent to the engine. While the engine is down the calls wait for it (`_job_call`)."""
        loop = self.loop
        assert loop is not None, "start() first"

        def run_call(call: Call, max_batch_tokens: int | None) -> list[dict]:  # the engine's batcher sizes batches
            return asyncio.run_coroutine_threadsafe(self._job_call(call, heavy_cost, slice_cost), loop).result()

        return spec.run_calls(calls, None, run_call)

    async def _job_call(self, call: Call, heavy_cost: int, slice_cost: int) -> Any:
        """One call of a batch job: up to JOB_RETRIES tries while the engine is unavailable, each after waiting up
        to JOB_ENGINE_WAIT_S for it to be back; raises the call's error (or the last `engine_unavailable`)."""
        err: APIError | None = None
        for _ in range(JOB_RETRIES):
            deadline = time.monotonic() + JOB_ENGINE_WAIT_S
            while not self.ready and time.monotonic() < deadline and not self._stopping:
                await asyncio.sleep(RECONNECT_S)
            try:
                return await self.submit(call, heavy=call.cost > heavy_cost, slice_cost=slice_cost)
            except APIError as e:
                if e.code != "engine_unavailable":
                    raise
                err = e
        assert err is not None
        raise err

    async def models_changed(self) -> None:
        """After this worker reloaded the store: the engine syncs too (re-hashing every file) before answering."""
        if not self.ready:
            return
        p = await self._send({"t": "reload"}, None)
        await p.future

    def _none_arriving(self) -> None:
        if self.reported:  # the engine may be holding a batch for the requests it heard of: none comes
            self.reported = 0
            self._send_now({"t": "arriving", "arriving": 0})

    def fail_pending(self) -> int:
        """Shutting down: every request waiting on the engine is answered 503 and cancelled there; new ones are
        refused. Returns how many were answered."""
        self._refusing = True
        pending, self.pending = self.pending, {}
        n = 0
        for rid, p in pending.items():
            self._send_now({"t": "cancel", "id": rid})
            if p.stream is not None:
                p.stream.put(ShuttingDown())
            elif not p.future.done():
                p.future.set_exception(ShuttingDown())
                n += 1
        return n
