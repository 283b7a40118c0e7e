"""POST /v1/completions: OpenAI's completions API, so the `openai` client, LangChain and curl scripts written for LM
servers work unchanged. The operation itself (its request model, preparing, cost, sampling, log-probabilities and
its `text_completion` answer) is `ops.completions`, declared in `ops.spec` like every operation; this route adds
only OpenAI's framing: the body validated as `CompletionRequest`, the call prepared and run through the one request
path (`operations.prepare_call`, the batcher or the engine process), and with `stream: true` the answer as
server-sent `text_completion` chunks (`stream_chunks`). Errors are the `{"error": {...}}` shape of every route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse

from latentlm import ops
from latentlm.models.results import Completion
from latentlm.ops import format, spec
from latentlm.ops.completions import CHUNK_SCHEMA, RESPONSE_SCHEMA, head, usage
from latentlm.ops.requests import CompletionRequest
from latentlm.service.batcher import QueueFull
from latentlm.service.routes.operations import CANCEL, JSONBytes, OperationRoute, prepare_call
from latentlm.service.schemas import sse_event
from latentlm.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["completions"], route_class=OperationRoute)

ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


@router.post("/completions", responses={200: {"content": {
    "application/json": {"schema": RESPONSE_SCHEMA}, "text/event-stream": {"schema": sse_event(CHUNK_SCHEMA)}},
    "description": "an OpenAI `text_completion`; with `stream: true` server-sent `text_completion` chunks, then "
                   "`data: [DONE]` (the event-stream schema is one event's)"},
    404: {"description": "no such model", **ERROR},
    429: {"description": "queue full or rate limit: retry after Retry-After", **ERROR}})
async def completions(req: CompletionRequest, state: ServiceState = Depends(get_state)) -> Response:
    """OpenAI completions over a chain-family model: choices drawn as /v1/sample draws them (same seed and
    settings, same tokens), with exact log-probabilities (`logprobs`, `echo`)."""
    op = spec.get("completions")
    call = await prepare_call(op, req, state)
    try:
        choices = await state.batcher.submit(call, heavy=call.cost > state.settings.heavy_request_cost,
                                             scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    if not req.stream:
        return JSONBytes(ops.dumps(op.body(call, choices)), cost=call.cost)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(stream_chunks(head(call), choices, usage(call, choices), include_usage),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "x-cost": str(call.cost)})


async def stream_chunks(shared: dict, choices: list[Completion], used: dict[str, int], include_usage: bool):
    """OpenAI's streamed completion: per choice, its pieces (`format.completion_pieces`: the echoed prompt as one
    chunk, one chunk per completion token with that token's logprobs, then one with its finish_reason), each in a
    `text_completion` chunk; with stream_options.include_usage every chunk has `usage: null` and a last chunk of
    `choices: []` has the usage; then `data: [DONE]`. The choices are drawn before the first chunk (the sampler
    draws a prompt's n choices together)."""
    extra = {"usage": None} if include_usage else {}

    def event(choices: list[dict], **more: Any) -> bytes:
        return b"data: " + ops.dumps({**shared, "choices": choices, **extra, **more}) + b"\n\n"

    for c in choices:
        for piece in format.completion_pieces(c):
            yield event([piece])
    if include_usage:
        yield event([], usage=used)
    yield b"data: [DONE]\n\n"
