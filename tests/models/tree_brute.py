"""Brute force over every labelled binary tree for tiny PCFGs (float64), the reference for the tree engine.

A grammar is (start (S,), rules (NT, S, S), emit (PT, V)) with symbols 0..NT-1 nonterminals and NT..S-1
preterminals; every quantity is a sum or max over all Catalan(n-1) bracketings times all labellings."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

Tree = tuple  # (i, j, left, right) or (i,) for the word at i


def bracketings(i: int, j: int) -> Iterator[Tree]:
    """Every binary tree over words i..j-1."""
    if j - i == 1:
        yield (i,)
        return
    for k in range(i + 1, j):
        for left in bracketings(i, k):
            for right in bracketings(k, j):
                yield (i, j, left, right)


def spans(tree: Tree) -> set[tuple[int, int]]:
    """Constituents of width >= 2."""
    if len(tree) == 1:
        return set()
    return {(tree[0], tree[1])} | spans(tree[2]) | spans(tree[3])


def derivations(tree: Tree, sym: int, words: list[int], rules: Tensor, emit: Tensor, nt: int
                ) -> Iterator[tuple[float, tuple]]:
    """(probability, labelled tree) of every labelling of `tree` rooted at `sym`."""
    if len(tree) == 1:
        if sym >= nt:
            yield float(emit[sym - nt, words[tree[0]]]), (sym, words[tree[0]])
        return
    if sym >= nt:
        return
    S = rules.shape[1]
    for b in range(S):
        for c in range(S):
            p = float(rules[sym, b, c])
            if p == 0:
                continue
            for pl, tl in derivations(tree[2], b, words, rules, emit, nt):
                for pr, tr in derivations(tree[3], c, words, rules, emit, nt):
                    yield p * pl * pr, (sym, tl, tr)


@dataclass
class Brute:
    logprob: float
    marginals: dict[tuple[int, int], float]
    best_logprob: float
    best_tree: tuple
    mbr_score: float
    mbr_spans: list[set[tuple[int, int]]]  # every bracketing reaching the best score


def brute(start: Tensor, rules: Tensor, emit: Tensor, words: list[int]) -> Brute:
    n, nt = len(words), rules.shape[0]
    total = 0.0
    per_tree: list[tuple[Tree, float]] = []
    best = (-1.0, None)
    for tree in bracketings(0, n):
        pt = 0.0
        for a in range(start.shape[0]):
            for p, lab in derivations(tree, a, words, rules, emit, nt):
                p *= float(start[a])
                pt += p
                if p > best[0]:
                    best = (p, lab)
        per_tree.append((tree, pt))
        total += pt
    marg: dict[tuple[int, int], float] = {}
    for tree, p in per_tree:
        for sp in spans(tree):
            marg[sp] = marg.get(sp, 0.0) + p / total
    scores = [(sum(marg.get(sp, 0.0) for sp in spans(t)), spans(t)) for t, _ in per_tree]
    top = max(s for s, _ in scores)
    return Brute(math.log(total), marg, math.log(best[0]), best[1], top,
                 [sp for s, sp in scores if s > top - 1e-9])


def tree_string(tree: tuple, name) -> str:
    """Labelled tree tuple -> the engine's bracketed format."""
    if len(tree) == 2:
        return f"({name(tree[0])} {tree[1]})"
    return f"({name(tree[0])} {tree_string(tree[1], name)} {tree_string(tree[2], name)})"
