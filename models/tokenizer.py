"""A language model's own tokenizer (the HF `tokenizers` JSON file), carried by a model store: text in through its
`encode`, text out as the exact bytes each token id contributes.

`TextTokenizer.token_bytes[i]` are the UTF-8 bytes token i adds to a decoded text, so a text is the join of its
tokens' bytes (`decode`), which is what a character-level automaton, a streamed completion or `logprobs.tokens` need.
That holds for decoders that act token by token, which covers the LMs people use:
- byte-level BPE (GPT-2, Llama 3, Qwen, ...): `ByteLevel`, each character of a token one byte through GPT-2's
  byte <-> unicode table (a token with a character outside it contributes its own UTF-8, as `tokenizers` does);
- SentencePiece-style: `Metaspace` ("▁" -> " ") or `Replace("▁", " ")`, `ByteFallback` (`<0x0A>` -> b"\\n"),
  `Fuse`, and a `Strip` of leading spaces of the whole text (Llama 2, Mistral, Gemma);
- no decoder: tokens joined by single spaces (what `tokenizers` does without one).
Some of those drop the space of a text's first word (`Metaspace` drops the "▁" of the first token, `Strip` the
first space of the text): `decode_text` (and `pieces`) reproduce that for a whole text, `decode` is the plain join
(a continuation). Special tokens contribute nothing (`tokenizers`' `skip_special_tokens`). Anything else (WordPiece
with its clean-up, BPE suffix decoders, CTC, regex replacements, ...) is refused when the tokenizer is read, naming
`tokenizer`, rather than guessed; and every id's decoding (as a text's first token and after another token) is checked
against the library's own `decode` when the tokenizer is read.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from latentlm.models.errors import ArtifactError, InputError
from latentlm.models.vocab import TOKENIZER_JSON, Preprocessing, Vocabulary

TOKENIZER_FILE = TOKENIZER_JSON
PLACEHOLDER = "<|id:{}|>"  # vocab.txt's line for an id the tokenizer does not know (or cannot spell on one line)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level table inverted: the printable character standing for each of the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass(frozen=True)
class _Decoding:
    """How token strings become text: per-token steps, whether a text's first token drops its "▁" (Metaspace), the
    leading characters stripped from a whole text (Strip after Fuse), and a word for `describe`."""

    steps: tuple[tuple[str, Any], ...]
    metaspace_first: str | None  # the replacement character a text's first token drops entirely
    strip_text: tuple[str, int]  # (character, how many at most) stripped from the start of a whole text
    kind: str


def _plan(decoder: dict | None, error: type[Exception]) -> _Decoding:
    """The decoder of a tokenizer.json as per-token steps; `error` (naming `tokenizer`) for one not reproduced
    exactly."""
    def refuse(why: str) -> Exception:
        return error(f"tokenizer: {why}; only decoders that act token by token (ByteLevel, Metaspace, Replace of a "
                     "string, ByteFallback, Fuse, Strip) can be reproduced exactly", param="tokenizer")

    if decoder is None:
        return _Decoding((("join_spaces", None),), None, (" ", 1), "spaces")
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    steps: list[tuple[str, Any]] = []
    fused = False
    as_bytes = False  # a step has turned (some) tokens into bytes: string steps after it are not per token
    metaspace_first = None
    strip_text = (" ", 0)
    kinds = []
    for d in parts:
        t = d.get("type")
        if t == "Fuse":
            fused = True
            continue
        if t == "Strip":
            content, start, stop = d.get("content"), int(d.get("start", 0)), int(d.get("stop", 0))
            if stop:
                raise refuse("a Strip decoder of trailing characters depends on the last token")
            if fused:
                if strip_text[1]:
                    raise refuse("two Strip decoders of the whole text")
                strip_text = (content, start)
            else:
                steps.append(("strip", (content, start)))
            continue
        if fused:
            raise refuse(f"decoder {t} after Fuse acts on the whole text")
        if t == "ByteLevel":
            steps.append(("byte_level", None))
            as_bytes = True
            kinds.append("byte_level")
        elif t == "ByteFallback":
            steps.append(("byte_fallback", None))
            as_bytes = True
            kinds.append("byte_fallback")
        elif t == "Metaspace":
            if as_bytes:
                raise refuse("Metaspace after a byte decoder")
            rep = d.get("replacement", "▁")
            steps.append(("replace", (rep, " ")))
            if d.get("prepend_scheme", "always") != "never" and d.get("add_prefix_space", True):
                metaspace_first = rep
            kinds.append("metaspace")
        elif t == "Replace":
            pattern = d.get("pattern", {})
            if as_bytes or "String" not in pattern:
                raise refuse("a Replace decoder of a regex, or after a byte decoder")
            steps.append(("replace", (pattern["String"], d.get("content", ""))))
            kinds.append("replace")
        else:
            raise refuse(f"decoder {t!r} is not supported")
    return _Decoding(tuple(steps), metaspace_first, strip_text, "+".join(kinds) or "none")


def _token_bytes(token: str, steps: tuple[tuple[str, Any], ...]) -> bytes:
    """The bytes one token string contributes after the per-token decoder steps."""
    value: str | bytes = token
    for step, arg in steps:
        if isinstance(value, bytes):
            continue  # the byte steps come last among per-token steps (checked by `_plan`)
        if step == "replace":
            value = value.replace(*arg)
        elif step == "strip":
            char, n = arg
            k = 0
            while k < n and k < len(value) and value[k] == char:
                k += 1
            value = value[k:]
        elif step == "byte_fallback":
            m = _BYTE_TOKEN.match(value)
            if m:
                value = bytes([int(m.group(1), 16)])
        elif step == "byte_level":
            table = byte_decoder()
            value = bytes(table[c] for c in value) if all(c in table for c in value) else value.encode()
        elif step == "join_spaces":
            value = " " + value
    return value if isinstance(value, bytes) else value.encode()


class TextTokenizer:
    """An LM's tokenizer (`tokenizers.Tokenizer`) with the exact bytes of each token id. ids 0..vocab_size-1."""

    def __init__(self, data: bytes, *, error: type[Exception] = ArtifactError, source: str = TOKENIZER_FILE):
        """Read a tokenizer.json's bytes; `error` (ArtifactError for a model store, InputError for a user's file)
        names `tokenizer` for a file `tokenizers` cannot read or whose decoding cannot be reproduced exactly.
        O(V) decodes (the check against the library's decoder)."""
        from tokenizers import Tokenizer

        self.sha256 = hashlib.sha256(data).hexdigest()
        self._data = data
        try:
            spec = json.loads(data.decode("utf-8"))
            self.hf = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library raises its own exception types
            raise error(f"tokenizer: {source} cannot be read by the `tokenizers` library ({e})"[:500],
                        param="tokenizer") from None
        self.hf.no_truncation()
        self.hf.no_padding()
        self.decoding = _plan(spec.get("decoder"), error)
        vocab = self.hf.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        specials = {i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        self.special: frozenset[int] = frozenset(specials)
        self.token_strings: list[str | None] = [self.hf.id_to_token(i) for i in range(self.vocab_size)]
        steps = self.decoding.steps
        self.token_bytes: list[bytes] = [
            b"" if (s is None or i in specials) else _token_bytes(s, steps) for i, s in enumerate(self.token_strings)]
        seen: set[str] = set()
        self._display: list[str] = []
        for i, s in enumerate(self.token_strings):
            d = PLACEHOLDER.format(i) if not s or "\n" in s or "\r" in s or s in seen else s
            seen.add(d)
            self._display.append(d)
        self._check(error, source)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: Path | str, *, error: type[Exception] = ArtifactError) -> TextTokenizer:
        """A tokenizer.json file (what `tokenizers.Tokenizer.save` writes)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise error(f"tokenizer: {path}: cannot be read ({e.strerror or e})", param="tokenizer") from None
        return cls.from_bytes(data, error=error, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, *, error: type[Exception] = ArtifactError,
                   source: str = TOKENIZER_FILE) -> TextTokenizer:
        """A tokenizer.json's bytes; tokenizers already read in this process are shared (by SHA-256)."""
        key = (hashlib.sha256(data).hexdigest(), error)
        tok = _CACHE.pop(key, None)
        if tok is None:
            tok = cls(data, error=error, source=source)
        _CACHE[key] = tok  # most recently used last
        while len(_CACHE) > CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        return tok

    @classmethod
    def from_pretrained_dir(cls, lm_dir: Path | str) -> TextTokenizer:
        """The tokenizer.json of a `save_pretrained` directory (a fast tokenizer's); InputError naming `tokenizer`
        when there is none."""
        path = Path(lm_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise InputError(f"tokenizer: {lm_dir} has no {TOKENIZER_FILE} (save the LM's fast tokenizer there: "
                             "AutoTokenizer.from_pretrained(...).save_pretrained(DIR))", param="tokenizer")
        return cls.from_file(path, error=InputError)

    @classmethod
    def from_hf(cls, tok: Any) -> TextTokenizer:
        """A `tokenizers.Tokenizer` (or a `transformers` fast tokenizer, through its `backend_tokenizer`)."""
        tok = getattr(tok, "backend_tokenizer", tok)
        return cls.from_bytes(tok.to_str().encode("utf-8"), error=InputError, source="the tokenizer given")

    def to_json_bytes(self) -> bytes:
        """The tokenizer.json bytes read (their SHA-256 is `sha256`)."""
        return self._data

    # -- text <-> ids -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text -> ids as the LM's tokenizer splits it, no special tokens added (a special token spelled in the
        text is still that token, as `tokenizers` does). O(len(text))."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The join of the ids' bytes as text (invalid UTF-8, e.g. half a character, as U+FFFD): the text a
        continuation adds."""
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", "replace")

    def first_bytes(self, i: int) -> bytes:
        """The bytes id i contributes as the first (non-special) token of a text (a Metaspace decoder drops its
        "▁")."""
        rep = self.decoding.metaspace_first
        s = self.token_strings[i]
        if rep is None or s is None or i in self.special:
            return self.token_bytes[i]
        return _token_bytes(s.replace(rep, ""), self.decoding.steps)

    def text_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each id's bytes in a whole text (`ids` from its start): the first non-special token's `first_bytes`, and
        the leading characters a Strip of the whole text removes taken off the first tokens'."""
        out = [self.token_bytes[i] for i in ids]
        first = next((k for k, i in enumerate(ids) if i not in self.special and self.token_strings[i] is not None),
                     None)
        if first is not None:
            out[first] = self.first_bytes(ids[first])
        char, n = self.decoding.strip_text
        c = char.encode() if char else b""
        k = 0
        while n > 0 and c and k < len(out):
            while n > 0 and out[k].startswith(c):
                out[k] = out[k][len(c):]
                n -= 1
            if out[k]:
                break
            k += 1
        return out

    def decode_text(self, ids: Sequence[int]) -> str:
        """The text of ids from its start, as the tokenizer's own `decode` writes it (special tokens skipped)."""
        return b"".join(self.text_bytes(ids)).decode("utf-8", "replace")

    def pieces(self, ids: Sequence[int], *, start: bool = True) -> list[str]:
        """One string per id whose join is exactly `decode_text(ids)` (`decode(ids)` when not `start`): a token
        that ends inside a multi-byte character gives what it completes of the text so far, the rest comes with
        the token that completes it (incremental UTF-8 decoding)."""
        parts = self.text_bytes(ids) if start else [self.token_bytes[i] for i in ids]
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        out = [dec.decode(b) for b in parts]
        tail = dec.decode(b"", final=True)
        if tail:
            out[-1] += tail
        return out

    def display(self, i: int) -> str:
        """vocab.txt's line for id i: the token string, or `<|id:i|>` for an id the tokenizer does not name (or
        names with an empty or multi-line string, or a string an earlier id has)."""
        return self._display[i] if 0 <= i < self.vocab_size else PLACEHOLDER.format(i)

    def describe(self) -> dict[str, Any]:
        """`{"type": "tokenizer.json", "sha256", "vocab_size", "decoder"}` (GET /v1/models)."""
        return {"type": TOKENIZER_FILE, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "decoder": self.decoding.kind}

    # -- the check against the library ------------------------------------------------------------------------
    def _check(self, error: type[Exception], source: str) -> None:
        """Every id decoded alone (as a text's first token) and after an anchor token, by `tokenizers` and here,
        must agree; `error` naming `tokenizer` (and the first id that differs) otherwise. 2 V decodes."""
        ids = [i for i in range(self.vocab_size) if self.token_strings[i] is not None]
        if not ids:
            raise error(f"tokenizer: {source} has an empty vocabulary", param="tokenizer")
        anchor = next((i for i in ids if i not in self.special and self.decode_text([i]).isalpha()
                       and self.decode_text([i]).isascii()), None)
        if anchor is None:
            raise error(f"tokenizer: {source}: no plain ASCII token to check its decoding with", param="tokenizer")
        alone = self.hf.decode_batch([[i] for i in ids], skip_special_tokens=True)
        after = self.hf.decode_batch([[anchor, i] for i in ids], skip_special_tokens=True)
        lead = b"".join(self.text_bytes([anchor]))  # non-empty letters: nothing after it is stripped
        plain = self.decoding.metaspace_first is None and not self.decoding.strip_text[1]
        for i, a, b in zip(ids, alone, after, strict=True):
            mine = (self.token_bytes[i] if plain else b"".join(self.text_bytes([i]))).decode("utf-8", "replace")
            if a != mine or b != (lead + self.token_bytes[i]).decode("utf-8", "replace"):
                raise error(f"tokenizer: {source}: the decoding of token {i} ({self.token_strings[i]!r}) cannot be "
                            f"reproduced exactly ({a!r} / {b!r} by the tokenizer, {self.decode_text([i])!r} / "
                            f"{self.decode_text([anchor, i])!r} token by token)"[:500], param="tokenizer")


