"""Bounded automata: regular expressions to minimal DFAs over character classes, within a budget of states and time.

Why home-made: `interegular` parses Python-style regexes well (kept here: `interegular.parse_pattern`), but its
`to_fsm` determinises compositionally (`fsm.crawl`, with a `states.index` lookup that makes each step quadratic)
with no bound on states or time, and the k-th-symbol-from-the-end family (`.*a.{15}`: 2^16 states) runs for
minutes, holding the GIL. Here the parse tree becomes a Glushkov (position) automaton (one NFA state per
position, bounded repeats expanded: `estimate_regex` counts the positions before any work), determinised by
the subset construction over bit sets of positions, then trimmed and minimised (Moore refinement): every loop
ticks one `Budget` (a state limit, a wall-clock deadline, a cancellation check), so a pattern costs at most the
budget's seconds before a `LimitExceeded` naming the field.

    budget = Budget(max_states=32768, seconds=1.0, cancelled=lambda: scope.cancelled)
    if estimate_regex(pattern, "regex") > MAX_POSITIONS: raise LimitExceeded(...)
    dfa = compile_regex(pattern, budget, "regex")      # SymbolDFA: full-match language of `pattern`

Semantics are Python's `re.fullmatch` for the syntax interegular accepts: `.` matches anything but a newline
(unless the `s` flag), `[^...]` matches a newline, the `i` flag folds case with `str.lower` / `str.upper` per
character (as interegular). Lookarounds are refused (InputError). Character classes of the result: characters
the pattern mentions that no part of the pattern tells apart share a class; every character it does not mention
is class `other` (the last class).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from latentlm.models.errors import InputError, LimitExceeded

CHECK_EVERY = 512  # ticks between two looks at the clock and the cancellation flag (a tick is ~0.1-1 us of work)
MAX_CELLS = 1 << 24  # states x classes of one automaton table (int64: 128 MB)
MAX_DEPTH = 200  # nesting of groups and repeats in a pattern


class CompileCancelled(Exception):
    """The compilation was cancelled (`Budget.cancelled` said so: the client went away, the service stops)."""


class Budget:
    """What one compilation may spend, shared by all its loops: `max_states` states of any automaton it builds
    (`states`), `seconds` of wall-clock time from construction (`tick` looks at the clock every CHECK_EVERY ticks)
    and a `cancelled` callable polled at the same time. `param` names the field in the LimitExceeded raised
    (`naming` changes it for a part of the work); `max_cells` bounds states x classes of a table."""

    def __init__(self, max_states: int, seconds: float, cancelled: Callable[[], bool] | None = None,
                 param: str = "constraint", *, max_cells: int = MAX_CELLS):
        self.max_states, self.seconds, self.cancelled, self.param = max_states, seconds, cancelled, param
        self.max_cells = max_cells
        self.started = time.monotonic()
        self.deadline = self.started + seconds
        self.ticks = 0
        self._next = CHECK_EVERY
        self.expired = False  # the deadline (not a size) stopped the compilation: not a property of the input

    def tick(self, n: int = 1) -> None:
        """Count n units of work; every CHECK_EVERY units check the deadline and cancellation. O(1)."""
        self.ticks += n
        if self.ticks >= self._next:
            self._next = self.ticks + CHECK_EVERY
            self.check()

    def check(self) -> None:
        """Raise CompileCancelled when cancelled, LimitExceeded (naming `param`) past the deadline."""
        if self.cancelled is not None and self.cancelled():
            raise CompileCancelled(f"{self.param}: compilation cancelled")
        if time.monotonic() > self.deadline:
            self.expired = True
            raise LimitExceeded(f"{self.param}: compiling it takes more than the limit of {self.seconds:g} s "
                                "(LATENTLM_CONSTRAINT_COMPILE_SECONDS); its automaton is too large, simplify it "
                                "(fewer or smaller bounded repeats, fewer alternatives)", param=self.param)

    def states(self, n: int, what: str) -> None:
        """LimitExceeded naming `param` when `n` (states of `what`) is above `max_states`."""
        if n > self.max_states:
            raise LimitExceeded(f"{self.param}: {what} exceeds {self.max_states} states while being built; "
                                "simplify it (fewer or smaller bounded repeats, fewer alternatives)",
                                param=self.param)

    def cells(self, states: int, classes: int, what: str) -> None:
        """LimitExceeded naming `param` when a table of `states` x `classes` is above `max_cells`."""
        if states * classes > self.max_cells:
            raise LimitExceeded(f"{self.param}: {what} needs {states} states x {classes} symbol classes, above the "
                                f"limit of {self.max_cells} table entries", param=self.param)

    @contextmanager
    def naming(self, param: str) -> Iterator[Budget]:
        """Within the block, limits name `param` (e.g. `constraint.regex` while the regex part compiles)."""
        saved, self.param = self.param, param
        try:
            yield self
        finally:
            self.param = saved


@dataclass
class SymbolDFA:
    """A DFA over symbol classes. `classes`: each character the pattern mentions -> its class (characters no part
    of the pattern tells apart share one); `other`: the class of every other character (= number of mentioned
    classes, the last column); `delta` (Q, other + 1) int64, -1 = no edge (no continuation can match), start state
    0; `accept` (Q,) bool. Minimal and trimmed: every state can reach an accepting one (the empty language is one
    non-accepting state without edges)."""

    classes: dict[str, int]
    other: int
    delta: np.ndarray
    accept: np.ndarray

    @property
    def num_states(self) -> int:
        return int(self.delta.shape[0])

    def symbol(self, ch: str) -> int:
        """The class of character `ch`."""
        return self.classes.get(ch, self.other)

    def accepts(self, text: str) -> bool:
        """Whether `text` matches in full. O(len(text))."""
        q = 0
        for ch in text:
            q = int(self.delta[q, self.symbol(ch)])
            if q < 0:
                return False
        return bool(self.accept[q])


# -- the parse tree, normalised ---------------------------------------------------------------------------
# Nodes: ("leaf", i) (one character from leaf set i), ("cat", nodes), ("alt", nodes), ("rep", node, lo, hi or None),
# ("eps",). Leaf sets: (chars, negated) pairs, deduplicated.
Leaf = tuple[frozenset[str], bool]


@lru_cache(maxsize=256)
def _parse(pattern: str, param: str) -> tuple[Any, tuple[Leaf, ...]]:
    """`pattern` -> (normalised tree, leaf sets); InputError naming `param` for what interegular cannot parse,
    lookarounds and nesting deeper than MAX_DEPTH."""
    import interegular

    if not isinstance(pattern, str):
        raise InputError(f"{param}: expected a string", param=param)
    try:
        tree = interegular.parse_pattern(pattern)
    except RecursionError:
        raise InputError(f"{param}: nested too deeply", param=param) from None
    except Exception as e:
        detail = str(e).split("\n")[0] or type(e).__name__
        raise InputError(f"{param}: not a valid pattern ({type(e).__name__}: {detail})", param=param) from None
    leaves: dict[Leaf, int] = {}
    node = _normalise(tree, 0, False, False, leaves, param)
    return node, tuple(leaves)


def _normalise(p: Any, depth: int, icase: bool, dotall: bool, leaves: dict[Leaf, int], param: str) -> Any:
    from interegular import patterns as ip

    if depth > MAX_DEPTH:
        raise InputError(f"{param}: nested more than {MAX_DEPTH} levels deep", param=param)

    def leaf(chars: frozenset[str], negated: bool) -> tuple[str, int]:
        key = (chars, negated)
        if key not in leaves:
            leaves[key] = len(leaves)
        return ("leaf", leaves[key])

    if isinstance(p, ip.Pattern):
        added, removed = p.added_flags, p.removed_flags
        if added & ip.REFlags.I:
            icase = True
        if removed & ip.REFlags.I:
            icase = False
        if added & ip.REFlags.S:
            dotall = True
        if removed & ip.REFlags.S:
            dotall = False
        opts = [_normalise(o, depth + 1, icase, dotall, leaves, param) for o in p.options]
        return opts[0] if len(opts) == 1 else ("alt", tuple(opts))
    if isinstance(p, ip._Concatenation):
        parts = []
        for q in p.parts:
            if isinstance(q, ip._NonCapturing):
                raise InputError(f"{param}: lookahead and lookbehind are not supported", param=param)
            parts.append(_normalise(q, depth + 1, icase, dotall, leaves, param))
        return parts[0] if len(parts) == 1 else ("cat", tuple(parts))
    if isinstance(p, ip._Repeated):
        return ("rep", _normalise(p.base, depth + 1, icase, dotall, leaves, param), p.min, p.max)
    if isinstance(p, ip._CharGroup):
        chars = p.chars
        if icase:
            folded = {*chars, *(c.lower() for c in chars), *(c.upper() for c in chars)}
            chars = frozenset(c for c in folded if len(c) == 1)
        return leaf(frozenset(chars), p.negated)
    if p is ip._DOT:
        return leaf(frozenset() if dotall else frozenset("\n"), True)
    if p is ip._EMPTY:
        return ("eps",)
    raise InputError(f"{param}: unsupported construct {type(p).__name__}", param=param)


def _positions(node: Any) -> int:
    """Positions of the Glushkov automaton once bounded repeats are expanded (X{m,n}: n copies, X{m,}: max(m, 1))."""
    kind = node[0]
    if kind == "leaf":
        return 1
    if kind == "eps":
        return 0
    if kind in ("cat", "alt"):
        return sum(_positions(n) for n in node[1])
    _, sub, lo, hi = node
    return _positions(sub) * (hi if hi is not None else max(lo, 1))


def estimate_regex(pattern: str, param: str) -> int:
    """The size of `pattern`'s position automaton (NFA states after expanding bounded repeats: repeat bounds times
    alternatives, multiplied through the nesting), computed from the parse tree without building anything: a
    caller refuses a pattern above its limit before the determinisation (whose worst case is 2^positions). Raises
    InputError naming `param` for an invalid pattern. O(pattern length)."""
    node, _ = _parse(pattern, param)
    return _positions(node)


# -- Glushkov construction ----------------------------------------------------------------------------------
class _Glushkov:
    """Positions 1..n (0 is the start); `follow[p]`: bit set of the positions that may come next after p;
    `leaf_of[p]`: p's leaf set. Bit sets are Python ints."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.follow: list[int] = [0]
        self.leaf_of: list[int] = [-1]

    def link(self, last: int, first: int) -> None:
        """follow[p] |= first for every p in `last`."""
        if not first:
            return
        while last:
            low = last & -last
            p = low.bit_length() - 1
            self.follow[p] |= first
            last ^= low
            self.budget.tick()

    def cat(self, parts: Iterator[tuple[bool, int, int]]) -> tuple[bool, int, int]:
        null, first, last = True, 0, 0
        for n2, f2, l2 in parts:
            self.link(last, f2)
            if null:
                first |= f2
            last = (last | l2) if n2 else l2
            null = null and n2
        return null, first, last

    def build(self, node: Any) -> tuple[bool, int, int]:
        """(nullable, first, last) of `node`, its positions created (a fresh copy per call)."""
        kind = node[0]
        if kind == "leaf":
            p = len(self.follow)
            self.follow.append(0)
            self.leaf_of.append(node[1])
            self.budget.tick()
            return False, 1 << p, 1 << p
        if kind == "eps":
            return True, 0, 0
        if kind == "cat":
            return self.cat(self.build(n) for n in node[1])
        if kind == "alt":
            null, first, last = False, 0, 0
            for n in node[1]:
                n2, f2, l2 = self.build(n)
                null, first, last = null or n2, first | f2, last | l2
            return null, first, last
        _, sub, lo, hi = node
        if hi is None:  # X{lo,}: X^(lo-1) X+ (X* when lo = 0)
            def copies() -> Iterator[tuple[bool, int, int]]:
                for _ in range(max(lo, 1) - 1):
                    yield self.build(sub)
                n2, f2, l2 = self.build(sub)
                self.link(l2, f2)
                yield (n2 or lo == 0), f2, l2
            return self.cat(copies())
        # X{lo,hi}: X^lo then (X (X (...)?)?)? with hi - lo optional copies, nested from the right
        tail = (True, 0, 0)
        for _ in range(hi - lo):
            _, f2, l2 = self.cat(iter([self.build(sub), tail]))
            tail = (True, f2, l2)
        return self.cat(iter([*(self.build(sub) for _ in range(lo)), tail]))


