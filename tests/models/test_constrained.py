"""Constraints (models.constraint) and exact inference on the HMM x automaton product (models.constrained), checked
by enumeration on tiny float64 models of every chain family.

The oracle shares no code with the compiler or the recursions: p(y | x) comes from brute-force state-path tables
(`chain_brute.joint_tables`, a plain forward over them), and whether y satisfies a constraint from a naive checker
(pyahocorasick over word-id tuples for phrases and first occurrences, slices for the suffix, Python's `re` on one
character per word for the regex)."""

from __future__ import annotations

import itertools
import math
import re
from functools import cache

import ahocorasick
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from latentlm.models import constrained as cn
from latentlm.models import constrained_sampling as cs
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.chain_view import DenseView
from latentlm.models.constraint import WordDFA, compile_constraint, parse_constraint
from latentlm.models.errors import InputError, LimitExceeded, UnsupportedOperation
from latentlm.models.hmm import DenseHMM
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.models.tagging_hmm import TaggingHMM
from latentlm.models.vocab import Preprocessing, Vocabulary
from tests.models.chain_brute import joint_tables
from tests.models.test_sampling import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["a", "b", "c", "d"]
VOCAB = Vocabulary([*WORDS, "<eos>"], Preprocessing(unk=None))
EOS = VOCAB.eos_id
CONTENT = [VOCAB.index[w] for w in WORDS]
LMAX = 6
FAMILIES = ["hmm", "blocked_hmm", "rank_hmm", "tagging_hmm"]
PREFIXES = [(), (1,), (2, 0)]


@cache
def model(family: str, seed: int = 0):
    V = len(VOCAB)
    if family == "hmm":
        return DenseHMM.from_tensors(*random_hmm(3, V, seed, concentration=0.7), dtype=torch.float64)
    if family == "blocked_hmm":
        return BlockedHMM.from_tensors(*random_blocked_hmm(2, 2, V, seed), dtype=torch.float64)
    if family == "rank_hmm":
        return RankHMM.from_tensors(*random_rank_hmm(4, 2, V, seed), dtype=torch.float64)
    t, c = random_hmm(3, V, seed + 100)
    g = torch.Generator().manual_seed(seed)
    tag = torch.rand(3, 2, generator=g, dtype=torch.float64) + 0.1
    t["tag_emit"] = tag / tag.sum(1, keepdim=True)
    return TaggingHMM.from_tensors(t, {**c, "tags": ["N", "V"]}, dtype=torch.float64)


# -- the oracle ---------------------------------------------------------------------------------------------
def _after(first, step, alpha, x):
    return first[:, x] if alpha is None else alpha @ step[:, :, x]


def prefix_prob(m, seq) -> float:
    """p(seq) as a prefix (a plain forward over the brute-force tables)."""
    first, step = joint_tables(m)
    alpha = None
    for x in seq:
        alpha = _after(first, step, alpha, x)
    return 1.0 if alpha is None else float(alpha.sum())


