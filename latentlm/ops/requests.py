"""Request models of the operations (pydantic; unknown fields are rejected, naming the field). Integer fields (and
token ids) take what JSON Schema's `integer` admits: integers and numbers with a zero fractional part (`n: 2.0` is 2);
`312.5`, `true` and `"3"` are rejected 422 naming the field. Number fields take integers and floats, never booleans.

These models are the operations' one declaration of their options: the REST bodies, the OpenAPI document, batch-job
lines and the CLI flags (`Cli` marks a flag spelled otherwise than `--field-name`) all come from them. The schema
admits only what the service accepts: decode methods as an enum, `temperature` with `exclusiveMinimum` 0, text
inputs with at least one non-space character.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    WithJsonSchema,
    field_validator,
)

from latentlm.models import constraint as word_constraint
from latentlm.models import text_constraint
from latentlm.models.family import DECODE_METHODS
from latentlm.ops.inputs import MAX_SEED, MAX_STOP_SEQUENCES, MAX_STOP_TOKENS


def integral(v: Any) -> Any:
    """A number with a zero fractional part (`2.0`, which JSON Schema's `integer` admits) -> that integer; anything
    else unchanged (the strict integer check then rejects floats, booleans and strings)."""
    return int(v) if type(v) is float and v.is_integer() else v


JSONInt = Annotated[int, BeforeValidator(integral), Strict()]

_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def when(condition: dict[str, Any], then: dict[str, Any], *, present: tuple[str, ...] = (),
         required: tuple[str, ...] = ()) -> dict[str, Any]:
    """JSON Schema's `if`/`then` between a request's fields: where the fields of `condition` hold (those named in
    `present` given), the fields of `then` hold too (those in `required` given; the others may be left out)."""
    return {"if": {"properties": condition, "required": list(present)},
            "then": {"properties": then, "required": list(required)}}


def schema_with(*rules: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A model's `json_schema_extra`: its bounds renamed (`json_schema_bounds`) and `rules` (conditions between its
    fields, `when`) added as `allOf`."""
    def extra(schema: dict[str, Any]) -> None:
        json_schema_bounds(schema)
        schema["allOf"] = list(rules)

    return extra


def json_schema_bounds(schema: dict[str, Any]) -> None:
    """A request model's JSON Schema with its integer bounds named as JSON Schema names them: pydantic writes the
    bounds of a `JSONInt` that is optional or inside a list (behind its validator) as `ge`, `le`, ... which no
    schema reader knows (so `"prompt": [-1]` looked valid). In place, every nested schema."""
    if isinstance(schema, dict):
        for short, name in _BOUNDS.items():
            if short in schema:
                schema[name] = schema.pop(short)
        for v in schema.values():
            json_schema_bounds(v)
    elif isinstance(schema, list):
        for v in schema:
            json_schema_bounds(v)


@dataclass(frozen=True)
class Cli:
    """How a request field is spelled on the command line when `--field-name` does not fit: `flag` (e.g.
    `--no-stop` for `stop_at_eos`, which it sets False), `default` shown and parsed instead of the field's,
    `metavar`. `hidden`: the field has no flag (a REST-only option such as `stream`)."""

    flag: str | None = None
    default: Any = None
    metavar: str | None = None
    hidden: bool = False
    parse: Callable[[str], Any] | None = None  # the flag's text -> the field's value


def json_arg(text: str) -> Any:
    """A JSON-object flag (`--constraint`): a file's path, or the JSON itself."""
    import json
    from pathlib import Path

    try:
        raw = Path(text).read_text(encoding="utf-8") if not text.lstrip().startswith("{") else text
        return json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"expected a JSON object or the path of a file holding one: {e}") from None


def int_or_all(text: str) -> int | str:
    """A `--top-k` value: 'all' or an integer (range checked by the request model)."""
    return text if text == "all" else int(text)


