"""`Call`: a request ready to run (what `ops.spec.prepare` returns, the batcher queues, `ops.wire` sends to an engine
process and an operation's `run` computes). Its own module so that operations declared in their own modules
(`ops.completions`) build calls without importing the table that registers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from latentlm.ops.constrain import Limits
from latentlm.ops.model import LoadedModel


@dataclass
class Call:
    """A request ready to run: the model version it will use, the operation (an `ops.spec.Operation`), its options
    (defaults filled), token ids of its inputs (none for a generating operation), its size and estimated cost, and
    what `prepare` built for `run` (e.g. a constraint's automaton). `request`: the validated request (None for
    calls merged from several, or received from another process: `run` never reads it)."""

    model: LoadedModel
    op: Any
    opts: dict[str, Any]
    seqs: list[list[int]]
    request: BaseModel | None
    cost: int = 0
    input_tokens: int = 0  # tokens of the inputs (or of a sample's prefix, a completion's prompts)
    output_tokens: int = 0  # tokens a generating operation may produce at most (n x max_tokens)
    prepared: dict[str, Any] = field(default_factory=dict)  # what `prepare` built for `run` (e.g. an automaton)
    limits: Limits = field(default_factory=Limits)

    @property
    def num_tokens(self) -> int:
        return self.input_tokens

    @property
    def streaming(self) -> bool:
        return bool(getattr(self.request, "stream", False))
