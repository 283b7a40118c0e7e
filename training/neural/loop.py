"""`latentlm train --family blocked_hmm|rank_hmm`: the training loop, as small steps over one `Run`. The loop names
no family: it asks the run's network (`networks.NETWORKS`) for what differs (its build, loss, artifact config):
`setup` (data, model, resume), `step` (one clipped AdamW step), `check` (evaluate what would be exported,
plateau decay, early stopping), `checkpoint` (everything a resume needs) and `export` (the artifact); `fit` runs
the epochs. `latentlm distill --family blocked_hmm` calls `fit` and `export` itself, with its samples as the data
(`data.Sequences`), its own checkpoint directory and its provenance and files added to the artifact.

Under `torchrun` the run is data-parallel (`training.distributed`): every rank builds the same batches and takes
its rows of each (BPTT: its streams), the gradients are summed, rank 0 alone evaluates and writes; the
trajectory is the one-process trajectory up to float summation order, and a checkpoint (the BPTT carry of every
stream gathered into it) resumes on any number of ranks.

The validation perplexity is computed by the exported family's own scoring code. On the CPU a step's float32
GEMMs run on the faster of torch's BLAS and oneDNN for the model's shapes (`kernels.gemm`, `gemm_for_run`,
`--gemm`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import Carried
from latentlm.models.errors import InputError, LatentLMError
from latentlm.models.kernels import gemm
from latentlm.models.registry import FAMILIES, save_artifact
from latentlm.models.vocab import Vocabulary
from latentlm.training import common, distributed
from latentlm.training.data import Sequences, load_training_split
from latentlm.training.neural import bptt
from latentlm.training.neural.growth import checkpoint_states, split_model, split_state_dict, splits_done
from latentlm.training.neural.networks import NETWORKS
from latentlm.training.neural.schedule import (
    anneal_factor,
    backward_clipped,
    budget_used,
    make_optimizer,
    parameters_swapped,
    set_lr,
    update_average,
)
from latentlm.training.recipes import trainer

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings


class TrainingDiverged(LatentLMError):
    """The loss became NaN or infinite: training stops before writing a broken model (exit status 2)."""


# -- the model ----------------------------------------------------------------------------------------
def build(ns: TrainSettings, vocab: Vocabulary, train_seqs: list[list[int]]) -> tuple[nn.Module, dict]:
    """The network of recipe `ns.family` (`NETWORKS`; blocked_hmm's Brown clustering runs here). Returns (module,
    the files the artifact adds)."""
    return NETWORKS[ns.family].build(ns, vocab, train_seqs)


def exported_tensors(model: nn.Module, ns: TrainSettings, train_seqs: list[list[int]], eos: int | None,
                     device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """The tensors the artifact stores (on `device`): the family's cached matrices, with a BPTT-trained VL-HMM's
    sentence start replaced by the state distribution after `<eos>` (`bptt.fix_start_for_streams`), unless it was
    trained with --reset-eos (then every sentence started from the start distribution, as the artifact's do)."""
    tensors = model.export_tensors(device)
    if model.carries_state and ns.bptt and not ns.reset_eos:
        tensors = bptt.fix_start_for_streams(model, tensors, train_seqs, eos)
    return tensors


def family_scorer(model: nn.Module, family: str | None = None, tensors: dict[str, Tensor] | None = None):
    """Score function over the exported tensors through the family's own inference (what the service runs: the
    registered family `model.family`, or `family`), on the device that holds the model's parameters."""
    t = model.export_tensors() if tensors is None else tensors
    device = next(model.parameters()).device
    impl = FAMILIES[family or model.family].from_tensors(t, model.scoring_config(), device=device)
    return lambda b: impl.score(b)[0], t


def gemm_for_run(ns: TrainSettings, model: nn.Module, device: torch.device, saved: str | None
                 ) -> tuple[str, dict[str, float]]:
    """The GEMM library of a run's step (`kernels.gemm`): `--gemm` itself, else the checkpoint's choice `saved`
    when resuming (the two libraries round differently, so a resumed run must keep its own), else the faster
    on this model's largest products (blocked_hmm: transition logits, the largest cluster's emission logits, a
    state MLP layer; rank_hmm: U, the emission logits, V U^T). CUDA runs use torch's ops: ("torch", {}).
    Returns (name, GFLOP/s measured)."""
    if device.type != "cpu":
        return "torch", {}
    if ns.gemm == "auto" and saved:
        return (saved if saved in gemm.BACKENDS else "torch"), {}
    return gemm.choose(model.gemm_shapes(ns.state_dropout), ns.gemm)


# -- the run ------------------------------------------------------------------------------------------
@dataclass
class Position:
    """Where training stands: `batch` batches of epoch `epoch` done, `step` optimiser steps and `tokens`
    training tokens in all (what a checkpoint needs to continue at the next batch)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    tokens: int = 0

    @classmethod
    def from_json(cls, state: dict, history: common.History) -> Position:
        tokens = state.get("tokens", history.rows[-1].get("tokens", 0) if history.rows else 0)
        return cls(int(state["epoch"]), int(state.get("batch", 0)), int(state["step"]), int(tokens))


@dataclass
class Run:
    """What a run holds between steps: settings, data, the model and its optimiser, the random generator (state
    dropout), the position, the history of evaluations, the best (exported) parameters, the moving average
    (--weight-average), the BPTT carry and the time spent in checks."""

    ns: TrainSettings
    vocab: Vocabulary
    train_seqs: list[list[int]]
    valid_batches: list[Batch]
    device: torch.device
    gen: torch.Generator
    model: nn.Module
    opt: torch.optim.Optimizer
    extra_files: dict[str, bytes]
    splits: common.Splits
    ckdir: Path
    t0: float
    decay: float  # LR factor at a plateau
    gemm_name: str = "torch"
    gemm_rates: dict[str, float] = field(default_factory=dict)
    history: common.History = field(default_factory=common.History)
    pos: Position = field(default_factory=Position)
    keep: int = 0  # states per cluster state dropout keeps (`kept_states`; 0 without state dropout)
    best_state: dict[str, Tensor] = field(default_factory=dict)
    average: dict[str, Tensor] | None = None
    carry: Carried | None = None
    check_seconds: float = 0.0  # cumulative wall time of evaluations and checkpoint writes
    stop: bool = False  # early stopping (or a run with nothing left to do)
    bar: common.Progress | None = None
    world: distributed.World = field(default_factory=distributed.World)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def current_state(self) -> dict[str, Tensor]:
        """What would be exported now: the averaged parameters if any, else the parameters (copies)."""
        average = self.average
        return {n: (average[n] if average and n in average else v).detach().clone()
                for n, v in self.model.state_dict().items()}

    def label(self) -> str:
        """The progress bar's label: family and current state count, and the splits still to come."""
        done = splits_done(self.ns.states, self.model, self.splits) if self.splits else 0
        return f"{self.ns.family} Z={self.model.num_states}" + self.splits.describe(done)


def setup(ns: TrainSettings, sequences: Sequences | None = None, checkpoints: Path | None = None) -> Run:
    """Data, model and optimiser, restored from the checkpoint with --resume (refused before any data is read
    when its shape settings differ); the step-0 evaluation of a fresh run. The data is `--data`'s, or
    `sequences` when given (ids over their own vocabulary; `latentlm distill`); checkpoints go to `checkpoints`
    (default `<store>/.train/<name>/`)."""
    common.check_resume(ns)
    world = distributed.world(ns.device)
    if not world.main:
        ns = replace(ns, progress=False)  # rank 0 alone reports
    if world.size > 1 and NETWORKS[ns.family].carries_state and ns.bptt and ns.batch % world.size:
        raise InputError(f"--batch {ns.batch}: BPTT's {ns.batch} streams must split evenly over the {world.size} "
                         f"ranks", param="batch")
    gen = common.seed_all(ns.seed)
    device = world.device
    if sequences is None:
        vocab, train_seqs, valid_seqs = load_training_split(ns)
    else:
        vocab, train_seqs, valid_seqs = sequences.vocab, sequences.train, sequences.valid
    model, extra_files = build(ns, vocab, train_seqs)
    model.to(device)
    splits = common.split_plan(ns)
    ckdir = common.checkpoint_dir(ns.store, ns.name) if checkpoints is None else Path(checkpoints)
    tensors, state = common.load_checkpoint(ckdir) if ns.resume else ({}, {})
    while splits and ns.resume and model.num_states < checkpoint_states(model, tensors):
        model = split_model(model)[0]  # splits done before the checkpoint (its parameters follow)
    opt = make_optimizer(model, ns.lr, weight_decay=ns.weight_decay)
    gemm_name, gemm_rates = gemm_for_run(ns, model, device, state.get("gemm")) if world.main else ("torch", {})
    gemm_name = world.broadcast_choice(gemm_name, gemm.BACKENDS)  # every rank rounds alike
    gemm.set_backend(gemm_name)
    if ns.progress and gemm_rates:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in gemm_rates.items())
        print(f"GEMM: {gemm_name} (GFLOP/s on this model's shapes: {rates})", file=sys.stderr)
    # --time-limit counts training from here: reading the corpus, Brown clustering and choosing the GEMM library
    # (minutes on a busy machine) are not training time (they once left a busy machine's default build 1 step)
    t0 = time.perf_counter()
    run = Run(ns, vocab, train_seqs, [], device, gen, model, opt, extra_files, splits, ckdir, t0,
              decay=1.0 / (ns.lr_decay or model.lr_decay), gemm_name=gemm_name, gemm_rates=gemm_rates, world=world)
    if ns.resume:
        _restore(run, tensors, state)
    run.valid_batches = common.bucket_batches(valid_seqs, 256, device=device) if world.main else []
    run.keep = model.kept_states(ns.state_dropout)
    N = common.num_tokens(train_seqs)
    run.bar = common.Progress(N * max(ns.epochs - run.pos.epoch, 0), run.label(), ns.progress)
    if ns.weight_average and run.average is None:  # (a checkpoint written without the average starts it here)
        run.average = {n: p.detach().clone() for n, p in model.named_parameters()}
    run.best_state = run.current_state()
    if run.history.rows:
        run.best_state = {k2[5:]: v for k2, v in common.load_checkpoint(ckdir)[0].items()
                          if k2.startswith("best.")} or run.best_state
        run.check_seconds = run.history.rows[-1].get("check_seconds", 0.0)
    else:
        tick = time.perf_counter()
        ppl = evaluate(run)
        run.check_seconds = time.perf_counter() - tick
        run.history.add(step=0, epoch=0, tokens=0, seconds=run.seconds(), valid_ppl=ppl,
                        lr=opt.param_groups[0]["lr"], check_seconds=run.check_seconds)
    return run


