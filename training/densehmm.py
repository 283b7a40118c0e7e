"""DenseHMM (Sicking et al., eqs. 2a-2c): every state i has an incoming vector u_i, an outgoing vector z_i and
an emission vector w_i, every word k a vector v_k, and the start a vector z_start (all of length l = `--hidden`,
drawn from N(0, 1) as in the paper's App. C):

    a_ij = softmax_j(u_j . z_i),   b_ik = softmax_k(v_k . w_i),   pi_i = softmax_i(u_i . z_start).

Two fits, as in the paper:
- `em` (§3.1): Baum-Welch E-step (`baum_welch.e_step`), then a gradient M-step: Adam steps on the expected
  complete-data log-likelihood (the Lagrangian L^dense of App. A) w.r.t. the vectors; the M-step keeps the
  best iterate it visited (never worse than where it started), so each EM iteration is a generalised EM step
  and the training likelihood does not decrease.
- `cooc` (§3.2): full-batch Adam on the squared Frobenius distance || Omega_gt - B^T diag(pi) A B ||_F^2
  between the empirical distribution of consecutive-observation pairs and the model's, with pi the
  stationary distribution of A (a differentiable linear solve, not a parameter). Divided by ||Omega_gt||_F^2
  (same minimiser). The exported start distribution is that stationary pi (the fit has no start).

`em-tied` (`TiedDenseParams`): the earlier variant (emissions from the outgoing vectors plus a per-word
bias, start from the outgoing vectors), kept under its own name because it is better on PTB; its
cross-entropy co-occurrence fit is gone. Checkpoints after every iteration (em: also every `--checkpoint-every` E-step
batches) let `--resume` continue exactly. Exported as an `hmm` artifact with `state_vectors` = W (Z, l),
`word_vectors` = V (V, l) (their dot products are the emission logits), `state_in_vectors` = U,
`state_out_vectors` = Z and `start_vector` = z_start."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from latentlm.models.errors import InputError
from latentlm.training import baum_welch as bw
from latentlm.training import common, distributed
from latentlm.training.data import load_training_split
from latentlm.training.recipes import trainer

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

M_STEPS = 25  # Adam steps per gradient M-step (em)
COOC_STEPS = 50  # full-batch Adam steps per iteration (cooc)


class DenseParams(nn.Module):
    """The paper's vectors: u, z, w (n, l), v (m, l), z_start (l,). `probs()` -> HMMParams.
    Building A, B, pi costs O(n^2 l + n m l)."""

    def __init__(self, n: int, m: int, l: int, generator: torch.Generator, dtype: torch.dtype = torch.float32):
        super().__init__()

        def r(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype))

        self.u, self.z, self.w, self.v, self.z_start = r(n, l), r(n, l), r(n, l), r(m, l), r(l)

    def log_trans(self) -> Tensor:
        """log A (n, n), log a_ij = u_j . z_i - logsumexp_k u_k . z_i (eq. 2a)."""
        return torch.log_softmax(self.z @ self.u.T, 1)

    def log_emit(self) -> Tensor:
        """log B (n, m), log b_ik = v_k . w_i - logsumexp_k' v_k' . w_i (eq. 2b)."""
        return torch.log_softmax(self.w @ self.v.T, 1)

    def log_start(self) -> Tensor:
        """log pi (n,), log pi_i = u_i . z_start - logsumexp_k u_k . z_start (eq. 2c)."""
        return torch.log_softmax(self.u @ self.z_start, 0)

    def log_probs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.log_start(), self.log_trans(), self.log_emit()

    def probs(self, start: str = "param") -> bw.HMMParams:
        """HMMParams with pi from z_start (`param`, eq. 2c) or the stationary distribution of A (`stationary`)."""
        with torch.no_grad():
            ls, lt, le = self.log_probs()
            pi = ls.exp() if start == "param" else stationary(lt.exp())
        return bw.HMMParams(pi, lt.exp(), le.exp())


class TiedDenseParams(DenseParams):
    """`--fit em-tied`, the project's earlier DenseHMM variant, kept because it measurably helps on PTB (269.0
    valid after 40 EM iterations at 128 states, d = 64, against 457.0 after 17 for the paper's model; see
    results/densehmm_results.md). It differs from eqs. 2b-2c: emissions reuse each state's outgoing vector
    z_i plus a per-word bias, b_ik = softmax_k(v_k . z_i + c_k), the start uses the outgoing vectors,
    pi_i = softmax_i(z_i . z_start), and every vector starts from 0.5 N(0, 1). Fit by the same EM with a
    gradient M-step. Exported `state_vectors` are the z_i (the emission side); the bias is not exported."""

    def __init__(self, n: int, m: int, l: int, generator: torch.Generator, dtype: torch.dtype = torch.float32):
        super().__init__(n, m, l, generator, dtype)
        del self.w
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(0.5)
        self.word_bias = nn.Parameter(torch.zeros(m, dtype=dtype))

    def log_emit(self) -> Tensor:
        return torch.log_softmax(self.z @ self.v.T + self.word_bias, 1)

    def log_start(self) -> Tensor:
        return torch.log_softmax(self.z @ self.z_start, 0)


def stationary(A: Tensor) -> Tensor:
    """Stationary distribution pi (n,) of a row-stochastic A (n, n) with all entries > 0 (softmax rows):
    the solution of (I - A^T + 1 1^T) pi = 1, i.e. pi^T A = pi^T and sum(pi) = 1. Differentiable, O(n^3)."""
    n = A.shape[0]
    M = torch.eye(n, dtype=A.dtype, device=A.device) - A.T + 1.0
    return torch.linalg.solve(M, torch.ones(n, dtype=A.dtype, device=A.device))


def expected_loglik(model: DenseParams, counts: bw.Counts) -> Tensor:
    """The M-step objective (App. A, L^dense): sum(counts * log params) / tokens. O(n^2 l + n m l)."""
    ls, lt, le = model.log_probs()
    dt = ls.dtype
    obj = ((counts.start.to(dt) * ls).sum() + (counts.trans.to(dt) * lt).sum() + (counts.emit.to(dt) * le).sum())
    return obj / float(counts.tokens)


def gradient_m_step(model: DenseParams, counts: bw.Counts, opt: torch.optim.Optimizer, steps: int) -> float:
    """`steps` Adam steps on `expected_loglik`; the parameters end at the best iterate visited (the start
    included), so the objective never decreases. Returns it. O(steps (n^2 l + n m l))."""
    best, best_state = -float("inf"), None
    for s in range(steps + 1):
        obj = expected_loglik(model, counts)
        val = float(obj.detach())
        if val > best:
            best, best_state = val, {k: t.detach().clone() for k, t in model.state_dict().items()}
        if s == steps:
            break
        opt.zero_grad(set_to_none=True)
        (-obj).backward()
        opt.step()
    if best_state is not None:
        model.load_state_dict(best_state)
    return best


def empirical_cooc(seqs: list[list[int]], m: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Relative frequencies of consecutive pairs (o_t, o_t+1) inside each sequence: a sparse COO (m, m)
    tensor summing to 1. O(N)."""
    left = torch.cat([torch.as_tensor(s[:-1], dtype=torch.long) for s in seqs if len(s) > 1])
    right = torch.cat([torch.as_tensor(s[1:], dtype=torch.long) for s in seqs if len(s) > 1])
    omega = torch.sparse_coo_tensor(torch.stack([left, right]), torch.ones(len(left), dtype=dtype), (m, m),
                                    check_invariants=True)
    omega = omega.coalesce()
    return omega / float(len(left))