STOP_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_STOP_TOKENS, "items": {"type": "integer", "minimum": 0}}]}},
    {"type": "null"}]}
"""What `inputs.encode_stops` takes (a text's tokens, and ids below the vocabulary's size, are the model's to say)."""
TEXT = {"type": "string", "pattern": r"\S"}  # at least one non-space character: whitespace alone has no tokens
# (the schema admits only what the service takes; the service itself answers 422 naming the item, e.g. `input[0]`)
INPUT_SCHEMA = {
    "description": "a string, a list of strings, or a list of token-id lists (ids taken as is, no <eos> added)",
    "anyOf": [TEXT, {"type": "array", "minItems": 1,
                     "items": {"anyOf": [TEXT, {"type": "array", "minItems": 1, "items": {"type": "integer"}}]}}],
}
InputField = Annotated[Any, WithJsonSchema(INPUT_SCHEMA)]
_INT = {int}


def check_input(v: Any) -> Any:
    """Structure check only; token-level checks (ids in range, unknown words, text with no tokens: 422 naming the
    item) happen in `ops.encode_inputs`."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("expected a string, a list of strings, or a list of token-id lists")
    if not v:
        raise ValueError("empty list: give at least one input")
    for i, item in enumerate(v):
        if type(item) is list and set(map(type, item)) <= _INT:  # fast path
            continue
        if isinstance(item, str):
            continue
        if not isinstance(item, list):
            raise ValueError(f"item {i} is {type(item).__name__}; expected a string or a list of token ids")
        item[:] = [integral(t) for t in item]
        for j, t in enumerate(item):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"item {i}, position {j}: token id {t!r} is not an integer")
    return v


class OperationRequest(BaseModel):
    """Fields every operation's request has: the model's id."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), json_schema_extra=json_schema_bounds)
    model: str = Field(description="model id (see GET /v1/models)", min_length=1)


class InputRequest(OperationRequest):
    """An operation over given inputs (score, posterior, decode, embed)."""

    input: InputField

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_input(v)


class ScoreRequest(InputRequest):
    token_logprobs: StrictBool = Field(False, description="add tokens and per-token log p(x_t | x_<t)")


TOP_K_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "all"}, {"type": "null"}]}


