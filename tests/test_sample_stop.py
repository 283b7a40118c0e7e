"""`ops.cut_at_stop`, the stop sequences of sampling, against its definition on random token strings over a
three-letter alphabet (overlapping and nested stop sequences are then common)."""

from __future__ import annotations

import random

import pytest

from latentlm import ops
from latentlm.models.results import Sample


def occurs_within(ids: list[int], stops: list[list[int]], upto: int) -> bool:
    """Whether some stop sequence lies wholly within ids[:upto]."""
    return any(ids[i: i + len(s)] == s for s in stops for i in range(0, upto - len(s) + 1))


@pytest.mark.parametrize("seed", range(300))
def test_cut_at_stop_is_the_first_completed_stop_sequence(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
    stops = [[rng.randrange(3) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 4))]
    eos = 2 if rng.random() < 0.5 else None
    sample = Sample(ids, states=[10 + i for i in ids], tree="kept")
    got = ops.cut_at_stop(sample, stops, eos, max_tokens=12)
    keep = len(got.ids)
    assert got.ids == ids[:keep] and got.states == sample.states[:keep] and got.tree == "kept"
    if got.finish_reason == "stop":
        # a stop sequence starts where the sample was cut and completes at `end`, where none had completed before;
        # it is the longest completing there (the cut removes all of it)
        ends = [keep + len(s) for s in stops if ids[keep: keep + len(s)] == s]
        assert ends
        end = min(ends)
        assert not occurs_within(ids, stops, end - 1)
        assert all(not (len(s) > end - keep and ids[end - len(s): end] == s) for s in stops)
    else:
        assert keep == len(ids) and not occurs_within(ids, stops, len(ids))
        assert got.finish_reason == ("eos" if eos is not None and ids and ids[-1] == eos else "length")


@pytest.mark.parametrize("family", ["hmm", "blocked_hmm", "rank_hmm"])
def test_sampling_ends_at_stop_sequences_as_cutting_would(family):
    """Each chain family's sampler, told the stop sequences, ends a sample where its tokens complete one (and
    stops drawing once every sample has ended) with exactly the samples that drawing to `max_tokens` and
    cutting give: every step draws for all samples, so a sample's draws do not depend on when others end."""
    from latentlm.models.blocked_hmm import BlockedHMM
    from latentlm.models.hmm import DenseHMM
    from latentlm.models.rank_hmm import RankHMM
    from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm

    V = 6
    cls, (t, c) = {"hmm": (DenseHMM, random_hmm(5, V, seed=1)),
                   "blocked_hmm": (BlockedHMM, random_blocked_hmm(2, 3, V, seed=1)),
                   "rank_hmm": (RankHMM, random_rank_hmm(5, 3, V, seed=1))}[family]
    model = cls.from_tensors(t, c)
    for seed in range(5):
        stops = [[seed % V], [(seed + 1) % V, (seed + 2) % V]]
        for eos in (None, V - 1):
            full = model.op_sample(n=40, max_tokens=30, seed=seed, stop_id=eos)
            early = model.op_sample(n=40, max_tokens=30, seed=seed, stop_id=eos, stop_seqs=stops)
            cut = [ops.cut_at_stop(r, stops, eos, 30) for r in full]
            assert [ops.cut_at_stop(r, stops, eos, 30) for r in early] == cut
            assert all(len(e.ids) <= len(f.ids) for e, f in zip(early, full, strict=True))
