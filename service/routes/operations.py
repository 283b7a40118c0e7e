"""POST /v1/score, /v1/posterior, /v1/decode, /v1/embed and /v1/sample: the one request path for every
operation.

Every operation route is an `OperationRoute`: a FastAPI route like any other, behind the same middleware and
exception handlers, in the same OpenAPI document (generated from the endpoint's request model). Only what
runs inside the route is leaner than FastAPI's generic request handling, which costs more CPU than a batched
forward pass of a 256-state model: the body is validated straight from its bytes by that same pydantic model
(`model_validate_json`, one pass in pydantic-core), and the endpoint is called as `endpoint(req, state)`
with no dependency injection and no Request object. Errors propagate to the app's exception handlers like
any route's. Requests of the same model, operation and options are merged by the batcher into one batched
run on the inference thread.

Every request's cost is estimated before any work (`ops.operation_cost`, answered in the `x-cost` header): above
`max_request_cost` it is refused 413 `budget_exceeded`; above `heavy_request_cost` it runs in the batcher's heavy
lane (its own thread, in slices), so light requests never wait for it. While a request waits or computes, the
route watches its connection: when the client goes away its `CancelScope` is cancelled, so queued work is dropped
and heavy work stops at its next slice. `POST /v1/posterior` with `stream: true` (or `Accept:
application/x-ndjson`) answers NDJSON, produced slice by slice with bounded memory.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, get_type_hints

import anyio
from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.models.errors import LatentLMError
from latentlm.service import errors, execute
from latentlm.service.batcher import CancelScope, QueueFull, slices
from latentlm.service.cache import CACHED_OPS
from latentlm.service.errors import APIError, ShuttingDown
from latentlm.service.middleware import BODY
from latentlm.service.schemas import DecodeRequest, EmbedRequest, PosteriorRequest, SampleRequest, ScoreRequest
from latentlm.service.state import ServiceState, get_state

JSON = "application/json"
BIG_RESPONSE_TOKENS = 2048  # bigger responses are serialised off the event loop
TICKET: ContextVar[list[bool] | None] = ContextVar("latentlm_ticket", default=None)  # Batcher.announce()'s
CANCEL: ContextVar[CancelScope | None] = ContextVar("latentlm_cancel", default=None)  # this request's scope
NDJSON = "application/x-ndjson"
STREAM_PAYLOAD_BYTES = 1 << 20  # a streamed posterior hands the event loop about this much per payload


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

        async def app(scope, receive, send) -> None:
            state: ServiceState = scope["app"].state.service
            ticket = state.batcher.announce()
            token = TICKET.set(ticket)
            cancel = CancelScope()
            ctoken = CANCEL.set(cancel)
            watcher = response = None
            try:
                raw = scope.get(BODY)
                if raw is None:
                    raw = await read_body(receive)
                req = parse_json(model, raw)
                if getattr(req, "stream", None) is False and model is PosteriorRequest and wants_ndjson(scope):
                    req.stream = True
                watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, cancel))
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
                if watcher is not None and not isinstance(response, StreamingResponse):
                    watcher.cancel()  # a stream keeps watching: its work goes on while it is sent
            try:
                await response(scope, receive, send)
            finally:
                if watcher is not None:
                    watcher.cancel()

        self.app = app


async def _gone(send) -> None:
    """Record 499 (client closed request) for a request whose client went away; nothing reaches the client."""
    try:
        await send({"type": "http.response.start", "status": 499, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
    except Exception:  # the connection is gone
        pass


router = APIRouter(prefix="/v1", tags=["operations"], route_class=OperationRoute)
X_COST = {"x-cost": {"description": "the request's estimated cost (`ops.operation_cost` units); over "
                                    "LATENTLM_MAX_REQUEST_COST it is refused 413 `budget_exceeded`, over "
                                    "LATENTLM_HEAVY_REQUEST_COST it runs in the heavy lane",
                     "schema": {"type": "integer"}}}


async def run_batched(op: str, req: Any, state: ServiceState) -> Response:
    """Check (limits, cost budget), look up the cache, queue for the batcher (the heavy lane above
    `heavy_request_cost`), shape the body (one write by `ops.dumps`)."""
    state.ensure_ready()
    s = state.settings
    streaming = bool(getattr(req, "stream", False))
    prep = execute.prepare(state.registry.get(req.model), op, req, s.max_request_tokens, s.max_posterior_entries,
                           max_cost=s.max_request_cost, streaming=streaming)
    if streaming:
        return await stream_posterior(prep, state)
    cache, key = state.cache, None
    if cache is not None and op in CACHED_OPS:
        key = execute.cache_key(prep)
        hit = await cache.get(key, op)
        if hit is not None:
            return JSONBytes(hit, "hit", prep.cost)
    heavy = prep.cost > s.heavy_request_cost
    if heavy:
        state.batcher.max_heavy = s.max_heavy_requests
    try:
        results = await state.batcher.submit(prep.model, op, prep.opts, prep.seqs, TICKET.get(), heavy=heavy,
                                             slice_cost=s.heavy_slice_cost, scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    data = execute.body(prep, results)
    big = prep.num_tokens > BIG_RESPONSE_TOKENS or op == "posterior"
    payload = await anyio.to_thread.run_sync(ops.dumps, data) if big else ops.dumps(data)
    if key is None:
        return JSONBytes(payload, cost=prep.cost)
    await cache.set(key, payload)
    return JSONBytes(payload, "miss", prep.cost)


async def stream_posterior(prep: execute.Prepared, state: ServiceState) -> Response:
    """NDJSON posterior: `{"object": "posterior.chunk", "model", "index", "offset", "marginals"}` lines (chain
    families: at most `posterior_stream_positions` tokens each; PCFGs: one line per sentence with `spans`), then
    `{"object": "posterior.usage", "model", "usage"}`. Computed in the heavy lane slice by slice; at most
    STREAM_AHEAD payloads of ~1 MB wait for a slow client, so memory stays bounded whatever the response size.
    An error before the first line is answered with its status; a later one as a last line `{"error": ...}`."""
    s = state.settings
    model, seqs, top_k = prep.model, prep.seqs, prep.opts.get("top_k")
    positions = max(1, s.posterior_stream_positions)
    head = b'{"object":"posterior.chunk","model":' + ops.dumps(model.name) + b","

    def job():
        costs = [ops.operation_cost(model, "posterior", [q], top_k=top_k) for q in seqs]
        for lo, hi in slices(costs, s.heavy_slice_cost):
            lines: list[bytes] = []
            size = 0
            for piece in ops.posterior_chunks(model, seqs[lo:hi], top_k, positions, offset=lo):
                line = head + ops.dumps(piece)[1:] + b"\n"
                lines.append(line)
                size += len(line)
                if size >= STREAM_PAYLOAD_BYTES:
                    yield b"".join(lines)
                    lines, size = [], 0
            if lines:
                yield b"".join(lines)

    state.batcher.max_heavy = s.max_heavy_requests
    try:
        reader = state.batcher.stream(model, "posterior", job, CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    try:
        first = await reader.__anext__()  # errors of the first slice get their own status
    except ShuttingDown:
        raise state.shutting_down() from None
    except BaseException:
        reader.close()
        raise
    n = prep.num_tokens
    usage = ops.dumps({"object": "posterior.usage", "model": model.name,
                       "usage": {"input_tokens": n, "total_tokens": n}}) + b"\n"

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
                                                                  "x-cost": str(prep.cost)})


@router.post("/score", responses={200: {"headers": X_COST}})
async def score(req: ScoreRequest, state: ServiceState = Depends(get_state)) -> Response:
    """log p(x), perplexity per input [, tokens and token_logprobs]."""
    return await run_batched("score", req, state)


@router.post("/posterior", responses={200: {"content": {
    "application/json": {}, NDJSON: {"schema": {"type": "string"}}},
    "description": "the marginals; with `stream: true` or `Accept: application/x-ndjson` NDJSON: "
                   "`posterior.chunk` lines (`index`, `offset`, `marginals`; PCFGs `spans`) then a "
                   "`posterior.usage` line", "headers": X_COST}})
async def posterior(req: PosteriorRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Per-token state marginals, most probable first (top_k per token, or every state). Above
    max_posterior_entries 413 unless streamed (`stream: true`: NDJSON)."""
    return await run_batched("posterior", req, state)


