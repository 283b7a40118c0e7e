"""Constraints over the text of a tokenizer-backed model (models.text_constraint), lifted to token ids, and exact
inference with such automata (models.constrained), checked by brute force on a small byte-level BPE.

The oracle shares no code with the compiler: every token sequence up to length 3 or 4 over a subset of the
vocabulary (tokens that spell " apple" whole or in pieces, tokens that start or end inside a word, the two bytes of
"é" alone, white space, punctuation) is decoded by the `tokenizers` library itself and checked with plain string
searches (explicit boundary tests), Python's `re` and `str.endswith`; probabilities come from brute-force state-path
tables (`chain_brute.joint_tables`) summed over every continuation."""

from __future__ import annotations

import itertools
import math
import re
from functools import cache

import numpy as np
import pytest
import torch

from latentlm.models import constrained as cn
from latentlm.models import constrained_sampling as cs
from latentlm.models import text_constraint as tc
from latentlm.models.automata import Budget
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.hmm import DenseHMM
from latentlm.models.rank_hmm import RankHMM
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm
from latentlm.models.tokenizer import TextTokenizer, vocab_for
from tests.helpers_tokenizer import EOS, make_bpe_tokenizer
from tests.models.chain_brute import joint_tables
from tests.models.test_sampling import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

HF = make_bpe_tokenizer(400)
TT = TextTokenizer.from_hf(HF)
VOCAB = vocab_for(TT, eos=EOS)
EOS_ID = VOCAB.eos_id


def tid(piece: bytes) -> int:
    ids = [i for i, b in enumerate(TT.token_bytes) if b == piece]
    assert ids, piece
    return ids[0]


# " apple" whole and as " a" + "pple", " a" + "p" + "p" + "le"; "s" (apples); "a" / "e" (inside a word); " river" and
# " r" + "iver"; " café", " c" + "afé", "é" and its two bytes alone (half a character: U+FFFD); space, ".", newline, "_"
SUB3 = [tid(b) for b in (b" apple", b" a", b"pple", b"p", b"le", b"s", b" river", b" r", b"iver", b" caf\xc3\xa9",
                         b" c", b"af\xc3\xa9", b"\xc3\xa9", b"\xc3", b"\xa9", b".", b" ", b"\n", b"_", b"a", b"e")]
SUB4 = [tid(b) for b in (b" apple", b" a", b"pple", b"p", b"le", b"s", b" river", b"\xc3", b"\xa9", b".", b" ",
                         b"_")]


@cache
def sequences(length: int) -> tuple[tuple[int, ...], ...]:
    sub = SUB4 if length == 4 else SUB3
    return tuple(s for n in range(length + 1) for s in itertools.product(sub, repeat=n))


@cache
def texts(length: int) -> dict[tuple[int, ...], str]:
    seqs = sequences(length)
    return dict(zip(seqs, HF.decode_batch([list(s) for s in seqs], skip_special_tokens=False), strict=True))


# -- the oracle ----------------------------------------------------------------------------------------------------
def ascii_word(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch == "_")


def include_word(ch: str) -> bool:
    """Word characters around an included phrase: ASCII letters, digits, _ and any non-ASCII character."""
    return ascii_word(ch) or not ch.isascii()


def whole_word_ends(text: str, phrase: str, is_word) -> list[int]:
    ends = []
    i = text.find(phrase)
    while i >= 0:
        j = i + len(phrase)
        if (i == 0 or not is_word(text[i - 1])) and (j == len(text) or not is_word(text[j])):
            ends.append(j)
        i = text.find(phrase, i + 1)
    return ends


def satisfies(spec: dict, text: str, tokens: int) -> bool:
    """The constraint on a complete continuation's text; `tokens` counts the final <eos>."""
    if not spec.get("min_tokens", 1) <= tokens <= spec.get("max_tokens", 32):
        return False
    firsts = []
    for group in spec.get("include", []):
        found = [e for alt in group for e in whole_word_ends(text, alt, include_word)]
        if not found:
            return False
        firsts.append(min(found))
    if spec.get("ordered") and firsts != sorted(firsts):
        return False
    if any(whole_word_ends(text, p, ascii_word) for p in spec.get("exclude", [])):
        return False
    if "regex" in spec and re.fullmatch(spec["regex"], text) is None:
        return False
    if not text.endswith(spec.get("suffix", "")):
        return False
    words = len(re.findall(r"[^ \t\n\r\f\v]+", text))
    return spec.get("min_words", 0) <= words <= spec.get("max_words", math.inf)


def compiled(spec: dict, **kw) -> tc.TextDFA:
    return tc.compile_text_constraint(tc.parse_text_constraint(spec), VOCAB, **kw)


