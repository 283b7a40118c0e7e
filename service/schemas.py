"""The error body every route answers errors with (`ERROR_SCHEMA`), and the operations' request models, which are
declared in the operations layer (`latentlm.ops.requests`, named by `latentlm.ops.spec`) and re-exported here."""

from __future__ import annotations

from typing import Any

from latentlm.ops.requests import (
    INPUT_SCHEMA,
    DecodeRequest,
    EmbedRequest,
    InputField,
    OperationRequest,
    PosteriorRequest,
    SampleRequest,
    ScoreRequest,
    check_input,
)
from latentlm.ops.spec import OPERATIONS


def requests() -> dict[str, type]:
    """operation name -> its request model, for every operation declared now."""
    return {name: op.request for name, op in OPERATIONS.items()}


REQUESTS = requests()  # the built-in operations' request models

__all__ = ["INPUT_SCHEMA", "DecodeRequest", "EmbedRequest", "InputField", "OperationRequest", "PosteriorRequest",
           "SampleRequest", "ScoreRequest", "check_input", "ERROR_SCHEMA", "REQUESTS", "requests"]


ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "the field at fault"},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}


# -- streamed bodies: each event or line as it is sent -------------------------------------------------------------
# OpenAPI 3.1 has no keyword for the items of a stream (3.2's `itemSchema`); as schema checkers read a 3.1 document
# (schemathesis), a `text/event-stream` or `application/x-ndjson` entry's `schema` describes one event or one line.
def sse_event(*payloads: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event as sent: `data` is the JSON of one of `payloads`, or the closing `[DONE]`."""
    content = payloads[0] if len(payloads) == 1 else {"anyOf": list(payloads)}
    return {"type": "object", "required": ["data"], "additionalProperties": False, "properties": {
        "event": {"const": "message"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                 "contentSchema": content}]}}}


def chunk(op: str, piece: dict[str, Any] | None) -> dict[str, Any]:
    """`{"object": "<op>.chunk", "model", ...piece}` (`ops.format.chunk`); any fields where `piece` is None."""
    head = {"object": {"const": f"{op}.chunk"}, "model": {"type": "string"}}
    if piece is None:
        return {"type": "object", "required": ["object", "model"], "properties": head}
    if "anyOf" in piece:
        return {"anyOf": [chunk(op, p) for p in piece["anyOf"]]}
    return {**piece, "properties": {**head, **piece["properties"]}, "required": [*head, *piece["required"]]}


def usage_line(op: str, generates: bool) -> dict[str, Any]:
    """`{"object": "<op>.usage", "model", "usage"[, "warnings"]}` (`ops.format.usage_line`)."""
    count = {"type": "integer", "minimum": 0}
    usage = {"input_tokens": count, **({"output_tokens": count} if generates else {}), "total_tokens": count}
    return {"type": "object", "additionalProperties": False, "required": ["object", "model", "usage"], "properties": {
        "object": {"const": f"{op}.usage"}, "model": {"type": "string"},
        "usage": {"type": "object", "additionalProperties": False, "required": list(usage), "properties": usage},
        "warnings": {"type": "array", "items": {"type": "string"}}}}
