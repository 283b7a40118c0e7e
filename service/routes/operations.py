"""POST /v1/<operation> for every operation of `ops.spec.OPERATIONS` (score, posterior, decode, sample, embed, ...):
the one request path for every operation, its routes built from the declarations (`build_router`).

Every operation route is an `OperationRoute`: a FastAPI route like any other, behind the same middleware and
exception handlers, in the same OpenAPI document (generated from the endpoint's request model). Only what
runs inside the route is leaner than FastAPI's generic request handling, which costs more CPU than a batched
forward pass of a 256-state model: the body is validated straight from its bytes by that same pydantic model
(`model_validate_json`, one pass in pydantic-core), and the endpoint is called as `endpoint(req, state)`
with no dependency injection and no Request object. Errors propagate to the app's exception handlers like
any route's. Requests of the same model, operation and options are merged by the batcher into one batched
run on the inference thread.

Every request's cost is estimated before any work (its family's `cost`, answered in the `x-cost` header): above
`max_request_cost` it is refused 413 `budget_exceeded`; above `heavy_request_cost` it runs in the batcher's heavy
lane (its own thread, in slices), so light requests never wait for it. Preparing a request that compiles a
constraint (`constraint`, `sample` with one) costs up to LATENTLM_CONSTRAINT_COMPILE_SECONDS of CPU: it runs on
the preparation threads (`service.preparing`), never on the event loop. While a request waits, compiles or
computes, the route watches its connection: when the client goes away its `CancelScope` is cancelled, so queued
work is dropped, a compilation stops at its next check and heavy work at its next slice. `POST /v1/posterior`
with `stream: true` (or `Accept: application/x-ndjson`) answers NDJSON, produced slice by slice with bounded
memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from contextvars import ContextVar
from typing import Any, get_type_hints

import anyio
from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.ops import format, spec
from latentlm.service import errors, execute, schemas
from latentlm.service.batcher import CancelScope, QueueFull
from latentlm.service.errors import APIError, ShuttingDown
from latentlm.service.middleware import BODY
from latentlm.service.state import ServiceState, get_state

JSON = "application/json"
BIG_RESPONSE_TOKENS = 2048  # bigger responses are serialised off the event loop
TICKET: ContextVar[list[bool] | None] = ContextVar("latentlm_ticket", default=None)  # Batcher.announce()'s
CANCEL: ContextVar[CancelScope | None] = ContextVar("latentlm_cancel", default=None)  # this request's scope
NDJSON = "application/x-ndjson"
WATCH_AFTER_S = 0.05  # a request still running after this starts watching its connection (`Watch`)


def parse_json(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Body bytes -> the operation's request model; 422 naming the field (400 for bytes that are not JSON)."""
    if not raw.strip():
        raise APIError(422, "body: empty request body; expected a JSON object", param="body", code="missing_field")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errs = list(e.errors())
        if errs and not errs[0].get("loc") and errs[0].get("type") != "json_invalid":
            raise APIError(422, "body: expected a JSON object", param="body", code="invalid_value") from None
        raise errors.describe_validation(errs) from None


class JSONBytes(Response):
    """A 200 response of JSON bytes already written by `ops.dumps`; its headers are built as raw bytes
    (Starlette's `Response.__init__` renders them through its generic path, slower per request)."""

    media_type = JSON

    def __init__(self, body: bytes, x_cache: str | None = None, cost: int | None = None) -> None:
        self.body, self.status_code, self.background = body, 200, None
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]
        if x_cache is not None:
            self.raw_headers.append((b"x-cache", x_cache.encode()))
        if cost is not None:
            self.raw_headers.append((b"x-cost", b"%d" % cost))