class PosteriorRequest(InputRequest):
    top_k: Annotated[Any, WithJsonSchema(TOP_K_SCHEMA), Cli(default="all", metavar="K", parse=int_or_all)] = Field(
        None, description="K most probable states per token; null or 'all' = every state")

    @field_validator("top_k")
    @classmethod
    def _k(cls, v):
        if v is None or v == "all":
            return v
        v = integral(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected a positive integer, 'all' or null, got {v!r}")
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    stream: Annotated[StrictBool, Cli(hidden=True)] = Field(
        False, description="NDJSON (application/x-ndjson): one line per sequence, or per chunk of token positions of "
                           "a long one, ending with a usage line; bounded by max_stream_entries "
                           "(LATENTLM_MAX_STREAM_ENTRIES) instead of max_posterior_entries (and by max_request_tokens "
                           "and max_request_cost). Also chosen by 'Accept: application/x-ndjson'")


METHOD_SCHEMA = {"anyOf": [{"enum": list(DECODE_METHODS)}, {"type": "null"}]}


class DecodeRequest(InputRequest):
    # any string is taken, so that a method the family lacks is answered 400 `unsupported_operation` naming the
    # methods it has; the schema admits only the methods some family has
    method: Annotated[str | None, WithJsonSchema(METHOD_SCHEMA)] = Field(
        None, description="viterbi (best path) or mbr (per-token argmax of marginals); default: the family's "
                          "`default_method` (viterbi for HMMs, mbr for PCFGs)")


class EmbedRequest(InputRequest):
    causal: StrictBool = Field(False, description="filtered (left-context) instead of smoothed embeddings")


def number(v: Any) -> Any:
    """A JSON number (integer or float), never a boolean or a string (None passes, for optional fields)."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    return v


def positive_finite(v: float) -> float:
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"must be a positive finite number, got {v!r}")
    return v


# > 0 and finite, as a JSON number; the schema says exclusiveMinimum 0 (added by each field's `json_schema_extra`)
Temperature = Annotated[float, BeforeValidator(number), AfterValidator(positive_finite)]
Probability = Annotated[float, Field(gt=0, le=1), BeforeValidator(number)]  # in (0, 1]


PHRASE = {"type": "string", "minLength": 1}  # white space alone is a phrase of a text, not of a word-level model
INCLUDE_SCHEMA = {"anyOf": [{"type": "array", "maxItems": word_constraint.MAX_GROUPS, "items": {"anyOf": [
    {"type": "array", "minItems": 1, "items": PHRASE}, PHRASE]}}, {"type": "null"}]}
WINDOW = {"maximum": word_constraint.MAX_TOKENS_LIMIT}  # above it: 413


class ConstraintSpec(BaseModel):
    """What a continuation must satisfy (`models.constraint`; for a model over an LM's tokenizer, its decoded text:
    `models.text_constraint`); a continuation is complete when it emits `<eos>`, and its length (min_tokens ..
    max_tokens) counts that `<eos>`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=json_schema_bounds)
    include: Annotated[list[list[str] | str] | None, WithJsonSchema(INCLUDE_SCHEMA)] = Field(
        None, description="groups, each a list of alternatives (a word or a space-separated phrase of the model's "
                          "vocabulary; for a model over an LM's tokenizer, text matched as a whole word, "
                          "case-sensitive); every group must appear at least once")
    ordered: StrictBool = Field(False, description="the groups' first occurrences end in the given order")
    exclude: Annotated[list[str] | None, WithJsonSchema({"anyOf": [{"type": "array", "items": PHRASE},
                                                                    {"type": "null"}]})] = Field(
        None, description="words or phrases that must not appear")
    min_tokens: JSONInt | None = Field(None, ge=1, json_schema_extra=WINDOW,
                                       description="shortest continuation, counting <eos> (default 1)")
    max_tokens: JSONInt | None = Field(None, ge=1, json_schema_extra=WINDOW,
                                       description="longest continuation, counting <eos> (default: the request's "
                                                   "max_tokens, else 32)")
    regex: str | None = Field(None, json_schema_extra={"maxLength": word_constraint.MAX_REGEX_CHARS},
                              description="a regular expression over words: vocabulary words, `.` (any word), "
                                          "`[w1 w2]`, `[^w1 w2]`, `( ) | * + ? {m,n}`, separated by spaces; for "
                                          "a model over an LM's tokenizer, a Python-style regex the decoded "
                                          "text matches in full")
    suffix: str | None = Field(None, description="the continuation ends with this phrase (before <eos>)")
    min_words: JSONInt | None = Field(None, ge=0, json_schema_extra={"maximum": text_constraint.MAX_WORDS_LIMIT},
                                      description="fewest words of the decoded text (runs of characters other than "
                                                  "ASCII white space); models over an LM's tokenizer")
    max_words: JSONInt | None = Field(None, ge=0, json_schema_extra={"maximum": text_constraint.MAX_WORDS_LIMIT},
                                      description="most words of the decoded text; models over an LM's tokenizer (a "
                                                  "word-level model's words are its tokens: max_tokens)")


ConstraintField = Annotated[ConstraintSpec, Cli(parse=json_arg, metavar="FILE.json")]


CONSTRAINED = {"constraint": {"type": "object"}}
NULL = {"type": "null"}


