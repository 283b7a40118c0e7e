"""The `completions` operation: OpenAI's completions over the chain families (`base.ChainFamily`: hmm, blocked_hmm,
rank_hmm, tagging_hmm and any registered later). Declared in `ops.spec` like every operation (its request model is
`requests.CompletionRequest`); served by `POST /v1/completions` (`service.routes.completions`: OpenAI's framing and
its server-sent events) and by batch lines.

Generation is `/v1/sample`'s: each prompt's choices are `generate.draw(n, max_tokens, seed, prefix=prompt, ...)`,
with the options checked and costed as a sample request's (`generate.compile_constraint`, `generate.sample_cost`),
so a seeded completion equals `/v1/sample` with the same seed and settings; a constraint is compiled once, when the
request is prepared, for all its prompts. What the OpenAI shape adds is computed from the model exactly:
- `logprobs`: each token's log p(x_t | x_<t) is `/v1/score`'s `token_logprobs` of prompt + completion (the same
  `batching.run(model, "score", ..., token_logprobs=True)`); the top alternatives come from the next-token
  distribution p(. | x_<t) by forward filtering (the hooks of the families' top_k/top_p sampler; rank_hmm in rank
  space). O(T K (Z + V)) per choice of T tokens (K: the states one token is emitted by).
- `echo`: the prompt and its per-token log-probabilities (scoring without generation: `max_tokens: 0`).

Text: tokens are joined with single spaces as the vocabulary spells them (`<unk>`, lowercasing and `<eos>` as the
model's manifest says); a completion after a non-empty prompt starts with a space, so `prompt + text` reads as one
text. For a model over an LM's tokenizer (`tokenizer.json`), prompts are its ids and `text` its exact decoding;
`logprobs.tokens` are each token's piece of that text (joining to it exactly) and `logprobs.bytes` each token's
UTF-8 bytes (`tokenizer_choices`). `<eos>` ends a choice (`finish_reason` "stop") and is not part of its text.
Fields latentlm cannot honour answer 400 naming the field (`UnsupportedOperation`, code `unsupported_parameter`);
nothing is silently ignored. `run` returns typed `Completion`s; `body` writes OpenAI's `text_completion`.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from typing import Any

import torch

from latentlm.models import registry
from latentlm.models.base import ChainFamily, NextTokenFilter
from latentlm.models.errors import InputError, LatentLMError, LimitExceeded, UnsupportedOperation
from latentlm.models.results import Completion, Sample
from latentlm.ops import batching, format, generate
from latentlm.ops.call import Call
from latentlm.ops.compute import check_supported
from latentlm.ops.constrain import Limits
from latentlm.ops.cost import operation_cost
from latentlm.ops.inputs import MAX_SEED
from latentlm.ops.model import LoadedModel
from latentlm.ops.requests import DEFAULT_MAX_TOKENS, CompletionRequest

ADVICE = "ask for fewer or shorter completions (prompts, n, max_tokens) or fewer logprobs"
SAMPLE_OPTIONS = ("n", "max_tokens", "seed", "temperature", "stop_at_eos", "stop", "top_k", "top_p")


def supports(model: LoadedModel) -> bool:
    """Whether the model generates text token by token (a chain family)."""
    return isinstance(model.impl, ChainFamily)


def refusal(model: LoadedModel) -> UnsupportedOperation:
    """400 `unsupported_model` naming the families that answer completions."""
    return UnsupportedOperation(f"model {model.name!r} (family {model.family}) does not generate text token by token; "
                                f"completions serve the chain families ({', '.join(registry.families(ChainFamily))})",
                                param="model", code="unsupported_model")


def refuse_unsupported(req: CompletionRequest) -> None:
    """400 naming the first field whose value latentlm cannot honour (never silently ignored)."""
    def no(param: str, why: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"{param}: {why}", param=param, code="unsupported_parameter")

    if req.suffix:
        raise no("suffix", "infilling (a suffix after the completion) is not supported; leave suffix out")
    n = req.n or 1
    if req.best_of is not None and req.best_of not in (1, n):
        raise no("best_of", f"the choices returned are the samples drawn: best_of must be 1 or n ({n}), got "
                            f"{req.best_of}")
    if req.logit_bias:
        raise no("logit_bias", "biasing token logits is not supported (the distributions are the model's exact ones)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise no(name, "repetition penalties are not supported; leave it out or send 0")
    if req.stream_options is not None and not req.stream:
        raise InputError("stream_options: only allowed with stream: true", param="stream_options")


def encode_prompts(model: LoadedModel, prompt: Any) -> list[list[int]]:
    """Prompts -> token ids (text tokenised without `<eos>`; "" is the empty prompt); 422 naming `prompt`."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    out = []
    try:
        for i, p in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(p, str):  # a word-level model reads no words in white space; an LM's tokenizer does
                text = p if model.vocab.tokenizer is not None else p.split()
                out.append(model.vocab.encode(p, add_eos=False, where=where) if text else [])
            else:
                out.append(model.vocab.check_ids(list(p), where=where))
    except InputError as e:
        raise InputError(e.message, param="prompt") from None
    return out


