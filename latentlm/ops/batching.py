"""Running an operation over token-id sequences in length-sorted batches, several requests merged into one run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from latentlm.models.errors import UnsupportedOperation
from latentlm.models.family import length_batches
from latentlm.ops.model import LoadedModel


def default_method(model: LoadedModel) -> str | None:
    """The decode method a request without `method` gets: the family's declared default."""
    return model.impl.default_method


def check_supported(model: LoadedModel, op: str, method: str | None = None) -> None:
    """UnsupportedOperation (400) naming what the model offers when `op` / decode `method` is not among it."""
    impl = model.impl
    if op not in impl.operations:
        raise UnsupportedOperation(
            f"model {model.name!r} (family {model.family}) does not support {op!r}; it supports "
            f"{', '.join(sorted(impl.operations)) or 'nothing'}", param="model")
    if op == "decode" and method is not None and method not in impl.decode_methods:
        if method in impl.decode_notes:
            raise UnsupportedOperation(impl.decode_notes[method], param="method")
        raise UnsupportedOperation(
            f"family {model.family} has no decode method {method!r}; use one of "
            f"{', '.join(sorted(impl.decode_methods))}", param="method")


CPU_BATCH_TOKENS = 16384  # padded tokens of one batched call on CPU (the compiled engines' sweet spot)
CUDA_BATCH_TOKENS = 1 << 18  # on CUDA: a call costs a few launches or one graph replay whatever its size, so
#                              large batches (up to `triton_chain`'s rows per graph call at 64 tokens) pay
CUDA_SPLIT_ROWS = 256  # on CUDA a length-sorted batch this large is cut where its longest would pass twice its
#                        shortest (padding to the longest costs steps), smaller ones are kept whole


def batch_tokens(device: torch.device | str, requested: int | None = None) -> int:
    """The padded-token cap of one batched call: `requested` when positive, else by device (CPU_BATCH_TOKENS,
    CUDA_BATCH_TOKENS on a GPU)."""
    if requested is not None and requested > 0:
        return int(requested)
    return CUDA_BATCH_TOKENS if torch.device(device).type == "cuda" else CPU_BATCH_TOKENS


def device_batches(seqs: list[list[int]], max_batch_tokens: int, device: torch.device | str) -> list[list[int]]:
    """Indices in length-sorted batches of at most `max_batch_tokens` padded tokens; on CUDA a batch of
    CUDA_SPLIT_ROWS+ rows is also cut where the length doubles (`length_batches`)."""
    cuda = torch.device(device).type == "cuda"
    return length_batches(seqs, max_batch_tokens, CUDA_SPLIT_ROWS if cuda else None)


def run(model: LoadedModel, op: str, seqs: list[list[int]], *, max_batch_tokens: int | None = None,
        **opts: Any) -> list[dict]:
    """Run `op` over token-id sequences in length-sorted batches; returns one dict per input in input
    order, each with `index` and the operation's fields (and `tokens` where they help). `max_batch_tokens`:
    padded tokens per batched call (None or 0: `batch_tokens` for the model's device)."""
    if op == "decode" and opts.get("method") is None:
        opts["method"] = default_method(model)
    check_supported(model, op, opts.get("method"))
    fn = getattr(model.runner(op), f"op_{op}")
    results: list[dict | None] = [None] * len(seqs)
    cap = batch_tokens(model.device, max_batch_tokens)
    for idx in device_batches(seqs, cap, model.device):
        for i, res in zip(idx, fn([seqs[i] for i in idx], **opts), strict=True):
            results[i] = res
    out = []
    for i, res in enumerate(results):
        assert res is not None
        if op == "score" and "token_logprobs" in res:
            res = {**res, "tokens": model.vocab.decode(seqs[i])}
        out.append({"index": i, **res})
    return out



def run_merged(model: LoadedModel, op: str, groups: Sequence[list[list[int]]], *,
               max_batch_tokens: int | None = None, run_seqs: Callable[[list[list[int]], int | None], list[dict]]
               | None = None, **opts: Any) -> list[list[dict] | Exception]:
    """Several requests' inputs (`groups`, each a list of token-id sequences) in one `run` (or `run_seqs(seqs,
    max_batch_tokens)`, an operation's own run); each group gets its own results renumbered from 0. When the merged
    run raises, each group runs alone, so one bad request never fails its neighbours: a group's entry is then its
    own results or its exception."""
    seqs = [s for g in groups for s in g]
    try:
        if run_seqs is not None:
            results = run_seqs(seqs, max_batch_tokens)
        else:
            results = run(model, op, seqs, max_batch_tokens=max_batch_tokens, **opts)
    except Exception as e:
        if len(groups) == 1:
            return [e]
        return [run_merged(model, op, [g], max_batch_tokens=max_batch_tokens, run_seqs=run_seqs, **opts)[0]
                for g in groups]
    out: list[list[dict] | Exception] = []
    pos = 0
    for g in groups:
        part = results[pos : pos + len(g)]
        pos += len(g)
        for j, r in enumerate(part):  # fresh dicts from run: renumber within the request in place
            r["index"] = j
        out.append(part)
    return out


def slices(costs: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of sequences whose summed cost stays <= `limit` (at least one each)."""
    out, lo, acc = [], 0, 0
    for i, c in enumerate(costs):
        if i > lo and acc + c > limit:
            out.append((lo, i))
            lo, acc = i, 0
        acc += c
    if lo < len(costs):
        out.append((lo, len(costs)))
    return out
