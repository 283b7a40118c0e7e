"""Shared by tests of models over an LM's tokenizer: a tiny byte-level BPE (and a Metaspace BPE) trained here with the
`tokenizers` library on a few hundred sentences with multi-byte characters, and a tiny dense HMM store over its ids.
Stable API: `make_bpe_tokenizer`, `make_metaspace_tokenizer`, `make_tokenizer_hmm_store`, `SENTENCES`, `EOS`."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

EOS = "<|endoftext|>"

_WORDS = ("the river runs past an apple tree near the old mill while a naïve café owner in Zürich sells crème "
          "brûlée and 日本 tea to travellers who say hello world and smile at the señora with her piñata "
          "résumé über straße ça va déjà vu 東京 cold water quick brown fox jumps over lazy dogs").split()


def _sentences(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        s = " ".join(words)
        out.append(s[0].upper() + s[1:] + rng.choice([".", "!", "?", ",", " 🍎.", "\n"]))
    return out


SENTENCES: list[str] = _sentences()
"""300 sentences (seeded) over ASCII, Latin-1, CJK and emoji characters: the training text of the test tokenizers."""


@functools.cache
def _bpe_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    return tok.to_str()


def make_bpe_tokenizer(vocab_size: int = 300):
    """A GPT-2-style byte-level BPE (`tokenizers.Tokenizer`; eos "<|endoftext|>" = id 0, the 256 byte tokens, then
    merges up to `vocab_size`) trained on `SENTENCES`. Deterministic; a fresh object each call."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_bpe_json(vocab_size))


@functools.cache
def _metaspace_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    spec = json.loads(tok.to_str())  # the 256 byte-fallback tokens `<0xNN>` appended to the model's vocabulary
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return json.dumps(spec)


def make_metaspace_tokenizer(vocab_size: int = 200):
    """A SentencePiece-style BPE ("▁" for spaces; eos id 0; merges up to `vocab_size`, then the 256 `<0xNN>` byte
    tokens a character it has not seen falls back to) trained on `SENTENCES`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_metaspace_json(vocab_size))


def make_tokenizer_hmm_store(store_dir: Path | str, name: str, tok=None, states: int = 4, seed: int = 0,
                             V: int | None = None, eos: str = EOS) -> Path:
    """A dense `hmm` (random Dirichlet weights, `states` states) over `tok`'s ids (default: `make_bpe_tokenizer()`),
    V = the tokenizer's vocabulary size unless given, saved as `<store_dir>/<name>` with its tokenizer.json;
    returns the model directory."""
    from latentlm.models.registry import save_artifact
    from latentlm.models.synthetic import random_hmm
    from latentlm.models.tokenizer import TextTokenizer, tokenizer_files, vocab_for

    t = TextTokenizer.from_hf(tok if tok is not None else make_bpe_tokenizer())
    vocab = vocab_for(t, V, eos)
    tensors, config = random_hmm(states, len(vocab), seed=seed)
    return save_artifact(store_dir, name, "hmm", tensors, vocab, config=config, extra_files=tokenizer_files(t))