def prepare(model: LoadedModel, op: Any, req: CompletionRequest, opts: dict[str, Any], limits: Limits) -> Call:
    """Check the fields and `limits` before any work, encode the prompts, compile the constraint (once, within
    `limits`) and estimate the cost: each prompt's samples as `/v1/sample` costs them, plus the log-probabilities
    asked for (`logprob_cost`). The call's options are the samples' (`SAMPLE_OPTIONS`, the seed drawn here when the
    request has none, so any process running the call draws the same choices), `logprobs` and `echo`; `prepared`
    holds the prompts' ids, the time it was created and the automaton with its warnings."""
    check_supported(model, "sample")
    refuse_unsupported(req)
    prompts = encode_prompts(model, req.prompt)
    seed = secrets.randbelow(MAX_SEED) if req.seed is None else req.seed
    n = req.n or 1
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = None
    if temperature == 0 and req.constraint is not None:
        raise UnsupportedOperation("temperature: 0 (greedy) is not combined with constraint (constrained choices are "
                                   "drawn exactly from the conditioned model); use a temperature > 0",
                                   param="temperature", code="unsupported_parameter")
    if temperature == 0:  # greedy: the most probable next token (top_k 1 of the next-token distribution)
        if not getattr(model.impl, "predictive_sampling", False):
            raise UnsupportedOperation(f"temperature: 0 (greedy) draws from the next-token distribution, which family "
                                       f"{model.family} does not sample from; use a temperature > 0",
                                       param="temperature", code="unsupported_parameter")
        top_k, temperature = 1, 1.0
    top_p = None if req.top_p is None or req.top_p == 1 else req.top_p  # 1: no truncation
    if req.max_tokens == 0 and not req.echo:
        raise InputError("max_tokens: 0 returns nothing without echo: true (scoring the prompt)", param="max_tokens")
    n_prompt = sum(len(p) for p in prompts)
    if limits.max_request_tokens is not None and n_prompt > limits.max_request_tokens:
        raise LimitExceeded(f"prompt: {n_prompt} tokens exceed the limit of {limits.max_request_tokens} per request "
                            "(max_request_tokens)", param="prompt")
    drawn = n * max_tokens * len(prompts)
    if limits.max_sample_tokens is not None and drawn > limits.max_sample_tokens:
        raise LimitExceeded(f"max_tokens: prompts x n x max_tokens = {drawn} exceeds the limit of "
                            f"{limits.max_sample_tokens} (max_sample_tokens)", param="max_tokens")
    sample = {"n": n, "max_tokens": max_tokens, "seed": seed, "temperature": temperature, "stop_at_eos": True,
              "stop": req.stop, "top_k": top_k, "top_p": top_p}
    prepared: dict[str, Any] = {"prompts": prompts, "created": int(time.time())}
    if req.constraint is not None and max_tokens > 0:
        dfa, warnings = generate.compile_constraint(model, req.constraint, sample, limits)
        prepared.update(dfa=dfa, warnings=warnings)
    cost = 0
    for ids in prompts:
        if max_tokens > 0:
            cost += generate.sample_cost(model, sample, len(ids), prepared.get("dfa"))
        if req.logprobs is not None or req.echo:
            cost += logprob_cost(model, len(ids) if req.echo else 0, n, max_tokens, len(ids))
    return Call(model, op, {**sample, "logprobs": req.logprobs, "echo": bool(req.echo)}, [], req, cost,
                input_tokens=n_prompt, output_tokens=drawn, prepared=prepared, limits=limits)


