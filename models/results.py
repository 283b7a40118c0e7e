"""What the families' operations return: one typed result per input (or per sample), in plain Python values; and
the typed answers of the operations built on them (a constraint's probability, the beam's completions, an
OpenAI-style completion's choices).

A family's `op_*` computes; `latentlm.ops.format` alone turns these into the public JSON (field names, fields
derived from others such as a score's perplexity, the order of keys). Below, T is the input's length in tokens,
k the states listed per token, n the sentence length of a PCFG input, d an embedding's width.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Score:
    """log p(x) (natural log; -inf for probability 0), the input's token count T, and with `token_logprobs`
    asked for, log p(x_t | x_<t) per token (T,)."""

    logprob: float
    num_tokens: int
    token_logprobs: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Marginals:
    """A chain posterior p(z_t | x): per token t, the listed states (T, k) and their probabilities (T, k),
    sorted by probability (k: every state of the token's reduced state space, or the `top_k` most probable)."""

    states: list[list[int]]
    probs: list[list[float]]


@dataclass(frozen=True, slots=True)
class Span:
    """A constituent over tokens [start, end) and its marginal probability p(span | x)."""

    start: int
    end: int
    prob: float


@dataclass(frozen=True, slots=True)
class SpanMarginals:
    """A PCFG posterior: the marginals of the spans of width >= 2 (at most n (n - 1) / 2), most probable first
    (ties: narrower, then leftmost), cut to `top_k` when asked."""

    spans: list[Span]


@dataclass(frozen=True, slots=True)
class Path:
    """The Viterbi path of a chain family: one state per token (T,) and its joint log p(x, z); a tagging
    HMM also gives the tag each state emits best (T,) (log p(x, y, z) then includes the tags)."""

    states: list[int]
    logprob: float
    tags: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Decoded:
    """A minimum-Bayes-risk decode of a chain family: the most probable state per token (T,) and the sum of the
    chosen marginals, `expected_correct`. Plain chain families give the chosen states' marginals `state_probs`
    (T,); a tagging HMM gives the most probable tag per token `tags` (T,) and its marginal `tag_probs` (T,)
    (`expected_correct` then sums those)."""

    states: list[int]
    expected_correct: float
    state_probs: list[float] | None = None
    tags: list[str] | None = None
    tag_probs: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Parse:
    """A PCFG decode: the bracketed tree (leaves are token ids), its constituents of width >= 2 as sorted
    [start, end) pairs, and either log p(x, tree) (Viterbi) or the summed span marginals of the MBR tree
    (`expected_correct`)."""

    tree: str
    spans: list[tuple[int, int]]
    logprob: float | None = None
    expected_correct: float | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """One drawn sequence: token ids (L,), and the states that drew them (L,) (chain families) or the tree
    (PCFGs). `finish_reason` ("stop", "eos" or "length") once the operations layer has cut the sample at its
    stop sequences (`ops.generate.cut_at_stop`); None as a family draws it."""

    ids: list[int]
    states: list[int] | None = None
    tree: str | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Embedding:
    """One vector per token (T, d) and its width d."""

    embeddings: list[list[float]]
    dim: int


@dataclass(frozen=True, slots=True)
class ConstraintProb:
    """A constraint's answer after a prefix: log P(C | prefix[, generated]) (None for probability 0), the sizes of
    its automaton (states, classes, edges, the window and its parts'), and with weights asked for, P(C | prefix, v)
    for every token id v (V,)."""

    log_prob: float | None
    automaton: dict[str, int]
    weights: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Continuation:
    """One completion found by the constrained beam search: token ids (L,) ending with `<eos>`, log p(y | prefix)
    and log p(y | prefix, C)."""

    ids: list[int]
    log_prob: float
    log_prob_given: float


@dataclass(frozen=True, slots=True)
class Beam:
    """The constrained beam search's completions, best first; `certified`: provably the n_best most probable
    satisfying continuations, else `gap` bounds how much more probable (in log) an unseen one could be."""

    completions: list[Continuation]
    certified: bool
    gap: float


@dataclass(frozen=True, slots=True)
class Completion:
    """One choice of an OpenAI-style completion: the texts of its tokens as they appear in its text (T,) (the first
    `echoed` of them the prompt's), why it ended ("stop" or "length"), the tokens drawn for it (its `<eos>` counted,
    as usage counts it), and with log-probabilities asked for: log p(x_t | x_<t) per token (T,), the most probable
    alternatives at each position with the chosen token {text: log p} (T,), each token's offset in the text (T,)
    and, for a model over an LM's tokenizer, each token's UTF-8 bytes (T,)."""

    index: int
    tokens: list[str]
    echoed: int
    finish_reason: str
    drawn: int = 0
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float | None]] | None = None
    text_offset: list[int] | None = None
    token_bytes: list[list[int]] | None = None


Result = (Score | Marginals | SpanMarginals | Path | Decoded | Parse | Sample | Embedding | ConstraintProb
          | Continuation | Beam | Completion)
"""Any one answer of a family's or an operation's computation."""

RESULTS: tuple[type, ...] = (Score, Marginals, SpanMarginals, Path, Decoded, Parse, Sample, Embedding, ConstraintProb,
                             Continuation, Beam, Completion)
"""Every result type (what may cross between processes as itself, `ops.wire`)."""
