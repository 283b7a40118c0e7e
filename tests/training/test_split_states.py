"""Warm starts by splitting states (`--split-at`): the split VL-HMM is the same distribution (brute force over
every state path on a tiny model), its AdamW moments follow the parameters, and the settings are checked."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from latentlm.models.base import Batch
from latentlm.models.errors import InputError
from latentlm.training import neural
from latentlm.training.common import Splits, split_plan
from latentlm.training.settings import resolve_settings
from tests.training.helpers import train_args


def brute_force_logp(start: torch.Tensor, trans: torch.Tensor, emit: torch.Tensor, word_cluster: torch.Tensor,
                     M: int, words: list[int]) -> float:
    """log p(words) by enumerating every state path of the full (Z = M k) HMM, float64. O(Z^T)."""
    k = emit.shape[1]
    Z = M * k
    # a state z = m k + j emits word w with emit[w, j] when w's cluster is m, else 0
    full = torch.zeros(emit.shape[0], Z, dtype=torch.float64)
    for w in range(emit.shape[0]):
        m = int(word_cluster[w])
        full[w, m * k:(m + 1) * k] = emit[w].double()
    total = 0.0
    for path in itertools.product(range(Z), repeat=len(words)):
        p = float(start[path[0]]) * float(full[words[0], path[0]])
        for t in range(1, len(words)):
            p *= float(trans[path[t - 1], path[t]]) * float(full[words[t], path[t]])
        total += p
    return math.log(total)


@pytest.mark.parametrize("state_embedding", ["factored", "independent", "tied"])
def test_split_model_is_the_same_distribution(state_embedding):
    torch.manual_seed(0)
    V, M, k = 7, 2, 1
    wc = torch.tensor([0, 1, 0, 1, 0, 1, 1])
    model = neural.VLHMM(V, wc, M, k, 8, state_embedding).double()
    grown, _, _ = neural.split_model(model)
    assert (grown.M, grown.k) == (M, 2 * k)
    old = {n: t.double() for n, t in model.export_tensors().items()}
    new = {n: t.double() for n, t in grown.export_tensors().items()}
    # structure: each copy halves its parent's start and incoming mass and keeps its rows
    z = torch.arange(2 * M * k) // 2
    assert torch.allclose(new["start"], old["start"][z] / 2, atol=1e-6)
    assert torch.allclose(new["trans"], old["trans"][z][:, z] / 2, atol=1e-6)
    assert torch.allclose(new["emit"], old["emit"][:, torch.arange(2 * k) // 2], atol=1e-6)
    for words in ([0], [1, 2], [3, 0, 5], [6, 6, 1, 4]):
        a = brute_force_logp(old["start"], old["trans"], old["emit"], wc, M, words)
        b = brute_force_logp(new["start"], new["trans"], new["emit"], wc, M, words)
        assert abs(a - b) < 1e-5, (words, a, b)
    # and the training loss (full model, no dropout) agrees on a batch
    b = Batch.from_lists([[0, 4, 2, 5], [1, 3]])
    full_old = torch.arange(k).expand(M, k)
    full_new = torch.arange(2 * k).expand(M, 2 * k)
    nll_old, _ = neural.blocked_loss(model, b, full_old)
    nll_new, _ = neural.blocked_loss(grown, b, full_new)
    assert torch.allclose(nll_old.detach(), nll_new.detach(), atol=1e-9)


def test_split_carries_adam_moments_noise_and_best_state():
    torch.manual_seed(1)
    V, M, k = 12, 3, 2
    wc = torch.arange(V) % M
    model = neural.VLHMM(V, wc, M, k, 8, "independent")
    opt = neural.make_optimizer(model, 0.01, blocked=True)
    b = Batch.from_lists([[0, 1, 2, 3, 4], [5, 6, 7]])
    nll, _ = neural.blocked_loss(model, b, torch.arange(k).expand(M, k))
    nll.backward()
    opt.step()
    best = {n: v.clone() for n, v in model.state_dict().items()}
    moments = opt.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    before = {names[i]: {key: v.clone() for key, v in st.items() if torch.is_tensor(v)} for i, st in moments.items()}
    grown, gopt, gbest = neural.split_model(model, opt, best, torch.Generator().manual_seed(0), noise=0.01)
    gnames = [n for n, _ in grown.named_parameters()]
    assert gnames == names
    after = gopt.state_dict()["state"]
    for i, name in enumerate(gnames):
        axis = grown.state_axes().get(name)
        for key in ("exp_avg", "exp_avg_sq"):
            want = before[name][key]
            if axis is not None:
                want = want.repeat_interleave(2, dim=axis)  # copies of each state next to each other
            assert torch.equal(after[i][key], want), (name, key)
    assert gopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for name, axis in grown.state_axes().items():
        exact = best[name].repeat_interleave(2, dim=axis)
        assert torch.equal(gbest[name], exact)  # the best parameters split without noise
        moved = getattr(grown, name).detach() - model.state_dict()[name].repeat_interleave(2, dim=axis)
        assert 0 < float(moved.abs().max()) < 0.1 * float(exact.std())  # small noise breaks the copies' tie
    # training continues on the grown model
    nll, _ = neural.blocked_loss(grown, b, torch.arange(2 * k).expand(M, 2 * k))
    nll.backward()
    gopt.step()


def test_split_at_settings_are_checked(tmp_path):
    ok = resolve_settings(train_args(tmp_path, "blocked_hmm", states=64, clusters=4, epochs=5, split_at="3,1"))
    assert split_plan(ok) == Splits((1, 3))
    listed = resolve_settings(train_args(tmp_path, "blocked_hmm", states=64, clusters=4, epochs=5, split_at=None,
                                         config=_config(tmp_path, "split_at: [2, 4]\n")))
    assert split_plan(listed) == Splits((2, 4))
    shares = resolve_settings(train_args(tmp_path, "blocked_hmm", states=64, clusters=4, epochs=5, split_at="30%,10%"))
    assert split_plan(shares) == Splits((0.1, 0.3), by_budget=True)
    bad = [(dict(family="rank_hmm", states=64, rank=8, split_at="1"), "only blocked_hmm"),
           (dict(states=64, clusters=4, epochs=5, split_at="5"), "in [1, 5)"),
           (dict(states=64, clusters=4, epochs=5, split_at="0"), "in [1, 5)"),
           (dict(states=64, clusters=4, epochs=5, split_at="2,2"), "distinct"),
           (dict(states=64, clusters=4, epochs=5, split_at="two"), "comma-separated"),
           (dict(states=64, clusters=4, epochs=5, split_at="10%,2"), "comma-separated"),
           (dict(states=64, clusters=4, epochs=5, split_at="0%"), "between 0% and 100%"),
           (dict(states=64, clusters=4, epochs=5, split_at="100%"), "between 0% and 100%"),
           (dict(states=64, clusters=4, epochs=5, split_at="20%,20%"), "distinct"),
           (dict(states=48, clusters=4, epochs=5, split_at="1,2,3"), "--states 48"),
           (dict(states=16, clusters=4, epochs=5, split_at="1,2", state_dropout=0.7), "keep one")]
    for kw, message in bad:
        family = kw.pop("family", "blocked_hmm")
        with pytest.raises(InputError, match="--split-at") as e:
            resolve_settings(train_args(tmp_path, family, **kw))
        assert message in str(e.value) and e.value.param == "split_at"


def test_splits_fall_due_by_epoch_or_by_budget():
    by_epoch, by_budget = Splits((2, 5)), Splits((0.25, 0.5), by_budget=True)
    assert [by_epoch.due(0, e, 0.9) for e in (1, 2)] == [False, True]
    assert [by_epoch.due(1, e, 0.0) for e in (4, 5)] == [False, True]
    assert not by_epoch.due(2, 9, 1.0)  # both made
    assert [by_budget.due(0, 0, u) for u in (0.2, 0.25)] == [False, True]
    assert [by_budget.due(1, 0, u) for u in (0.3, 0.6)] == [False, True]
    assert by_epoch.describe(1) == " (x2 at epoch 5)" and by_budget.describe(0) == " (x2 at 25%, 50% of the budget)"
    assert by_budget.describe(2) == ""


def _config(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path