def logprob_cost(model: LoadedModel, prompt_steps: int, n: int, max_tokens: int, prompt_len: int) -> int:
    """Scoring prompt + completion for n choices and filtering the next-token distributions (`prompt_steps`
    prompt positions once, max_tokens steps of n rows): the sampler's cost model for the filtering steps."""
    score = operation_cost(model, "score", [range(prompt_len + max_tokens)] * max(n, 1))
    steps = operation_cost(model, "sample", n=n, max_tokens=max_tokens, predictive=True) if max_tokens else 0
    prompt = operation_cost(model, "sample", n=1, max_tokens=prompt_steps, predictive=True) if prompt_steps else 0
    return int(score + steps + prompt)


# -- running ---------------------------------------------------------------------------------------------------
def run(call: Call, max_batch_tokens: int | None = None) -> list[Completion]:
    """Blocking: draw every prompt's choices with `/v1/sample`'s sampler, then the log-probabilities asked for.
    Returns the choices, prompt i's j-th at index i n + j."""
    model, o, p = call.model, call.opts, call.prepared
    vocab, echo, k, n = model.vocab, bool(o["echo"]), o["logprobs"], o["n"]
    filt = next_token_filter(model) if k is not None else None
    choices: list[Completion] = []
    for p_index, ids in enumerate(p["prompts"]):
        if o["max_tokens"] > 0:
            drawn = draw(model, {key: o[key] for key in SAMPLE_OPTIONS}, ids, p.get("dfa"), call.limits)
        else:
            drawn = [Sample([], finish_reason="length") for _ in range(n)]
        outs = [d.ids[:-1] if d.finish_reason == "eos" else d.ids for d in drawn]
        logprobs = None if filt is None else token_logprobs(model, filt, ids, outs, int(k or 0), echo)
        if vocab.tokenizer is not None:
            choices += tokenizer_choices(vocab, p_index * n, ids, drawn, outs, logprobs, echo)
            continue
        prompt_words = vocab.decode(ids)
        for j, (d, out) in enumerate(zip(drawn, outs, strict=True)):
            toks = spaced((prompt_words if echo else []) + vocab.decode(out), first_spaced=bool(ids) and not echo)
            more: dict[str, Any] = {}
            if logprobs is not None:
                lps, tops = logprobs[j]
                base = 0 if echo else len(" ".join(prompt_words))
                more = {"token_logprobs": lps, "top_logprobs": [top_dict(vocab, toks[t], lps[t], tops[t],
                                                                         space=toks[t].startswith(" "))
                                                                for t in range(len(toks))],
                        "text_offset": list(itertools.accumulate((len(t) for t in toks[:-1]), initial=base))
                        if toks else []}
            choices.append(Completion(p_index * n + j, toks, len(ids) if echo else 0, finish(d), len(d.ids), **more))
    return choices


def draw(model: LoadedModel, sample: dict[str, Any], ids: list[int], dfa: Any, limits: Limits) -> list[Sample]:
    """`/v1/sample`'s draw (`generate.draw`) of these settings after the prompt `ids`; errors about the prefix name
    `prompt`."""
    try:
        return generate.draw(model, **sample, prefix=ids or None, dfa=dfa, limits=limits)[1]
    except LatentLMError as e:
        if e.param == "prefix":
            raise InputError(e.message.replace("prefix", "prompt", 1), param="prompt") from None
        raise


def finish(d: Sample) -> str:
    """OpenAI's finish_reason of a drawn sample: "length" (max_tokens drawn), else "stop" (`<eos>`, a stop
    sequence)."""
    return "length" if d.finish_reason == "length" else "stop"


