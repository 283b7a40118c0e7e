"""The fused CUDA scoring path wired into the engine: `backend.score` (which engine a family's `score` runs
on), explicit `backend="cuda_fused"`, the storage dtype, `describe()`'s backend field and the registry's
setting and cache sweep.

Without a GPU the decision is tested with fake devices; the fused path itself runs in Triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported, as tests/models/test_triton.py does) on CPU tensors.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from latentlm.models import backend as dispatch  # noqa: E402
from latentlm.models import chain  # noqa: E402
from latentlm.models import triton_chain as tc  # noqa: E402
from latentlm.models.backend import Backend  # noqa: E402
from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.hmm import DenseHMM  # noqa: E402
from latentlm.models.rank_hmm import RankHMM  # noqa: E402
from latentlm.models.registry import save_artifact  # noqa: E402
from latentlm.models.synthetic import random_blocked_hmm, random_hmm, random_rank_hmm  # noqa: E402
from latentlm.models.vocab import Vocabulary  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
GPU = torch.device("cuda")
CPU = torch.device("cpu")
F32 = torch.float32
needs_fused = pytest.mark.skipif(not tc.available(DEV), reason="triton not installed (pip install triton)")


@pytest.fixture(autouse=True)
def _fresh_cache():
    tc.clear_cache()
    yield
    tc.clear_cache()


def decide(backend="auto", device=GPU, dtype=F32, fused=True, grad=False, width=10, ready=True):
    return dispatch.score(backend, device=device, dtype=dtype, fused=fused, grad=grad, width=width, ready=ready)


# -- the decision ------------------------------------------------------------------------------------------
def test_auto_picks_fused_only_on_cuda_for_float32_families_that_have_it():
    assert decide() is Backend.CUDA_FUSED
    assert decide(device="cuda:1") is Backend.CUDA_FUSED
    # everything else goes to the chain engine, which decides per call ("auto")
    assert decide(device=CPU) is Backend.AUTO  # even where the interpreter could run it
    assert decide(fused=False) is Backend.AUTO  # dense hmm, tagging hmm
    assert decide(dtype=torch.float64) is Backend.AUTO
    assert decide(grad=True) is Backend.AUTO
    assert decide(ready=False) is Backend.AUTO  # no triton / CUDA unusable
    assert decide(width=dispatch.FUSED_MAX_TOKENS) is Backend.AUTO  # long batches: chunked on the chain engine
    assert decide(width=dispatch.FUSED_MAX_TOKENS - 1) is Backend.CUDA_FUSED


def test_named_chain_engines_pass_through():
    for b in ("torch", "single", "groups", "lockstep"):
        assert decide(b) is Backend(b)
        assert decide(b, device=CPU) is Backend(b)


@pytest.mark.parametrize("kw,why", [
    (dict(device=CPU, ready=False), r"runs on CUDA tensors and the model is on cpu"),
    (dict(ready=False), r"triton is not importable or CUDA is not available"),
    (dict(fused=False), r"no fused scoring path"),
    (dict(dtype=torch.float64), r"needs a float32 model"),
    (dict(grad=True), r"autograd"),
])
def test_explicit_cuda_fused_refuses_with_the_reason(kw, why):
    with pytest.raises(ValueError, match=r"backend 'cuda_fused' cannot run this call: .*" + why):
        decide("cuda_fused", **kw)


def test_explicit_cuda_fused_runs_any_width():
    assert decide("cuda_fused", width=10**6) is Backend.CUDA_FUSED


def test_chain_engine_calls_refuse_cuda_fused():
    t, c = random_rank_hmm(12, 8, 20, seed=1)
    model = RankHMM.from_tensors(t, c)
    batch = Batch.from_lists([[1, 2, 3]])
    init, emit, trans = model.chain(batch)
    with pytest.raises(ValueError, match="not chain calls"):
        chain.forward(init, emit, trans, batch.lengths, backend="cuda_fused")
    with pytest.raises(ValueError, match="not chain calls"):
        chain.viterbi(*model.log_chain(batch), batch.lengths, backend="cuda_fused")


def test_available_asks_triton_chain(monkeypatch):
    monkeypatch.setattr(tc, "_triton", lambda: None)
    assert not dispatch.available("cuda_fused")


def test_storage_dtype_names():
    assert dispatch.storage_dtype(None) is torch.float32
    assert dispatch.storage_dtype("BFloat16") is torch.bfloat16
    assert dispatch.storage_dtype(torch.bfloat16) is torch.bfloat16
    for bad in ("float16", torch.float64):
        with pytest.raises(ValueError, match="storage dtype: expected one of"):
            dispatch.storage_dtype(bad)


# -- through the family ------------------------------------------------------------------------------------
def rank_model(**kw):
    t, c = random_rank_hmm(24, 16, 30, seed=3)
    return RankHMM.from_tensors(t, c, device=DEV, **kw)


def blocked_model(**kw):
    t, c = random_blocked_hmm(4, 8, 30, seed=4)
    return BlockedHMM.from_tensors(t, c, device=DEV, **kw)


def a_batch(V=30, B=5, T=9, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return Batch(ids, lengths)


def torch_score(model, batch):
    init, emit, trans = model.chain(model.to(batch))
    log_cond, _ = chain.forward(init, emit, trans, batch.lengths.to(model.device), backend="torch")
    return log_cond.double().sum(1), log_cond


def test_explicit_cuda_fused_on_cpu_raises_through_the_family(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a CPU server sees
    model = rank_model() if not CUDA else RankHMM.from_tensors(*random_rank_hmm(24, 16, 30, seed=3))
    with pytest.raises(ValueError, match="model is on cpu"):
        model.score(a_batch(), backend="cuda_fused")
    dense = DenseHMM.from_tensors(*random_hmm(8, 30, seed=1))
    with pytest.raises(ValueError, match="no fused scoring path"):
        dense.score(a_batch(), backend="cuda_fused")


@needs_fused
@pytest.mark.parametrize("make", [rank_model, blocked_model], ids=["rank_hmm", "blocked_hmm"])
def test_fused_through_the_family_equals_the_torch_engine(make):
    model, batch = make(), a_batch()
    logp, lc = model.score(batch, backend="cuda_fused")
    want_logp, want_lc = torch_score(model, batch)
    assert lc.dtype == model.dtype and lc.shape == want_lc.shape
    assert torch.allclose(lc.double().cpu(), want_lc.double().cpu(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(logp.cpu(), want_logp.cpu(), rtol=1e-5, atol=1e-5)
    # auto runs the chain engine on CPU and the fused path on CUDA: the same numbers either way
    auto_logp, _ = model.score(batch)
    assert torch.allclose(auto_logp.cpu(), want_logp.cpu(), rtol=1e-5, atol=1e-5)


@needs_fused
@pytest.mark.parametrize("make", [rank_model, blocked_model], ids=["rank_hmm", "blocked_hmm"])
def test_bf16_storage_applies_to_the_fused_path_only(make):
    model, batch = make(storage_dtype="bfloat16"), a_batch(seed=6)
    assert model.storage_dtype is torch.bfloat16 and model.dtype is torch.float32
    _, lc = model.score(batch, backend="cuda_fused")
    _, want = torch_score(model, batch)
    err = (lc.double() - want.double()).abs().max().item()
    assert err <= dispatch.BF16_TOKEN_ABS_BOUND
    # the chain engine (every other operation too) keeps the model's float32 tensors
    _, lc32 = model.score(batch, backend="torch")
    assert torch.equal(lc32, want)


# -- describe() and auto through the family on a (pretended) GPU ------------------------------------------------
def pretend_cuda(model, monkeypatch, ready=True):
    monkeypatch.setattr(model, "device", GPU, raising=False)
    monkeypatch.setattr(dispatch, "_fused_ready", lambda device: ready)
    return model


def test_describe_reports_the_score_backend(monkeypatch):
    rank = RankHMM.from_tensors(*random_rank_hmm(24, 16, 30, seed=3))
    blocked = BlockedHMM.from_tensors(*random_blocked_hmm(4, 8, 30, seed=4))
    dense = DenseHMM.from_tensors(*random_hmm(8, 30, seed=1))
    # on CPU: the chain engine's choice for a batch of a few sequences
    rank_backend = rank.describe()["backend"]
    assert {k: rank_backend[k] for k in ("score", "storage_dtype")} == {
        "score": Backend.LOCKSTEP.value if dispatch.available("lockstep") else "groups", "storage_dtype": "float32"}
    assert rank_backend["calibrated"] is False  # nothing measured yet (`calibrate()`, done by the service at load)
    # per-step blocks: the compiled blocked sweeps (reported as "groups"), or torch ops without numba
    assert blocked.describe()["backend"] == {"score": "groups" if dispatch.available("groups") else "torch",
                                             "storage_dtype": "float32"}
    assert dense.describe()["backend"]["score"] in ("lockstep", "groups")
    assert rank.describe()["rank"] == 16 and blocked.describe()["num_clusters"] == 4
    # on a GPU with triton: the fused path, in its storage dtype
    for m in (rank, blocked):
        m.set_storage_dtype("bfloat16")
        pretend_cuda(m, monkeypatch)
        assert m.describe()["backend"] == {"score": "cuda_fused", "storage_dtype": "bfloat16"}
        assert m.score_backend() is Backend.CUDA_FUSED
    assert pretend_cuda(dense, monkeypatch).score_backend() is Backend.AUTO


def test_auto_on_cuda_calls_score_fused_only_for_score(monkeypatch):
    model = rank_model()
    calls = []
    real = model.score_fused
    monkeypatch.setattr(model, "score_fused", lambda batch: calls.append(batch) or real(batch))
    monkeypatch.setattr(dispatch, "_fused_ready", lambda device: True)
    monkeypatch.setattr(dispatch, "score", lambda backend, **kw: Backend.CUDA_FUSED if Backend(backend) in
                        (Backend.AUTO, Backend.CUDA_FUSED) else Backend(backend))
    batch = a_batch()
    if tc.available(DEV):
        model.score(batch)
        assert len(calls) == 1
    model.posterior(batch)
    model.viterbi(batch)
    model.op_sample(n=2, max_tokens=3, seed=0)
    assert len(calls) == (1 if tc.available(DEV) else 0)  # posteriors, Viterbi, sampling: their own paths


# -- the service registry ----------------------------------------------------------------------------------
def vocab(V=30) -> Vocabulary:
    return Vocabulary([*(f"w{i}" for i in range(V - 2)), "<unk>", "<eos>"])


def test_registry_storage_dtype_setting_and_cache_sweep(tmp_path, monkeypatch):
    from latentlm.service import registry as reg_mod
    from latentlm.service.registry import ModelRegistry

    def save(name, family, made):
        save_artifact(tmp_path, name, family, made[0], vocab(), config=made[1])

    save("r", "rank_hmm", random_rank_hmm(24, 16, 30, seed=1))
    save("d", "hmm", random_hmm(8, 30, seed=1))
    monkeypatch.setenv("LATENTLM_STORAGE_DTYPE", "bfloat16")
    reg = ModelRegistry(tmp_path)
    assert reg.storage_dtype is torch.bfloat16
    assert ModelRegistry(tmp_path, storage_dtype="float32").storage_dtype is torch.float32
    with pytest.raises(ValueError, match="storage dtype"):
        ModelRegistry(tmp_path, storage_dtype="float16")
    cleared = []
    monkeypatch.setattr(tc, "clear_cache", lambda: cleared.append(1))
    reg.reload()
    assert reg.get("r").impl.storage_dtype is torch.bfloat16 and not cleared  # nothing unloaded yet
    assert reg.get("r").describe()["backend"]["score"] != "cuda_fused"  # CPU
    save("r", "rank_hmm", random_rank_hmm(24, 16, 30, seed=2))
    assert reg.reload()["updated"] == ["r"] and len(cleared) == 1  # replaced
    assert reg.reload()["updated"] == [] and len(cleared) == 1
    shutil.rmtree(tmp_path / "d")
    assert reg.reload()["removed"] == ["d"] and len(cleared) == 2  # unloaded

    def boom():
        raise RuntimeError("no")

    monkeypatch.setattr(tc, "clear_cache", boom)
    reg_mod._clear_fused_cache()  # logged, never raised
