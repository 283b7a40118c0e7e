"""The `ngram` family (ARPA backoff models): a hand-computed bigram, an absolutely discounted trigram estimated
here and checked against the direct interpolation formula and a dict-based backoff scorer, batching,
normalisation, artifact validation, malformed ARPA files, `latentlm import-arpa` and the service's /v1/score."""

from __future__ import annotations

import json
import math
import random
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from latentlm import ops
from latentlm.cli import main
from latentlm.cli.imports import import_file
from latentlm.models.base import Batch
from latentlm.models.errors import ArtifactError, UnsupportedOperation
from latentlm.models.ngram import ArpaError, NGramLM, parse_arpa, read_arpa, validate
from latentlm.models.registry import load_artifact

LOG10 = math.log(10)

# p(</s>)=.5 p(a)=.4 p(<unk>)=.1; p(a|<s>)=.6 so b(<s>)=.4/.6; p(</s>|a)=.7 so b(a)=.3/.5
HAND_BIGRAM = f"""
\\data\\
ngram 1=4
ngram 2=2

\\1-grams:
{math.log10(.1)!r}\t<unk>
-99\t<s>\t{math.log10(.4 / .6)!r}
{math.log10(.5)!r}\t</s>
{math.log10(.4)!r}\ta\t{math.log10(.3 / .5)!r}

\\2-grams:
{math.log10(.6)!r}\t<s> a
{math.log10(.7)!r}\ta </s>

\\end\\
"""


def import_arpa(path, name, store, **options):
    """`latentlm import-arpa` as a function: the family's declared importer, checked and stored."""
    return import_file(NGramLM, NGramLM.importers[0], path, name, store, **options)


# -- an independent estimator and a dict-based reference scorer ------------------------------------------
def estimate(sents: list[list[str]], order: int, vocab: list[str], D: float = 0.5):
    """Interpolated absolute discounting from counts. Returns (prob(h, w) by the direct recursive
    formula, ARPA text holding the same model in backoff form)."""
    pred = vocab + ["</s>"]  # predictable words (<unk> included, possibly unseen)
    counts: Counter[tuple[str, ...]] = Counter()
    for s in sents:
        padded = ["<s>"] + s + ["</s>"]
        for n in range(1, order + 1):
            for i in range(len(padded) - n + 1):
                g = tuple(padded[i: i + n])
                if g != ("<s>",) and (n == 1 or "<s>" not in g[1:]):
                    counts[g] += 1
    ctx_total: Counter[tuple[str, ...]] = Counter()
    ctx_types: Counter[tuple[str, ...]] = Counter()
    for g, c in counts.items():
        ctx_total[g[:-1]] += c
        ctx_types[g[:-1]] += 1

    def prob(h: tuple[str, ...], w: str) -> float:
        if not h:
            tot = ctx_total[()]
            return max(counts[(w,)] - D, 0) / tot + D * ctx_types[()] / tot / len(pred)
        if ctx_total[h] == 0:
            return prob(h[1:], w)
        tot = ctx_total[h]
        return max(counts[h + (w,)] - D, 0) / tot + D * ctx_types[h] / tot * prob(h[1:], w)

    def backoff(h: tuple[str, ...]) -> float:
        """The interpolation weight: (1 - sum_seen p(w|h)) / (1 - sum_seen p(w|h[1:])) simplifies to it."""
        return D * ctx_types[h] / ctx_total[h] if ctx_total[h] else 1.0

    grams = {n: sorted(g for g in counts if len(g) == n) for n in range(1, order + 1)}
    grams[1] = sorted(set(grams[1]) | {(w,) for w in pred})
    lines = ["\\data\\"] + [f"ngram {n}={len(grams[n]) + (n == 1)}" for n in grams]
    for n in range(1, order + 1):
        lines += ["", f"\\{n}-grams:"]
        if n == 1:
            lines.append("-99\t<s>" + (f"\t{math.log10(backoff(('<s>',)))!r}" if order > 1 else ""))
        for g in grams[n]:
            row = f"{math.log10(prob(g[:-1], g[-1]))!r}\t{' '.join(g)}"
            if n < order and g[-1] != "</s>":
                row += f"\t{math.log10(backoff(g))!r}"
            lines.append(row)
    lines += ["", "\\end\\", ""]
    return prob, "\n".join(lines)