def tokenizer_choices(vocab: Any, first: int, ids: list[int], drawn: list[Sample], outs: list[list[int]],
                      logprobs: list | None, echo: bool) -> list[Completion]:
    """The choices of one prompt for a model over an LM's tokenizer: each token's text is its piece of the text
    the tokenizer decodes from the prompt's start (`Vocabulary.pieces`: a character split across tokens comes with
    the token that completes it), so `logprobs.tokens` join to exactly `text` (the prompt's too with `echo`);
    `logprobs.bytes` gives each token's exact UTF-8 bytes, the top alternatives are keyed by their text
    (`bytes:\\xNN...` for one that is not whole characters, as OpenAI's). O(len(prompt) + len(choice)) each."""
    out = []
    for j, (d, o) in enumerate(zip(drawn, outs, strict=True)):
        pieces = vocab.pieces(ids + o)
        toks = pieces if echo else pieces[len(ids):]
        more: dict[str, Any] = {}
        if logprobs is not None:
            lps, tops = logprobs[j]
            seq = ids + o if echo else o
            at = 0 if echo else len(ids)  # the position in prompt + completion of the choice's first token
            base = 0 if echo else len("".join(pieces[:len(ids)]))
            raw = text_bytes(vocab, ids + o)[at:]
            more = {"token_logprobs": lps, "top_logprobs": [
                {**{token_key(vocab, i, at + t == 0): v for i, v in tops[t]}, token_key(vocab, x, at + t == 0): lps[t]}
                for t, x in enumerate(seq)],
                "text_offset": list(itertools.accumulate((len(t) for t in toks[:-1]), initial=base)) if toks else [],
                "token_bytes": [list(b) for b in raw]}
        out.append(Completion(first + j, toks, len(ids) if echo else 0, finish(d), len(d.ids), **more))
    return out


def text_bytes(vocab: Any, ids: list[int]) -> list[bytes]:
    """Each id's exact bytes in the text decoded from the start of `ids` (padding ids beyond the tokenizer: b"")."""
    tok = vocab.tokenizer
    keep = [i for i in ids if i < tok.vocab_size]
    spelled = iter(tok.text_bytes(keep))
    return [next(spelled) if i < tok.vocab_size else b"" for i in ids]


def token_key(vocab: Any, i: int, first: bool) -> str:
    """How token i is named among a position's top alternatives: its text (as the first token of a text when
    `first`), or `bytes:` and its bytes escaped when they are not whole UTF-8 characters."""
    tok = vocab.tokenizer
    b = b"" if i >= tok.vocab_size else tok.text_bytes([i])[0] if first else tok.token_bytes[i]
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def top_dict(vocab: Any, tok: str, chosen_lp: float | None, top: list, space: bool) -> dict[str, float | None]:
    """A position's top alternatives {token text: log p} and the chosen token with its scored log p (OpenAI: up to
    logprobs + 1 entries); texts spelled as at that position (with its leading space or not)."""
    lead = " " if space else ""
    out: dict[str, float | None] = {lead + vocab.tokens[i]: v for i, v in top}
    out[tok] = chosen_lp
    return out


def spaced(words: list[str], first_spaced: bool) -> list[str]:
    """Token texts as they appear in the text: a space before every token but the first of the whole text."""
    return [(" " if (i > 0 or first_spaced) else "") + w for i, w in enumerate(words)]


# -- the next-token distribution p(x_t | x_<t), by forward filtering ------------------------------------------
def next_token_filter(model: LoadedModel) -> NextTokenFilter:
    """The family's forward filter over next-token distributions; 400 naming `logprobs` where it has none."""
    impl = model.impl
    filt = impl.next_token_filter() if isinstance(impl, ChainFamily) else None
    if filt is None:
        raise UnsupportedOperation(f"logprobs: family {getattr(impl, 'family', '?')} has no next-token distribution "
                                   "here", param="logprobs", code="unsupported_parameter")
    return filt


