"""DenseHMM (Sicking et al.): transitions, emissions and start as softmaxes of dot products of learned
vectors — state vectors u_i, transition-target vectors z_j, word vectors o_k, a start vector z_0:

    A_ij = softmax_j(u_i . z_j),   B_ik = softmax_k(u_i . o_k),   pi_i = softmax_i(z_0 . u_i).

Two fits: `em` — Baum-Welch E-step (`models.chain.expected_counts`) and a gradient M-step (Adam on the
expected complete-data log-likelihood); `cooc` — direct fit of the bigram co-occurrence matrix
Omega = B^T diag(pi) A B to the empirical bigram distribution (cross-entropy over observed pairs,
stochastic over chunks of pairs). Checkpoints after every iteration (and every `--checkpoint-every`
E-step batches / pair chunks) let `--resume` continue exactly. Exported as an `hmm` artifact carrying
`state_vectors` (Z, d) and `word_vectors` (V, d)."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from latentlm.training import baum_welch as bw
from latentlm.training import common
from latentlm.training.data import load_training_split


class DenseParams(nn.Module):
    """Vectors of a DenseHMM; `probs()` -> HMMParams (start, trans, emit). O(Z^2 d + Z V d)."""

    def __init__(self, Z: int, V: int, d: int, generator: torch.Generator):
        super().__init__()
        def r(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * 0.5)

        self.u, self.z, self.o, self.z0 = r(Z, d), r(Z, d), r(V, d), r(d)
        self.emit_bias = nn.Parameter(torch.zeros(V))  # word frequency offset, shared by all states

    def log_probs(self) -> tuple[Tensor, Tensor, Tensor]:
        return (torch.log_softmax(self.u @ self.z0, 0), torch.log_softmax(self.u @ self.z.T, 1),
                torch.log_softmax(self.u @ self.o.T + self.emit_bias, 1))

    def probs(self) -> bw.HMMParams:
        with torch.no_grad():
            ls, lt, le = self.log_probs()
        return bw.HMMParams(ls.exp(), lt.exp(), le.exp())


def gradient_m_step(model: DenseParams, counts: bw.Counts, opt: torch.optim.Optimizer, steps: int) -> float:
    """Maximise sum(counts * log params) / tokens by `steps` optimiser steps; returns the final objective."""
    cs, ct, ce = (c.float() for c in (counts.start, counts.trans, counts.emit))
    n = float(counts.tokens)
    obj = 0.0
    for _ in range(steps):
        ls, lt, le = model.log_probs()
        loss = -((cs * ls).sum() + (ct * lt).sum() + (ce * le).sum()) / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        obj = -float(loss.detach())
    return obj


def cooc_loss(model: DenseParams, left: Tensor, right: Tensor, weight: Tensor) -> Tensor:
    """-sum_w weight * log Omega[left, right] with Omega = B^T diag(pi) A B (pairs given as index lists).
    O(V Z d + P Z) for P pairs."""
    ls, lt, le = model.log_probs()
    B = le.exp()  # (Z, V)
    L = B.T @ (ls.exp()[:, None] * lt.exp())  # (V, Z): sum_i B_ia pi_i A_ij
    omega = (L[left] * B.T[right]).sum(1)
    return -(weight * omega.clamp_min(1e-30).log()).sum()


def train(ns: argparse.Namespace) -> Path:
    """`latentlm train --family densehmm [--fit em|cooc]`: export as an `hmm` artifact with vectors."""
    common.check_resume(ns)
    t0 = time.perf_counter()
    gen = common.seed_all(ns.seed)
    vocab, train_seqs, valid_seqs = load_training_split(ns)
    V = len(vocab)
    model = DenseParams(ns.states, V, ns.hidden, gen)
    with torch.no_grad():  # start each state at the unigram distribution
        model.emit_bias.copy_(bw.unigram(train_seqs, V).log().float())
    opt = torch.optim.Adam(model.parameters(), lr=ns.lr)
    batches = common.bucket_batches(train_seqs, ns.batch)
    vbatches = common.bucket_batches(valid_seqs, ns.batch)
    ckdir = common.checkpoint_dir(ns.store, ns.name)
    history, it0, partial, first, vectors = common.History(), 0, None, 0, None
    if ns.resume:
        tensors, state = common.load_checkpoint(ckdir)
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        common.restore_optimizer(opt, tensors, state["optimizer"])
        common.restore_rng(gen, tensors)
        history, it0 = common.History.from_json(state["history"]), int(state["iteration"])
        best = bw.HMMParams(tensors["best_start"], tensors["best_trans"], tensors["best_emit"])
        if "best_state_vectors" in tensors:
            vectors = {k: tensors[f"best_{k}"] for k in ("state_vectors", "word_vectors")}
        partial, first = bw.load_partial(tensors, state)
        t0 -= state.get("seconds", 0.0)
    else:
        history.add(iteration=0, tokens=0, seconds=time.perf_counter() - t0,
                    valid_ppl=common.evaluate(model.probs().score, vbatches))
        best = model.probs()
    N = common.num_tokens(train_seqs)
    iters = ns.epochs if not ns.max_steps else min(ns.epochs, ns.max_steps)
    if ns.patience and history.bad_evals >= ns.patience:
        it0 = iters  # early-stopped before the checkpoint: export the best again
    bar = common.Progress(N * max(iters - it0, 0), f"densehmm Z={ns.states} d={ns.hidden} ({ns.fit})", ns.progress)
    if ns.fit == "cooc":
        from latentlm.training.brown import bigram_matrix

        big = bigram_matrix(train_seqs, V).tocoo()
        left, right = torch.as_tensor(big.row), torch.as_tensor(big.col)
        weight = torch.as_tensor(big.data, dtype=torch.float32)
        weight = weight / weight.sum()

    def save(it: int, best: bw.HMMParams, done: int = 0, counts: bw.Counts | None = None,
             rng: dict[str, Tensor] | None = None) -> None:
        """Checkpoint after `it` iterations and `done` batches (em: with their `counts`) or chunks (cooc:
        with the generators as they were when the iteration's pair order was drawn, `rng`) of the next."""
        ot, ometa = common.optimizer_tensors(opt)
        tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()}, **ot,
                   **(rng or common.rng_tensors(gen)), **{f"best_{k}": v for k, v in best.tensors().items()},
                   **{f"best_{k}": v for k, v in (vectors or {}).items()}}
        state = {"iteration": it, "batch": done, "history": history.to_json(), "optimizer": ometa,
                 "seconds": time.perf_counter() - t0}
        if counts is not None:
            tensors.update(partial_start=counts.start, partial_trans=counts.trans, partial_emit=counts.emit)
            state.update(partial_loglik=counts.loglik, partial_tokens=counts.tokens)
        common.save_checkpoint(ckdir, tensors, state, ns)

    every = ns.checkpoint_every or 0
    for it in range(it0, iters):
        if ns.fit == "em":
            c = bw.e_step(model.probs(), batches, on_batch=lambda n, loss: bar.update(n, loss), start=first,
                          partial=partial, every=every, on_checkpoint=functools.partial(save, it, best))
            gradient_m_step(model, c, opt, steps=25)
        else:
            rng = common.rng_tensors(gen)  # a resumed iteration redraws the same order from here
            perm = torch.randperm(len(left), generator=gen)
            chunks = perm.split(1 << 16)
            for ci in range(first, len(chunks)):
                ch = chunks[ci]
                loss = cooc_loss(model, left[ch], right[ch], weight[ch] * len(chunks))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.update(N // len(chunks), float(loss.detach()))
                if every and (ci + 1) % every == 0 and ci + 1 < len(chunks):
                    save(it, best, ci + 1, rng=rng)
        partial, first = None, 0
        p = model.probs()
        vppl = common.evaluate(p.score, vbatches)
        bar.update(0, valid_ppl=vppl)
        if history.add(iteration=it + 1, tokens=N * (it + 1), seconds=time.perf_counter() - t0, valid_ppl=vppl):
            best = p
            vectors = {"state_vectors": model.u.detach().clone(), "word_vectors": model.o.detach().clone()}
        save(it + 1, best)
        if ns.patience and history.bad_evals >= ns.patience:
            break
    bar.close()
    if vectors is None or history.best == history.rows[0]["valid_ppl"]:
        vectors = {"state_vectors": model.u.detach().clone(), "word_vectors": model.o.detach().clone()}
    prov = common.provenance(ns, history, time.perf_counter() - t0, {"method": f"DenseHMM ({ns.fit})"})
    return bw.export(ns.store, ns.name, best, vocab, provenance=prov, extra_tensors=vectors,
                     config_extra={"vector_dim": ns.hidden, "densehmm_fit": ns.fit},
                     extra_files={"curve.png": common.curve_png(history, f"DenseHMM {ns.states} states ({ns.fit})")})