def enumerate_continuations(m, prefix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """p(y | prefix) under model m of every complete continuation y (content words then <eos>) of at most LMAX
    tokens."""
    first, step = joint_tables(m)
    alpha = None
    for x in prefix:
        alpha = _after(first, step, alpha, x)
    px = 1.0 if alpha is None else float(alpha.sum())
    out: dict[tuple[int, ...], float] = {}

    def dfs(alpha, u):
        out[(*u, EOS)] = float(_after(first, step, alpha, EOS).sum()) / px
        if len(u) + 1 < LMAX:
            for w in CONTENT:
                dfs(_after(first, step, alpha, w), (*u, w))

    dfs(alpha, ())
    return out


@cache
def continuations(family: str, prefix: tuple[int, ...], seed: int = 0) -> dict[tuple[int, ...], float]:
    return enumerate_continuations(model(family, seed), prefix)


def ids(phrase: str) -> tuple[int, ...]:
    return tuple(VOCAB.index[w] for w in phrase.split())


def regex_to_python(text: str) -> str:
    """The test grammar's regex (every token separated by spaces) as a Python pattern over chr(0xF0000 + id)."""
    out = []
    for tok in re.findall(r"\[[^\]]*\]|\S+", text):
        if tok.startswith("["):
            neg = tok.startswith("[^")
            body = "".join(chr(0xF0000 + VOCAB.index[w]) for w in tok[2 if neg else 1: -1].split())
            out.append(("[^" if neg else "[") + body + "]")
        elif tok in VOCAB.index:
            out.append(chr(0xF0000 + VOCAB.index[tok]))
        else:
            out.append(tok)  # . ( ) | * + ? {m,n}
    return "".join(out)


@cache
def phrase_matcher(groups: str, exclude: str) -> ahocorasick.Automaton:
    """pyahocorasick over word-id tuples: each include alternative tagged ("inc", group), each excluded phrase
    ("exc", -1) (arguments: the reprs of the lists, so that the automaton is built once per constraint)."""
    A = ahocorasick.Automaton(ahocorasick.STORE_ANY, ahocorasick.KEY_SEQUENCE)
    tags: dict[tuple[int, ...], list] = {}
    for g, alts in enumerate(eval(groups)):
        for alt in alts:
            tags.setdefault(ids(alt), []).append(("inc", g))
    for p in eval(exclude):
        tags.setdefault(ids(p), []).append(("exc", -1))
    for key, tag in tags.items():
        A.add_word(key, tag)
    A.make_automaton()
    return A


def naive_satisfies(spec: dict, y: tuple[int, ...]) -> bool:
    """Whether the complete continuation y satisfies the constraint `spec`, by brute force."""
    L = len(y)
    if not (spec.get("min_tokens", 1) <= L <= spec.get("max_tokens", 32)) or y[-1] != EOS or EOS in y[:-1]:
        return False
    u = y[:-1]
    groups = spec.get("include", [])
    first_end: dict[int, int] = {}
    excluded = False
    if groups or spec.get("exclude"):
        for end, found in phrase_matcher(repr(groups), repr(spec.get("exclude", []))).iter(u):
            for kind, g in found:
                if kind == "exc":
                    excluded = True
                elif g not in first_end:
                    first_end[g] = end
    if excluded or len(first_end) < len(groups):
        return False
    if spec.get("ordered") and any(first_end[g] > first_end[g + 1] for g in range(len(groups) - 1)):
        return False
    if spec.get("suffix"):
        s = ids(spec["suffix"])
        if len(u) < len(s) or u[len(u) - len(s):] != s:
            return False
    if spec.get("regex"):
        if re.fullmatch(regex_to_python(spec["regex"]), "".join(chr(0xF0000 + w) for w in u)) is None:
            return False
    return True


def exact(family: str, spec: dict, prefix: tuple[int, ...], seed: int = 0) -> tuple[float, int]:
    """(P(C | prefix) by enumeration, how many strings satisfy C whatever their probability)."""
    total, count = 0.0, 0
    for y, p in continuations(family, prefix, seed).items():
        if naive_satisfies(spec, y):
            total += p
            count += 1
    return total, count


def compiled(spec: dict) -> WordDFA:
    return compile_constraint(parse_constraint(spec, VOCAB), VOCAB)


# -- random constraints -------------------------------------------------------------------------------------
phrase = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2).map(" ".join)


@st.composite
def regexes(draw) -> str:
    def atom():
        kind = draw(st.sampled_from(["word", "word", "dot", "class", "neg"]))
        if kind == "word":
            return draw(st.sampled_from(WORDS))
        if kind == "dot":
            return "."
        ws = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=2, unique=True))
        return ("[^ " if kind == "neg" else "[ ") + " ".join(ws) + " ]"

    def piece():
        a = atom()
        if draw(st.booleans()):
            a = f"( {a} | {atom()} )"
        return a + draw(st.sampled_from(["", "", " *", " ?", " +", " {0,2}"]))

    return " ".join(piece() for _ in range(draw(st.integers(1, 3))))


