"""POST /v1/completions: the OpenAI completions API over the chain families (`base.ChainFamily`: hmm, blocked_hmm,
rank_hmm, tagging_hmm and any registered later), so the `openai` client, LangChain and curl scripts written for LM
servers work unchanged.

Generation is `/v1/sample`'s: each prompt's choices are `ops.sample(n, max_tokens, seed, prefix=prompt, ...)`
through the same checks (`execute.check_sample`: sample-token limit, prompt limit, cost budget) and the same
batcher lane, so a seeded completion equals `/v1/sample` with the same seed and settings. What the OpenAI shape
adds is computed from the model exactly:
- `logprobs`: each token's log p(x_t | x_<t) is `/v1/score`'s `token_logprobs` of prompt + completion (the same
  `ops.run(model, "score", ..., token_logprobs=True)`); the top alternatives come from the next-token
  distribution p(. | x_<t) by forward filtering (the hooks of the families' top_k/top_p sampler; rank_hmm in rank
  space). O(T K (Z + V)) per choice of T tokens (K: the states one token is emitted by).
- `echo`: the prompt and its per-token log-probabilities (scoring without generation: `max_tokens: 0`).

Text: tokens are joined with single spaces as the vocabulary spells them (`<unk>`, lowercasing and `<eos>` as the
model's manifest says); a completion after a non-empty prompt starts with a space, so `prompt + text` reads as one
text. For a model over an LM's tokenizer (`tokenizer.json`), prompts are its ids and `text` its exact decoding;
`logprobs.tokens` are each token's piece of that text (joining to it exactly) and `logprobs.bytes` each token's
UTF-8 bytes (`tokenizer_choices`). `<eos>` ends a choice (`finish_reason` "stop") and is not part of its text.
Fields latentlm cannot honour answer 400 naming the field; nothing is silently ignored. Errors are the
`{"error": {...}}` shape of every route.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from latentlm import ops
from latentlm.models import registry
from latentlm.models.base import ChainFamily, NextTokenFilter
from latentlm.models.errors import InputError, LatentLMError
from latentlm.ops import constrain, spec
from latentlm.ops.constrain import Limits
from latentlm.ops.requests import ConstraintSpec, JSONInt, SampleRequest
from latentlm.service import execute
from latentlm.service.batcher import QueueFull
from latentlm.service.errors import APIError
from latentlm.service.routes.operations import CANCEL, JSONBytes, OperationRoute, compiles, prepare_off_loop
from latentlm.service.settings import Settings
from latentlm.service.state import ServiceState, get_state

MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's completions allow 5)
MAX_PROMPTS = 1024  # prompts in one request
MAX_N = 128  # choices per prompt
DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions

NonEmptyIds = Annotated[list[Annotated[JSONInt, Field(ge=0)]], Field(min_length=1)]
Prompt = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | NonEmptyIds
          | Annotated[list[NonEmptyIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = Field(None, description="end the stream with a chunk of `choices: []` and "
                                                               "the request's `usage`")


def _number(v: Any, name: str) -> Any:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    if v is not None and not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r}")
    return v


class CompletionRequest(BaseModel):
    """OpenAI's completion request. Unknown fields are refused (422 naming the field); fields latentlm cannot
    honour (suffix, best_of other than 1 or n, logit_bias, non-zero penalties) 400 naming the field."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = Field(description="model id (see GET /v1/models); a chain family", min_length=1)
    prompt: Prompt = Field(description="a string, a list of strings, a token-id list, or a list of token-id lists "
                                       f"(at most {MAX_PROMPTS} prompts); \"\" samples from the start")
    max_tokens: JSONInt | None = Field(None, ge=0, description=f"tokens per choice at most (default "
                                                                 f"{DEFAULT_MAX_TOKENS}); 0 with echo scores the "
                                                                 "prompt only")
    temperature: float | None = Field(None, ge=0, description="default 1; 0 = greedy (top_k 1); applied to the "
                                                              "model's tables (ancestral) or next-token distribution")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling from the next-token distribution "
                                                              "(hmm, tagging_hmm, blocked_hmm); 1 = none")
    n: JSONInt | None = Field(None, ge=1, le=MAX_N, description="choices per prompt (default 1)")
    stop: str | Annotated[list[str | NonEmptyIds], Field(max_length=ops.MAX_STOP_SEQUENCES)] | None = Field(
        None, description=f"up to {ops.MAX_STOP_SEQUENCES} stop sequences (text or token ids); left out of the text")
    seed: JSONInt | None = Field(None, ge=0, lt=ops.MAX_SEED, description="same seed, same choices (as "
                                                                            "/v1/sample's); default: a fresh one")
    stream: StrictBool | None = Field(None, description="server-sent `text_completion` chunks, ending "
                                                        "'data: [DONE]'")
    stream_options: StreamOptions | None = None
    logprobs: JSONInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log p of each token and of the "
                                                                               "this many most probable next tokens")
    echo: StrictBool | None = Field(None, description="the prompt before the completion, with its log-probabilities")
    suffix: str | None = Field(None, description="infilling: not supported (400) unless empty")
    best_of: JSONInt | None = Field(None, ge=1, description="only 1 or n (the choices are the samples drawn)")
    logit_bias: dict[str, float] | None = Field(None, description="not supported (400) unless empty")
    presence_penalty: float | None = Field(None, description="not supported (400) unless 0")
    frequency_penalty: float | None = Field(None, description="not supported (400) unless 0")
    user: str | None = Field(None, description="accepted, not used")
    constraint: ConstraintSpec | None = Field(
        None, description="the constraint object of constrained generation (`extra_body` in the openai client): "
                          "each choice drawn exactly from the model conditioned on it (as /v1/sample with "
                          "`constraint`)")

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _numbers(cls, v, info):
        return _number(v, info.field_name)


