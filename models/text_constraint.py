"""Constraints over the decoded text of a model that carries its LM's tokenizer, compiled to a byte-level automaton
and lifted exactly to token ids.

For such a model a continuation's text is `b"".join(token_bytes[i] for i in content).decode("utf-8", "replace")`
(content: the tokens before `<eos>`; special tokens add no bytes). The `constraint` object reads that text:
- `include`: groups of alternatives, each a phrase of text; every group must occur as a whole word: a match not
  preceded or followed by a word character. `exclude`: phrases that must not occur as a whole word. Case-sensitive.
  Word characters (conservative towards Python's Unicode `\\w` on both sides, so that what is accepted also
  satisfies `(?<!\\w)phrase(?!\\w)` for included and excluded phrases): for `include`, ASCII letters, digits, `_`
  and every non-ASCII character (a match next to `é` or `’` does not count); for `exclude`, ASCII letters, digits and
  `_` only (a match next to `é` or `’` is still forbidden).
- `ordered`: the groups' first whole-word occurrences end in the given order (ties allowed), in text positions.
- `regex`: the whole text matches it (Python's `re.fullmatch`, interegular syntax, over characters; `.` is any
  character but a newline; U+FFFD stands for each invalid UTF-8 piece as `decode("utf-8", "replace")` gives it).
- `suffix`: the text ends with it. `min_tokens` / `max_tokens`: the continuation's length in the LM's tokens,
  counting `<eos>`. `min_words` / `max_words`: its words, maximal runs of characters other than ASCII white
  space (space, tab, newline, carriage return, form feed, vertical tab), as Ctrl-G counts them.
The automaton accepts every token sequence whose text satisfies the constraint, whichever way the tokenizer splits
it (" apple" as one token or " app" + "le"), not only the canonical tokenisation.

Compilation (`compile_text_constraint`): (1) the keyphrase part, a subset construction over byte classes of the
phrases' bytes (partial matches started at a boundary, the boundary kind of the last byte, matches awaiting their
right boundary), with the groups' progress (a bitmask, or the count of ordered groups done); the suffix by its KMP
automaton; (2) the word counter (count, inside a word), capped at max_words (beyond: dead) or min_words; (3) the
regex, compiled over characters by `models.automata` and expanded to bytes through a minimal UTF-8 decoder whose
states are the pending multi-byte prefixes that the regex's character classes tell apart (invalid bytes decoded as
Python does: one U+FFFD per maximal invalid piece). Their product is explored breadth-first (numpy, a layer at a
time), trimmed and minimised; then each token's bytes are run through it from every state reached at a token
boundary (`outlines-core`'s index, vectorised over the vocabulary: tokens with the same byte-class string lifted
once, the (states x strings) array stepped one byte position at a time), tokens with identical successor columns
grouped into classes, and the token-level automaton trimmed and minimised. Everything ticks one
`automata.Budget` (states, table cells, seconds, cancellation): LimitExceeded naming `constraint` (`constraint.regex`
for the regex part) when it blows up. Results (and input-only errors) are cached per (tokenizer, constraint,
limits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from latentlm.models import constraint as wl
from latentlm.models.automata import Budget, compile_regex, estimate_regex, trim
from latentlm.models.constraint import WordDFA
from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.token_lift import TokenTable, group_columns, lift, lift_states, minimise, token_table
from latentlm.models.vocab import Vocabulary

FIELDS = (*wl.FIELDS, "min_words", "max_words")
MAX_PHRASE_BYTES = 256
MAX_PHRASES = 64
MAX_WORDS_LIMIT = wl.MAX_TOKENS_LIMIT
ASCII_WORD = frozenset(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
SPACE = frozenset(b" \t\n\r\f\v")
# byte kinds for word boundaries: N = an ASCII non-word byte (or the text's start), X = a non-ASCII byte, W = ASCII word
N_KIND, X_KIND, W_KIND = 0, 1, 2
KIND = np.array([W_KIND if b in ASCII_WORD else X_KIND if b >= 0x80 else N_KIND for b in range(256)], dtype=np.int64)


@dataclass(frozen=True)
class TextConstraint:
    """A validated constraint over text (hashable: compiled automata are cached by it). Phrases are `str`;
    `max_words` None: no upper bound."""

    include: tuple[tuple[str, ...], ...] = ()
    ordered: bool = False
    exclude: tuple[str, ...] = ()
    min_tokens: int = wl.DEFAULT_MIN_TOKENS
    max_tokens: int = wl.DEFAULT_MAX_TOKENS
    min_words: int = 0
    max_words: int | None = None
    regex: str | None = None
    suffix: str = ""
    warnings: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, eq=False)
class TextDFA(WordDFA):
    """A `WordDFA` whose classes are any sets of token ids (the engine in `models.constrained` reads them through
    `class_words`): `class_words` (C,) the token of a one-token class, -1 for a class of several; `special` is
    empty, `has_other` true (every class holds a token)."""

    class_words: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


# -- parsing -----------------------------------------------------------------------------------------------------
def parse_text_constraint(spec: Mapping[str, Any], *, max_tokens_limit: int = wl.MAX_TOKENS_LIMIT,
                          field_name: str = "constraint") -> TextConstraint:
    """The `constraint` object (module docstring) -> `TextConstraint`. InputError naming the field for anything
    malformed (an empty phrase, one with U+FFFD or a lone surrogate), LimitExceeded above the limits (groups,
    phrases, bytes per phrase, max_tokens, max_words). O(total text)."""
    groups, excludes, ordered, lo, hi = wl.parse_shape(spec, FIELDS, field_name, max_tokens_limit, "phrases")
    include = [tuple(_phrase(a, where, f"{field_name}.include") for where, a in g) for g in groups]
    exclude = tuple(_phrase(p, where, f"{field_name}.exclude") for where, p in excludes)
    if sum(len(g) for g in include) + len(exclude) > MAX_PHRASES:
        raise LimitExceeded(f"{field_name}: more than {MAX_PHRASES} phrases", param=field_name)

    def name(key: str) -> str:
        return f"{field_name}.{key}"

    wlo = wl.as_int(spec.get("min_words", 0), name("min_words"))
    whi = spec.get("max_words")
    if wlo < 0:
        raise InputError(f"{name('min_words')}: must be at least 0, got {wlo}", param=name("min_words"))
    if whi is not None:
        whi = wl.as_int(whi, name("max_words"))
        if whi < wlo:
            raise InputError(f"{name('max_words')}: {whi} is below min_words {wlo}", param=name("max_words"))
    for key, value in (("min_words", wlo), ("max_words", whi)):
        if value is not None and value > MAX_WORDS_LIMIT:
            raise LimitExceeded(f"{name(key)}: {value} is above the limit of {MAX_WORDS_LIMIT}", param=name(key))
    suffix = spec.get("suffix")
    suffix = "" if suffix in (None, "") else _phrase(suffix, name("suffix"), name("suffix"))
    regex = spec.get("regex")
    if regex in (None, ""):
        regex = None
    elif not isinstance(regex, str):
        raise InputError(f"{name('regex')}: expected a string", param=name("regex"))
    elif len(regex) > wl.MAX_REGEX_CHARS:
        raise LimitExceeded(f"{name('regex')}: {len(regex)} characters, above the limit of {wl.MAX_REGEX_CHARS}",
                            param=name("regex"))
    return TextConstraint(tuple(include), ordered, exclude, lo, hi, wlo, whi, regex, suffix)


def _phrase(text: Any, where: str, param: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"{where}: expected a phrase (a string), got {text!r}", param=param)
    if not text:
        raise InputError(f"{where}: empty phrase", param=param)
    if "\ufffd" in text:
        raise InputError(f"{where}: {text!r} holds U+FFFD, which decoded text also uses for invalid bytes",
                         param=param)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InputError(f"{where}: {text!r} is not valid text (a lone surrogate)", param=param) from None
    if size > MAX_PHRASE_BYTES:
        raise LimitExceeded(f"{where}: {size} bytes, above the limit of {MAX_PHRASE_BYTES}", param=param)
    return text


# -- compilation ---------------------------------------------------------------------------------------------------
_CACHE = wl.Compiled(wl.CACHE_SIZE)
clear_compiled = _CACHE.clear


def compile_text_constraint(c: TextConstraint, vocab: Vocabulary, *, max_states: int = wl.DEFAULT_MAX_STATES,
                            build_limit: int | None = None, seconds: float = wl.DEFAULT_COMPILE_SECONDS,
                            cancelled: Callable[[], bool] | None = None) -> TextDFA:
    """`c` -> its minimal token-level `TextDFA` over `vocab` (a vocabulary over a tokenizer). Raises InputError
    naming the phrase's field for an include alternative or suffix no token sequence spells, InputError
    (`constraint`) for an empty language within the window; LimitExceeded (`constraint.regex` for the regex part,
    else `constraint`) past `build_limit` (default BUILD_FACTOR x max_states) states while building, `max_states`
    after minimisation, MAX_CELLS table entries or `seconds`; CompileCancelled when `cancelled()` says so. Costs:
    the byte automaton O(states x byte classes); the lift O(Q_boundary x total bytes of the distinct token class
    strings) numpy steps."""
    if vocab.tokenizer is None:
        raise InputError("constraint: a text constraint needs a model over an LM's tokenizer", param="constraint")
    if vocab.eos_id is None:
        raise InputError("constraint: this model's vocabulary has no <eos>, so no continuation ever completes",
                         param="constraint")
    limit = wl.BUILD_FACTOR * max_states if build_limit is None else build_limit
    key = (c, vocab.tokenizer.sha256, len(vocab), vocab.eos_id, max_states, limit)
    budget = Budget(limit, seconds, cancelled, param="constraint")
    return _CACHE.compile(key, budget, lambda: _compile(c, token_table(vocab), max_states, budget))


def _compile(c: TextConstraint, table: TokenTable, max_states: int, budget: Budget) -> TextDFA:
    _check_spellable(c, table, budget)
    regex = _regex_bytes(c.regex, budget) if c.regex is not None else None
    byte_delta, accept, byte_cls, parts = _byte_automaton(c, regex, budget)
    delta, accept, cls_u, strings_of = lift(byte_delta, accept, byte_cls, table, budget)
    delta, accept = minimise(*trim(delta, accept, budget), budget)
    if delta.shape[0] == 0:
        raise InputError("constraint: no text satisfies it (its parts contradict each other, or no token sequence "
                         "spells such a text)", param="constraint")
    if delta.shape[0] > max_states:
        raise LimitExceeded(f"constraint: its automaton over the tokens has {delta.shape[0]} states, above the limit "
                            f"of {max_states}", param="constraint")
    # classes that the minimised automaton no longer tells apart are merged
    merge, first = group_columns(delta)  # the columns: classes
    C = len(first)
    delta = np.ascontiguousarray(delta[:, first])
    cls = np.full(table.V, -1, dtype=np.int64)
    cls[table.ids] = merge[cls_u[strings_of]]
    sizes_of = np.bincount(cls[cls >= 0], minlength=C)
    class_words = np.full(C, -1, dtype=np.int64)
    single = np.flatnonzero(sizes_of == 1)
    if len(single):
        tok = np.flatnonzero((cls >= 0) & (sizes_of[np.maximum(cls, 0)] == 1))
        class_words[cls[tok]] = tok
    sizes = {**parts, "states": int(delta.shape[0]), "classes": C, "edges": int((delta >= 0).sum())}
    dfa = TextDFA(c, cls, np.zeros(0, dtype=np.int64), delta, accept, table.eos_id, True, sizes,  # type: ignore
                  class_words)
    if not dfa.live()[0][0]:
        raise InputError(f"constraint: no continuation of {c.min_tokens} to {c.max_tokens} tokens (counting the "
                         "final <eos>) satisfies it", param="constraint")
    return dfa


def _check_spellable(c: TextConstraint, table: TokenTable, budget: Budget) -> None:
    """InputError naming the field when an include alternative or the suffix is spelled by no token sequence (its
    bytes inside the join of some tokens' bytes): the KMP automaton of the phrase lifted over the tokens. Skipped
    when every byte is a token."""
    if table.every_byte:
        return
    named = [(p, f"constraint.include[{i}][{j}]", "constraint.include")
             for i, g in enumerate(c.include) for j, p in enumerate(g)]
    if c.suffix:
        named.append((c.suffix, "constraint.suffix", "constraint.suffix"))
    for text, where, param in named:
        pat = text.encode("utf-8")
        kmp = _kmp(pat)
        n = len(pat)
        kmp[n] = n  # absorbing once found
        cls = np.arange(256, dtype=np.int64)
        seen = {0}
        frontier = [0]
        while frontier and n not in seen:
            succ = lift_states(np.array(frontier), kmp, cls, table, budget)
            frontier = [int(s) for s in np.unique(succ) if int(s) not in seen]
            seen.update(frontier)
        if n not in seen:
            raise InputError(f"{where}: no sequence of the tokenizer's tokens spells {text!r}", param=param)


def _kmp(pat: bytes) -> np.ndarray:
    """The KMP automaton of `pat` over bytes: state i = the longest suffix read that is a prefix of pat (n+1, 256)."""
    n = len(pat)
    table = np.zeros((n + 1, 256), dtype=np.int64)
    table[0, pat[0]] = 1
    x = 0
    for i in range(1, n + 1):
        table[i] = table[x]
        if i < n:
            table[i, pat[i]] = i + 1
            x = int(table[x, pat[i]])
    return table


# -- the regex, over bytes -----------------------------------------------------------------------------------------
@dataclass
class _Decoder:
    """UTF-8 decoding as an automaton over bytes with character-class outputs: node 0 = no pending bytes, others
    pending multi-byte prefixes (minimal for the classes). Reading byte b in node d emits classes e1[d, b], then
    e2[d, b] (-1: none), and goes to nxt[d, b]. At the end of the text a pending node emits `fffd` once."""

    e1: np.ndarray
    e2: np.ndarray
    nxt: np.ndarray
    fffd: int


@lru_cache(maxsize=32)
def _decoder(classes: tuple[tuple[int, int], ...], other: int) -> _Decoder:
    """The decoder for a character partition (code point -> class for the listed ones, `other` for the rest).
    Python's "replace" decoding: a byte that cannot continue the pending prefix ends it as one U+FFFD and is read
    again from node 0; a byte that cannot start a character (80-BF, C0, C1, F5-FF) is one U+FFFD."""
    cp = np.full(0x110000, other, dtype=np.int64)
    for code, k in classes:
        cp[code] = k
    fffd = int(cp[0xFFFD])
    nodes: dict[bytes, int] = {}
    sigs: list[np.ndarray] = []

    def node(sig: np.ndarray) -> int:  # sig (64,) over continuation bytes: class >= 0, child -(id + 2), -1 invalid
        key = sig.tobytes()
        if key not in nodes:
            nodes[key] = len(sigs) + 1
            sigs.append(sig)
        return nodes[key]

    def ids(rows: np.ndarray) -> np.ndarray:
        inv, first = group_columns(np.ascontiguousarray(rows.T))
        return np.array([node(rows[f].copy()) for f in first], dtype=np.int64)[inv]

    def child(i: np.ndarray) -> np.ndarray:
        return -(i + 2)

    lead = np.zeros(256, dtype=np.int64)
    for b in range(0xC2, 0xE0):  # 2 bytes: U+0080..U+07FF
        lead[b] = node(cp[(b & 0x1F) << 6: ((b & 0x1F) << 6) + 64].copy())
    l2 = ids(cp[0x800:0x10000].reshape(-1, 64))  # 3 bytes: the prefix cp >> 6 in 0x20..0x3FF
    for b in range(0xE0, 0xF0):
        sig = np.full(64, -1, dtype=np.int64)
        lo, hi = (0xA0, 0xC0) if b == 0xE0 else (0x80, 0xA0) if b == 0xED else (0x80, 0xC0)
        for s in range(lo, hi):
            sig[s - 0x80] = child(l2[(((b & 0x0F) << 6) | (s & 0x3F)) - 0x20])
        lead[b] = node(sig)
    l3 = ids(cp[0x10000:0x110000].reshape(-1, 64))  # 4 bytes: cp >> 6 in 0x400..0x43FF
    l2b = ids(child(l3).reshape(-1, 64))  # cp >> 12 in 0x10..0x10F
    for b in range(0xF0, 0xF5):
        sig = np.full(64, -1, dtype=np.int64)
        lo, hi = (0x90, 0xC0) if b == 0xF0 else (0x80, 0x90) if b == 0xF4 else (0x80, 0xC0)
        for s in range(lo, hi):
            sig[s - 0x80] = child(l2b[(((b & 0x07) << 6) | (s & 0x3F)) - 0x10])
        lead[b] = node(sig)
    D = len(sigs) + 1
    g_e1 = np.where(np.arange(256) < 0x80, cp[:256], np.where(lead > 0, -1, fffd))
    e1 = np.tile(g_e1, (D, 1))
    e2 = np.full((D, 256), -1, dtype=np.int64)
    nxt = np.tile(lead, (D, 1))
    for d, sig in enumerate(sigs, start=1):
        e1[d], e2[d] = fffd, g_e1  # an invalid byte: the pending piece as U+FFFD, the byte read again
        valid = sig != -1
        cont = np.arange(0x80, 0xC0)[valid]
        s = sig[valid]
        e1[d, cont] = np.where(s >= 0, s, -1)
        e2[d, cont] = -1
        nxt[d, cont] = np.where(s >= 0, 0, -(s + 2))
    return _Decoder(e1, e2, nxt, fffd)


def _regex_bytes(pattern: str, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """The regex's full-match language over the decoded text as a minimal DFA over bytes: (delta (Q, 256) -1 dead,
    accept (Q,): the text read so far, its pending bytes decoded as U+FFFD, matches)."""
    param = "constraint.regex"
    with budget.naming(param):
        if estimate_regex(pattern, param) > wl.MAX_REGEX_POSITIONS:
            raise LimitExceeded(f"{param}: more than {wl.MAX_REGEX_POSITIONS} positions once its bounded repeats "
                                "are expanded; simplify it", param=param)
        sd = compile_regex(pattern, budget, param)
        dec = _decoder(tuple(sorted((ord(ch), k) for ch, k in sd.classes.items())), sd.other)
        R, D = sd.num_states, dec.e1.shape[0]
        budget.cells(R * D, 256, "its automaton over bytes")
        ext = np.vstack([sd.delta, np.full((1, sd.delta.shape[1]), -1, dtype=np.int64)])  # row R: dead
        ext[ext < 0] = R
        r = np.arange(R)[:, None, None]

        def step(states: np.ndarray, sym: np.ndarray) -> np.ndarray:
            return np.where(sym >= 0, ext[states, np.maximum(sym, 0)], states)

        r2 = step(step(np.broadcast_to(r, (R, D, 256)), dec.e1[None]), dec.e2[None])
        delta = np.where(r2 < R, r2 * D + dec.nxt[None], -1).reshape(R * D, 256)
        budget.tick(delta.size // 16)
        flushed = np.concatenate([ext[:, dec.fffd][:R], [R]])
        acc_r = np.concatenate([sd.accept, [False]])
        accept = np.where(np.arange(D)[None] == 0, acc_r[:R, None], acc_r[flushed[:R]][:, None]).reshape(-1)
        return minimise(*trim(delta, accept, budget), budget)


# -- the byte-level product ----------------------------------------------------------------------------------------
def _byte_automaton(c: TextConstraint, regex: tuple[np.ndarray, np.ndarray] | None, budget: Budget
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """(delta (Q, B) over byte classes, accept (Q,), byte_cls (256,), sizes of the parts) of the whole constraint
    over the text's bytes, trimmed and minimised. Byte classes: the bytes the phrases name one by one, the rest by
    boundary kind, white space and the regex's columns."""
    phrases = [p for g in c.include for p in g] + list(c.exclude) + ([c.suffix] if c.suffix else [])
    named = sorted({b for p in phrases for b in p.encode("utf-8")})
    sig = np.stack([np.full(256, -1), KIND, np.array([b in SPACE for b in range(256)])], 1).astype(np.int64)
    sig[named, 0] = named
    if regex is not None:
        _, rcol = np.unique(regex[0].T, axis=0, return_inverse=True)
        sig = np.concatenate([sig, rcol.reshape(-1, 1)], 1)
    _, byte_cls = np.unique(sig, axis=0, return_inverse=True)
    byte_cls = byte_cls.reshape(-1)
    B = int(byte_cls.max()) + 1
    reps = np.zeros(B, dtype=np.int64)
    reps[byte_cls[::-1]] = np.arange(256)[::-1]

    kp = _Keyphrases(c, reps, budget)
    wc_delta, wc_accept = _word_counter(c, reps)
    if regex is not None:
        rb_delta, rb_accept = regex[0][:, reps], regex[1]
    else:
        rb_delta, rb_accept = np.zeros((1, B), dtype=np.int64), np.ones(1, dtype=bool)
    m = len(c.include)
    full = m if c.ordered else (1 << m) - 1
    sizes = [kp.delta.shape[0], full + 1, wc_delta.shape[0], rb_delta.shape[0]]
    if float(np.prod(np.array(sizes, dtype=float))) >= 2.0 ** 62:
        raise LimitExceeded("constraint: its parts are too large to combine", param="constraint")
    mult = np.cumprod([1, *sizes[:-1]])

    def successors(codes: np.ndarray) -> np.ndarray:
        k, p, w, r = (codes[:, None] // mult[i] % sizes[i] for i in range(4))
        k2 = kp.delta[k, np.arange(B)]
        p2 = _progress(p, kp.bits[k, np.arange(B)], c.ordered, m)
        w2 = wc_delta[w, np.arange(B)]
        r2 = rb_delta[r, np.arange(B)]
        ok = (k2 >= 0) & (p2 >= 0) & (w2 >= 0) & (r2 >= 0)
        return np.where(ok, k2 * mult[0] + p2 * mult[1] + w2 * mult[2] + r2 * mult[3], -1)

    known = np.zeros(1, dtype=np.int64)  # sorted codes seen; the start is code 0
    states, blocks = [np.zeros(1, dtype=np.int64)], []
    frontier = states[0]
    while len(frontier):
        succ = successors(frontier)
        blocks.append(succ)
        budget.tick(succ.size)
        new = np.unique(succ[succ >= 0])
        new = new[~np.isin(new, known, assume_unique=True)]
        known = np.union1d(known, new)
        budget.states(len(known), "its automaton over bytes")
        budget.cells(len(known), B, "its automaton over bytes")
        states.append(new)
        frontier = new
    codes = np.concatenate(states)
    order = np.argsort(codes)
    sorted_codes = codes[order]

    def index(x: np.ndarray) -> np.ndarray:
        return np.where(x >= 0, order[np.searchsorted(sorted_codes, np.maximum(x, 0))], -1)

    delta = index(np.concatenate(blocks))
    k, p, w, r = (codes // mult[i] % sizes[i] for i in range(4))
    p_end = _progress(p, kp.flush_bits[k], c.ordered, m)
    accept = ((p_end == full) & ~kp.flush_exclude[k] & kp.suffix_ok[k] & wc_accept[w] & rb_accept[r])
    product = len(codes)
    delta, accept = minimise(*trim(delta, accept, budget), budget)
    parts = {"keyphrase_states": int(kp.delta.shape[0]), "word_counter_states": int(wc_delta.shape[0]),
             "regex_states": int(rb_delta.shape[0]) if regex is not None else 0, "byte_classes": B,
             "byte_product_states": product, "byte_states": int(delta.shape[0])}
    if delta.shape[0] == 0:
        raise InputError("constraint: no text satisfies it (its parts contradict each other)", param="constraint")
    return delta, accept, byte_cls, parts


def _progress(p: np.ndarray, bits: np.ndarray, ordered: bool, m: int) -> np.ndarray:
    """The groups' progress after groups `bits` (bitmask) got their first whole-word occurrence: unordered, the
    union; ordered (p = groups done), p' = p when nothing new, the new top when the new groups are exactly
    p+1 .. top, else -1 (a later group before an earlier one)."""
    if not ordered:
        return np.where(p >= 0, p | bits, -1)
    new = bits & ~((1 << p) - 1)
    top = np.zeros_like(new)
    for g in range(m):
        top = np.where((new >> g) & 1 == 1, g + 1, top)
    contiguous = new == (1 << top) - (1 << p)
    return np.where(new == 0, p, np.where(contiguous, top, -1))


class _Keyphrases:
    """The phrases' automaton over byte classes (reps: one byte per class), determinised from the state (partial
    matches (phrase, offset) started at a boundary, kind of the last byte, phrases completed by the last byte and
    awaiting their right boundary, the suffix's KMP state). `delta` (K, B) -1 = an excluded phrase confirmed;
    `bits` (K, B) include groups confirmed on that step; `flush_bits`, `flush_exclude`: what the end of the text
    confirms; `suffix_ok`: the text ends with the suffix."""

    def __init__(self, c: TextConstraint, reps: np.ndarray, budget: Budget):
        pats = [(p.encode("utf-8"), 0, g) for g, alts in enumerate(c.include) for p in alts]
        pats += [(p.encode("utf-8"), 1, -1) for p in c.exclude]
        suffix = c.suffix.encode("utf-8")
        kmp = _kmp(suffix) if suffix else np.zeros((1, 256), dtype=np.int64)
        start = ((), N_KIND, (), 0)
        ids = {start: 0}
        order = [start]
        rows_d, rows_b = [], []
        i = 0
        while i < len(order):
            active, prev, pending, ks = order[i]
            i += 1
            drow, brow = [], []
            for b in reps.tolist():
                kind = int(KIND[b])
                bits, excluded = _confirm(pats, pending, kind)
                nxt_active, done = set(), set()
                for k, o in active:
                    if pats[k][0][o] == b:
                        (done.add(k) if o + 1 == len(pats[k][0]) else nxt_active.add((k, o + 1)))
                for k, (p, role, _) in enumerate(pats):
                    if p[0] == b and (prev == N_KIND or (role == 1 and prev == X_KIND)):
                        (done.add(k) if len(p) == 1 else nxt_active.add((k, 1)))
                st = (tuple(sorted(nxt_active)), kind, tuple(sorted(done)), int(kmp[ks, b]))
                if st not in ids:
                    ids[st] = len(order)
                    order.append(st)
                    budget.states(len(order), "its keyphrase automaton")
                budget.tick(1 + len(active) + len(pats))
                drow.append(-1 if excluded else ids[st])
                brow.append(bits)
            rows_d.append(drow)
            rows_b.append(brow)
        self.delta = np.array(rows_d, dtype=np.int64).reshape(len(order), len(reps))
        self.bits = np.array(rows_b, dtype=np.int64).reshape(len(order), len(reps))
        ends = [_confirm(pats, s[2], None) for s in order]
        self.flush_bits = np.array([e[0] for e in ends], dtype=np.int64)
        self.flush_exclude = np.array([e[1] for e in ends], dtype=bool)
        self.suffix_ok = np.array([not suffix or s[3] == len(suffix) for s in order], dtype=bool)


def _confirm(pats: list[tuple[bytes, int, int]], pending: tuple[int, ...], kind: int | None) -> tuple[int, bool]:
    """(include groups, whether an excluded phrase) confirmed among `pending` when the next byte has boundary
    kind `kind` (None: the text ends). An include match needs an ASCII non-word byte or the end after it; an
    exclude match anything but an ASCII word byte."""
    bits, excluded = 0, False
    for k in pending:
        _, role, g = pats[k]
        if role == 0 and kind in (None, N_KIND):
            bits |= 1 << g
        elif role == 1 and kind != W_KIND:
            excluded = True
    return bits, excluded


def _word_counter(c: TextConstraint, reps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Words = maximal runs of non-white-space bytes (a run of non-white-space characters spans exactly such a
    run): state 2 count + inside, count capped at max_words (more: dead) or at min_words. (states, B), accept."""
    if c.max_words is None and c.min_words == 0:
        return np.zeros((1, len(reps)), dtype=np.int64), np.ones(1, dtype=bool)
    cap = c.max_words if c.max_words is not None else c.min_words
    space = np.array([b in SPACE for b in reps.tolist()])
    count = np.arange(cap + 1)[:, None]
    out = np.empty((cap + 1, 2, len(reps)), dtype=np.int64)
    out[:, 0] = np.where(space, 2 * count, np.where(count + 1 <= cap, 2 * (count + 1) + 1,
                                                    -1 if c.max_words is not None else 2 * cap + 1))
    out[:, 1] = np.where(space, 2 * count, 2 * count + 1)
    accept = np.repeat(np.arange(cap + 1) >= c.min_words, 2)
    return out.reshape(2 * (cap + 1), len(reps)), accept
