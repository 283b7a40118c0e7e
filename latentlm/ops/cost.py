"""A request's estimated work before it runs: the family's own cost model (`Family.cost`) over `models.cost.Work`,
and the size of a posterior's answer (`Family.posterior_entries`)."""

from __future__ import annotations

from collections.abc import Sequence

from latentlm.models.cost import ENTRY_COST, OUTPUT_TOKEN_COST, PCFG_VITERBI_FACTOR, SAMPLE_STEP_COST, TOKEN_COST, Work
from latentlm.ops.model import LoadedModel

__all__ = ["ENTRY_COST", "OUTPUT_TOKEN_COST", "PCFG_VITERBI_FACTOR", "SAMPLE_STEP_COST", "TOKEN_COST", "Work",
           "operation_cost", "posterior_entries"]


def posterior_entries(model: LoadedModel, seqs: Sequence[Sequence[int]], top_k: int | None) -> int:
    """How many (state or span, probability) pairs a posterior of `seqs` returns, known before any work (the
    family's `posterior_entries`: states per token for chains, spans per sentence for PCFGs). The service bounds it
    (`max_posterior_entries`): with every state, the response of a long input is gigabytes."""
    return int(model.impl.posterior_entries(tuple(len(s) for s in seqs), top_k))


def operation_cost(model: LoadedModel, op: str, seqs: Sequence[Sequence[int]] = (), *,
                   method: str | None = None, top_k: int | None = None, n: int = 1, max_tokens: int = 0,
                   prefix_tokens: int = 0, predictive: bool = False) -> int:
    """Estimated work of `op` over `seqs` (or, for `sample`, of n x max_tokens steps after a prefix of
    `prefix_tokens`; `predictive`: drawn from the next-token distribution, top_k / top_p), in `models.cost` units,
    as the model's family states it (`Family.cost`); known before any work. A decode without `method` is costed
    as the family's default method."""
    if op == "decode" and method is None:
        method = model.impl.default_method
    work = Work(op, tuple(len(s) for s in seqs), method=method, top_k=top_k, n=n, max_tokens=max_tokens,
                prefix_tokens=prefix_tokens, predictive=predictive, vocab_size=len(model.vocab))
    return int(model.impl.cost(work))