def _restore(run: Run, tensors: dict[str, Tensor], state: dict) -> None:
    """Continue from checkpoint (`tensors`, `state`): parameters, optimiser, generators, position, history, BPTT
    carry, moving average and the time already spent."""
    ns = run.ns
    run.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    if not ns.export_only:  # exporting needs only the parameters (a checkpoint may carry no optimizer state)
        common.restore_optimizer(run.opt, tensors, state["optimizer"])
        common.restore_rng(run.gen, tensors)
    run.history = common.History.from_json(state["history"])
    run.pos = Position.from_json(state, run.history)
    run.carry = bptt.carry_from_checkpoint(tensors, run.device)
    if run.carry is not None:  # every stream's carry: this rank keeps its streams'
        part = run.world.share(run.carry.state.shape[0])
        run.carry = Carried(run.carry.state[part], run.carry.cluster[part])
    if ns.weight_average:
        run.average = {n[4:]: v.to(run.device) for n, v in tensors.items() if n.startswith("avg.")} or None
    run.t0 -= state.get("seconds", 0.0)
    if state.get("early_stopped") or ns.export_only or (ns.max_steps and run.pos.step >= ns.max_steps):
        run.pos.epoch = ns.epochs  # nothing left to do: export the best parameters again


def evaluate(run: Run) -> float:
    """The validation perplexity of exactly what would be exported now (the moving average, if any), computed by
    rank 0 and known to every rank."""
    if run.world.distributed:
        return run.world.broadcast_floats([_evaluate(run) if run.world.main else 0.0])[0]
    return _evaluate(run)


