"""The rank-space PCFG (`pcfg`): its O(n^3 r + n^2 r^2) inside pass equals the dense inside pass on the
grammar built from the same CPD, marginals / MBR match brute force, sampling follows the grammar,
artifacts are checked, and the family's refusals are clear."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.dense_pcfg import DensePCFG, dense_from_factors
from latentlm.models.errors import ArtifactError, LimitExceeded, UnsupportedOperation
from latentlm.models.pcfg import RankPCFG, random_pcfg
from latentlm.models.registry import load_artifact, save_artifact
from latentlm.models.vocab import Preprocessing, Vocabulary
from tests.models.test_dense_pcfg import chi_square_pvalue, sentence_probs
from tests.models.tree_brute import brute

V = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def make(seed: int, nt=3, pt=2, r=2, dtype=torch.float64, vocab=V) -> tuple[RankPCFG, DensePCFG]:
    """A rank-space grammar and the dense grammar of the same CPD."""
    t, cfg = random_pcfg(nt, pt, r, vocab, seed=seed)
    rules = dense_from_factors(t["start"], t["parent"], t["left"], t["right"])
    dense = DensePCFG.from_tensors({"start": t["start"], "rules": rules, "emit": t["emit"]},
                                   {"nt": nt, "pt": pt}, dtype=dtype)
    return RankPCFG.from_tensors(t, cfg, dtype=dtype), dense


def sentences(seed: int, lengths: list[int], vocab: int = V) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 100), nt=st.integers(1, 4), pt=st.integers(1, 4), r=st.integers(1, 5),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5))
def test_rank_inside_equals_dense_inside(seed, nt, pt, r, lengths):
    rank, dense = make(seed, nt, pt, r)
    seqs = sentences(seed, lengths)
    a, b = rank.op_score(seqs), dense.op_score(seqs)
    for x, y in zip(a, b, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-9)
    # span marginals (autograd through the rank-space pass) equal the dense ones
    for p, q in zip(rank.marginals(seqs), dense.marginals(seqs), strict=True):
        assert torch.allclose(p, q, atol=1e-9)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_marginals_and_mbr_match_brute_force(n):
    rank, dense = make(n, nt=2, pt=2, r=3)
    [x] = sentences(n, [n])
    ref = brute(dense.start, dense.rules, dense.emit, x)
    assert rank.op_score([x])[0].logprob == pytest.approx(ref.logprob, abs=1e-10)
    [post] = rank.op_posterior([x])
    for d in post.spans:
        assert d.prob == pytest.approx(ref.marginals.get((d.start, d.end), 0.0), abs=1e-10)
    [mbr] = rank.op_decode([x], method="mbr")
    assert mbr.expected_correct == pytest.approx(ref.mbr_score, abs=1e-9)
    assert {tuple(s) for s in mbr.spans} in ref.mbr_spans
    assert mbr.tree.startswith("(S ") and mbr.tree.count("(") == max(2 * n - 1, 2)


def test_batching_by_length_equals_one_at_a_time():
    rank, _ = make(7, nt=4, pt=3, r=4)
    seqs = sentences(7, [3, 1, 6, 3, 2, 6, 6, 1])
    rank.chart_elems = 200  # several sub-batches per length
    together = rank.op_score(seqs)
    for s, t in zip(seqs, together, strict=True):
        assert t.logprob == pytest.approx(rank.op_score([s])[0].logprob, abs=1e-10)
    dec = rank.op_decode(seqs, method="mbr")
    for a, b in zip(dec, [rank.op_decode([s], method="mbr")[0] for s in seqs], strict=True):
        assert a.tree == b.tree and a.spans == b.spans
        assert a.expected_correct == pytest.approx(b.expected_correct, abs=1e-12)


def test_float32_long_sentences_stay_finite_and_accurate():
    t, cfg = random_pcfg(10, 20, 8, 200, seed=3)
    m64 = RankPCFG.from_tensors(t, cfg, dtype=torch.float64)
    m32 = RankPCFG.from_tensors(t, cfg, dtype=torch.float32)
    seqs = sentences(0, [200, 150], vocab=200)
    a, b = m64.op_score(seqs), m32.op_score(seqs)
    for x, y in zip(a, b, strict=True):
        assert y.logprob < -800 and y.logprob == pytest.approx(x.logprob, rel=1e-4)
    short = [seqs[1][:60]]
    [p32], [p64] = m32.marginals(short), m64.marginals(short)
    assert torch.isfinite(p32).all() and (p32 - p64).abs().max() < 1e-3


def test_viterbi_is_refused_with_a_reason():
    rank, _ = make(0)
    assert rank.decode_methods == frozenset({"mbr"})
    with pytest.raises(UnsupportedOperation, match="no exact Viterbi") as e:
        rank.op_decode([[0, 1]], method="viterbi")
    assert e.value.param == "method"
    with pytest.raises(UnsupportedOperation, match="token_logprobs"):
        rank.op_score([[0, 1]], token_logprobs=True)


def test_length_limit_and_length_one():
    rank, dense = make(1)
    rank.max_length = 8
    with pytest.raises(LimitExceeded, match="max_length of 8"):
        rank.op_posterior([[0] * 3, [1] * 9])
    [s] = rank.op_score([[4]])
    assert s.logprob == pytest.approx(dense.op_score([[4]])[0].logprob, abs=1e-12)
    assert rank.op_decode([[4]], method="mbr")[0].tree == "(S (X 4))"


def test_samples_follow_the_grammar():
    rank, _ = make(11, nt=2, pt=2, r=2, vocab=2)
    N = 4000
    out = rank.op_sample(n=N, max_tokens=30, seed=0)
    counts = collections.Counter(tuple(o.ids) for o in out if len(o.ids) <= 3)
    assert sum(counts.values()) > N / 3
    assert chi_square_pvalue(counts, sentence_probs(rank, 3, 2), sum(counts.values())) > 1e-3
    assert all(o.tree.count("(") == 2 * len(o.ids) - 1 for o in out[:100])


def test_artifact_round_trip_and_checks(tmp_path):
    t, cfg = random_pcfg(3, 4, 5, V, seed=2)
    vocab = Vocabulary([f"w{i}" for i in range(V)], Preprocessing(unk=None, eos=None, add_eos=False))
    art = load_artifact(save_artifact(tmp_path, "p", "pcfg", t, vocab, config={**cfg, "max_length": 50}))
    m = RankPCFG.from_tensors(art.tensors, art.config)
    assert m.describe() == {"num_states": 7, "nt": 3, "pt": 4, "rank": 5, "max_length": 50}
    assert math.isfinite(m.op_score([[0, 1, 2]])[0].logprob)
    stale = dict(t, rank_left=t["rank_left"] * 0.9)
    with pytest.raises(ArtifactError, match="'rank_left'"):
        save_artifact(tmp_path, "q", "pcfg", stale, vocab, config=cfg)
    with pytest.raises(ArtifactError, match="'left'"):
        save_artifact(tmp_path, "q", "pcfg", dict(t, left=t["left"] * 2), vocab, config=cfg)
    with pytest.raises(ArtifactError, match="'max_length'"):
        save_artifact(tmp_path, "q", "pcfg", t, vocab, config={**cfg, "max_length": 0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    t, cfg = random_pcfg(10, 20, 8, 30, seed=0)
    cpu = RankPCFG.from_tensors(t, cfg, dtype=torch.float64)
    gpu = RankPCFG.from_tensors(t, cfg, dtype=torch.float64, device="cuda")
    seqs = sentences(0, [5, 12, 1], vocab=30)
    for a, b in zip(cpu.op_score(seqs), gpu.op_score(seqs), strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
    assert cpu.op_decode(seqs, method="mbr") == gpu.op_decode(seqs, method="mbr")
    assert len(gpu.op_sample(n=4, max_tokens=50, seed=0)) == 4


def test_served_through_ops(tmp_path):
    from latentlm import ops

    t, cfg = random_pcfg(3, 4, 5, V, seed=2)
    vocab = Vocabulary([f"w{i}" for i in range(V)], Preprocessing(unk=None, eos=None, add_eos=False))
    save_artifact(tmp_path, "p", "pcfg", t, vocab, config=cfg)
    model = ops.load_model(tmp_path, "p")
    seqs = ops.encode_inputs(model.vocab, ["w1 w2 w3", "w4", [0, 1]])
    rows = ops.run(model, "decode", seqs, method="mbr")
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[1]["tree"] == "(S (X 4))"
    with pytest.raises(UnsupportedOperation):
        ops.run(model, "decode", seqs, method="viterbi")
    [s] = ops.sample(model, n=1, max_tokens=50, seed=0)
    assert s["tokens"] == model.vocab.decode(s["ids"]) and s["tree"].startswith("(")


def test_training_smoke(tmp_path):
    import argparse

    from latentlm import ops
    from latentlm.training.pcfg import train
    from latentlm.training.settings import resolve_settings

    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(["the dog barks", "a cat sleeps", "the cat sees a dog", "dogs bark"] * 10) + "\n")

    def settings(**kw):
        return resolve_settings(argparse.Namespace(family="pcfg", data=[str(data)], nt=2, pt=3, rank=2, hidden=8,
                                                   epochs=2, batch=8, lr=0.01, device="cpu", seed=0, name="tiny",
                                                   store=tmp_path / "store", progress=False, **kw))

    path = train(settings(max_steps=3))
    assert (path / "curve.png").is_file()
    assert (tmp_path / "store" / ".train" / "tiny" / "state.json").is_file()
    model = ops.load_model(tmp_path / "store", "tiny")
    [r] = ops.run(model, "score", ops.encode_inputs(model.vocab, ["the dog sees a cat"]))
    assert math.isfinite(r["logprob"]) and r["num_tokens"] == 5
    train(settings(resume=True, max_steps=0))  # continue from the epoch-1 checkpoint to the end of epoch 2
    rows = ops.load_model(tmp_path / "store", "tiny").artifact.manifest["provenance"]["curve"]
    assert [row["epoch"] for row in rows] == [1, 2] and rows[1]["step"] > rows[0]["step"]


def test_marginal_memory_limit_is_a_clear_413():
    rank, _ = make(0, r=4)
    rank.marginal_elems = 1000
    assert rank.op_posterior([[0] * 5], top_k=1)[0].spans[0].prob == pytest.approx(1.0)
    with pytest.raises(LimitExceeded, match="marginal_elems"):
        rank.op_decode([[0] * 12], method="mbr")
