"""Every operation, declared once.

An `Operation` names its request model (its options, with their CLI spelling derived from the model's fields), how a
request is prepared (inputs encoded, limits and cost known before any work), how it runs, and how its answer is
shaped. REST routes (`service.routes.operations`), CLI subcommands and flags (`cli.infer`), batch-job lines
(`service.jobs`) and the OpenAPI document read `OPERATIONS`; dispatch is by this table (`Operation.run`), never by
name lookups. Adding an operation is one `register(Operation(...))` (see docs/architecture.md).

A request's life: `prepare(model, op, request) -> Call` (options with defaults filled once, support checked, inputs
encoded, cost estimated), then `op.run(call, max_batch_tokens)` (blocking; the service merges calls of `op.merge`
operations with equal options into one batched run), then `format.body(call, results)`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from latentlm.models.errors import InputError, UnsupportedOperation
from latentlm.models.results import Beam
from latentlm.ops import batching, completions, compute, constrain, cost, format, generate, inputs
from latentlm.ops.call import Call
from latentlm.ops.constrain import Limits
from latentlm.ops.model import LoadedModel
from latentlm.ops.requests import (
    Cli,
    CompletionRequest,
    ConstraintRequest,
    DecodeRequest,
    EmbedRequest,
    InputRequest,
    PosteriorRequest,
    SampleRequest,
    ScoreRequest,
)

ROUTE_ONLY = ("model", "input")  # fields that are not options of the operation itself


def _prepare_input(model: LoadedModel, op: Operation, req: BaseModel, opts: dict[str, Any], limits: Limits
                   ) -> Call:
    raw = req.input if isinstance(req.input, list) else [req.input]
    seqs = inputs.encode_inputs(model.vocab, raw)
    n = sum(len(s) for s in seqs)
    c = cost.operation_cost(model, op.name, seqs, method=opts.get("method"), top_k=opts.get("top_k"))
    return Call(model, op, opts, seqs, req, c, input_tokens=n)


def _run_input(call: Call, max_batch_tokens: int | None) -> list[dict]:
    return batching.run(call.model, call.op.name, call.seqs, max_batch_tokens=max_batch_tokens, **call.opts)


def _prepare_sample(model: LoadedModel, op: Operation, req: BaseModel, opts: dict[str, Any], limits: Limits
                    ) -> Call:
    n_prefix = generate.prefix_tokens(model, opts.get("prefix"))
    out_tokens = opts["n"] * opts["max_tokens"]
    spec = opts.pop("constraint", None)
    prepared: dict[str, Any] = {}
    if spec is not None:  # exact constrained sampling: the automaton compiled now, before any inference
        dfa, warnings = generate.compile_constraint(model, spec, opts, limits)
        prepared = {"dfa": dfa, "warnings": warnings}
    c = generate.sample_cost(model, opts, n_prefix, prepared.get("dfa"))
    return Call(model, op, opts, [], req, c, input_tokens=n_prefix, output_tokens=out_tokens, prepared=prepared,
                limits=limits)


def _run_sample(call: Call, max_batch_tokens: int | None) -> list[dict]:
    return generate.sample(call.model, **call.opts, dfa=call.prepared.get("dfa"), limits=call.limits)


def _prepare_constraint(model: LoadedModel, op: Operation, req: BaseModel, opts: dict[str, Any], limits: Limits
                        ) -> Call:
    prefix = inputs.prefix_ids(model.vocab, opts["prefix"])
    generated = constrain.generated_ids(model, opts.get("generated"))
    dfa, warnings = constrain.compile_request(model, opts.pop("constraint"), limits)
    read = len(prefix or ()) + len(generated)
    c = constrain.cost(model, dfa, guide_rows=1 if opts["weights"] else 0, beam=opts.get("beam") or 0,
                       prefix_tokens=read)
    return Call(model, op, opts, [], req, c, input_tokens=read,
                prepared={"dfa": dfa, "prefix": prefix, "generated": generated, "warnings": warnings}, limits=limits)


def _run_constraint(call: Call, max_batch_tokens: int | None) -> list[dict]:
    o, p, vocab = call.opts, call.prepared, call.model.vocab
    prob = constrain.probability(call.model, p["dfa"], p["prefix"], temperature=o["temperature"],
                                 weights=o["weights"], generated=p["generated"], limits=call.limits)
    out = format.fields(prob)
    if o.get("beam"):
        if p["generated"]:
            raise InputError("beam: searches from the prefix; leave `generated` out (or append it to the prefix)",
                             param="beam")
        found = Beam([], True, 0.0) if prob.log_prob is None else constrain.beam(
            call.model, p["dfa"], p["prefix"], width=o["beam"], n_best=o["n_best"], temperature=o["temperature"],
            limits=call.limits)
        out.update(format.beam(found, vocab, p["prefix"]))
    return [out]


def _constraint_body(call: Call, results: list[dict]) -> dict[str, Any]:
    """`{"object": "constraint", "model", "log_prob", "automaton"[, "weights"][, "completions", "certified", "gap"],
    "usage"[, "warnings"]}`."""
    return format.with_warnings(call, {"object": "constraint", "model": call.model.name, **results[0],
                                       "usage": format.usage(call, results)})


def _posterior_pieces(call: Call, positions: int, offset: int = 0) -> Iterator[dict]:
    return format.posterior_chunks(call.model, call.seqs, call.opts.get("top_k"), positions, offset=offset)


@dataclass(frozen=True)
class Operation:
    """One operation: `name` (route /v1/NAME, CLI subcommand NAME, batch endpoint /v1/NAME), `help`, its
    `request` model (options = its fields but `model`, `input`, `stream`), `prepare` and `run`.

    `supports(model)`: whether a model answers it (default: its family lists the name in `operations`); `merge`:
    requests with equal options may share one batched run (their inputs concatenated); `cache`: answers
    are cached by (model version, options, input); `generates`: output tokens are counted in `usage` and bounded by
    the service's `max_sample_tokens`; `stream`: what `"stream": true` answers, "ndjson" (pieces computed and sent
    slice by slice, `pieces`) or "sse" (one server-sent event per result); `input_field`: the field a too-long input
    is blamed on; `cli_backend`: the CLI offers the scoring engine flags (`--backend`, `--storage-dtype`);
    `refusal(model)`: the error a model `supports` refuses gets (default: UnsupportedOperation naming the operation);
    `route`: False for an operation served by a route of its own (completions: OpenAI's framing), which then has
    no generic `POST /v1/<name>` route, CLI subcommand or entry in /v1/models' `operations` (batch lines and an
    engine process take it as any other); `piece_schema`: the JSON Schema of what one streamed piece holds (an SSE
    chunk's or an NDJSON line's fields but `object` and `model`), declared in the OpenAPI document. `run` returns
    what `body` writes: per-input answers (`format`'s), or typed
    results (`models.results`) that `body` writes."""

    name: str
    help: str
    request: type[BaseModel]
    prepare: Callable[[LoadedModel, Operation, BaseModel, dict[str, Any], Limits], Call] = _prepare_input
    run: Callable[[Call, int | None], list[Any]] = _run_input
    merge: bool = True
    cache: bool = True
    generates: bool = False
    stream: str | None = None
    pieces: Callable[..., Iterator[dict]] | None = None
    input_field: str = "input"
    supports: Callable[[LoadedModel], bool] | None = None  # default: the family lists `name` in its `operations`
    cli_backend: bool = False
    advice: str = "send less input (or shorter sequences) per request"
    body: Callable[[Call, list[Any]], dict[str, Any]] = format.body  # the whole response
    refusal: Callable[[LoadedModel], Exception] | None = None
    route: bool = True
    piece_schema: dict[str, Any] | None = None  # JSON Schema of one streamed piece's fields (`format`'s schemas)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"/v1/{self.name}"

    @property
    def takes_input(self) -> bool:
        return issubclass(self.request, InputRequest)

    def options(self, model: LoadedModel, req: BaseModel) -> dict[str, Any]:
        """The keyword options `run` takes: every request field but `model`, `input` and `stream` (named as in the
        CLI), `top_k` parsed where it may say "all", and a missing decode `method` set to the family's default:
        defaults are filled here, once."""
        opts = {k: getattr(req, k) for k in type(req).model_fields if k not in ROUTE_ONLY and k != "stream"}
        if self.takes_input and "top_k" in opts:
            opts["top_k"] = inputs.parse_top_k(opts["top_k"])
        if "method" in opts and opts["method"] is None:
            opts["method"] = model.impl.default_method
        return opts


OPERATIONS: dict[str, Operation] = {}
"""name -> Operation, in the order the CLI and the API list them."""


def register(op: Operation) -> Operation:
    """Add `op` to `OPERATIONS` (replacing one of the same name); routes, CLI and batch lines built afterwards
    offer it."""
    OPERATIONS[op.name] = op
    return op


def unregister(name: str) -> None:
    OPERATIONS.pop(name, None)


def get(name: str) -> Operation:
    """The operation named `name`; InputError naming `op` for an unknown one."""
    try:
        return OPERATIONS[name]
    except KeyError:
        raise InputError(f"op: no operation {name!r}; operations: {', '.join(OPERATIONS)}", param="op") from None


def supported(model: LoadedModel, op: Operation) -> bool:
    return op.supports(model) if op.supports is not None else op.name in model.impl.operations


def describe(model: LoadedModel) -> dict[str, Any]:
    """`GET /v1/models`' entry of `model`, its `operations` those of `OPERATIONS` it answers; a model over an LM's
    tokenizer adds `vocabulary_sha256` (`ops.guide.vocabulary_sha256`: what each id spells, which a guided LM's
    tokenizer must match)."""
    out = {**model.describe(), "operations": sorted(n for n, op in OPERATIONS.items() if op.route and
                                                    supported(model, op))}
    if model.vocab.tokenizer is not None:
        from latentlm.ops.guide import vocabulary_sha256

        out["vocabulary_sha256"] = vocabulary_sha256(model.vocab.tokenizer)
    return out


def prepare(model: LoadedModel, op: Operation | str, req: BaseModel, limits: Limits = Limits()) -> Call:
    """Options (defaults filled), support checked (400 for an operation or decode method the family lacks), inputs
    encoded (a constraint compiled, within `limits`) and the cost estimated, before any work."""
    op = get(op) if isinstance(op, str) else op
    opts = op.options(model, req)
    if op.supports is not None and not op.supports(model):
        if op.refusal is not None:
            raise op.refusal(model)
        raise UnsupportedOperation(f"model {model.name!r} (family {model.family}) does not support {op.name!r}",
                                   param="model")
    if op.supports is None:
        compute.check_supported(model, op.name, opts.get("method"))
    return op.prepare(model, op, req, opts, limits)


RunCall = Callable[[Call, int | None], list[Any]]  # (call, max_batch_tokens) -> its results; raises on failure


def run_call_here(call: Call, max_batch_tokens: int | None) -> list[Any]:
    """`RunCall` in this process: the operation's own run."""
    return call.op.run(call, max_batch_tokens)


def run_merged(op: Operation, model: LoadedModel, opts: dict[str, Any], groups: list[list[list[int]]],
               max_batch_tokens: int | None, *, costs: Sequence[int] | None = None,
               run_call: RunCall = run_call_here) -> list[list[dict] | Exception]:
    """Several calls of `op` with equal `opts` (their inputs `groups`, their estimated `costs`) in one
    `run_call`; each group gets its own results (indices from 0), or its own exception when it fails alone
    (`batching.run_merged`). The merged call's cost is the sum of its groups' (an engine's batcher puts it in the
    heavy lane by it)."""
    def run_groups(indices: list[int], cap: int | None) -> list[dict]:
        seqs = [s for i in indices for s in groups[i]]
        cost = sum(costs[i] for i in indices) if costs is not None else 0
        return run_call(Call(model, op, opts, seqs, None, cost, input_tokens=sum(map(len, seqs))),
                        cap)  # no one request: several merged

    return batching.run_merged(model, op.name, groups, max_batch_tokens=max_batch_tokens, run_groups=run_groups)


def run_calls(calls: Sequence[Call], max_batch_tokens: int | None, run_call: RunCall = run_call_here) -> list[Any]:
    """Each call's results, or its exception: calls of one model version, operation and options merged into one
    `run_call` where the operation merges (`run_merged`: a call that fails alone gets its own error), the others
    (e.g. sampling) and lone calls run as they are. Batch jobs run their chunks of lines through this, in process
    or through an engine process (`run_call` sending each call there)."""
    results: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for j, c in enumerate(calls):
        if c.op.merge and c.op.takes_input:
            key = (c.model.name, c.model.content_hash, c.op.name, tuple(sorted(c.opts.items())))
            groups.setdefault(key, []).append(j)
        else:
            groups[("call", j)] = [j]
    for members in groups.values():
        if len(members) == 1:
            j = members[0]
            try:
                results[j] = run_call(calls[j], max_batch_tokens)
            except Exception as e:
                results[j] = e
            continue
        first = calls[members[0]]
        parts = run_merged(first.op, first.model, first.opts, [calls[j].seqs for j in members], max_batch_tokens,
                           costs=[calls[j].cost for j in members], run_call=run_call)
        for j, res in zip(members, parts, strict=True):
            results[j] = res
    return results


def execute(call: Call, max_batch_tokens: int | None = None) -> dict[str, Any]:
    """Run a prepared call without a batcher (CLI, batch-job workers) and shape its body."""
    return call.op.body(call, call.op.run(call, max_batch_tokens))


# -- CLI flags, derived from the request models ------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One command-line option of an operation: `argparse` `add_argument(flag, **kwargs)` filling field `name`."""

    name: str
    flag: str
    kwargs: dict[str, Any]


def _cli_marker(info: Any) -> Cli:
    return next((m for m in info.metadata if isinstance(m, Cli)), Cli())


def _scalar(annotation: Any) -> Any:
    """The first non-None scalar type inside an annotation (`int | None` -> int, `str | list[int]` -> str)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for a in args:
            if a is not type(None):
                return _scalar(a)
    if typing.get_origin(annotation) is typing.Annotated:
        return _scalar(args[0])
    return annotation


def _choices(prop: dict[str, Any]) -> list[Any] | None:
    """The values a JSON-schema property enumerates (directly or in one `anyOf` branch), else None."""
    if "enum" in prop:
        return list(prop["enum"])
    return next((list(a["enum"]) for a in prop.get("anyOf", ()) if "enum" in a), None)


def cli_flags(op: Operation) -> list[Flag]:
    """The operation's options as command-line flags: `--field-name` for each request field but `model`, `input`
    and REST-only ones; a boolean defaulting to False is a switch; one defaulting to True is a negative switch
    named by `Cli(flag=...)`; a field taking a list of values is repeatable; an enumerated one offers its choices
    (from the same JSON schema the OpenAPI document shows); help from the field's description."""
    flags = []
    props = op.request.model_json_schema()["properties"]
    for name, info in op.request.model_fields.items():
        marker = _cli_marker(info)
        if name in ROUTE_ONLY or marker.hidden:
            continue
        flag = marker.flag or "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "help": info.description}
        scalar = _scalar(info.annotation)
        default = marker.default if marker.default is not None else info.default
        if scalar is bool:
            kwargs["action"] = "store_false" if info.default else "store_true"
        else:
            many = typing.get_origin(info.annotation) in (typing.Union, types.UnionType) and any(
                typing.get_origin(a) is list and _scalar(typing.get_args(a)[0]) is str
                for a in typing.get_args(info.annotation))
            if many:
                kwargs["action"] = "append"
            elif marker.parse is not None:
                kwargs["type"] = marker.parse
            elif scalar in (int, float):
                kwargs["type"] = scalar
            choices = _choices(props.get(name, {}))
            if choices:
                kwargs["choices"] = choices
            kwargs["default"] = default
            if marker.metavar:
                kwargs["metavar"] = marker.metavar
        flags.append(Flag(name, flag, kwargs))
    return flags


# -- the operations ---------------------------------------------------------------------------------------------

register(Operation("score", "log-likelihood, perplexity and per-token log-probs", ScoreRequest, cli_backend=True))
register(Operation("posterior", "per-token state marginals", PosteriorRequest, stream="ndjson",
                   pieces=_posterior_pieces, piece_schema=format.POSTERIOR_PIECE_SCHEMA))
register(Operation("decode", "Viterbi or MBR decoding", DecodeRequest))
register(Operation("sample", "sample sentences or continuations of --prefix", SampleRequest,
                   prepare=_prepare_sample, run=_run_sample, merge=False, cache=False, generates=True, stream="sse",
                   input_field="prefix", advice="ask for fewer or shorter samples (n, max_tokens)",
                   piece_schema=format.SAMPLE_SCHEMA))
register(Operation("embed", "per-token embeddings", EmbedRequest))
register(Operation("constraint", "the probability that a continuation of --prefix satisfies a constraint "
                   "[, and each next token's weight P(C | prefix, v)]", ConstraintRequest, prepare=_prepare_constraint,
                   run=_run_constraint, merge=False, cache=False, input_field="prefix", body=_constraint_body,
                   advice="ask for fewer automaton states (a smaller constraint) or a shorter max_tokens"))
register(Operation("completions", "OpenAI completions (served by POST /v1/completions)", CompletionRequest,
                   prepare=completions.prepare, run=completions.run, merge=False, cache=False, generates=True,
                   input_field="prompt", supports=completions.supports, refusal=completions.refusal,
                   body=completions.body, advice=completions.ADVICE, route=False))
