"""A guide for neural LMs (Ctrl-G's factor), in process: `ConstraintLogitsProcessor` steers an LM whose token ids
are the HMM's (token id i = token i of the HMM's vocabulary: an HMM distilled from the LM, or imported from Ctrl-G,
carries the LM's tokenizer) so that every text it generates satisfies a `constraint`. It follows `transformers`'
LogitsProcessor protocol (`__call__(input_ids, scores) -> scores`) without importing transformers:

    proc = ConstraintLogitsProcessor(ops.load_model(store, "gpt2-hmm"), {"include": [["apple"], ["river"]],
                                     "max_words": 20, "max_tokens": 40}, tokenizer=tok, config=lm.config)
    lm.generate(prompt_ids, logits_processor=[proc], **proc.generate_kwargs())

Each step adds alpha log g_j(v), g_j(v) = P(C | x, y_<=j, v) (the HMM's exact probability that the constraint can
still be met after v; -inf where it cannot), to the LM's scores: the LM's next-token distribution times g^alpha.
alpha = 1 (default) is Ctrl-G's product; any alpha > 0 keeps every text inside the constraint (g = 0 stays
excluded) and weighs the HMM's lookahead more (> 1) or less (< 1) against the LM's fluency; alpha = 0 returns the
LM's scores unchanged (the constraint is then not enforced).

The ids must mean the same text on both sides. The LM's tokenizer (`tokenizer=`: a `transformers` fast tokenizer, a
`tokenizers.Tokenizer`, a tokenizer.json or save_pretrained directory) is compared with the HMM's by what each id
spells (`vocabulary_sha256`): a different one is an InputError naming `tokenizer`. The LM's scores must cover
exactly the HMM's ids, or more when the extra ids are declared padding (an LM whose embedding is padded above its
tokenizer: `lm_vocab_size=` / `config=` with that size, or the matching tokenizer, whose ids stop at the HMM's):
they get weight 0; anything else is an InputError naming `scores`. `ids_match=True` skips both checks (the caller
vouches that id i means the same on both sides). The end token is the HMM's (`generate_kwargs`), checked against
the LM's (`eos_token_id=`, the config's or the tokenizer's) when given: InputError naming `eos_token_id`.
The guide is incremental: it keeps a `models.constrained.Guide` (the HMM's filter over (state, automaton state) per
row) and reads only the newest token per call, one filter step (O(S^2); blocked O(k Z)) plus the weights (O(S V);
blocked O(k V)) per token and row, after one backward pass over the constraint's window when it is built
(O(max_tokens (Q S^2 + E S))). Rows are batch rows (`num_return_sequences` included); beam search works too (rows
reordered between steps are followed by matching each row's history to the previous step's rows).
"""

from __future__ import annotations

import functools
import hashlib
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
from latentlm.ops.inputs import prefix_ids
from latentlm.ops.model import LoadedModel