@st.composite
def constraints(draw) -> dict:
    spec: dict = {}
    if draw(st.booleans()):
        spec["include"] = draw(st.lists(st.lists(phrase, min_size=1, max_size=2), min_size=1, max_size=3))
        spec["ordered"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["exclude"] = draw(st.lists(phrase, min_size=1, max_size=2))
    if draw(st.integers(0, 3)) == 0:
        spec["suffix"] = draw(phrase)
    if draw(st.integers(0, 2)) == 0:
        spec["regex"] = draw(regexes())
    lo = draw(st.integers(1, 3))
    spec["min_tokens"], spec["max_tokens"] = lo, draw(st.integers(lo, LMAX))
    return spec


SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- the automaton --------------------------------------------------------------------------------------------
@SETTINGS
@given(spec=constraints())
def test_automaton_accepts_exactly_what_the_naive_checker_accepts(spec):
    strings = [y for y in continuations("hmm", ()) if len(y) <= spec["max_tokens"]]
    truth = {y: naive_satisfies(spec, y) for y in strings}
    try:
        dfa = compiled(spec)
    except InputError as e:
        assert e.param == "constraint" and not any(truth.values())  # empty within the window
        return
    assert {y: dfa.satisfied(list(y)) for y in strings} == truth
    assert_minimal(dfa)


def assert_minimal(dfa: WordDFA) -> None:
    """No two states accept the same language: each pair is told apart by some word string (pair BFS)."""
    Q, C = dfa.delta.shape
    for p, q in itertools.combinations(range(Q), 2):
        seen, todo, apart = {(p, q)}, [(p, q)], False
        while todo and not apart:
            s, t = todo.pop()
            if s < 0 or t < 0 or dfa.accept[s] != dfa.accept[t]:
                apart = s != t
                continue
            for c in range(C if dfa.has_other else C - 1):
                nxt = (int(dfa.delta[s, c]), int(dfa.delta[t, c]))
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert apart, f"states {p} and {q} are equivalent"


def test_ordered_is_first_occurrence_not_concatenation():
    dfa = compiled({"include": [["a"], ["b"]], "ordered": True, "max_tokens": 6})
    a, b = VOCAB.index["a"], VOCAB.index["b"]
    assert dfa.satisfied([a, b, EOS]) and dfa.satisfied([a, a, b, a, EOS])
    assert not dfa.satisfied([b, a, b, EOS])  # concatenation of languages would accept it
    # ties: "c a" and "a" end together
    dfa = compiled({"include": [["c a"], ["a"]], "ordered": True, "max_tokens": 6})
    assert dfa.satisfied([VOCAB.index["c"], a, EOS])


def test_input_errors_name_the_field_and_the_word():
    with pytest.raises(InputError) as e:
        parse_constraint({"include": [["a", "stock"]]}, VOCAB)
    assert e.value.param == "constraint.include" and "'stock'" in e.value.message
    for key in ("suffix", "regex"):
        with pytest.raises(InputError) as e:
            parse_constraint({key: "a zebra"}, VOCAB)
        assert e.value.param == f"constraint.{key}" and "'zebra'" in e.value.message
    # an excluded phrase with a word outside the vocabulary can never occur: dropped, with a warning
    kept = parse_constraint({"exclude": ["zebra", "a", "b zebra"]}, VOCAB)
    assert kept.exclude == ((VOCAB.index["a"],),) and kept == parse_constraint({"exclude": ["a"]}, VOCAB)
    assert len(kept.warnings) == 2 and "constraint.exclude[0]" in kept.warnings[0] and "'zebra'" in kept.warnings[0]
    with pytest.raises(InputError) as e:
        parse_constraint({"exclude": ["zebra <eos>", "<eos>"]}, VOCAB)
    assert e.value.param == "constraint.exclude"
    with pytest.raises(InputError) as e:
        parse_constraint({"include": [["<eos>"]]}, VOCAB)
    assert e.value.param == "constraint.include"
    with pytest.raises(InputError) as e:
        parse_constraint({"colour": "red"}, VOCAB)
    assert e.value.param == "constraint.colour"
    with pytest.raises(InputError) as e:
        parse_constraint({"min_tokens": 4, "max_tokens": 3}, VOCAB)
    assert e.value.param == "constraint.max_tokens"
    with pytest.raises(InputError) as e:
        compiled({"include": [["a"]], "exclude": ["a"]})
    assert e.value.param == "constraint"
    with pytest.raises(InputError) as e:
        compiled({"regex": "a a a", "max_tokens": 3})  # needs 4 tokens with <eos>
    assert e.value.param == "constraint"
    with pytest.raises(InputError) as e:
        compiled({"regex": "( a"})
    assert e.value.param == "constraint.regex"


def test_automata_above_the_size_limit_are_refused_before_any_work():
    spec = parse_constraint({"include": [["a b c"], ["b c a"], ["c a b"], ["a c"], ["c b"]]}, VOCAB)
    with pytest.raises(LimitExceeded) as e:
        compile_constraint(spec, VOCAB, max_states=8)
    assert e.value.param == "constraint"
    with pytest.raises(LimitExceeded):
        parse_constraint({"max_tokens": 10**6}, VOCAB)


# -- exact probabilities ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=constraints(), which=st.integers(0, len(PREFIXES) - 1))
@example(spec={"include": [["a b", "c"], ["d"]], "ordered": True, "exclude": ["b b"], "suffix": "a",
               "regex": "( . )* d [^ b ] ( a | c ) *", "min_tokens": 2, "max_tokens": 6}, which=1)
@example(spec={"include": [["a"], ["b"], ["c"]], "exclude": ["d"], "min_tokens": 4, "max_tokens": 6}, which=2)
def test_log_prob_equals_enumeration(family, spec, which):
    prefix = PREFIXES[which]
    truth, count = exact(family, spec, prefix)
    try:
        dfa = compiled(spec)
    except InputError:
        assert count == 0
        return
    lp = cn.prepare(model(family), dfa).log_prob(list(prefix))
    if truth == 0:
        assert lp is None
    else:
        assert lp is not None and math.isclose(lp, math.log(truth), rel_tol=0, abs_tol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_identities(family):
    m = model(family)

    def P(spec):
        lp = cn.prepare(m, compiled({"min_tokens": 2, "max_tokens": 5, **spec})).log_prob([1])
        return 0.0 if lp is None else math.exp(lp)

    window = P({})
    assert math.isclose(window, sum(p for y, p in continuations(family, (1,)).items() if 2 <= len(y) <= 5),
                        rel_tol=1e-12)
    assert math.isclose(P({"include": [["c"]]}) + P({"exclude": ["c"]}), window, rel_tol=1e-12)
    both = P({"include": [["a"], ["b"]]})
    assert math.isclose(P({"include": [["a"], ["b"]], "ordered": True})
                        + P({"include": [["b"], ["a"]], "ordered": True}), both, rel_tol=1e-12)
    assert P({"include": [["a"], ["b"], ["c"]]}) <= both


# -- the guide -----------------------------------------------------------------------------------------------
GUIDE_SPEC = {"include": [["a b", "c"], ["d"]], "ordered": True, "exclude": ["b b"], "min_tokens": 3,
              "max_tokens": 5}


def guide_mismatch(family: str, spec: dict, prefix: tuple[int, ...], depth: int = 3) -> tuple[float, float]:
    """(largest |guide weight - brute-force P(C | x, h, v)| over every history h of up to `depth` tokens and every
    next token v, largest relative error of the identity sum_v p(v | x, h) g(v) = P(C | x, h) reported by the
    guide)."""
    m = model(family)
    msgs = cn.prepare(m, compiled(spec))
    satisfying = [(y, p) for y, p in continuations(family, prefix).items() if naive_satisfies(spec, y)]
    px = prefix_prob(m, prefix)
    worst = worst_identity = 0.0
    for n in range(depth + 1):
        for h in itertools.product(CONTENT, repeat=n):
            guide = cn.Guide(msgs, [list(prefix)])
            for t in h:
                guide.advance([t])
            g = guide.weights()[0]
            ph = prefix_prob(m, prefix + h) / px
            for v in [*CONTENT, EOS]:
                hv = (*h, v)
                phv = prefix_prob(m, prefix + hv) / px
                if phv == 0:
                    continue
                sat = sum(p for y, p in satisfying if y[: len(hv)] == hv)
                worst = max(worst, abs(float(g[v]) - sat / phv))
            p_next = torch.tensor([prefix_prob(m, prefix + h + (v,)) / px / ph for v in range(len(VOCAB))],
                                  dtype=torch.float64)
            lp = guide.log_prob()[0]
            total = float((p_next * g).sum())
            reported = 0.0 if lp is None else math.exp(lp)
            worst_identity = max(worst_identity, abs(total - reported) / max(reported, 1e-300))
    return worst, worst_identity


@pytest.mark.parametrize("family", FAMILIES)
def test_guide_weights_equal_brute_force_conditionals(family):
    weights, identity = guide_mismatch(family, GUIDE_SPEC, (2,))
    assert weights < 1e-12 and identity < 1e-9


# -- sampling ---------------------------------------------------------------------------------------------------
SAMPLE_SPEC = {"include": [["a"], ["b", "d c"]], "exclude": ["c c"], "min_tokens": 2, "max_tokens": 5}
OTHER_SPEC = {"include": [["a"]], "exclude": ["b"], "min_tokens": 2, "max_tokens": 5}  # c, d: class OTHER


def sample_pvalue(family: str, spec: dict, prefix: tuple[int, ...], n: int = 20000, seed: int = 0,
                  temperature: float = 1.0, method: str = "states") -> float:
    """p-value of the chi-square between n constrained samples and the exact conditional; every sample must
    satisfy the constraint."""
    msgs = cn.prepare(model(family), compiled(spec), temperature=temperature)
    draws = cs.sample(msgs, n, torch.Generator().manual_seed(seed), prefix=list(prefix), method=method)
    assert all(naive_satisfies(spec, tuple(y)) for y in draws)
    table = continuations(family, prefix) if temperature == 1.0 else tempered_continuations(family, prefix,
                                                                                           temperature)
    probs = {y: p for y, p in table.items() if naive_satisfies(spec, y)}
    total = sum(probs.values())
    counts: dict = {}
    for y in draws:
        counts[tuple(y)] = counts.get(tuple(y), 0) + 1
    return chi_square_pvalue(counts, {y: p / total for y, p in probs.items()}, n)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", cs.SAMPLING_METHODS)
def test_samples_satisfy_and_follow_the_exact_conditional(family, method):
    assert sample_pvalue(family, SAMPLE_SPEC, (1,), method=method) > 1e-3
    assert sample_pvalue(family, OTHER_SPEC, (), method=method, seed=1) > 1e-3


def test_sampling_a_constraint_of_probability_zero_names_constraint():
    t, c = random_hmm(3, len(VOCAB), 5)
    t["emit"][:, VOCAB.index["d"]] = 0  # the model never says "d"
    t["emit"] /= t["emit"].sum(1, keepdim=True)
    m = DenseHMM.from_tensors(t, c, dtype=torch.float64)
    msgs = cn.prepare(m, compiled({"include": [["d"]]}))
    assert msgs.log_prob() is None
    with pytest.raises(InputError) as e:
        cs.sample(msgs, 3, torch.Generator().manual_seed(0))
    assert e.value.param == "constraint"
    with pytest.raises(UnsupportedOperation):
        cn.view_of(object())


@cache
def tempered_continuations(family: str, prefix: tuple[int, ...], temperature: float):
    """Enumeration under the dense model with each factor tempered by hand (not by `ChainFamily.tempered`)."""
    assert family == "hmm"
    m = model(family)

    def rows(p):
        w = p ** (1 / temperature)
        return w / w.sum(-1, keepdim=True)

    return enumerate_continuations(DenseHMM(rows(m.start), rows(m.trans), rows(m.emit)), prefix)


def test_temperature_tempers_the_model_before_conditioning():
    assert sample_pvalue("hmm", SAMPLE_SPEC, (1,), temperature=0.6) > 1e-3
    assert sample_pvalue("hmm", SAMPLE_SPEC, (1,), temperature=0.6, method="tokens") > 1e-3
    msgs = cn.prepare(model("hmm"), compiled(SAMPLE_SPEC), temperature=0.6)
    probs = tempered_continuations("hmm", (1,), 0.6)
    truth = sum(p for y, p in probs.items() if naive_satisfies(SAMPLE_SPEC, y))
    assert math.isclose(msgs.log_prob([1]), math.log(truth), abs_tol=1e-9)


# -- beam search -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_certified_beam_results_are_the_most_probable_constrained_strings(family):
    spec = {"include": [["a"], ["c"]], "min_tokens": 2, "max_tokens": 6}
    msgs = cn.prepare(model(family), compiled(spec))
    ranked = sorted(((p, y) for y, p in continuations(family, (3,)).items() if naive_satisfies(spec, y)),
                    reverse=True)
    for beam in (2, 4, 16):
        res = cn.beam_search(msgs, prefix=[3], beam=beam, n_best=3)
        assert all(naive_satisfies(spec, tuple(r["ids"])) for r in res.results)
        assert [r["log_prob"] for r in res.results] == sorted((r["log_prob"] for r in res.results), reverse=True)
        if beam == 16:
            assert res.certified
        if res.certified:
            assert [tuple(r["ids"]) for r in res.results] == [y for _, y in ranked[:3]]
            for r, (p, _) in zip(res.results, ranked, strict=False):
                assert math.isclose(r["log_prob"], math.log(p), abs_tol=1e-9)
                assert math.isclose(r["log_prob_given"], math.log(p) - res.log_prob_constraint, abs_tol=1e-9)
        else:
            assert res.gap > 0


def test_cost_estimate_grows_with_the_work():
    m, dfa = model("hmm"), compiled(SAMPLE_SPEC)
    base = cn.estimate_cost(m, dfa)
    assert 0 < base < cn.estimate_cost(m, dfa, n_samples=100) < cn.estimate_cost(m, dfa, n_samples=1000)
    assert cn.estimate_cost(m, dfa, prefix_tokens=50) > base
    wide = DenseHMM.from_tensors(*random_hmm(64, len(VOCAB)))
    assert cn.estimate_cost(wide, dfa, n_samples=100, method="tokens") > cn.estimate_cost(wide, dfa, n_samples=100)
    need = cn.table_bytes(m, dfa)
    msgs = cn.prepare(m, dfa, max_bytes=need)
    assert msgs.nbytes() <= need
    with pytest.raises(LimitExceeded) as e:
        cn.prepare(m, dfa, max_bytes=need - 1)
    assert e.value.param == "constraint"


# -- mutations: the checks above fail when the conditioning is wrong ---------------------------------------------
def test_mutation_window_off_by_one_fails_the_probability_check(monkeypatch):
    spec = {"include": [["a"]], "min_tokens": 2, "max_tokens": 4}
    truth, _ = exact("hmm", spec, (1,))
    monkeypatch.setattr(cn, "eos_allowed", lambda j, lo, hi: lo < j + 1 <= hi)
    lp = cn.prepare(model("hmm"), compiled(spec)).log_prob([1])
    assert not math.isclose(lp, math.log(truth), abs_tol=1e-9)


def test_mutation_filter_not_updated_fails_the_guide_check(monkeypatch):
    monkeypatch.setattr(DenseView, "condition", lambda self, a, words: a)
    assert guide_mismatch("hmm", GUIDE_SPEC, (2,), depth=2)[0] > 1e-3


def test_mutation_masking_instead_of_conditioning_fails_the_chi_square(monkeypatch):
    """Sampling from the model restricted to tokens that can still satisfy C (a token mask, as grammar-constrained
    decoders do) satisfies C every time but draws from the wrong distribution."""
    exact_scores = cn.next_log_scores

    def masked(msgs, a, q, j):
        log_s = exact_scores(msgs, a, q, j)
        log_p = msgs.view.token_probs(a).double().log()
        return torch.where(log_s > -math.inf, log_p, -math.inf)

    monkeypatch.setattr(cn, "next_log_scores", masked)
    assert sample_pvalue("hmm", SAMPLE_SPEC, (1,), method="tokens") < 1e-3


def test_mutation_words_not_restricted_to_the_chosen_successor_fails_satisfaction(monkeypatch):
    """The state sampler draws an OTHER word by rejection; accepting any word breaks the constraint."""
    monkeypatch.setattr(cs, "_draw_other", lambda msgs, z, generator: msgs.view.draw_words(z, generator))
    with pytest.raises(AssertionError):
        sample_pvalue("hmm", OTHER_SPEC, (1,), n=2000)


def test_control_pruning_redundant_alternatives_changes_nothing(monkeypatch):
    """Dropping alternatives that contain another alternative is an optimisation: without it, same answers."""
    from latentlm.models import constraint as cons

    spec = {"include": [["a", "b a", "a c"], ["c"]], "exclude": ["d", "d d"], "max_tokens": 5}
    with_pruning = compiled(spec)
    monkeypatch.setattr(cons, "_prune", lambda phrases: sorted(set(phrases)))
    cons.clear_compiled()
    without = compiled(spec)
    cons.clear_compiled()
    assert with_pruning.sizes["aho_corasick_nodes"] < without.sizes["aho_corasick_nodes"]
    for y in continuations("hmm", ()):
        assert with_pruning.satisfied(list(y)) == without.satisfied(list(y))
    lp1 = cn.prepare(model("hmm"), with_pruning).log_prob()
    lp2 = cn.prepare(model("hmm"), without).log_prob()
    assert lp1 is not None and lp2 is not None and math.isclose(lp1, lp2, abs_tol=1e-12)


def test_float32_model_within_1e5_of_float64():
    t, c = random_hmm(16, len(VOCAB), 3)
    spec = {"include": [["a"], ["b"], ["c"], ["d"]], "min_tokens": 5, "max_tokens": 6}
    lp64 = cn.prepare(DenseHMM.from_tensors(t, c, dtype=torch.float64), compiled(spec)).log_prob([0])
    lp32 = cn.prepare(DenseHMM.from_tensors(t, c, dtype=torch.float32), compiled(spec)).log_prob([0])
    assert lp64 is not None and lp32 is not None and abs(lp32 - lp64) < 1e-5
    assert np.isfinite(lp64)


def test_blocked_model_stored_in_bfloat16_reads_its_matrix_in_slabs():
    """bfloat16 storage keeps only the rounded Z x Z matrix: the messages widen it a slab at a time and give what
    the float32 model with that rounded matrix gives."""
    t, c = random_blocked_hmm(3, 2, len(VOCAB), 4)
    stored16 = BlockedHMM.from_tensors(t, c, dtype=torch.float32, storage_dtype="bfloat16")
    assert stored16.trans.dtype == torch.bfloat16
    exact32 = BlockedHMM(stored16.start, stored16.trans.float(), stored16.emit, stored16.word_cluster, stored16.M)
    dfa = compiled(SAMPLE_SPEC)
    lp16 = cn.prepare(stored16, dfa).log_prob([1])
    lp32 = cn.prepare(exact32, dfa).log_prob([1])
    assert lp16 is not None and lp32 is not None and abs(lp16 - lp32) < 1e-5
    draws = cs.sample(cn.prepare(stored16, dfa), 200, torch.Generator().manual_seed(0), prefix=[1])
    assert all(naive_satisfies(SAMPLE_SPEC, tuple(y)) for y in draws)


def test_float32_with_a_large_vocabulary_sums_the_other_words_in_float64():
    """The OTHER words' emission mass sums 2 x 10^4 terms: accumulated in float32 it is off by ~1e-6 relative,
    which the backward compounds over the window (log P(C) 1.5e-6 away here); in float64, 3e-8."""
    V = 20001
    vocab = Vocabulary([f"w{i}" for i in range(V - 1)] + ["<eos>"], Preprocessing(unk=None))
    t, c = random_hmm(8, V, 0)
    t["emit"][:, -1] += 0.05
    t["emit"] /= t["emit"].sum(1, keepdim=True)
    dfa = compile_constraint(parse_constraint({"include": [["w1"], ["w2"]], "max_tokens": 20}, vocab), vocab)
    lp64 = cn.prepare(DenseHMM.from_tensors(t, c, dtype=torch.float64), dfa).log_prob()
    lp32 = cn.prepare(DenseHMM.from_tensors(t, c), dfa).log_prob()
    assert lp64 is not None and lp32 is not None and abs(lp32 - lp64) < 3e-7