def top_alternatives(filt: NextTokenFilter, pi: torch.Tensor, seqs: list[list[int]], k: int) -> list[list[list]]:
    """For each sequence b (all continuing from pi (1, S)), at each of its positions t, the k most probable tokens
    under p(. | prefix, x_<t) as [(token id, log p)], most probable first (tokens of probability 0 left out).
    O(max len x B K (Z + V)); nothing to compute for k = 0."""
    if k == 0:
        return [[[] for _ in s] for s in seqs]
    out: list[list[list]] = [[] for _ in seqs]
    live = [b for b, s in enumerate(seqs) if s]
    pi = pi.expand(len(live), -1)
    t = 0
    with torch.no_grad():
        while live:
            logp = filt.probs(pi).clamp_min(0).log()
            val, idx = logp.topk(min(k, logp.shape[1]), dim=1)
            val, idx = val.double().tolist(), idx.tolist()
            for j, b in enumerate(live):
                out[b].append([(i, v) for i, v in zip(idx[j], val[j], strict=True) if math.isfinite(v)])
            going = [j for j, b in enumerate(live) if len(seqs[b]) > t + 1]
            if not going:
                break
            x = torch.tensor([seqs[live[j]][t] for j in going], device=pi.device)
            pi = filt.step(pi[torch.tensor(going, device=pi.device)], x)
            live = [live[j] for j in going]
            t += 1
    return out


def token_logprobs(model: LoadedModel, filt: NextTokenFilter, ids: list[int], outs: list[list[int]], k: int,
                   echo: bool) -> list[tuple[list[float | None], list[list]]]:
    """Per choice: log p(x_t | x_<t) of its tokens (the prompt's too with `echo`), as /v1/score computes them for
    prompt + completion, and the k most probable alternatives at each of those positions (forward filtering)."""
    full = [ids + o for o in outs]
    scored: list[list[float]] = [[] for _ in full]
    nonempty = [i for i, f in enumerate(full) if f]
    if nonempty:
        for i, r in zip(nonempty, batching.run(model, "score", [full[i] for i in nonempty], token_logprobs=True),
                        strict=True):
            scored[i] = r["token_logprobs"]
    with torch.no_grad():
        head = top_alternatives(filt, filt.start(), [ids], k)[0] if echo and ids else []
        tails = top_alternatives(filt, filt.after(ids), outs, k)
    first = 0 if echo else len(ids)
    return [(scored[i][first:], head + tails[i]) for i in range(len(outs))]


# -- the answer --------------------------------------------------------------------------------------------------
def head(call: Call) -> dict[str, Any]:
    """The fields every `text_completion` object of a response shares (the whole answer and each streamed chunk):
    `id` (fresh), `object`, `created` (when the request was prepared), `model`, `system_fingerprint` (the model
    version)."""
    return {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": call.prepared["created"],
            "model": call.model.name, "system_fingerprint": "fp_" + call.model.content_hash[:16]}


def usage(call: Call, results: list[Completion]) -> dict[str, int]:
    """OpenAI's usage: the prompts' tokens and the tokens drawn (each choice's `<eos>` counted)."""
    drawn = sum(c.drawn for c in results)
    return {"prompt_tokens": call.input_tokens, "completion_tokens": drawn, "total_tokens": call.input_tokens + drawn}


def body(call: Call, results: list[Completion]) -> dict[str, Any]:
    """OpenAI's `text_completion`: `head`, `choices` (`format.fields` of each), `usage`[, `warnings`]."""
    return format.with_warnings(call, {**head(call), "choices": [format.fields(c) for c in results],
                                       "usage": usage(call, results)})


# -- what the answer holds, for the OpenAPI document ----------------------------------------------------------
_INT = {"type": "integer", "minimum": 0}
USAGE_SCHEMA = format.obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
                          "prompt_tokens", "completion_tokens", "total_tokens")
_HEAD = {"id": {"type": "string", "pattern": "^cmpl-[0-9a-f]{24}$"}, "object": {"const": "text_completion"},
         "created": _INT, "model": {"type": "string"}, "system_fingerprint": {"type": "string"}}
_CHOICES = {"type": "array", "items": format.COMPLETION_SCHEMA}
RESPONSE_SCHEMA = format.obj({**_HEAD, "choices": _CHOICES, "usage": USAGE_SCHEMA,
                              "warnings": {"type": "array", "items": {"type": "string"}}}, *_HEAD, "choices", "usage")
"""The whole answer (`body`)."""
CHUNK_SCHEMA = format.obj({**_HEAD, "choices": _CHOICES, "usage": {"anyOf": [{"type": "null"}, USAGE_SCHEMA]}},
                          *_HEAD, "choices")
"""One streamed chunk: a piece of one choice (`format.completion_pieces`), or with stream_options.include_usage the
last, `choices: []` and the usage (the others then `usage: null`)."""
