"""DenseHMM as in Sicking et al.: which vectors feed which distribution (eqs. 2a-2c), the stationary
distribution, the gradient M-step objective and its gradient, the Frobenius co-occurrence objective against a
direct computation and finite differences, EM monotonicity, co-occurrence recovery, and the export."""

from __future__ import annotations

import torch

from latentlm.models import chain
from latentlm.models.base import Batch
from latentlm.training import baum_welch as bw
from latentlm.training import densehmm as dh


def tiny(n: int = 4, m: int = 6, l: int = 3, seed: int = 0) -> dh.DenseParams:
    return dh.DenseParams(n, m, l, torch.Generator().manual_seed(seed), dtype=torch.float64)


def sample_hmm(A: torch.Tensor, B: torch.Tensor, pi: torch.Tensor, count: int, length: int,
               gen: torch.Generator) -> list[list[int]]:
    seqs = []
    for _ in range(count):
        s = int(torch.multinomial(pi, 1, generator=gen))
        seq = []
        for _ in range(length):
            seq.append(int(torch.multinomial(B[s], 1, generator=gen)))
            s = int(torch.multinomial(A[s], 1, generator=gen))
        seqs.append(seq)
    return seqs


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, B rows ~ Dir(0.1) (m = n), pi stationary, as in the paper's synthetic experiment."""
    torch.manual_seed(seed)
    dirichlet = torch.distributions.Dirichlet(torch.full((n,), 0.1, dtype=torch.float64))
    A, B = dirichlet.sample((n,)) + 1e-9, dirichlet.sample((n,)) + 1e-9
    A, B = A / A.sum(1, keepdim=True), B / B.sum(1, keepdim=True)
    return A, B, dh.stationary(A)


def test_parameterisation_follows_equations_2a_2c():
    p = tiny()
    A, B, pi = p.log_trans().exp(), p.log_emit().exp(), p.log_start().exp()
    assert A.shape == (4, 4) and B.shape == (4, 6) and pi.shape == (4,)
    for t, dim in ((A, 1), (B, 1), (pi, 0)):
        assert torch.allclose(t.sum(dim), torch.ones(()).double())
    # a_ij ∝ exp(u_j . z_i), b_ik ∝ exp(v_k . w_i), pi_i ∝ exp(u_i . z_start)
    i, j, k = 1, 2, 3
    ea = torch.exp(p.z[i] @ p.u.T)
    assert torch.allclose(A[i, j], ea[j] / ea.sum())
    eb = torch.exp(p.w[i] @ p.v.T)
    assert torch.allclose(B[i, k], eb[k] / eb.sum())
    ep = torch.exp(p.u @ p.z_start)
    assert torch.allclose(pi, ep / ep.sum())
    # emissions do not depend on u or z; transitions not on w or v; the start uses u, not z
    (B.sum() + (B * torch.arange(6.0).double()).sum()).backward()
    assert p.u.grad is None and p.z.grad is None and p.w.grad.abs().sum() > 0
    p.zero_grad()
    (pi * torch.arange(4.0).double()).sum().backward()
    assert p.z.grad is None and p.w.grad is None and p.u.grad.abs().sum() > 0


def test_stationary_distribution_is_stationary():
    p = tiny(n=7)
    A = p.log_trans().exp().detach()
    pi = dh.stationary(A)
    assert torch.allclose(pi @ A, pi, atol=1e-12) and abs(float(pi.sum()) - 1) < 1e-12 and (pi > 0).all()
    assert torch.allclose(pi, torch.linalg.matrix_power(A, 200)[0], atol=1e-10)


