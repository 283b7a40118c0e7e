"""Neural blocked (VL-)HMM and rank-space HMM: state dropout, few-step training on a PTB slice lowers the
validation perplexity, the export loads and scores as the training-time evaluation, resume, BPTT;
DenseHMM exports an `hmm` with vectors."""

from __future__ import annotations

import json

import pytest
import torch

from latentlm import ops
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM, Carried
from latentlm.models.registry import load_artifact
from latentlm.training import neural
from latentlm.training.settings import corpus_perplexity, resolve_settings
from tests.training.helpers import train_args, valid_file


@pytest.mark.parametrize("M,k,keep", [(1, 1, 1), (3, 8, 4), (5, 7, 3), (2, 16, 1)])
def test_state_dropout_keeps_exactly_keep_states_per_cluster(M, k, keep):
    g = torch.Generator().manual_seed(0)
    seen = torch.zeros(M, k)
    for _ in range(50):
        a = neural.sample_state_dropout(M, k, keep, g)
        assert a.shape == (M, keep)
        for row in a:
            assert len(set(row.tolist())) == keep and 0 <= int(row.min()) and int(row.max()) < k
            assert row.tolist() == sorted(row.tolist())
        seen.scatter_(1, a, 1.0)
    assert bool((seen == 1).all())  # every state gets kept sometimes


