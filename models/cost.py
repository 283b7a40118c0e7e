"""What a request costs, estimated before any work: the units and the `Work` every family's `cost` reads.

A request's work is estimated in multiply-add-like units ("cost"; ~0.05-0.1 ns each on one AVX2 core): the
service refuses a request above its budget (`max_request_cost`) and sends requests above `heavy_request_cost`
to the heavy lane. Each family states its own algorithm's cost (`Family.cost`): chains tokens x width^2 (width:
the states one step of the recursion spans), PCFGs n^3/6 split points x the rule work of a split per sentence,
sampling n x max_tokens steps (plus the prefix) with a fixed per-step overhead, and a floor per token for the work
around the recursion (tokenising, writing the response).
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_COST = 5_000  # per input token (encoding, copying), whatever the model
OUTPUT_TOKEN_COST = 200_000  # per token whose result is a list (posterior, MBR, embed): building the objects
ENTRY_COST = 20_000  # per (state, probability) entry or embedding value returned
SAMPLE_STEP_COST = 3_000_000  # per sampling step (one Python-level step of the sampler, vectorised over n)
PCFG_VITERBI_FACTOR = 10  # max-product charts are not GEMMs: measured ~10x the inside pass per rule product


@dataclass(frozen=True)
class Work:
    """What one request asks of a model, as far as its cost depends on it.

    `lengths`: tokens of each input sequence; `method`: the decode method (filled with the family's default);
    `top_k`: states listed per token (None: every one); for `sample`: `n` samples of at most `max_tokens` after a
    prefix of `prefix_tokens`, `predictive` when drawn from the next-token distribution (top_k / top_p)."""

    op: str
    lengths: tuple[int, ...] = ()
    method: str | None = None
    top_k: int | None = None
    n: int = 1
    max_tokens: int = 0
    prefix_tokens: int = 0
    predictive: bool = False
    vocab_size: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)
