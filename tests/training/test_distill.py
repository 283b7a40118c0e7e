"""`latentlm distill` end to end on a tiny GPT-2 trained here (tests/training/tiny_lm.py), and its parts against
brute force: the E-step's expected counts (every state path enumerated), LVD's counts, k-means (scikit-learn's),
the hidden states (one forward pass per sample), EM's monotone objective, resumable sample shards; and
`--family blocked_hmm` (the neural trainer over Brown clusters of the token ids) on the same samples."""

from __future__ import annotations

import hashlib
import itertools
import json
import math

import numpy as np
import pytest
import torch

from latentlm import ops
from latentlm.cli import main
from latentlm.models.base import Batch
from latentlm.training import distill_sampling as sampling
from latentlm.training.distill_em import Counts, Params, accumulate, m_step, perplexity, random_params, sample_batches
from latentlm.training.distill_init import kmeans, lvd_counts

transformers = pytest.importorskip("transformers")  # the [distill] / [test] extras

from tests.training.tiny_lm import make_lm  # noqa: E402

QUIET = ["--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def distilled(lm_dir, tmp_path_factory):
    """The store after `latentlm distill` with LVD, Z=8, L=8, 400 samples in shards of 100, 3 EM steps."""
    store = tmp_path_factory.mktemp("store")
    rc = main(["distill", "--lm", str(lm_dir), "--name", "d", "--store", str(store), "--states", "8", "--samples",
               "400", "--max-length", "8", "--em-steps", "3", "--shard-size", "100", "--seed", "1", *QUIET])
    assert rc == 0
    return store


def lm_samples(lm_dir, n: int, L: int, seed: int) -> list[list[int]]:
    """Fresh samples of the LM, drawn here (plain `generate`, cut after the first EOS)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    eos = model.config.eos_token_id
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.full((n, 1), eos), attention_mask=torch.ones(n, 1, dtype=torch.long),
                             do_sample=True, top_k=0, max_new_tokens=L, pad_token_id=eos)
    seqs = []
    for row in out[:, 1:].tolist():
        seqs.append(row[: row.index(eos) + 1] if eos in row else row)
    return seqs


def manifest(store, name: str) -> dict:
    return json.loads((store / name / "manifest.json").read_text())


def test_distilled_model_beats_a_unigram_on_fresh_lm_samples(distilled, lm_dir):
    model = ops.load_model(distilled, "d")
    fresh = lm_samples(lm_dir, 300, 8, seed=12345)
    hmm_ll = sum(r["logprob"] for r in ops.run(model, "score", fresh))
    tokens = sum(len(s) for s in fresh)
    # the add-one unigram of the same training samples
    work = distilled / ".distill" / "d" / "samples"
    (key,) = list(work.iterdir())
    train = np.concatenate([np.load(p) for p in sorted((key / "train").glob("shard-*.npy"))])
    assert train.shape == (400, 8)
    counts = np.bincount(train[train >= 0], minlength=len(model.vocab)) + 1.0
    uni_ll = float(np.log(counts / counts.sum())[np.concatenate(fresh)].sum())
    hmm_ppl, uni_ppl = math.exp(-hmm_ll / tokens), math.exp(-uni_ll / tokens)
    assert hmm_ppl < 0.8 * uni_ppl, (hmm_ppl, uni_ppl)


def test_store_carries_the_tokenizer_and_records_the_lm(distilled, lm_dir):
    m = manifest(distilled, "d")
    assert m["family"] == "hmm" and m["config"] == {"num_states": 8}
    assert m["preprocessing"] == {"lowercase": False, "unk": None, "eos": "<|endoftext|>", "add_eos": True,
                                  "tokenizer": "tokenizer.json"}
    assert (distilled / "d" / "tokenizer.json").read_bytes() == (lm_dir / "tokenizer.json").read_bytes()
    assert {"curve.png", "curve.json", "tokenizer.json"} <= set(m["files"])
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    lines = (distilled / "d" / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert lines == [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    p = m["provenance"]
    sha = lambda name: hashlib.sha256((lm_dir / name).read_bytes()).hexdigest()  # noqa: E731
    assert p["lm"]["dir"] == str(lm_dir.resolve())
    assert p["lm"]["config_sha256"] == sha("config.json") and p["lm"]["tokenizer_sha256"] == sha("tokenizer.json")
    assert (p["samples"], p["valid_samples"], p["max_length"], p["seed"], p["init"], p["em_steps"],
            p["pseudocount"], p["world_size"]) == (400, 100, 8, 1, "lvd", 3, 0.1, 1)
    assert p["sampling"]["tokens_per_s"] > 0 and p["em_step_seconds"] > 0
    curve = json.loads((distilled / "d" / "curve.json").read_text())
    assert [r["iteration"] for r in curve["rows"]] == [0, 1, 2, 3]
    assert curve["rows"][-1]["valid_ppl"] < curve["unigram_valid_ppl"]
    # MAP-EM: the objective (log-likelihood + log prior of the pseudocount) never decreases
    obj = [r["objective_per_token"] for r in curve["rows"][1:]]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(obj)), obj
    text = ops.load_model(distilled, "d").vocab
    assert text.encode("the dog") == tok("the dog")["input_ids"] + [tok.eos_token_id]


def test_a_rerun_reuses_complete_shards_and_draws_what_an_uninterrupted_run_draws(lm_dir, tmp_path, capsys):
    """A run of 100 samples (shards of 40: 40, 40, 20), then one of 120: shards 0 and 1 are reused as they are,
    shard 2 drawn again at full size; the samples equal those of one uninterrupted run of 120."""
    def run(work, n, steps="0"):
        args = ["distill", "--lm", str(lm_dir), "--name", "r", "--store", str(tmp_path / "store"), "--states", "4",
                "--samples", str(n), "--valid-samples", "10", "--max-length", "6", "--shard-size", "40", "--init",
                "random", "--em-steps", steps, "--work-dir", str(work), *QUIET]
        assert main(args) == 0
        (key,) = list((work / "samples").iterdir())
        return key / "train"

    first = run(tmp_path / "w1", 100)
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    capsys.readouterr()
    again = run(tmp_path / "w1", 120, steps="1")
    err = capsys.readouterr().err
    assert "3 shard(s) reused, 1 drawn" in err  # train 0, 1 and the valid shard reused; train 2 drawn again
    assert all(before[f"shard-0000{i}.npy"] == (again / f"shard-0000{i}.npy").stat().st_mtime_ns for i in (0, 1))
    assert np.load(again / "shard-00002.npy").shape == (40, 6)
    fresh = run(tmp_path / "w2", 120)
    for i in range(3):
        assert np.array_equal(np.load(again / f"shard-0000{i}.npy"), np.load(fresh / f"shard-0000{i}.npy"))
    assert not list(again.glob(".*tmp"))  # shards are written atomically


def test_em_continues_from_its_checkpoint_as_an_uninterrupted_run(lm_dir, tmp_path, capsys):
    """1 EM step, then a rerun asking for 3: it continues after step 1 and writes the model 3 uninterrupted steps
    write, bit for bit."""
    from safetensors.torch import load_file

    def run(steps: str, name: str):
        assert main(["distill", "--lm", str(lm_dir), "--name", name, "--store", str(tmp_path), "--states", "4",
                     "--samples", "60", "--valid-samples", "10", "--max-length", "6", "--em-steps", steps,
                     "--work-dir", str(tmp_path / "work"), *QUIET]) == 0
        return load_file(str(tmp_path / name / "weights.safetensors"))

    run("1", "a")
    capsys.readouterr()
    resumed = run("3", "a")
    assert "continuing from the checkpoint after step 1" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "work" / "em").glob("params-*")] == ["params-00003.safetensors"]
    for f in (tmp_path / "work" / "em").iterdir():
        f.unlink()
    fresh = run("3", "b")
    assert all(torch.equal(resumed[k], fresh[k]) for k in ("start", "trans", "emit"))
    assert manifest(tmp_path, "a")["provenance"]["em_steps"] == 3


def brute_counts(p: Params, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Expected start / transition / emission (V, Z) counts and log-likelihood by enumerating every state path."""
    start, trans, emit = (t.double().numpy() for t in (p.start, p.trans, p.emit_by_word))
    Z, V = trans.shape[0], emit.shape[0]
    cs, ct, ce, ll = np.zeros(Z), np.zeros((Z, Z)), np.zeros((V, Z)), 0.0
    for x in seqs:
        paths = list(itertools.product(range(Z), repeat=len(x)))
        w = np.array([start[z[0]] * np.prod([trans[a, b] for a, b in itertools.pairwise(z)])
                      * np.prod([emit[xt, zt] for xt, zt in zip(x, z, strict=True)]) for z in paths])
        px = w.sum()
        ll += math.log(px)
        for z, wz in zip(paths, w / px, strict=True):
            cs[z[0]] += wz
            for a, b in itertools.pairwise(z):
                ct[a, b] += wz
            for xt, zt in zip(x, z, strict=True):
                ce[xt, zt] += wz
    return cs, ct, ce, ll


def test_expected_counts_and_m_step_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    Z, V = 2, 3
    p = random_params(Z, torch.full((V,), 1 / V), gen)
    p = Params(p.start.double(), p.trans.double(), p.emit_by_word.double())
    seqs = [[0, 2, 1], [1, 1], [2, 0, 0], [1]]  # padding in a batch: lengths 3, 2, 3, 1
    c = Counts.zeros(Z, V, "cpu")
    accumulate(p, Batch.from_lists(seqs[:2]), c)
    accumulate(p, Batch.from_lists(seqs[2:]), c)
    cs, ct, ce, ll = brute_counts(p, seqs)
    for got, want in ((c.start, cs), (c.trans, ct), (c.emit, ce)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)
    assert c.loglik == pytest.approx(ll, abs=1e-12) and (c.tokens, c.sequences) == (9, 4)
    # M-step: Ctrl-G's pseudocount, spread over each distribution's entries
    a = 0.3
    new = m_step(c, a, dtype=torch.float64)
    np.testing.assert_allclose(new.start.numpy(), (cs + a / Z) / (cs + a / Z).sum(), rtol=1e-12)
    np.testing.assert_allclose(new.trans.numpy(), (ct + a / Z) / (ct + a / Z).sum(1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(new.emit_by_word.numpy(), (ce + a / V) / (ce + a / V).sum(0, keepdims=True),
                               rtol=1e-12)


def test_em_never_lowers_the_training_likelihood(distilled):
    """Plain EM (pseudocount 0) on the distilled run's training samples, from a random start: the log-likelihood of
    the samples never decreases; with a pseudocount, the MAP objective never does."""
    (key,) = list((distilled / ".distill" / "d" / "samples").iterdir())
    arrays = [np.load(p) for p in sorted((key / "train").glob("shard-*.npy"))]
    V = 300
    for a in (0.0, 0.5):
        p = random_params(6, torch.full((V,), 1.0 / V), torch.Generator().manual_seed(3))
        objective = []
        for _ in range(6):
            c = Counts.zeros(6, V, "cpu")
            for b in sample_batches(arrays, 128, "cpu"):
                accumulate(p, b, c)
            objective.append(c.loglik + p.log_prior(a))
            p = m_step(c, a, old=p)
        assert all(y >= x - 1e-6 * abs(x) for x, y in itertools.pairwise(objective)), (a, objective)
        assert objective[-1] > objective[0] + 1


def test_lvd_counts_are_read_off_the_assignments():
    samples = np.array([[0, 1, -1], [2, 2, 1]], dtype=np.int32)
    assign = torch.tensor([1, 0, 0, 1, 1])  # row 0: z = 1, 0; row 1: z = 0, 1, 1
    c = lvd_counts(samples, assign, 2, 3)
    assert c.start.tolist() == [1, 1]
    assert c.trans.tolist() == [[0, 1], [1, 1]]
    assert c.emit.tolist() == [[0, 1], [1, 1], [1, 1]]  # [x, z]
    assert (c.tokens, c.sequences) == (5, 2)


def test_kmeans_finds_the_partition_scikit_learn_finds():
    sklearn_cluster = pytest.importorskip("sklearn.cluster")
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]])
    x = (centres.repeat_interleave(50, 0) + torch.randn(200, 3, generator=gen)).float()
    _, assign, history = kmeans(x, 4, iters=20, generator=torch.Generator().manual_seed(1))
    ref = sklearn_cluster.KMeans(4, n_init=10, random_state=0).fit(x.numpy()).labels_
    pairs = set(zip(assign.tolist(), ref.tolist(), strict=True))
    assert len(pairs) == 4  # the same partition up to the clusters' names
    assert all(b <= a + 1e-5 for a, b in itertools.pairwise(history))  # Lloyd never raises the distortion
    # fewer distinct points than clusters: the extra clusters stay empty, nothing fails
    _, assign, _ = kmeans(torch.zeros(10, 2), 3, iters=5, generator=torch.Generator().manual_seed(0))
    assert len(set(assign.tolist())) == 1


