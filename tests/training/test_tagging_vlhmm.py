"""The tagging VL-HMM (paper 003 §5.2): parameterisation (shapes, normalisation, which vectors feed which
distribution) and the joint loss, against brute-force enumeration on tiny models."""

from __future__ import annotations

import itertools
import math

import torch

from latentlm.models.base import Batch
from latentlm.training.neural import blocked_loss, sample_state_dropout
from latentlm.training.tagging_vlhmm import BlockedTagger, TaggingVLHMM, joint_loss, tagged_batches

V, M, K, H, Y = 9, 3, 4, 8, 5


def tiny(seed: int = 0) -> TaggingVLHMM:
    torch.manual_seed(seed)
    wc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 0, 2])
    m = TaggingVLHMM(V, wc, M, K, H, Y).double()
    with torch.no_grad():  # away from the near-uniform initialisation, so wrong wiring shows
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return m


def dense(t: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """start (Z,), trans (Z, Z), emit (Z, V) with zeros outside each state's cluster."""
    Z = t["trans"].shape[0]
    k = t["emit"].shape[1]
    emit = torch.zeros(Z, t["emit"].shape[0], dtype=torch.float64)
    for w, c in enumerate(t["word_cluster"].tolist()):
        emit[c * k: (c + 1) * k, w] = t["emit"][w].double()
    return t["start"].double(), t["trans"].double(), emit


def brute_joint(start, trans, emit, tag_emit, words, tags) -> float:
    """log sum_z p(w, y, z) by enumerating every state path."""
    Z = len(start)
    total = 0.0
    for path in itertools.product(range(Z), repeat=len(words)):
        p = start[path[0]]
        for t, z in enumerate(path):
            if t:
                p = p * trans[path[t - 1], z]
            p = p * emit[z, words[t]] * tag_emit[z, tags[t]]
        total += float(p)
    return math.log(total)


def test_shapes_and_normalisation():
    m = tiny()
    t = m.export_tensors()
    Z = M * K
    assert t["start"].shape == (Z,) and t["trans"].shape == (Z, Z) and t["emit"].shape == (V, K)
    assert t["tag_emit"].shape == (Z, Y) and t["state_vectors"].shape == (Z, H)
    assert torch.allclose(t["start"].sum().double(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(t["trans"].sum(1).double(), torch.ones(Z, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(t["tag_emit"].sum(1).double(), torch.ones(Z, dtype=torch.float64), atol=1e-5)
    # each state's word emission sums to 1 over its own cluster's words (the Brown-cluster constraint)
    per_state = torch.zeros(M, K, dtype=torch.float64).index_add_(0, t["word_cluster"], t["emit"].double())
    assert torch.allclose(per_state, torch.ones(M, K, dtype=torch.float64), atol=1e-5)
    # the tag emission is unconstrained: every state gives every tag positive mass
    assert bool((t["tag_emit"] > 0).all())
    BlockedTagger(t, M, [f"T{i}" for i in range(Y)])  # passes the blocked_hmm artifact checks


def test_tag_emission_is_softmax_of_tag_role_over_tag_embeddings():
    m = tiny()
    states = torch.arange(M * K)
    e = torch.cat([m.cluster_emb[states // K], m.state_emb[states]], -1)
    h_tag = m.mlp["tag"](m.compose["tag"](e))
    expect = torch.log_softmax(h_tag @ m.tag_emb.T, -1)
    assert torch.allclose(m.log_tag_emission(states), expect)
    # and it is a different role from the word emission's H_emit
    assert not torch.allclose(h_tag, m.emission_reprs(states))


def test_which_vectors_feed_which_distribution():
    m = tiny()
    states = torch.arange(M * K)
    ls, lt, le = m.matrices(None)
    ly = m.log_tag_emission(states)
    grads = {}
    for name, out in (("start", ls), ("trans", lt), ("emit", le), ("tag", ly)):
        m.zero_grad()
        (out * torch.randn_like(out)).sum().backward(retain_graph=True)
        grads[name] = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert "tag_emb" in grads["tag"] and not any("tag" in n for k in ("start", "trans", "emit") for n in grads[k])
    assert "word_emb_by_slot" in grads["emit"] and "word_emb_by_slot" not in grads["tag"]
    assert {"cluster_emb", "state_emb"} <= grads["tag"]  # the shared factored state embedding
    assert any(n.startswith("mlp.tag") for n in grads["tag"])
    assert not any(n.startswith("mlp.emit") for n in grads["tag"])
    assert not any(n.startswith(("mlp.out", "mlp.in", "start_vec")) for n in grads["tag"])


def test_joint_loss_matches_brute_force_with_and_without_dropout():
    m = tiny()
    words = [[0, 3, 6, 2], [5, 1, 8]]
    tags = [[1, 0, 4, 2], [3, 3, 0]]
    b = Batch.from_lists(words)
    tg = Batch.from_lists(tags).ids
    for keep in (K, 2):
        active = sample_state_dropout(M, K, keep, torch.Generator().manual_seed(1))
        nll = float(joint_loss(m, b, tg, active).detach())
        # brute force over the restricted model: the active states' matrices, as the trainer builds them
        ls, lt, le = m.slot_matrices(active)
        states = m.active_states(active)
        ty = m.log_tag_emission(states).exp().detach()
        emit = torch.zeros(len(states), V, dtype=torch.float64)
        for w in range(V):
            s, c = int(m.word_slot[w]), int(m.word_cluster[w])
            emit[c * keep: (c + 1) * keep, w] = le[s].exp().detach()
        start, trans = ls.exp().detach(), lt.exp().detach()
        want = -sum(brute_joint(start, trans, emit, ty, w, y) for w, y in zip(words, tags, strict=True))
        assert abs(nll - want) < 1e-8 * max(1.0, abs(want))


def test_tags_sum_out_to_the_language_model():
    """sum_y p(w, y) = p(w): the tag factor is normalised, so the word-only VL-HMM loss comes back."""
    m = tiny()
    words = [4, 0, 7]
    b = Batch.from_lists([words])
    active = torch.arange(K).expand(M, K)
    total = 0.0
    for ys in itertools.product(range(Y), repeat=len(words)):
        total += math.exp(-float(joint_loss(m, b, torch.tensor([ys]), active).detach()))
    lm, _ = blocked_loss(m, b, active)
    assert abs(-math.log(total) - float(lm.detach())) < 1e-9


def test_gradient_reaches_word_and_tag_parameters():
    m = tiny()
    b = Batch.from_lists([[0, 3, 6], [2, 2]])
    tg = Batch.from_lists([[1, 0, 4], [2, 3]]).ids
    joint_loss(m, b, tg, sample_state_dropout(M, K, 2, torch.Generator().manual_seed(0))).backward()
    for name in ("tag_emb", "word_emb_by_slot", "cluster_emb", "state_emb"):
        assert getattr(m, name).grad.abs().sum() > 0, name


def test_tagger_marginals_and_viterbi_match_brute_force():
    m = tiny()
    t = m.export_tensors()
    t = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    tagger = BlockedTagger(t, M, [f"T{i}" for i in range(Y)], dtype=torch.float64)
    start, trans, emit = dense(t)
    ty = t["tag_emit"].double()
    words = [1, 5, 3]
    Z = M * K
    marg = torch.zeros(len(words), Y, dtype=torch.float64)
    best, best_tags = -1.0, None
    for path in itertools.product(range(Z), repeat=len(words)):
        p = start[path[0]] * emit[path[0], words[0]]
        for i in range(1, len(words)):
            p = p * trans[path[i - 1], path[i]] * emit[path[i], words[i]]
        if p == 0:
            continue
        for i, z in enumerate(path):
            marg[i] += p * ty[z]
        q = p * torch.prod(torch.stack([ty[z].max() for z in path]))
        if q > best:
            best, best_tags = float(q), [int(ty[z].argmax()) for z in path]
    marg /= marg.sum(-1, keepdim=True)
    got = tagger.tag_marginals(Batch.from_lists([words]))[0]
    assert torch.allclose(got, marg, atol=1e-10)
    assert torch.allclose(got.sum(-1), torch.ones(len(words), dtype=torch.float64))
    assert tagger.decode_tags([words], "viterbi")[0] == [f"T{i}" for i in best_tags]
    assert tagger.decode_tags([words], "mbr")[0] == [f"T{i}" for i in marg.argmax(-1).tolist()]


def test_tagged_batches_keep_words_and_tags_aligned():
    ids = [[1, 2, 3], [4], [5, 6]]
    tags = [[0, 1, 2], [3], [4, 0]]
    for b, t in tagged_batches(ids, tags, 2, torch.Generator().manual_seed(0)):
        for r in range(len(b.lengths)):
            n = int(b.lengths[r])
            i = ids.index(b.ids[r, :n].tolist())
            assert t[r, :n].tolist() == tags[i]
