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
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, get_type_hints

import anyio
from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.service import errors, execute
from latentlm.service.batcher import QueueFull
from latentlm.service.cache import CACHED_OPS
from latentlm.service.errors import APIError
from latentlm.service.middleware import BODY
from latentlm.service.schemas import DecodeRequest, EmbedRequest, PosteriorRequest, SampleRequest, ScoreRequest
from latentlm.service.state import ServiceState, get_state

JSON = "application/json"
BIG_RESPONSE_TOKENS = 2048  # bigger responses are serialised off the event loop
TICKET: ContextVar[list[bool] | None] = ContextVar("latentlm_ticket", default=None)  # Batcher.announce()'s


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

    def __init__(self, body: bytes, x_cache: str | None = None) -> None:
        self.body, self.status_code, self.background = body, 200, None
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]
        if x_cache is not None:
            self.raw_headers.append((b"x-cache", x_cache.encode()))


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
            try:
                raw = scope.get(BODY)
                if raw is None:
                    raw = await read_body(receive)
                response = await endpoint(parse_json(model, raw), state)
            finally:
                state.batcher.retract(ticket)
                TICKET.reset(token)
            await response(scope, receive, send)

        self.app = app


router = APIRouter(prefix="/v1", tags=["operations"], route_class=OperationRoute)


async def run_batched(op: str, req: Any, state: ServiceState) -> Response:
    """Check, look up the cache, queue for the batcher, shape the body (one write by `ops.dumps`)."""
    state.ensure_ready()
    s = state.settings
    prep = execute.prepare(state.registry.get(req.model), op, req, s.max_request_tokens, s.max_posterior_entries)
    cache, key = state.cache, None
    if cache is not None and op in CACHED_OPS:
        key = execute.cache_key(prep)
        hit = await cache.get(key, op)
        if hit is not None:
            return JSONBytes(hit, "hit")
    try:
        results = await state.batcher.submit(prep.model, op, prep.opts, prep.seqs, TICKET.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    data = execute.body(prep, results)
    big = prep.num_tokens > BIG_RESPONSE_TOKENS or op == "posterior"
    payload = await anyio.to_thread.run_sync(ops.dumps, data) if big else ops.dumps(data)
    if key is None:
        return JSONBytes(payload)
    await cache.set(key, payload)
    return JSONBytes(payload, "miss")


@router.post("/score")
async def score(req: ScoreRequest, state: ServiceState = Depends(get_state)) -> Response:
    """log p(x), perplexity per input [, tokens and token_logprobs]."""
    return await run_batched("score", req, state)


@router.post("/posterior")
async def posterior(req: PosteriorRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Per-token state marginals, most probable first (top_k per token, or every state)."""
    return await run_batched("posterior", req, state)


@router.post("/decode")
async def decode(req: DecodeRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Viterbi path (states, logprob) or MBR (states, state_probs); without `method`, the family's default
    (viterbi for HMMs, mbr for PCFGs; see `default_method` in /v1/models)."""
    return await run_batched("decode", req, state)


@router.post("/embed")
async def embed(req: EmbedRequest, state: ServiceState = Depends(get_state)) -> Response:
    """Per-token embeddings (families that support it)."""
    return await run_batched("embed", req, state)


@router.post("/sample", responses={200: {"content": {
    "application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
    "description": "the samples; with `stream: true` server-sent events, one per sample, then `data: [DONE]`"}})
async def sample(req: SampleRequest, state: ServiceState = Depends(get_state)) -> Response:
    """n samples (continuations of `prefix`); `stream: true` sends one SSE event per sample."""
    state.ensure_ready()
    model = state.registry.get(req.model)
    ops.check_supported(model, "sample")
    execute.check_sample(req, state.settings.max_sample_tokens, model=model,
                         max_request_tokens=state.settings.max_request_tokens)
    try:
        data = await state.batcher.call(model, "sample", lambda: execute.run_sample(model, req))
    except QueueFull as e:
        raise state.queue_full(e) from None
    if not req.stream:
        return JSONBytes(ops.dumps(data))

    async def events():
        for item in data["data"]:
            yield b"data: " + ops.dumps({"object": "sample.chunk", "model": model.name, **item}) + b"\n\n"
        yield b"data: " + ops.dumps({"object": "sample.usage", "model": model.name, "usage": data["usage"]}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
