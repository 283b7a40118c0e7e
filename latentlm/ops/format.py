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


FIELDS: dict[type, Callable[[Any, Tokens], dict[str, Any]]] = {
    Score: _score, Marginals: _marginals, SpanMarginals: _span_marginals, Path: _path, Decoded: _decoded,
    Parse: _parse, Sample: _sample, Embedding: _embedding,
}
"""Result type -> the function writing its public fields (in the order clients see them)."""


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