def test_m_step_objective_gradient_matches_finite_differences():
    torch.manual_seed(0)
    p = tiny()
    c = bw.Counts(torch.rand(4).double(), torch.rand(4, 4).double(), torch.rand(4, 6).double(), 0.0, 10)

    def f(u, z, w, v, z_start):  # App. A's L^dense written out from eqs. 2a-2c
        ls = torch.log_softmax(u @ z_start, 0)
        lt = torch.log_softmax(z @ u.T, 1)
        le = torch.log_softmax(w @ v.T, 1)
        return ((c.start * ls).sum() + (c.trans * lt).sum() + (c.emit * le).sum()) / c.tokens

    params = tuple(t.detach().clone().requires_grad_() for t in (p.u, p.z, p.w, p.v, p.z_start))
    assert torch.autograd.gradcheck(f, params)  # autograd against finite differences
    obj = dh.expected_loglik(p, c)
    assert abs(float(obj.detach()) - float(f(*params).detach())) < 1e-12
    obj.backward()
    grads = torch.autograd.grad(f(*params), params)
    for mine, ref in zip((p.u.grad, p.z.grad, p.w.grad, p.v.grad, p.z_start.grad), grads, strict=True):
        assert torch.allclose(mine, ref, atol=1e-12)


def test_frobenius_objective_equals_direct_computation_and_its_gradient_checks():
    p = tiny(n=3, m=5, l=2, seed=1)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 5, (30,), generator=gen).tolist() for _ in range(4)]
    omega = dh.empirical_cooc(seqs, 5, dtype=torch.float64)
    dense = omega.to_dense()
    assert abs(float(dense.sum()) - 1) < 1e-12 and dense[seqs[0][0], seqs[0][1]] > 0
    sq = float((dense ** 2).sum())
    A, B = p.log_trans().exp(), p.log_emit().exp()
    pi = dh.stationary(A)
    direct = ((dense - B.T @ torch.diag(pi) @ A @ B) ** 2).sum() / sq
    assert torch.allclose(dh.cooc_objective(p, omega, sq), direct, rtol=1e-10, atol=1e-14)

    def f(u, z, w, v):
        A = torch.softmax(z @ u.T, 1)
        B = torch.softmax(w @ v.T, 1)
        return ((dense - B.T @ torch.diag(dh.stationary(A)) @ A @ B) ** 2).sum() / sq

    params = tuple(t.detach().clone().requires_grad_() for t in (p.u, p.z, p.w, p.v))
    assert torch.autograd.gradcheck(f, params)
    # the module's gradient equals that of the direct formula
    dh.cooc_objective(p, omega, sq).backward()
    grads = torch.autograd.grad(f(*params), params)
    for mine, ref in zip((p.u.grad, p.z.grad, p.w.grad, p.v.grad), grads, strict=True):
        assert torch.allclose(mine, ref, atol=1e-10)


def loglik(p: bw.HMMParams, seqs: list[list[int]]) -> float:
    b = Batch.from_lists(seqs)
    log_cond, _ = chain.forward(p.start.expand(len(seqs), -1), p.emit.T[b.ids], p.trans, b.lengths)
    return float(log_cond.sum())


