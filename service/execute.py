"""From a validated request to a response body: resolve the model, encode inputs, check limits, run the
operation (via the batcher in the API, directly in batch-job workers) and shape `{"object": "list", ...}`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from latentlm import ops
from latentlm.models.errors import LimitExceeded
from latentlm.service.errors import APIError, describe_validation
from latentlm.service.schemas import REQUESTS, SampleRequest


@dataclass
class Prepared:
    """A request ready to run: the model version it will use, token ids and the operation's options."""

    model: ops.LoadedModel
    op: str
    opts: dict[str, Any]
    seqs: list[list[int]]
    request: BaseModel
    cost: int = 0  # `ops.operation_cost` estimate

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


def parse(op: str, body: Any) -> BaseModel:
    """Validate a JSON body for `op` (batch-job path; the API lets FastAPI do it). 422 naming the field."""
    if not isinstance(body, dict):
        raise APIError(422, "body: expected a JSON object", param="body", code="invalid_value")
    try:
        return REQUESTS[op].model_validate(body)
    except ValidationError as e:
        raise describe_validation([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def options(model: ops.LoadedModel, op: str, req: BaseModel) -> dict[str, Any]:
    """The keyword options `ops.run` takes for `op`: every request field but `model` and `input` (they are
    named as in the CLI; `stream` is the route's), with `top_k` parsed and a missing decode `method` set to the
    family's default."""
    opts = {k: getattr(req, k) for k in type(req).model_fields if k not in ("model", "input", "stream")}
    if "top_k" in opts:
        opts["top_k"] = ops.parse_top_k(opts["top_k"])
    if op == "decode" and opts.get("method") is None:
        opts["method"] = ops.default_method(model)
    return opts


def prepare(model: ops.LoadedModel, op: str, req: BaseModel, max_request_tokens: int,
            max_posterior_entries: int | None = None, *, max_cost: int | None = None,
            streaming: bool = False) -> Prepared:
    """Check support, encode inputs (strings per the manifest; id lists as is), the token limit, the cost
    budget (`max_cost`; None or 0: none) and, for a posterior that is not streamed, the response budget
    (`max_posterior_entries`; None: unbounded) before any work."""
    opts = options(model, op, req)
    ops.check_supported(model, op, opts.get("method"))
    raw = req.input if isinstance(req.input, list) else [req.input]
    seqs = ops.encode_inputs(model.vocab, raw)
    n = sum(len(s) for s in seqs)
    if n > max_request_tokens:
        raise LimitExceeded(f"input: {n} tokens exceed the limit of {max_request_tokens} per request "
                            "(split the input or use /v1/batches)", param="input")
    cost = ops.operation_cost(model, op, seqs, method=opts.get("method"), top_k=opts.get("top_k"))
    check_cost(op, cost, max_cost, "input", "send less input (or shorter sequences) per request")
    if op == "posterior" and max_posterior_entries is not None and not streaming:
        check_posterior(model, seqs, opts.get("top_k"), max_posterior_entries)
    return Prepared(model, op, opts, seqs, req, cost)


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


def body(prep: Prepared, results: list[dict]) -> dict[str, Any]:
    n = prep.num_tokens
    return {"object": "list", "model": prep.model.name, "data": results,
            "usage": {"input_tokens": n, "total_tokens": n}}


def run_direct(prep: Prepared, max_batch_tokens: int) -> dict[str, Any]:
    """Run without the batcher (batch-job workers): same ops.run the batcher calls."""
    return body(prep, ops.run(prep.model, prep.op, prep.seqs, max_batch_tokens=max_batch_tokens, **prep.opts))


def check_sample(req: SampleRequest, max_sample_tokens: int, *, model: ops.LoadedModel | None = None,
                 max_request_tokens: int | None = None, max_cost: int | None = None) -> int:
    """413 when n * max_tokens exceeds `max_sample_tokens`, the prefix's tokens `max_request_tokens`
    (counted with `model`'s tokenizer for a text prefix) or the estimated cost `max_cost`. Returns the cost
    estimate (0 without `model`)."""
    if req.n * req.max_tokens > max_sample_tokens:
        raise LimitExceeded(f"n * max_tokens = {req.n * req.max_tokens} exceeds the limit of {max_sample_tokens}",
                            param="max_tokens")
    n = prefix_tokens(model, req.prefix) if req.prefix else 0
    if max_request_tokens is not None and n > max_request_tokens:
        raise LimitExceeded(f"prefix: {n} tokens exceed the limit of {max_request_tokens} per request "
                            "(max_request_tokens)", param="prefix")
    if model is None:
        return 0
    cost = ops.operation_cost(model, "sample", n=req.n, max_tokens=req.max_tokens, prefix_tokens=n,
                              predictive=req.top_k is not None or req.top_p is not None)
    check_cost("sample", cost, max_cost, "max_tokens", "ask for fewer or shorter samples (n, max_tokens)")
    return cost


def prefix_tokens(model: ops.LoadedModel | None, prefix: str | list[int] | None) -> int:
    """Tokens of a sample prefix: ids as given, text as the model tokenises it (no <eos>)."""
    if not prefix:
        return 0
    if isinstance(prefix, list):
        return len(prefix)
    return len(model.vocab.tokenize(prefix) if model is not None else prefix.split())


def run_sample(model: ops.LoadedModel, req: SampleRequest) -> dict[str, Any]:
    """Blocking: draw the samples and shape the response body."""
    data = ops.sample(model, n=req.n, max_tokens=req.max_tokens, seed=req.seed, prefix=req.prefix,
                      temperature=req.temperature, stop_at_eos=req.stop_at_eos, stop=req.stop, top_k=req.top_k,
                      top_p=req.top_p)
    out_tokens = sum(len(d["ids"]) for d in data)
    n_prefix = prefix_tokens(model, req.prefix)
    return {"object": "list", "model": model.name, "data": data,
            "usage": {"input_tokens": n_prefix, "output_tokens": out_tokens,
                      "total_tokens": n_prefix + out_tokens}}


def cache_key(prep: Prepared) -> str:
    """model name + content hash + numerics (dtype, scoring precision, runner: `LoadedModel.numerics`) + operation
    + every option + input hash (the name is in the body)."""
    opts = prep.request.model_dump(exclude={"model", "input"})
    h_opts = hashlib.sha256(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:16]
    h_in = hashlib.sha256(json.dumps(prep.request.input, separators=(",", ":")).encode()).hexdigest()
    return (f"latentlm:cache:{prep.model.name}:{prep.model.content_hash}:{prep.model.numerics()}:{prep.op}:{h_opts}:"
            f"{h_in}")
