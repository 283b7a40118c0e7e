"""Adding a chain family touches its own module: a toy HMM family declared here (its class, its view for constrained
inference, its tempered copy) and registered from this module (`registry.register`) answers constraint probabilities,
guide weights and the beam search, exact constrained sampling, plain sampling and completions through the operations
layer and the completions route, with nothing else changed. Checked against brute-force enumeration over state paths
on a tiny float64 model; the registry is left as it was."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from functools import cache
from typing import Any

import pytest
import torch
from torch import Tensor

from latentlm import ops
from latentlm.models import registry
from latentlm.models.base import Batch, ChainFamily, ChainOperations, tempered_rows
from latentlm.models.chain import Emit, RowLookup, Trans
from latentlm.models.chain_view import DenseView
from latentlm.models.checks import check_distribution, check_shape
from latentlm.models.sampling import CategoricalTable
from latentlm.models.vocab import Preprocessing, Vocabulary
from latentlm.ops import spec
from latentlm.ops.requests import CompletionRequest, ConstraintRequest, SampleRequest
from tests.models.test_sampling import chi_square_pvalue


class ToyChain(ChainFamily):
    """The toy family: an HMM whose emissions are stored by word, `by_word` (V, Z) (each column a state's
    distribution over the words), beside `start` (Z,) and `trans` (Z, Z)."""

    family = "toy_chain"
    operations = ChainOperations(ChainFamily.operations | {"constraint"})  # type: ignore[assignment]

    def __init__(self, start: Tensor, trans: Tensor, by_word: Tensor):
        self.start, self.trans, self.by_word = start, trans, by_word
        self.device, self.dtype = trans.device, trans.dtype

    @staticmethod
    def validate_tensors(tensors: dict[str, Tensor], config: dict[str, Any], vocab_size: int, where: str) -> None:
        Z = tensors["trans"].shape[0]
        check_distribution(check_shape(tensors, "start", (Z,), where), "start", 0, where)
        check_distribution(check_shape(tensors, "trans", (Z, Z), where), "trans", 1, where)
        check_distribution(check_shape(tensors, "by_word", (vocab_size, Z), where), "by_word", 0, where)

    @classmethod
    def from_tensors(cls, tensors, config, *, device="cpu", dtype=torch.float32, storage_dtype=None) -> ToyChain:
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        return cls(t["start"], t["trans"], t["by_word"].contiguous())

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    def chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        return self.start.expand(batch.ids.shape[0], -1), RowLookup(self.by_word, batch.ids), self.trans

    def log_chain(self, batch: Batch) -> tuple[Tensor, Emit, Trans]:
        return (self.start.log().expand(batch.ids.shape[0], -1), RowLookup(self.by_word.log(), batch.ids),
                self.trans.log())

    def state_ids(self, batch: Batch) -> Tensor:
        return torch.arange(self.num_states, device=self.device).expand(*batch.ids.shape, -1)

    def sampling_tables(self, temperature: float):
        return CategoricalTable(self.trans, temperature), CategoricalTable(self.by_word.T, temperature), None

    def constraint_view(self) -> DenseView:
        return DenseView(self, self.start, self.trans, self.by_word.T, self.by_word)

    def tempered_copy(self, temperature: float) -> ToyChain:
        rows = [tempered_rows(w, temperature, self.dtype) for w in (self.start[None], self.trans, self.by_word.T)]
        return ToyChain(rows[0][0], rows[1], rows[2].T.contiguous())


WORDS = ["a", "b", "c", "d"]
VOCAB = Vocabulary([*WORDS, "<eos>"], Preprocessing(unk=None))
A, B, C, D, EOS = range(5)
SPEC = {"include": [["a"]], "exclude": ["b c"], "min_tokens": 2, "max_tokens": 4}
PREFIX = [C, A]


def satisfies(y: tuple[int, ...]) -> bool:
    """The naive reading of SPEC: y ends with its only <eos>, 2 <= len(y) <= 4, "a" among its words, no "b c"."""
    words = y[:-1]
    return (y[-1] == EOS and EOS not in words and 2 <= len(y) <= 4 and A in words
            and not any(words[i: i + 2] == (B, C) for i in range(len(words) - 1)))


def tensors(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def dist(*shape: int, dim: int = -1) -> Tensor:
        w = torch.rand(*shape, generator=g, dtype=torch.float64) + 0.05
        return w / w.sum(dim, keepdim=True)

    return {"start": dist(3), "trans": dist(3, 3), "by_word": dist(len(VOCAB), 3, dim=0)}


@cache
def factors(temperature: float) -> tuple[list, list, list]:
    """(start, trans, emit (Z, V)) of `tensors()` as Python floats, each factor tempered by hand."""
    def rows(p: Tensor) -> list:
        w = p ** (1 / temperature)
        return (w / w.sum(-1, keepdim=True)).tolist()

    t = tensors()
    return rows(t["start"]), rows(t["trans"]), rows(t["by_word"].T)


@cache
def prefix_prob(x: tuple[int, ...], temperature: float = 1.0) -> float:
    """P(a sequence starts with x), summed over every state path."""
    start, trans, emit = factors(temperature)
    total = 0.0
    for path in itertools.product(range(3), repeat=len(x)):
        p = start[path[0]] * emit[path[0]][x[0]]
        for i in range(1, len(x)):
            p *= trans[path[i - 1]][path[i]] * emit[path[i]][x[i]]
        total += p
    return total


@cache
def continuations(temperature: float = 1.0) -> dict[tuple[int, ...], float]:
    """p(y | PREFIX) of every complete continuation y of at most 4 tokens."""
    base = prefix_prob(tuple(PREFIX), temperature)
    return {(*w, EOS): prefix_prob((*PREFIX, *w, EOS), temperature) / base
            for L in range(0, 4) for w in itertools.product(range(4), repeat=L)}


@pytest.fixture()
def toy(tmp_path):
    """The toy family registered and one model of it stored and loaded (float64); unregistered afterwards."""
    registry.register(ToyChain)
    try:
        registry.save_artifact(tmp_path, "toy", "toy_chain", tensors(), VOCAB, config={"num_states": 3})
        yield ops.load_model(tmp_path, "toy", dtype="float64")
    finally:
        registry.unregister("toy_chain")


def run(model: ops.LoadedModel, op: str, request: Any) -> dict[str, Any]:
    return spec.execute(spec.prepare(model, op, request))


def test_the_family_declares_constraint_and_its_cost(toy):
    assert registry.families_with("constraint")[-1] == "toy_chain" and "toy_chain" in registry.families(ChainFamily)
    assert "constraint" in spec.describe(toy)["operations"]
    call = spec.prepare(toy, "constraint", ConstraintRequest(model="toy", prefix=PREFIX, constraint=SPEC))
    assert call.cost > ops.SAMPLE_STEP_COST * SPEC["max_tokens"]  # the family's cost of the product recursion


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_constraint_probability_weights_and_beam_against_enumeration(toy, temperature):
    table = continuations(temperature)
    good = {y: p for y, p in table.items() if satisfies(y)}
    truth = sum(good.values())
    body = run(toy, "constraint", ConstraintRequest(model="toy", prefix=PREFIX, constraint=SPEC,
                                                    temperature=temperature, weights=True, beam=16, n_best=2))
    assert math.isclose(body["log_prob"], math.log(truth), abs_tol=1e-9)
    base = prefix_prob(tuple(PREFIX), temperature)
    for v in range(len(VOCAB)):  # P(C | prefix, v) = P(v, C | prefix) / p(v | prefix)
        p_v = prefix_prob((*PREFIX, v), temperature) / base
        want = sum(p for y, p in good.items() if y[0] == v) / p_v
        assert math.isclose(body["weights"][v], want, abs_tol=1e-9), v
    best = sorted(good.items(), key=lambda kv: -kv[1])[:2]
    assert body["certified"] and [c["ids"] for c in body["completions"]] == [list(y) for y, _ in best]
    for c, (_, p) in zip(body["completions"], best, strict=True):
        assert math.isclose(c["log_prob"], math.log(p), abs_tol=1e-9)


def test_constrained_samples_follow_the_exact_conditional(toy):
    n = 3000
    body = run(toy, "sample", SampleRequest(model="toy", n=n, max_tokens=4, seed=1, prefix=PREFIX, constraint=SPEC))
    draws = [tuple(d["ids"]) for d in body["data"]]
    assert all(satisfies(y) for y in draws)
    good = {y: p for y, p in continuations().items() if satisfies(y)}
    total = sum(good.values())
    assert chi_square_pvalue(Counter(draws), {y: p / total for y, p in good.items()}, n) > 1e-3


def test_plain_samples_follow_the_model(toy):
    """Ancestral samples of at most 3 tokens: complete ones (ending in <eos>) with p(y | prefix), the others with the
    probability of their 3 tokens as a prefix."""
    n = 3000
    body = run(toy, "sample", SampleRequest(model="toy", n=n, max_tokens=3, seed=2, prefix=PREFIX))
    draws = [tuple(d["ids"]) for d in body["data"]]
    base = prefix_prob(tuple(PREFIX))
    probs = {y: p for y, p in continuations().items() if len(y) <= 3}
    probs |= {w: prefix_prob((*PREFIX, *w)) / base for w in itertools.product(range(4), repeat=3)}
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-12) and set(draws) <= set(probs)
    assert chi_square_pvalue(Counter(draws), probs, n) > 1e-3


def test_completions_serve_the_family(toy):
    req = CompletionRequest(model="toy", prompt=PREFIX, max_tokens=4, n=8, seed=5, constraint=SPEC)
    body = run(toy, "completions", req)
    assert len(body["choices"]) == 8 and body["usage"]["completion_tokens"] > 0
    for c in body["choices"]:
        words = tuple(VOCAB.index[w] for w in c["text"].split())
        assert c["finish_reason"] == "stop" and satisfies((*words, EOS)), c


def test_the_registry_is_left_as_it_was():
    assert "toy_chain" not in registry.FAMILIES
    assert registry.families_with("constraint") == ["hmm", "blocked_hmm", "rank_hmm", "tagging_hmm"]
