"""Vocabulary and tokenisation, recorded in the manifest so training, CLI and service treat text alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from latentlm.models.errors import ArtifactError, InputError

WHITESPACE = "whitespace"
TOKENIZER_JSON = "tokenizer.json"


@dataclass(frozen=True)
class Preprocessing:
    """How raw text becomes token ids. Stored verbatim under `preprocessing` in manifest.json. `tokenizer`:
    "whitespace" (words split at white space) or "tokenizer.json" (the LM's own tokenizer, a file of the model)."""

    lowercase: bool = False
    unk: str | None = "<unk>"
    eos: str | None = "<eos>"
    add_eos: bool = True
    tokenizer: str = WHITESPACE

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Preprocessing:
        known = {k: d[k] for k in ("lowercase", "unk", "eos", "add_eos", "tokenizer") if k in d}
        return cls(**known)


@dataclass
class Vocabulary:
    """Token strings indexed by id; `vocab.txt` holds one token per line (line number = id). With a `tokenizer`
    (preprocessing "tokenizer.json": a model over an LM's token ids), text goes in through the tokenizer's `encode`
    and out through its exact bytes per id (`text`, `pieces`, `token_bytes`); line i is then the tokenizer's token
    i (`TextTokenizer.display`), ids from the tokenizer's vocab_size up to V placeholders that spell nothing."""

    tokens: list[str]
    preprocessing: Preprocessing = field(default_factory=Preprocessing)
    tokenizer: Any = None  # a `latentlm.models.tokenizer.TextTokenizer` (which imports this module), or None

    def __post_init__(self) -> None:
        self.index = {tok: i for i, tok in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            seen: set[str] = set()
            dup = next(t for t in self.tokens if t in seen or seen.add(t))
            raise ArtifactError(f"vocab.txt: duplicate token {dup!r}", param="vocab")
        p = self.preprocessing
        self.unk_id = self.index.get(p.unk) if p.unk else None
        self.eos_id = self.index.get(p.eos) if p.eos else None
        if self.tokenizer is not None and p.tokenizer != TOKENIZER_JSON:
            raise ArtifactError(f"preprocessing: tokenizer {p.tokenizer!r} does not take a tokenizer file "
                                f"({TOKENIZER_JSON!r} does)", param="tokenizer")
        if p.tokenizer not in (WHITESPACE, TOKENIZER_JSON):
            raise ArtifactError(f"preprocessing: tokenizer {p.tokenizer!r} is not one of {WHITESPACE!r}, "
                                f"{TOKENIZER_JSON!r}", param="tokenizer")
        if self.tokenizer is not None:
            self._check_tokenizer(self.tokenizer)

    def _check_tokenizer(self, tok: Any) -> None:
        """The vocabulary is the tokenizer's (line i its token i, padded with placeholders) and holds its eos;
        ArtifactError naming `tokenizer` / `vocab` otherwise. O(V)."""
        V = len(self.tokens)
        if tok.vocab_size > V:
            raise ArtifactError(f"tokenizer: its vocabulary size {tok.vocab_size} exceeds the model's {V} tokens",
                                param="tokenizer")
        p = self.preprocessing
        if p.eos and self.eos_id is None:
            raise ArtifactError(f"tokenizer: the eos token {p.eos!r} is not in the vocabulary", param="tokenizer")
        if p.unk:
            raise ArtifactError("preprocessing: a model over an LM's tokenizer has no unk token (unk must be null)",
                                param="tokenizer")
        for i, t in enumerate(self.tokens):
            if t != tok.display(i):
                raise ArtifactError(f"vocab.txt: line {i + 1} is {t!r}, the tokenizer's token {i} is "
                                    f"{tok.display(i)!r}"[:300], param="vocab")
        self._token_bytes = tok.token_bytes + [b""] * (V - tok.vocab_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def tokenize(self, text: str) -> list[str]:
        """Split raw text into token strings (whitespace tokenizer, optional lowercasing; with a tokenizer, its
        tokens' strings)."""
        if self.preprocessing.lowercase:
            text = text.lower()
        if self.tokenizer is not None:
            return [self.tokens[i] for i in self.tokenizer.encode(text)]
        return text.split()

    def encode(self, text: str, *, add_eos: bool | None = None, where: str = "input") -> list[int]:
        """Text -> ids: unknown words map to `<unk>` (error if the model has none); appends `<eos>`
        when the model was trained with it. Raises InputError on an empty result. With a tokenizer: its ids."""
        if self.preprocessing.tokenizer == TOKENIZER_JSON:
            if self.tokenizer is None:  # a vocabulary being written, not one read from a store
                raise ArtifactError("tokenizer: this vocabulary names tokenizer.json but does not hold it",
                                    param="tokenizer")
            ids = self.tokenizer.encode(text.lower() if self.preprocessing.lowercase else text)
            if not ids:
                raise InputError(f"{where}: empty sequence (no tokens after tokenisation)", param=where)
            use_eos = self.preprocessing.add_eos if add_eos is None else add_eos
            return ids + [self.eos_id] if use_eos and self.eos_id is not None else ids
        ids: list[int] = []
        for pos, tok in enumerate(self.tokenize(text)):
            i = self.index.get(tok)
            if i is None:
                if self.unk_id is None:
                    raise InputError(
                        f"{where}: word {tok!r} at position {pos} is not in the vocabulary and the model "
                        "has no <unk> token",
                        param=where,
                    )
                i = self.unk_id
            ids.append(i)
        if not ids:
            raise InputError(f"{where}: empty sequence (no tokens after tokenisation)", param=where)
        use_eos = self.preprocessing.add_eos if add_eos is None else add_eos
        if use_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def check_ids(self, ids: list[int], *, where: str = "input") -> list[int]:
        """Validate a token-id sequence: non-empty, integers in [0, V). Returns it unchanged."""
        if len(ids) == 0:
            raise InputError(f"{where}: empty sequence", param=where)
        v = len(self.tokens)
        if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < v:  # the usual case, at C speed
            return ids
        for pos, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < v:
                raise InputError(
                    f"{where}: token id {i!r} at position {pos} is outside [0, {v})", param=where
                )
        return ids

    def decode(self, ids: list[int]) -> list[str]:
        """The ids' token strings (vocab.txt's lines)."""
        return [self.tokens[i] for i in ids]

    @property
    def token_bytes(self) -> list[bytes]:
        """With a tokenizer: the exact UTF-8 bytes each id (0..V-1) adds to a decoded text (b"" for special tokens
        and placeholders). AttributeError for a word-level vocabulary."""
        if self.tokenizer is None:
            raise AttributeError("token_bytes: a word-level vocabulary (tokens are joined by spaces)")
        return self._token_bytes

    def text(self, ids: Sequence[int], prefix: Sequence[int] = ()) -> str:
        """The text of `ids` (a continuation of `prefix` ids when given: the text they add after it). With a
        tokenizer, decoded by it (exact bytes, special tokens skipped, a text's first word as the tokenizer spells
        it); word-level, the tokens joined by single spaces (one before the first when there is a prefix)."""
        return "".join(self.pieces(ids, prefix))

    def pieces(self, ids: Sequence[int], prefix: Sequence[int] = ()) -> list[str]:
        """One string per id whose join is `text(ids, prefix)`: with a tokenizer, a token that ends inside a
        multi-byte character gives "" or what it completes, the character coming with the token that completes it;
        word-level, each token with a space before it but the first of the whole text. O(len(prefix) + len(ids))."""
        if self.tokenizer is None:
            return [(" " if (k > 0 or prefix) else "") + self.tokens[i] for k, i in enumerate(ids)]
        full = [*prefix, *ids]
        keep = [k for k, i in enumerate(full) if i < self.tokenizer.vocab_size]  # ids beyond it (padding) spell nothing
        parts = self.tokenizer.pieces([full[k] for k in keep])
        out = [""] * len(full)
        for k, p in zip(keep, parts, strict=True):
            out[k] = p
        return out[len(full) - len(ids):]

    def piece_bytes(self, ids: Sequence[int], prefix: Sequence[int] = ()) -> list[bytes]:
        """With a tokenizer: the bytes each id adds to the decoded text of `prefix + ids` (ids beyond the tokenizer,
        padding, add none); their join is the text's UTF-8 after the prefix's. AttributeError word-level."""
        if self.tokenizer is None:
            raise AttributeError("piece_bytes: a word-level vocabulary (tokens are joined by spaces)")
        full = [*prefix, *ids]
        keep = [k for k, i in enumerate(full) if i < self.tokenizer.vocab_size]
        out = [b""] * len(full)
        for k, b in zip(keep, self.tokenizer.text_bytes([full[k] for k in keep]), strict=True):
            out[k] = b
        return out[len(full) - len(ids):]

    # -- files ------------------------------------------------------------------------------------
    def to_text(self) -> str:
        for t in self.tokens:
            if not t or any(ch in t for ch in "\n\r"):
                raise ArtifactError(f"vocab: token {t!r} is empty or contains a newline", param="vocab")
        return "".join(t + "\n" for t in self.tokens)

    @classmethod
    def read(cls, path: Path, preprocessing: Preprocessing, tokenizer: Any = None) -> Vocabulary:
        """vocab.txt; `tokenizer` the model's (read and verified by the caller) when preprocessing names
        "tokenizer.json"."""
        text = path.read_text(encoding="utf-8")
        tokens = text.split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        return cls(tokens, preprocessing, tokenizer)
