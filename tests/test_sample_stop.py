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


def first_text_stop(parts: list[bytes], stops: list[bytes]) -> tuple[int | None, bool]:
    """By definition: the tokens kept before the first stop text the bytes `parts` (one per token) spell: the
    occurrence whose last byte comes first (of those ending in the same token, the earliest start), and the
    tokens that end before it starts (None when no stop text occurs); and whether it spans tokens."""
    text, ends = b"", []
    for p in parts:
        text += p
        ends.append(len(text))
    hits = [(next(k for k, e in enumerate(ends) if e >= i + len(s)), i) for s in stops
            for i in range(len(text)) if text.startswith(s, i)]
    if not hits:
        return None, False
    token = min(k for k, _ in hits)
    start = min(i for k, i in hits if k == token)
    keep = sum(1 for e in ends if e <= start)
    return keep, keep < token and ends[token - 1] > start


PIECES = [b"a", b"b", b"ab", b"ba", b"", b"aab"]  # a toy tokenizer's bytes per id: stops often span tokens


@pytest.mark.parametrize("seed", range(300))
def test_text_stops_cut_before_the_first_stop_text_the_tokens_spell(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(PIECES)) for _ in range(rng.randint(0, 10))]
    texts = [bytes(rng.choice(b"ab") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
    sample = Sample(ids, states=list(range(len(ids))))
    got = ops.cut_at_stop(sample, [], None, 10, texts, lambda xs: [PIECES[i] for i in xs])
    keep, _ = first_text_stop([PIECES[i] for i in ids], texts)
    assert got.ids == ids[: len(ids) if keep is None else keep] and got.states == sample.states[: len(got.ids)]
    assert got.finish_reason == ("length" if keep is None else "stop")
    assert not any(t in b"".join(PIECES[i] for i in got.ids) for t in texts)


@pytest.mark.parametrize("prefix", [None, "The river"])
def test_text_stops_over_a_tokenizer_cut_where_the_decoded_text_spells_them(tmp_path, prefix):
    """A model over an LM's byte-level BPE: a text stop ends a sample where its decoded text spells it, whichever
    tokens spell it, and the sample is the one drawn without stops, cut there; its text never contains a stop."""
    from tests.helpers_tokenizer import make_tokenizer_hmm_store

    make_tokenizer_hmm_store(tmp_path, "tok", states=4, seed=3)
    model = ops.load_model(tmp_path, "tok")
    stops = ["an", "e", "ver"]
    raw = [s.encode() for s in stops]
    stopped = 0
    for seed in range(12):
        pids, full = ops.generate.draw(model, n=20, max_tokens=24, seed=seed, prefix=prefix, stop_at_eos=False)
        _, cut = ops.generate.draw(model, n=20, max_tokens=24, seed=seed, prefix=prefix, stop_at_eos=False,
                                   stop=stops)
        for f, c in zip(full, cut, strict=True):
            parts = model.vocab.piece_bytes(f.ids, pids or ())
            keep, _ = first_text_stop(parts, raw)
            assert c.ids == f.ids[: len(f.ids) if keep is None else keep]
            assert c.finish_reason == ("length" if keep is None else "stop")
            assert not any(s in b"".join(parts[: len(c.ids)]) for s in raw)
            stopped += keep is not None
    assert stopped > 20
