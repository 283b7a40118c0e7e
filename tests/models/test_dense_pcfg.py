"""dense_pcfg and the tree engine against brute-force enumeration of every labelled binary tree (float64),
batching, limits, sampling, artifacts and `latentlm import-pcfg`."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from latentlm.models.dense_pcfg import DensePCFG, random_dense_pcfg
from latentlm.models.errors import ArtifactError, InputError, LimitExceeded, UnsupportedOperation
from latentlm.models.registry import load_artifact, save_artifact
from latentlm.models.results import SpanMarginals
from latentlm.models.tree import bracket, mbr_cky, relabel_leaves
from latentlm.models.vocab import Preprocessing, Vocabulary
from tests.models.tree_brute import brute, tree_string

V = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def make(seed: int, nt: int = 2, pt: int = 2, dtype=torch.float64, **kw) -> DensePCFG:
    t, cfg = random_dense_pcfg(nt, pt, V, seed=seed, **kw)
    return DensePCFG.from_tensors(t, {**cfg}, dtype=dtype)


def sentence(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1000 * n)
    return torch.randint(0, V, (n,), generator=g).tolist()


CASES = [(seed, n) for seed in range(2) for n in range(1, 6)]


@pytest.mark.parametrize("seed,n", CASES)
def test_everything_matches_brute_force(seed, n):
    model = make(seed, nt=2 if n == 5 else 3, pt=2)
    x = sentence(seed, n)
    ref = brute(model.start, model.rules, model.emit, x)
    # sentence probability
    [score] = model.op_score([x])
    assert score.logprob == pytest.approx(ref.logprob, abs=1e-10)
    assert score.num_tokens == n
    # span marginals (every span of width >= 2, the whole sentence included)
    [post] = model.op_posterior([x])
    got = {(d.start, d.end): d.prob for d in post.spans}
    assert set(got) == {(i, i + w) for w in range(2, n + 1) for i in range(n - w + 1)}
    for sp, p in got.items():
        assert p == pytest.approx(ref.marginals.get(sp, 0.0), abs=1e-10)
    probs = [d.prob for d in post.spans]
    assert probs == sorted(probs, reverse=True)
    # Viterbi: best labelled tree and its joint log-probability
    [vit] = model.op_decode([x], method="viterbi")
    assert vit.logprob == pytest.approx(ref.best_logprob, abs=1e-10)
    assert vit.tree == tree_string(ref.best_tree, model.symbol_name)
    # MBR: the bracketing with the largest summed marginals
    [mbr] = model.op_decode([x], method="mbr")
    assert mbr.expected_correct == pytest.approx(ref.mbr_score, abs=1e-9)
    assert {tuple(s) for s in mbr.spans} in ref.mbr_spans


def test_length_one_sentences():
    model = make(3)
    [s] = model.op_score([[2]])
    expected = float(model.start[model.nt:] @ model.emit[:, 2])
    assert s.logprob == pytest.approx(math.log(expected))
    assert model.op_posterior([[2]]) == [SpanMarginals([])]
    [m] = model.op_decode([[2]], method="mbr")
    assert m.tree == "(S (X 2))" and m.spans == []
    [v] = model.op_decode([[2]], method="viterbi")
    best = int((model.start[model.nt:] * model.emit[:, 2]).argmax())
    assert v.tree == f"(T{best} 2)"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 50), lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_batches_equal_one_at_a_time(seed, lengths):
    model = make(seed, nt=3, pt=2)
    seqs = [sentence(seed + i, n) for i, n in enumerate(lengths)]
    model.chart_elems = 300  # force several sub-batches per length
    together = model.op_score(seqs)
    alone = [model.op_score([s])[0] for s in seqs]
    for a, b in zip(together, alone, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-10)
    post = model.op_posterior(seqs, top_k=3)
    for s, p in zip(seqs, post, strict=True):
        q = model.op_posterior([s], top_k=3)[0]
        assert [d.prob for d in p.spans] == pytest.approx([d.prob for d in q.spans], abs=1e-12)
        assert len(p.spans) == min(3, len(s) * (len(s) - 1) // 2)
    for a, b in zip(model.op_decode(seqs, method="viterbi"), [model.op_decode([s], method="viterbi")[0] for s in seqs],
                    strict=True):
        assert a.tree == b.tree and a.logprob == pytest.approx(b.logprob, abs=1e-10)


def test_marginals_sum_to_expected_number_of_constituents():
    model = make(5, nt=3, pt=3)
    for n in (2, 6, 9):
        [p] = model.op_posterior([sentence(5, n)])
        assert sum(d.prob for d in p.spans) == pytest.approx(n - 1, abs=1e-9)


def test_float32_long_sentence_does_not_underflow():
    t, cfg = random_dense_pcfg(3, 3, 50, seed=1)
    m64 = DensePCFG.from_tensors(t, cfg, dtype=torch.float64)
    m32 = DensePCFG.from_tensors(t, cfg, dtype=torch.float32)
    x = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    [a], [b] = m64.op_score([x]), m32.op_score([x])
    assert math.isfinite(b.logprob) and b.logprob < -300  # far below float32's range as a probability
    assert b.logprob == pytest.approx(a.logprob, rel=1e-4)
    [v64], [v32] = m64.op_decode([x], method="viterbi"), m32.op_decode([x], method="viterbi")
    assert v32.logprob == pytest.approx(v64.logprob, rel=1e-4)


def test_limits_and_errors():
    model = make(0)
    model.max_length = 10
    with pytest.raises(LimitExceeded, match="max_length"):
        model.op_score([[0] * 11])
    with pytest.raises(InputError):
        model.op_score([[]])
    with pytest.raises(UnsupportedOperation, match="token_logprobs"):
        model.op_score([[0, 1]], token_logprobs=True)
    with pytest.raises(UnsupportedOperation, match="prefix"):
        model.op_sample(n=1, max_tokens=5, seed=0, prefix=[1])
    # a word no preterminal emits: score -inf, posterior/decode name the input
    t, cfg = random_dense_pcfg(2, 2, V, seed=0)
    t["emit"][:, 3] = 0
    t["emit"] /= t["emit"].sum(1, keepdim=True)
    m = DensePCFG.from_tensors(t, cfg, dtype=torch.float64)
    assert m.op_score([[0, 3]])[0].logprob == float("-inf")
    with pytest.raises(InputError, match=r"input\[1\]"):
        m.op_posterior([[0, 1], [0, 3]])
    with pytest.raises(InputError, match=r"input\[0\]"):
        m.op_decode([[3, 3, 1]], method="viterbi")


def test_validation_names_the_tensor(tmp_path):
    t, cfg = random_dense_pcfg(2, 3, V, seed=0)
    vocab = Vocabulary([f"w{i}" for i in range(V)], Preprocessing(unk=None, eos=None, add_eos=False))
    path = save_artifact(tmp_path, "g", "dense_pcfg", t, vocab, config=cfg)
    art = load_artifact(path)
    m = DensePCFG.from_tensors(art.tensors, art.config, dtype=torch.float64)
    assert m.op_score([[0, 1]]) == make(0, pt=3).op_score([[0, 1]])
    bad = dict(t, rules=t["rules"] * 1.01)
    with pytest.raises(ArtifactError, match="'rules'"):
        save_artifact(tmp_path, "bad", "dense_pcfg", bad, vocab, config=cfg)
    with pytest.raises(ArtifactError, match="'emit'"):
        save_artifact(tmp_path, "bad", "dense_pcfg", dict(t, emit=t["emit"][:, :2]), vocab, config=cfg)
    with pytest.raises(ArtifactError, match="'nt'"):
        save_artifact(tmp_path, "bad", "dense_pcfg", t, vocab, config={"pt": 3})


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled)."""
    stat, po, pe, cells = 0.0, 0.0, 0.0, 0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e >= 5:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
        else:
            po, pe = po + o, pe + e
    if pe > 0:
        stat, cells = stat + (po - pe) ** 2 / pe, cells + 1
    return float(chi2.sf(stat, cells - 1))


