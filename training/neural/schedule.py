"""The optimisation of the neural HMMs: AdamW as each paper trains, one clipped gradient step, the
budget-aware learning-rate schedule (--lr-anneal) and the parameters' moving average (--weight-average)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from latentlm.training import common

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings


def make_optimizer(model: nn.Module, lr: float, blocked: bool | None = None, weight_decay: float | None = None
                   ) -> torch.optim.Optimizer:
    """AdamW as the papers train, as the network declares it (`adamw`): blocked_hmm (Chiu & Rush) betas (0.9,
    0.999), no weight decay; rank_hmm (Yang et al.) betas (0.99, 0.999), weight decay 0.01 (`blocked` picks one
    of the two for a module that declares none). `weight_decay` (--weight-decay) replaces the family's decoupled
    weight decay on every parameter."""
    declared = getattr(model, "adamw", None)
    if declared is None or blocked is not None:
        declared = {"betas": (0.9, 0.999), "weight_decay": 0.0} if blocked else {"betas": (0.99, 0.999),
                                                                               "weight_decay": 0.01}
    betas = declared["betas"]
    if weight_decay is None:
        weight_decay = declared["weight_decay"]
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def update_average(average: dict[str, Tensor], model: nn.Module, decay: float, step: int) -> None:
    """One step of the parameters' exponential moving average (--weight-average D): average <- d average +
    (1 - d) params with d = min(D, (1 + step) / (10 + step)), so the first steps are not held at the
    initialisation. `average` maps parameter names to tensors of their shapes. O(parameters)."""
    d = min(decay, (1 + step) / (10 + step))
    pairs = list(model.named_parameters())
    torch._foreach_lerp_([average[n] for n, _ in pairs], [p.detach() for _, p in pairs], 1.0 - d)


@contextlib.contextmanager
def parameters_swapped(model: nn.Module, average: dict[str, Tensor] | None):
    """Within the block the model's parameters hold `average` (nothing happens for None); the trained
    parameters come back on exit, bit for bit."""
    if average is None:
        yield
        return
    params = dict(model.named_parameters())
    kept = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(average[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(kept[n])



MAX_GRAD_NORM = 5.0  # gradient clipping of the neural families (Chiu & Rush's and Yang et al.'s code alike)


def backward_clipped(model: nn.Module, opt: torch.optim.Optimizer, loss: Tensor,
                     reduce: Callable[[Iterable[nn.Parameter]], None] | None = None) -> Tensor:
    """A training step's gradients: zeroed, back-propagated from `loss`, zero-filled where a parameter was not
    used (`fill_missing_grads`), summed over the ranks by `reduce` (data-parallel: `World.sum_gradients`) and
    clipped to MAX_GRAD_NORM. Returns the total norm before clipping (a 0-dim tensor on the gradients' device:
    reading it waits on the device). `opt.step()` is the caller's."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    fill_missing_grads(model)
    if reduce is not None:
        reduce(model.parameters())
    return common.clip_grad_norm(model.parameters(), MAX_GRAD_NORM)


def fill_missing_grads(model: nn.Module) -> None:
    """Give every parameter the step did not use a zero gradient, as if it had been used: AdamW then moves it
    by its moments exactly as when the unused part was built and back-propagated zeros (a parameter with no
    gradient it would skip), so leaving out a part no row reads changes nothing in the trajectory."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def budget_used(ns: TrainSettings, step: int, epochs_done: float, seconds: float) -> float:
    """The fraction of the training budget spent: the largest of epochs, steps and wall time against their
    limits (a limit of 0 is no limit). Wall time makes it depend on the machine, as --time-limit does."""
    fractions = [epochs_done / ns.epochs if ns.epochs else 0.0]
    if ns.max_steps:
        fractions.append(step / ns.max_steps)
    if ns.time_limit:
        fractions.append(seconds / (ns.time_limit * 60))
    return min(max(fractions), 1.0)


def anneal_factor(used: float, fraction: float) -> float:
    """LR multiplier of the budget-aware schedule (--lr-anneal F): 1 until 1 - F of the budget is spent, then
    a linear fall to 0 at its end ("warmup-stable-decay" without the warm-up)."""
    return min(1.0, (1.0 - used) / fraction) if fraction > 0 else 1.0


def set_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's LR to its plateau-decayed base LR (`base_lr`, kept in the checkpointed groups) x factor."""
    for g in opt.param_groups:
        g["lr"] = g.setdefault("base_lr", g["lr"]) * factor


