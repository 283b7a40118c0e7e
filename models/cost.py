"""What a request costs, estimated before any work: the units and the `Work` every family's `cost` reads.

A request's work is estimated in multiply-add-like units ("cost"; ~0.05-0.1 ns each on one AVX2 core): the
service refuses a request above its budget (`max_request_cost`) and sends requests above `heavy_request_cost`
to the heavy lane. Each family states its own algorithm's cost (`Family.cost`): chains tokens x width^2 (width:
the states one step of the recursion spans), PCFGs n^3/6 split points x the rule work of a split per sentence,
sampling n x max_tokens steps (plus the prefix) with a fixed per-step overhead, and a floor per token for the work
around the recursion (tokenising, writing the response). A constraint's work on a chain family (`product_cost`) is
that of the product recursion of `models.constrained` over the family's sizes and the automaton's (`ProductWork`).
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_COST = 5_000  # per input token (encoding, copying), whatever the model
OUTPUT_TOKEN_COST = 200_000  # per token whose result is a list (posterior, MBR, embed): building the objects
ENTRY_COST = 20_000  # per (state, probability) entry or embedding value returned
SAMPLE_STEP_COST = 3_000_000  # per sampling step (one Python-level step of the sampler, vectorised over n)
PCFG_VITERBI_FACTOR = 10  # max-product charts are not GEMMs: measured ~10x the inside pass per rule product


@dataclass(frozen=True)
class ProductWork:
    """A compiled constraint's automaton as the product recursion's cost reads it, and what a request asks of it
    (`models.constrained.product_work` fills it): `live` live automaton states at each step j = 0 .. Lmax-1 (Lmax
    = its max_tokens), `edges` live (state, class) transitions, `classes` C (its K named classes and OTHER),
    `successor_rows` (an automaton whose classes are any sets of token ids: the most distinct successors of one
    state, at least 1; 0 for a word-level one); `samples` drawn by `method` ("states" or "tokens"), `guide_rows`
    sequences guided, a beam of width `beam`."""

    live: tuple[int, ...]
    edges: int
    classes: int
    successor_rows: int = 0
    samples: int = 0
    method: str = "states"
    guide_rows: int = 0
    beam: int = 0

    @property
    def max_tokens(self) -> int:
        return len(self.live)


@dataclass(frozen=True)
class Work:
    """What one request asks of a model, as far as its cost depends on it.

    `lengths`: tokens of each input sequence; `method`: the decode method (filled with the family's default);
    `top_k`: states listed per token (None: every one); for `sample`: `n` samples of at most `max_tokens` after a
    prefix of `prefix_tokens`, `predictive` when drawn from the next-token distribution (top_k / top_p); for
    `constraint` (its probability, guide weights, beam or exact samples): the automaton's `product` after a prefix
    of `prefix_tokens` over `vocab_size` words."""

    op: str
    lengths: tuple[int, ...] = ()
    method: str | None = None
    top_k: int | None = None
    n: int = 1
    max_tokens: int = 0
    prefix_tokens: int = 0
    predictive: bool = False
    vocab_size: int = 0
    product: ProductWork | None = None

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def product_cost(states: int, width: int, emit_width: int, work: Work) -> int:
    """Multiply-adds of the product recursion (`models.constrained`) of a chain with `states` S (the chain it runs),
    a filter step `width` wide and emissions touching `emit_width` states per word, under `work.product`: the
    backward messages (the products A What over the live columns, the edges' terms, the emission columns; OTHER a
    masked row sum), the prefix's filter, then per step the samples (state then token: a row of A, the successors,
    the word; "tokens": a token-marginal step), guided rows and beam rows (two token products each), each step
    with the sampler's per-step overhead. Known before any inference."""
    p = work.product
    assert p is not None, "a constraint's Work carries its automaton (ProductWork)"
    S, V, steps = states, work.vocab_size, p.max_tokens
    backward = sum(p.live[1:]) * S * S + steps * p.edges * S + emit_width * V + p.classes * S
    filt = width * S  # the filter after a word: (a * B(., w)) A over the states that can emit it
    scores = 2 * emit_width * V + filt + p.classes * emit_width  # guide / token-marginal step (two rows)
    draw = S + p.classes + 64  # state-then-token step: a row of A, the successors, the word
    if p.successor_rows:  # classes of any token ids: a row per distinct live successor in the token product
        scores += (p.successor_rows - 1) * emit_width * V + 4 * V
    per_sample = draw if p.method == "states" else scores
    total = backward + SAMPLE_STEP_COST * steps + work.prefix_tokens * (width * width + TOKEN_COST)
    rows = p.samples * per_sample + (p.guide_rows + p.beam) * scores
    if rows:
        total += steps * (rows + SAMPLE_STEP_COST)
    return int(total)