def _evaluate(run: Run) -> float:
    model, ns = run.model, run.ns
    model.eval()
    with parameters_swapped(model, run.average):
        tensors = exported_tensors(model, ns, run.train_seqs, run.vocab.eos_id, run.device)
        score, _ = family_scorer(model, ns.family, tensors)
        ppl = common.evaluate(score, run.valid_batches)
    model.train()
    return ppl


def epoch_batches(run: Run, epoch: int) -> list[Batch]:
    """The epoch's batches: a function of (seed, epoch) alone, so a resumed epoch regenerates them."""
    ns = run.ns
    egen = torch.Generator().manual_seed(ns.seed * 100003 + epoch)
    if run.model.carries_state and ns.bptt:
        start = int(torch.randint(common.num_tokens(run.train_seqs), (1,), generator=egen)) if ns.bptt_rotate else 0
        return bptt.bptt_batches(run.train_seqs, ns.batch, ns.bptt, run.device, start)
    return common.bucket_batches(run.train_seqs, ns.batch, egen, run.device)


def grow_if_due(run: Run, epoch: int) -> None:
    """At an epoch's start, a split of --split-at that is due: every state splits in two (the same distribution;
    noise breaks the ties), with its optimiser moments, best and averaged parameters."""
    if not run.splits:
        return
    used = budget_used(run.ns, run.pos.step, epoch, run.seconds())
    if run.splits.by_budget:  # wall time may count: rank 0's clock decides for every rank
        used = run.world.broadcast_floats([used])[0]
    if not run.splits.due(splits_done(run.ns.states, run.model, run.splits), epoch, used):
        return
    if run.average is not None:
        run.average = split_state_dict(run.model, run.average)
    run.model, run.opt, run.best_state = split_model(run.model, run.opt, run.best_state, run.gen, noise=0.01)
    run.keep = run.model.kept_states(run.ns.state_dropout)
    run.bar.relabel(run.label())