def arpa_dict(text: str) -> tuple[dict[tuple[str, ...], tuple[float, float]], int]:
    """{n-gram: (log10 p, log10 backoff)} and the order, read naively."""
    table, order = {}, 0
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("\\") or parts[0].startswith("ngram"):
            if parts and parts[0].endswith("-grams:"):
                order = int(parts[0][1:].split("-")[0])
            continue
        words = tuple(parts[1: order + 1])
        table[words] = (float(parts[0]), float(parts[order + 1]) if len(parts) > order + 1 else 0.0)
    return table, order


def brute_logprob(table, order: int, sent: list[str]) -> list[float]:
    """Natural-log p(w_t | history) for sent + </s>, by the textbook backoff recursion."""
    def rec(h: tuple[str, ...], w: str) -> float:
        if h + (w,) in table:
            return table[h + (w,)][0]
        return table.get(h, (0.0, 0.0))[1] + rec(h[1:], w)

    hist, out = ["<s>"], []
    for w in sent + ["</s>"]:
        out.append(rec(tuple(hist[-(order - 1):]) if order > 1 else (), w) * LOG10)
        hist.append(w)
    return out


VOCAB = ["a", "b", "c", "d", "<unk>"]


def random_corpus(seed: int, n: int = 40) -> list[list[str]]:
    rng = random.Random(seed)
    weights = [5, 3, 2, 1, 1]
    return [rng.choices(VOCAB, weights, k=rng.randint(1, 6)) for _ in range(n)]


@pytest.fixture(scope="module")
def trigram(tmp_path_factory):
    """(store, prob, ARPA text) of an absolutely discounted trigram imported as `tri`."""
    tmp = tmp_path_factory.mktemp("ngram")
    prob, text = estimate(random_corpus(0), 3, VOCAB)
    (tmp / "tri.arpa").write_text(text)
    import_arpa(tmp / "tri.arpa", "tri", tmp / "store")
    return tmp / "store", prob, text


def score_texts(store: Path, name: str, texts: list[str], dtype: str = "float64") -> list[dict]:
    model = ops.load_model(store, name, dtype=dtype)
    return ops.run(model, "score", ops.encode_inputs(model.vocab, texts), token_logprobs=True)


# -- exact scores ----------------------------------------------------------------------------------------
def test_hand_computed_bigram(tmp_path):
    (tmp_path / "bi.arpa").write_text(HAND_BIGRAM)
    import_arpa(tmp_path / "bi.arpa", "bi", tmp_path)
    r = score_texts(tmp_path, "bi", ["a a", "a", "zzz"])
    assert r[0]["tokens"] == ["a", "a", "<eos>"]
    assert r[0]["token_logprobs"] == pytest.approx([math.log(.6), math.log(.3 / .5 * .4), math.log(.7)], abs=1e-12)
    assert r[0]["logprob"] == pytest.approx(math.log(.6 * (.3 / .5 * .4) * .7), abs=1e-12)
    assert r[0]["perplexity"] == pytest.approx(math.exp(-r[0]["logprob"] / 3))
    assert r[1]["logprob"] == pytest.approx(math.log(.6 * .7), abs=1e-12)
    # an unknown word is <unk>: p(<unk>|<s>) = b(<s>) p(<unk>), then p(</s>|<unk>) = p(</s>)
    assert r[2]["tokens"] == ["<unk>", "<eos>"]
    assert r[2]["logprob"] == pytest.approx(math.log(.4 / .6 * .1 * .5), abs=1e-12)


def test_trigram_matches_interpolation_formula_and_backoff_reference(trigram):
    store, prob, text = trigram
    table, order = arpa_dict(text)
    rng = random.Random(1)
    sents = [rng.choices(VOCAB, k=rng.randint(1, 9)) for _ in range(30)] + [["d", "d", "d", "d"], ["<unk>"]]
    res = score_texts(store, "tri", [" ".join(s) for s in sents])
    for s, r in zip(sents, res, strict=True):
        hist = ["<s>"] + s
        direct = [math.log(prob(tuple(hist[max(0, t - 1): t + 1]), w)) for t, w in enumerate(s + ["</s>"])]
        assert r["token_logprobs"] == pytest.approx(direct, abs=1e-9)
        assert r["token_logprobs"] == pytest.approx(brute_logprob(table, order, s), abs=1e-9)
        assert r["logprob"] == pytest.approx(math.fsum(direct), abs=1e-8)


