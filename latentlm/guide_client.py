"""A guide for neural LMs over REST: `RemoteConstraintLogitsProcessor` steers an LM whose token ids are a served
HMM's (token id i = token i: an HMM over the LM's own tokenizer) so that every text it generates satisfies a
`constraint`, asking a running latentlm server for the weights. It follows `transformers`' LogitsProcessor protocol:

    with Client("http://127.0.0.1:8000") as client:
        proc = RemoteConstraintLogitsProcessor(client, "gpt2-hmm", {"include": [["apple"]], "max_tokens": 20},
                                               tokenizer=tok, config=lm.config)
        lm.generate(prompt_ids, logits_processor=[proc], **proc.generate_kwargs())

Each call sends, per row still generating, `POST /v1/constraint` with the row's prefix, the tokens it generated so
far (`generated`) and `weights: true`, and adds alpha log P(C | x, y_<=j, v) to the LM's scores (-inf where 0;
alpha = 0: the plain LM). The vocabulary checks are the in-process processor's (`latentlm.ops.guide`): the LM's
tokenizer against the served model's `vocabulary_sha256` (`GET /v1/models/{model}`), its scores' width against the
HMM's (extra ids only when declared), its eos against the server's; `ids_match=True` skips them. It is
stateless: the server rescans the prefix and the generated tokens at every step (O(T) filter steps for step T,
O(T^2) over a text, plus the backward messages rebuilt per request), where the in-process
`latentlm.ops.guide.ConstraintLogitsProcessor` keeps the filter and pays one step per token. Identical rows of a
step (e.g. `num_return_sequences` copies before they differ) are asked once; distinct rows are asked concurrently.
Beam search needs nothing more (each row is sent whole).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from latentlm.client import APIError, Client
from latentlm.models.errors import InputError
from latentlm.ops.guide import apply_log_weights, check_scores, lm_eos_ids, lm_tokenizer, vocabulary_sha256

Row = tuple[str | tuple[int, ...] | None, tuple[int, ...]]  # (prefix text or ids or None, generated ids)


class RemoteConstraintLogitsProcessor:
    """Steers a neural LM by a served HMM's exact constraint weights (module docstring).

    client: a `latentlm.client.Client` or the server's URL; model: the served model's name; constraint: the
    `constraint` object of `POST /v1/constraint`; prefix: the HMM's prefix (text or ids) for every row, or None
    (default) for each row's prompt as `generate` passes it at the first call, with leading `<eos>` tokens (a
    start-of-text token or left padding) dropped; temperature: the HMM's; eos_token_id: the LM's end id(s), checked
    against the server's `<eos>` (None: the server's is used); max_concurrency: requests in flight per step; alpha,
    ids_match, tokenizer, lm_vocab_size, config: as `latentlm.ops.guide.ConstraintLogitsProcessor`. The constraint
    and the vocabulary are checked at construction (`APIError` 422 with the field at fault, e.g. a word outside the
    vocabulary, `tokenizer`, `eos_token_id`); one instance serves one `generate` call."""

    def __init__(self, client: Client | str, model: str, constraint: dict[str, Any], prefix: str | Sequence[int] |
                 None = None, temperature: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
                 max_concurrency: int = 8, *, alpha: float = 1.0, ids_match: bool = False, tokenizer: Any = None,
                 lm_vocab_size: int | None = None, config: Any = None):
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
            raise APIError(422, f"alpha: must be a finite number >= 0, got {alpha!r}", param="alpha")
        self.client = Client(client) if isinstance(client, str) else client
        self.own_client = isinstance(client, str)
        self.model, self.constraint, self.temperature = model, dict(constraint), temperature
        self.alpha, self.ids_match = float(alpha), bool(ids_match)
        self.max_concurrency = max(1, int(max_concurrency))
        self.lm_vocab_size = lm_vocab_size if lm_vocab_size is not None else getattr(config, "vocab_size", None)
        self.tokenizer_checked = False
        if tokenizer is not None and not self.ids_match:
            self._check_tokenizer(tokenizer)
        first = self._ask(prefix if prefix not in ("", []) else None, None, weights=True)
        self.automaton: dict[str, Any] = first["automaton"]
        self.vocab_size = len(first["weights"])
        if prefix is not None and first["log_prob"] is None:
            raise APIError(422, "constraint: has probability 0 under the HMM after this prefix: no continuation "
                                "satisfies it", param="constraint")
        sources = [] if self.ids_match else lm_eos_ids(eos_token_id, config, tokenizer)
        self.eos_token_id = self._eos_id(sources)
        self.from_prompt = prefix is None
        # the prefix every row continues when one is given (text or ids; None: empty)
        self.fixed: str | tuple[int, ...] | None = (
            None if prefix is None or prefix in ("", []) else prefix if isinstance(prefix, str) else tuple(prefix))
        self.prompt_length: int | None = None
        self.last_length: int | None = None
        self.requests = 0  # POST /v1/constraint calls made by steps (not counting construction)

    @property
    def max_tokens(self) -> int:
        """The longest continuation the constraint allows, counting `<eos>` (`generate`'s max_new_tokens)."""
        return int(self.automaton["max_tokens"])

    def generate_kwargs(self) -> dict[str, Any]:
        """max_new_tokens, and `<eos>` as `generate`'s end and padding token."""
        return {"max_new_tokens": self.max_tokens, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.eos_token_id}

    def close(self) -> None:
        if self.own_client:
            self.client.close()

    def _ask(self, prefix: str | Sequence[int] | None, generated: Sequence[int] | None, *, weights: bool,
             constraint: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "constraint": constraint or self.constraint,
                                "temperature": self.temperature, "weights": weights}
        if prefix is not None:
            body["prefix"] = prefix if isinstance(prefix, str) else list(prefix)
        if generated:
            body["generated"] = list(generated)
        return self.client.operation("constraint", body)

    def _check_tokenizer(self, tokenizer: Any) -> None:
        """APIError 422 naming `tokenizer` unless the served model carries a tokenizer whose ids spell what the LM's
        do (its `vocabulary_sha256`)."""
        info = self.client.model(self.model)
        served = info.get("vocabulary_sha256")
        if served is None:
            raise APIError(422, f"tokenizer: model {self.model!r} is word-level (its ids are its own words, not the LM "
                                "tokenizer's); an HMM over the LM's tokenizer is needed, or ids_match=True",
                           param="tokenizer")
        try:
            mine = vocabulary_sha256(lm_tokenizer(tokenizer))
        except InputError as e:
            raise APIError(422, e.message, param="tokenizer") from None
        if mine != served:
            raise APIError(422, f"tokenizer: the LM's tokenizer is not the one model {self.model!r} carries (the ids "
                                "spell different texts); the guide needs an HMM over the LM's own tokenizer",
                           param="tokenizer")
        self.tokenizer_checked = True

    def _eos_id(self, sources: list[set[int]]) -> int:
        """The server's `<eos>` id (under the constraint "max_tokens": 1 only `<eos>` has a positive weight, 1),
        which every source of the LM's end ids must hold."""
        probe = self._ask(None, None, weights=True, constraint={"max_tokens": 1})["weights"]
        positive = [v for v, w in enumerate(probe) if w > 0]
        found = positive[0] if len(positive) == 1 else None
        for ids in sources:
            if found is not None and found not in ids:
                raise APIError(422, f"eos_token_id: {sorted(ids)} does not hold the model's <eos> ({found})",
                               param="eos_token_id")
        if found is None:
            if len(sources) == 1 and len(sources[0]) == 1:
                return next(iter(sources[0]))
            raise APIError(422, "eos_token_id: the server's model gives <eos> probability 0 as a first token; pass "
                                "its <eos> id", param="eos_token_id")
        return int(found)

    def _row(self, ids: list[int]) -> Row | None:
        """(prefix, generated) of one row, None when it has ended (an `<eos>` among its generated tokens)."""
        assert self.prompt_length is not None
        prompt, generated = ids[: self.prompt_length], ids[self.prompt_length:]
        if self.eos_token_id in generated:
            return None
        if not self.from_prompt:
            return self.fixed, tuple(generated)
        start = 0
        while start < len(prompt) and prompt[start] == self.eos_token_id:
            start += 1
        return (tuple(prompt[start:]) or None), tuple(generated)

    def _weights(self, row: Row) -> list[float]:
        prefix, generated = row
        body = self._ask(prefix, generated, weights=True)
        if body["log_prob"] is None:
            raise APIError(422, "constraint: has probability 0 under the HMM after this row's prompt and tokens: no "
                                "continuation satisfies it", param="constraint")
        return body["weights"]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """(n, L) ids so far, (n, V_lm) next-token scores -> scores + log P(C | x, y_<=j, v) (n, V_lm); one request
        per distinct row still generating."""
        check_scores(input_ids, scores, self.vocab_size, lm_vocab_size=None if self.ids_match else self.lm_vocab_size,
                     padding=self.ids_match or self.tokenizer_checked)
        length = input_ids.shape[1]
        if self.prompt_length is None:
            self.prompt_length = length
        elif self.last_length is None or length != self.last_length + 1:
            raise APIError(422, f"input_ids: length {length} after {self.last_length} at the previous call; one "
                                "processor serves one generate call (make a new one for the next)", param="input_ids")
        self.last_length = length
        if self.alpha == 0:  # the plain LM: nothing to ask
            return scores
        rows = [self._row(ids) for ids in input_ids.tolist()]
        distinct = list(dict.fromkeys(r for r in rows if r is not None))
        workers = min(self.max_concurrency, len(distinct))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                answers = dict(zip(distinct, pool.map(self._weights, distinct), strict=True))
        else:
            answers = {r: self._weights(r) for r in distinct}
        self.requests += len(distinct)
        log_w = torch.full((len(rows), self.vocab_size), -math.inf, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r is not None:
                log_w[i] = torch.tensor(answers[r], dtype=torch.float64).log()
        live = torch.tensor([r is not None for r in rows], dtype=torch.bool)
        return apply_log_weights(scores, log_w, live, self.alpha)
