"""The public JSON: one place that writes it (strict JSON, non-finite floats as null)."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import torch

from latentlm.ops.batching import check_supported, run
from latentlm.ops.model import LoadedModel

Call = Any  # an `ops.spec.Call` (not imported: the specification imports this module)


def usage(call: Call, results: list[dict]) -> dict[str, int]:
    """`usage` of a response: input tokens (a sample's prefix), plus the tokens generated for a generating
    operation."""
    n = call.input_tokens
    if call.op.generates:
        out = sum(len(r["ids"]) for r in results)
        return {"input_tokens": n, "output_tokens": out, "total_tokens": n + out}
    return {"input_tokens": n, "total_tokens": n}


def body(call: Call, results: list[dict]) -> dict[str, Any]:
    """The whole response of a call: `{"object": "list", "model", "data", "usage"}`."""
    return {"object": "list", "model": call.model.name, "data": results, "usage": usage(call, results)}


def chunk(call: Call, piece: dict) -> dict[str, Any]:
    """One streamed piece: `{"object": "<op>.chunk", "model", ...piece}`."""
    return {"object": f"{call.op.name}.chunk", "model": call.model.name, **piece}


def usage_line(call: Call, results: list[dict]) -> dict[str, Any]:
    """The last line of a stream: `{"object": "<op>.usage", "model", "usage"}`."""
    return {"object": f"{call.op.name}.usage", "model": call.model.name, "usage": usage(call, results)}


def posterior_chunks(model: LoadedModel, seqs: list[list[int]], top_k: int | None, positions: int = 1024,
                     offset: int = 0):
    """Posterior results of `seqs` in pieces, for streaming: yields dicts `{"index", "offset", "marginals"}` of
    at most `positions` tokens each (chain families; the marginals of a long sequence are formatted piece by
    piece from the tensor, never all as Python objects at once) or `{"index", "spans"}` per sentence (PCFGs).
    Concatenating a sequence's pieces gives exactly `run(model, "posterior", ...)`'s answer. `offset` is added
    to the indices."""
    from latentlm.models.base import Batch, ChainOps

    check_supported(model, "posterior")
    impl = model.runner("posterior")
    if not isinstance(impl, ChainOps):
        for r in run(model, "posterior", seqs, top_k=top_k):
            r["index"] += offset
            yield r
        return
    with torch.no_grad():
        ids, probs = impl.posterior(Batch.from_lists(seqs, impl.device))
    K = probs.shape[-1]
    k = K if top_k is None else min(top_k, K)
    for i, s in enumerate(seqs):
        for t0 in range(0, len(s), positions):
            t1 = min(len(s), t0 + positions)
            p, j = probs[i, t0:t1].topk(k, dim=-1)  # as op_posterior: sorted by probability
            states = ids[i, t0:t1].gather(-1, j)
            p, states = p.double().cpu().tolist(), states.cpu().tolist()
            yield {"index": offset + i, "offset": t0,
                   "marginals": [{"states": st, "probs": pr} for st, pr in zip(states, p, strict=True)]}
        if not s:
            yield {"index": offset + i, "offset": 0, "marginals": []}



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
