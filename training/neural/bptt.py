"""Training over running text (`--bptt`): the corpus as streams cut into chunks, the carried state a checkpoint
keeps, and the sentence start of a model trained that way (the state distribution after `<eos>`)."""

from __future__ import annotations

import torch
from torch import Tensor

from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM, Carried
from latentlm.models.errors import InputError
from latentlm.training import common
from latentlm.training.neural.networks import EXPORT_ROWS, VLHMM


def bptt_batches(seqs: list[list[int]], streams: int, chunk: int, device, start: int = 0) -> list[Batch]:
    """The concatenated corpus, read from token `start` on (wrapping around), split into `streams` running
    streams and cut into chunks of `chunk` tokens: consecutive batches continue each stream (carry the posterior
    between them)."""
    flat = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long)
    flat = flat.roll(-start)
    n = len(flat) // streams
    if n == 0:
        raise InputError(f"--batch {streams}: {streams} BPTT streams need at least {streams} training tokens, the "
                         f"training data has {len(flat)}", param="batch")
    flat = flat[: n * streams].view(streams, n)
    out = []
    for i in range(0, n, chunk):
        ids = flat[:, i : i + chunk]
        out.append(Batch(ids.to(device), torch.full((streams,), ids.shape[1], dtype=torch.long, device=device)))
    return out



def fix_start_for_streams(model: VLHMM, tensors: dict[str, Tensor], seqs: list[list[int]], eos: int | None
                          ) -> dict[str, Tensor]:
    """After BPTT training the sentence start is p(z | previous token <eos>): average the filtered
    posterior at <eos> over (up to 2,000) training sentences and push it through the transitions."""
    if eos is None:
        return tensors
    device = tensors["trans"].device
    impl = BlockedHMM.from_tensors(tensors, {"num_clusters": model.M}, device=device)
    sample = [s for s in seqs[:2000] if s and s[-1] == eos]
    if not sample:
        return tensors
    acc = torch.zeros(impl.num_states, dtype=torch.float64, device=device)
    for b in common.bucket_batches(sample, 256, device=device):
        last = impl.filtered_last(b).double()  # (B, k) in <eos>'s cluster
        ids = impl.state_ids(b)[torch.arange(len(b.lengths)), b.lengths - 1]
        acc.index_add_(0, ids.reshape(-1), last.reshape(-1))
    weights, trans = acc / acc.sum(), tensors["trans"]
    start = sum(weights[i:i + EXPORT_ROWS] @ trans[i:i + EXPORT_ROWS].double()  # a float64 copy of trans is 8 GiB
                for i in range(0, len(weights), EXPORT_ROWS))                       # at 2^15: by row blocks
    return {**tensors, "start": (start / start.sum()).float()}




def carry_from_checkpoint(tensors: dict[str, Tensor], device: torch.device | str) -> Carried | None:
    """The BPTT carry a checkpoint holds: `carry` (B, k) with its `carry_cluster` (B,), or from a checkpoint
    written before the carry was kept by cluster, `carry` (B, M, k) over every cluster (mass in one of them)."""
    state = tensors.get("carry")
    if state is None:
        return None
    if "carry_cluster" in tensors:
        return Carried(state.to(device), tensors["carry_cluster"].long().to(device))
    cluster = state.sum(2).argmax(1)
    return Carried(state[torch.arange(state.shape[0]), cluster].to(device), cluster.to(device))
