"""`hmm` by Baum-Welch (EM) over the chain engine: E-step `models.chain.expected_counts`, closed-form
M-step. Each iteration costs O(N Z^2) for N training tokens and never decreases the training likelihood
(with `smoothing=0`; a pseudo-count turns it into MAP-EM, monotone in the smoothed objective)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.registry import save_artifact
from latentlm.models.vocab import Vocabulary
from latentlm.training import common, distributed
from latentlm.training.data import load_training_split
from latentlm.training.recipes import trainer

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings


@dataclass
class HMMParams:
    """start (Z,), trans (Z, Z) and emit (Z, V), all row-stochastic."""

    start: Tensor
    trans: Tensor
    emit: Tensor

    def tensors(self) -> dict[str, Tensor]:
        return {"start": self.start, "trans": self.trans, "emit": self.emit}

    def score(self, batch: Batch) -> Tensor:
        """log p(x) per sequence (B,) via the chain engine. O(B T Z^2)."""
        emit_by_word = self.emit.T
        log_cond, _ = chain.forward(self.start.expand(batch.ids.shape[0], -1), emit_by_word[batch.ids],
                                    self.trans, batch.lengths)
        return log_cond.sum(1)


def unigram(seqs: list[list[int]], V: int) -> Tensor:
    """Add-one unigram distribution (V,) of the training tokens. O(N)."""
    counts = torch.ones(V, dtype=torch.float64)
    for s in seqs:
        counts.index_add_(0, torch.as_tensor(s), torch.ones(len(s), dtype=torch.float64))
    return counts / counts.sum()


def init_params(Z: int, uni: Tensor, generator: torch.Generator, noise: float = 1.0,
                dtype: torch.dtype = torch.float32) -> HMMParams:
    """Random start: trans rows softmax(noise * N(0,1)); emission rows = unigram * exp(noise * N(0,1)),
    renormalised, so every state starts close to the unigram model. O(Z (Z + V))."""
    V = uni.shape[0]
    trans = torch.softmax(noise * torch.randn(Z, Z, generator=generator, dtype=torch.float64), 1)
    start = torch.softmax(noise * torch.randn(Z, generator=generator, dtype=torch.float64), 0)
    emit = uni[None] * torch.exp(noise * torch.randn(Z, V, generator=generator, dtype=torch.float64))
    emit = emit / emit.sum(1, keepdim=True)
    return HMMParams(start.to(dtype), trans.to(dtype), emit.to(dtype))


@dataclass
class Counts:
    """Expected sufficient statistics (float64) and the log-likelihood they came from."""

    start: Tensor
    trans: Tensor
    emit: Tensor
    loglik: float
    tokens: int


def e_step(p: HMMParams, batches: list[Batch], on_batch=None, *, start: int = 0, partial: Counts | None = None,
           every: int = 0, on_checkpoint: Callable[[int, Counts], None] | None = None,
           world: distributed.World | None = None) -> Counts:
    """Accumulate expected start / transition / emission counts over `batches`. O(N Z^2).
    `start`, `partial`: continue a pass after its first `start` batches from their counts (a resume);
    `on_checkpoint(done, counts so far)` is called after every `every` batches (not after the last).
    Data-parallel (`world` of W ranks): rank r takes batches r, r + W, ...; the counts handed to `on_checkpoint`
    and returned are the sums over the ranks (`partial` is given on rank 0 only, the others start at zero)."""
    world = world or distributed.World()
    Z, V = p.emit.shape
    cs = torch.zeros(Z, dtype=torch.float64)
    ct = torch.zeros(Z, Z, dtype=torch.float64)
    ce = torch.zeros(V, Z, dtype=torch.float64)
    ll, n = 0.0, 0
    if partial is not None:
        cs, ct, ce = partial.start.double().clone(), partial.trans.double().clone(), partial.emit.double().T.clone()
        ll, n = partial.loglik, partial.tokens
    emit_by_word = p.emit.T.contiguous()
    with torch.no_grad():
        for bi in range(start, len(batches)):
            if on_checkpoint is not None and every and bi > start and bi % every == 0:
                on_checkpoint(bi, _summed(world, Counts(cs, ct, ce.T, ll, n), copy=True))
            if bi % world.size != world.rank:
                continue
            b = batches[bi]
            init = p.start.expand(b.ids.shape[0], -1)
            gamma, s, xi, log_cond = chain.expected_counts(init, emit_by_word[b.ids], p.trans, b.lengths)
            cs += s.double()
            ct += xi.double()
            mask = b.mask
            ce.index_add_(0, b.ids[mask], gamma[mask].double())
            bl = float(log_cond.double().sum())
            ll += bl
            ntok = int(b.lengths.sum())
            n += ntok
            if on_batch is not None:
                on_batch(ntok * world.size, -bl / ntok)
    return _summed(world, Counts(cs, ct, ce.T.contiguous(), ll, n))


def _summed(world: distributed.World, c: Counts, copy: bool = False) -> Counts:
    """`c` summed over the ranks (in place unless `copy`; one process: `c` itself, or a copy)."""
    if copy:
        c = Counts(c.start.clone(), c.trans.clone(), c.emit.clone(), c.loglik, c.tokens)
    world.sum_(c.start, c.trans, c.emit)
    c.loglik, tokens = world.sum_floats([c.loglik, c.tokens])
    c.tokens = int(tokens)
    return c


def _normalise(counts: Tensor, fallback: Tensor, smoothing: float) -> Tensor:
    """Rows of counts + smoothing, normalised; rows with no mass keep `fallback`'s row."""
    c = counts + smoothing
    tot = c.sum(-1, keepdim=True)
    return torch.where(tot > 0, c / tot.clamp_min(1e-300), fallback.double())