def _bits(x: int) -> Iterator[int]:
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def _alphabet(leaves: tuple[Leaf, ...]) -> tuple[dict[str, int], int, list[set[int]]]:
    """Character classes: mentioned characters grouped by the leaf sets holding them; `other` last. Returns
    (classes, other, accepted classes of each leaf set). O(total size of the leaf sets)."""
    member: dict[str, list[int]] = {}
    for i, (chars, _) in enumerate(leaves):
        for ch in chars:
            member.setdefault(ch, []).append(i)
    sig_class: dict[tuple[int, ...], int] = {}
    classes: dict[str, int] = {}
    for ch in sorted(member):
        classes[ch] = sig_class.setdefault(tuple(member[ch]), len(sig_class))
    other = len(sig_class)
    everything = set(range(other + 1))
    accepted = []
    for chars, negated in leaves:
        named = {classes[ch] for ch in chars}
        accepted.append(everything - named if negated else named)
    return classes, other, accepted


def compile_regex(pattern: str, budget: Budget, param: str = "constraint.regex") -> SymbolDFA:
    """The minimal `SymbolDFA` of the strings `pattern` matches in full (re.fullmatch). InputError naming `param` for
    an invalid pattern; LimitExceeded naming `param` when the determinisation exceeds `budget.max_states` states (or
    `budget.max_cells` table entries) or the budget's deadline passes; CompileCancelled when the budget is cancelled.
    Positions n (`estimate_regex`; check it first): O(n^2 / 64) to build, then O(|S| n / 64 + C) per DFA state."""
    with budget.naming(param):
        node, leaves = _parse(pattern, param)
        budget.states(_positions(node), "its position automaton (bounded repeats expanded)")
        budget.check()
        g = _Glushkov(budget)
        null, first, last = g.build(node)
        g.follow[0] = first
        finals = last | (1 if null else 0)
        classes, other, accepted = _alphabet(leaves)
        C = other + 1
        # mask[c]: positions whose leaf set accepts class c; neg: positions of negated sets (accept most classes)
        by_leaf = [0] * len(leaves)
        for p in range(1, len(g.leaf_of)):
            by_leaf[g.leaf_of[p]] |= 1 << p
        budget.tick(len(g.leaf_of))
        mask = [0] * C
        neg = 0
        for i, bits in enumerate(by_leaf):
            if leaves[i][1]:
                neg |= bits
            for c in accepted[i]:
                mask[c] |= bits
            budget.tick(len(accepted[i]))
        follow, leaf_of = g.follow, g.leaf_of
        ids = {1: 0}  # DFA state = bit set of the positions just read (1: the start position)
        sets = [1]
        rows: list[np.ndarray] = []
        all_classes = range(C)
        while len(rows) < len(sets):
            S = sets[len(rows)]
            F = 0
            for p in _bits(S):
                F |= follow[p]
                budget.tick()
            row = np.full(C, -1, dtype=np.int64)
            if F:
                if F & neg:
                    cand: Any = all_classes
                else:
                    cand = set()
                    for lf in {leaf_of[p] for p in _bits(F)}:
                        cand |= accepted[lf]
                    budget.tick(len(cand))
                for c in cand:
                    T = F & mask[c]
                    budget.tick()
                    if not T:
                        continue
                    q = ids.get(T)
                    if q is None:
                        q = ids[T] = len(sets)
                        sets.append(T)
                        budget.states(len(sets), "its automaton")
                        budget.cells(len(sets), C, "its automaton")
                    row[c] = q
            rows.append(row)
        delta = np.stack(rows)
        accept = np.array([bool(S & finals) for S in sets], dtype=bool)
        delta, accept = minimise(*trim(delta, accept, budget), budget)
    if delta.shape[0] == 0:
        delta, accept = np.full((1, C), -1, dtype=np.int64), np.zeros(1, dtype=bool)
    return SymbolDFA(classes, other, delta, accept)