async def watch_disconnect(receive, scope: CancelScope) -> None:
    """Wait for the client to go away (`http.disconnect`), then cancel the request's work."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            scope.cancel()
            return


class Watch:
    """A request's disconnect watcher (`watch_disconnect`), started only once the request has taken WATCH_AFTER_S:
    small requests are answered sooner even at c=64 on 2 cores, and a watcher costs a task created, run and
    cancelled (bench/results/hot_path.md). A client that goes away is noticed WATCH_AFTER_S later at most."""

    __slots__ = ("receive", "scope", "timer", "task")

    def __init__(self, receive, scope: CancelScope) -> None:
        self.receive, self.scope = receive, scope
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None

    def arm(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self.timer = None
        self.task = asyncio.get_running_loop().create_task(watch_disconnect(self.receive, self.scope))

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None:
            self.task.cancel()
            self.task = None


def wants_ndjson(scope) -> bool:
    return any(k == b"accept" and NDJSON.encode() in v for k, v in scope.get("headers", ()))


async def read_body(receive) -> bytes:
    """The request body (the middleware has already bounded its size and buffered it)."""
    msg = await receive()
    body = msg.get("body", b"")
    if not msg.get("more_body", False):
        return body
    chunks = [body]
    while msg.get("more_body", False):
        msg = await receive()
        chunks.append(msg.get("body", b""))
    return b"".join(chunks)


class OperationRoute(APIRoute):
    """An APIRoute whose ASGI app calls `endpoint(req, state)` with the body validated by the endpoint's
    `req` annotation. The batcher hears of the request as soon as it arrives (`announce`), so a batch waits
    for company that is on its way."""

    def __init__(self, path: str, endpoint: Any, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        model = get_type_hints(endpoint)["req"]
        ndjson = getattr(endpoint, "stream", None) == "ndjson"

        async def app(scope, receive, send) -> None:
            state: ServiceState = scope["app"].state.service
            ticket = state.batcher.announce()
            token = TICKET.set(ticket)
            cancel = CancelScope()
            ctoken = CANCEL.set(cancel)
            watch = Watch(receive, cancel)
            response = None
            try:
                raw = scope.get(BODY)
                if raw is None:
                    raw = await read_body(receive)
                req = parse_json(model, raw)
                if ndjson and getattr(req, "stream", None) is False and wants_ndjson(scope):
                    req.stream = True
                watch.arm()
                try:
                    response = await endpoint(req, state)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if not cancel.cancelled or (task is not None and task.cancelling()):
                        raise
                    await _gone(send)  # the client went away; its work is dropped
                    return
            finally:
                state.batcher.retract(ticket)
                TICKET.reset(token)
                CANCEL.reset(ctoken)
                if not isinstance(response, StreamingResponse):
                    watch.stop()  # a stream keeps watching: its work goes on while it is sent
            try:
                await response(scope, receive, send)
            finally:
                watch.stop()

        self.app = app


async def _gone(send) -> None:
    """Record 499 (client closed request) for a request whose client went away; nothing reaches the client."""
    try:
        await send({"type": "http.response.start", "status": 499, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
    except Exception:  # the connection is gone
        pass


X_COST = {"x-cost": {"description": "the request's estimated cost (its family's `cost`, in `models.cost` units); "
                                    "over LATENTLM_MAX_REQUEST_COST it is refused 413 `budget_exceeded`, over "
                                    "LATENTLM_HEAVY_REQUEST_COST it runs in the heavy lane",
                     "schema": {"type": "integer"}}}
STREAM_DOCS = {
    "ndjson": "the answer; with `stream: true` or `Accept: application/x-ndjson` NDJSON: `<op>.chunk` lines "
              "(posterior: `index`, `offset`, `marginals`; PCFGs `spans`) then an `<op>.usage` line (an error after "
              "the first line: a last `{\"error\": ...}` line); the NDJSON schema is one line's",
    "sse": "the answer; with `stream: true` server-sent events, one `<op>.chunk` per result, then an `<op>.usage` "
           "event and `data: [DONE]`; the event-stream schema is one event's",
}


def response_docs(op: spec.Operation) -> dict[str, Any]:
    """The 200 response of `POST /v1/<op>` in the OpenAPI document: JSON, and what a streamed answer sends, one
    event or line at a time (`schemas.sse_event`, `schemas.chunk`, `schemas.usage_line`)."""
    if op.stream not in STREAM_DOCS:
        return {"description": "the answer", "headers": X_COST}
    pieces = schemas.chunk(op.name, op.piece_schema), schemas.usage_line(op.name, op.generates)
    if op.stream == "ndjson":
        media, schema = NDJSON, {"anyOf": [*pieces, {"$ref": "#/components/schemas/Error"}]}
    else:
        media, schema = "text/event-stream", schemas.sse_event(*pieces)
    return {"content": {"application/json": {}, media: {"schema": schema}}, "description": STREAM_DOCS[op.stream],
            "headers": X_COST}


async def run_operation(op: spec.Operation, req: Any, state: ServiceState) -> Response:
    """Prepare (support, inputs, limits, cost budget: all before any work), look up the cache, queue for the
    batcher (the heavy lane above `heavy_request_cost`), shape the body (one write by `ops.dumps`)."""
    call = await prepare_call(op, req, state)
    s = state.settings
    if op.stream == "ndjson" and call.streaming:
        return await stream_pieces(call, state)
    cache, key = state.cache, None
    if cache is not None and op.cache:
        key = execute.cache_key(call)
        hit = await cache.get(key, op.name)
        if hit is not None:
            return JSONBytes(hit, "hit", call.cost)
    try:
        results = await state.batcher.submit(call, TICKET.get(), heavy=call.cost > s.heavy_request_cost,
                                             slice_cost=s.heavy_slice_cost, scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    if op.stream == "sse" and call.streaming:
        return sse_response(call, results)
    data = op.body(call, results)
    big = call.num_tokens > BIG_RESPONSE_TOKENS or op.name == "posterior"
    payload = await anyio.to_thread.run_sync(ops.dumps, data) if big else ops.dumps(data)
    if key is None:
        return JSONBytes(payload, cost=call.cost)
    await cache.set(key, payload)
    return JSONBytes(payload, "miss", call.cost)


async def prepare_call(op: spec.Operation, req: Any, state: ServiceState) -> spec.Call:
    """The request prepared (`execute.prepare`: support, inputs, a constraint compiled, limits, cost budget) before
    any work; a request that compiles a constraint (up to constraint_compile_seconds of CPU) on a preparation thread,
    cancelled with the request."""
    state.ensure_ready()
    s = state.settings
    prepare = functools.partial(execute.prepare, state.registry.get(req.model), op, req, s.max_request_tokens,
                                s.max_posterior_entries, max_cost=s.max_request_cost, streaming=call_streams(op, req),
                                max_sample_tokens=s.max_sample_tokens, max_stream_entries=s.max_stream_entries)
    if compiles(req):
        return await prepare_off_loop(state, prepare)
    return prepare(limits=execute.limits(s))


def compiles(req: Any) -> bool:
    """Whether preparing `req` compiles a constraint's automaton (CPU-bound: never on the event loop)."""
    return getattr(req, "constraint", None) is not None


