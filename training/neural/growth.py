"""Growing a VL-HMM (`--split-at`): every state splits in two within its cluster, keeping the model's
distribution (the parameters, the AdamW moments, the best and averaged parameters alike)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from latentlm.training import common
from latentlm.training.neural.networks import VLHMM
from latentlm.training.neural.schedule import make_optimizer


def split_states(t: Tensor, M: int, k: int, axis: int) -> Tensor:
    """`t` with its state axis `axis` (M k states, cluster-major) doubled to M 2k: state j of cluster m becomes
    states 2j and 2j + 1 of cluster m, both copies of it. O(numel)."""
    before, after = t.shape[:axis], t.shape[axis + 1:]
    pairs = t.reshape(*before, M, k, 1, *after).expand(*before, M, k, 2, *after)
    return pairs.reshape(*before, M * 2 * k, *after)


def split_state_dict(model: VLHMM, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` (a state dict of `model`, or part of one) with every state axis doubled as `split_model`
    splits the model (no noise): the same distribution over twice the states. O(numel)."""
    axes = model.state_axes()
    return {n: split_states(v, model.M, model.k, axes[n]) if n in axes else v for n, v in params.items()}


def split_model(model: VLHMM, opt: torch.optim.Optimizer | None = None, best_state: dict[str, Tensor] | None = None,
                generator: torch.Generator | None = None, noise: float = 0.0
                ) -> tuple[VLHMM, torch.optim.Optimizer | None, dict[str, Tensor] | None]:
    """Every state of `model` split in two within its cluster (k -> 2k states per cluster). Without noise the
    new model is the same distribution: the copies share their parent's outgoing and emission distributions
    and halve its start and incoming transition probabilities (all logits are copied, so each softmax over
    the doubled states gives each copy half). `noise` adds N(0, (noise x std)^2) to the copies' state
    parameters (drawn from `generator`) to break their symmetry. The AdamW moments in `opt` and the
    parameters in `best_state` are split alike (`best_state` without noise: the same model, the same
    perplexity). Returns (model, optimizer over its parameters, best_state). O(Z h)."""
    M, k, axes = model.M, model.k, model.state_axes()
    device, dtype = model.word_cluster.device, model.state_emb.dtype
    new = VLHMM(model.V, model.word_cluster, M, 2 * k, model.h, model.state_embedding).to(device, dtype)
    split_all = functools.partial(split_state_dict, model)
    new.load_state_dict(split_all(model.state_dict()))
    if noise:
        with torch.no_grad():
            for name in axes:
                p = getattr(new, name)
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device) * (noise * float(p.std())))
    new_opt = None
    if opt is not None:
        state = opt.state_dict()
        index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        for name, axis in axes.items():
            moments = state["state"].get(index[name], {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    moments[key] = split_states(moments[key], M, k, axis)
        new_opt = make_optimizer(new, state["param_groups"][0]["lr"], blocked=True)
        new_opt.load_state_dict(state)
    if best_state is not None:
        best_state = split_all(best_state)
    return new, new_opt, best_state




def splits_done(states: int, model: VLHMM, splits: common.Splits) -> int:
    """How many of `splits` the model has made: `states` (the final count, --states) = its states x 2^(splits
    still to come)."""
    return len(splits) - (states // (model.M * model.k)).bit_length() + 1


def checkpoint_states(model: VLHMM, tensors: dict[str, Tensor]) -> int:
    """The number of states of the VL-HMM parameters in checkpoint `tensors`."""
    return int(tensors["model.state_emb"].shape[model.state_axes()["state_emb"]])