def refuse_unsupported(req: CompletionRequest) -> None:
    """400 naming the first field whose value latentlm cannot honour (never silently ignored)."""
    def no(param: str, why: str) -> APIError:
        return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

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
        raise APIError(422, "stream_options: only allowed with stream: true", param="stream_options",
                       code="invalid_value")


@dataclass
class Prepared:
    """A completion request checked against the model and the limits: prompts as token ids, the settings of
    `/v1/sample` that generate each prompt's choices, and the estimated cost."""

    model: ops.LoadedModel
    req: CompletionRequest
    prompts: list[list[int]]
    samples: list[SampleRequest | None]  # one per prompt; None when max_tokens is 0
    cost: int = 0
    seed: int = 0
    top_k: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    warnings: list[str] = field(default_factory=list)  # what the constraint dropped (answered as `warnings`)

    @property
    def n(self) -> int:
        return self.req.n or 1

    @property
    def max_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS if self.req.max_tokens is None else self.req.max_tokens


def encode_prompts(model: ops.LoadedModel, prompt: Any) -> list[list[int]]:
    """Prompts -> token ids (text tokenised without `<eos>`; "" is the empty prompt); 422 naming `prompt`."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):  # a word-level model reads no words in white space; an LM's tokenizer does
            text = p if model.vocab.tokenizer is not None else p.split()
            out.append(model.vocab.encode(p, add_eos=False, where=where) if text else [])
        else:
            out.append(model.vocab.check_ids(list(p), where=where))
    return out


def prepare(model: ops.LoadedModel, req: CompletionRequest, settings: Settings, limits: Limits | None = None
            ) -> Prepared:
    """Check the family, the fields, the limits and the cost budget before any work; build each prompt's
    `/v1/sample` settings (a constraint compiled within `limits`, default the settings')."""
    if not isinstance(model.impl, ChainFamily):
        raise APIError(400, f"model {model.name!r} (family {model.family}) does not generate text token by token; "
                            f"completions serve the chain families ({', '.join(registry.families(ChainFamily))})",
                       param="model", code="unsupported_model")
    ops.check_supported(model, "sample")
    refuse_unsupported(req)
    s = settings
    try:
        prompts = encode_prompts(model, req.prompt)
    except InputError as e:
        raise APIError(422, e.message, param="prompt", code="invalid_value") from None
    prep = Prepared(model, req, prompts, [], seed=secrets.randbelow(ops.MAX_SEED) if req.seed is None else req.seed)
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature == 0 and req.constraint is not None:
        raise APIError(400, "temperature: 0 (greedy) is not combined with constraint (constrained choices are "
                            "drawn exactly from the conditioned model); use a temperature > 0", param="temperature",
                       code="unsupported_parameter")
    if temperature == 0:  # greedy: the most probable next token (top_k 1 of the next-token distribution)
        if not getattr(model.impl, "predictive_sampling", False):
            raise APIError(400, f"temperature: 0 (greedy) draws from the next-token distribution, which family "
                                f"{model.family} does not sample from; use a temperature > 0", param="temperature",
                           code="unsupported_parameter")
        prep.top_k, prep.temperature = 1, 1.0
    else:
        prep.temperature = temperature
    prep.top_p = None if req.top_p is None or req.top_p == 1 else req.top_p  # 1: no truncation
    if req.max_tokens == 0 and not req.echo:
        raise APIError(422, "max_tokens: 0 returns nothing without echo: true (scoring the prompt)",
                       param="max_tokens", code="invalid_value")
    n_prompt = sum(len(p) for p in prompts)
    if n_prompt > s.max_request_tokens:
        raise APIError(413, f"prompt: {n_prompt} tokens exceed the limit of {s.max_request_tokens} per request "
                            "(max_request_tokens)", param="prompt", code="limit_exceeded")
    drawn = prep.n * prep.max_tokens * len(prompts)
    if drawn > s.max_sample_tokens:
        raise APIError(413, f"max_tokens: prompts x n x max_tokens = {drawn} exceeds the limit of "
                            f"{s.max_sample_tokens} (max_sample_tokens)", param="max_tokens", code="limit_exceeded")
    cost = 0
    for ids in prompts:
        sreq = None
        if prep.max_tokens > 0:
            sreq = SampleRequest(model=req.model, n=prep.n, max_tokens=prep.max_tokens, seed=prep.seed,
                                 prefix=ids or None, temperature=prep.temperature, top_k=prep.top_k,
                                 top_p=prep.top_p, stop=req.stop, constraint=req.constraint)
            cost += execute.check_sample(sreq, s.max_sample_tokens, model=model,
                                         limits=limits or execute.limits(s))
        prep.samples.append(sreq)
        if req.logprobs is not None or req.echo:
            cost += logprob_cost(model, len(ids) if req.echo else 0, prep.n, prep.max_tokens, len(ids))
    if req.constraint is not None and prep.max_tokens > 0:
        prep.warnings = list(constrain.parse_request(model, req.constraint, prep.max_tokens).warnings)
    execute.check_cost("completions", cost, s.max_request_cost, "max_tokens",
                       "ask for fewer or shorter completions (prompts, n, max_tokens) or fewer logprobs")
    prep.cost = cost
    return prep


def logprob_cost(model: ops.LoadedModel, prompt_steps: int, n: int, max_tokens: int, prompt_len: int) -> int:
    """Scoring prompt + completion for n choices and filtering the next-token distributions (`prompt_steps`
    prompt positions once, max_tokens steps of n rows): the sampler's cost model for the filtering steps."""
    score = ops.operation_cost(model, "score", [range(prompt_len + max_tokens)] * max(n, 1))
    steps = ops.operation_cost(model, "sample", n=n, max_tokens=max_tokens, predictive=True) if max_tokens else 0
    prompt = ops.operation_cost(model, "sample", n=1, max_tokens=prompt_steps, predictive=True) if prompt_steps else 0
    return int(score + steps + prompt)


# -- the next-token distribution p(x_t | x_<t), by forward filtering ------------------------------------------
def next_token_filter(impl: ChainFamily) -> NextTokenFilter:
    """The family's forward filter over next-token distributions; 400 naming `logprobs` where it has none."""
    filt = impl.next_token_filter() if isinstance(impl, ChainFamily) else None
    if filt is None:
        raise APIError(400, f"logprobs: family {getattr(impl, 'family', '?')} has no next-token distribution here",
                       param="logprobs", code="unsupported_parameter")
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


# -- running ---------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One choice: its token texts as they appear in `text` (`echoed` of them the prompt's), and with logprobs
    each token's log p, its top alternatives and its offset in prompt text + completion text."""

    index: int
    tokens: list[str]
    echoed: int
    finish_reason: str
    logprobs: dict[str, list] | None = None

    def body(self) -> dict[str, Any]:
        return {"text": "".join(self.tokens), "index": self.index, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason}


def run(prep: Prepared) -> tuple[list[Choice], dict[str, int]]:
    """Blocking (on the batcher's lane): draw every prompt's choices with `/v1/sample`'s code, then the
    log-probabilities asked for. Returns the choices (prompt i's j-th at index i n + j) and the usage."""
    model, req = prep.model, prep.req
    vocab, echo, k = model.vocab, bool(req.echo), req.logprobs
    filt = next_token_filter(model.impl) if k is not None else None
    choices: list[Choice] = []
    completion_tokens = 0
    for p_index, (ids, sreq) in enumerate(zip(prep.prompts, prep.samples, strict=True)):
        if sreq is not None:
            data = sample_like_v1(model, sreq)
            drawn = data["data"]
            completion_tokens += data["usage"]["output_tokens"]
        else:
            drawn = [{"ids": [], "finish_reason": "length"} for _ in range(prep.n)]
        outs = [d["ids"][:-1] if d.get("finish_reason") == "eos" else d["ids"] for d in drawn]
        prompt_words = vocab.decode(ids)
        logprobs = None if filt is None else token_logprobs(model, filt, ids, outs, int(k or 0), echo)
        if vocab.tokenizer is not None:
            choices += tokenizer_choices(vocab, p_index * prep.n, ids, drawn, outs, logprobs, echo)
            continue
        for j, (d, o) in enumerate(zip(drawn, outs, strict=True)):
            words = (prompt_words if echo else []) + vocab.decode(o)
            toks = spaced(words, first_spaced=bool(ids) and not echo)
            c = Choice(p_index * prep.n + j, toks, len(ids) if echo else 0,
                       "length" if d.get("finish_reason") == "length" else "stop")
            if logprobs is not None:
                lps, tops = logprobs[j]
                base = 0 if echo else len(" ".join(prompt_words))
                offsets = list(itertools.accumulate((len(t) for t in toks[:-1]), initial=base)) if toks else []
                c.logprobs = {"tokens": toks, "token_logprobs": lps, "top_logprobs": [
                    top_dict(vocab, toks[t], lps[t], tops[t], space=toks[t].startswith(" ")) for t in range(len(toks))],
                    "text_offset": offsets}
            choices.append(c)
    prompt_tokens = sum(len(p) for p in prep.prompts)
    return choices, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}