@pytest.mark.parametrize("order", [1, 2, 4])
def test_other_orders_match_interpolation_formula(tmp_path, order):
    prob, text = estimate(random_corpus(order), order, VOCAB)
    (tmp_path / "m.arpa").write_text(text)
    import_arpa(tmp_path / "m.arpa", "m", tmp_path)
    rng = random.Random(order)
    sents = [rng.choices(VOCAB, k=rng.randint(1, 9)) for _ in range(20)]
    for s, r in zip(sents, score_texts(tmp_path, "m", [" ".join(s) for s in sents]), strict=True):
        hist = ["<s>"] + s
        direct = [math.log(prob(tuple(hist[max(0, t + 2 - order): t + 1]) if order > 1 else (), w))
                  for t, w in enumerate(s + ["</s>"])]
        assert r["token_logprobs"] == pytest.approx(direct, abs=1e-9)
    d = ops.load_model(tmp_path, "m").describe()
    assert d["family"] == "ngram" and d["order"] == order and d["operations"] == ["score"]


def test_float32_scores_close_to_float64(trigram):
    store = trigram[0]
    a = score_texts(store, "tri", ["a b c d", "b b"], dtype="float32")
    b = score_texts(store, "tri", ["a b c d", "b b"], dtype="float64")
    for x, y in zip(a, b, strict=True):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(trigram):
    seqs = [[0, 1, 2, 3, 4, 5], [2, 2], [5, 1, 0]]
    cpu = ops.run(ops.load_model(trigram[0], "tri", dtype="float64"), "score", seqs, token_logprobs=True)
    gpu = ops.run(ops.load_model(trigram[0], "tri", device="cuda", dtype="float64"), "score", seqs,
                  token_logprobs=True)
    for a, b in zip(cpu, gpu, strict=True):
        assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=6))
def test_batch_equals_one_at_a_time(trigram, seqs):
    model = ops.load_model(trigram[0], "tri", dtype="float64").impl
    logp, cond = model.score(Batch.from_lists(seqs))
    for i, s in enumerate(seqs):
        lp1, c1 = model.score(Batch.from_lists([s]))
        assert float(logp[i]) == pytest.approx(float(lp1[0]), abs=1e-12)
        assert cond[i, : len(s)].tolist() == pytest.approx(c1[0].tolist(), abs=1e-12)
        assert bool((cond[i, len(s):] == 0).all())


def test_context_restarts_after_eos(trigram):
    """Several sentences in one sequence score as the product of the sentences."""
    model = ops.load_model(trigram[0], "tri", dtype="float64")
    enc = model.vocab.encode
    both = enc("a b") + enc("c a d")
    lp = ops.run(model, "score", [both, enc("a b"), enc("c a d")])
    assert lp[0]["logprob"] == pytest.approx(lp[1]["logprob"] + lp[2]["logprob"], abs=1e-10)


@pytest.mark.parametrize("context", [[], ["a"], ["b", "c"], ["d", "d"], ["c", "<unk>", "a"], ["a", "b", "a"]])
def test_conditionals_sum_to_one(trigram, context):
    model = ops.load_model(trigram[0], "tri", dtype="float64")
    V = len(model.vocab)
    prefix = [model.vocab.index[w] for w in context]
    seqs = [prefix + [w] for w in range(V)]
    _, cond = model.impl.score(Batch.from_lists(seqs))
    last = cond[torch.arange(V), len(prefix)]
    assert float(last.exp().sum()) == pytest.approx(1.0, abs=1e-10)


# -- artifact --------------------------------------------------------------------------------------------
def test_artifact_layout_and_preprocessing(trigram):
    from latentlm.training.data import PTB_PREPROCESSING

    art = load_artifact(trigram[0] / "tri")
    assert art.family == "ngram" and art.vocab.preprocessing == PTB_PREPROCESSING
    assert "<s>" not in art.vocab.index and art.vocab.tokens.count("<eos>") == 1
    cfg = art.config
    assert cfg["order"] == 3 and cfg["num_words"] == len(art.vocab) + 1 and cfg["bos_id"] == len(art.vocab)
    assert all(bool((art.tensors[f"keys_{n}"].diff() > 0).all()) for n in (2, 3))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.__setitem__("keys_3", t["keys_3"].flip(0)), "not strictly increasing"),
    (lambda t: t["logprob_2"].__setitem__(0, 0.5), "log-probability > 0"),
    (lambda t: t["logprob_2"].__setitem__(0, float("nan")), "finite"),
    (lambda t: t["unigram_logprob"].__setitem__(0, -9.0), "unigram distribution sums to"),
    (lambda t: t["logprob_3"].__setitem__(3, t["logprob_3"][3] - 1), "sums to"),
    (lambda t: t["backoff_2"].__setitem__(2, t["backoff_2"][2] + 1), "sums to"),
    (lambda t: t.__setitem__("keys_2", t["keys_2"] + 10**9), "outside"),
    (lambda t: t.pop("backoff_2"), "missing"),
    (lambda t: t.__setitem__("logprob_3", t["logprob_3"][:-1]), "shape"),
])
def test_bad_artifacts_are_refused(trigram, edit, match):
    art = load_artifact(trigram[0] / "tri")
    tensors = {k: v.clone() for k, v in art.tensors.items()}
    validate(tensors, art.config, len(art.vocab), "w")  # the original passes
    edit(tensors)
    with pytest.raises(ArtifactError, match=match):
        validate(tensors, art.config, len(art.vocab), "w")