def m_step(c: Counts, old: HMMParams, smoothing: float = 0.0) -> HMMParams:
    """Closed-form maximisation (MAP with a symmetric pseudo-count `smoothing`). O(Z (Z + V))."""
    dt = old.trans.dtype
    start = _normalise(c.start[None], old.start[None], smoothing)[0]
    return HMMParams(start.to(dt), _normalise(c.trans, old.trans, smoothing).to(dt),
                     _normalise(c.emit, old.emit, smoothing).to(dt))


def baum_welch(p: HMMParams, batches: list[Batch], iterations: int, smoothing: float = 0.0
               ) -> tuple[HMMParams, list[float]]:
    """Run EM; returns the final parameters and the training log-likelihood before each M-step."""
    lls = []
    for _ in range(iterations):
        c = e_step(p, batches)
        lls.append(c.loglik)
        p = m_step(c, p, smoothing)
    return p, lls


def export(store: Path, name: str, p: HMMParams, vocab: Vocabulary, *, provenance: dict,
           extra_files: dict[str, bytes] | None = None, extra_tensors: dict[str, Tensor] | None = None,
           config_extra: dict | None = None) -> Path:
    """Write `p` as an `hmm` artifact (rows renormalised in float64 so the store's 1e-4 check holds)."""
    def norm(t: Tensor) -> Tensor:
        t = t.double().clamp_min(0)
        return (t / t.sum(-1, keepdim=True)).float()

    tensors = {"start": norm(p.start), "trans": norm(p.trans), "emit": norm(p.emit), **(extra_tensors or {})}
    config = {"num_states": int(p.trans.shape[0]), **(config_extra or {})}
    return save_artifact(store, name, "hmm", tensors, vocab, config=config, provenance=provenance,
                         extra_files=extra_files)


def load_partial(tensors: dict[str, Tensor], state: dict) -> tuple[Counts | None, int]:
    """The counts of a checkpoint taken inside an E-step pass and the number of batches they cover."""
    if not state.get("batch"):
        return None, 0
    return Counts(tensors["partial_start"], tensors["partial_trans"], tensors["partial_emit"],
                  float(state["partial_loglik"]), int(state["partial_tokens"])), int(state["batch"])