def tokenizer_choices(vocab, first: int, ids: list[int], drawn: list[dict], outs: list[list[int]],
                      logprobs: list | None, echo: bool) -> list[Choice]:
    """The choices of one prompt for a model over an LM's tokenizer: each token's text is its piece of the text
    the tokenizer decodes from the prompt's start (`Vocabulary.pieces`: a character split across tokens comes with
    the token that completes it), so `logprobs.tokens` join to exactly `text` (the prompt's too with `echo`);
    `logprobs.bytes` gives each token's exact UTF-8 bytes, the top alternatives are keyed by their text
    (`bytes:\\xNN...` for one that is not whole characters, as OpenAI's). O(len(prompt) + len(choice)) each."""
    out = []
    for j, (d, o) in enumerate(zip(drawn, outs, strict=True)):
        pieces = vocab.pieces(ids + o)
        toks = pieces if echo else pieces[len(ids):]
        c = Choice(first + j, toks, len(ids) if echo else 0, "length" if d.get("finish_reason") == "length" else "stop")
        if logprobs is not None:
            lps, tops = logprobs[j]
            seq = ids + o if echo else o
            at = 0 if echo else len(ids)  # the position in prompt + completion of the choice's first token
            base = 0 if echo else len("".join(pieces[:len(ids)]))
            raw = text_bytes(vocab, ids + o)[at:]
            c.logprobs = {"tokens": toks, "token_logprobs": lps, "top_logprobs": [
                {**{token_key(vocab, i, at + t == 0): v for i, v in tops[t]}, token_key(vocab, x, at + t == 0): lps[t]}
                for t, x in enumerate(seq)],
                "text_offset": list(itertools.accumulate((len(t) for t in toks[:-1]), initial=base)) if toks else [],
                "bytes": [list(b) for b in raw]}
        out.append(c)
    return out