@pytest.mark.parametrize("state_embedding", ["factored", "independent", "tied"])
def test_vlhmm_matrices_normalised_and_dropout_chain_is_a_blocked_hmm(state_embedding):
    torch.manual_seed(0)
    V, M, k = 30, 3, 4
    wc = torch.arange(V) % M
    m = neural.VLHMM(V, wc, M, k, 16, state_embedding).double()
    active = neural.sample_state_dropout(M, k, 2, torch.Generator().manual_seed(1))
    ls, lt, le = m.matrices(active)
    assert torch.allclose(ls.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(lt.exp().sum(1), torch.ones(M * 2, dtype=torch.float64))
    per_state = torch.zeros(M, 2, dtype=torch.float64).index_add_(0, wc, le.exp())
    assert torch.allclose(per_state, torch.ones_like(per_state))
    # the training loss with a mask equals the exact blocked-HMM score of the reduced model
    b = Batch.from_lists([[0, 4, 8, 2], [5, 1]])
    nll, _ = neural.blocked_loss(m, b, active)
    with torch.no_grad():
        reduced = BlockedHMM(ls.exp(), lt.exp(), le.exp(), wc, M)
        assert torch.allclose(-nll.detach(), reduced.score(b)[0].sum())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transitions_normalised_inside_the_loss_equal_a_log_softmax_before_it(dtype):
    """`blocked_loss` hands `BlockedNLL` the transition logits (normalised inside, the gradient formed over the
    counts in place); with `trans_logits=False` a log-softmax normalises them before it (the path before): the
    same loss and the same gradient of every parameter, with a carried state and state dropout."""
    torch.manual_seed(0)
    V, M, k, B = 30, 3, 4, 2
    wc = torch.arange(V) % M
    m = neural.VLHMM(V, wc, M, k, 16, "tied").to(dtype)
    active = neural.sample_state_dropout(M, k, 3, torch.Generator().manual_seed(1))
    b = Batch.from_lists([[0, 4, 8, 2, 11], [5, 1, 7]])
    state = torch.rand(B, k, generator=torch.Generator().manual_seed(3), dtype=dtype)
    state[1] = 0.0  # the second row carries nothing: it starts from the start distribution
    carry = Carried(state, torch.tensor([1, 0]))
    out = []
    for fused in (True, False):
        m.zero_grad()
        nll, last = neural.blocked_loss(m, b, active, carry, want_last=True, trans_logits=fused)
        (nll / 8).backward()
        out.append((nll.detach(), last.state, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (n0, l0, g0), (n1, l1, g1) = out
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    assert torch.allclose(n0, n1, **tol) and torch.allclose(l0, l1, **tol)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], **tol), n


def test_tied_state_embedding_is_one_table_for_every_role():
    """'tied' (the authors' PTB command, --tw slIlrIrp): start, left, right and preterminal read one (Z, h)
    table; the next state's side of a transition logit is its embedding itself."""
    torch.manual_seed(0)
    V, M, k, h = 30, 3, 4, 16
    wc = torch.arange(V) % M
    tied = neural.VLHMM(V, wc, M, k, h, "tied").double()
    ind = neural.VLHMM(V, wc, M, k, h, "independent")
    assert tied.state_emb.shape == (M * k, h) and tied.next_state is None
    n_tied, n_ind = (sum(p.numel() for p in m.parameters()) for m in (tied, ind))
    assert n_ind - n_tied == 3 * M * k * h  # three role tables fewer
    e = tied.state_emb
    ls, lt, le = tied.matrices(None)
    assert torch.allclose(ls, torch.log_softmax(tied.start_out(tied.mlp["start"](e)).squeeze(-1), 0))
    assert torch.allclose(lt, torch.log_softmax(tied.mlp["out"](e) @ e.T, -1))
    h_emit = tied.mlp["emit"](e).view(M, k, h)
    logits = torch.einsum("vh,vkh->vk", tied.word_emb_by_slot[tied.word_slot], h_emit[wc])  # word x own states
    logits = logits + tied.word_bias_by_slot[tied.word_slot][:, None]
    for m in range(M):  # each cluster's words normalised against its own states
        rows = (wc == m).nonzero().squeeze(1)
        assert torch.allclose(le[rows], torch.log_softmax(logits[rows], 0))
    # one gradient reaches the table from every role
    (ls.sum() + lt.sum() + le.sum()).backward()
    assert tied.state_emb.grad is not None and bool(tied.state_emb.grad.abs().sum() > 0)


def _check_run(tmp_path, ns, path, family):
    m = json.loads((path / "manifest.json").read_text())
    assert m["family"] == family
    rows = m["provenance"]["curve"]
    assert rows[-1]["valid_ppl"] < rows[0]["valid_ppl"]
    # the uniform model over the 10,000 PTB words has perplexity 10,000; a few dozen steps reach ~1,000
    assert m["vocab_size"] == 10000 and m["provenance"]["best_valid_ppl"] < m["vocab_size"] / 4
    load_artifact(path)
    res = corpus_perplexity(tmp_path, ns.name, str(valid_file(tmp_path, ns.valid_sentences)))
    assert abs(res["perplexity"] - m["provenance"]["best_valid_ppl"]) / res["perplexity"] < 1e-3
    assert (path / "curve.png").is_file()
    return m


def test_blocked_hmm_few_steps_lower_valid_ppl_and_export(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "blocked_hmm", states=32, clusters=8, hidden=16, epochs=1,
                                     train_sentences=1500, batch=32, lr=0.02, eval_every=25,
                                     valid_sentences=400))
    path = neural.train(ns)
    m = _check_run(tmp_path, ns, path, "blocked_hmm")
    assert m["config"]["num_clusters"] == 8 and m["config"]["states_per_cluster"] == 4
    assert len((path / "clusters.txt").read_text().splitlines()) == 10000
    model = ops.load_model(tmp_path, ns.name)
    fwd, rev = (ops.run(model, "score", [model.vocab.encode(s)])[0] for s in ("the company said", "said company the"))
    # word order matters to a trained sequence model (a unigram model scores both orders alike): measured
    # 5.5 nats apart after this run
    assert fwd["logprob"] > rev["logprob"] + 2, (fwd, rev)
    assert fwd["perplexity"] < m["provenance"]["best_valid_ppl"]  # frequent words in a frequent phrase
    # the neural VL-HMM carries its states' vectors, so it serves `embed` (posterior-weighted)
    assert "embed" in model.impl.operations
    emb = ops.run(model, "embed", [model.vocab.encode("the company said")], causal=False)[0]
    assert emb["dim"] == 16 and len(emb["embeddings"]) == 4 and len(emb["embeddings"][0]) == 16


