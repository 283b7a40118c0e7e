"""Vocabulary and tokenisation, recorded in the manifest so training, CLI and service treat text alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from latentlm.models.errors import ArtifactError, InputError


@dataclass(frozen=True)
class Preprocessing:
    """How raw text becomes token ids. Stored verbatim under `preprocessing` in manifest.json."""

    lowercase: bool = False
    unk: str | None = "<unk>"
    eos: str | None = "<eos>"
    add_eos: bool = True
    tokenizer: str = "whitespace"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Preprocessing:
        known = {k: d[k] for k in ("lowercase", "unk", "eos", "add_eos", "tokenizer") if k in d}
        return cls(**known)


@dataclass
class Vocabulary:
    """Token strings indexed by id; `vocab.txt` holds one token per line (line number = id)."""

    tokens: list[str]
    preprocessing: Preprocessing = field(default_factory=Preprocessing)

    def __post_init__(self) -> None:
        self.index = {tok: i for i, tok in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            seen: set[str] = set()
            dup = next(t for t in self.tokens if t in seen or seen.add(t))
            raise ArtifactError(f"vocab.txt: duplicate token {dup!r}", param="vocab")
        p = self.preprocessing
        self.unk_id = self.index.get(p.unk) if p.unk else None
        self.eos_id = self.index.get(p.eos) if p.eos else None

    def __len__(self) -> int:
        return len(self.tokens)

    def tokenize(self, text: str) -> list[str]:
        """Split raw text into token strings (whitespace tokenizer, optional lowercasing)."""
        if self.preprocessing.lowercase:
            text = text.lower()
        return text.split()

    def encode(self, text: str, *, add_eos: bool | None = None, where: str = "input") -> list[int]:
        """Text -> ids: unknown words map to `<unk>` (error if the model has none); appends `<eos>`
        when the model was trained with it. Raises InputError on an empty result."""
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
        return [self.tokens[i] for i in ids]

    # -- files ------------------------------------------------------------------------------------
    def to_text(self) -> str:
        for t in self.tokens:
            if not t or any(ch in t for ch in "\n\r"):
                raise ArtifactError(f"vocab: token {t!r} is empty or contains a newline", param="vocab")
        return "".join(t + "\n" for t in self.tokens)

    @classmethod
    def read(cls, path: Path, preprocessing: Preprocessing) -> Vocabulary:
        text = path.read_text(encoding="utf-8")
        tokens = text.split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        return cls(tokens, preprocessing)
