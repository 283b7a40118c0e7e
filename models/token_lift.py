"""Byte-level automata lifted to token ids (`outlines-core`'s index of a regex against a vocabulary, vectorised):
each token's bytes run through a byte automaton from every state reached at a token boundary, tokens with identical
successors grouped into classes. Used by `models.text_constraint`.

- `token_table(vocab)`: a vocabulary's token bytes as arrays (built once per tokenizer).
- `lift(delta, accept, byte_cls, table, budget)`: the token-level automaton (states reached at token boundaries,
  classes of tokens), over a trie of the tokens' byte-class strings: O(states x trie nodes) numpy steps.
- `minimise(delta, accept, budget)`: Moore refinement by row hashing (`group_columns`), the same result as
  `models.automata.minimise`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from latentlm.models.automata import Budget
from latentlm.models.vocab import Vocabulary

LIFT_CHUNK_CELLS = 1 << 22  # states x token strings lifted at once


class TokenTable:
    """The content tokens' bytes as arrays (built once per vocabulary): `ids` (n,) the token ids but `<eos>`,
    `matrix` (n, L) uint8 padded, `lengths` (n,); `every_byte`: each single byte is some token's whole spelling
    (byte-level BPE, byte fallback), so every text can be spelled."""

    def __init__(self, token_bytes: list[bytes], eos_id: int | None):
        ids = [i for i in range(len(token_bytes)) if i != eos_id]
        self.V = len(token_bytes)
        self.eos_id = eos_id
        self.ids = np.array(ids, dtype=np.int64)
        self.lengths = np.array([len(token_bytes[i]) for i in ids], dtype=np.int64)
        L = max(1, int(self.lengths.max(initial=0)))
        flat = b"".join(token_bytes[i] for i in ids)
        self.matrix = np.zeros((len(ids), L), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        rows = np.repeat(np.arange(len(ids)), self.lengths)
        cols = np.arange(len(flat)) - np.repeat(starts, self.lengths)
        self.matrix[rows, cols] = np.frombuffer(flat, dtype=np.uint8)
        singles = {token_bytes[i] for i in ids if len(token_bytes[i]) == 1}
        self.every_byte = len(singles) == 256


_TABLES: OrderedDict[tuple, TokenTable] = OrderedDict()
_TABLES_LOCK = threading.Lock()


def token_table(vocab: Vocabulary) -> TokenTable:
    """The `TokenTable` of a vocabulary over a tokenizer (a few kept, by tokenizer hash, size and eos)."""
    key = (vocab.tokenizer.sha256, len(vocab), vocab.eos_id)
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
        if hit is not None:
            _TABLES.move_to_end(key)
            return hit
    table = TokenTable(list(vocab.token_bytes), vocab.eos_id)
    with _TABLES_LOCK:
        _TABLES[key] = table
        while len(_TABLES) > 4:
            _TABLES.popitem(last=False)
    return table


def lift_states(states: np.ndarray, delta: np.ndarray, byte_cls: np.ndarray, table: TokenTable,
                 budget: Budget) -> np.ndarray:
    """The state after each content token's bytes from each of `states` (m, n) (a small automaton; -1 dead)."""
    Q, B = delta.shape
    T = np.vstack([np.where(delta < 0, Q, delta), np.full((1, B), Q)]).ravel()
    strings = byte_cls[table.matrix]
    S = np.repeat(states[:, None], len(table.ids), axis=1)
    for k in range(table.matrix.shape[1]):
        live = table.lengths > k
        S[:, live] = T[S[:, live] * B + strings[live, k]]
        budget.tick(S.size // 64)
    return np.where(S == Q, -1, S)


def group_columns(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items = the columns of keys (k, n) int -> (inverse (n,): the group of each item, first (G,): an item of each
    group), items with equal columns grouped, groups numbered by first appearance. A 64-bit polynomial hash per
    item, a key row at a time, then every item checked against its group's first (np.unique over the columns on a
    collision). O(n k)."""
    k, n = keys.shape
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * np.uint64(0x9E3779B97F4A7C15) + keys[j].astype(np.uint64) + np.uint64(j + 1)
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = first[inv]
    if not all(np.array_equal(keys[j], keys[j, rep]) for j in range(k)):
        _, first, inv = np.unique(keys.T, axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    rank = np.empty(len(first), dtype=np.int64)  # renumber by first appearance (deterministic classes)
    order = np.argsort(first)
    rank[order] = np.arange(len(first))
    return rank[inv], first[order]


def minimise(delta: np.ndarray, accept: np.ndarray, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """Moore refinement as `automata.minimise` (same result: blocks renumbered in BFS order from the start, only
    the reachable ones), each round grouping the signature rows (accept, block of each successor) by `_group`'s
    hash instead of a sort of the rows. O(rounds x Q C)."""
    Q, C = delta.shape
    if Q == 0:
        return delta, accept
    block = accept.astype(np.int64)
    count = len(np.unique(block))
    while True:
        budget.tick(delta.size)
        succ = np.where(delta >= 0, block[np.maximum(delta, 0)], -1)
        block, first = group_columns(np.concatenate([block[None], succ.T], 0))
        if len(first) == count:
            break
        count = len(first)
    bdelta = np.where(delta[first] >= 0, block[np.maximum(delta[first], 0)], -1)  # (blocks, C)
    order = [int(block[0])]
    seen = {order[0]: 0}
    i = 0
    while i < len(order):
        for b in bdelta[order[i]].tolist():
            if b >= 0 and b not in seen:
                seen[b] = len(order)
                order.append(b)
        i += 1
    budget.tick(len(order) * C)
    remap = np.full(count + 1, -1, dtype=np.int64)
    remap[np.array(list(seen))] = np.array(list(seen.values()))
    return remap[bdelta[order]], accept[first[order]]


class _Trie:
    """The distinct class strings of the tokens as a trie, level by level: at depth k, node i extends node
    `parent[k][i]` of depth k-1 (depth -1: the root) by class `label[k][i]`; the strings of length k+1 end at nodes
    `ends[k]` (their indices `enders[k]`). Lifting walks nodes, not strings: tokens share prefixes (about 4x fewer
    steps on a 50k BPE vocabulary)."""

    def __init__(self, mat: np.ndarray, lengths: np.ndarray, B: int):
        self.U = len(lengths)
        self.parent: list[np.ndarray] = []
        self.label: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        self.enders: list[np.ndarray] = []
        self.empty = np.flatnonzero(lengths == 0)
        node = np.zeros(self.U, dtype=np.int64)  # each string's node at the previous depth
        for k in range(mat.shape[1]):
            alive = np.flatnonzero(lengths > k)
            if not len(alive):
                break
            key = node[alive] * (B + 1) + mat[alive, k]
            uniq, inv = np.unique(key, return_inverse=True)
            self.parent.append(uniq // (B + 1))
            self.label.append(uniq % (B + 1))
            node[alive] = inv.reshape(-1)
            done = alive[lengths[alive] == k + 1]
            self.enders.append(done)
            self.ends.append(node[done])

    @property
    def nodes(self) -> int:
        return sum(len(p) for p in self.parent)

    def lift(self, T: np.ndarray, B: int, batch: np.ndarray, budget: Budget) -> np.ndarray:
        """(m, U): the state after each string from each state of `batch` (m,) (T: the flat (Q+1) x B table with
        an absorbing dead row). O(m x nodes)."""
        out = np.empty((len(batch), self.U), dtype=np.int64)
        out[:, self.empty] = batch[:, None]
        prev = batch[:, None]
        for parent, label, ends, enders in zip(self.parent, self.label, self.ends, self.enders, strict=True):
            prev = T[prev[:, parent] * B + label]
            out[:, enders] = prev[:, ends]
            budget.tick(prev.size // 16)
        return out


def lift(byte_delta: np.ndarray, byte_accept: np.ndarray, byte_cls: np.ndarray, table: TokenTable,
          budget: Budget) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The token-level automaton: states = byte states reached at token boundaries from the start (breadth-first,
    a chunk of states at a time), classes = distinct token class-strings with identical successors from every such
    state. Returns (delta (Q, C) -1 dead, accept (Q,), class of each distinct string (U,), the string of each content
    token (n,)). O(Q x nodes of the strings' trie)."""
    Qb, B = byte_delta.shape
    T = np.vstack([np.where(byte_delta < 0, Qb, byte_delta), np.full((1, B), Qb)]).astype(np.int64).ravel()
    mat = np.where(np.arange(table.matrix.shape[1])[None] < table.lengths[:, None], byte_cls[table.matrix], B)
    strings_of, first = group_columns(np.ascontiguousarray(mat.T))
    trie = _Trie(mat[first], table.lengths[first], B)
    U = len(first)
    chunk = max(1, LIFT_CHUNK_CELLS // max(U, trie.nodes // 4, 1))
    known = np.zeros(Qb + 1, dtype=bool)
    known[[0, Qb]] = True
    byte_of = [0]
    part = np.zeros(U, dtype=np.int64)  # class of each string
    rows = np.zeros((0, 1), dtype=np.int64)  # successor byte state per class, per token-level state
    pos = 0
    while pos < len(byte_of):
        batch = np.array(byte_of[pos: pos + chunk], dtype=np.int64)
        pos += len(batch)
        S = trie.lift(T, B, batch, budget)
        old = part
        part, firsts = group_columns(np.concatenate([old[None], S], 0))
        rows = np.concatenate([rows[:, old[firsts]], S[:, firsts]], 0)  # a class refines its parent's column
        seen = np.zeros(Qb + 1, dtype=bool)
        seen[S[:, firsts].ravel()] = True
        new = np.flatnonzero(seen & ~known)
        known[new] = True
        byte_of.extend(new.tolist())
        budget.states(len(byte_of), "its automaton over the tokens")
        budget.cells(len(byte_of), len(firsts), "its automaton over the tokens")
    remap = np.full(Qb + 1, -1, dtype=np.int64)
    remap[np.array(byte_of)] = np.arange(len(byte_of))
    return remap[rows], byte_accept[np.array(byte_of)], part, strings_of
