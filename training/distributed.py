"""Data-parallel training on `torch.distributed`, launched by `torchrun` (gloo on CPU, NCCL on CUDA).

A trainer asks `world(device)` for its `World`: rank, world size, the device of this rank, and the few collectives
training needs. Run as one plain process (no `WORLD_SIZE` in the environment, or 1) the world has one rank and
every collective returns its input: the single-process code path is the distributed one with W = 1.

What stays fixed whatever the world size (`docs/distributed.md`): the global batch is the config's and is split
by rows across the ranks (`World.rows`); each rank back-propagates its rows' share of the global loss (divided
by the global token count) and the gradients are summed (`World.sum_gradients`), so the update equals the
one-process update up to float summation order; EM trainers sum their expected counts (`World.sum_`). Every rank
draws the same random numbers (same seed: state dropout masks, dropout), rank 0 alone evaluates (the result is
broadcast so every rank takes the same LR decay and stopping decisions), writes checkpoints, curves and the
artifact. A stop (time limit, Ctrl-C, early stopping) is agreed by all ranks (`World.any`), so none is left
waiting in a collective; a rank that raises exits, and torchrun stops the others (its agent tears the group down
when one worker fails) and reports the failing rank.

Costs: one all-reduce of all gradients per step (one flat buffer: O(parameters) bytes each way), one of a flag,
and for EM one all-reduce of the counts per pass (O(Z (Z + V)) float64).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from latentlm.models.base import Batch
from latentlm.models.errors import InputError

T = TypeVar("T")
COMMUNICATION = {"seconds": 0.0, "calls": 0}
"""Wall time this process spent in the all-reduces of gradients and counts (the share of a step the bench and the
manifest report; the wait for a slower rank counts in it)."""
TIMEOUT_ENV = "LATENTLM_DIST_TIMEOUT_MINUTES"
"""How long a collective may wait for the other ranks (default 60 minutes: rank 0 alone evaluates and exports, a
2^15-state export takes minutes) before the group fails with an error instead of hanging."""


@dataclass(frozen=True)
class World:
    """This process's place in the training job: `rank` of `size`, `local_rank` on its machine, `device` it
    trains on and whether a process group is up (`distributed`)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False

    @property
    def main(self) -> bool:
        """Rank 0: the one that evaluates, logs and writes."""
        return self.rank == 0

    # -- splitting work -------------------------------------------------------------------------------------
    def share(self, n: int) -> slice:
        """This rank's contiguous share of `n` rows: [r n / W, (r + 1) n / W) (sizes differ by at most one)."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows of a global batch, cut to their longest row (padding columns change nothing)."""
        if self.size == 1:
            return batch
        part = self.share(batch.ids.shape[0])
        lengths = batch.lengths[part]
        T = int(lengths.max()) if lengths.numel() else 0
        return Batch(batch.ids[part, :T], lengths)

    def mine(self, items: Iterable[T]) -> Iterable[T]:
        """Every W-th item from this rank's index on (round-robin: shards, batches of an E-step)."""
        return (x for i, x in enumerate(items) if i % self.size == self.rank)

    # -- collectives (identity for one process) ---------------------------------------------------------------
    def sum_(self, *tensors: Tensor) -> None:
        """In place: each tensor becomes the sum of its copies over the ranks (EM's expected counts)."""
        if self.distributed:
            tick = time.perf_counter()
            for t in tensors:
                if t.device != self.device and self.device.type == "cuda":  # NCCL reduces device memory only
                    on_device = t.to(self.device)
                    dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
                    t.copy_(on_device)
                else:
                    dist.all_reduce(t, op=dist.ReduceOp.SUM)
            _count(tick)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """The sums over the ranks of a few numbers (float64)."""
        return self._reduce_floats(values, dist.ReduceOp.SUM)

    def max_floats(self, values: Sequence[float]) -> list[float]:
        """The largest over the ranks of a few numbers (float64)."""
        return self._reduce_floats(values, dist.ReduceOp.MAX)

    def _reduce_floats(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in one flat all-reduce per dtype (a parameter without a
        gradient counts as zeros and gets the sum). Each rank's loss must already be its share of the global loss
        (its rows' loss over the global token count)."""
        if not self.distributed:
            return
        tick = time.perf_counter()
        params = list(parameters)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.grad.dtype for p in params}, key=str):
            grads = [p.grad for p in params if p.grad.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        _count(tick)

    def any(self, flag: bool) -> bool:
        """Whether any rank says `flag` (a stop every rank must take together)."""
        if not self.distributed:
            return bool(flag)
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0

    def broadcast_floats(self, values: Sequence[float]) -> list[float]:
        """Rank 0's numbers, on every rank (an evaluation only rank 0 ran)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def broadcast_choice(self, choice: str, options: Sequence[str]) -> str:
        """Rank 0's pick among `options` (all ranks then compute alike, e.g. with one GEMM library)."""
        if not self.distributed:
            return choice
        index = self.broadcast_floats([float(list(options).index(choice)) if self.main else 0.0])[0]
        return list(options)[int(index)]

    def broadcast_(self, *tensors: Tensor) -> None:
        """In place: rank 0's values of these tensors on every rank."""
        if self.distributed:
            for t in tensors:
                dist.broadcast(t, src=0)

    def gather_rows(self, t: Tensor) -> Tensor:
        """The rows every rank holds, concatenated in rank order (each rank holds the same number of rows)."""
        if not self.distributed:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _count(since: float) -> None:
    COMMUNICATION["seconds"] += time.perf_counter() - since
    COMMUNICATION["calls"] += 1


def communication() -> dict[str, float]:
    """What the manifest records of the collectives: their count and seconds (rounded)."""
    return {"allreduce_calls": COMMUNICATION["calls"], "allreduce_seconds": round(COMMUNICATION["seconds"], 3)}


_WORLD: World | None = None


def launched_size() -> int:
    """The world size torchrun set for this process (1 without torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world(device: str = "cpu") -> World:
    """This process's `World`, joining the process group on first call when torchrun launched more than one rank
    (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT` from its rendezvous): NCCL when the trainer
    asks for CUDA (rank r on `cuda:LOCAL_RANK`), else gloo. `device` is the trainer's --device ("auto", "cpu",
    "cuda", "cuda:N"). One process: a world of one on that device."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    want = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                        ("cpu" if device == "auto" else device))
    size = launched_size()
    if size == 1:  # nothing to join: a world of one on the device asked for (not kept: the next run may ask another)
        return World(device=want)
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if want.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device here", param="device")
        want = torch.device("cuda", local)
        torch.cuda.set_device(want)
    backend = "nccl" if want.type == "cuda" else "gloo"
    minutes = float(os.environ.get(TIMEOUT_ENV, "60"))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=minutes),
                                **({"device_id": want} if want.type == "cuda" else {}))
    _WORLD = World(rank, dist.get_world_size(), local, want, True)
    return _WORLD


def close() -> None:
    """Leave the process group (every rank, after its last collective)."""
    global _WORLD
    if _WORLD is not None and _WORLD.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _WORLD = None
    COMMUNICATION.update(seconds=0.0, calls=0)
