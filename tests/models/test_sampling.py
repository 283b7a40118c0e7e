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
def test_unconditional_samples_follow_the_joint(family, sampler):
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
def test_continuations_follow_the_conditional(family, sampler):
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


@pytest.fixture(params=["alias", "chunked"])
def sampler(request, monkeypatch):
    """Each sampler of `CategoricalTable`: alias tables (numba) or the chunked inverse CDF (forced by a zero
    size limit on alias tables, as a table larger than `ALIAS_MAX_ENTRIES` gets)."""
    from latentlm.models import sampling
    from latentlm.models.kernels.jit import HAVE_NUMBA

    if request.param == "alias" and not HAVE_NUMBA:
        pytest.skip("alias tables need numba")
    if request.param == "chunked":
        monkeypatch.setattr(sampling, "ALIAS_MAX_ENTRIES", 0)
        monkeypatch.setattr(sampling, "TEMPERED_ALIAS_MAX_ENTRIES", 0)
    return request.param


def test_categorical_table_frequencies(sampler):
    """Both samplers reproduce every row's distribution, zeros included."""
    from latentlm.models.sampling import CategoricalTable

    g = torch.Generator().manual_seed(3)
    probs = torch.rand(4, 7, generator=g, dtype=torch.float64) ** 3
    probs[:, 2] = 0.0
    probs /= probs.sum(1, keepdim=True)
    table = CategoricalTable(probs)
    assert (table.cdf is None) == (sampler == "alias")
    n = 40000
    for r in range(4):
        draws = table.draw(torch.full((n,), r), g)
        counts = torch.bincount(draws, minlength=7)
        assert counts[2] == 0
        p = chi_square_pvalue({c: int(counts[c]) for c in range(7)}, {c: probs[r, c].item() for c in range(7)}, n)
        assert p > 1e-3