def test_hidden_states_are_the_states_that_predict_each_token(lm_dir):
    """`hidden_states` (batched, prompts of different lengths left-padded) equals one unpadded forward pass per
    sample: at each token, the LM's last hidden state over everything before it."""
    info = sampling.inspect_lm(lm_dir)
    model = sampling.load_model(info, torch.device("cpu"))
    prompts = [[0], [0, 80, 71, 68], [0, 69]]
    samples = np.array([[5, 6, 7, -1], [8, 0, -1, -1], [9, 10, 11, 12], [13, -1, -1, -1]], dtype=np.int32)
    got = sampling.hidden_states(model, info, samples, prompts=prompts, first_row=1, batch=4, device="cpu")
    want = []
    for r, s in enumerate(samples):
        s = [int(t) for t in s if t >= 0]
        prefix = prompts[(1 + r) % len(prompts)]
        with torch.no_grad():
            h = model.base_model(input_ids=torch.tensor([prefix + s[:-1]])).last_hidden_state[0]
        want.append(h[len(prefix) - 1 :])
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_samples_end_at_the_first_eos():
    new = np.array([[4, 0, 5, 0], [4, 5, 6, 7], [0, 3, 3, 3]])
    out = sampling.end_samples(new[:, :3], 4, (0,))
    assert out.tolist() == [[4, 0, -1, -1], [4, 5, 6, -1], [0, -1, -1, -1]]
    assert out.dtype == np.int32


