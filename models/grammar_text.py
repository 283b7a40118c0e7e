"""Plain-text grammars (`latentlm import-pcfg FILE --name NAME [--start SYM]`): a grammar file becomes the
`dense_pcfg` family's tensors.

Format: one rule per line, `LHS -> RHS PROB` (the probability may be written `[PROB]`); `#` starts a
comment; blank lines are ignored. Terminals (words) are quoted, 'like' "this"; everything else is a symbol.
    S  -> NP VP 1.0          binary rule: S is a nonterminal
    NP -> Det N 1.0
    Det -> 'the' 0.7          lexical rule: Det is a preterminal
    Det -> 'a' 0.3
    N -> 'dog' 1.0
    VP -> 'barks' 1.0
The start symbol is `--start` or the first rule's left-hand side. It may have binary rules (it is then the
root) or only unary rules `S -> A p` naming the root's distribution over symbols (a unary rule to a
preterminal generates one-word sentences). Every other symbol has either binary or lexical rules, never
both (words come only from preterminals). Checked, with the line named: syntax, probabilities in (0, 1],
duplicate rules, unknown symbols, each symbol's rules summing to 1 within 1e-4, a start symbol that is
defined and derives some finite sentence, symbols unreachable from the start.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from latentlm.models.errors import InputError, read_text_file
from latentlm.models.vocab import Preprocessing, Vocabulary

TOL = 1e-4
_TERMINAL = re.compile(r"""^(?:'([^']+)'|"([^"]+)")$""")


@dataclass
class Rule:
    line: int
    lhs: str
    rhs: tuple[str, ...]
    prob: float
    lexical: bool


def _fail(line: int, msg: str) -> None:
    raise InputError(f"line {line}: {msg}", param="FILE")


def _strip_comment(text: str) -> str:
    """Drop a `#` comment that is not inside a quoted word."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return text[:i]
    return text


def parse_rule(text: str, line: int) -> Rule | None:
    """One line -> Rule (None for blank/comment lines); InputError naming the line otherwise."""
    text = _strip_comment(text).strip()
    if not text:
        return None
    if "->" not in text:
        _fail(line, f"expected 'LHS -> RHS PROB', got {text!r}")
    lhs, rest = (s.strip() for s in text.split("->", 1))
    if not lhs or len(lhs.split()) != 1 or _TERMINAL.match(lhs):
        _fail(line, f"left-hand side must be one symbol, got {lhs!r}")
    toks = re.findall(r"""'[^']*'|"[^"]*"|\[[^\]]*\]|\S+""", rest)
    if len(toks) < 2:
        _fail(line, f"rule for {lhs!r} needs a right-hand side and a probability")
    ptxt = toks[-1].strip("[]")
    try:
        prob = float(ptxt)
    except ValueError:
        _fail(line, f"the last field must be the rule's probability, got {toks[-1]!r}")
    if not (math.isfinite(prob) and 0 < prob <= 1):
        _fail(line, f"probability must be in (0, 1], got {ptxt}")
    rhs = tuple(toks[:-1])
    words = [_TERMINAL.match(t) for t in rhs]
    if any(t in ("''", '""') for t in rhs):
        _fail(line, "empty terminal ''")
    if any(words):
        if len(rhs) != 1:
            _fail(line, "a lexical rule has exactly one quoted word on the right (terminals cannot appear in "
                        "binary rules of this grammar family)")
        m = words[0]
        return Rule(line, lhs, ((m.group(1) or m.group(2)),), prob, True)
    if len(rhs) > 2:
        _fail(line, f"rules have one or two right-hand-side symbols, got {len(rhs)}")
    return Rule(line, lhs, rhs, prob, False)


