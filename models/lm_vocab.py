"""The vocabulary of an HMM over a language model's token ids (`notes/tokenizer_contract`): `vocab.txt` line i is
the tokenizer's token i, the manifest's preprocessing names `tokenizer.json`, stored beside the weights.

Used by `latentlm distill` (training) and `latentlm import-ctrlg` (models.ctrlg). Reads the tokenizer with the
`tokenizers` library (imported when called)."""

from __future__ import annotations

from pathlib import Path

from latentlm.models.errors import InputError
from latentlm.models.vocab import Preprocessing, Vocabulary

TOKENIZER_FILE = "tokenizer.json"


def placeholder(i: int) -> str:
    """The `vocab.txt` line of an id the tokenizer does not name (or names with an empty or multi-line string)."""
    return f"<|id:{i}|>"


def read_tokenizer_json(path: Path, *, param: str) -> bytes:
    """The bytes of `tokenizer.json` in a `save_pretrained` directory, or of that file given directly; raises
    InputError naming `param` when there is none or it is not a tokenizer the `tokenizers` library reads."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not path.exists():
        raise InputError(f"{param}: {path}: no such directory", param=param)
    if not file.is_file():
        raise InputError(f"{param}: {path}: no {TOKENIZER_FILE} (a fast tokenizer's save_pretrained directory)",
                         param=param)
    data = file.read_bytes()
    parse_tokenizer(data, where=f"{param}: {file}", param=param)
    return data


def parse_tokenizer(data: bytes, *, where: str, param: str):
    """`tokenizers.Tokenizer` from JSON bytes; InputError naming `param` when unreadable."""
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - installed with the [distill] / [test] extras
        raise InputError(f"{where}: reading a tokenizer needs the `tokenizers` package "
                         "(pip install 'latentlm[distill]')", param=param) from None
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the library raises a plain Exception on bad JSON
        raise InputError(f"{where}: not a tokenizers JSON file ({str(e).splitlines()[0] if str(e) else e})",
                         param=param) from None


def lm_vocabulary(tokenizer_json: bytes, vocab_size: int, eos_id: int | None, *, where: str = "tokenizer",
                  param: str = "tokenizer") -> Vocabulary:
    """Vocabulary of `vocab_size` ids (the LM's output size): line i = `id_to_token(i)`, or `placeholder(i)` for an
    id the tokenizer lacks, names with an empty or multi-line string, or names twice; preprocessing per the
    contract (`tokenizer.json`, eos = the token of `eos_id`, add_eos when there is one, no unk, no lowercasing).
    O(V)."""
    tok = parse_tokenizer(tokenizer_json, where=where, param=param)
    tokens: list[str] = []
    seen: set[str] = set()
    for i in range(vocab_size):
        t = tok.id_to_token(i)
        if not t or "\n" in t or "\r" in t or t in seen:
            t = placeholder(i)
        seen.add(t)
        tokens.append(t)
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise InputError(f"{where}: eos id {eos_id} is outside the vocabulary [0, {vocab_size})", param="eos_token_id")
    eos = tokens[eos_id] if eos_id is not None else None
    pre = Preprocessing(lowercase=False, unk=None, eos=eos, add_eos=eos is not None, tokenizer=TOKENIZER_FILE)
    return Vocabulary(tokens, pre)