def text_bytes(vocab, ids: list[int]) -> list[bytes]:
    """Each id's exact bytes in the text decoded from the start of `ids` (padding ids beyond the tokenizer: b"")."""
    tok = vocab.tokenizer
    keep = [i for i in ids if i < tok.vocab_size]
    spelled = iter(tok.text_bytes(keep))
    return [next(spelled) if i < tok.vocab_size else b"" for i in ids]


def token_key(vocab, i: int, first: bool) -> str:
    """How token i is named among a position's top alternatives: its text (as the first token of a text when
    `first`), or `bytes:` and its bytes escaped when they are not whole UTF-8 characters."""
    tok = vocab.tokenizer
    b = b"" if i >= tok.vocab_size else tok.text_bytes([i])[0] if first else tok.token_bytes[i]
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def token_logprobs(model: ops.LoadedModel, filt: NextTokenFilter, ids: list[int], outs: list[list[int]], k: int,
                   echo: bool) -> list[tuple[list[float | None], list[list]]]:
    """Per choice: log p(x_t | x_<t) of its tokens (the prompt's too with `echo`), as /v1/score computes them for
    prompt + completion, and the k most probable alternatives at each of those positions (forward filtering)."""
    full = [ids + o for o in outs]
    scored: list[list[float]] = [[] for _ in full]
    nonempty = [i for i, f in enumerate(full) if f]
    if nonempty:
        for i, r in zip(nonempty, ops.run(model, "score", [full[i] for i in nonempty], token_logprobs=True),
                        strict=True):
            scored[i] = r["token_logprobs"]
    with torch.no_grad():
        head = top_alternatives(filt, filt.start(), [ids], k)[0] if echo and ids else []
        tails = top_alternatives(filt, filt.after(ids), outs, k)
    first = 0 if echo else len(ids)
    return [(scored[i][first:], head + tails[i]) for i in range(len(outs))]