def test_rank_hmm_few_steps_lower_valid_ppl_export_and_resume(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "rank_hmm", states=32, rank=8, hidden=16, epochs=2,
                                     train_sentences=1500, batch=32, lr=0.01, max_steps=60,
                                     valid_sentences=400))
    path = neural.train(ns)
    m = _check_run(tmp_path, ns, path, "rank_hmm")
    assert m["config"]["rank"] == 8
    steps = m["provenance"]["steps"]
    # resume from the checkpoint with a larger step budget continues counting steps
    ns2 = resolve_settings(train_args(tmp_path, "rank_hmm", states=32, rank=8, hidden=16, epochs=2,
                                      train_sentences=1500, batch=32, lr=0.01, max_steps=steps + 10,
                                      resume=True, valid_sentences=400))
    m2 = json.loads((neural.train(ns2) / "manifest.json").read_text())
    assert m2["provenance"]["steps"] == steps + 10


def test_blocked_hmm_bptt_streams_run(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "blocked_hmm", states=16, clusters=8, hidden=8, epochs=1,
                                     train_sentences=300, valid_sentences=100, batch=8, bptt=16, max_steps=6))
    path = neural.train(ns)
    art = load_artifact(path)
    assert art.config["num_states"] == 16
    # the training-time validation scores what is exported (with the sentence start after <eos>)
    prov = json.loads((path / "manifest.json").read_text())["provenance"]
    best = prov["best_valid_ppl"]
    res = corpus_perplexity(tmp_path, ns.name, str(valid_file(tmp_path, 100)))
    assert abs(res["perplexity"] - best) / best < 1e-4
    # each check row says how much of its wall time went to checks and checkpoint writes (cumulative)
    rows = prov["curve"]
    assert all(0 < r["check_seconds"] <= r["seconds"] for r in rows)
    assert all(a["check_seconds"] <= b["check_seconds"] and a["seconds"] - a["check_seconds"] <=
               b["seconds"] - b["check_seconds"] for a, b in zip(rows, rows[1:], strict=False))


def test_bptt_batches_cut_the_running_text_from_any_start():
    """Streams are consecutive slices of the corpus read from token `start` (wrapping around); chunks continue
    them; start 0 is the unrotated corpus."""
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]]  # 12 tokens
    for start in (0, 1, 5, 11):
        flat = [1 + (start + i) % 12 for i in range(12)]
        batches = neural.bptt_batches(seqs, 3, 3, "cpu", start)  # 3 streams of 4 tokens: chunks of 3 then 1
        assert [b.ids.shape for b in batches] == [(3, 3), (3, 1)]
        streams = torch.cat([b.ids for b in batches], 1).tolist()
        assert streams == [flat[0:4], flat[4:8], flat[8:12]]
        assert all(b.lengths.tolist() == [b.ids.shape[1]] * 3 for b in batches)
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="--batch 13: 13 BPTT streams need at least 13 training tokens, the "
                                         "training data has 12"):
        neural.bptt_batches(seqs, 13, 3, "cpu")  # not one token per stream: no step at all, so refused


def test_bptt_rotate_moves_the_streams_per_epoch_and_needs_bptt(tmp_path):
    from latentlm.models.errors import InputError

    for kw in (dict(family="rank_hmm"), dict(family="blocked_hmm")):
        with pytest.raises(InputError, match="--bptt-rotate: needs --family blocked_hmm with --bptt"):
            resolve_settings(train_args(tmp_path, kw["family"], bptt_rotate=True))
    runs = {}
    for rotate in (False, True):
        ns = resolve_settings(train_args(tmp_path, "blocked_hmm", states=16, clusters=8, hidden=8, epochs=2,
                                         train_sentences=200, valid_sentences=50, batch=8, bptt=16, seed=3,
                                         bptt_rotate=rotate, name=f"r{int(rotate)}", patience=0))
        curve = json.loads((neural.train(ns) / "manifest.json").read_text())["provenance"]["curve"]
        runs[rotate] = [r["valid_ppl"] for r in curve]
    assert runs[False][0] == runs[True][0]  # same initial model
    assert runs[False][1:] != runs[True][1:]  # other batches from the first epoch on


