"""Sampling: n samples (or continuations of a prefix), plain or constrained, stop sequences and each sample's
finish_reason; what a sample request costs and what a constrained one must not ask."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from latentlm.models.constraint import WordDFA
from latentlm.models.errors import InputError, UnsupportedOperation
from latentlm.models.results import Sample
from latentlm.ops import constrain, format, inputs
from latentlm.ops.compute import check_supported
from latentlm.ops.constrain import Limits
from latentlm.ops.cost import operation_cost
from latentlm.ops.inputs import check_seed, check_shaping, encode_stops
from latentlm.ops.model import LoadedModel


def sample(model: LoadedModel, *, n: int = 1, max_tokens: int = 32, seed: int = 0,
           prefix: str | list[int] | None = None, temperature: float = 1.0, stop_at_eos: bool = True,
           stop: str | Sequence[str | list[int]] | None = None, top_k: int | None = None,
           top_p: float | None = None, dfa: WordDFA | None = None, limits: Limits = Limits()) -> list[dict]:
    """n samples (continuations of `prefix` when given, which is tokenised without `<eos>`), as `/v1/sample` answers
    them (`format.samples`: one shape, constrained or not); see `draw`."""
    prefix_ids, res = draw(model, n=n, max_tokens=max_tokens, seed=seed, prefix=prefix, temperature=temperature,
                           stop_at_eos=stop_at_eos, stop=stop, top_k=top_k, top_p=top_p, dfa=dfa, limits=limits)
    return format.samples(model.vocab, res, prefix_ids)


def draw(model: LoadedModel, *, n: int = 1, max_tokens: int = 32, seed: int = 0,
         prefix: str | list[int] | None = None, temperature: float = 1.0, stop_at_eos: bool = True,
         stop: str | Sequence[str | list[int]] | None = None, top_k: int | None = None,
         top_p: float | None = None, dfa: WordDFA | None = None, limits: Limits = Limits()
         ) -> tuple[list[int] | None, list[Sample]]:
    """The prefix's token ids and n samples drawn after it (typed `Sample`s). `stop`: up to `MAX_STOP_SEQUENCES` stop
    sequences (text, tokenised without `<eos>`, or token-id lists; one string alone is one sequence): a sample of a
    chain family ends before the first place its drawn tokens spell one (the sequence itself left out, as OpenAI-
    style servers do). Over an LM's tokenizer a text stop is matched on the decoded text, however it was tokenised:
    the sample keeps the tokens that end before the stop text starts (`cut_at_stop`). Cutting a drawn sample there
    gives exactly the distribution of stopping there: what follows a position never changes what precedes it. Chain
    families report each sample's `finish_reason`: "stop" (a stop sequence), "eos" (ended by `<eos>`) or "length"
    (`max_tokens` drawn). `top_k` / `top_p`: each token is drawn from the model's next-token distribution p(x_t |
    x_<t), `temperature` applied to it, cut to its `top_k` most probable tokens and to the fewest whose mass reaches
    `top_p`, as LM servers do (forward filtering; the states then from p(z | x); families with
    `predictive_sampling`: hmm, tagging_hmm, blocked_hmm). Without them a sample is drawn ancestrally, state then
    token, `temperature` applied to each table. `dfa`: a compiled constraint (`constrained_options` checked the
    options): each sample drawn exactly from p(y | prefix, y complete, y satisfies it), ending with `<eos>`
    (`constrain.draw`)."""
    from latentlm.models.tree import PCFGOps

    check_supported(model, "sample")
    if n < 1 or max_tokens < 1:
        raise InputError("n and max_tokens must be >= 1", param="n" if n < 1 else "max_tokens")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a positive finite number, got {temperature!r}", param="temperature")
    check_seed(seed)
    prefix_ids = inputs.prefix_ids(model.vocab, prefix)
    if dfa is not None:
        return prefix_ids, constrain.draw(model, dfa, n=n, seed=seed, prefix=prefix_ids, temperature=temperature,
                                          limits=limits)
    shaping = check_shaping(model, top_k, top_p)
    stops = encode_stops(model.vocab, stop)
    texts = text_stops(model.vocab, stop)
    trees = isinstance(model.impl, PCFGOps)
    if stops and trees:
        raise UnsupportedOperation("stop: a PCFG samples whole sentences with their trees; stop sequences apply to "
                                   "the chain families", param="stop")
    stop_id = model.vocab.eos_id if stop_at_eos else None
    res = model.impl.op_sample(n=n, max_tokens=max_tokens, seed=seed, prefix=prefix_ids, temperature=temperature,
                               stop_id=stop_id, **({"stop_seqs": stops} if stops else {}), **shaping)
    if not trees:
        spell = None if not texts else (lambda ids: model.vocab.piece_bytes(ids, prefix_ids or ()))
        id_stops = [s for s, item in zip(stops, _items(stop), strict=True) if not isinstance(item, str) or not texts]
        res = [cut_at_stop(r, id_stops, stop_id, max_tokens, texts, spell) for r in res]
    return prefix_ids, res


def _items(stop: Any) -> list[Any]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def text_stops(vocab: Any, stop: Any) -> list[bytes]:
    """The UTF-8 bytes of the text stop sequences of a model over an LM's tokenizer (matched on the decoded text);
    [] for a word-level vocabulary, whose text stops are word sequences (`encode_stops`)."""
    if vocab.tokenizer is None:
        return []
    return [item.encode("utf-8") for item in _items(stop) if isinstance(item, str)]


def cut_at_stop(sample: Sample, stops: list[list[int]], stop_id: int | None, max_tokens: int,
                texts: Sequence[bytes] = (), spell: Callable[[list[int]], list[bytes]] | None = None) -> Sample:
    """A chain family's drawn sample (ids and states) cut before the first stop sequence it spells, with its
    `finish_reason` ("stop", "eos" or "length"). A stop is token ids (`stops`: the first to be complete; of those
    complete at the same token, the longest, cut away whole) or text (`texts`, matched on the bytes `spell(ids)`
    gives each token: the tokens that end before the first stop text starts are kept, so the text ends before it;
    a stop starting inside a token takes that token's first bytes with it). O(len(ids) x total stop length)."""
    ids = sample.ids
    parts = spell(ids) if texts and spell is not None else None
    done, longest = b"", max((len(t) for t in texts), default=0)
    for end in range(1, len(ids) + 1):  # the first place a stop sequence is complete; there, the longest one
        hit = max((len(s) for s in stops if len(s) <= end and ids[end - len(s): end] == s), default=0)
        keep = end - hit if hit else None
        if parts is not None:  # a text stop completed within this token: cut before the token it starts in
            start = len(done)
            done += parts[end - 1]
            at = [done.find(t, max(0, start - longest)) for t in texts]
            first = min((a for a in at if a >= 0), default=-1)
            if first >= 0:
                ends, k = 0, 0
                while k < end and ends + len(parts[k]) <= first:
                    ends += len(parts[k])
                    k += 1
                keep = k if keep is None else min(keep, k)
        if keep is not None:
            states = None if sample.states is None else sample.states[:keep]
            return dataclasses.replace(sample, ids=ids[:keep], states=states, finish_reason="stop")
    eos = stop_id is not None and bool(ids) and ids[-1] == stop_id
    return dataclasses.replace(sample, finish_reason="eos" if eos else "length")



def constrained_options(opts: dict[str, Any]) -> None:
    """InputError naming the option that a constrained sample cannot take: top_k, top_p, stop (constrained samples
    are drawn exactly from the conditioned model), stop_at_eos false (one is complete when it emits `<eos>`)."""
    for name in ("top_k", "top_p", "stop"):
        if opts.get(name) is not None:
            raise InputError(f"{name}: not combined with `constraint` (constrained samples are drawn exactly "
                             "from the conditioned model)", param=name)
    if not opts.get("stop_at_eos", True):
        raise InputError("stop_at_eos: a constrained sample is complete when it emits <eos>; it cannot be "
                         "false with `constraint`", param="stop_at_eos")


def compile_constraint(model: LoadedModel, spec: Any, opts: dict[str, Any], limits: Limits
                       ) -> tuple[WordDFA, list[str]]:
    """A sample's `constraint` compiled (within `limits`) after its options are checked (`constrained_options`), the
    window's end defaulting to `opts["max_tokens"]`, and the warnings of what it dropped; InputError naming
    `constraint.max_tokens` when the constraint's window ends after the request's max_tokens."""
    constrained_options(opts)
    dfa, warnings = constrain.compile_request(model, spec, limits, default_max_tokens=opts["max_tokens"])
    if dfa.max_tokens > opts["max_tokens"]:
        raise InputError(f"constraint.max_tokens: {dfa.max_tokens} is above the request's max_tokens "
                         f"{opts['max_tokens']}", param="constraint.max_tokens")
    return dfa, warnings


def sample_cost(model: LoadedModel, opts: dict[str, Any], prefix_tokens: int, dfa: WordDFA | None = None) -> int:
    """The work of drawing `opts["n"]` samples of at most `opts["max_tokens"]` after `prefix_tokens` tokens (the
    family's cost; a constrained draw's from its automaton)."""
    if dfa is not None:
        return constrain.cost(model, dfa, n_samples=opts["n"], prefix_tokens=prefix_tokens)
    predictive = opts.get("top_k") is not None or opts.get("top_p") is not None
    return operation_cost(model, "sample", n=opts["n"], max_tokens=opts["max_tokens"], prefix_tokens=prefix_tokens,
                          predictive=predictive)


def prefix_tokens(model: LoadedModel | None, prefix: str | list[int] | None) -> int:
    """Tokens of a sample prefix: ids as given, text as the model tokenises it (no <eos>)."""
    if not prefix:
        return 0
    if isinstance(prefix, list):
        return len(prefix)
    if model is not None and model.vocab.tokenizer is not None:
        return len(model.vocab.tokenizer.encode(prefix))
    return len(model.vocab.tokenize(prefix) if model is not None else prefix.split())
