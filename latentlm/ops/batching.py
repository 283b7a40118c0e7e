"""Running an operation over token-id sequences in length-sorted batches (`ops.compute`) and shaping each answer
(`ops.format`); several requests merged into one run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from latentlm.ops import compute, format
from latentlm.ops.model import LoadedModel


def run(model: LoadedModel, op: str, seqs: list[list[int]], *, max_batch_tokens: int | None = None,
        **opts: Any) -> list[dict]:
    """Run `op` over token-id sequences in length-sorted batches; returns one dict per input in input
    order, each with `index` and the operation's fields (and `tokens` where they help: `format.answer`).
    `max_batch_tokens`: padded tokens per batched call (None or 0: `batch_tokens` for the model's device)."""
    res = compute.results(model, op, seqs, max_batch_tokens=max_batch_tokens, **opts)
    return [format.answer(r, i, tokens=partial(model.vocab.decode, seqs[i])) for i, r in enumerate(res)]


def run_merged(model: LoadedModel, op: str, groups: Sequence[list[list[int]]], *,
               max_batch_tokens: int | None = None,
               run_groups: Callable[[list[int], int | None], list[dict]] | None = None,
               **opts: Any) -> list[list[dict] | Exception]:
    """Several requests' inputs (`groups`, each a list of token-id sequences) in one `run` (or `run_groups(indices,
    max_batch_tokens)`, an operation's own run of the sequences of the groups at those indices, in order); each
    group gets its own results renumbered from 0. When the merged run raises, each group runs alone, so one bad
    request never fails its neighbours: a group's entry is then its own results or its exception."""
    def run_here(indices: list[int], cap: int | None) -> list[dict]:
        return run(model, op, [s for i in indices for s in groups[i]], max_batch_tokens=cap, **opts)

    run_these = run_groups or run_here

    def run_part(indices: list[int]) -> list[list[dict] | Exception]:
        results = run_these(indices, max_batch_tokens)
        out: list[list[dict] | Exception] = []
        pos = 0
        for i in indices:
            part = results[pos : pos + len(groups[i])]
            pos += len(groups[i])
            for j, r in enumerate(part):  # fresh dicts from run: renumber within the request in place
                r["index"] = j
            out.append(part)
        return out

    try:
        return run_part(list(range(len(groups))))
    except Exception as e:
        if len(groups) == 1:
            return [e]
    alone: list[list[dict] | Exception] = []
    for i in range(len(groups)):
        try:
            alone.append(run_part([i])[0])
        except Exception as e:
            alone.append(e)
    return alone


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