def model_cooc(trans: Tensor, emit: Tensor) -> Tensor:
    """Dense Omega = B^T diag(pi) A B (m, m) with pi the stationary distribution of A (eq. 3). O(n m^2)."""
    pi = stationary(trans)
    return emit.T @ (pi[:, None] * trans) @ emit


def cooc_objective(model: DenseParams, omega: Tensor, omega_sq: float) -> Tensor:
    """||Omega_gt - B^T Theta B||_F^2 / ||Omega_gt||_F^2 with Theta = diag(pi) A, pi stationary, computed
    without the dense (m, m) model matrix: ||gt||^2 - 2 <Theta, B gt B^T> + tr(Theta^T G Theta G),
    G = B B^T. `omega` is sparse (m, m) with P nonzeros. O(n^2 m + P n + n^3)."""
    A, B = model.log_trans().exp(), model.log_emit().exp()
    theta = stationary(A)[:, None] * A
    cross = (theta * (B @ torch.sparse.mm(omega, B.T))).sum()
    G = B @ B.T
    model_sq = ((theta.T @ G @ theta) * G).sum()
    return (omega_sq - 2 * cross + model_sq) / omega_sq


def cooc_step(model: DenseParams, opt: torch.optim.Optimizer, omega: Tensor, omega_sq: float) -> float:
    """One full-batch Adam step on `cooc_objective`; returns the objective before the step."""
    loss = cooc_objective(model, omega, omega_sq)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _vectors(model: DenseParams) -> dict[str, Tensor]:
    d = {k: t.detach().clone() for k, t in model.state_dict().items()}
    return {"state_vectors": d["w"] if "w" in d else d["z"].clone(), "word_vectors": d["v"], "state_in_vectors": d["u"],
            "state_out_vectors": d["z"], "start_vector": d["z_start"]}