CACHE_SIZE = 16  # tokenizers kept read in a process (GPT-2-sized: ~7 MB of Python objects, ~1 s to read and check)
_CACHE: dict[tuple[str, type], TextTokenizer] = {}


# -- writing a model over a tokenizer ------------------------------------------------------------------------------
def as_text_tokenizer(tok: Any) -> TextTokenizer:
    """A TextTokenizer from itself, a `tokenizers.Tokenizer`, a `transformers` fast tokenizer, or a path to a
    tokenizer.json or a save_pretrained directory."""
    if isinstance(tok, TextTokenizer):
        return tok
    if isinstance(tok, str | Path):
        p = Path(tok)
        return TextTokenizer.from_pretrained_dir(p) if p.is_dir() else TextTokenizer.from_file(p, error=InputError)
    return TextTokenizer.from_hf(tok)


def tokenizer_files(tok: Any) -> dict[str, bytes]:
    """The extra file a model store over `tok` carries: `{"tokenizer.json": bytes}` (for `save_artifact`'s
    `extra_files`)."""
    return {TOKENIZER_FILE: as_text_tokenizer(tok).to_json_bytes()}


def vocab_for(tok: Any, V: int | None = None, eos: str | int | None = None, *, add_eos: bool = True) -> Vocabulary:
    """The `Vocabulary` of a model over `tok`'s ids: V entries (default: the tokenizer's vocab_size; more pads with
    placeholders), preprocessing `{"tokenizer": "tokenizer.json", "eos": <eos token string>, "unk": None, "add_eos",
    "lowercase": False}`. `eos`: its token string or id (default: the tokenizer's only special token, if one).
    InputError naming `eos` / `V` when they do not fit."""
    t = as_text_tokenizer(tok)
    V = t.vocab_size if V is None else V
    if V < t.vocab_size:
        raise InputError(f"V: {V} is below the tokenizer's vocabulary size {t.vocab_size}", param="V")
    if isinstance(eos, int) and not isinstance(eos, bool):
        if not 0 <= eos < t.vocab_size or t.token_strings[eos] is None:
            raise InputError(f"eos: id {eos} is not a token of the tokenizer", param="eos")
        eos = t.token_strings[eos]
    if eos is None:
        specials = sorted(t.special)
        if len(specials) != 1:
            raise InputError(f"eos: name the end-of-text token (the tokenizer has {len(specials)} special tokens)",
                             param="eos")
        eos = t.token_strings[specials[0]]
    eid = t.hf.token_to_id(eos)
    if eid is None or t.display(eid) != eos:
        raise InputError(f"eos: {eos!r} is not a token of the tokenizer", param="eos")
    pre = Preprocessing(lowercase=False, unk=None, eos=eos, add_eos=add_eos, tokenizer=TOKENIZER_FILE)
    return Vocabulary([t.display(i) for i in range(V)], pre, tokenizer=t)