SPECS = {
    "include": ({"include": [["apple"]], "max_tokens": 8}, 4),
    "ordered": ({"include": [["river"], ["apple", "café"]], "ordered": True, "max_tokens": 8}, 3),
    "groups+exclude": ({"include": [["apple"], ["river"]], "exclude": ["café"], "max_tokens": 8}, 3),
    "exclude": ({"exclude": ["apple", "é"], "max_tokens": 8}, 3),
    "regex": ({"regex": "( [a-z]+)+", "max_tokens": 8}, 3),
    "regex-chars": ({"regex": "[^\\n]{2,4}", "max_tokens": 8}, 3),
    "regex-utf8": ({"regex": "[^é]*é\\.?", "max_tokens": 8}, 3),
    "suffix": ({"suffix": "le.", "max_tokens": 8}, 3),
    "words": ({"min_words": 2, "max_words": 3, "max_tokens": 8}, 4),
    "mixed": ({"include": [["apple"]], "max_words": 2, "suffix": ".", "min_tokens": 3, "max_tokens": 4}, 4),
}


def mismatches(spec: dict, length: int, accepts) -> list[tuple[str, bool]]:
    """Every sequence over the subset: the oracle on its decoded text against `accepts(ids + [eos], text)`."""
    out = []
    for seq, text in texts(length).items():
        want = satisfies(spec, text, len(seq) + 1)
        if accepts([*seq, EOS_ID], text) != want:
            out.append((text, want))
    return out


@pytest.mark.parametrize("name", SPECS)
def test_every_token_sequence_is_accepted_iff_its_text_satisfies(name):
    spec, length = SPECS[name]
    dfa = compiled(spec)
    bad = mismatches(spec, length, lambda ids, text: dfa.satisfied(ids))
    assert not bad, (name, bad[:5], dfa.sizes)
    # conservative towards Python's Unicode words: accepted texts hold each included phrase, and no excluded one,
    # as (?<!\w)phrase(?!\w)
    for seq, text in texts(length).items():
        if dfa.satisfied([*seq, EOS_ID]):
            for group in spec.get("include", []):
                assert any(re.search(rf"(?<!\w){re.escape(p)}(?!\w)", text) for p in group), text
            for p in spec.get("exclude", []):
                assert not re.search(rf"(?<!\w){re.escape(p)}(?!\w)", text), text


def test_the_oracle_fails_an_automaton_of_canonical_tokenisations_only():
    """Mutation: a lift that accepts a sequence only when it is the tokenizer's own encoding of its text misses
    " a" + "pple" and the like: the brute-force comparison must see it."""
    spec, length = SPECS["include"]
    dfa = compiled(spec)

    def canonical(ids, text):
        return dfa.satisfied(ids) and HF.encode(text, add_special_tokens=False).ids == ids[:-1]

    bad = mismatches(spec, length, canonical)
    assert any(want and "apple" in text for text, want in bad)
    pieces = [tid(b" a"), tid(b"pple"), EOS_ID]
    assert dfa.satisfied(pieces) and not canonical(pieces, " apple")


def test_the_decoder_reads_invalid_utf8_as_python_does():
    """The regex over bytes against re.fullmatch on decode("utf-8", "replace"), on random byte strings rich in
    lead, continuation and invalid bytes (each maximal invalid piece is one U+FFFD)."""
    rng = np.random.default_rng(0)
    alphabet = np.array([0x61, 0x0A, 0xC3, 0xA9, 0xC2, 0x80, 0xBF, 0xE0, 0xA0, 0xED, 0x9F, 0xF0, 0x90, 0xF4, 0x8F,
                         0xF5, 0xC0, 0xE6, 0x97, 0xA5], dtype=np.uint8)
    for pattern in ["[^\\n]{0,3}", "(é|a\ufffd|\ufffd\\n)*", ".*[日é].*", "(\ufffd\ufffd|a)*"]:
        delta, accept = tc._regex_bytes(pattern, Budget(100000, 30.0))
        for _ in range(1500):
            data = bytes(rng.choice(alphabet, size=int(rng.integers(0, 7))))
            q = 0
            for b in data:
                q = int(delta[q, b])
                if q < 0:
                    break
            got = q >= 0 and bool(accept[q])
            assert got == (re.fullmatch(pattern, data.decode("utf-8", "replace")) is not None), (pattern, data)