def step(run: Run, batch: Batch, ntok: int, epochs_done: float) -> float:
    """One optimisation step on `batch` (`ntok` tokens; `epochs_done` epochs into the run); returns the loss per
    token. Raises TrainingDiverged (naming --lr) at a non-finite loss or gradient, before the update. On W ranks
    each back-propagates its rows' loss over the global `ntok` and the gradients are summed before clipping.
    A rank with no rows (a last bucket smaller than W) runs one row at weight 0, so that every rank draws the
    same random numbers (dropout) and sends gradients."""
    ns, model, opt, world = run.ns, run.model, run.opt, run.world
    mine = world.rows(batch)
    weight = 1.0
    if mine.ids.shape[0] == 0:
        mine, weight = Batch(batch.ids[:1, : int(batch.lengths[0])], batch.lengths[:1]), 0.0
    nll, run.carry = model.step_nll(mine, generator=run.gen, keep=run.keep, carry=run.carry, bptt=bool(ns.bptt),
                                    eos=run.vocab.eos_id if ns.reset_eos else None)
    loss = nll * (weight / ntok)
    if ns.lr_anneal:
        used = budget_used(ns, run.pos.step, epochs_done, run.seconds())
        if ns.time_limit and world.distributed:  # wall time counts: rank 0's clock sets every rank's LR
            used = world.broadcast_floats([used])[0]
        set_lr(opt, anneal_factor(used, ns.lr_anneal))
    grad_norm = backward_clipped(model, opt, loss, world.sum_gradients)
    # the step's one host sync: the loss and the gradient norm read together, before the update
    loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm.float().to(loss.device)]).tolist()
    if world.distributed:
        loss_value = world.sum_floats([loss_value])[0]
    if not math.isfinite(loss_value):
        raise TrainingDiverged(
            f"--lr: training diverged at step {run.pos.step + 1} (loss {loss_value}); nothing was "
            f"written. Try a lower --lr than {opt.param_groups[0]['lr']:g}, or more states per cluster", param="lr")
    if not math.isfinite(norm_value):
        raise TrainingDiverged(
            f"--lr: the gradient became non-finite at step {run.pos.step + 1}; nothing was written. Try a "
            f"lower --lr than {opt.param_groups[0]['lr']:g}", param="lr")
    opt.step()
    if run.average is not None:
        update_average(run.average, model, ns.weight_average, run.pos.step)
    run.pos.step += 1
    run.pos.tokens += ntok
    run.bar.update(ntok, loss_value)
    return loss_value