def test_prompted_samples_continue_the_prompts(lm_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the red\n\na cat\n", encoding="utf-8")
    store = tmp_path / "store"
    assert main(["distill", "--lm", str(lm_dir), "--name", "p", "--store", str(store), "--states", "4", "--samples",
                 "100", "--valid-samples", "10", "--max-length", "5", "--em-steps", "1", "--prompts", str(prompts),
                 *QUIET]) == 0
    p = manifest(store, "p")["provenance"]
    assert p["prompts"]["count"] == 2
    assert p["prompts"]["sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    # row r continues prompt r % 2: its first token is likelier under the LM after its own prompt than after the other
    (key,) = list((store / ".distill" / "p" / "samples").iterdir())
    rows = np.load(key / "train" / "shard-00000.npy")
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    with torch.no_grad():
        nxt = [torch.log_softmax(model(torch.tensor([tok(t)["input_ids"]])).logits[0, -1], -1)
               for t in ("the red", "a cat")]
    for k in (0, 1):
        first = torch.from_numpy(rows[k::2, 0].astype(np.int64))
        own, other = float(nxt[k][first].sum()), float(nxt[1 - k][first].sum())
        assert own > other + 10, (k, own, other)


def _error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_missing_or_non_causal_lm_is_one_line_naming_it(tmp_path, lm_dir, capsys):
    base = ["distill", "--name", "x", "--store", str(tmp_path / "store"), "--states", "4", "--samples", "10",
            "--max-length", "4", *QUIET]
    line = _error_line(capsys, [*base, "--lm", str(tmp_path / "nope")])
    assert str(tmp_path / "nope") in line and "no such directory" in line
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _error_line(capsys, [*base, "--lm", str(tmp_path / "empty")])
    bare = tmp_path / "bare"  # a config and a tokenizer, no weights
    bare.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / f).write_bytes((lm_dir / f).read_bytes())
    assert "no weights" in _error_line(capsys, [*base, "--lm", str(bare)])
    enc = tmp_path / "encoder"
    transformers.DistilBertConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(enc)
    line = _error_line(capsys, [*base, "--lm", str(enc)])
    assert str(enc) in line and "'distilbert' is not a causal language model" in line
    assert not (tmp_path / "store").exists()  # refused before any work


def test_memory_is_estimated_and_refused_before_any_work(tmp_path, lm_dir, capsys):
    base = ["distill", "--lm", str(lm_dir), "--name", "big", "--store", str(tmp_path), "--samples", "10",
            "--max-length", "4", *QUIET]
    line = _error_line(capsys, [*base, "--states", "300000"])  # 16 bytes x 3e5 x 3e5 = 1.3 TiB
    assert line.startswith("latentlm distill: error: --states 300000: distilling needs about 1")
    assert "GiB is available" in line
    line = _error_line(capsys, [*base, "--states", "64", "--max-memory", "0.0001"])
    assert "allowed (--max-memory)" in line
    assert not (tmp_path / ".distill").exists()


def test_time_limit_stops_em_and_still_exports(tmp_path, lm_dir):
    assert main(["distill", "--lm", str(lm_dir), "--name", "t", "--store", str(tmp_path), "--states", "4",
                 "--samples", "50", "--max-length", "4", "--init", "random", "--em-steps", "50", "--time-limit",
                 "0.00001", *QUIET]) == 0
    p = manifest(tmp_path, "t")["provenance"]
    assert p["em_steps"] <= 1
    model = ops.load_model(tmp_path, "t")
    assert ops.run(model, "score", [[5, 6, 0]])[0]["logprob"] < 0


def test_validation_perplexity_is_the_chain_engines(distilled):
    """The curve's last validation perplexity is the stored model's on the held-out shards, scored by ops."""
    (key,) = list((distilled / ".distill" / "d" / "samples").iterdir())
    valid = np.load(key / "valid" / "shard-00000.npy")
    seqs = [[int(t) for t in r if t >= 0] for r in valid]
    model = ops.load_model(distilled, "d")
    ll = sum(r["logprob"] for r in ops.run(model, "score", seqs))
    ppl = math.exp(-ll / sum(len(s) for s in seqs))
    curve = json.loads((distilled / "d" / "curve.json").read_text())
    assert ppl == pytest.approx(curve["rows"][-1]["valid_ppl"], rel=1e-4)
    # and the training code's own perplexity agrees
    p = Params(*(model.impl.start, model.impl.trans, model.impl.emit.T.contiguous()))
    assert perplexity(p, sample_batches([valid], 64, "cpu"))[0] == pytest.approx(ppl, rel=1e-4)


def test_the_best_validation_step_is_exported_not_the_last(lm_dir, tmp_path):
    """64 states on 40 samples overfit: validation is best at an earlier step than the last. The stored model is
    that step's (its perplexity on the held-out shard is the curve's there), the manifest says which."""
    assert main(["distill", "--lm", str(lm_dir), "--name", "o", "--store", str(tmp_path), "--states", "64",
                 "--samples", "40", "--valid-samples", "40", "--max-length", "8", "--em-steps", "8", "--init",
                 "random", "--pseudocount", "0.01", *QUIET]) == 0
    prov = manifest(tmp_path, "o")["provenance"]
    rows = json.loads((tmp_path / "o" / "curve.json").read_text())["rows"]
    best = min(range(len(rows)), key=lambda i: rows[i]["valid_ppl"])
    assert 0 < best < 8 and prov["exported_step"] == best and prov["em_steps"] == 8
    (key,) = list((tmp_path / ".distill" / "o" / "samples").iterdir())
    seqs = [[int(t) for t in r if t >= 0] for r in np.load(key / "valid" / "shard-00000.npy")]
    ll = sum(r["logprob"] for r in ops.run(ops.load_model(tmp_path, "o"), "score", seqs))
    ppl = math.exp(-ll / sum(len(s) for s in seqs))
    assert ppl == pytest.approx(rows[best]["valid_ppl"], rel=1e-4) == prov["exported_valid_ppl"]
    assert ppl < rows[-1]["valid_ppl"] * 0.999


# -- --family blocked_hmm: the neural trainer over Brown clusters of the token ids -------------------------------
@pytest.fixture(scope="module")
def blocked(distilled, lm_dir):
    """`latentlm distill --family blocked_hmm`, 64 states in 4 clusters, 8 epochs, on the `distilled` run's samples
    (its work directory: the shards are reused, not drawn again)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits for a second thread (and the CPU is shared)
    try:
        rc = main(["distill", "--lm", str(lm_dir), "--name", "b", "--store", str(distilled), "--states", "64",
                   "--samples", "400", "--max-length", "8", "--shard-size", "100", "--seed", "1", "--family",
                   "blocked_hmm", "--clusters", "4", "--epochs", "8", "--work-dir",
                   str(distilled / ".distill" / "d"), *QUIET])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return distilled


def shards(store, split: str) -> np.ndarray:
    (key,) = list((store / ".distill" / "d" / "samples").iterdir())
    return np.concatenate([np.load(p) for p in sorted((key / split).glob("shard-*.npy"))])


def test_blocked_model_is_over_the_lms_tokenizer_scores_text_and_beats_a_unigram(blocked, lm_dir, tmp_path, capsys):
    model = ops.load_model(blocked, "b")
    assert model.family == "blocked_hmm"
    m = manifest(blocked, "b")
    assert m["config"]["num_states"] == 64 and m["config"]["num_clusters"] == 4
    assert m["preprocessing"]["tokenizer"] == "tokenizer.json" and m["vocab_size"] == 300
    assert (blocked / "b" / "tokenizer.json").read_bytes() == (lm_dir / "tokenizer.json").read_bytes()
    assert {"curve.png", "clusters.txt", "tokenizer.json"} <= set(m["files"])
    # text goes in through the LM's tokenizer, the eos appended; the CLI scores it as ops scores those ids
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    text = "the red dog sleeps near the river ."
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    assert model.vocab.encode(text) == ids
    (tmp_path / "in.txt").write_text(text + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["score", "--model", "b", "--store", str(blocked), str(tmp_path / "in.txt")]) == 0
    got = json.loads(capsys.readouterr().out)
    want = ops.run(model, "score", [ids])[0]
    assert got["num_tokens"] == len(ids) and got["logprob"] == pytest.approx(want["logprob"], rel=1e-6)
    assert -60 < got["logprob"] < 0
    # fresh LM samples: well below the add-one unigram of the training samples
    fresh = lm_samples(lm_dir, 300, 8, seed=12345)
    tokens = sum(len(s) for s in fresh)
    hmm_ppl = math.exp(-sum(r["logprob"] for r in ops.run(model, "score", fresh)) / tokens)
    train = shards(blocked, "train")
    counts = np.bincount(train[train >= 0], minlength=300) + 1.0
    uni_ppl = math.exp(-float(np.log(counts / counts.sum())[np.concatenate(fresh)].sum()) / tokens)
    assert hmm_ppl < 0.8 * uni_ppl, (hmm_ppl, uni_ppl)


def test_blocked_run_trains_on_the_samples_and_records_the_lm(blocked, lm_dir):
    """The clusters are Brown's over the training samples' token ids; the recorded validation perplexity is the
    stored model's on the held-out samples; the provenance names the LM and the recipe as the dense path's does."""
    from safetensors.torch import load_file

    from latentlm.training.brown import brown_clusters

    train = [[int(t) for t in r if t >= 0] for r in shards(blocked, "train")]
    stored = load_file(str(blocked / "b" / "weights.safetensors"))
    assert np.array_equal(stored["word_cluster"].numpy(), brown_clusters(train, 300, 4).word_cluster)
    valid = [[int(t) for t in r if t >= 0] for r in shards(blocked, "valid")]
    model = ops.load_model(blocked, "b")
    ppl = math.exp(-sum(r["logprob"] for r in ops.run(model, "score", valid)) / sum(map(len, valid)))
    p = manifest(blocked, "b")["provenance"]
    assert ppl == pytest.approx(p["best_valid_ppl"], rel=1e-4) and p["final_valid_ppl"] == p["best_valid_ppl"]
    assert p["best_valid_ppl"] < p["unigram_valid_ppl"]
    sha = lambda name: hashlib.sha256((lm_dir / name).read_bytes()).hexdigest()  # noqa: E731
    assert p["source"] == "latentlm distill" and p["lm"]["dir"] == str(lm_dir.resolve())
    assert p["lm"]["config_sha256"] == sha("config.json") and p["lm"]["tokenizer_sha256"] == sha("tokenizer.json")
    assert (p["samples"], p["valid_samples"], p["max_length"], p["seed"], p["init"], p["clusters"],
            p["states_per_cluster"], p["world_size"]) == (400, 100, 8, 1, "random", 4, 16, 1)
    assert p["sampling"]["shards_reused"] == 5 and p["sampling"]["shards_drawn"] == 0  # the dense run's samples
    assert p["settings"]["family"] == "blocked_hmm" and p["settings"]["em_steps"] is None
    t = p["trainer_settings"]
    assert (t["family"], t["states"], t["clusters"], t["epochs"], t["hidden"], t["lr"]) == \
        ("blocked_hmm", 64, 4, 8, 256, 0.01)
    assert p["steps"] > 0 and p["memory"]["estimate_bytes"] < p["memory"]["available_bytes"]


def test_blocked_flags_are_checked_naming_them(tmp_path, lm_dir, capsys):
    base = ["distill", "--lm", str(lm_dir), "--name", "x", "--store", str(tmp_path / "store"), "--samples", "20",
            "--valid-samples", "5", "--max-length", "4", *QUIET]
    blocked = [*base, "--family", "blocked_hmm"]
    assert _error_line(capsys, [*blocked, "--states", "64", "--clusters", "5"]).endswith(
        "error: --clusters 5: must divide --states 64 (each cluster gets --states / --clusters states)")
    assert "--clusters: must be a positive integer, got 0" in _error_line(capsys, [*blocked, "--states", "64",
                                                                                  "--clusters", "0"])
    line = _error_line(capsys, [*blocked, "--states", "512", "--clusters", "512"])
    assert "--clusters 512: more clusters than the LM's 300 token ids" in line
    assert "--clusters: only for --family blocked_hmm" in _error_line(capsys, [*base, "--states", "8",
                                                                              "--clusters", "2"])
    assert "--em-steps: only for --family hmm" in _error_line(capsys, [*blocked, "--states", "8", "--em-steps", "2"])
    assert "--init: only for --family hmm" in _error_line(capsys, [*blocked, "--states", "8", "--init", "lvd"])
    assert "--epochs: must be a positive integer" in _error_line(capsys, [*blocked, "--states", "8", "--epochs", "0"])
    line = _error_line(capsys, [*blocked, "--states", str(1 << 20)])  # 12 bytes x 2^40 transitions to evaluate
    assert "--states 1048576: distilling a blocked_hmm needs about" in line and "GiB is available" in line
    assert not (tmp_path / "store").exists()  # all of the above before any work
    # more clusters than the samples hold distinct tokens: refused after sampling, before Brown clustering
    assert main([*blocked, "--states", "256", "--clusters", "256"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("latentlm distill: error: --clusters 256: the 20 training samples hold only ")
    assert not (tmp_path / "store" / ".distill" / "x" / "train").exists()  # the trainer never started


def test_default_clusters():
    from latentlm.training.distill_blocked import default_clusters

    assert [default_clusters(z) for z in (8, 64, 96, 100, 4096, 32768)] == [1, 4, 6, 5, 128, 128]
    assert default_clusters(4096, distinct=50) == 32  # the largest divisor up to the distinct tokens


def test_blocked_memory_estimate_has_no_states_x_vocabulary_term(lm_dir):
    """At 4,096 states over GPT-2's 50,257 tokens the blocked run needs under half the dense one's memory, and
    growing the vocabulary from 300 to 50,257 tokens costs it less than one float32 Z x V table (it grows with
    V h and V k, not V Z); the Z x Z transitions it holds like the dense model."""
    import dataclasses

    from latentlm.training import distill, distill_blocked

    info = sampling.inspect_lm(lm_dir)
    gpt2 = dataclasses.replace(info, vocab_size=50257)
    s = distill.DistillSettings(lm=lm_dir, name="m", store=lm_dir, states=4096, samples=100000, max_length=32)
    dense = distill.memory_estimate(s, gpt2, distill.estep_batch(s, torch.device("cpu")))["total"]
    s.family = "blocked_hmm"
    est = distill_blocked.memory_estimate(s, gpt2, 128)
    assert est["total"] < dense / 2, (est, dense)
    assert est["total"] - distill_blocked.memory_estimate(s, info, 128)["total"] < 4 * 4096 * 50257
    assert est["evaluate"] >= 12 * 4096**2  # the (Z, Z) float32 transitions, three times
