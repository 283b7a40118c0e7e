"""models.automata: regexes to minimal DFAs over character classes, checked by brute force against Python's `re`
on every string up to length 5 over a small alphabet (with a newline and a character the pattern never names), and
bounded: the adversarial patterns stop at the budget's states or deadline, and a cancelled budget stops."""

from __future__ import annotations

import itertools
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm.models.automata import Budget, CompileCancelled, SymbolDFA, compile_regex, estimate_regex, minimise
from latentlm.models.errors import InputError, LimitExceeded

ALPHABET = "ab\nc"  # c is never named by the generated patterns: it is of class `other`
STRINGS = ["".join(t) for n in range(6) for t in itertools.product(ALPHABET, repeat=n)]


def big() -> Budget:
    return Budget(100_000, 30.0, param="regex")


def agrees(pattern: str, dfa: SymbolDFA, strings: list[str] = STRINGS) -> list[str]:
    rx = re.compile(pattern)
    return [s for s in strings if dfa.accepts(s) != bool(rx.fullmatch(s))]


def check_minimal_and_trimmed(dfa: SymbolDFA) -> None:
    Q = dfa.num_states
    if Q == 1 and not dfa.accept[0]:
        assert (dfa.delta < 0).all()
        return
    again, _ = minimise(dfa.delta, dfa.accept)
    assert again.shape[0] == Q  # no two equivalent states
    # every state reaches an accepting one
    good = dfa.accept.copy()
    for _ in range(Q):
        good = good | np.concatenate([good, [False]])[dfa.delta].any(1)
    assert good.all()


ATOMS = st.sampled_from(["a", "b", ".", "[ab]", "[^a]", "[^ab]", "[a\n]", "(?:)", "\\n"])


def regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        rep = st.tuples(st.integers(0, 3), st.integers(0, 2)).map(lambda t: f"{{{t[0]},{t[0] + t[1]}}}")
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,}", "{0,}"])).map(
                lambda t: f"(?:{t[0]}){t[1]}"),
            st.tuples(inner, rep).map(lambda t: f"(?:{t[0]}){t[1]}"),
        )
    return st.recursive(ATOMS, extend, max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(regexes())
def test_the_dfa_accepts_exactly_what_re_fullmatch_accepts(pattern):
    dfa = compile_regex(pattern, big(), "regex")
    assert agrees(pattern, dfa) == []
    check_minimal_and_trimmed(dfa)


@pytest.mark.parametrize("pattern", [
    "a", "", "a*", "(ab|b){1,3}", ".*a.{3}", "[^a]b?", "a{0}", "(a|)", "((a.{0,2}){0,2}b){1,2}", "(a|b)*a(a|b){2}",
    "[^\n]*", "(?s).a", "(?i)A[^B]", "a{2,}b+", ".{0,3}|b", "((a?){2}){2}",
])
def test_known_patterns(pattern):
    dfa = compile_regex(pattern, big(), "regex")
    assert agrees(pattern, dfa) == []
    check_minimal_and_trimmed(dfa)


@pytest.mark.parametrize("pattern", ["ab*", "(a|b)*a(a|b){2}", "[^a]{1,3}b?", ".*a", "(ab|ba){0,2}"])
def test_agrees_with_interegular(pattern):
    import interegular
    fsm = interegular.parse_pattern(pattern).to_fsm()
    dfa = compile_regex(pattern, big(), "regex")
    assert [s for s in STRINGS if dfa.accepts(s) != fsm.accepts(s)] == []


def test_the_minimal_sizes():
    """The k-th symbol from the end needs 2^(k+1) states; a window of k + 1 states; the empty language one."""
    assert compile_regex(".*a.{4}", big()).num_states == 32
    assert compile_regex("a{5}", big()).num_states == 6
    empty = compile_regex("[^\\s\\S]", big())  # no character at all
    assert empty.num_states == 1 and not empty.accept[0] and (empty.delta < 0).all()
    d = compile_regex("[ab]c|[ab]d", big())
    assert d.classes["a"] == d.classes["b"] and d.other == 3  # a, b are never told apart: one class


def test_estimate_counts_positions_after_expanding_bounded_repeats():
    assert estimate_regex(".*a.{15}", "regex") == 17
    assert estimate_regex("(a.{0,20}){0,20}", "regex") == 420
    assert estimate_regex("((a|b){3}){4}", "regex") == 24
    assert estimate_regex("(a{5}){2,}", "regex") == 10  # X{2,}: X X+
    assert estimate_regex("(((a{0,200}){0,200}){0,200}){0,200}", "regex") == 200 ** 4  # no work done


def test_invalid_patterns_name_the_field():
    for bad in ["(", "a{2,1", "(?=a)b", "a)"]:
        with pytest.raises(InputError) as e:
            compile_regex(bad, big(), "constraint.regex")
        assert e.value.param == "constraint.regex"


@pytest.mark.parametrize("pattern", [".*a.{15}", "(a.{0,20}){0,20}", ".*a.{12}", "((a.{0,9}){0,9}){0,9}",
                                     "(((a|b){0,5}c){0,5}.){0,6}"])
def test_adversarial_patterns_stop_within_the_budget(pattern):
    t = time.monotonic()
    with pytest.raises(LimitExceeded) as e:
        compile_regex(pattern, Budget(2048, 1.0, param="constraint"), "constraint.regex")
    assert time.monotonic() - t < 2.0
    assert e.value.param == "constraint.regex"


def test_a_cancelled_budget_stops_at_the_next_check():
    flag = []
    budget = Budget(10 ** 9, 60.0, cancelled=lambda: bool(flag))
    t = time.monotonic()
    calls = 0

    def cancelled():
        nonlocal calls
        calls += 1
        return time.monotonic() - t > 0.2

    budget.cancelled = cancelled
    with pytest.raises(CompileCancelled):
        compile_regex("((a.{0,9}){0,9}){0,9}", budget)
    assert calls > 1 and time.monotonic() - t < 1.0


def test_budget_states_and_naming():
    b = Budget(10, 1.0, param="constraint")
    b.states(10, "x")
    with b.naming("constraint.regex"), pytest.raises(LimitExceeded) as e:
        b.states(11, "its automaton")
    assert e.value.param == "constraint.regex" and b.param == "constraint"