def check(run: Run, loss_value: float, epochs_done: float) -> None:
    """An evaluation: a history row; the best parameters on improvement; else early stopping (--patience) or
    the plateau decay of the LR, at every evaluation without improvement or (--lr-patience N) after every N in
    a row (Chiu & Rush: x 1/4 after 8 checks)."""
    ns, opt = run.ns, run.opt
    tick = time.perf_counter()
    ppl = evaluate(run)
    run.check_seconds += time.perf_counter() - tick
    run.bar.update(0, valid_ppl=ppl)
    if run.history.add(step=run.pos.step, epoch=epochs_done, tokens=run.pos.tokens, seconds=run.seconds(),
                       train_ppl=math.exp(loss_value), valid_ppl=ppl, lr=opt.param_groups[0]["lr"],
                       check_seconds=run.check_seconds):
        run.best_state = run.current_state()
    elif ns.patience and run.history.bad_evals >= ns.patience:
        run.stop = True
    elif not ns.lr_patience or run.history.bad_evals % ns.lr_patience == 0:
        for g in opt.param_groups:
            g["base_lr"] = g.get("base_lr", g["lr"]) * run.decay
            g["lr"] *= run.decay


def checkpoint(run: Run, with_carry: bool) -> None:
    """Write everything a resume needs to continue bit-for-bit: parameters, best parameters, AdamW state, both
    generators (state dropout; torch's global one, used by nn.Dropout), the position in the epoch, the BPTT
    carry (`with_carry`: mid-epoch), the parameters' moving average (--weight-average), the GEMM library in use
    and the run's shape settings. Its time counts in `check_seconds`."""
    tick = time.perf_counter()
    carry = run.carry if with_carry else None
    if carry is not None and run.world.distributed:  # every rank's streams, in rank order
        carry = Carried(run.world.gather_rows(carry.state), run.world.gather_rows(carry.cluster))
    if not run.world.main:
        return
    ot, ometa = common.optimizer_tensors(run.opt)
    tensors = {**{f"model.{k}": v for k, v in run.model.state_dict().items()},
               **{f"best.{k}": v for k, v in run.best_state.items()}, **ot, **common.rng_tensors(run.gen)}
    if carry is not None:
        tensors["carry"], tensors["carry_cluster"] = carry.state, carry.cluster
    if run.average is not None:
        tensors.update({f"avg.{n}": v for n, v in run.average.items()})
    pos = run.pos
    common.save_checkpoint(run.ckdir, tensors, {"epoch": pos.epoch, "batch": pos.batch, "step": pos.step,
                                                "tokens": pos.tokens, "history": run.history.to_json(),
                                                "optimizer": ometa, "seconds": run.seconds(),
                                                "early_stopped": run.stop, "gemm": gemm.backend(),
                                                "world_size": run.world.size}, run.ns)
    run.check_seconds += time.perf_counter() - tick