def test_automaton_sizes_and_caching():
    spec = {"include": [["apple"], ["river"]], "max_words": 20, "max_tokens": 40}
    dfa = compiled(spec)
    assert compiled(spec) is dfa  # cached per (tokenizer, constraint, limits)
    assert dfa.num_states == dfa.sizes["states"] and dfa.num_classes == dfa.sizes["classes"]
    assert (dfa.cls[EOS_ID] == -1) and (dfa.cls[np.arange(len(VOCAB)) != EOS_ID] >= 0).all()
    sizes = np.bincount(dfa.cls[dfa.cls >= 0], minlength=dfa.num_classes)
    assert (sizes > 0).all()  # every class holds a token
    assert ((dfa.class_words >= 0) == (sizes == 1)).all()


def test_errors_name_the_field():
    with pytest.raises(InputError) as e:
        tc.parse_text_constraint({"include": [["apple", ""]]})
    assert e.value.param == "constraint.include"
    with pytest.raises(InputError) as e:
        tc.parse_text_constraint({"min_words": 3, "max_words": 2})
    assert e.value.param == "constraint.max_words"
    with pytest.raises(InputError) as e:
        tc.parse_text_constraint({"words": 3})
    assert e.value.param == "constraint.words"
    with pytest.raises(InputError) as e:
        compiled({"include": [["apple"]], "exclude": ["apple"]})
    assert e.value.param == "constraint"
    with pytest.raises(InputError) as e:  # 2 content tokens cannot hold 5 words... they can (" a a"): 40 cannot
        compiled({"min_words": 40, "max_tokens": 3})
    assert e.value.param == "constraint"
    with pytest.raises(LimitExceeded) as e:
        compiled({"include": [["apple"], ["river"], ["café"]], "max_words": 60, "max_tokens": 80}, max_states=100)
    assert e.value.param == "constraint"
    with pytest.raises(LimitExceeded) as e:
        compiled({"regex": ".*a.{15}"}, seconds=5.0)
    assert e.value.param == "constraint.regex"