class SampleRequest(OperationRequest):
    model_config = ConfigDict(json_schema_extra=schema_with(when(
        CONSTRAINED, {"top_k": NULL, "top_p": NULL, "stop": NULL, "stop_at_eos": {"const": True}},
        present=("constraint",))))
    n: JSONInt = Field(1, ge=1, description="number of samples")
    max_tokens: JSONInt = Field(32, ge=1, description="tokens per sample at most")
    seed: JSONInt = Field(0, ge=0, lt=1 << 63, description="random seed in [0, 2^63) (same seed, same samples)")
    prefix: str | list[JSONInt] | None = Field(None, description="text or token ids to continue")
    temperature: Temperature = Field(1.0, json_schema_extra={"exclusiveMinimum": 0},
                               description="> 0; below 1 sharpens, above 1 flattens")
    stop_at_eos: Annotated[StrictBool, Cli(flag="--no-stop")] = Field(
        True, description="end a sample after <eos> (CLI: --no-stop sets it false)")
    top_k: JSONInt | None = Field(None, ge=1, description="draw each token from the next-token distribution cut to "
                                                           "its k most probable tokens (hmm, tagging_hmm, blocked_hmm)")
    top_p: Probability | None = Field(None, description="draw each token from the fewest most probable next "
                                                             "tokens whose mass reaches p (hmm, tagging_hmm, "
                                                             "blocked_hmm)")
    stop: Annotated[str | list[str | list[JSONInt]] | None, Cli(metavar="TEXT"), WithJsonSchema(STOP_SCHEMA)] = Field(
        None, description=f"up to {MAX_STOP_SEQUENCES} stop sequences (text or token ids): a sample ends before the "
                          "first it spells, which is left out; chain families (each sample then says its "
                          "`finish_reason`: stop, eos or length for all of them)")
    constraint: Annotated[ConstraintSpec | None, Cli(parse=json_arg, metavar="FILE.json")] = Field(
        None, description="draw exactly from p(y | prefix, y complete, y satisfies the constraint) (chain families; "
                          "every sample ends with <eos>; not combined with top_k, top_p or stop)")
    stream: Annotated[StrictBool, Cli(hidden=True)] = Field(
        False, description="server-sent events, one per sample, ending 'data: [DONE]'")


class ConstraintRequest(OperationRequest):
    """P(C | prefix): the probability that a continuation of `prefix` satisfies the constraint."""

    prefix: str | list[JSONInt] | None = Field(None, description="text or token ids the continuation follows")
    constraint: ConstraintField = Field(description="what the continuation must satisfy")
    temperature: Temperature = Field(1.0, json_schema_extra={"exclusiveMinimum": 0},
                                     description="> 0: the model tempered (start, transition and emission rows) before "
                                           "conditioning")
    weights: StrictBool = Field(False, description="add `weights`: for every token v (by id) P(C | prefix, v), the "
                                                   "factor that steers a neural LM's next-token distribution")
    beam: JSONInt | None = Field(None, ge=1, le=256, description="add `completions`: the most probable "
                                   "continuations satisfying the constraint, by a beam search of this width ranked by "
                                   "model probability x the exact lookahead P(C | prefix, h) (Ctrl-G's ranking), with "
                                   "`certified` when they are provably the most probable (not what Viterbi gives: "
                                   "that is a best state path)")
    n_best: JSONInt = Field(1, ge=1, le=256, description="how many completions the beam search returns")
    generated: Annotated[list[JSONInt] | None, Cli(hidden=True)] = Field(
        None, description="token ids of the continuation generated so far (no <eos>): counted in the constraint's "
                          "window and read by its automaton; `log_prob` and `weights` are then P(C | prefix, "
                          "generated[, v]) (a guide that asks each step)")


# -- OpenAI's completions (`ops.completions`, served by POST /v1/completions) -------------------------------------
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's completions allow 5)
MAX_PROMPTS = 1024  # prompts in one request
MAX_N = 128  # choices per prompt
DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions

NonEmptyIds = Annotated[list[Annotated[JSONInt, Field(ge=0)]], Field(min_length=1)]  # bounds: `json_schema_bounds`
Prompt = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | NonEmptyIds
          | Annotated[list[NonEmptyIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = Field(None, description="end the stream with a chunk of `choices: []` and "
                                                               "the request's `usage`")


def _finite_number(v: Any) -> Any:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    if v is not None and not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r}")
    return v


SAMPLED = {"max_tokens": {"not": {"const": 0}}}  # a completion draws (with max_tokens 0 it only scores the prompt)
COMPLETION_RULES = (
    when(CONSTRAINED, {"temperature": {"anyOf": [NULL, {"exclusiveMinimum": 0}]}}, present=("constraint",)),
    when({**CONSTRAINED, **SAMPLED}, {"top_p": {"anyOf": [NULL, {"const": 1}]}, "stop": NULL},
         present=("constraint",)),
    when({"max_tokens": {"const": 0}}, {"echo": {"const": True}}, present=("max_tokens",), required=("echo",)),
    when({"stream_options": {"type": "object"}}, {"stream": {"const": True}}, present=("stream_options",),
         required=("stream",)))


class CompletionRequest(BaseModel):
    """OpenAI's completion request. Unknown fields are refused (422 naming the field); fields latentlm cannot
    honour (suffix, best_of other than 1 or n, logit_bias, non-zero penalties) 400 naming the field."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), json_schema_extra=schema_with(*COMPLETION_RULES))
    model: str = Field(description="model id (see GET /v1/models); a chain family", min_length=1)
    prompt: Prompt = Field(description="a string, a list of strings, a token-id list, or a list of token-id lists "
                                       f"(at most {MAX_PROMPTS} prompts); \"\" samples from the start")
    max_tokens: JSONInt | None = Field(None, ge=0, description=f"tokens per choice at most (default "
                                                                 f"{DEFAULT_MAX_TOKENS}); 0 with echo scores the "
                                                                 "prompt only")
    temperature: float | None = Field(None, ge=0, description="default 1; 0 = greedy (top_k 1); applied to the "
                                                              "model's tables (ancestral) or next-token distribution")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling from the next-token distribution "
                                                              "(hmm, tagging_hmm, blocked_hmm); 1 = none")
    n: JSONInt | None = Field(None, ge=1, le=MAX_N, description="choices per prompt (default 1)")
    stop: Annotated[str | Annotated[list[str | NonEmptyIds], Field(max_length=MAX_STOP_SEQUENCES)] | None,
                    WithJsonSchema(STOP_SCHEMA)] = Field(
        None, description=f"up to {MAX_STOP_SEQUENCES} stop sequences (text or token ids); left out of the text")
    seed: JSONInt | None = Field(None, ge=0, lt=MAX_SEED, description="same seed, same choices (as "
                                                                        "/v1/sample's); default: a fresh one")
    stream: StrictBool | None = Field(None, description="server-sent `text_completion` chunks, ending "
                                                        "'data: [DONE]'")
    stream_options: StreamOptions | None = None
    logprobs: JSONInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log p of each token and of the "
                                                                               "this many most probable next tokens")
    echo: StrictBool | None = Field(None, description="the prompt before the completion, with its log-probabilities")
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0},
                               description="infilling: not supported (400) unless empty")
    best_of: JSONInt | None = Field(None, ge=1, description="only 1 or n (the choices are the samples drawn)")
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0},
                                                description="not supported (400) unless empty")
    presence_penalty: float | None = Field(None, json_schema_extra={"enum": [0, None]},
                                           description="not supported (400) unless 0")
    frequency_penalty: float | None = Field(None, json_schema_extra={"enum": [0, None]},
                                            description="not supported (400) unless 0")
    user: str | None = Field(None, description="accepted, not used")
    constraint: ConstraintSpec | None = Field(
        None, description="the constraint object of constrained generation (`extra_body` in the openai client): "
                          "each choice drawn exactly from the model conditioned on it (as /v1/sample with "
                          "`constraint`)")

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _numbers(cls, v, info):
        return _finite_number(v)