@trainer("densehmm", data_parallel=True)
def train(ns: TrainSettings) -> Path:
    """`latentlm train --family densehmm [--fit em|em-tied|cooc]`: export as an `hmm` artifact with vectors.
    Under torchrun (em, em-tied) the E-step's batches are shared and the counts summed (`bw.e_step`); every rank
    takes the same gradient M-step; rank 0 evaluates and writes. cooc fits one full-batch objective: one process."""
    common.check_resume(ns)
    world = distributed.world("cpu")
    if world.size > 1 and ns.fit == "cooc":
        raise InputError(f"--fit cooc: its full-batch co-occurrence objective trains in one process; torchrun "
                         f"started {world.size} (data-parallel: --fit em or em-tied)", param="fit")
    t0 = time.perf_counter()
    gen = common.seed_all(ns.seed)
    vocab, train_seqs, valid_seqs = load_training_split(ns)
    V = len(vocab)
    model = (TiedDenseParams if ns.fit == "em-tied" else DenseParams)(ns.states, V, ns.hidden, gen)
    opt = torch.optim.Adam(model.parameters(), lr=ns.lr)
    start_kind = "stationary" if ns.fit == "cooc" else "param"
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
            vectors = {k[5:]: t for k, t in tensors.items() if k.startswith("best_") and k[5:] not in
                       ("start", "trans", "emit")}
        partial, first = bw.load_partial(tensors, state)
        t0 -= state.get("seconds", 0.0)
    else:
        history.add(iteration=0, tokens=0, seconds=time.perf_counter() - t0,
                    valid_ppl=_evaluate(world, model.probs(start_kind), vbatches))
        best = model.probs(start_kind)
    N = common.num_tokens(train_seqs)
    iters = ns.epochs if not ns.max_steps else min(ns.epochs, ns.max_steps)
    if ns.patience and history.bad_evals >= ns.patience:
        it0 = iters  # early-stopped before the checkpoint: export the best again
    bar = common.Progress(N * max(iters - it0, 0), f"densehmm Z={ns.states} d={ns.hidden} ({ns.fit})",
                          ns.progress and world.main)
    if ns.fit == "cooc":
        omega = empirical_cooc(train_seqs, V)
        omega_sq = float((omega.values().double() ** 2).sum())

    def save(it: int, best: bw.HMMParams, done: int = 0, counts: bw.Counts | None = None) -> None:
        """Checkpoint after `it` iterations and `done` E-step batches of the next (em: with their `counts`)."""
        if not world.main:
            return
        ot, ometa = common.optimizer_tensors(opt)
        tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()}, **ot,
                   **common.rng_tensors(gen), **{f"best_{k}": v for k, v in best.tensors().items()},
                   **{f"best_{k}": v for k, v in (vectors or {}).items()}}
        state = {"iteration": it, "batch": done, "history": history.to_json(), "optimizer": ometa,
                 "seconds": time.perf_counter() - t0}
        if counts is not None:
            tensors.update(partial_start=counts.start, partial_trans=counts.trans, partial_emit=counts.emit)
            state.update(partial_loglik=counts.loglik, partial_tokens=counts.tokens)
        common.save_checkpoint(ckdir, tensors, state, ns)

    every = ns.checkpoint_every or 0
    for it in range(it0, iters):
        if ns.fit in ("em", "em-tied"):
            c = bw.e_step(model.probs(), batches, on_batch=lambda n, loss: bar.update(n, loss), start=first,
                          partial=partial if world.main else None, every=every,
                          on_checkpoint=functools.partial(save, it, best), world=world)
            gradient_m_step(model, c, opt, steps=M_STEPS)
        else:  # one iteration = COOC_STEPS full-batch steps, checkpointed at its end
            for _ in range(COOC_STEPS):
                loss = cooc_step(model, opt, omega, omega_sq)
                bar.update(N // COOC_STEPS, loss)
        partial, first = None, 0
        p = model.probs(start_kind)
        vppl = _evaluate(world, p, vbatches)
        bar.update(0, valid_ppl=vppl)
        if history.add(iteration=it + 1, tokens=N * (it + 1), seconds=time.perf_counter() - t0, valid_ppl=vppl):
            best, vectors = p, _vectors(model)
        save(it + 1, best)
        if ns.patience and history.bad_evals >= ns.patience:
            break
    bar.close()
    if vectors is None or history.best == history.rows[0]["valid_ppl"]:
        vectors = _vectors(model)
    prov = common.provenance(ns, history, time.perf_counter() - t0, {"method": f"DenseHMM ({ns.fit})",
                                                                     "world_size": world.size})
    if not world.main:
        return Path(ns.store) / ns.name
    return bw.export(ns.store, ns.name, best, vocab, provenance=prov, extra_tensors=vectors,
                     config_extra={"vector_dim": ns.hidden, "densehmm_fit": ns.fit,
                                   "densehmm_start": start_kind},
                     extra_files={"curve.png": common.curve_png(history, f"DenseHMM {ns.states} states ({ns.fit})")})


def _evaluate(world: distributed.World, p: bw.HMMParams, batches: list) -> float:
    """Rank 0's validation perplexity of `p`, known to every rank."""
    return world.broadcast_floats([common.evaluate(p.score, batches) if world.main else 0.0])[0]