async def prepare_off_loop(state: ServiceState, prepare: Any) -> Any:
    """`prepare(limits=...)` on the service's preparation threads (`service.preparing`), its compilation cancelled
    when the request's client goes away or the shutdown grace ends. The request stops counting as on its way to
    the batcher meanwhile (a light batch would wait for it)."""
    scope = CANCEL.get()
    state.batcher.retract(TICKET.get())
    limits = dataclasses.replace(execute.limits(state.settings), cancelled=state.preparer.cancelled_for(scope))
    try:
        return await state.preparer.run(functools.partial(prepare, limits=limits), scope=scope)
    except QueueFull as e:
        raise state.queue_full(e) from None


def call_streams(op: spec.Operation, req: Any) -> bool:
    return op.stream is not None and bool(getattr(req, "stream", False))


def sse_response(call: spec.Call, results: list[dict]) -> Response:
    """Server-sent events: one `<op>.chunk` per result, an `<op>.usage` event, then `data: [DONE]`."""

    async def events():
        for item in results:
            yield b"data: " + ops.dumps(format.chunk(call, item)) + b"\n\n"
        yield b"data: " + ops.dumps(format.usage_line(call, results)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                               "x-cost": str(call.cost)})


async def stream_pieces(call: spec.Call, state: ServiceState) -> Response:
    """NDJSON: `{"object": "<op>.chunk", "model", ...piece}` lines (posterior: chain families at most
    `posterior_stream_positions` tokens each, `index`, `offset`, `marginals`; PCFGs one line per sentence with
    `spans`), then `{"object": "<op>.usage", "model", "usage"}`. Computed in the heavy lane slice by slice; at most
    STREAM_AHEAD payloads of ~1 MB wait for a slow client, so memory stays bounded whatever the response size. An
    error before the first line is answered with its status; a later one as a last line `{"error": ...}`."""
    try:
        s = state.settings
        reader = await state.batcher.stream(call, slice_cost=s.heavy_slice_cost,
                                            positions=max(1, s.posterior_stream_positions), scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    try:
        first = await reader.__anext__()  # errors of the first slice get their own status
    except ShuttingDown:
        raise state.shutting_down() from None
    except BaseException:
        reader.close()
        raise
    usage = ops.dumps(format.usage_line(call, [])) + b"\n"

    async def lines():
        try:
            yield first
            async for payload in reader:
                yield payload
            yield usage
        except Exception as e:  # after the 200 was sent: the error as the last line
            err = state.shutting_down() if isinstance(e, ShuttingDown) else (
                errors.from_model_error(e) if isinstance(e, LatentLMError) else
                e if isinstance(e, APIError) else APIError(500, f"internal error: {type(e).__name__}",
                                                           code="internal_error"))
            yield ops.dumps(errors.error_payload(err)) + b"\n"
        finally:
            reader.close()

    return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": "no-cache",
                                                                  "x-cost": str(call.cost)})


def endpoint_for(op: spec.Operation) -> Any:
    """`POST /v1/<op>`'s endpoint: its body validated by the operation's request model, then `run_operation`."""

    async def endpoint(req, state=Depends(get_state)):
        return await run_operation(op, req, state)

    endpoint.__annotations__ = {"req": op.request, "state": ServiceState, "return": Response}
    endpoint.__name__ = endpoint.__qualname__ = op.name
    endpoint.__doc__ = op.help[:1].upper() + op.help[1:] + "."
    endpoint.stream = op.stream  # type: ignore[attr-defined]
    return endpoint


def build_router() -> APIRouter:
    """One route per operation of `spec.OPERATIONS`, in their order (but those served by a route of their own)."""
    router = APIRouter(prefix="/v1", tags=["operations"], route_class=OperationRoute)
    for op in spec.OPERATIONS.values():
        if not op.route:
            continue
        router.add_api_route(f"/{op.name}", endpoint_for(op), methods=["POST"], name=op.name,
                             responses={200: response_docs(op)})
    return router