def export(run: Run, provenance: dict[str, Any] | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """The best evaluation's parameters as the family's artifact (+ clusters.txt, curve.png); returns its
    directory (rank 0 writes it; the other ranks return the same path). `provenance` entries replace or add to
    the trainer's; `extra_files` are stored too."""
    ns, model = run.ns, run.model
    if not run.world.main:
        return Path(ns.store) / ns.name
    if run.splits and splits_done(ns.states, model, run.splits) < len(run.splits):  # a share never reached
        print(f"--split-at: the budget ended before {len(run.splits) - splits_done(ns.states, model, run.splits)} "
              f"of the splits; the model has {model.M * model.k} states, not {ns.states}", file=sys.stderr)
    model.load_state_dict(run.best_state)
    model.eval()
    tensors = exported_tensors(model, ns, run.train_seqs, run.vocab.eos_id)
    config = model.artifact_config(ns)
    prov = common.provenance(ns, run.history, run.seconds(),
                             {"method": model.method,
                              "steps": run.pos.step, "gemm": run.gemm_name, "world_size": run.world.size,
                              **distributed.communication(),
                              "gemm_gflops": {k: round(v, 1) for k, v in run.gemm_rates.items()}})
    files = {**run.extra_files, "curve.png": common.curve_png(run.history, model.title(ns)), **(extra_files or {})}
    return save_artifact(ns.store, ns.name, model.family, tensors, run.vocab, config=config,
                         provenance={**prov, **(provenance or {})}, extra_files=files)


@trainer(*NETWORKS, data_parallel=True)
def train(ns: TrainSettings) -> Path:
    """`latentlm train --family blocked_hmm|rank_hmm`. Returns the artifact directory. The GEMM library the run
    picks (`--gemm`, `gemm_for_run`) is the process's only while it trains."""
    with gemm.using(gemm.backend()):  # whatever the run sets is undone on return or error
        return _train(ns)


def _train(ns: TrainSettings) -> Path:
    return export(fit(ns))


def fit(ns: TrainSettings, sequences: Sequences | None = None, checkpoints: Path | None = None) -> Run:
    """Epochs of steps; a check at --eval-every / --evals-per-epoch, the end and any limit (--max-steps,
    --time-limit, Ctrl-C); a checkpoint at each check and every --checkpoint-every steps. Returns the run, for
    `export`. `sequences`, `checkpoints`: as `setup` takes them. The GEMM library the run picks stays the
    process's: a caller other than `train` holds `gemm.using` around fit and export."""
    run = setup(ns, sequences, checkpoints)
    with common.graceful_interrupt() as interrupt:  # Ctrl-C: stop after this step and export the best
        for epoch in range(run.pos.epoch, ns.epochs):
            batches = epoch_batches(run, epoch)
            n = len(batches)
            eval_at = {round(n * (i + 1) / ns.evals_per_epoch) for i in range(ns.evals_per_epoch)}
            ntoks = [int(t) for t in torch.stack([b.lengths.sum() for b in batches]).tolist()]  # one sync an epoch
            first = run.pos.batch if epoch == run.pos.epoch else 0
            if first == 0:
                run.carry = None
                grow_if_due(run, epoch)
            run.model.train()
            for bi in range(first, n):
                loss_value = step(run, batches[bi], ntoks[bi], epoch + bi / n)
                last_batch = bi == n - 1
                out_of_time = bool(ns.time_limit and run.seconds() >= ns.time_limit * 60)
                # every rank stops at the same step: one rank's clock or Ctrl-C stops them all
                at_limit = run.world.any(out_of_time or interrupt.requested) or bool(
                    ns.max_steps and run.pos.step >= ns.max_steps)
                if ns.eval_every:
                    evaluating = run.pos.step % ns.eval_every == 0
                else:
                    evaluating = (bi + 1) in eval_at if ns.evals_per_epoch else last_batch
                if evaluating or (last_batch and epoch == ns.epochs - 1) or at_limit:
                    evaluating = True
                    check(run, loss_value, epoch + (bi + 1) / n)
                periodic = bool(ns.checkpoint_every and run.pos.step % ns.checkpoint_every == 0)
                if evaluating or run.stop or at_limit or periodic:
                    run.pos.epoch, run.pos.batch = (epoch + 1, 0) if last_batch else (epoch, bi + 1)
                    checkpoint(run, with_carry=bool(ns.bptt) and not last_batch)
                if run.stop or at_limit:
                    run.stop = True
                    break
            if run.stop:
                break
    run.bar.close()
    return run