def test_a_phrase_no_token_sequence_spells_is_refused_naming_it():
    """A byte-level BPE trained on ASCII text without the 256-byte alphabet has no token for "é"'s bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["the apple fell in the river", "a quick brown fox"] * 5,
                           trainers.BpeTrainer(vocab_size=80, special_tokens=[EOS], show_progress=False))
    vocab = vocab_for(TextTokenizer.from_hf(hf), eos=EOS)
    assert tc.compile_text_constraint(tc.parse_text_constraint({"include": [["river"]]}), vocab).num_states > 1
    with pytest.raises(InputError) as e:
        tc.compile_text_constraint(tc.parse_text_constraint({"include": [["river"], ["x", "café"]]}), vocab)
    assert e.value.param == "constraint.include" and "café" in str(e.value)
    with pytest.raises(InputError) as e:
        tc.compile_text_constraint(tc.parse_text_constraint({"suffix": "Zürich"}), vocab)
    assert e.value.param == "constraint.suffix"


# -- exact inference ---------------------------------------------------------------------------------------------
PROB_SUB = [tid(b) for b in (b" apple", b" a", b"pple", b"le", b" river", b".", b" ", b"\xc3")]
LMAX = 5
PROB_SPECS = [
    {"include": [["apple"]], "max_tokens": LMAX},
    {"include": [["river"], ["apple"]], "ordered": True, "max_tokens": LMAX},
    {"exclude": ["apple"], "min_words": 1, "max_words": 2, "max_tokens": LMAX},
    {"regex": "( [a-z]+)*\\.", "min_tokens": 2, "max_tokens": LMAX},
    {"suffix": "le.", "max_tokens": LMAX},
]
FAMILIES = ["hmm", "blocked_hmm", "rank_hmm"]


@cache
def model(family: str, seed: int = 0):
    """A tiny model over the 400 ids whose emissions are 0 outside PROB_SUB + <eos> (exact zeros: the enumeration
    over that subset is then every continuation)."""
    V = len(VOCAB)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[[*PROB_SUB, EOS_ID]] = True
    if family == "hmm":
        t, c = random_hmm(3, V, seed, concentration=0.7)
        e = t["emit"] * keep
        t["emit"] = e / e.sum(1, keepdim=True)
        return DenseHMM.from_tensors(t, c, dtype=torch.float64)
    if family == "blocked_hmm":
        t, c = random_blocked_hmm(2, 2, V, seed)
        wc = t["word_cluster"]
        wc[[*PROB_SUB, EOS_ID]] = torch.arange(len(PROB_SUB) + 1) % 2
        e = torch.rand(V, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * keep[:, None]
        for m in range(2):
            e[wc == m] /= e[wc == m].sum(0, keepdim=True)
        t["emit"], t["word_cluster"] = e, wc
        return BlockedHMM.from_tensors(t, c, dtype=torch.float64)
    t, c = random_rank_hmm(4, 2, V, seed)
    e = t["emit"] * keep[:, None]
    t["emit"] = e / e.sum(0, keepdim=True)
    return RankHMM.from_tensors(t, c, dtype=torch.float64)


def prefix_prob(family: str, seq: tuple[int, ...]) -> float:
    """p(seq) as a prefix: a plain forward over the brute-force tables."""
    first, step = joint_tables(model(family))
    alpha = None
    for x in seq:
        alpha = first[:, x] if alpha is None else alpha @ step[:, :, x]
    return 1.0 if alpha is None else float(alpha.sum())


@cache
def continuations(family: str, prefix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """p(y | prefix) of every complete continuation of at most LMAX tokens over PROB_SUB (brute-force tables)."""
    first, step = joint_tables(model(family))

    def after(alpha, x):
        return first[:, x] if alpha is None else alpha @ step[:, :, x]

    alpha = None
    for x in prefix:
        alpha = after(alpha, x)
    px = prefix_prob(family, prefix)
    out = {}

    def dfs(alpha, u):
        out[(*u, EOS_ID)] = float(after(alpha, EOS_ID).sum()) / px
        if len(u) + 1 < LMAX:
            for w in PROB_SUB:
                dfs(after(alpha, w), (*u, w))

    dfs(alpha, ())
    return out


def text_of(ids) -> str:
    return HF.decode([i for i in ids if i != EOS_ID], skip_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", range(len(PROB_SPECS)))
def test_probability_and_next_token_weights_equal_enumeration(family, k):
    spec = PROB_SPECS[k]
    msgs = cn.prepare(model(family), compiled(spec))
    for prefix in [(), (tid(b" a"),), (tid(b"pple"), tid(b" "))]:
        conts = continuations(family, prefix)
        good = {y: p for y, p in conts.items() if satisfies(spec, text_of(y), len(y))}
        want = sum(good.values())
        got = msgs.log_prob(list(prefix))
        assert got is not None and math.isclose(math.exp(got), want, rel_tol=1e-10), (prefix, want, got)
        # g(v) = P(C | x, y, v) after every y of at most one token, for every token of the subset
        for y in [(), (tid(b" a"),), (tid(b" apple"),)]:
            guide = cn.Guide(msgs, [list(prefix)])
            for t in y:
                guide.advance([t])
            w = guide.weights()[0]
            for v in [*PROB_SUB, EOS_ID]:
                num = sum(p for c, p in good.items() if c[: len(y) + 1] == (*y, v))  # P(y v, C | x)
                den = prefix_prob(family, (*prefix, *y, v)) / prefix_prob(family, prefix)  # p(y v | x)
                expect = num / den if den > 0 else 0.0
                assert math.isclose(float(w[v]), expect, rel_tol=1e-9, abs_tol=1e-13), (y, v, float(w[v]), expect)


@pytest.mark.parametrize("method", ["states", "tokens"])
@pytest.mark.parametrize("family", ["hmm", "blocked_hmm"])
def test_samples_satisfy_and_follow_the_exact_conditional(family, method):
    spec = PROB_SPECS[1]
    msgs = cn.prepare(model(family), compiled(spec))
    prefix = (tid(b" a"),)
    conts = continuations(family, prefix)
    good = {y: p for y, p in conts.items() if satisfies(spec, text_of(y), len(y))}
    total = sum(good.values())
    n = 3000
    draws = cs.sample(msgs, n, torch.Generator().manual_seed(3), prefix=list(prefix), method=method)
    counts: dict[tuple[int, ...], int] = {}
    for d in draws:
        assert satisfies(spec, text_of(d), len(d)), text_of(d)
        counts[tuple(d)] = counts.get(tuple(d), 0) + 1
    assert chi_square_pvalue(counts, {y: p / total for y, p in good.items()}, n) > 1e-3


def test_beam_search_finds_the_most_probable_satisfying_continuations():
    spec = PROB_SPECS[0]
    msgs = cn.prepare(model("hmm"), compiled(spec))
    found = cn.beam_search(msgs, prefix=[tid(b" a")], beam=8, n_best=3)
    conts = continuations("hmm", (tid(b" a"),))
    best = sorted((p for y, p in conts.items() if satisfies(spec, text_of(y), len(y))), reverse=True)[:3]
    if found.certified:
        assert [math.exp(r["log_prob"]) for r in found.results] == pytest.approx(best, rel=1e-9)
    for r in found.results:
        assert satisfies(spec, text_of(r["ids"]), len(r["ids"]))