def check_scores(input_ids: Tensor, scores: Tensor, vocab_size: int, *, lm_vocab_size: int | None = None,
                 padding: bool = False) -> None:
    """`input_ids` (n, L) integer ids and `scores` (n, V_lm) float with V_lm = the HMM's V, or V_lm > V when the
    extra ids are declared: `lm_vocab_size` = V_lm, or `padding` (the caller checked the tokenizer, or vouched with
    ids_match); they get weight 0. InputError naming the argument otherwise."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype.is_floating_point:
        raise InputError(f"input_ids: expected (batch, length >= 1) integer ids, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}", param="input_ids")
    if scores.dim() != 2 or scores.shape[0] != input_ids.shape[0] or not scores.dtype.is_floating_point:
        raise InputError(f"scores: expected ({input_ids.shape[0]}, vocabulary) floats, got {tuple(scores.shape)} "
                         f"{scores.dtype}", param="scores")
    V_lm = scores.shape[1]
    if V_lm < vocab_size:
        raise InputError(f"scores: the LM's vocabulary ({V_lm}) is smaller than the HMM's ({vocab_size}); "
                         "the guide needs token id i to be the HMM's token i", param="scores")
    if lm_vocab_size is not None and V_lm != lm_vocab_size:
        raise InputError(f"scores: the LM gives {V_lm} scores per row, lm_vocab_size says {lm_vocab_size}",
                         param="scores")
    if V_lm > vocab_size and lm_vocab_size is None and not padding:
        raise InputError(f"scores: the LM scores {V_lm} token ids, the HMM has {vocab_size}: they are not the same "
                         "vocabulary (an HMM over the LM's own tokenizer is needed: `latentlm distill` or "
                         "`latentlm import-ctrlg`); if the extra ids are only padding of the LM's embedding, declare "
                         f"lm_vocab_size={V_lm} (or pass the LM's tokenizer or config); ids_match=True vouches that "
                         "the ids match", param="scores")


def apply_log_weights(scores: Tensor, log_weights: Tensor, live: Tensor, alpha: float = 1.0) -> Tensor:
    """scores (n, V_lm) + alpha log_weights (n, V) on the rows where `live` (n,) bool; ids >= V get -inf, and so do
    the ids of weight 0 for any alpha > 0; alpha = 0 returns `scores` itself. Other rows are returned unchanged (a
    finished row's scores are not used by `generate`). A live row left with no finite score raises: nothing the
    scores allow can still satisfy the constraint."""
    if alpha == 0:
        return scores
    n, V = log_weights.shape
    add = torch.full(scores.shape, -math.inf, dtype=scores.dtype, device=scores.device)
    add[:, :V] = (alpha * log_weights).to(device=scores.device, dtype=scores.dtype)
    live = live.to(scores.device)
    out = torch.where(live[:, None], scores + add, scores)
    stuck = (live & ~torch.isfinite(out).any(1)).nonzero().squeeze(1).tolist()
    if stuck:
        raise InputError(f"scores: row(s) {stuck[:8]} have no next token that both the scores allow (a processor "
                         "before the guide ruled out every token the constraint still allows, e.g. min_new_tokens "
                         "or bad_words_ids) and that can still satisfy the constraint", param="scores")
    return out


def vocabulary_sha256(tok: Any) -> str:
    """SHA-256 of what each id of a tokenizer spells (`models.tokenizer.TextTokenizer`: every id's bytes, length
    first, then its special ids): two tokenizers give the same digest exactly when their ids mean the same text,
    however their tokenizer.json files are written. O(V), cached per tokenizer file."""
    return _vocabulary_sha256(tok.sha256, tok)


@functools.lru_cache(maxsize=16)
def _vocabulary_sha256(_: str, tok: Any) -> str:
    h = hashlib.sha256(len(tok.token_bytes).to_bytes(8, "little"))
    for b in tok.token_bytes:
        h.update(len(b).to_bytes(4, "little") + b)
    h.update(b"special:" + ",".join(str(i) for i in sorted(tok.special)).encode())
    return h.hexdigest()


def lm_tokenizer(tokenizer: Any) -> Any:
    """The LM's tokenizer as a `TextTokenizer` (from itself, a `tokenizers.Tokenizer`, a `transformers` fast
    tokenizer, a tokenizer.json or a save_pretrained directory); InputError naming `tokenizer` when it cannot be
    read."""
    from latentlm.models.tokenizer import as_text_tokenizer

    try:
        return as_text_tokenizer(tokenizer)
    except InputError:
        raise
    except Exception as e:  # a library error, or an object that is no tokenizer
        raise InputError(f"tokenizer: cannot be read as a fast tokenizer ({type(e).__name__}: {e})"[:400],
                         param="tokenizer") from None


def check_tokenizer(hmm_tokenizer: Any, hmm_name: str, tokenizer: Any) -> None:
    """InputError naming `tokenizer` unless the LM's tokenizer spells every id as the HMM's does (`hmm_tokenizer`
    None: a word-level HMM, whose ids are its words, never an LM tokenizer's)."""
    if hmm_tokenizer is None:
        raise InputError(f"tokenizer: model {hmm_name!r} is word-level (its ids are its own words, not the LM "
                         "tokenizer's); an HMM over the LM's tokenizer is needed (`latentlm distill`, `latentlm "
                         "import-ctrlg`), or ids_match=True if the LM's ids really are these words", param="tokenizer")
    lm = lm_tokenizer(tokenizer)
    if vocabulary_sha256(lm) == vocabulary_sha256(hmm_tokenizer):
        return
    a, b = lm.token_bytes, hmm_tokenizer.token_bytes
    diff = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    detail = (f"id {diff} spells {a[diff]!r} for the LM, {b[diff]!r} for the HMM" if diff is not None else
              f"{len(a)} ids for the LM, {len(b)} for the HMM" if len(a) != len(b) else "their special tokens differ")
    raise InputError(f"tokenizer: the LM's tokenizer is not the one model {hmm_name!r} carries ({detail}); the "
                     "guide needs an HMM over the LM's own tokenizer (`latentlm distill`, `latentlm import-ctrlg`)",
                     param="tokenizer")


def lm_eos_ids(eos_token_id: Any = None, config: Any = None, tokenizer: Any = None) -> list[set[int]]:
    """The LM's end-of-text ids as each source gives them (an int or a list: the argument, `config.eos_token_id`,
    a transformers tokenizer's `eos_token_id`); sources that say nothing are left out."""
    out = []
    for value in (eos_token_id, getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        ids = value if isinstance(value, (list, tuple, set)) else [value]
        out.append({int(i) for i in ids})
    return out


def check_eos(hmm_eos: int | None, sources: list[set[int]]) -> None:
    """InputError naming `eos_token_id` when a source of the LM's end ids does not hold the HMM's `<eos>`."""
    for ids in sources:
        if hmm_eos not in ids:
            raise InputError(f"eos_token_id: the LM ends texts with id(s) {sorted(ids)}, the HMM with {hmm_eos}: "
                             "not the same vocabulary", param="eos_token_id")


class ConstraintLogitsProcessor:
    """Steers a neural LM sharing the HMM's token ids so that its texts satisfy `constraint` (module docstring).

    model: a loaded chain-family model (`ops.load_model`), for an LM with its own tokenizer one that carries it;
    constraint: the `constraint` object of `POST /v1/constraint` (dict; over the decoded text for such a model);
    prefix: the HMM's prefix x (text, encoded by the HMM's tokenizer, or token ids) for every row, or None (default)
    for each row's prompt as `generate` passes it at the first call, with leading `<eos>` tokens (a start-of-text
    token or left padding) dropped; temperature: the HMM's (applied before conditioning; the LM's own temperature,
    top_k and top_p act after this processor, on the product); alpha >= 0: the weight of the HMM's factor (scores +
    alpha log g; 0: the plain LM); tokenizer, lm_vocab_size, config (its vocab_size and eos_token_id),
    eos_token_id: what the LM says of its vocabulary, checked against the HMM's (module docstring); ids_match: skip
    those checks. One instance serves one `generate` call. Errors (InputError, naming the field): words outside
    the vocabulary, an impossible constraint, a different tokenizer or eos, a prompt id outside the HMM's
    vocabulary, scores of another vocabulary, input_ids that do not continue the previous call's."""

    def __init__(self, model: LoadedModel, constraint: dict[str, Any] | Any, prefix: str | Sequence[int] | None = None,
                 temperature: float = 1.0, limits: Limits = Limits(), *, alpha: float = 1.0, ids_match: bool = False,
                 tokenizer: Any = None, lm_vocab_size: int | None = None, config: Any = None,
                 eos_token_id: int | Sequence[int] | None = None):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise InputError(f"temperature: must be a positive finite number, got {temperature!r}",
                             param="temperature")
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
            raise InputError(f"alpha: must be a finite number >= 0, got {alpha!r}", param="alpha")
        self.alpha = float(alpha)
        self.ids_match = bool(ids_match)
        if lm_vocab_size is None and config is not None:
            lm_vocab_size = getattr(config, "vocab_size", None)
        if lm_vocab_size is not None and (isinstance(lm_vocab_size, bool) or not isinstance(lm_vocab_size, int)):
            raise InputError(f"lm_vocab_size: expected an integer, got {lm_vocab_size!r}", param="lm_vocab_size")
        self.lm_vocab_size = lm_vocab_size
        self.tokenizer_checked = False
        if tokenizer is not None and not self.ids_match:
            check_tokenizer(model.vocab.tokenizer, model.name, tokenizer)
            self.tokenizer_checked = True
        self.model = model
        self.dfa: WordDFA = constrain.compile_for(model, constraint, limits)
        with torch.no_grad():
            self.messages = constrained.prepare(model.impl, self.dfa, temperature=float(temperature),
                                                max_bytes=limits.max_bytes)
        self.vocab_size = self.messages.vocab_size
        self.eos_token_id: int | None = self.dfa.eos_id
        if not self.ids_match:
            check_eos(self.eos_token_id, lm_eos_ids(eos_token_id, config, tokenizer))
            if lm_vocab_size is not None and lm_vocab_size < self.vocab_size:
                raise InputError(f"lm_vocab_size: {lm_vocab_size} is below the HMM's vocabulary ({self.vocab_size})",
                                 param="lm_vocab_size")
        self.fixed_prefix = None if prefix is None else prefix_ids(model.vocab, prefix)
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
        """(n, L) ids so far, (n, V_lm) next-token scores (logits or log-probabilities) -> scores + alpha log g
        (n, V_lm). One filter step per row (the newest token), then the weights."""
        check_scores(input_ids, scores, self.vocab_size, lm_vocab_size=None if self.ids_match else self.lm_vocab_size,
                     padding=self.ids_match or self.tokenizer_checked)
        with torch.no_grad():
            if self.guide is None:
                self._start(input_ids)
            else:
                self._read(input_ids)
            self.seen = input_ids.detach().clone()
            assert self.guide is not None
            if self.alpha == 0:  # the plain LM (the guide still follows the rows: log_prob() stays available)
                return scores
            return apply_log_weights(scores, self.log_weights(), ~self.guide.done, self.alpha)
