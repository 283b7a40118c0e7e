"""Constrained generation as operations: a `constraint` object compiled to an automaton over the model's vocabulary
(`models.constraint`), and exact inference on the model x automaton product (`models.constrained`): P(C | prefix),
the guide's next-token weights, exact constrained sampling.

    P(C | prefix) = sum over complete continuations y (ending in <eos>) with min_tokens <= |y| <= max_tokens
                    that satisfy C of p(y | prefix).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from latentlm.models import constrained, constrained_sampling, registry, text_constraint
from latentlm.models import constraint as automata
from latentlm.models.errors import InputError, UnsupportedOperation
from latentlm.models.results import Beam, ConstraintProb, Continuation, Sample
from latentlm.ops import format
from latentlm.ops.inputs import check_seed
from latentlm.ops.model import LoadedModel


@dataclass(frozen=True)
class Limits:
    """The sizes a constrained request may reach before it is refused 413, before any work: states of its
    minimised automaton, bytes of its backward messages, seconds its compilation may take. The service sets them
    (LATENTLM_MAX_CONSTRAINT_STATES, LATENTLM_MAX_CONSTRAINT_BYTES, LATENTLM_CONSTRAINT_COMPILE_SECONDS).
    `max_request_tokens`, `max_sample_tokens`: the service's request limits, for an operation that checks them
    before its own work (completions: before compiling its constraint); None: not checked while preparing (the
    service checks every operation's after preparing, `service.execute.prepare`).
    `cancelled`: polled while compiling (the request's client went away, the service stops); not part of equality."""

    max_states: int = automata.DEFAULT_MAX_STATES
    max_bytes: int = constrained.DEFAULT_MAX_TABLE_BYTES
    compile_seconds: float = automata.DEFAULT_COMPILE_SECONDS
    max_request_tokens: int | None = None
    max_sample_tokens: int | None = None
    cancelled: Callable[[], bool] | None = field(default=None, compare=False, repr=False)


class MessageCache:
    """The backward messages of recent (model version, constraint, temperature) triples, least recently used
    dropped first, at most `max_bytes` in all (`constrained.table_bytes` each): they depend on neither the prefix nor
    the samples, so a guide asking once per generated token (`generated`), or the same constraint asked again, reuses
    them instead of rebuilding O(max_tokens (Q S^2 + E S)) work. Thread-safe (the service's lanes share it)."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple[constrained.Messages, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, model: LoadedModel, dfa: automata.WordDFA, temperature: float, limits: Limits
            ) -> constrained.Messages:
        key = (id(model.impl), model.content_hash, model.numerics(), dfa.constraint, int(dfa.cls.shape[0]),
               limits.max_states, float(temperature))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit[0]
            self.misses += 1
        msgs = constrained.prepare(model.impl, dfa, temperature=temperature, max_bytes=limits.max_bytes)
        size = constrained.table_bytes(model.impl, dfa)
        if size <= self.max_bytes:
            with self._lock:
                self._entries[key] = (msgs, size)
                while sum(b for _, b in self._entries.values()) > self.max_bytes:
                    self._entries.popitem(last=False)
        return msgs

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


MESSAGES = MessageCache()


def check_family(model: LoadedModel, param: str = "constraint") -> None:
    """UnsupportedOperation naming `param` unless the model's family lists `constraint` among its operations."""
    if "constraint" not in model.impl.operations:
        raise UnsupportedOperation(f"{param}: model {model.name!r} (family {model.family}) has no constrained "
                                   f"inference; families with it: {', '.join(registry.families_with('constraint'))}",
                                   param=param)


def compile_for(model: LoadedModel, spec: Any, limits: Limits, *, default_max_tokens: int | None = None
                ) -> automata.WordDFA:
    """`compile_request`'s automaton (its warnings left out)."""
    return compile_request(model, spec, limits, default_max_tokens=default_max_tokens)[0]


def compile_request(model: LoadedModel, spec: Any, limits: Limits, *, default_max_tokens: int | None = None
                    ) -> tuple[automata.WordDFA, list[str]]:
    """The request's `constraint` (a `ConstraintSpec` or a dict) -> its minimal automaton over the model's vocabulary,
    and the warnings of what was dropped (an excluded phrase with a word outside the vocabulary). 422 naming the
    field and the word for words outside the vocabulary elsewhere or an empty language; 413 above
    `limits.max_states` or past `limits.compile_seconds` of compilation (`constraint.regex` when the regex is what
    is too large); `automata.CompileCancelled` when `limits.cancelled()` turns true meanwhile. CPU-bound for up to
    `limits.compile_seconds`: a server runs it off its event loop. `default_max_tokens`: the window's end when the
    constraint names none."""
    check_family(model)
    parsed = parse_request(model, spec, default_max_tokens)
    if isinstance(parsed, text_constraint.TextConstraint):  # a model over an LM's tokenizer: constraints on text
        dfa: automata.WordDFA = text_constraint.compile_text_constraint(
            parsed, model.vocab, max_states=limits.max_states, seconds=limits.compile_seconds,
            cancelled=limits.cancelled)
    else:
        dfa = automata.compile_constraint(parsed, model.vocab, max_states=limits.max_states,
                                          seconds=limits.compile_seconds, cancelled=limits.cancelled)
    return dfa, list(parsed.warnings)


WORD_COUNTS = ("min_words", "max_words")


def parse_request(model: LoadedModel, spec: Any, default_max_tokens: int | None = None
                  ) -> automata.Constraint | text_constraint.TextConstraint:
    """The request's `constraint` parsed (no compilation: O(words)): over the decoded text for a model that carries
    its LM's tokenizer (`models.text_constraint`), else over the vocabulary's words, where `min_words` /
    `max_words` are refused (422 naming them: a word-level model's tokens are its words, min_tokens / max_tokens
    count them). `.warnings` says what was dropped."""
    raw = spec.model_dump(exclude_none=True) if hasattr(spec, "model_dump") else dict(spec)
    if default_max_tokens is not None:
        raw.setdefault("max_tokens", default_max_tokens)
    if getattr(model.vocab, "tokenizer", None) is not None:
        return text_constraint.parse_text_constraint(raw)
    for key in WORD_COUNTS:
        if key in raw:
            raise InputError(f"constraint.{key}: counts the words of a text decoded by an LM's tokenizer; model "
                             f"{model.name!r} is word-level (its tokens are words: use min_tokens / max_tokens, "
                             "which count the final <eos> too)", param=f"constraint.{key}")
    return automata.parse_constraint(raw, model.vocab)


def generated_ids(model: LoadedModel, ids: list[int] | None) -> list[int]:
    """The continuation generated so far (token ids in [0, V), no `<eos>`: a continuation ends at its first)."""
    if not ids:
        return []
    model.vocab.check_ids(list(ids), where="generated")
    if model.vocab.eos_id is not None and model.vocab.eos_id in ids:
        raise InputError(f"generated: holds <eos> (id {model.vocab.eos_id}) at position "
                         f"{list(ids).index(model.vocab.eos_id)}: a continuation ends there", param="generated")
    return list(ids)


def automaton_sizes(dfa: automata.WordDFA) -> dict[str, Any]:
    """What a response reports of the automaton: its states, edges, word classes and the parts' sizes."""
    return {"states": dfa.num_states, "classes": dfa.num_classes, "edges": int((dfa.delta >= 0).sum()),
            "min_tokens": dfa.min_tokens, "max_tokens": dfa.max_tokens, **dfa.sizes}


def probability(model: LoadedModel, dfa: automata.WordDFA, prefix: list[int] | None, *, temperature: float = 1.0,
                weights: bool = False, generated: list[int] | None = None, limits: Limits = Limits()
                ) -> ConstraintProb:
    """log P(C | prefix[, generated]) (None for probability 0), the automaton's sizes[, and P(C | prefix[, generated],
    v) for every token id v]; `generated`: continuation tokens already produced (one guide step each).
    O(max_tokens (Q S^2 + E S)) for the messages, O((prefix + generated) S^2) for the tokens."""
    with torch.no_grad():
        msgs = MESSAGES.get(model, dfa, temperature, limits)
        if not generated:
            log_prob = msgs.log_prob(prefix)
            w = constrained.Guide(msgs, [prefix]).weights()[0].tolist() if weights else None
            return ConstraintProb(log_prob, automaton_sizes(dfa), w)
        guide = constrained.Guide(msgs, [prefix])
        for token in generated:
            guide.advance([token])
        return ConstraintProb(guide.log_prob()[0], automaton_sizes(dfa), guide.weights()[0].tolist() if weights
                              else None)


def beam(model: LoadedModel, dfa: automata.WordDFA, prefix: list[int] | None, *, width: int, n_best: int = 1,
         temperature: float = 1.0, limits: Limits = Limits()) -> Beam:
    """The constrained beam search (`models.constrained.beam_search`: hypotheses ranked by p(h | x) P(C | x, h)):
    its completions best first, each with log p(y | prefix) and log p(y | prefix, C); `certified`: provably the
    n_best most probable satisfying continuations, else `gap` bounds how much more probable (in log) an unseen one
    could be. O(max_tokens width (S V + S^2)) after the messages."""
    if n_best > width:
        raise InputError(f"n_best: {n_best} is above the beam width {width}", param="n_best")
    with torch.no_grad():
        msgs = MESSAGES.get(model, dfa, temperature, limits)
        found = constrained.beam_search(msgs, prefix=prefix, beam=width, n_best=n_best)
    return Beam([Continuation(r["ids"], r["log_prob"], r["log_prob_given"]) for r in found.results], found.certified,
                found.gap)


def draw(model: LoadedModel, dfa: automata.WordDFA, *, n: int, seed: int, prefix: list[int] | None,
         temperature: float = 1.0, limits: Limits = Limits()) -> list[Sample]:
    """n continuations drawn exactly from p(y | prefix, y complete, y satisfies C) (the model tempered first), each
    ending with `<eos>` (`finish_reason` "eos", no states); 422 naming `constraint` when P(C | prefix) = 0."""
    check_seed(seed)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a positive finite number, got {temperature!r}", param="temperature")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        msgs = MESSAGES.get(model, dfa, temperature, limits)
        draws = constrained_sampling.sample(msgs, n, gen, prefix=prefix)
    return [Sample(ids, finish_reason="eos") for ids in draws]


def sample(model: LoadedModel, dfa: automata.WordDFA, *, n: int, seed: int, prefix: list[int] | None,
           temperature: float = 1.0, limits: Limits = Limits()) -> list[dict]:
    """`draw`'s samples as `/v1/sample` answers them (`format.samples`): `{"index", "tokens"[, "text"], "ids",
    "finish_reason": "eos"}`."""
    return format.samples(model.vocab, draw(model, dfa, n=n, seed=seed, prefix=prefix, temperature=temperature,
                                            limits=limits), prefix)


def cost(model: LoadedModel, dfa: automata.WordDFA, *, n_samples: int = 0, guide_rows: int = 0, beam: int = 0,
         prefix_tokens: int = 0) -> int:
    """The request's work in the cost model's units, known once the automaton is compiled."""
    return constrained.estimate_cost(model.impl, dfa, n_samples=n_samples, guide_rows=guide_rows, beam=beam,
                                     prefix_tokens=prefix_tokens)