def test_unk_token_renaming(tmp_path):
    """KenLM style: the corpus' <unk> renamed to _unk_; the ARPA <unk> stays in the unigram mass only."""
    sents = [[w.replace("<unk>", "_unk_") for w in s] for s in random_corpus(3)]
    prob, text = estimate(sents, 2, ["a", "b", "c", "d", "_unk_", "<unk>"])
    (tmp_path / "k.arpa").write_text(text)
    import_arpa(tmp_path / "k.arpa", "k", tmp_path, unk_token="_unk_")
    art = load_artifact(tmp_path / "k")
    assert "_unk_" not in art.vocab.index and art.config["num_words"] == len(art.vocab) + 2
    r = score_texts(tmp_path, "k", ["a zzz <unk>"])[0]
    expect = [prob(("<s>",), "a"), prob(("a",), "_unk_"), prob(("_unk_",), "_unk_"), prob(("_unk_",), "</s>")]
    assert r["token_logprobs"] == pytest.approx([math.log(p) for p in expect], abs=1e-9)


# -- malformed ARPA --------------------------------------------------------------------------------------
def mangle(old: str, new: str) -> str:
    assert old in HAND_BIGRAM
    return HAND_BIGRAM.replace(old, new, 1)


@pytest.mark.parametrize("text,match", [
    ("hello\n", "expected '\\\\data\\\\'"),
    ("", "no '\\\\data\\\\' header"),
    (mangle("ngram 2=2", "ngram 2=3"), "header says 3 2-grams"),
    (mangle("ngram 2=2", "ngram 3=2"), "bad count line"),
    (mangle("\\end\\", ""), "missing '\\\\end\\\\'"),
    (mangle("\\2-grams:", "\\3-grams:"), "expected '\\\\2-grams:'"),
    (mangle("\ta </s>", "\ta b"), "word 'b' is not a unigram"),
    (mangle("\ta </s>", "\ta"), "expected 3 fields"),
    (mangle("\ta </s>", "\ta </s>\t-0.5"), "expected 3 fields"),
    (mangle("-99\t<s>", "x\t<s>"), "not a number"),
    (mangle("-99\t<s>", "nan\t<s>"), "not finite"),
    (mangle("-99\t<s>", "0.5\t<s>"), "> 0"),
    (mangle("\ta\t", "\t<unk>\t"), "duplicate unigram"),
])
def test_malformed_arpa(tmp_path, text, match):
    with pytest.raises(ArpaError, match=match):
        parse_arpa(text.splitlines(), name="x.arpa")


@pytest.mark.parametrize("text,match", [
    (mangle("-99\t<s>", "-99\t<S>").replace("<s> a", "<S> a"), "no '<s>'"),
    (mangle("</s>\n", "<eos>\n").replace("a </s>", "a <eos>"), "no '</s>'"),
    (mangle("ngram 2=2", "ngram 2=3").replace("\ta </s>", "\ta </s>\n-0.1\ta </s>"), "duplicate 2-gram"),
    (HAND_BIGRAM.replace(f"{math.log10(.6)!r}", "-0.1"), "sums to"),  # p(a|<s>) changed, b(<s>) not
])
def test_arpa_that_parses_but_is_refused(tmp_path, text, match):
    (tmp_path / "x.arpa").write_text(text)
    with pytest.raises((ArpaError, ArtifactError), match=match):
        import_arpa(tmp_path / "x.arpa", "x", tmp_path / "store")
    assert not (tmp_path / "store" / "x").exists()


