"""Running a family's operation over token-id sequences in length-sorted batches: its typed results
(`models.results`) in input order. `ops.format` turns them into the public JSON; `ops.batching.run` does both."""

from __future__ import annotations

from typing import Any

import torch

from latentlm.models.errors import UnsupportedOperation
from latentlm.models.family import length_batches
from latentlm.models.results import Result
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


def results(model: LoadedModel, op: str, seqs: list[list[int]], *, max_batch_tokens: int | None = None,
            **opts: Any) -> list[Result]:
    """The family's (or its attached runner's) `op_<op>` over `seqs` in length-sorted batches of at most
    `max_batch_tokens` padded tokens (None or 0: `batch_tokens` for the model's device): one typed result per
    input, in input order. A decode without `method` gets the family's default; UnsupportedOperation when the
    model lacks `op` or the method."""
    if op == "decode" and opts.get("method") is None:
        opts["method"] = default_method(model)
    check_supported(model, op, opts.get("method"))
    fn = getattr(model.runner(op), f"op_{op}")
    out: list[Result | None] = [None] * len(seqs)
    cap = batch_tokens(model.device, max_batch_tokens)
    for idx in device_batches(seqs, cap, model.device):
        for i, res in zip(idx, fn([seqs[i] for i in idx], **opts), strict=True):
            out[i] = res
    return out  # type: ignore[return-value]  # every index is in one batch
