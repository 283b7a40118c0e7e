"""Turning request values into what a family takes: inputs to token ids, stop sequences, seeds, top_k."""

from __future__ import annotations

from typing import Any

from latentlm.models.errors import InputError, UnsupportedOperation
from latentlm.models.vocab import Vocabulary
from latentlm.ops.model import LoadedModel


def encode_inputs(vocab: Vocabulary, inputs: list[Any], *, as_ids: bool | None = None,
                  where: str = "input") -> list[list[int]]:
    """Strings (tokenised per the manifest, `<eos>` appended if trained with it) or lists of token ids
    (taken as is, each id checked against [0, V)) -> token-id lists. Errors name the item and position."""
    seqs = []
    for i, item in enumerate(inputs):
        loc = f"{where}[{i}]"
        if isinstance(item, str) and not as_ids:
            seqs.append(vocab.encode(item, where=loc))
        elif isinstance(item, str):
            try:
                ids = [int(tok) for tok in item.split()]
            except ValueError:
                bad = next(t for t in item.split() if not t.lstrip("-").isdigit())
                raise InputError(f"{loc}: {bad!r} is not an integer token id", param=where) from None
            seqs.append(vocab.check_ids(ids, where=loc))
        elif isinstance(item, list):
            seqs.append(vocab.check_ids(item, where=loc))
        else:
            raise InputError(f"{loc}: expected a string or a list of token ids", param=where)
    return seqs


def prefix_ids(vocab: Vocabulary, prefix: str | list[int] | None, where: str = "prefix") -> list[int] | None:
    """A prefix (of a sample, a constraint's continuation, a completion's prompt) as token ids: text tokenised
    without `<eos>`, ids checked against [0, V); None when empty. Errors name `where`."""
    if prefix is None or prefix == "" or prefix == []:
        return None
    if isinstance(prefix, str):
        return vocab.encode(prefix, add_eos=False, where=where)
    return vocab.check_ids(list(prefix), where=where)


MAX_STOP_SEQUENCES = 4  # as OpenAI-style servers allow
MAX_STOP_TOKENS = 64  # tokens per stop sequence

def check_shaping(model: LoadedModel, top_k: Any, top_p: Any) -> dict[str, Any]:
    """`sample`'s top_k / top_p as keyword arguments of `op_sample` (none when both are None); InputError naming
    the field for a top_k that is not a positive integer or a top_p outside (0, 1], UnsupportedOperation for a
    family that samples only ancestrally."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"top_k: expected a positive integer, got {top_k!r}", param="top_k")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise InputError(f"top_p: expected a number in (0, 1], got {top_p!r}", param="top_p")
    given = {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None}
    if given and not getattr(model.impl, "predictive_sampling", False):
        name = next(iter(given))
        raise UnsupportedOperation(f"{name}: family {model.family!r} samples ancestrally only (state, then token); "
                                   "sampling from the next-token distribution (top_k, top_p) is offered by hmm, "
                                   "tagging_hmm and blocked_hmm", param=name)
    return given


def encode_stops(vocab: Vocabulary, stop: Any) -> list[list[int]]:
    """Token-id lists of `sample`'s stop sequences; InputError naming `stop` (or `stop[i]`) for anything but a
    string, or a list of up to `MAX_STOP_SEQUENCES` non-empty strings or token-id lists of at most
    `MAX_STOP_TOKENS` tokens. Text of a model over an LM's tokenizer is that tokenizer's ids of it: the sampler may
    end a sample early where it draws them, and `generate.cut_at_stop` then finds the text in the decoded text
    (`generate.text_stops`), however it was tokenised."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOP_SEQUENCES:
        raise InputError(f"stop: expected a string or a list of at most {MAX_STOP_SEQUENCES} strings or token-id "
                         f"lists, got {stop!r}"[:300], param="stop")
    out = []
    for i, item in enumerate(items):
        where = f"stop[{i}]" if not isinstance(stop, str) else "stop"
        if isinstance(item, str) and vocab.tokenizer is not None:  # the LM tokenizer's ids of the text
            ids = vocab.tokenizer.encode(item)
        elif isinstance(item, str):
            words = vocab.tokenize(item)
            unknown = next((w for w in words if w not in vocab.index), None)
            if unknown is not None:  # it would match <unk>: a sample never spells the word itself
                raise InputError(f"{where}: {unknown!r} is not in the model's vocabulary, so no sample spells it "
                                 f"(write {vocab.tokens[vocab.unk_id]!r} to stop at an unknown word)"
                                 if vocab.unk_id is not None else f"{where}: {unknown!r} is not in the model's "
                                 "vocabulary, so no sample spells it", param="stop")
            ids = [vocab.index[w] for w in words]
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = list(item)
            if ids and not all(0 <= t < len(vocab) for t in ids):
                raise InputError(f"{where}: token ids must lie in [0, {len(vocab)}), got {item!r}"[:300], param="stop")
        else:
            raise InputError(f"{where}: expected a string or a list of token ids, got {item!r}"[:300], param="stop")
        if not 1 <= len(ids) <= MAX_STOP_TOKENS:
            raise InputError(f"{where}: a stop sequence needs 1 to {MAX_STOP_TOKENS} tokens, got {len(ids)}",
                             param="stop")
        out.append(ids)
    return out


MAX_SEED = 1 << 63  # seeds are 0 <= seed < 2^63 (torch's generator takes 64 bits; JSON clients often only 63)


def check_seed(seed: Any) -> int:
    """InputError naming `seed` unless it is an integer in [0, 2^63) (torch raises ValueError beyond 64 bits)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed: expected an integer, got {seed!r}", param="seed")
    if not 0 <= seed < MAX_SEED:
        raise InputError(f"seed: must be in [0, 2^63), got {seed}", param="seed")
    return seed



def parse_top_k(value: Any) -> int | None:
    """'all' / None -> None (every state); positive int -> int."""
    if value is None or value == "all":
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise InputError(f"top_k: expected a positive integer or 'all', got {value!r}", param="top_k") from None
    if k < 1:
        raise InputError(f"top_k: must be >= 1, got {k}", param="top_k")
    return k