def test_em_with_gradient_m_step_never_decreases_the_likelihood():
    A, B, pi = synthetic(4, seed=3)
    seqs = sample_hmm(A, B, pi, 10, 60, torch.Generator().manual_seed(4))
    batches = [Batch.from_lists(seqs)]
    model = tiny(n=4, m=4, l=3, seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    lls = []
    for _ in range(6):
        c = bw.e_step(model.probs(), batches)
        lls.append(c.loglik)
        before = float(dh.expected_loglik(model, c))
        after = dh.gradient_m_step(model, c, opt, steps=10)
        assert after >= before
    lls.append(loglik(model.probs(), seqs))
    assert all(b >= a - 1e-9 for a, b in zip(lls, lls[1:], strict=False)), lls
    assert lls[-1] > lls[0] + 1.0


def test_cooc_fit_recovers_a_tiny_hmms_cooccurrence_matrix():
    A, B, _ = synthetic(3, seed=7)
    gt = dh.model_cooc(A, B)
    omega = gt.to_sparse()
    sq = float((gt ** 2).sum())
    model = tiny(n=3, m=3, l=3, seed=8)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    start = float(dh.cooc_objective(model, omega, sq))
    for _ in range(1500):
        dh.cooc_step(model, opt, omega, sq)
    with torch.no_grad():
        fit = dh.model_cooc(model.log_trans().exp(), model.log_emit().exp())
    mad = float((fit - gt).abs().mean())
    assert float(dh.cooc_objective(model, omega, sq)) < 1e-3 < start
    assert mad < 5e-3, mad


def test_train_exports_hmm_artifact_with_paper_vectors(tmp_path):
    from latentlm.models.registry import load_artifact
    from latentlm.training.settings import resolve_settings
    from tests.training.helpers import train_args
    from tests.training.test_resume import tiny_corpus

    for fit in ("em", "cooc"):
        ns = resolve_settings(train_args(tmp_path, "densehmm", name=f"d-{fit}", data=[tiny_corpus(tmp_path)],
                                         states=6, hidden=3, epochs=3, fit=fit, lr=0.05, batch=32))
        art = load_artifact(dh.train(ns))
        assert art.family == "hmm" and art.manifest["config"]["densehmm_fit"] == fit
        t = art.tensors
        V = t["emit"].shape[1]
        assert t["state_vectors"].shape == (6, 3) and t["word_vectors"].shape == (V, 3)
        assert t["state_in_vectors"].shape == t["state_out_vectors"].shape == (6, 3)
        # the exported emissions are softmax(W V^T) of the exported vectors
        emit = torch.softmax(t["state_vectors"].double() @ t["word_vectors"].double().T, 1)
        assert torch.allclose(emit.float(), t["emit"], atol=1e-5)
        trans = torch.softmax(t["state_out_vectors"].double() @ t["state_in_vectors"].double().T, 1)
        assert torch.allclose(trans.float(), t["trans"], atol=1e-5)
        if fit == "cooc":  # start = stationary distribution of A
            assert torch.allclose(t["start"].double(), dh.stationary(t["trans"].double()), atol=1e-4)
        else:
            start = torch.softmax(t["state_in_vectors"].double() @ t["start_vector"].double(), 0)
            assert torch.allclose(start.float(), t["start"], atol=1e-5)
        rows = art.manifest["provenance"]["curve"]
        assert rows[-1]["valid_ppl"] <= rows[0]["valid_ppl"]


def test_em_tied_variant_trains_and_differs_from_the_paper_model(tmp_path):
    """`--fit em-tied`: emissions from the outgoing vectors plus a word bias, start from the outgoing
    vectors; EM improves it and it exports the outgoing vectors as `state_vectors`."""
    from latentlm.models.registry import load_artifact
    from latentlm.training.settings import resolve_settings
    from tests.training.helpers import train_args
    from tests.training.test_resume import tiny_corpus

    g = torch.Generator().manual_seed(0)
    tied = dh.TiedDenseParams(5, 7, 3, g)
    assert not hasattr(tied, "w") and tied.word_bias.shape == (7,)
    with torch.no_grad():
        tied.word_bias[2] = 3.0
        emit = torch.softmax(tied.z @ tied.v.T + tied.word_bias, 1)
        assert torch.allclose(tied.log_emit().exp(), emit)
        assert torch.allclose(tied.log_start().exp(), torch.softmax(tied.z @ tied.z_start, 0))
    ns = resolve_settings(train_args(tmp_path, "densehmm", name="d-tied", data=[tiny_corpus(tmp_path)],
                                     states=6, hidden=3, epochs=3, fit="em-tied", lr=0.05, batch=32))
    art = load_artifact(dh.train(ns))
    assert art.manifest["config"]["densehmm_fit"] == "em-tied"
    assert torch.equal(art.tensors["state_vectors"], art.tensors["state_out_vectors"])
    rows = art.manifest["provenance"]["curve"]
    assert rows[-1]["valid_ppl"] < rows[0]["valid_ppl"]