@pytest.mark.parametrize("C", [1, 2, 5, 16, 17, 50, 97])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("slab, builder", [(1 << 23, "compiled"), (7, "torch"), (1 << 23, "torch")])
def test_chunked_cdf_inverts_exactly(C, temperature, slab, builder, monkeypatch):
    """`ChunkedCDF.invert` maps u to the column a float64 inverse CDF over the whole row gives (u away from a
    boundary by 1e-9), for every chunk layout, with zero columns (a whole zero chunk, zeros at both ends),
    float32 storage read through strides (a transposed table) and temperature (weights p^(1/T)), chunk masses
    summed (and draws at T != 1 taken) by the compiled pass or by torch in one slab or many; a zero-probability
    column is never drawn."""
    from latentlm.models import sampling
    from latentlm.models.sampling import ChunkedCDF

    if builder == "compiled" and not sampling.HAVE_NUMBA:
        pytest.skip("the compiled pass needs numba")
    monkeypatch.setattr(sampling, "SLAB_ENTRIES", slab)
    monkeypatch.setattr(sampling, "HAVE_NUMBA", builder == "compiled")
    g = torch.Generator().manual_seed(C)
    probs = torch.rand(5, C, generator=g, dtype=torch.float64) ** 2
    probs[1, : C // 2] = 0.0  # zeros first, whole chunks of them
    probs[2, C // 2:] = 0.0 if C > 1 else probs[2, C // 2:]  # zeros last
    probs[3, ::3] = 0.0 if C > 2 else probs[3, ::3]
    probs = (probs / probs.sum(1, keepdim=True)).float().T.contiguous().T
    cdf = ChunkedCDF(probs, temperature)
    weights = torch.softmax(probs.double().log() / temperature, dim=1)
    cum = weights.cumsum(1)
    cum = cum / cum[:, -1:]
    u = torch.cat([torch.rand(4000, generator=g, dtype=torch.float64), torch.tensor([0.0, 1 - 2 ** -53])])
    for r in range(5):
        rows = torch.full(u.shape, r)
        got = cdf.invert(rows, u)
        assert torch.equal(got[:40], torch.cat([cdf.invert(rows[i: i + 1], u[i: i + 1]) for i in range(40)]))
        want = torch.searchsorted(cum[r], u, right=True).clamp(max=C - 1)
        clear = (cum[r][None, :] - u[:, None]).abs().min(1).values > 1e-9
        assert torch.equal(got[clear], want[clear])
        assert bool((weights[r][got] > 0).all())  # even at the edges (u = 0, u -> 1)


def test_tempered_draws_read_bfloat16_as_its_float32():
    """The compiled draws at a temperature other than 1 read a bfloat16 table (stored as its bits) exactly as
    the float32 table of the same values, threads or not."""
    from latentlm.models.kernels import alias
    from latentlm.models.kernels.jit import HAVE_NUMBA
    from latentlm.models.sampling import ChunkedCDF

    if not HAVE_NUMBA:
        pytest.skip("the compiled pass needs numba")
    g = torch.Generator().manual_seed(5)
    probs = (torch.rand(6, 300, generator=g) ** 4).to(torch.bfloat16)
    probs[2, 100:] = 0
    rows = torch.randint(0, 6, (3000,), generator=g)
    u = torch.rand(3000, generator=g, dtype=torch.float64)
    for temperature in (0.5, 2.0):
        want = ChunkedCDF(probs.float(), temperature).invert(rows, u)
        assert torch.equal(ChunkedCDF(probs, temperature).invert(rows, u), want)
        assert torch.equal(alias.tempered_draws(probs, rows, u, temperature, 1), want)
        assert bool((probs[rows, want] > 0).all())


def test_tables_built_per_request_are_alias_tables_only_when_small():
    """At a temperature other than 1 (tables built per request) a table gets alias tables only up to
    `TEMPERED_ALIAS_MAX_ENTRIES` (one row drawn by every sample: the first states); a larger one (a VL-HMM's
    emissions) is drawn by whole-row weighing, which builds nothing."""
    from latentlm.models.kernels.jit import HAVE_NUMBA
    from latentlm.models.sampling import ALIAS_MAX_ENTRIES, TEMPERED_ALIAS_MAX_ENTRIES, CategoricalTable

    if not HAVE_NUMBA:
        pytest.skip("alias tables need numba")
    small = torch.full((1, TEMPERED_ALIAS_MAX_ENTRIES), 1.0 / TEMPERED_ALIAS_MAX_ENTRIES)
    large = torch.full((4, TEMPERED_ALIAS_MAX_ENTRIES), 1.0 / TEMPERED_ALIAS_MAX_ENTRIES)
    assert 4 * TEMPERED_ALIAS_MAX_ENTRIES <= ALIAS_MAX_ENTRIES
    assert CategoricalTable(small, 0.7).cdf is None and CategoricalTable(large, 1.0).cdf is None
    assert CategoricalTable(large, 0.7).cdf is not None


def test_large_tables_are_drawn_in_place():
    """A table above `ALIAS_MAX_ENTRIES` keeps no copy of its probabilities: the chunked sampler holds a
    reference to them and O(R sqrt C) chunk masses."""
    from latentlm.models.sampling import ALIAS_MAX_ENTRIES, CategoricalTable

    C = 4096
    R = ALIAS_MAX_ENTRIES // C + 1
    probs = torch.full((R, C), 1.0 / C)
    table = CategoricalTable(probs)
    assert table.cdf is not None and table.cdf.probs is probs
    assert table.cdf.cum.shape == (R, 64)
    draws = table.draw(torch.arange(R), torch.Generator().manual_seed(0))
    assert draws.shape == (R,) and bool(((draws >= 0) & (draws < C)).all())


def shaped(probs: list[float], temperature: float, top_k: int | None, top_p: float | None) -> list[float]:
    """The definition of an LM sampler's shaping, written out: p^(1/T) renormalised; rank by (-p, index); keep
    the first top_k and the entries whose preceding mass is below top_p; renormalise."""
    w = [p ** (1 / temperature) if p > 0 else 0.0 for p in probs]
    w = [x / sum(w) for x in w]
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    keep, before = set(), 0.0
    for rank, i in enumerate(order):
        if (top_k is None or rank < top_k) and (top_p is None or before < top_p) and w[i] > 0:
            keep.add(i)
        before += w[i]
    w = [x if i in keep else 0.0 for i, x in enumerate(w)]
    return [x / sum(w) for x in w]


@pytest.mark.parametrize("family", ["hmm", "blocked_hmm"])
@pytest.mark.parametrize("temperature, top_k, top_p, prefix", [(1.0, 2, None, None), (1.0, None, 0.6, None),
                                                               (0.7, 3, 0.8, None), (2.0, None, 0.9, [1, 3])])
def test_predictive_sampling_matches_enumeration(family, temperature, top_k, top_p, prefix):
    """`top_k` / `top_p` sampling against brute force on a 4-word model, two tokens: every token is drawn from
    the shaped next-token distribution p(x_t | x_<t) (enumerated from dense matrices: a blocked model's as a
    dense HMM whose states emit only their cluster's words), and the states from p(z | x); the chi-square
    runs over the joint cells (x1, x2, z1, z2)."""
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.hmm import DenseHMM
    from latentlm.models.synthetic import random_blocked_hmm, random_hmm

    V = 4
    if family == "hmm":
        t, c = random_hmm(3, V, seed=7)
        model = DenseHMM.from_tensors(t, c, dtype=torch.float64)
        E = t["emit"].double()
    else:
        t, c = random_blocked_hmm(2, 2, V, seed=7)
        model = BlockedHMM.from_tensors(t, c, dtype=torch.float64)
        Z, k = 4, 2
        E = torch.zeros(Z, V, dtype=torch.float64)
        for x in range(V):
            cl = int(t["word_cluster"][x])
            E[cl * k: (cl + 1) * k, x] = t["emit"][x].double()
    A, Z = t["trans"].double(), E.shape[0]
    first = t["start"].double()
    for x in prefix or []:  # filter through the prefix: p(z_{T+1} | prefix)
        first = first * E[:, x]
        first = (first / first.sum()) @ A
    probs = {}
    p1 = shaped((first @ E).tolist(), temperature, top_k, top_p)
    for x1 in range(V):
        a1 = first * E[:, x1]
        if p1[x1] == 0:
            continue
        pi2 = (a1 / a1.sum()) @ A
        p2 = shaped((pi2 @ E).tolist(), temperature, top_k, top_p)
        for x2 in range(V):
            if p2[x2] == 0:
                continue
            joint = a1[:, None] * A * E[:, x2][None, :]  # p(z1, z2, x | prefix) up to a constant
            joint = joint / joint.sum()
            for z1 in range(Z):
                for z2 in range(Z):
                    if joint[z1, z2] > 0:
                        probs[(x1, x2, z1, z2)] = p1[x1] * p2[x2] * float(joint[z1, z2])
    n = 40000
    got = model.op_sample(n=n, max_tokens=2, seed=11, prefix=prefix, temperature=temperature, top_k=top_k,
                          top_p=top_p)
    counts: dict = {}
    for s in got:
        key = (*s.ids, *s.states)
        assert key in probs, key  # never a token the shaping removed, nor an impossible state
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, probs, n) > 1e-3


@pytest.mark.parametrize("family", ["hmm", "blocked_hmm", "rank_hmm"])
def test_a_prefix_of_probability_zero_is_refused(family):
    """A prefix the model gives probability 0 (a word no state emits) leaves nothing to continue: both samplers
    refuse it naming `prefix`, where they used to draw from NaN or all-zero weights."""
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.errors import InputError
    from latentlm.models.hmm import DenseHMM
    from latentlm.models.rank_hmm import RankHMM
    from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm

    V = 6
    if family == "hmm":
        t, c = random_hmm(3, V, seed=2)
        t["emit"][:, 2] = 0
        t["emit"] /= t["emit"].sum(1, keepdim=True)
        model = DenseHMM.from_tensors(t, c)
    elif family == "blocked_hmm":
        t, c = random_blocked_hmm(2, 2, V, seed=2)
        t["emit"][2] = 0  # word 2: no state of its cluster emits it
        cl = t["word_cluster"] == t["word_cluster"][2]
        t["emit"][cl] /= t["emit"][cl].sum(0, keepdim=True)
        model = BlockedHMM.from_tensors(t, c)
    else:
        t, c = random_rank_hmm(4, 2, V, seed=2)
        t["emit"][2] = 0
        t["emit"] /= t["emit"].sum(0, keepdim=True)
        model = RankHMM.from_tensors(t, c)
    shapings = [{}, {"top_k": 2}] if model.predictive_sampling else [{}]
    for shaping in shapings:
        with pytest.raises(InputError, match="prefix: has probability 0") as e:
            model.op_sample(n=2, max_tokens=3, seed=0, prefix=[1, 2], **shaping)
        assert e.value.param == "prefix"
        assert len(model.op_sample(n=2, max_tokens=3, seed=0, prefix=[1, 3], **shaping)) == 2