def top_dict(vocab, tok: str, chosen_lp: float | None, top: list, space: bool) -> dict[str, float | None]:
    """A position's top alternatives {token text: log p} and the chosen token with its scored log p (OpenAI: up to
    logprobs + 1 entries); texts spelled as at that position (with its leading space or not)."""
    lead = " " if space else ""
    out: dict[str, float | None] = {lead + vocab.tokens[i]: v for i, v in top}
    out[tok] = chosen_lp
    return out


def spaced(words: list[str], first_spaced: bool) -> list[str]:
    """Token texts as they appear in the text: a space before every token but the first of the whole text."""
    return [(" " if (i > 0 or first_spaced) else "") + w for i, w in enumerate(words)]


def sample_like_v1(model: ops.LoadedModel, sreq: SampleRequest) -> dict[str, Any]:
    """`/v1/sample`'s run (`execute.run_sample`) of these settings. Errors about the prefix name `prompt`."""
    try:
        return execute.run_sample(model, sreq)
    except LatentLMError as e:
        if e.param == "prefix":
            raise InputError(e.message.replace("prefix", "prompt", 1), param="prompt") from None
        raise


# -- the route ---------------------------------------------------------------------------------------------------
def call_for(model: ops.LoadedModel, req: CompletionRequest, settings: Settings, limits: Limits | None = None
             ) -> spec.Call:
    """The completion request checked and prepared (`prepare`) as a call of `OPERATION`. Its `request` has the seed
    drawn here, so an engine process preparing it again (service/engine.py) draws the same choices."""
    prep = prepare(model, req, settings, limits)
    if req.seed is None:
        req = req.model_copy(update={"seed": prep.seed})
    return spec.Call(model, OPERATION, {"prepared": prep}, [], req, prep.cost,
                     input_tokens=sum(len(p) for p in prep.prompts), output_tokens=prep.n * prep.max_tokens)