# -- trimming and minimisation (shared with models.constraint) ----------------------------------------------
def trim(delta: np.ndarray, accept: np.ndarray, budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keep the states that can reach an accepting state (reverse BFS, one numpy pass per round); edges into the
    others become -1; no states at all when the start (state 0) cannot accept. O(rounds x Q C)."""
    Q = delta.shape[0]
    good = accept.copy()
    while True:
        if budget is not None:
            budget.tick(delta.size)
        nxt = np.concatenate([good, [False]])
        grown = good | nxt[delta].any(1)
        if (grown == good).all():
            break
        good = grown
    if Q == 0 or not good[0]:
        return np.zeros((0, delta.shape[1]), dtype=np.int64), np.zeros(0, dtype=bool)
    new_id = np.full(Q + 1, -1, dtype=np.int64)
    new_id[np.flatnonzero(good)] = np.arange(int(good.sum()))
    return new_id[delta[good]], accept[good]


def minimise(delta: np.ndarray, accept: np.ndarray, budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Moore refinement on (accept, block of each successor) until stable, then states renumbered in BFS order
    from the start (state 0). Missing edges (-1) form their own block. O(rounds x Q C log Q); `budget` ticks
    Q C per round."""
    if delta.shape[0] == 0:
        return delta, accept
    block = accept.astype(np.int64)
    count = len(np.unique(block))
    while True:
        if budget is not None:
            budget.tick(delta.size)
        succ = np.where(delta >= 0, block[np.maximum(delta, 0)], -1)
        sig = np.concatenate([block[:, None], succ], 1)
        _, block = np.unique(sig, axis=0, return_inverse=True)
        block = block.reshape(-1)
        new_count = int(block.max()) + 1
        if new_count == count:
            break
        count = new_count
    # one representative per block; BFS from the start's block gives the new numbering
    rep = np.zeros(count, dtype=np.int64)
    rep[block[::-1]] = np.arange(len(block))[::-1]
    bdelta = np.where(delta[rep] >= 0, block[np.maximum(delta[rep], 0)], -1)
    order = [int(block[0])]
    seen = {order[0]: 0}
    i = 0
    while i < len(order):
        for b in bdelta[order[i]]:
            if b >= 0 and int(b) not in seen:
                seen[int(b)] = len(order)
                order.append(int(b))
        i += 1
        if budget is not None:
            budget.tick(bdelta.shape[1])
    remap = np.full(count + 1, -1, dtype=np.int64)
    for b, new in seen.items():
        remap[b] = new
    out = remap[bdelta[order]]
    return out, accept[rep[order]]