def test_missing_prefix_is_refused(tmp_path):
    prob, text = estimate(random_corpus(0), 3, VOCAB)
    tri = next(ln for ln in text.splitlines() if ln.count(" ") == 2 and "<s>" not in ln)
    a, b, _ = tri.split("\t")[1].split()
    lines = [ln for ln in text.splitlines() if not (ln.endswith(f"\t{a} {b}") or f"\t{a} {b}\t" in ln)]
    n2 = sum(1 for ln in lines if len(ln.split("\t")) > 1 and ln.split("\t")[1].count(" ") == 1)
    lines = [f"ngram 2={n2}" if ln.startswith("ngram 2=") else ln for ln in lines]
    (tmp_path / "x.arpa").write_text("\n".join(lines))
    with pytest.raises(ArpaError, match="has no 2-gram for its first 2 words"):
        read_arpa(tmp_path / "x.arpa")


# -- CLI and service -------------------------------------------------------------------------------------
def test_import_arpa_cli_round_trip(tmp_path, capsys):
    (tmp_path / "bi.arpa").write_text(HAND_BIGRAM)
    store = str(tmp_path / "store")
    assert main(["import-arpa", str(tmp_path / "bi.arpa"), "--name", "bi", "--store", store]) == 0
    assert "imported bi" in capsys.readouterr().err
    (tmp_path / "in.txt").write_text("a a\na\n")
    assert main(["score", "--model", "bi", "--store", store, "--dtype", "float64", "--token-logprobs",
                 str(tmp_path / "in.txt")]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert rows[1]["logprob"] == pytest.approx(math.log(.6 * .7), abs=1e-12) and rows[1]["tokens"] == ["a", "<eos>"]
    assert main(["decode", "--model", "bi", "--store", store, str(tmp_path / "in.txt")]) == 2
    assert "does not support 'decode'" in capsys.readouterr().err
    # refusing to overwrite, then a malformed file: one line, exit 2, nothing written
    assert main(["import-arpa", str(tmp_path / "bi.arpa"), "--name", "bi", "--store", store]) == 2
    assert "already exists" in capsys.readouterr().err
    (tmp_path / "bad.arpa").write_text(mangle("ngram 2=2", "ngram 2=5"))
    assert main(["import-arpa", str(tmp_path / "bad.arpa"), "--name", "bad", "--store", store]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "header says 5 2-grams" in err and not (tmp_path / "store" / "bad").exists()
    assert main(["import-arpa", str(tmp_path / "bi.arpa"), "--name", "b2", "--store", store,
                 "--unk-token", "zz"]) == 2
    assert "no 'zz'" in capsys.readouterr().err


def test_eval_path(trigram, tmp_path):
    from latentlm.training.settings import corpus_perplexity

    store, prob, _ = trigram
    (tmp_path / "t.txt").write_text("a b\n\nc d a\n")
    res = corpus_perplexity(store, "tri", str(tmp_path / "t.txt"), dtype="float64")
    logp = sum(math.log(prob(h, w)) for h, w in [(("<s>",), "a"), (("<s>", "a"), "b"), (("a", "b"), "</s>"),
                                                  (("<s>",), "c"), (("<s>", "c"), "d"), (("c", "d"), "a"),
                                                  (("d", "a"), "</s>")])
    assert res["num_tokens"] == 7 and res["logprob"] == pytest.approx(logp, abs=1e-9)


def test_unsupported_operations_raise(trigram):
    impl = ops.load_model(trigram[0], "tri").impl
    with pytest.raises(UnsupportedOperation):
        impl.op_decode([[0]])
    with pytest.raises(UnsupportedOperation):
        impl.op_sample(n=1, max_tokens=2, seed=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_service_scores_and_rejects_decode(trigram, tmp_path):
    from fastapi.testclient import TestClient

    from latentlm.service.app import create_app
    from latentlm.service.settings import Settings

    store, prob, _ = trigram
    app = create_app(Settings(store=store, device="cpu", dtype="float64", state_dir=tmp_path))
    with TestClient(app) as c:
        for _ in range(2400):  # loading warms up the numba kernels: seconds, more on a loaded machine
            if c.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert c.get("/ready").status_code == 200, "service not ready after 120 s"
        r = c.post("/v1/score", json={"model": "tri", "input": ["a b"], "token_logprobs": True})
        assert r.status_code == 200, r.text
        item = r.json()["data"][0]
        expect = math.log(prob(("<s>",), "a") * prob(("<s>", "a"), "b") * prob(("a", "b"), "</s>"))
        assert item["logprob"] == pytest.approx(expect, abs=1e-9)
        assert c.post("/v1/decode", json={"model": "tri", "input": ["a b"]}).status_code == 400

