"""`--reset-eos`: BPTT over running text where every `<eos>` ends a sentence and the next one starts from the
start distribution. The chunks' summed negative log-likelihood is then exactly the sum over sentences scored
one by one from the start distribution (the carry continues a sentence cut by a chunk boundary, and nothing
crosses an `<eos>`); the export keeps the trained start."""

from __future__ import annotations

import pytest
import torch

from latentlm.models.base import Batch
from latentlm.models.errors import InputError
from latentlm.models.kernels import blocked as blocked_kernels
from latentlm.training import neural
from latentlm.training.settings import resolve_settings
from tests.training.helpers import train_args

EOS = 0


def test_rows_are_cut_after_every_eos_into_pieces_in_row_order():
    b = Batch.from_lists([[3, 0, 4, 5, 0, 6], [7, 8, 9, 2, 0, 0]])
    pieces, first, last = neural.sentence_pieces(b, EOS)
    assert pieces.lengths.tolist() == [2, 3, 1, 5, 1]
    assert [row[:n].tolist() for row, n in zip(pieces.ids, pieces.lengths, strict=True)] == \
        [[3, 0], [4, 5, 0], [6], [7, 8, 9, 2, 0], [0]]
    assert first.tolist() == [0, 3] and last.tolist() == [2, 4]
    short = Batch.from_lists([[0, 5, 0], [6]])  # variable lengths: padding is never a piece
    pieces, first, last = neural.sentence_pieces(short, EOS)
    assert pieces.lengths.tolist() == [1, 2, 1] and first.tolist() == [0, 2] and last.tolist() == [1, 2]


def corpus(n: int, V: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist() + [EOS]
            for _ in range(n)]


@pytest.mark.parametrize("chunk", [1, 4, 9])
@pytest.mark.parametrize("state_dropout", [False, True])
@pytest.mark.parametrize("compiled", [True, False])
def test_chunks_with_reset_score_every_sentence_from_the_start(monkeypatch, chunk, state_dropout, compiled):
    """One stream cut into chunks of `chunk` tokens (a sentence may span several): with the carry and the reset,
    the chunks' NLL sums to the sentences' NLL, each sentence scored alone from the start distribution (under the
    same state-dropout mask); without the reset it does not (the state runs on through <eos>). On the compiled
    sweep and on the PyTorch path (what a GPU runs)."""
    if not compiled:
        monkeypatch.setattr(blocked_kernels, "HAVE_NUMBA", False)
    V, M, k = 12, 3, 4
    torch.manual_seed(0)
    model = neural.VLHMM(V, torch.arange(V) % M, M, k, 8, "tied").double()
    sentences = corpus(9, V, seed=chunk)
    active = neural.sample_state_dropout(M, k, 2, torch.Generator().manual_seed(1)) if state_dropout \
        else torch.arange(k).expand(M, k)
    with torch.no_grad():
        want, _ = neural.blocked_loss(model, Batch.from_lists(sentences), active)
        totals = {}
        for reset in (True, False):
            carry, total = None, 0.0
            for b in neural.bptt_batches(sentences, 1, chunk, "cpu"):
                nll, carry = neural.blocked_loss(model, b, active, carry, want_last=True, eos=EOS if reset else None)
                total += float(nll)
            totals[reset] = total
    assert totals[True] == pytest.approx(float(want), rel=1e-12)
    assert abs(totals[False] - float(want)) > 1e-3


def test_reset_eos_needs_bptt_and_is_refused_naming_the_field(tmp_path):
    with pytest.raises(InputError, match="--reset-eos: needs --family blocked_hmm with --bptt N") as e:
        resolve_settings(train_args(tmp_path, "blocked_hmm", reset_eos=True))
    assert e.value.param == "reset_eos"


@pytest.mark.parametrize("reset", [True, False])
def test_only_a_model_trained_without_the_reset_gets_the_state_after_eos_as_its_start(tmp_path, monkeypatch, reset):
    """Trained with --reset-eos every sentence began from the start distribution, so the export keeps the
    model's own start; trained without, the export's start is the state distribution after <eos>
    (`fix_start_for_streams`), at every check and at the end."""
    calls = []
    real = neural.fix_start_for_streams
    monkeypatch.setattr(neural.bptt, "fix_start_for_streams", lambda *a: calls.append(1) or real(*a))
    ns = resolve_settings(train_args(tmp_path, "blocked_hmm", name="m", states=8, clusters=2, hidden=8, bptt=6,
                                     batch=3, epochs=1, max_steps=12, eval_every=6, train_sentences=200,
                                     valid_sentences=50, reset_eos=reset))
    neural.train(ns)
    assert (len(calls) == 0) if reset else (len(calls) >= 2)


@pytest.mark.parametrize("state_dropout", [False, True])
def test_the_gradient_with_reset_and_carry_equals_autograd_through_the_forward(state_dropout):
    """The gradient of a chunk's NLL with --reset-eos and a carried state (every parameter of the model) equals
    autograd through the differentiable scaled forward over the same sentence pieces cut by hand: each row's
    first piece from its carried state (restricted to the active states and renormalised), every later piece
    from the start distribution."""
    from latentlm.models.blocked_hmm import Carried
    from tests.training.test_blocked_counts import autograd_nll

    V, M, k = 12, 3, 4
    torch.manual_seed(1)
    model = neural.VLHMM(V, torch.arange(V) % M, M, k, 8, "independent").double()
    batch = Batch.from_lists([[3, 5, EOS, 7, 2, EOS, 4], [6, 1, 8, 9, EOS, 10, 11]])
    g = torch.Generator().manual_seed(2)
    carry = Carried(torch.rand(2, k, generator=g, dtype=torch.float64), torch.tensor([1, 2]))
    kk = 2 if state_dropout else k
    active = neural.sample_state_dropout(M, k, kk, g) if state_dropout else torch.arange(k).expand(M, k)
    params = list(model.parameters())
    nll, _ = neural.blocked_loss(model, batch, active, carry, eos=EOS)
    got = torch.autograd.grad(nll, params, allow_unused=True)

    pieces = Batch.from_lists([[3, 5, EOS], [7, 2, EOS], [4], [6, 1, 8, 9, EOS], [10, 11]])
    kept = torch.stack([carry.state[b, active[carry.cluster[b]]] for b in range(2)])
    state = torch.zeros(5, kk, dtype=torch.float64)
    state[[0, 3]] = kept / kept.sum(1, keepdim=True)
    cluster = torch.zeros(5, dtype=torch.long)
    cluster[[0, 3]] = carry.cluster
    ls, lt, le = model.slot_matrices(active)
    ref = autograd_nll(ls, lt, le, model.slot_cluster, M, model.word_slot[pieces.ids], pieces.lengths,
                       Carried(state, cluster))
    want = torch.autograd.grad(ref, params, allow_unused=True)
    assert float(nll.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    for (name, p), a, b in zip(model.named_parameters(), got, want, strict=True):
        a = torch.zeros_like(p) if a is None else (a.to_dense() if a.is_sparse else a)
        b = torch.zeros_like(p) if b is None else b
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-11), name
