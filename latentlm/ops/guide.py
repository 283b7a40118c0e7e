"""A guide for neural LMs (Ctrl-G's factor), in process: `ConstraintLogitsProcessor` steers any LM whose token ids
are the HMM's words (token id i = word i of the HMM's vocabulary) so that every text it generates satisfies a
`constraint`. It follows `transformers`' LogitsProcessor protocol (`__call__(input_ids, scores) -> scores`) without
importing transformers:

    proc = ConstraintLogitsProcessor(ops.load_model(store, "ptb-hmm"), {"include": [["stock"], ["fell"]],
                                                                         "max_tokens": 20})
    lm.generate(prompt_ids, logits_processor=[proc], **proc.generate_kwargs())

Each step adds log g_j(v) = log P(C | x, y_<=j, v) (the HMM's exact probability that the constraint can still be
met after v; -inf where it cannot) to the LM's scores: the LM's next-token distribution times the guide's weights.
The guide is incremental: it keeps a `models.constrained.Guide` (the HMM's filter over (state, automaton state) per
row) and reads only the newest token per call, one filter step (O(S^2); blocked O(k Z)) plus the weights (O(S V);
blocked O(k V)) per token and row, after one backward pass over the constraint's window when it is built
(O(max_tokens (Q S^2 + E S))). Rows are batch rows (`num_return_sequences` included); beam search works too (rows
reordered between steps are followed by matching each row's history to the previous step's rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from latentlm.models import constrained
from latentlm.models.constraint import WordDFA
from latentlm.models.errors import InputError
from latentlm.ops import constrain
from latentlm.ops.constrain import Limits
from latentlm.ops.model import LoadedModel


def check_scores(input_ids: Tensor, scores: Tensor, vocab_size: int) -> None:
    """`input_ids` (n, L) integer ids and `scores` (n, V_lm) float with V_lm >= the HMM's V (a larger LM vocabulary
    is allowed: its extra ids get weight 0). InputError naming the argument otherwise."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype.is_floating_point:
        raise InputError(f"input_ids: expected (batch, length >= 1) integer ids, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}", param="input_ids")
    if scores.dim() != 2 or scores.shape[0] != input_ids.shape[0] or not scores.dtype.is_floating_point:
        raise InputError(f"scores: expected ({input_ids.shape[0]}, vocabulary) floats, got {tuple(scores.shape)} "
                         f"{scores.dtype}", param="scores")
    if scores.shape[1] < vocab_size:
        raise InputError(f"scores: the LM's vocabulary ({scores.shape[1]}) is smaller than the HMM's ({vocab_size}); "
                         "the guide needs token id i to be the HMM's word i", param="scores")


def apply_log_weights(scores: Tensor, log_weights: Tensor, live: Tensor) -> Tensor:
    """scores (n, V_lm) + log_weights (n, V) on the rows where `live` (n,) bool; ids >= V get -inf; other rows are
    returned unchanged (a finished row's scores are not used by `generate`). A live row left with no finite score
    raises: nothing the scores allow can still satisfy the constraint."""
    n, V = log_weights.shape
    add = torch.full(scores.shape, -math.inf, dtype=scores.dtype, device=scores.device)
    add[:, :V] = log_weights.to(device=scores.device, dtype=scores.dtype)
    live = live.to(scores.device)
    out = torch.where(live[:, None], scores + add, scores)
    stuck = (live & ~torch.isfinite(out).any(1)).nonzero().squeeze(1).tolist()
    if stuck:
        raise InputError(f"scores: row(s) {stuck[:8]} have no next token that both the scores allow (a processor "
                         "before the guide ruled out every token the constraint still allows, e.g. min_new_tokens "
                         "or bad_words_ids) and that can still satisfy the constraint", param="scores")
    return out


