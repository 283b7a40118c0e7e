"""`ChainFamily.next_token_filter` (what `/v1/completions` logprobs read): p(x_t | x_<t) against brute force over
every state path (float64), for every chain family, from the start and after a prefix."""

from __future__ import annotations

import math

import pytest
import torch

from latentlm.models.tagging_hmm import TaggingHMM
from tests.models.chain_brute import joint_tables, path_logprobs
from tests.models.test_hmm_families import FAMILIES, SEQS, V, make
from tests.models.test_tagging_hmm import tiny_tagger


def family_model(family: str, seed: int):
    """Every chain family with a next-token filter: the three HMM families, and a tagging HMM (words only)."""
    if family == "tagging_hmm":
        return TaggingHMM.from_tensors(*tiny_tagger(Z=3, V=V, seed=seed), dtype=torch.float64)
    return make(family, seed)


def brute_logprob(model, x: list[int]) -> float:
    """log p(x_1..x_T), summed over every state path."""
    if not x:
        return 0.0
    first, step = joint_tables(model)
    finite = [lp for lp in path_logprobs(first, step, x).values() if lp > -math.inf]
    return math.log(sum(math.exp(lp) for lp in finite)) if finite else -math.inf


@pytest.mark.parametrize("family", [*FAMILIES, "tagging_hmm"])
@pytest.mark.parametrize("seed", [0, 3])
def test_next_token_probabilities_are_the_brute_force_conditionals(family, seed):
    model = family_model(family, seed)
    filt = model.next_token_filter()
    assert filt is not None
    for seq in SEQS:
        for cut in range(len(seq)):  # the prefix through `after`, the rest step by step
            prefix, rest = seq[:cut], seq[cut:]
            pi = filt.after(prefix)
            for t, x in enumerate(rest):
                probs = filt.probs(pi)[0].double()
                assert probs.shape == (V,)
                assert probs.sum().item() == pytest.approx(1.0, abs=1e-9)
                seen = seq[: cut + t]
                want = [math.exp(brute_logprob(model, seen + [y]) - brute_logprob(model, seen)) for y in range(V)]
                assert probs.tolist() == pytest.approx(want, abs=1e-9), (family, seq, cut, t)
                pi = filt.step(pi, torch.tensor([x]))


@pytest.mark.parametrize("family", [*FAMILIES, "tagging_hmm"])
def test_rows_of_a_batch_step_independently(family):
    """Several rows at once (one per continuation) give what each row gives alone."""
    model = family_model(family, 1)
    filt = model.next_token_filter()
    pi = filt.start().expand(3, -1)
    xs = torch.tensor([[0, 5, 2], [3, 3, 1]])
    for step in xs:
        pi = filt.step(pi, step)
    for b in range(3):
        alone = filt.start()
        for step in xs:
            alone = filt.step(alone, step[b : b + 1])
        assert torch.allclose(filt.probs(pi)[b], filt.probs(alone)[0], atol=1e-12)
