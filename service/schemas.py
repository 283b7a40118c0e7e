"""Request bodies of the operation endpoints (pydantic; unknown fields are rejected, naming the field). Integer
fields take JSON integers only (`n: 312.0` and `true` are rejected 422 naming the field, as token ids are); number
fields take integers and floats, never booleans. `ERROR_SCHEMA`: the error body every route answers errors with.

Option names and meanings follow the CLI: `token_logprobs`; `top_k` (null or "all" = every state);
`method` viterbi|mbr; `n`, `max_tokens`, `seed`, `prefix`, `temperature`, `stop_at_eos`; `causal`."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema, field_validator

from latentlm.models.family import OPERATIONS
from latentlm.ops import MAX_STOP_SEQUENCES

INPUT_SCHEMA = {
    "description": "a string, a list of strings, or a list of token-id lists (ids taken as is, no <eos> added)",
    "anyOf": [{"type": "string"},
              {"type": "array", "minItems": 1,
               "items": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}],
}
InputField = Annotated[Any, WithJsonSchema(INPUT_SCHEMA)]
_INT = {int}


def check_input(v: Any) -> Any:
    """Structure check only; token-level checks (ids in range, unknown words) happen in ops.encode_inputs."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("expected a string, a list of strings, or a list of token-id lists")
    if not v:
        raise ValueError("empty list: give at least one input")
    for i, item in enumerate(v):
        if isinstance(item, str) or (type(item) is list and set(map(type, item)) <= _INT):  # fast path
            continue
        if not isinstance(item, list):
            raise ValueError(f"item {i} is {type(item).__name__}; expected a string or a list of token ids")
        for j, t in enumerate(item):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"item {i}, position {j}: token id {t!r} is not an integer")
    return v


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = Field(description="model id (see GET /v1/models)", min_length=1)


class _WithInput(_Base):
    input: InputField

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_input(v)


class ScoreRequest(_WithInput):
    token_logprobs: StrictBool = Field(False, description="add tokens and per-token log p(x_t | x_<t)")


class PosteriorRequest(_WithInput):
    top_k: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"const": "all"},
                                                     {"type": "null"}]})] = Field(
        None, description="K most probable states per token; null or 'all' = every state")

    @field_validator("top_k")
    @classmethod
    def _k(cls, v):
        if v is None or v == "all":
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected a positive integer, 'all' or null, got {v!r}")
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    stream: StrictBool = Field(False, description="NDJSON (application/x-ndjson): one line per sequence, or per "
                                                  "chunk of token positions of a long one, ending with a usage line; "
                                                  "not bounded by max_posterior_entries (the request still is by "
                                                  "max_request_tokens and max_request_cost). Also chosen by "
                                                  "'Accept: application/x-ndjson'")


class DecodeRequest(_WithInput):
    method: str | None = Field(None, description="viterbi (best path) or mbr (per-token argmax of marginals); "
                                                 "default: the family's `default_method` (viterbi for HMMs, mbr "
                                                 "for PCFGs)")


class EmbedRequest(_WithInput):
    causal: StrictBool = Field(False, description="filtered (left-context) instead of smoothed embeddings")


class SampleRequest(_Base):
    n: StrictInt = Field(1, ge=1, description="number of samples")
    max_tokens: StrictInt = Field(32, ge=1, description="tokens per sample at most")
    seed: StrictInt = Field(0, ge=0, lt=1 << 63, description="random seed in [0, 2^63) (same seed, same samples)")
    prefix: str | list[StrictInt] | None = Field(None, description="text or token ids to continue")
    temperature: float = Field(1.0, description="> 0; below 1 sharpens, above 1 flattens")
    stop_at_eos: StrictBool = Field(True, description="end a sample after <eos>")
    top_k: StrictInt | None = Field(None, ge=1, description="draw each token from the next-token distribution cut to "
                                                           "its k most probable tokens (hmm, tagging_hmm, blocked_hmm)")
    top_p: float | None = Field(None, gt=0, le=1, description="draw each token from the fewest most probable next "
                                                             "tokens whose mass reaches p (hmm, tagging_hmm, "
                                                             "blocked_hmm)")
    stop: str | list[str | list[StrictInt]] | None = Field(
        None, description=f"up to {MAX_STOP_SEQUENCES} stop sequences (text or token ids): a sample ends before the "
                          "first it spells, which is left out; chain families (each sample then says its "
                          "`finish_reason`: stop, eos or length for all of them)")
    stream: StrictBool = Field(False, description="server-sent events, one per sample, ending 'data: [DONE]'")

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _t_type(cls, v, info):
        if v is None and info.field_name == "top_p":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
        return v

    @field_validator("temperature")
    @classmethod
    def _t(cls, v):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"must be a positive finite number, got {v!r}")
        return v


REQUESTS: dict[str, type[_Base]] = {"score": ScoreRequest, "posterior": PosteriorRequest, "decode": DecodeRequest,
                                    "sample": SampleRequest, "embed": EmbedRequest}
assert tuple(REQUESTS) == tuple(sorted(REQUESTS, key=OPERATIONS.index)) and set(REQUESTS) == set(OPERATIONS)


ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "the field at fault"},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}