def sentence_probs(model, max_len: int, vocab: int) -> dict:
    """Exact p(x | length <= max_len) of every sentence up to max_len words (sampling rejects longer trees
    and a random grammar may put mass on infinite trees, so tests compare these conditionals)."""
    seqs = [list(x) for n in range(1, max_len + 1) for x in itertools.product(range(vocab), repeat=n)]
    probs = {tuple(s): math.exp(r.logprob) for s, r in zip(seqs, model.op_score(seqs), strict=True)}
    total = sum(probs.values())
    return {k: v / total for k, v in probs.items()}


def test_samples_follow_the_grammar():
    t, cfg = random_dense_pcfg(2, 2, 2, seed=4, leaf_bias=1.5)
    model = DensePCFG.from_tensors(t, cfg, dtype=torch.float64)
    N = 6000
    out = model.op_sample(n=N, max_tokens=60, seed=1)
    counts = collections.Counter(tuple(o.ids) for o in out if len(o.ids) <= 3)
    assert sum(counts.values()) > N / 3
    assert chi_square_pvalue(counts, sentence_probs(model, 3, 2), sum(counts.values())) > 1e-3
    # trees are consistent with their sentences, and the seed reproduces them
    for o in out[:50]:
        assert relabel_leaves(o.tree, [str(i) for i in o.ids]) == o.tree
    assert model.op_sample(n=20, max_tokens=60, seed=3) == model.op_sample(n=20, max_tokens=60, seed=3)


