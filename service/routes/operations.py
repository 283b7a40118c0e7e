"""POST /v1/score, /v1/posterior, /v1/decode, /v1/embed and /v1/sample: the one request path for every
operation.

Every operation route is an `OperationRoute`: a FastAPI route like any other (the same middleware, exception
handlers and OpenAPI document, generated from the endpoint's request model), except that its body is
validated straight from the request bytes by that same pydantic model (`model_validate_json`, one pass in
pydantic-core) rather than parsed to Python objects first and validated second, which costs more CPU than a
batched forward pass of a 256-state model. Requests of the same model, operation and options are merged by
the batcher into one batched run on the inference thread.
"""

from __future__ import annotations

from typing import Any, get_type_hints

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.service import errors, execute
from latentlm.service.batcher import QueueFull
from latentlm.service.cache import CACHED_OPS
from latentlm.service.errors import APIError
from latentlm.service.schemas import DecodeRequest, EmbedRequest, PosteriorRequest, SampleRequest, ScoreRequest
from latentlm.service.state import ServiceState

JSON = "application/json"
BIG_RESPONSE_TOKENS = 2048  # bigger responses are serialised off the event loop
TICKET = "latentlm.ticket"


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


class OperationRoute(APIRoute):
    """Calls `endpoint(req, request)` with the body validated by the endpoint's `req` annotation. The batcher
    hears of the request as soon as it arrives (`announce`), so a batch waits for company that is coming."""

    def get_route_handler(self):
        endpoint = self.endpoint
        model = get_type_hints(endpoint)["req"]

        async def handler(request: Request) -> Response:
            state: ServiceState = request.app.state.service
            ticket = state.batcher.announce()
            request.scope[TICKET] = ticket
            try:
                return await endpoint(parse_json(model, await request.body()), request)
            finally:
                state.batcher.retract(ticket)

        return handler


router = APIRouter(prefix="/v1", tags=["operations"], route_class=OperationRoute)


async def run_batched(op: str, req: Any, request: Request) -> Response:
    """Check, look up the cache, queue for the batcher, shape the body (one write by `ops.dumps`)."""
    state: ServiceState = request.app.state.service
    state.ensure_ready()
    prep = execute.prepare(state.registry.get(req.model), op, req, state.settings.max_request_tokens)
    cache, key = state.cache, None
    if cache is not None and op in CACHED_OPS:
        key = execute.cache_key(prep)
        hit = await cache.get(key, op)
        if hit is not None:
            return Response(hit, media_type=JSON, headers={"X-Cache": "hit"})
    try:
        results = await state.batcher.submit(prep.model, op, prep.opts, prep.seqs, request.scope.get(TICKET))
    except QueueFull as e:
        raise state.queue_full(e) from None
    data = execute.body(prep, results)
    big = prep.num_tokens > BIG_RESPONSE_TOKENS or op == "posterior"
    payload = await anyio.to_thread.run_sync(ops.dumps, data) if big else ops.dumps(data)
    if key is None:
        return Response(payload, media_type=JSON)
    await cache.set(key, payload)
    return Response(payload, media_type=JSON, headers={"X-Cache": "miss"})


@router.post("/score")
async def score(req: ScoreRequest, request: Request) -> Response:
    """log p(x), perplexity per input [, tokens and token_logprobs]."""
    return await run_batched("score", req, request)


@router.post("/posterior")
async def posterior(req: PosteriorRequest, request: Request) -> Response:
    """Per-token state marginals, most probable first (top_k per token, or every state)."""
    return await run_batched("posterior", req, request)


@router.post("/decode")
async def decode(req: DecodeRequest, request: Request) -> Response:
    """Viterbi path (states, logprob) or MBR (states, state_probs); without `method`, the family's default
    (viterbi for HMMs, mbr for PCFGs; see `default_method` in /v1/models)."""
    return await run_batched("decode", req, request)


@router.post("/embed")
async def embed(req: EmbedRequest, request: Request) -> Response:
    """Per-token embeddings (families that support it)."""
    return await run_batched("embed", req, request)


@router.post("/sample")
async def sample(req: SampleRequest, request: Request) -> Response:
    """n samples (continuations of `prefix`); `stream: true` sends one SSE event per sample."""
    state: ServiceState = request.app.state.service
    state.ensure_ready()
    model = state.registry.get(req.model)
    ops.check_supported(model, "sample")
    execute.check_sample(req, state.settings.max_sample_tokens)
    try:
        data = await state.batcher.call(model, "sample", lambda: execute.run_sample(model, req))
    except QueueFull as e:
        raise state.queue_full(e) from None
    if not req.stream:
        return Response(ops.dumps(data), media_type=JSON)

    async def events():
        for item in data["data"]:
            yield b"data: " + ops.dumps({"object": "sample.chunk", "model": model.name, **item}) + b"\n\n"
        yield b"data: " + ops.dumps({"object": "sample.usage", "model": model.name, "usage": data["usage"]}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