@trainer("hmm", data_parallel=True)
def train(ns: TrainSettings) -> Path:
    """`latentlm train --family hmm`: EM for `--epochs` iterations (or `--max-steps`), early stopping on
    validation perplexity with `--patience`, checkpoint after every iteration (and every
    `--checkpoint-every` E-step batches, with the partial counts), export of the best. Under torchrun the
    E-step's batches are shared round-robin and the counts summed; rank 0 evaluates and writes."""
    common.check_resume(ns)
    t0 = time.perf_counter()
    world = distributed.world(ns.device)
    gen = common.seed_all(ns.seed)
    device = world.device
    vocab, train_seqs, valid_seqs = load_training_split(ns)
    batches = common.bucket_batches(train_seqs, ns.batch, device=device)
    vbatches = common.bucket_batches(valid_seqs, ns.batch, device=device)
    ckdir = common.checkpoint_dir(ns.store, ns.name)
    smoothing = ns.smoothing
    partial, first = None, 0
    if ns.resume:
        tensors, state = common.load_checkpoint(ckdir)
        p = HMMParams(tensors["start"], tensors["trans"], tensors["emit"])
        best = HMMParams(tensors["best_start"], tensors["best_trans"], tensors["best_emit"])
        history, it0 = common.History.from_json(state["history"]), state["iteration"]
        partial, first = load_partial(tensors, state)
        partial = partial if world.main else None  # the partial counts are already a sum over the ranks
        t0 -= state.get("seconds", 0.0)
    else:
        p = init_params(ns.states, unigram(train_seqs, len(vocab)), gen, noise=ns.init_noise)
        history, it0, best = common.History(), 0, p
    p = HMMParams(*(t.to(device) for t in (p.start, p.trans, p.emit)))
    def evaluate(p: HMMParams) -> float:  # rank 0's, known to every rank
        return world.broadcast_floats([common.evaluate(p.score, vbatches) if world.main else 0.0])[0]

    if not history.rows:
        history.add(iteration=0, tokens=0, seconds=time.perf_counter() - t0, valid_ppl=evaluate(p))
    iters = ns.epochs if not ns.max_steps else min(ns.epochs, ns.max_steps)
    if ns.patience and history.bad_evals >= ns.patience:
        it0 = iters  # early-stopped before the checkpoint: export the best again
    N = common.num_tokens(train_seqs)
    bar = common.Progress(N * max(iters - it0, 0), f"hmm Z={ns.states} EM", ns.progress and world.main)

    def save(it: int, p: HMMParams, best: HMMParams, done: int = 0, counts: Counts | None = None) -> None:
        """Checkpoint after `it` iterations (+ `done` batches of the next one, whose counts are `counts`)."""
        if not world.main:
            return
        extra = {} if counts is None else {"partial_start": counts.start, "partial_trans": counts.trans,
                                           "partial_emit": counts.emit}
        common.save_checkpoint(ckdir, {**p.tensors(), **{f"best_{k}": v for k, v in best.tensors().items()}, **extra},
                               {"iteration": it, "batch": done, "history": history.to_json(),
                                "seconds": time.perf_counter() - t0, "world_size": world.size,
                                **({} if counts is None else {"partial_loglik": counts.loglik,
                                                              "partial_tokens": counts.tokens})}, ns)

    for it in range(it0, iters):
        c = e_step(p, batches, on_batch=lambda n, loss: bar.update(n, loss), start=first, partial=partial,
                   every=ns.checkpoint_every or 0, on_checkpoint=functools.partial(save, it, p, best), world=world)
        partial, first = None, 0
        p = m_step(c, p, smoothing)
        vppl = evaluate(p)
        bar.update(0, valid_ppl=vppl)
        if history.add(iteration=it + 1, tokens=N * (it + 1), seconds=time.perf_counter() - t0,
                       train_ppl=float(torch.tensor(-c.loglik / c.tokens).exp()), valid_ppl=vppl):
            best = p
        save(it + 1, p, best)
        if ns.patience and history.bad_evals >= ns.patience:
            break
    bar.close()
    prov = common.provenance(ns, history, time.perf_counter() - t0, {"method": "baum-welch", "smoothing": smoothing,
                                                                     "world_size": world.size})
    if not world.main:
        return Path(ns.store) / ns.name
    return export(ns.store, ns.name, best, vocab, provenance=prov,
                  extra_files={"curve.png": common.curve_png(history, f"hmm {ns.states} states, Baum-Welch")})