def test_sample_max_tokens_is_respected():
    model = make(2, nt=2, pt=2)
    out = model.op_sample(n=200, max_tokens=3, seed=0)
    assert all(1 <= len(o.ids) <= 3 for o in out)


def test_tree_helpers():
    assert bracket(3, {(0, 3): "S", (1, 3): "X"}, ["a", "b", "c"], ["P"] * 3) == "(S (P a) (X (P b) (P c)))"
    assert relabel_leaves("(S (X 0) (X 1))", ["the", "(dog)"]) == "(S (X the) (X -LRB-dog-RRB-))"
    m = torch.zeros(1, 3, 3, dtype=torch.float64)
    m[0, 1, 0] = 0.9  # span (0, 2)
    m[0, 1, 1] = 0.2  # span (1, 3)
    score, spans = mbr_cky(m)
    assert spans == [[(0, 3), (0, 2)]] and float(score) == pytest.approx(0.9)


# -- latentlm import-pcfg -------------------------------------------------------------------------------
TOY = """# a toy grammar
S -> NP VP 1.0
NP -> Det N 0.7
NP -> N N [0.3]
VP -> V NP 0.5
VP -> 'sleeps' 0.5   # lexical rules only: VP is then a preterminal -> error below
Det -> 'the' 0.6
Det -> 'a' 0.4
N -> 'dog' 0.5
N -> "cat" 0.5
V -> 'sees' 1.0
"""


def test_import_pcfg_errors_name_the_line(tmp_path):
    from latentlm.models.grammar_text import read_grammar

    def err(text: str, **kw) -> str:
        with pytest.raises(InputError) as e:
            read_grammar(text, **kw)
        return e.value.message

    assert err(TOY).startswith("line 6: symbol 'VP' has both binary and lexical")
    good = TOY.replace("VP -> 'sleeps' 0.5", "VP -> V N 0.5")
    assert "line 3: the rules of 'NP' sum to 1.1" in err(good.replace("[0.3]", "0.4"))
    assert err(good.replace("V NP", "V NQ")) == "line 5: unknown symbol 'NQ' (it has no rules)"
    assert err(good.replace("V -> 'sees' 1.0", "V -> 'sees' one")).startswith("line 11: the last field")
    assert err(good.replace("NP -> Det N 0.7", "NP -> Det 0.7")).startswith("line 3: unary rule NP -> Det")
    assert err(good + "X -> 'x' 1.0\n").startswith("line 12: symbol 'X' is unreachable")
    assert err(good + "N -> 'dog' 0.5\n").startswith("line 12: duplicate rule")
    assert err(good, start="Q") == "start symbol 'Q' has no rules"
    loop = "S -> S S 1.0\n"
    assert "derives no finite sentence" in err(loop)
    t, cfg, words = read_grammar(good)
    assert cfg["nt"] == 3 and cfg["pt"] == 3 and words == ["the", "a", "dog", "cat", "sees"]


def test_import_pcfg_cli_end_to_end(tmp_path, capsys):
    from latentlm import ops
    from latentlm.cli import main

    good = TOY.replace("VP -> 'sleeps' 0.5", "VP -> V N 0.5")
    f = tmp_path / "toy.pcfg"
    f.write_text(good)
    assert main(["import-pcfg", str(f), "--name", "toy", "--store", str(tmp_path)]) == 0
    assert main(["import-pcfg", str(f), "--name", "toy", "--store", str(tmp_path)]) == 2  # exists
    f.write_text(good.replace("0.6", "0.5"))
    assert main(["import-pcfg", str(f), "--name", "bad", "--store", str(tmp_path)]) == 2
    assert "line 7: the rules of 'Det' sum to 0.9" in capsys.readouterr().err
    model = ops.load_model(tmp_path, "toy", dtype="float64")
    seqs = ops.encode_inputs(model.vocab, ["the dog sees a cat", "dog cat sees cat dog"])
    [s1, s2] = ops.run(model, "score", seqs)
    assert s1["logprob"] == pytest.approx(math.log(1.0 * 0.7 * 0.6 * 0.5 * 0.5 * 1.0 * 0.7 * 0.4 * 0.5))
    [v1, _] = ops.run(model, "decode", seqs, method="viterbi")
    assert relabel_leaves(v1["tree"], model.vocab.decode(seqs[0])) == \
        "(S (NP (Det the) (N dog)) (VP (V sees) (NP (Det a) (N cat))))"
    [m1, _] = ops.run(model, "decode", seqs, method="mbr")
    assert m1["spans"] == [[0, 2], [0, 5], [2, 5], [3, 5]]