class ConstraintLogitsProcessor:
    """Steers a neural LM sharing the HMM's vocabulary so that its texts satisfy `constraint` (module docstring).

    model: a loaded chain-family model (`ops.load_model`); constraint: the `constraint` object of `POST
    /v1/constraint` (dict); prefix: the HMM's prefix x (text or token ids) for every row, or None (default) for
    each row's prompt as `generate` passes it at the first call, with leading `<eos>` tokens (a start-of-text
    token or left padding) dropped; temperature: the HMM's (applied before conditioning; the LM's own temperature,
    top_k and top_p act after this processor, on the product). One instance serves one `generate` call.
    Errors (InputError, naming the field): words outside the vocabulary, an impossible constraint, a prompt id
    outside the HMM's vocabulary, input_ids that do not continue the previous call's."""

    def __init__(self, model: LoadedModel, constraint: dict[str, Any] | Any, prefix: str | Sequence[int] | None = None,
                 temperature: float = 1.0, limits: Limits = Limits()):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise InputError(f"temperature: must be a positive finite number, got {temperature!r}",
                             param="temperature")
        self.model = model
        self.dfa: WordDFA = constrain.compile_for(model, constraint, limits)
        with torch.no_grad():
            self.messages = constrained.prepare(model.impl, self.dfa, temperature=float(temperature),
                                                max_bytes=limits.max_bytes)
        self.vocab_size = self.messages.vocab_size
        self.eos_token_id: int | None = self.dfa.eos_id
        self.fixed_prefix = None if prefix is None else constrain.prefix_ids(model, prefix)
        if prefix is not None and self.messages.log_prob(self.fixed_prefix) is None:
            raise InputError("constraint: has probability 0 under the HMM after this prefix: no continuation "
                             "satisfies it", param="constraint")
        self.from_prompt = prefix is None
        self.guide: constrained.Guide | None = None
        self.seen: Tensor | None = None  # the input_ids of the previous call (n, L)

    @property
    def max_tokens(self) -> int:
        """The longest continuation the constraint allows, counting `<eos>`: `generate`'s `max_new_tokens` must be at
        least this, or a text may be cut before its `<eos>`."""
        return self.dfa.max_tokens

    def generate_kwargs(self) -> dict[str, Any]:
        """What `generate` needs for every text to end inside the constraint's window: max_new_tokens, and `<eos>`
        as its end and padding token."""
        return {"max_new_tokens": self.max_tokens, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.eos_token_id}

    def log_prob(self) -> list[float | None]:
        """log P(C | x, y_<=j) per row under the HMM after the tokens read so far (None: probability 0)."""
        if self.guide is None:
            raise InputError("guide: no tokens read yet (call it from generate first)", param="guide")
        return self.guide.log_prob()

    def _prompt_prefix(self, row: Tensor) -> list[int] | None:
        ids = row.tolist()
        start = 0
        while start < len(ids) and ids[start] == self.eos_token_id:
            start += 1
        ids = ids[start:]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"input_ids: prompt token id {bad[0]} is outside the HMM's vocabulary "
                             f"(0..{self.vocab_size - 1})", param="input_ids")
        return ids or None

    def _start(self, input_ids: Tensor) -> None:
        if self.from_prompt:
            prefixes = [self._prompt_prefix(row) for row in input_ids.cpu()]
        else:
            prefixes = [self.fixed_prefix] * len(input_ids)
        with torch.no_grad():
            self.guide = constrained.Guide(self.messages, prefixes)
        impossible = [i for i, lp in enumerate(self.guide.log_prob()) if lp is None]
        if impossible:
            raise InputError(f"constraint: has probability 0 under the HMM after the prompt of row(s) "
                             f"{impossible[:8]}: no continuation satisfies it", param="constraint")

    def _parents(self, input_ids: Tensor) -> Tensor:
        """For each row, the row of the previous call whose ids it extends by one token (beam search reorders rows).
        O(n L) bytes hashed; only called when the rows moved."""
        assert self.seen is not None
        index = {row.numpy().tobytes(): i for i, row in enumerate(self.seen.cpu())}
        parents = []
        for i, row in enumerate(input_ids[:, :-1].cpu()):
            p = index.get(row.numpy().tobytes())
            if p is None:
                raise InputError(f"input_ids: row {i} does not continue any row of the previous call; one processor "
                                 "serves one generate call (make a new one for the next)", param="input_ids")
            parents.append(p)
        return torch.tensor(parents, dtype=torch.long, device=self.messages.view.device)

    def _read(self, input_ids: Tensor) -> None:
        """Advance the guide by the newest token of each row (rows first re-ordered when beams moved)."""
        guide, seen = self.guide, self.seen
        assert guide is not None and seen is not None
        if input_ids.shape[1] != seen.shape[1] + 1:
            raise InputError(f"input_ids: length {input_ids.shape[1]} after {seen.shape[1]} at the previous call; one "
                             "processor serves one generate call (make a new one for the next)", param="input_ids")
        if input_ids.shape[0] != seen.shape[0] or not torch.equal(input_ids[:, :-1], seen):
            if input_ids.shape[0] != seen.shape[0]:
                raise InputError(f"input_ids: {input_ids.shape[0]} rows after {seen.shape[0]}", param="input_ids")
            parents = self._parents(input_ids)
            guide.a, guide.q, guide.done = guide.a[parents], guide.q[parents], guide.done[parents]
        newest = input_ids[:, -1].to(guide.a.device)
        done = guide.done
        # a finished row gets padding from generate: read as <eos> (ignored by the guide)
        newest = torch.where(done, torch.full_like(newest, self.eos_token_id or 0), newest)
        outside = ((newest < 0) | (newest >= self.vocab_size)) & ~done
        if bool(outside.any()):
            row = int(outside.nonzero()[0, 0])
            raise InputError(f"input_ids: row {row} generated token id {int(newest[row])}, outside the HMM's "
                             f"vocabulary (0..{self.vocab_size - 1})", param="input_ids")
        guide.advance(newest)

    def log_weights(self) -> Tensor:
        """log g_j(v) = log P(C | x, y_<=j, v) (n, V) float64 after the tokens read so far (-inf: v makes C
        impossible, or the HMM gives v probability 0). O(n (S V + K S))."""
        assert self.guide is not None
        log_s, log_p = self.guide.scores()
        return torch.where(log_p > -math.inf, (log_s - log_p).clamp_max(0.0), -math.inf)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """(n, L) ids so far, (n, V_lm) next-token scores (logits or log-probabilities) -> scores + log g (n, V_lm).
        One filter step per row (the newest token), then the weights."""
        check_scores(input_ids, scores, self.vocab_size)
        with torch.no_grad():
            if self.guide is None:
                self._start(input_ids)
            else:
                self._read(input_ids)
            self.seen = input_ids.detach().clone()
            assert self.guide is not None
            return apply_log_weights(scores, self.log_weights(), ~self.guide.done)