def run_call(call: spec.Call, _cap: int | None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """`run` as plain data (each choice's fields, the usage), as it crosses to an API worker from an engine."""
    choices, usage = run(call.opts["prepared"])
    return [asdict(c) for c in choices], usage


# How the batcher runs a completion: like /v1/sample (not merged, not cached), on a lane's thread in queue order (the
# heavy lane above `heavy_request_cost`). A service route only: no CLI subcommand or batch endpoint reads it. An
# engine process prepares it again from its request (`extra["engine_call"]`).
OPERATION = spec.Operation("completions", "OpenAI completions (the /v1/completions route)", CompletionRequest,
                           run=run_call, merge=False, cache=False, generates=True, input_field="prompt",
                           extra={"engine_call": call_for})
router = APIRouter(prefix="/v1", tags=["completions"], route_class=OperationRoute)


ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


@router.post("/completions", responses={200: {"content": {
    "application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}},
    "description": "an OpenAI `text_completion`; with `stream: true` server-sent `text_completion` chunks, then "
                   "`data: [DONE]`"},
    404: {"description": "no such model", **ERROR},
    429: {"description": "queue full or rate limit: retry after Retry-After", **ERROR}})
async def completions(req: CompletionRequest, state: ServiceState = Depends(get_state)) -> Response:
    """OpenAI completions over a chain-family model: choices drawn as /v1/sample draws them (same seed and
    settings, same tokens), with exact log-probabilities (`logprobs`, `echo`)."""
    state.ensure_ready()
    model = state.registry.get(req.model)
    s = state.settings
    if compiles(req):  # a constraint's automaton: compiled on a preparation thread, never on the event loop
        call = await prepare_off_loop(state, functools.partial(call_for, model, req, s))
    else:
        call = call_for(model, req, s)
    prep = call.opts["prepared"]
    try:
        drawn, usage = await state.batcher.submit(call, heavy=prep.cost > s.heavy_request_cost, scope=CANCEL.get())
    except QueueFull as e:
        raise state.queue_full(e) from None
    choices = [Choice(**c) for c in drawn]
    head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": prep.created,
            "model": model.name, "system_fingerprint": "fp_" + model.content_hash[:16]}
    if not req.stream:
        more = {"warnings": prep.warnings} if prep.warnings else {}
        return JSONBytes(ops.dumps({**head, "choices": [c.body() for c in choices], "usage": usage, **more}),
                         cost=prep.cost)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(stream_chunks(head, choices, usage, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "x-cost": str(prep.cost)})


async def stream_chunks(head: dict, choices: list[Choice], usage: dict[str, int], include_usage: bool):
    """OpenAI's streamed completion: per choice, the echoed prompt as one chunk, one chunk per completion token
    (with that token's logprobs), then one with its finish_reason; with stream_options.include_usage every chunk
    has `usage: null` and a last chunk of `choices: []` has the usage; then `data: [DONE]`. The choices are drawn
    before the first chunk (the sampler draws a prompt's n choices together)."""
    extra = {"usage": None} if include_usage else {}

    def event(choices: list[dict], **more: Any) -> bytes:
        return b"data: " + ops.dumps({**head, "choices": choices, **extra, **more}) + b"\n\n"

    for c in choices:
        pieces = ([(0, c.echoed)] if c.echoed else []) + [(t, t + 1) for t in range(c.echoed, len(c.tokens))]
        for lo, hi in pieces:
            lp = None if c.logprobs is None else {key: v[lo:hi] for key, v in c.logprobs.items()}
            yield event([{"text": "".join(c.tokens[lo:hi]), "index": c.index, "logprobs": lp, "finish_reason": None}])
        yield event([{"text": "", "index": c.index, "logprobs": None, "finish_reason": c.finish_reason}])
    if include_usage:
        yield event([], usage=usage)
    yield b"data: [DONE]\n\n"