@router.post("/decode", responses={200: {"headers": X_COST}})
async def decode(req: DecodeRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Viterbi path (states, logprob) or MBR (states, state_probs); without `method`, the family's default
    (viterbi for HMMs, mbr for PCFGs; see `default_method` in /v1/models)."""
    return await run_batched("decode", req, state)


@router.post("/embed", responses={200: {"headers": X_COST}})
async def embed(req: EmbedRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Per-token embeddings (families that support it)."""
    return await run_batched("embed", req, state)


@router.post("/sample", responses={200: {"content": {
    "application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
    "description": "the samples; with `stream: true` server-sent events, one per sample, then `data: [DONE]`",
    "headers": X_COST}})
async def sample(req: SampleRequest, state: ServiceState = Depends(get_state)) -> Response:
    """n samples (continuations of `prefix`); `stream: true` sends one SSE event per sample."""
    state.ensure_ready()
    model = state.registry.get(req.model)
    ops.check_supported(model, "sample")
    s = state.settings
    cost = execute.check_sample(req, s.max_sample_tokens, model=model, max_request_tokens=s.max_request_tokens,
                                max_cost=s.max_request_cost)
    state.batcher.max_heavy = s.max_heavy_requests
    try:
        data = await state.batcher.call(model, "sample", lambda: execute.run_sample(model, req),
                                        heavy=cost > s.heavy_request_cost, scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    if not req.stream:
        return JSONBytes(ops.dumps(data), cost=cost)

    async def events():
        for item in data["data"]:
            yield b"data: " + ops.dumps({"object": "sample.chunk", "model": model.name, **item}) + b"\n\n"
        yield b"data: " + ops.dumps({"object": "sample.usage", "model": model.name, "usage": data["usage"]}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                               "x-cost": str(cost)})