def read_grammar(text: str, start: str | None = None) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """Grammar text -> (dense_pcfg tensors (float64), config, vocabulary tokens). InputError names the line."""
    rules = [r for i, ln in enumerate(text.splitlines(), 1) if (r := parse_rule(ln, i)) is not None]
    if not rules:
        raise InputError("the grammar has no rules", param="FILE")
    start = start or rules[0].lhs
    first_line: dict[str, int] = {}
    kinds: dict[str, str] = {}
    seen: dict[tuple[str, tuple[str, ...], bool], int] = {}
    for r in rules:
        key = (r.lhs, r.rhs, r.lexical)
        if key in seen:
            _fail(r.line, f"duplicate rule {r.lhs} -> {' '.join(r.rhs)} (first on line {seen[key]})")
        seen[key] = r.line
        first_line.setdefault(r.lhs, r.line)
        kind = "lexical" if r.lexical else ("unary" if len(r.rhs) == 1 else "binary")
        if kind == "unary" and r.lhs != start:
            _fail(r.line, f"unary rule {r.lhs} -> {r.rhs[0]}: only the start symbol {start!r} may have unary "
                          "rules (they give the root's distribution)")
        prev = kinds.setdefault(r.lhs, kind)
        if prev != kind:
            _fail(r.line, f"symbol {r.lhs!r} has both {prev} and {kind} rules; in this family a symbol either "
                          "rewrites to two symbols or emits one word")
    if start not in kinds:
        raise InputError(f"start symbol {start!r} has no rules", param="start")
    for r in rules:
        for sym in ([] if r.lexical else r.rhs):
            if sym not in kinds:
                _fail(r.line, f"unknown symbol {sym!r} (it has no rules)")
            if kinds[sym] == "unary":
                _fail(r.line, f"symbol {sym!r} is the start symbol with unary rules; it cannot appear on a "
                              "right-hand side")
    totals: dict[str, float] = {}
    for r in rules:
        totals[r.lhs] = totals.get(r.lhs, 0.0) + r.prob
    for sym, tot in totals.items():
        if abs(tot - 1) > TOL:
            _fail(first_line[sym], f"the rules of {sym!r} sum to {tot:.6g}, not 1 (tolerance {TOL})")
    _check_start(rules, kinds, start, first_line)
    nts = [s for s in first_line if kinds[s] == "binary"]
    pts = [s for s in first_line if kinds[s] == "lexical"]
    syms = nts + pts
    index = {s: i for i, s in enumerate(syms)}
    vocab: dict[str, int] = {}
    for r in rules:
        if r.lexical:
            vocab.setdefault(r.rhs[0], len(vocab))
    S, nt = len(syms), len(nts)
    start_v = torch.zeros(S, dtype=torch.float64)
    rules_t = torch.zeros(max(nt, 1), S, S, dtype=torch.float64)
    emit = torch.zeros(len(pts), len(vocab), dtype=torch.float64)
    for r in rules:
        if r.lexical:
            emit[index[r.lhs] - nt, vocab[r.rhs[0]]] += r.prob
        elif len(r.rhs) == 1:
            start_v[index[r.rhs[0]]] += r.prob
        else:
            rules_t[index[r.lhs], index[r.rhs[0]], index[r.rhs[1]]] += r.prob
    if kinds[start] != "unary":
        start_v[index[start]] = 1.0
    if nt == 0:  # a grammar of one-word sentences: keep one dummy nonterminal that is never used
        syms = ["_unused"] + syms
        start_v = torch.cat([start_v.new_zeros(1), start_v])
        rules_t = torch.zeros(1, S + 1, S + 1, dtype=torch.float64)
        rules_t[0, 0, 0] = 1.0
        nt = 1
    config = {"nt": nt, "pt": len(pts), "symbols": syms, "start_symbol": start}
    return {"start": start_v, "rules": rules_t, "emit": emit}, config, list(vocab)


def _check_start(rules: list[Rule], kinds: dict[str, str], start: str, first_line: dict[str, int]) -> None:
    """The start derives some finite sentence, and every symbol is reachable from it."""
    productive: set[str] = {r.lhs for r in rules if r.lexical}
    changed = True
    while changed:
        changed = False
        for r in rules:
            if r.lhs not in productive and not r.lexical and all(s in productive for s in r.rhs):
                productive.add(r.lhs)
                changed = True
    if start not in productive:
        raise InputError(f"line {first_line[start]}: the start symbol {start!r} derives no finite sentence "
                         "(every derivation from it loops forever)", param="start")
    reach, todo = {start}, [start]
    while todo:
        a = todo.pop()
        for r in rules:
            if r.lhs == a and not r.lexical:
                for s in r.rhs:
                    if s not in reach:
                        reach.add(s)
                        todo.append(s)
    for sym, line in first_line.items():
        if sym not in reach:
            _fail(line, f"symbol {sym!r} is unreachable from the start symbol {start!r}")


def read_grammar_file(path: Path, start: str | None = None) -> tuple[dict[str, torch.Tensor], Vocabulary, dict]:
    """The `import-pcfg` importer: a grammar file -> (dense_pcfg tensors, vocabulary, config). InputError
    names the file and the line."""
    text = read_text_file(path, param="FILE")
    try:
        tensors, config, words = read_grammar(text, start)
    except InputError as e:
        raise InputError(f"{path}: {e.message}", param=e.param) from None
    return tensors, Vocabulary(words, Preprocessing(lowercase=False, unk=None, eos=None, add_eos=False)), config