def test_densehmm_exports_hmm_with_vectors(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "densehmm", states=16, hidden=8, epochs=2, fit="cooc",
                                     train_sentences=3000, lr=0.05, valid_sentences=300))
    from latentlm.training.densehmm import train

    path = train(ns)
    art = load_artifact(path)
    assert art.family == "hmm"
    assert art.tensors["state_vectors"].shape == (16, 8) and art.tensors["word_vectors"].shape == (10000, 8)
    rows = art.manifest["provenance"]["curve"]
    assert rows[-1]["valid_ppl"] < rows[0]["valid_ppl"]


def test_a_diverging_run_stops_with_an_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """A non-finite loss ends training at once with exit status 2 naming --lr, and no artifact is written
    (before, a run whose loss went NaN exported its step-0 model)."""
    from latentlm.cli import main

    real = neural.blocked_loss
    calls = []

    def diverging(*args, **kwargs):
        nll, last = real(*args, **kwargs)
        calls.append(1)
        return (nll * float("nan") if len(calls) == 2 else nll), last

    monkeypatch.setattr(neural.losses, "blocked_loss", diverging)
    rc = main(["train", "--family", "blocked_hmm", "--data", "ptb", "--name", "div", "--store", str(tmp_path),
               "--states", "32", "--clusters", "8", "--hidden", "16", "--train-sentences", "300",
               "--valid-sentences", "50", "--batch", "32", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--lr: training diverged at step 2" in err, err
    assert not (tmp_path / "div" / "manifest.json").exists()
    assert len(calls) == 2


def test_ctrl_c_stops_after_the_step_and_exports_the_best_evaluation(tmp_path, monkeypatch):
    """A first SIGINT during training finishes the step, evaluates, checkpoints and exports (a run stopped by hand
    is not lost); the handler is the previous one again afterwards."""
    import signal

    calls = []
    real_loss = neural.rank_loss

    def loss_then_interrupt(model, batch):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # as a user's Ctrl-C arrives, mid-step
        return real_loss(model, batch)

    monkeypatch.setattr(neural.losses, "rank_loss", loss_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    ns = resolve_settings(train_args(tmp_path, "rank_hmm", states=16, rank=4, hidden=8, epochs=3,
                                     train_sentences=600, batch=32, lr=0.01, valid_sentences=100))
    path = neural.train(ns)
    m = json.loads((path / "manifest.json").read_text())
    assert m["provenance"]["steps"] == 3  # stopped after the interrupted step, not at the end of 3 epochs
    assert m["provenance"]["curve"][-1]["step"] == 3  # evaluated there
    load_artifact(path)
    assert signal.getsignal(signal.SIGINT) is before


def test_lr_anneal_falls_linearly_to_zero_over_the_last_fraction_of_the_budget(tmp_path):
    """--lr-anneal 0.5 with a 12-step budget: steps 1-7 run at the full LR, step j > 6 at lr x (12 - j + 1) / 6
    (the fraction spent before the step), and the LR never rises again after a plateau decay."""
    assert neural.anneal_factor(0.3, 0.5) == 1.0 and neural.anneal_factor(0.75, 0.5) == 0.5
    assert neural.anneal_factor(1.0, 0.2) == 0.0 and neural.anneal_factor(0.9, 0.0) == 1.0
    ns = resolve_settings(train_args(tmp_path, "rank_hmm", states=16, rank=4, hidden=8, epochs=50,
                                     train_sentences=300, valid_sentences=50, batch=16, lr=0.01, max_steps=12,
                                     eval_every=1, patience=0, lr_decay=1.0, lr_anneal=0.5))
    m = json.loads((neural.train(ns) / "manifest.json").read_text())
    lrs = {int(r["step"]): r["lr"] for r in m["provenance"]["curve"]}
    for j in range(1, 13):
        assert lrs[j] == pytest.approx(0.01 * min(1.0, (12 - (j - 1)) / 6)), j
    # with a plateau decay (x 1/2 at every evaluation without improvement) the schedule multiplies the decayed LR
    ns = resolve_settings(train_args(tmp_path, "rank_hmm", states=16, rank=4, hidden=8, epochs=50, name="d",
                                     train_sentences=300, valid_sentences=50, batch=16, lr=0.5, max_steps=12,
                                     eval_every=1, patience=0, lr_decay=2.0, lr_anneal=0.5))
    curve = json.loads((neural.train(ns) / "manifest.json").read_text())["provenance"]["curve"][1:]
    assert all(b["lr"] <= a["lr"] + 1e-15 for a, b in zip(curve, curve[1:], strict=False))
    assert any(r["lr"] < 0.5 * (12 - r["step"] + 1) / 6 - 1e-12 for r in curve[6:])  # a decay happened


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_lr_anneal_outside_0_1_is_refused(tmp_path, value):
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="--lr-anneal: must be a fraction from 0 to 1"):
        resolve_settings(train_args(tmp_path, "rank_hmm", lr_anneal=value))


def test_unknown_state_embedding_is_refused_naming_the_choices(tmp_path):
    from latentlm.models.errors import InputError

    with pytest.raises(InputError, match="--state-embedding: expected one of factored, independent, tied, got 'tide'"):
        resolve_settings(train_args(tmp_path, "blocked_hmm", state_embedding="tide"))


@pytest.mark.parametrize("state_embedding", ["factored", "independent", "tied"])
def test_a_step_whose_rows_all_carry_a_state_skips_the_start_and_changes_nothing(state_embedding):
    """BPTT: where every row continues a carried state the start distribution is never read, so `blocked_loss`
    does not build it; with `fill_missing_grads` the gradients and the AdamW step are those of building it."""
    V, M, k, B = 24, 3, 4, 3
    wc = torch.arange(V) % M
    b = Batch.from_lists([[0, 4, 8, 2], [5, 1, 7, 3], [2, 2, 6, 9]])
    active = neural.sample_state_dropout(M, k, 3, torch.Generator().manual_seed(2))
    carry = Carried(torch.rand(B, k, generator=torch.Generator().manual_seed(3)) + 0.1,  # mass on every state
                    torch.ones(B, dtype=torch.long))  # of cluster 1
    runs = []
    for build_start in (False, True):
        torch.manual_seed(0)
        m = neural.VLHMM(V, wc, M, k, 8, state_embedding)
        opt = neural.make_optimizer(m, 0.01, True)
        real = m.slot_matrices
        if build_start:  # the path before: the start distribution built (and back-propagated) every step
            m.slot_matrices = lambda active, with_start=True, real=real, **kw: real(active, True, **kw)
        nll, _ = neural.blocked_loss(m, b, active, carry)
        nll.backward()
        neural.fill_missing_grads(m)
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        runs.append((float(nll.detach()), grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (nll0, g0, p0), (nll1, g1, p1) = runs
    assert nll0 == nll1
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
        assert torch.equal(p0[n], p1[n]), n
    unused = [n for n in g0 if "start" in n]
    assert unused and all(not g0[n].any() for n in unused)


def test_a_checkpoints_carry_reads_back_by_cluster_and_from_the_older_layout():
    """The BPTT carry a checkpoint holds comes back as written (`carry` (B, k) and `carry_cluster` (B,)); a
    checkpoint from before the carry was kept by cluster holds it over every cluster (B, M, k), with all of
    each row's mass in one: read back as that cluster's row."""
    g = torch.Generator().manual_seed(0)
    B, M, k = 4, 3, 5
    carry = Carried(torch.rand(B, k, generator=g), torch.tensor([2, 0, 1, 2]))
    now = neural.carry_from_checkpoint({"carry": carry.state, "carry_cluster": carry.cluster}, "cpu")
    older = torch.zeros(B, M, k)
    older[torch.arange(B), carry.cluster] = carry.state
    before = neural.carry_from_checkpoint({"carry": older}, "cpu")
    for got in (now, before):
        assert torch.equal(got.state, carry.state) and torch.equal(got.cluster, carry.cluster)
    assert neural.carry_from_checkpoint({}, "cpu") is None
