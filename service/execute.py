"""From a validated request to a response body, with the service's limits: resolve the model, prepare the call
(`ops.spec.prepare`: options, inputs, cost), check the limits and budgets before any work, run it (via the batcher
in the API, directly in batch-job workers) and shape `{"object": "list", ...}` (`ops.format.body`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.models.errors import LimitExceeded
from latentlm.ops import spec
from latentlm.ops.constrain import Limits
from latentlm.ops.requests import SampleRequest
from latentlm.ops.spec import Call
from latentlm.service.errors import APIError, describe_validation


def parse(op: str, body: Any) -> BaseModel:
    """Validate a JSON body for `op` (batch-job path; the API validates from the raw bytes). 422 naming the
    field."""
    if not isinstance(body, dict):
        raise APIError(422, "body: expected a JSON object", param="body", code="invalid_value")
    try:
        return spec.get(op).request.model_validate(body)
    except ValidationError as e:
        raise describe_validation([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def prepare(model: ops.LoadedModel, op: str | spec.Operation, req: BaseModel, max_request_tokens: int,
            max_posterior_entries: int | None = None, *, max_cost: int | None = None, streaming: bool = False,
            max_sample_tokens: int | None = None, max_stream_entries: int | None = None,
            limits: Limits | None = None) -> Call:
    """`spec.prepare` (support, inputs, cost), then the service's limits before any work: input tokens
    (`max_request_tokens`, naming the operation's input field), tokens a generating operation may draw
    (`max_sample_tokens`), the cost budget (`max_cost`; None or 0: none) and the size of a posterior's answer:
    `max_posterior_entries` when it is not streamed, `max_stream_entries` when it is (None or 0: unbounded).
    `limits`: the sizes of a constrained request (`limits(settings)`)."""
    call = spec.prepare(model, op, req, limits or Limits())
    op = call.op
    if max_sample_tokens is not None and op.generates and call.output_tokens > max_sample_tokens:
        raise LimitExceeded(f"n * max_tokens = {call.output_tokens} exceeds the limit of {max_sample_tokens}",
                            param="max_tokens")
    if call.input_tokens > max_request_tokens:
        where = "(split the input or use /v1/batches)" if op.takes_input else "(max_request_tokens)"
        raise LimitExceeded(f"{op.input_field}: {call.input_tokens} tokens exceed the limit of {max_request_tokens} "
                            f"per request {where}", param=op.input_field)
    check_cost(op.name, call.cost, max_cost, "max_tokens" if op.generates else op.input_field, op.advice)
    if op.name == "posterior" and max_posterior_entries is not None and not streaming:
        check_posterior(model, call.seqs, call.opts.get("top_k"), max_posterior_entries)
    if op.name == "posterior" and max_stream_entries and streaming:
        check_stream(model, call.seqs, call.opts.get("top_k"), max_stream_entries)
    return call


def check_cost(op: str, cost: int, max_cost: int | None, param: str, advice: str) -> None:
    """413 `budget_exceeded` naming the estimate and the budget when `cost` is above `max_cost`."""
    if max_cost and cost > max_cost:
        raise APIError(413, f"{param}: the estimated cost of this {op} request is {cost:,} units, above the budget "
                            f"of {max_cost:,} per request (max_request_cost, LATENTLM_MAX_REQUEST_COST); {advice}",
                       param=param, code="budget_exceeded")


def check_posterior(model: ops.LoadedModel, seqs: list[list[int]], top_k: int | None, limit: int) -> None:
    """413 when the posterior would return more than `limit` (state or span, probability) pairs."""
    entries = ops.posterior_entries(model, seqs, top_k)
    if entries > limit:
        n = sum(len(s) for s in seqs)
        what = "every state" if top_k is None else f"top_k={top_k}"
        raise LimitExceeded(
            f"top_k: a posterior of {n} tokens with {what} returns {entries} entries, above the limit of {limit} "
            "per request (max_posterior_entries, LATENTLM_MAX_POSTERIOR_ENTRIES); ask for fewer states per "
            "token with top_k, send less input, or stream the answer (\"stream\": true, NDJSON)", param="top_k")


def check_stream(model: ops.LoadedModel, seqs: list[list[int]], top_k: int | None, limit: int) -> None:
    """413 when a streamed posterior would send more than `limit` entries (NDJSON, 25-32 bytes an entry), naming
    `top_k` when fewer states per token would fit, else `input`."""
    entries = ops.posterior_entries(model, seqs, top_k)
    if entries <= limit:
        return
    n = sum(len(s) for s in seqs)
    what = "every state" if top_k is None else f"top_k={top_k}"
    param = "top_k" if ops.posterior_entries(model, seqs, 1) <= limit else "input"
    advice = "ask for fewer states per token with top_k or send less input" if param == "top_k" else \
        "send less input per request (or use /v1/batches)"
    raise LimitExceeded(
        f"{param}: a streamed posterior of {n} tokens with {what} sends {entries:,} entries (about "
        f"{entries * 25 / 1e6:,.0f} MB), above the limit of {limit:,} per streamed request (max_stream_entries, "
        f"LATENTLM_MAX_STREAM_ENTRIES); {advice}", param=param)


def body(call: Call, results: list[dict]) -> dict[str, Any]:
    """The operation's whole response (`Operation.body`)."""
    return call.op.body(call, results)


def limits(settings: Any) -> Limits:
    """The sizes a constrained request may reach (LATENTLM_MAX_CONSTRAINT_STATES, LATENTLM_MAX_CONSTRAINT_BYTES,
    LATENTLM_CONSTRAINT_COMPILE_SECONDS), and the request limits an operation may check before its own work
    (max_request_tokens, max_sample_tokens)."""
    return Limits(max_states=settings.max_constraint_states, max_bytes=settings.max_constraint_bytes,
                  compile_seconds=settings.constraint_compile_seconds,
                  max_request_tokens=settings.max_request_tokens, max_sample_tokens=settings.max_sample_tokens)


def run_direct(call: Call, max_batch_tokens: int | None) -> dict[str, Any]:
    """Run without the batcher (batch-job workers): the same `Operation.run` the batcher calls."""
    return spec.execute(call, max_batch_tokens)


def check_sample(req: SampleRequest, max_sample_tokens: int, *, model: ops.LoadedModel | None = None,
                 max_request_tokens: int | None = None, max_cost: int | None = None, limits: Limits | None = None
                 ) -> int:
    """A sample request's limits (`prepare`'s, for callers that build `SampleRequest`s themselves): 413 when
    n * max_tokens exceeds `max_sample_tokens`, the prefix's tokens `max_request_tokens` or the estimated cost
    `max_cost`; a constraint is compiled within `limits`. Returns the cost estimate (0 without `model`)."""
    if req.n * req.max_tokens > max_sample_tokens:
        raise LimitExceeded(f"n * max_tokens = {req.n * req.max_tokens} exceeds the limit of {max_sample_tokens}",
                            param="max_tokens")
    if model is None:
        return 0
    limit = max_request_tokens if max_request_tokens is not None else 1 << 62
    return prepare(model, "sample", req, limit, max_cost=max_cost, limits=limits).cost


def cache_key(call: Call) -> str:
    """model name + content hash + numerics (dtype, scoring precision, runner: `LoadedModel.numerics`) + operation
    + every option + input hash (the name is in the body)."""
    opts = call.request.model_dump(exclude={"model", "input"})
    h_opts = hashlib.sha256(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:16]
    h_in = hashlib.sha256(json.dumps(call.request.input, separators=(",", ":")).encode()).hexdigest()
    return (f"latentlm:cache:{call.model.name}:{call.model.content_hash}:{call.model.numerics()}:{call.op.name}:"
            f"{h_opts}:{h_in}")
