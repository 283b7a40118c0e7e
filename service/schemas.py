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
