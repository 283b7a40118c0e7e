"""Baum-Welch: E-step statistics against brute-force enumeration; EM never decreases the likelihood;
the exported `hmm` scores exactly as the training-time evaluation."""

from __future__ import annotations

import itertools
import json
import math

import torch

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.training import baum_welch as bw
from latentlm.training.settings import corpus_perplexity, resolve_settings
from tests.training.helpers import train_args


def brute_counts(start, trans, emit, seq):
    Z = start.shape[0]
    cs, ct, ce = torch.zeros(Z, dtype=torch.float64), torch.zeros(Z, Z, dtype=torch.float64), torch.zeros_like(emit)
    total = 0.0
    for path in itertools.product(range(Z), repeat=len(seq)):
        p = start[path[0]] * emit[path[0], seq[0]]
        for t in range(1, len(seq)):
            p = p * trans[path[t - 1], path[t]] * emit[path[t], seq[t]]
        total += float(p)
        cs[path[0]] += p
        for t in range(len(seq)):
            ce[path[t], seq[t]] += p
            if t:
                ct[path[t - 1], path[t]] += p
    return cs / total, ct / total, ce / total, math.log(total)


def test_expected_counts_match_brute_force():
    g = torch.Generator().manual_seed(0)
    Z, V = 3, 4
    p = bw.init_params(Z, torch.full((V,), 1 / V, dtype=torch.float64), g, dtype=torch.float64)
    seqs = [[0, 2, 1, 3], [1], [3, 3, 0]]
    b = Batch.from_lists(seqs)
    gamma, s, xi, log_cond = chain.expected_counts(p.start.expand(3, -1), p.emit.T[b.ids], p.trans, b.lengths)
    c = bw.e_step(p, [b])
    ws, wt, we, ll = (torch.zeros(Z, dtype=torch.float64), torch.zeros(Z, Z, dtype=torch.float64),
                      torch.zeros(Z, V, dtype=torch.float64), 0.0)
    for seq in seqs:
        a, bb, cc, l_ = brute_counts(p.start, p.trans, p.emit, seq)
        ws, wt, we, ll = ws + a, wt + bb, we + cc, ll + l_
    assert torch.allclose(s, ws, atol=1e-12) and torch.allclose(xi, wt, atol=1e-12)
    assert torch.allclose(c.emit, we, atol=1e-12)
    assert abs(float(log_cond.sum()) - ll) < 1e-10
    assert torch.all(gamma[1, 1:] == 0)  # padding


def test_baum_welch_never_decreases_likelihood():
    g = torch.Generator().manual_seed(1)
    Z, V = 5, 12
    seqs = [torch.randint(0, V, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
            for _ in range(40)]
    batches = [Batch.from_lists(seqs[:25]), Batch.from_lists(seqs[25:])]
    p = bw.init_params(Z, bw.unigram(seqs, V), g, dtype=torch.float64)
    _, lls = bw.baum_welch(p, batches, 25, smoothing=0.0)
    assert all(b >= a - 1e-9 * abs(a) for a, b in zip(lls, lls[1:], strict=False))
    assert lls[-1] > lls[0] + 1.0


def test_hmm_training_lowers_validation_ppl_and_export_matches(tmp_path):
    ns = resolve_settings(train_args(tmp_path, "hmm", states=16, epochs=2, train_sentences=1500, smoothing=0.01))
    path = bw.train(ns)
    m = json.loads((path / "manifest.json").read_text())
    rows = m["provenance"]["curve"]
    assert rows[-1]["valid_ppl"] < rows[0]["valid_ppl"]
    # the uniform model over the 10,000 PTB words has perplexity 10,000 (the noisy start is above it)
    assert m["vocab_size"] == 10000 and m["provenance"]["best_valid_ppl"] < m["vocab_size"] / 4
    assert (path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    res = corpus_perplexity(tmp_path, ns.name, "ptb:valid")
    best = m["provenance"]["best_valid_ppl"]
    assert abs(res["perplexity"] - best) / best < 1e-3
    assert res["num_tokens"] == 73760


def test_hmm_resume_continues_iterations_and_seed_is_deterministic(tmp_path):
    kw = dict(states=8, train_sentences=400, valid_sentences=100, smoothing=0.01)
    p1 = bw.train(resolve_settings(train_args(tmp_path, "hmm", epochs=1, **kw)))
    p2 = bw.train(resolve_settings(train_args(tmp_path, "hmm", epochs=2, resume=True, **kw)))
    rows = json.loads((p2 / "manifest.json").read_text())["provenance"]["curve"]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert p1 == p2
    from latentlm.models.registry import load_artifact

    a = load_artifact(bw.train(resolve_settings(train_args(tmp_path, "hmm", epochs=2, name="again", **kw))))
    b = load_artifact(p2)
    assert torch.equal(a.tensors["trans"], b.tensors["trans"])
