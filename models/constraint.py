"""Constraints on a continuation, compiled to one minimal deterministic automaton over word classes.

A `constraint` object (JSON) says what a continuation y = y_1 .. y_L of a prefix must satisfy; y ends with the
first `<eos>` and its content u = y_1 .. y_{L-1} is what the automaton reads:

    {"include": [["stock", "shares"], ["fell"]], "ordered": true, "exclude": ["the"],
     "min_tokens": 3, "max_tokens": 15, "regex": "( . )* fell .", "suffix": "in june"}

- `include`: groups of alternatives (a word or a space-separated phrase of the vocabulary); every group must occur
  in u (one of its alternatives as a contiguous word sequence). With `ordered`, the groups' first occurrences end
  in the given order (e_1 <= e_2 <= ..., ties allowed: "new york" / "york"); this is first-occurrence semantics,
  not concatenation of languages (which would accept "B A B" for the order A, B).
- `exclude`: words or phrases that must not occur in u.
- `min_tokens` <= L <= `max_tokens`: the length counts the final `<eos>`.
- `regex`: u must match it in full, one symbol per word. Tokens are separated by whitespace (operators may also
  be attached to words: `(a|b)*`): a vocabulary word (`\\w` for a word that is also an operator), `.` (any
  content word), `[w1 w2]` / `[^w1 w2]` (word classes), `( ) | * + ? {m} {m,n}`.
- `suffix`: u ends with this phrase (infilling between a prefix and a suffix); it counts toward the length and
  the other fields see it as part of u.
Words outside the vocabulary, and `<eos>` anywhere but at the end, raise `InputError` naming the field and the
word; so does a constraint that no continuation within the window satisfies. Only in `exclude` is a phrase with a
word outside the vocabulary dropped instead (it can never occur), with a warning in `Constraint.warnings`.

Compilation (`compile_constraint`): the K distinct words named anywhere become classes 0..K-1, every other word
except `<eos>` shares class K (OTHER), `<eos>` is -1 (it is the acceptance test, never a transition). Keyphrases
(include alternatives, excluded phrases, the suffix) go into one Aho-Corasick automaton over class ids, built
here (its goto function is needed; pyahocorasick does not expose it); the regex (parsed by `interegular`) is
compiled by `models.automata` (a bounded subset construction). The product (AC node, progress over the groups: a
bitmask, or with `ordered` the count of groups done, regex state) is explored breadth-first from the start (word
classes both parts treat alike explored once), states that cannot accept are removed (their edges become missing
edges: probability exactly 0), and Moore refinement merges equivalent states. The length window is not in the
automaton: the inference runs over the time index anyway (`models.constrained`).

Sizes: the AC has at most (total phrase length + 1) nodes; unordered groups multiply it by up to 2^m, ordered ones
by m + 1; the regex by its automaton's states (up to 2^positions: `.* w . {15}` needs 65,536). Every loop of one
compilation ticks one `automata.Budget`: `LimitExceeded` is raised when the regex has more than
MAX_REGEX_POSITIONS positions (before any work), as soon as an automaton explored exceeds `build_limit` states,
the minimised one `max_states`, or the compilation its `seconds` (DEFAULT_COMPILE_SECONDS), before any inference
work; it names `constraint.regex` when the regex part exceeds it, else `constraint`.

Length (over 600 lines): the word-level constraint's whole pipeline (parsing, the regex over words, Aho-Corasick, the
product, the cache) in one module; the text path (`models.text_constraint`) reuses its shape parser and cache.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from latentlm.models.automata import Budget, compile_regex, estimate_regex, minimise, trim
from latentlm.models.errors import InputError, LimitExceeded
from latentlm.models.vocab import Vocabulary

FIELDS = ("include", "ordered", "exclude", "min_tokens", "max_tokens", "regex", "suffix")
DEFAULT_MIN_TOKENS = 1
DEFAULT_MAX_TOKENS = 32
MAX_TOKENS_LIMIT = 1024  # `max_tokens` above this: LimitExceeded (tables grow with it)
DEFAULT_MAX_STATES = 2048  # states of the minimised automaton (a setting of the service)
BUILD_FACTOR = 16  # the product explored before minimisation may hold this many times `max_states`
MAX_GROUPS = 16  # include groups (unordered groups cost up to 2^m automaton states)
MAX_REGEX_CHARS = 4096
MAX_REPEAT = 256  # the largest m, n in a regex's {m,n}
MAX_REGEX_POSITIONS = 4096  # positions of a regex's automaton once bounded repeats are expanded (`estimate_regex`)
DEFAULT_COMPILE_SECONDS = 1.0  # wall-clock budget of one compilation (a setting of the service)
SYM_BASE = 0xF0000  # class c is the character chr(SYM_BASE + c) for the regex library (Private Use Area-A)
MAX_CLASSES = 0xFFFE  # 65,534 code points from SYM_BASE with no surrogate, newline or metacharacter


@dataclass(frozen=True)
class Constraint:
    """A validated constraint over word ids (hashable: compiled automata are cached by it).

    `include`: groups, each a tuple of alternatives, each a tuple of word ids; `exclude`: phrases; `suffix`: a
    phrase (empty: none); `regex`: the pattern over class symbols is built at compile time from `regex_tokens`,
    the parsed regex (word ids as ints, operators and `.` as strings, classes as ("[", ids) / ("[^", ids));
    `warnings`: excluded phrases dropped because a word of theirs is outside the vocabulary (they can never occur)."""

    include: tuple[tuple[tuple[int, ...], ...], ...] = ()
    ordered: bool = False
    exclude: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = DEFAULT_MIN_TOKENS
    max_tokens: int = DEFAULT_MAX_TOKENS
    regex_tokens: tuple[Any, ...] | None = None
    suffix: tuple[int, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)  # what parsing dropped (not part of the key)

    def words(self) -> list[int]:
        """Every word id named by the constraint, sorted: the special classes 0..K-1 of its automaton."""
        out: set[int] = set()
        for group in self.include:
            for alt in group:
                out.update(alt)
        for phrase in self.exclude:
            out.update(phrase)
        out.update(self.suffix)
        for tok in self.regex_tokens or ():
            if isinstance(tok, int):
                out.add(tok)
            elif isinstance(tok, tuple):
                out.update(tok[1])
        return sorted(out)


# -- parsing the JSON object ------------------------------------------------------------------------
def parse_constraint(spec: Mapping[str, Any], vocab: Vocabulary, *, max_tokens_limit: int = MAX_TOKENS_LIMIT,
                     field_name: str = "constraint") -> Constraint:
    """The `constraint` object (see the module docstring) -> `Constraint` over `vocab`'s ids. Raises InputError
    naming the field (`constraint.include`, ...) and the word for anything malformed or outside the vocabulary,
    LimitExceeded for `max_tokens` above `max_tokens_limit` or more than `MAX_GROUPS` groups. O(total words)."""
    groups, excludes, ordered, lo, hi = parse_shape(spec, FIELDS, field_name, max_tokens_limit, "words or phrases")
    include = [tuple(_phrase(a, vocab, where, f"{field_name}.include") for where, a in g) for g in groups]

    def name(key: str) -> str:
        return f"{field_name}.{key}"

    exclude_ids: list[tuple[int, ...]] = []
    warnings: list[str] = []
    for where, p in excludes:
        unknown = [w for w in _words(p, where, name("exclude"), vocab) if _lookup(w, vocab) is None]
        if unknown:  # a phrase with a word the model never emits never occurs: excluding it excludes nothing
            warnings.append(f"{where}: word {unknown[0]!r} is not in the model's vocabulary, so {p!r} can never "
                            "occur; dropped")
            continue
        exclude_ids.append(_phrase(p, vocab, where, name("exclude")))
    exclude = tuple(exclude_ids)
    suffix_spec = spec.get("suffix")
    suffix = () if suffix_spec in (None, "") else _phrase(suffix_spec, vocab, name("suffix"), name("suffix"))
    regex = spec.get("regex")
    regex_tokens = None if regex in (None, "") else parse_regex(regex, vocab, name("regex"))
    return Constraint(tuple(include), ordered, exclude, lo, hi, regex_tokens, suffix, tuple(warnings))


def parse_shape(spec: Any, fields: Sequence[str], field_name: str, max_tokens_limit: int, what: str
                ) -> tuple[list[list[tuple[str, Any]]], list[tuple[str, Any]], bool, int, int]:
    """The structure every `constraint` object shares (word-level here, text in `models.text_constraint`): unknown
    fields, `include` groups, `exclude`, `ordered` and the `min_tokens` / `max_tokens` window, checked with errors
    naming the field. Returns (groups of (where, raw alternative), [(where, raw excluded phrase)], ordered, lo, hi);
    the caller reads the phrases (`what` names them in messages)."""
    if not isinstance(spec, Mapping):
        raise InputError(f"{field_name}: expected an object", param=field_name)
    unknown = [k for k in spec if k not in fields]
    if unknown:
        raise InputError(f"{field_name}.{unknown[0]}: unknown field (allowed: {', '.join(fields)})",
                         param=f"{field_name}.{unknown[0]}")

    def name(key: str) -> str:
        return f"{field_name}.{key}"

    groups = spec.get("include") or []
    if not isinstance(groups, list):
        raise InputError(f"{name('include')}: expected a list of groups (lists of {what})", param=name("include"))
    if len(groups) > MAX_GROUPS:
        raise LimitExceeded(f"{name('include')}: {len(groups)} groups, above the limit of {MAX_GROUPS}",
                            param=name("include"))
    include = []
    for i, group in enumerate(groups):
        alts = [group] if isinstance(group, str) else group
        if not isinstance(alts, list) or not alts:
            raise InputError(f"{name('include')}[{i}]: expected a non-empty list of {what}", param=name("include"))
        include.append([(f"{name('include')}[{i}][{j}]", a) for j, a in enumerate(alts)])
    exclude = spec.get("exclude") or []
    if isinstance(exclude, str):
        exclude = [exclude]
    if not isinstance(exclude, list):
        raise InputError(f"{name('exclude')}: expected a list of {what}", param=name("exclude"))
    ordered = spec.get("ordered", False)
    if not isinstance(ordered, bool):
        raise InputError(f"{name('ordered')}: expected true or false", param=name("ordered"))
    lo = as_int(spec.get("min_tokens", DEFAULT_MIN_TOKENS), name("min_tokens"))
    hi = as_int(spec.get("max_tokens", DEFAULT_MAX_TOKENS), name("max_tokens"))
    if lo < 1:
        raise InputError(f"{name('min_tokens')}: must be at least 1 (the length counts the final <eos>), got {lo}",
                         param=name("min_tokens"))
    if hi < lo:
        raise InputError(f"{name('max_tokens')}: {hi} is below min_tokens {lo}", param=name("max_tokens"))
    if hi > max_tokens_limit:
        raise LimitExceeded(f"{name('max_tokens')}: {hi} is above the limit of {max_tokens_limit}",
                            param=name("max_tokens"))
    return include, [(f"{name('exclude')}[{i}]", p) for i, p in enumerate(exclude)], ordered, lo, hi


def as_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: expected an integer, got {value!r}", param=where)
    return value


def _lookup(word: str, vocab: Vocabulary) -> int | None:
    i = vocab.index.get(word)
    if i is None and vocab.preprocessing.lowercase:
        i = vocab.index.get(word.lower())
    return i


def _word_id(word: str, vocab: Vocabulary, where: str, param: str) -> int:
    i = _lookup(word, vocab)
    if i is None:
        raise InputError(f"{where}: word {word!r} is not in the model's vocabulary", param=param)
    if i == vocab.eos_id:
        raise InputError(f"{where}: {word!r} ends every continuation and cannot be part of a constraint's words "
                         "(use min_tokens / max_tokens, or suffix)", param=param)
    return i


def _phrase(text: Any, vocab: Vocabulary, where: str, param: str) -> tuple[int, ...]:
    """A word or space-separated phrase -> word ids (the vocabulary's tokenizer, so lowercasing applies)."""
    return tuple(_word_id(w, vocab, where, param) for w in _words(text, where, param, vocab))


def _words(text: Any, where: str, param: str, vocab: Vocabulary) -> list[str]:
    if not isinstance(text, str):
        raise InputError(f"{where}: expected a word or phrase (a string), got {text!r}", param=param)
    words = vocab.tokenize(text)
    if not words:
        raise InputError(f"{where}: empty phrase", param=param)
    return words


_OPERATORS = ("(", ")", "|", "*", "+", "?")
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
_CHUNKS = re.compile(r"\[[^\]]*\]|\S+")
_PIECES = re.compile(r"\\\S+|\{\d+(?:,\d*)?\}|[()|*+?]|[^()|*+?{}\\]+")


def parse_regex(text: Any, vocab: Vocabulary, where: str = "constraint.regex") -> tuple[Any, ...]:
    """A regex over words (module docstring) -> tokens: word ids (int), operators and "." (str), word classes
    ("[" or "[^", ids). Raises InputError naming `where` for an unknown word or malformed syntax (the pattern is
    also checked by the regex library at compile time)."""
    if not isinstance(text, str):
        raise InputError(f"{where}: expected a string", param=where)
    if len(text) > MAX_REGEX_CHARS:
        raise LimitExceeded(f"{where}: {len(text)} characters, above the limit of {MAX_REGEX_CHARS}", param=where)
    out: list[Any] = []
    for chunk in _CHUNKS.findall(text):
        if chunk.startswith("["):
            neg = chunk.startswith("[^")
            body = chunk[2 if neg else 1: -1].split()
            if not body:
                raise InputError(f"{where}: empty word class {chunk!r}", param=where)
            out.append(("[^" if neg else "[", tuple(sorted({_word_id(w, vocab, where, where) for w in body}))))
            continue
        out.extend(_regex_chunk(chunk, vocab, where))
    if not out:
        raise InputError(f"{where}: empty pattern", param=where)
    return tuple(out)


def _regex_chunk(chunk: str, vocab: Vocabulary, where: str) -> list[Any]:
    """One whitespace-free chunk: a vocabulary word, `\\word` (the rest of the chunk is a word), or words,
    `.` and operators written together (`(a|b)*`)."""
    if chunk in vocab.index and chunk not in _OPERATORS and chunk != "." and not _REPEAT.fullmatch(chunk):
        return [_word_id(chunk, vocab, where, where)]
    pieces = _PIECES.findall(chunk)
    if "".join(pieces) != chunk:
        raise InputError(f"{where}: cannot read {chunk!r} (separate words and operators by spaces, or escape a "
                         "word with \\)", param=where)
    out: list[Any] = []
    for p in pieces:
        if p.startswith("\\"):
            out.append(_word_id(p[1:], vocab, where, where))
        elif p.startswith("{"):
            out.append(_repeat(p, where))
        elif p in _OPERATORS or p == ".":
            out.append(p)
        else:
            out.append(_word_id(p, vocab, where, where))
    return out


def _repeat(text: str, where: str) -> str:
    m = _REPEAT.fullmatch(text)
    assert m is not None
    lo, hi = int(m.group(1)), m.group(3)
    if lo > MAX_REPEAT or (hi not in (None, "") and int(hi) > MAX_REPEAT):
        raise LimitExceeded(f"{where}: repetition {text} above the limit of {MAX_REPEAT}", param=where)
    if hi not in (None, "") and int(hi) < lo:
        raise InputError(f"{where}: repetition {text} has its upper bound below its lower bound", param=where)
    return text


# -- the compiled automaton --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class WordDFA:
    """A constraint compiled to a minimal DFA over word classes, with its length window.

    `cls` (V,) int64: class of each word (0..K-1 the named words, K = OTHER, -1 = `<eos>`); `special` (K,) int64:
    the word of each special class; `delta` (Q, K+1) int64: successor per class, -1 = no edge (the continuation
    can no longer satisfy the constraint); `accept` (Q,) bool: an `<eos>` read in that state completes a
    satisfying continuation (when the length is in the window); the start state is 0. `has_other`: some word is
    of class K. `sizes`: states and edges of the parts and of the result (reported in responses)."""

    constraint: Constraint
    cls: np.ndarray
    special: np.ndarray
    delta: np.ndarray
    accept: np.ndarray
    eos_id: int | None
    has_other: bool
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def num_states(self) -> int:
        return int(self.delta.shape[0])

    @property
    def num_classes(self) -> int:
        """K + 1: the special words and OTHER."""
        return int(self.delta.shape[1])

    @property
    def min_tokens(self) -> int:
        return self.constraint.min_tokens

    @property
    def max_tokens(self) -> int:
        return self.constraint.max_tokens

    def step(self, q: int, word: int) -> int:
        """Successor of state q after content word `word` (-1: dead, or q was dead)."""
        c = int(self.cls[word])
        if q < 0 or c < 0:
            return -1
        return int(self.delta[q, c])

    def run(self, words: Sequence[int], q: int = 0) -> int:
        """State after reading content words from q (-1 once dead)."""
        for w in words:
            q = self.step(q, w)
            if q < 0:
                return -1
        return q

    def satisfied(self, continuation: Sequence[int]) -> bool:
        """Whether a complete continuation (content words then `<eos>`) satisfies the constraint, window
        included. O(L)."""
        L = len(continuation)
        if not (self.min_tokens <= L <= self.max_tokens) or continuation[-1] != self.eos_id:
            return False
        if any(w == self.eos_id for w in continuation[:-1]):
            return False
        q = self.run(continuation[:-1])
        return q >= 0 and bool(self.accept[q])

    def reachable(self, depth: int) -> list[np.ndarray]:
        """Sorted states reachable from 0 after exactly j content words, j = 0..depth (bool masks (Q,))."""
        Q = self.num_states
        succ = self.delta if self.has_other else self.delta[:, :-1]
        layers = [np.zeros(Q, dtype=bool)]
        layers[0][0] = True
        for _ in range(depth):
            cur = layers[-1]
            nxt = np.zeros(Q, dtype=bool)
            s = succ[cur].ravel()
            nxt[s[s >= 0]] = True
            layers.append(nxt)
        return layers

    def live(self) -> list[np.ndarray]:
        """Live states per number of content words read j = 0..max_tokens-1, (Q,) bool each: reachable from 0
        in exactly j words and able to reach an accepting state with the length of the whole continuation
        (j + more words + `<eos>`) in [min_tokens, max_tokens]. Every other (j, q) has probability 0 for every
        model. O(max_tokens Q (K+1))."""
        lo, hi = self.min_tokens, self.max_tokens
        reach = self.reachable(hi - 1)
        succ = self.delta if self.has_other else self.delta[:, :-1]
        good = [np.zeros(self.num_states, dtype=bool) for _ in range(hi)]
        for j in range(hi - 1, -1, -1):
            g = self.accept.copy() if lo <= j + 1 <= hi else np.zeros(self.num_states, dtype=bool)
            if j + 1 < hi:
                nxt = np.concatenate([good[j + 1], [False]])
                g |= nxt[succ].any(1)
            good[j] = g
        return [reach[j] & good[j] for j in range(hi)]


def compile_constraint(constraint: Constraint, vocab: Vocabulary, *, max_states: int = DEFAULT_MAX_STATES,
                       build_limit: int | None = None, seconds: float = DEFAULT_COMPILE_SECONDS,
                       cancelled: Callable[[], bool] | None = None) -> WordDFA:
    """`constraint` -> its minimal `WordDFA` over `vocab` (cached per constraint, vocabulary size and limits).
    Raises LimitExceeded (param `constraint.regex` for the regex part, else `constraint`) when the regex's position
    automaton exceeds MAX_REGEX_POSITIONS (before any work), an automaton explored exceeds `build_limit` (default
    `BUILD_FACTOR` x `max_states`) states, the minimised one `max_states`, a table MAX_CELLS entries, or the whole
    compilation `seconds` of wall-clock time; CompileCancelled as soon as `cancelled()` says so (it is polled every
    few thousand steps); InputError (param `constraint`) when no continuation within the length window satisfies
    it. O(states explored x distinct word behaviours) plus the regex's subset construction (`models.automata`).
    Failures that depend on the input only are cached too; a deadline or a cancellation is not."""
    if vocab.eos_id is None:
        raise InputError("constraint: this model's vocabulary has no <eos>, so no continuation ever completes",
                         param="constraint")
    limit = BUILD_FACTOR * max_states if build_limit is None else build_limit
    key = (constraint, len(vocab), vocab.eos_id, max_states, limit)
    budget = Budget(limit, seconds, cancelled, param="constraint")
    return _CACHE.compile(key, budget, lambda: _compile(constraint, len(vocab), vocab.eos_id, max_states, budget))


class Compiled:
    """The last CACHE_SIZE compilations (automata, or the error an input always gets), least recently used dropped
    first; thread-safe (the service compiles on several threads)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def compile(self, key: tuple, budget: Budget, build: Callable[[], Any]) -> Any:
        """The cached automaton of `key`, or the error its input always gets, else `build()` (within `budget`),
        cached with its input-only errors (a deadline or a cancellation is not cached)."""
        hit = self.get(key)
        if isinstance(hit, tuple):
            kind, message, param = hit
            raise kind(message, param=param)
        if hit is not None:
            return hit
        try:
            dfa = build()
        except (InputError, LimitExceeded) as e:
            if not budget.expired:
                self.put(key, (type(e), e.message, e.param))
            raise
        self.put(key, dfa)
        return dfa


CACHE_SIZE = 64
_CACHE = Compiled(CACHE_SIZE)
clear_compiled = _CACHE.clear  # tests: compile again


def _compile(c: Constraint, V: int, eos_id: int | None, max_states: int, budget: Budget) -> WordDFA:
    words = c.words()
    K = len(words)
    if K > MAX_CLASSES:
        raise LimitExceeded(f"constraint: {K} distinct words, above the limit of {MAX_CLASSES}", param="constraint")
    cls = np.full(V, K, dtype=np.int64)
    cls[words] = np.arange(K)
    if eos_id is not None:
        cls[eos_id] = -1
    has_other = bool((cls == K).any())
    index = {w: i for i, w in enumerate(words)}

    ac = _AhoCorasick(K)
    groups = [_prune([tuple(index[w] for w in alt) for alt in g]) for g in c.include]
    for g, alts in enumerate(groups):
        for alt in alts:
            ac.add(alt, include=g)
    for phrase in _prune([tuple(index[w] for w in p) for p in c.exclude]):
        ac.add(phrase, exclude=True)
    if c.suffix:
        ac.add(tuple(index[w] for w in c.suffix), suffix=True)
    budget.tick(ac.size)
    goto = ac.build()
    regex = _Regex(c.regex_tokens, index, K, budget) if c.regex_tokens is not None else None

    # word classes that both parts treat alike (in no keyphrase, same regex class: e.g. the words of a large
    # `[...]`) are explored once: `joint` columns, `rep` a class of each, `joint_of` each class's column
    keyed = ac.letters()
    classes = list(range(K + 1)) if has_other else list(range(K))
    column: dict[tuple[int, int], int] = {}
    joint_of = np.full(K + 1, -1, dtype=np.int64)
    rep: list[int] = []
    for cc in classes:
        k = (cc if cc in keyed else -1, regex.cls[cc] if regex is not None else 0)
        if k not in column:
            column[k] = len(rep)
            rep.append(cc)
        joint_of[cc] = column[k]
    J = len(rep)

    m = len(groups)
    full = (1 << m) - 1 if not c.ordered else m
    start = (0, 0, 0)
    ids = {start: 0}
    order = [start]
    edges: list[list[int]] = []
    queue = deque([start])
    build_limit = budget.max_states
    while queue:
        u, p, s = queue.popleft()
        row = [-1] * J
        budget.tick(J)
        for j, cc in enumerate(rep):
            v = int(goto[u, cc])
            if ac.exclude[v]:
                continue
            got = ac.groups[v]
            if c.ordered:
                new = got & ~((1 << p) - 1)
                if new:
                    top = new.bit_length()  # groups p+1 .. top must all be new: (1 << top) - (1 << p)
                    if new != (1 << top) - (1 << p):
                        continue  # a later group's first occurrence before an earlier one's
                    p2 = top
                else:
                    p2 = p
            else:
                p2 = p | got
            if regex is not None:
                s2 = regex.step(s, cc)
                if s2 < 0:
                    continue
            else:
                s2 = 0
            nxt = (v, p2, s2)
            if nxt not in ids:
                if len(ids) >= build_limit:
                    raise LimitExceeded(f"constraint: its automaton exceeds {build_limit} states while being built "
                                        f"(limit {max_states} after minimisation)", param="constraint")
                budget.cells(len(ids) + 1, J, "its automaton")
                ids[nxt] = len(order)
                order.append(nxt)
                queue.append(nxt)
            row[j] = ids[nxt]
        edges.append(row)
    delta = np.array(edges, dtype=np.int64).reshape(len(order), J)
    accept = np.array([p == full and (not c.suffix or ac.suffix[u]) and (regex is None or regex.final(s))
                       for u, p, s in order], dtype=bool)
    explored = len(order)
    delta, accept = minimise(*trim(delta, accept, budget), budget)
    if delta.shape[0] == 0:
        raise InputError("constraint: no continuation satisfies it (its parts contradict each other)",
                         param="constraint")
    if delta.shape[0] > max_states:
        raise LimitExceeded(f"constraint: its automaton has {delta.shape[0]} states, above the limit of "
                            f"{max_states}", param="constraint")
    budget.cells(delta.shape[0], K + 1, "its automaton")
    # back to one column per word class (a missing OTHER column stays -1)
    # (`minimise` numbered the states in BFS order over the joint columns, which is the order over the classes)
    delta = np.concatenate([delta, np.full((delta.shape[0], 1), -1, dtype=np.int64)], 1)[:, joint_of]
    sizes = {"aho_corasick_nodes": ac.size, "regex_states": regex.size if regex else 0, "product_states": explored,
             "states": int(delta.shape[0]), "classes": K + 1, "edges": int((delta >= 0).sum())}
    dfa = WordDFA(c, cls, np.array(words, dtype=np.int64), delta, accept, eos_id, has_other, sizes)
    if not dfa.live()[0][0]:
        raise InputError(f"constraint: no continuation of {c.min_tokens} to {c.max_tokens} tokens (counting the "
                         "final <eos>) satisfies it", param="constraint")
    return dfa


def _prune(phrases: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Drop duplicates and every phrase that contains another one of the list (an occurrence of it implies one of
    the shorter phrase, which ends no later): a pure optimisation of the automaton's size."""
    uniq = sorted(set(phrases), key=len)
    kept: list[tuple[int, ...]] = []
    for p in uniq:
        if not any(_contains(p, q) for q in kept):
            kept.append(p)
    return kept


def _contains(p: tuple[int, ...], q: tuple[int, ...]) -> bool:
    return any(p[i: i + len(q)] == q for i in range(len(p) - len(q) + 1))


class _AhoCorasick:
    """Aho-Corasick over class ids 0..K-1 (class K, OTHER, occurs in no pattern: it always returns to the root).
    Each node records what ends there or at a suffix of it: bitmask of include groups, exclude, suffix."""

    def __init__(self, K: int):
        self.K = K
        self.children: list[dict[int, int]] = [{}]
        self.groups = [0]
        self.exclude = [False]
        self.suffix = [False]

    @property
    def size(self) -> int:
        return len(self.children)

    def add(self, phrase: tuple[int, ...], *, include: int | None = None, exclude: bool = False,
            suffix: bool = False) -> None:
        u = 0
        for c in phrase:
            if c not in self.children[u]:
                self.children.append({})
                self.groups.append(0)
                self.exclude.append(False)
                self.suffix.append(False)
                self.children[u][c] = len(self.children) - 1
            u = self.children[u][c]
        if include is not None:
            self.groups[u] |= 1 << include
        self.exclude[u] |= exclude
        self.suffix[u] |= suffix

    def letters(self) -> set[int]:
        """The classes some pattern holds (every other class leads back to the root from every node)."""
        return {c for kids in self.children for c in kids}

    def build(self) -> np.ndarray:
        """The goto table (nodes, K+1) int64; merges each node's outputs with its fail node's (BFS order)."""
        n, K = len(self.children), self.K
        goto = np.zeros((n, K + 1), dtype=np.int64)
        fail = [0] * n
        queue: deque[int] = deque()
        for c, v in self.children[0].items():
            goto[0, c] = v
            queue.append(v)
        while queue:
            u = queue.popleft()
            f = fail[u]
            self.groups[u] |= self.groups[f]
            self.exclude[u] |= self.exclude[f]
            self.suffix[u] |= self.suffix[f]
            goto[u, :K] = goto[f, :K]
            for c, v in self.children[u].items():
                fail[v] = int(goto[f, c])
                goto[u, c] = v
                queue.append(v)
        return goto


class _Regex:
    """The regex over class symbols chr(SYM_BASE + c), compiled by `models.automata` within the budget: `cls[c]` the
    regex's symbol class of word class c (K: OTHER), `step(s, c)` -> state or -1 (no edge), start state 0."""

    def __init__(self, tokens: tuple[Any, ...], index: dict[int, int], K: int, budget: Budget):
        def sym(w: int) -> str:
            return chr(SYM_BASE + index[w])

        parts = []
        for tok in tokens:
            if isinstance(tok, int):
                parts.append(sym(tok))
            elif isinstance(tok, tuple):
                parts.append(tok[0] + "".join(sym(w) for w in tok[1]) + "]")
            else:
                parts.append(tok)
        pattern = "".join(parts)
        where = "constraint.regex"
        positions = estimate_regex(pattern, where)
        if positions > MAX_REGEX_POSITIONS:
            raise LimitExceeded(f"{where}: its automaton would have {positions:,} positions once the bounded "
                                f"repeats are expanded (repeat bounds times alternatives), above the limit of "
                                f"{MAX_REGEX_POSITIONS:,}; use smaller repeat bounds or fewer alternatives",
                                param=where)
        dfa = compile_regex(pattern, budget, where)
        self.delta, self.accept = dfa.delta, dfa.accept
        self.size = dfa.num_states
        self.cls = [dfa.symbol(chr(SYM_BASE + c)) for c in range(K)] + [dfa.other]

    def step(self, s: int, c: int) -> int:
        return int(self.delta[s, self.cls[c]])

    def final(self, s: int) -> bool:
        return bool(self.accept[s])
