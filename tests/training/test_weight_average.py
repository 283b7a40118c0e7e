"""The parameters' moving average (`--weight-average`) and AdamW's weight decay (`--weight-decay`) of the
neural HMMs: the average's update, the swap in and out of the model, what a run evaluates and exports, the
split of the average with the model. Resuming with both: tests/training/test_resume.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from latentlm.models.base import Batch
from latentlm.training import common, neural
from latentlm.training.settings import resolve_settings
from tests.training.helpers import train_args
from tests.training.test_resume import tiny_corpus


def tiny_vlhmm(seed: int = 0, embedding: str = "tied") -> neural.VLHMM:
    torch.manual_seed(seed)
    return neural.VLHMM(12, torch.arange(12) % 3, 3, 2, 8, embedding)


def test_update_average_is_the_warmed_up_exponential_average():
    model = tiny_vlhmm()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: torch.randn_like(p) for n, p in params.items()}
    before = {n: a.clone() for n, a in average.items()}
    for step, decay in [(0, 0.99), (5, 0.99), (1000, 0.9)]:
        neural.update_average(average, model, decay, step)
        d = min(decay, (1 + step) / (10 + step))  # 0.1, 0.4, then the decay itself
        for n in params:
            want = d * before[n] + (1 - d) * params[n]
            assert torch.allclose(average[n], want, rtol=1e-6, atol=1e-7), (step, n)
            before[n] = average[n].clone()
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())  # the model is not touched


def test_parameters_swapped_puts_the_average_in_and_the_parameters_back_bit_for_bit():
    model = tiny_vlhmm()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: p + 0.5 for n, p in params.items()}
    b = Batch.from_lists([[0, 1, 2, 3], [4, 5]])
    full = torch.arange(model.k).expand(model.M, model.k)
    with torch.no_grad():
        raw = neural.blocked_loss(model, b, full)[0]
        with neural.parameters_swapped(model, average):
            assert all(torch.equal(p, average[n]) for n, p in model.named_parameters())
            averaged = neural.blocked_loss(model, b, full)[0]
    assert not torch.allclose(raw, averaged)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError), neural.parameters_swapped(model, average):
        raise RuntimeError  # an error inside still restores the parameters
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    with neural.parameters_swapped(model, None):  # no average: nothing happens
        assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("embedding", ["factored", "independent", "tied"])
def test_split_state_dict_splits_an_average_as_the_model(embedding):
    model = tiny_vlhmm(1, embedding)
    average = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    grown = neural.split_model(model)[0]
    split = neural.split_state_dict(model, average)
    assert split.keys() == average.keys()
    shapes = dict(grown.named_parameters())
    assert all(split[n].shape == shapes[n].shape for n in split)
    # the split average is the average of the split model: splitting is linear in the parameters
    halved = neural.split_state_dict(model, {n: p.detach() for n, p in model.named_parameters()})
    assert all(torch.equal(split[n], halved[n] * 0.5) for n in split)


def test_split_keeps_the_weight_decay():
    model = tiny_vlhmm(2, "independent")
    opt = neural.make_optimizer(model, 0.01, blocked=True, weight_decay=0.3)
    assert neural.make_optimizer(model, 0.01, blocked=True).param_groups[0]["weight_decay"] == 0.0
    assert neural.make_optimizer(model, 0.01, blocked=False).param_groups[0]["weight_decay"] == 0.01
    _, new_opt, _ = neural.split_model(model, opt)
    assert new_opt.param_groups[0]["weight_decay"] == 0.3


@pytest.mark.parametrize("family,kw", [
    ("blocked_hmm", dict(states=12, clusters=3, hidden=8, state_embedding="tied")),
    ("rank_hmm", dict(states=12, rank=4, hidden=8, dropout=0.0)),
])
def test_a_run_evaluates_and_exports_the_average(tmp_path, family, kw):
    """The checkpoint holds the raw parameters and their average apart; the best check's parameters and the
    artifact are the average's (the run ends at its one check after step 0, which beats the start)."""
    data = tiny_corpus(tmp_path)
    ns = resolve_settings(train_args(tmp_path, family, data=[data], epochs=1, batch=16, lr=0.05, max_steps=8,
                                     eval_every=0, checkpoint_every=0, patience=0, weight_average=0.8, **kw))
    neural.train(ns)
    ck = load_file(str(common.checkpoint_dir(tmp_path, ns.name) / "tensors.safetensors"))
    names = [k[4:] for k in ck if k.startswith("avg.")]
    assert names and all(f"model.{n}" in ck and f"best.{n}" in ck for n in names)
    assert any(not torch.allclose(ck[f"avg.{n}"], ck[f"model.{n}"]) for n in names)
    assert all(torch.equal(ck[f"best.{n}"], ck[f"avg.{n}"]) for n in names)
    # the artifact is the export of the averaged parameters
    model = neural.build(ns, *_vocab_and_train(ns))[0]
    model.load_state_dict({k[5:]: v for k, v in ck.items() if k.startswith("best.")})
    model.eval()
    want = model.export_tensors()
    got = load_file(str(tmp_path / ns.name / "weights.safetensors"))
    for key, t in want.items():
        assert torch.allclose(got[key].to(t.dtype), t, rtol=1e-5, atol=1e-6), key


def _vocab_and_train(ns):
    from latentlm.training.data import load_training_split

    vocab, train_seqs, _ = load_training_split(ns)
    return vocab, train_seqs
