"""Samples follow the model: chi-square tests against exact sequence probabilities (float64)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from latentlm.models.base import Batch
from tests.models.chain_brute import joint_tables
from tests.models.test_hmm_families import FAMILIES, make

V = 6


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square over cells with expected count >= 5 (others pooled)."""
    stat, pooled_o, pooled_e, cells = 0.0, 0.0, 0.0, 0
    for key, p in probs.items():
        e = n * p
        o = counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            cells += 1
        else:
            pooled_o += o
            pooled_e += e
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return float(chi2.sf(stat, cells - 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_unconditional_samples_follow_the_joint(family):
    model = make(family, 7, Z=2, M=2, k=1, m=2, r=2)
    n, T = 20000, 2
    s = model.sample(n, T, torch.Generator().manual_seed(0))
    first, step = joint_tables(model)
    probs = {}
    for z in itertools.product(range(model.num_states), repeat=T):
        for x in itertools.product(range(V), repeat=T):
            p = first[z[0], x[0]] * step[z[0], z[1], x[1]]
            probs[(z, x)] = p.item()
    counts: dict = {}
    for i in range(n):
        key = (tuple(s.states[i].tolist()), tuple(s.ids[i].tolist()))
        counts[key] = counts.get(key, 0) + 1
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    assert chi_square_pvalue(counts, probs, n) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_continuations_follow_the_conditional(family):
    model = make(family, 11, Z=3, M=2, k=2, m=3, r=2)
    prefix = [1, 4]
    n = 20000
    s = model.sample(n, 2, torch.Generator().manual_seed(1), prefix=prefix)
    cands = [list(c) for c in itertools.product(range(V), repeat=2)]
    logp, _ = model.score(Batch.from_lists([prefix + c for c in cands]))
    lp_prefix, _ = model.score(Batch.from_lists([prefix]))
    probs = {tuple(c): math.exp(lp - lp_prefix[0].item()) for c, lp in zip(cands, logp.tolist(), strict=True)}
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    counts: dict = {}
    for row in s.ids.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert chi_square_pvalue(counts, probs, n) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_seed_reproducible_and_stop_token(family):
    model = make(family, 5, dtype=torch.float32)
    a = model.sample(8, 20, torch.Generator().manual_seed(42), stop_id=0)
    b = model.sample(8, 20, torch.Generator().manual_seed(42), stop_id=0)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.states, b.states)
    for i in range(8):
        L = a.lengths[i].item()
        row = a.ids[i, :L].tolist()
        assert 0 not in row[:-1]
        assert L == 20 or row[-1] == 0
        assert (a.ids[i, L:] == -1).all()


def test_temperature_sharpens():
    model = make("hmm", 2, Z=3)
    g = torch.Generator().manual_seed(0)
    cold = model.sample(4000, 1, g, temperature=0.05)
    # at low temperature the first state is (nearly) always the most probable one
    top = int(model.start.argmax())
    assert (cold.states[:, 0] == top).float().mean() > 0.95


@pytest.mark.parametrize("use_alias", [True, False])
def test_categorical_table_frequencies(monkeypatch, use_alias):
    """Both samplers (alias tables, flat inverse CDF) reproduce every row's distribution, zeros included."""
    from latentlm.models.kernels.jit import HAVE_NUMBA
    from latentlm.models.sampling import CategoricalTable

    if use_alias and not HAVE_NUMBA:
        pytest.skip("alias tables need numba")
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(4, 7, generator=g, dtype=torch.float64) ** 3
    probs[:, 2] = 0.0
    probs /= probs.sum(1, keepdim=True)
    table = CategoricalTable(probs, alias=use_alias)
    n = 40000
    for r in range(4):
        draws = table.draw(torch.full((n,), r), g)
        counts = torch.bincount(draws, minlength=7)
        assert counts[2] == 0
        p = chi_square_pvalue({c: int(counts[c]) for c in range(7)}, {c: probs[r, c].item() for c in range(7)}, n)
        assert p > 1e-3
