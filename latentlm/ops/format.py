"""The public JSON: one place that writes it. Each typed result of a family's operation (`models.results`) has one
function writing its fields (`FIELDS`), used for whole answers (`answer`, inside `body`) and streamed pieces
(`posterior_chunks`, `chunk`) alike; `dumps` writes strict JSON (non-finite floats as null)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import orjson
import torch

from latentlm.models.results import (
    Beam,
    Completion,
    ConstraintProb,
    Continuation,
    Decoded,
    Embedding,
    Marginals,
    Parse,
    Path,
    Result,
    Sample,
    Score,
    SpanMarginals,
)
from latentlm.models.vocab import Vocabulary
from latentlm.ops import compute
from latentlm.ops.model import LoadedModel

Call = Any  # an `ops.spec.Call` (not imported: the specification imports this module)
Tokens = Callable[[], list[str]] | None  # an answer's token strings, decoded only where an answer shows them
Text = Callable[[], str] | None  # a sample's text, for a model over an LM's tokenizer (`text_of`)


# -- one result -> its public fields (each result type's JSON, written here only) ---------------------------------

def perplexity(logprob: float, num_tokens: int) -> float:
    """exp(-logprob / num_tokens); inf for probability 0 or when it overflows."""
    try:
        return math.exp(-logprob / num_tokens)
    except OverflowError:
        return math.inf


def _score(r: Score, tokens: Tokens) -> dict[str, Any]:
    """`logprob`, `num_tokens`, `perplexity`[, `token_logprobs`, `tokens` (the input's)]."""
    out: dict[str, Any] = {"logprob": r.logprob, "num_tokens": r.num_tokens,
                           "perplexity": perplexity(r.logprob, r.num_tokens)}
    if r.token_logprobs is not None:
        out["token_logprobs"] = r.token_logprobs
        if tokens is not None:
            out["tokens"] = tokens()
    return out


def _marginals(r: Marginals, tokens: Tokens) -> dict[str, Any]:
    """`marginals`: per token `{"states", "probs"}`."""
    return {"marginals": [{"states": st, "probs": pr} for st, pr in zip(r.states, r.probs, strict=True)]}


def _span_marginals(r: SpanMarginals, tokens: Tokens) -> dict[str, Any]:
    """`spans`: `{"start", "end", "prob"}` each."""
    return {"spans": [{"start": sp.start, "end": sp.end, "prob": sp.prob} for sp in r.spans]}


def _path(r: Path, tokens: Tokens) -> dict[str, Any]:
    """[`tags`,] `states`, `logprob`."""
    return {**({} if r.tags is None else {"tags": r.tags}), "states": r.states, "logprob": r.logprob}


def _decoded(r: Decoded, tokens: Tokens) -> dict[str, Any]:
    """[`tags`, `tag_probs`,] `states`[, `state_probs`], `expected_correct`."""
    out: dict[str, Any] = {} if r.tags is None else {"tags": r.tags}
    if r.tag_probs is not None:
        out["tag_probs"] = r.tag_probs
    out["states"] = r.states
    if r.state_probs is not None:
        out["state_probs"] = r.state_probs
    out["expected_correct"] = r.expected_correct
    return out


def _parse(r: Parse, tokens: Tokens) -> dict[str, Any]:
    """`tree`, `spans` ([start, end] pairs), then `logprob` (Viterbi) or `expected_correct` (MBR)."""
    out: dict[str, Any] = {"tree": r.tree, "spans": [list(sp) for sp in r.spans]}
    if r.logprob is not None:
        out["logprob"] = r.logprob
    if r.expected_correct is not None:
        out["expected_correct"] = r.expected_correct
    return out


def _sample(r: Sample, tokens: Tokens) -> dict[str, Any]:
    """[`tokens`,] `ids`, then `states` (chain families) or `tree` (PCFGs)[, `finish_reason`]."""
    out: dict[str, Any] = {} if tokens is None else {"tokens": tokens()}
    out["ids"] = r.ids
    if r.states is not None:
        out["states"] = r.states
    if r.tree is not None:
        out["tree"] = r.tree
    if r.finish_reason is not None:
        out["finish_reason"] = r.finish_reason
    return out


def _embedding(r: Embedding, tokens: Tokens) -> dict[str, Any]:
    """`embeddings` (T, d), `dim`."""
    return {"embeddings": r.embeddings, "dim": r.dim}


def _constraint_prob(r: ConstraintProb, tokens: Tokens) -> dict[str, Any]:
    """`log_prob`, `automaton`[, `weights`]."""
    out: dict[str, Any] = {"log_prob": r.log_prob, "automaton": dict(r.automaton)}
    if r.weights is not None:
        out["weights"] = r.weights
    return out


def _continuation(r: Continuation, tokens: Tokens) -> dict[str, Any]:
    """[`tokens`,] `ids`, `log_prob`, `log_prob_given`."""
    out: dict[str, Any] = {} if tokens is None else {"tokens": tokens()}
    return {**out, "ids": r.ids, "log_prob": r.log_prob, "log_prob_given": r.log_prob_given}


def _completion(r: Completion, tokens: Tokens) -> dict[str, Any]:
    """OpenAI's choice: `text`, `index`, `logprobs` (null, or `tokens`, `token_logprobs`, `top_logprobs`,
    `text_offset`[, `bytes`]), `finish_reason`."""
    return {"text": "".join(r.tokens), "index": r.index, "logprobs": _completion_logprobs(r, 0, len(r.tokens)),
            "finish_reason": r.finish_reason}


def _completion_logprobs(r: Completion, lo: int, hi: int) -> dict[str, Any] | None:
    if r.token_logprobs is None or r.top_logprobs is None or r.text_offset is None:
        return None
    out: dict[str, Any] = {"tokens": r.tokens[lo:hi], "token_logprobs": r.token_logprobs[lo:hi],
                           "top_logprobs": r.top_logprobs[lo:hi], "text_offset": r.text_offset[lo:hi]}
    if r.token_bytes is not None:
        out["bytes"] = r.token_bytes[lo:hi]
    return out


FIELDS: dict[type, Callable[[Any, Tokens], dict[str, Any]]] = {
    Score: _score, Marginals: _marginals, SpanMarginals: _span_marginals, Path: _path, Decoded: _decoded,
    Parse: _parse, Sample: _sample, Embedding: _embedding, ConstraintProb: _constraint_prob,
    Continuation: _continuation, Completion: _completion,
}
"""Result type -> the function writing its public fields (in the order clients see them)."""


# -- the JSON Schemas of what the writers write (the OpenAPI document declares streamed pieces by them) -------------
_INT = {"type": "integer", "minimum": 0}
_IDS = {"type": "array", "items": _INT}
_STRS = {"type": "array", "items": {"type": "string"}}
_NUM = {"type": ["number", "null"]}  # a non-finite float is written as null (`dumps`)


def obj(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    """A JSON object schema with exactly these properties (others refused), `required` among them."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


SAMPLE_SCHEMA = obj({"index": _INT, "tokens": _STRS, "text": {"type": "string"}, "ids": _IDS, "states": _IDS,
                     "tree": {"type": "string"}, "finish_reason": {"enum": ["stop", "eos", "length"]}}, "index", "ids")
"""One sample's answer (`answer` of a `Sample`, `samples`)."""
POSTERIOR_PIECE_SCHEMA = {"anyOf": [
    obj({"index": _INT, "offset": _INT, "marginals": {"type": "array", "items": obj(
        {"states": _IDS, "probs": {"type": "array", "items": _NUM}}, "states", "probs")}}, "index", "offset",
        "marginals"),
    obj({"index": _INT, "spans": {"type": "array", "items": obj({"start": _INT, "end": _INT, "prob": _NUM}, "start",
                                                                 "end", "prob")}}, "index", "spans")]}
"""One piece of a streamed posterior (`posterior_chunks`): a chain family's positions, or a PCFG sentence's spans."""
_LOGPROBS = obj({"tokens": _STRS, "token_logprobs": {"type": "array", "items": _NUM},
                 "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": _NUM}},
                 "text_offset": {"type": "array", "items": _INT},
                 "bytes": {"type": "array", "items": {"type": "array", "items": {**_INT, "maximum": 255}}}},
                "tokens", "token_logprobs", "top_logprobs", "text_offset")
COMPLETION_SCHEMA = obj({"text": {"type": "string"}, "index": _INT,
                         "logprobs": {"anyOf": [{"type": "null"}, _LOGPROBS]},
                         "finish_reason": {"enum": ["stop", "length", None]}},
                        "text", "index", "logprobs", "finish_reason")
"""One choice of a completion (`fields` of a `Completion`), or a piece of one (`completion_pieces`: finish_reason
null but in the last)."""


def fields(result: Result, tokens: Tokens = None, text: Text = None) -> dict[str, Any]:
    """The public JSON fields of one typed result (`FIELDS`); `tokens()` gives the token strings an answer shows
    (a sample's, or a scored input's next to its `token_logprobs`), None to leave them out; `text()` a sample's
    decoded text (`text_of`: models over an LM's tokenizer), written after its `tokens`."""
    try:
        write = FIELDS[type(result)]
    except KeyError:
        raise TypeError(f"no public fields for a {type(result).__name__}; results: "
                        f"{', '.join(t.__name__ for t in FIELDS)}") from None
    out = write(result, tokens)
    if text is not None:
        out = {**({"tokens": out.pop("tokens")} if "tokens" in out else {}), "text": text(), **out}
    return out


def answer(result: Result, index: int, tokens: Tokens = None, text: Text = None) -> dict[str, Any]:
    """One input's (or sample's) answer: `{"index", ...fields(result, tokens, text)}`."""
    return {"index": index, **fields(result, tokens, text)}


def samples(vocab: Vocabulary, draws: Sequence[Sample], prefix: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The answers of drawn samples (plain or constrained: one shape): `{"index", "tokens"[, "text"], "ids", ...}`,
    a sample's `text` (a model over an LM's tokenizer) being what it adds after `prefix`."""
    return [answer(r, i, tokens=partial(vocab.decode, r.ids), text=text_of(vocab, r.ids, prefix))
            for i, r in enumerate(draws)]


def beam(r: Beam, vocab: Vocabulary, prefix: Sequence[int] | None = None) -> dict[str, Any]:
    """The beam search's fields: `completions` (each `{"tokens"[, "text"], "ids", "log_prob", "log_prob_given"}`,
    its `text` what it adds after `prefix`), `certified`, `gap`."""
    return {"completions": [fields(c, tokens=partial(vocab.decode, c.ids), text=text_of(vocab, c.ids, prefix))
                            for c in r.completions], "certified": r.certified, "gap": r.gap}


def completion_pieces(r: Completion) -> Iterator[dict[str, Any]]:
    """A choice as streamed: the echoed prompt as one piece, one piece per completion token (with its logprobs),
    then one with its `finish_reason`; each `{"text", "index", "logprobs", "finish_reason"}` as `fields` writes the
    whole choice (their texts and logprobs, joined, are the whole choice's)."""
    spans = ([(0, r.echoed)] if r.echoed else []) + [(t, t + 1) for t in range(r.echoed, len(r.tokens))]
    for lo, hi in spans:
        yield {"text": "".join(r.tokens[lo:hi]), "index": r.index, "logprobs": _completion_logprobs(r, lo, hi),
               "finish_reason": None}
    yield {"text": "", "index": r.index, "logprobs": None, "finish_reason": r.finish_reason}


def text_of(vocab: Vocabulary, ids: Sequence[int], prefix: Sequence[int] | None = None) -> Text:
    """The `text` of a generated sequence for a model over an LM's tokenizer: a callable giving the text `ids` add
    after `prefix` (a final `<eos>` left out), decoded by the tokenizer (exact bytes: leading spaces, a character
    split across tokens, as the LM's tokenizer writes the whole text); None for a word-level model, whose answers
    show only `tokens`. O(len(prefix) + len(ids)) when called."""
    if vocab.tokenizer is None:
        return None
    body = list(ids[:-1]) if ids and ids[-1] == vocab.eos_id else list(ids)
    return partial(vocab.text, body, list(prefix or ()))


# -- responses ----------------------------------------------------------------------------------------------------


def usage(call: Call, results: list[dict]) -> dict[str, int]:
    """`usage` of a response: input tokens (a sample's prefix), plus the tokens generated for a generating
    operation."""
    n = call.input_tokens
    if call.op.generates:
        out = sum(len(r["ids"]) for r in results)
        return {"input_tokens": n, "output_tokens": out, "total_tokens": n + out}
    return {"input_tokens": n, "total_tokens": n}


def body(call: Call, results: list[dict]) -> dict[str, Any]:
    """The whole response of a call: `{"object": "list", "model", "data", "usage"[, "warnings"]}`."""
    return with_warnings(call, {"object": "list", "model": call.model.name, "data": results,
                                "usage": usage(call, results)})


def with_warnings(call: Call, out: dict[str, Any]) -> dict[str, Any]:
    """`out` with `"warnings": [...]` last when preparing the call dropped something (an excluded phrase outside the
    vocabulary); unchanged otherwise."""
    warnings = call.prepared.get("warnings")
    if warnings:
        out["warnings"] = list(warnings)
    return out


def chunk(call: Call, piece: dict) -> dict[str, Any]:
    """One streamed piece: `{"object": "<op>.chunk", "model", ...piece}`."""
    return {"object": f"{call.op.name}.chunk", "model": call.model.name, **piece}


def usage_line(call: Call, results: list[dict]) -> dict[str, Any]:
    """The last line of a stream: `{"object": "<op>.usage", "model", "usage"[, "warnings"]}`."""
    return with_warnings(call, {"object": f"{call.op.name}.usage", "model": call.model.name,
                                "usage": usage(call, results)})


def posterior_chunks(model: LoadedModel, seqs: list[list[int]], top_k: int | None, positions: int = 1024,
                     offset: int = 0) -> Iterator[dict[str, Any]]:
    """Posterior results of `seqs` in pieces, for streaming: yields dicts `{"index", "offset", "marginals"}` of
    at most `positions` tokens each (chain families; the marginals of a long sequence are computed and formatted
    piece by piece from the tensor, never all as Python objects at once) or `{"index", "spans"}` per sentence
    (PCFGs). Each piece is written by `fields`, as whole answers are: concatenating a sequence's pieces gives exactly
    `run(model, "posterior", ...)`'s answer. `offset` is added to the indices."""
    from latentlm.models.base import Batch, ChainOps, top_marginals

    compute.check_supported(model, "posterior")
    impl = model.runner("posterior")
    if not isinstance(impl, ChainOps):
        for i, r in enumerate(compute.results(model, "posterior", seqs, top_k=top_k)):
            yield answer(r, offset + i)
        return
    with torch.no_grad():
        ids, probs = impl.posterior(Batch.from_lists(seqs, impl.device))
    for i, s in enumerate(seqs):
        for t0 in range(0, len(s), positions):
            t1 = min(len(s), t0 + positions)
            states, p = top_marginals(ids[i, t0:t1], probs[i, t0:t1], top_k)  # as op_posterior
            yield {"index": offset + i, "offset": t0, **fields(Marginals(states.tolist(), p.tolist()))}
        if not s:
            yield {"index": offset + i, "offset": 0, **fields(Marginals([], []))}


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def dumps(obj: Any) -> bytes:
    """Strict JSON (UTF-8 bytes, compact); NaN and +-inf become null. orjson (it writes non-finite floats as
    null itself, and is ~20x faster than the json module on a score response); the json module for what
    orjson does not take (e.g. integers beyond 64 bits)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
