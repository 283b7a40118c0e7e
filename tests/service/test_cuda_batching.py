"""The service's batching where models run on CUDA: device-aware batch sizes (settings, the batcher, `ops.run`),
and the fused scoring path's shape buckets under dynamic batching (few runners, i.e. few CUDA-graph captures,
and results equal to the chain engine's).

No GPU needed: the fused path runs on CPU tensors (its PyTorch ops, `impl="torch"`, or Triton's interpreter),
forced with `bucket=True` as it is on CUDA; "cuda" devices are only named where nothing runs on them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time

import pytest
import torch
from fastapi.testclient import TestClient

from latentlm import ops
from latentlm.models import chain
from latentlm.models import triton_chain as tc
from latentlm.models.backend import Backend
from latentlm.models.base import Batch
from latentlm.models.blocked_hmm import BlockedHMM
from latentlm.models.results import Score
from latentlm.service import settings as settings_mod
from latentlm.service.app import create_app
from latentlm.service.batcher import Batcher
from latentlm.service.metrics import Metrics
from latentlm.service.settings import Settings

from .conftest import V, add_model, prepared


# -- batch sizes by device -----------------------------------------------------------------------------------
def test_settings_defaults_by_device(monkeypatch):
    for k in ("LATENTLM_MAX_BATCH_TOKENS", "LATENTLM_JOB_CHUNK_SIZE", "LATENTLM_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    cpu = Settings.from_env(device="cpu")
    assert (cpu.max_batch_tokens, cpu.job_chunk_size) == (16384, 32) == (Settings().max_batch_tokens, 32)
    gpu = Settings.from_env(device="cuda")
    assert (gpu.max_batch_tokens, gpu.job_chunk_size) == (settings_mod.CUDA_DEFAULTS["max_batch_tokens"],
                                                          settings_mod.CUDA_DEFAULTS["job_chunk_size"])
    assert gpu.max_batch_tokens >= 1 << 18 and Settings.from_env(device="cuda:1").job_chunk_size == 512
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Settings.from_env().max_batch_tokens == 1 << 18  # auto on a machine with a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Settings.from_env().max_batch_tokens == 16384
    # what is set explicitly wins on any device
    monkeypatch.setenv("LATENTLM_JOB_CHUNK_SIZE", "7")
    s = Settings.from_env(device="cuda", max_batch_tokens=999)
    assert (s.max_batch_tokens, s.job_chunk_size) == (999, 7)


def test_batch_tokens_and_device_batches():
    assert ops.batch_tokens("cpu") == ops.CPU_BATCH_TOKENS == 16384
    assert ops.batch_tokens(torch.device("cuda")) == ops.CUDA_BATCH_TOKENS == 1 << 18
    assert ops.batch_tokens("cuda", 100) == 100 and ops.batch_tokens("cuda", 0) == 1 << 18
    seqs = [[1] * 50 for _ in range(2000)]
    assert len(ops.device_batches(seqs, 16384, "cpu")) == 7  # 327 rows of 50 tokens per batch
    assert [len(b) for b in ops.device_batches(seqs, 1 << 18, "cuda")] == [2000]
    # on CUDA a large batch is cut where the length doubles; small ones stay whole
    mixed = [[1] * 10] * 300 + [[1] * 30] * 300 + [[1] * 31] * 5
    assert [len(b) for b in ops.device_batches(mixed, 1 << 18, "cuda")] == [300, 305]
    few = [[1] * 10] * 20 + [[1] * 300] * 3
    assert [len(b) for b in ops.device_batches(few, 1 << 18, "cuda")] == [23]
    for batches in (ops.device_batches(mixed, 1000, "cuda"), ops.device_batches(mixed, 1000, "cpu")):
        assert sorted(i for b in batches for i in b) == list(range(len(mixed)))
        assert all(len(b) * max(len(mixed[i]) for i in b) <= 1000 for b in batches)


def test_batcher_cap_follows_the_models_device():
    b = Batcher(Metrics())
    assert b.cap_for(type("M", (), {"device": torch.device("cuda")})()) == 1 << 18
    assert b.cap_for(type("M", (), {"device": torch.device("cpu")})()) == 16384
    assert Batcher(Metrics(), max_batch_tokens=500).cap_for(type("M", (), {"device": "cuda"})()) == 500


class _Recorder:
    """An `op_score` runner that records the batch sizes it is handed."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def op_score(self, seqs, **_):
        self.calls.append(len(seqs))
        return [Score(-1.0, len(s)) for s in seqs]


def test_run_on_cuda_hands_large_batches(base_store):
    m = ops.load_model(base_store, "tiny")
    rec = _Recorder()
    m.runners["score"] = rec
    seqs = [[1] * 50 for _ in range(3000)]
    ops.run(m, "score", seqs)
    assert len(rec.calls) == 10  # CPU: 16k tokens per call
    rec.calls.clear()
    m.device = torch.device("cuda")  # only the batching reads it here
    out = ops.run_merged(m, "score", [seqs[:1000], seqs[1000:]])
    assert rec.calls == [3000] and [r["index"] for r in out[1]][:3] == [0, 1, 2]


# -- the fused path's buckets under dynamic batching -------------------------------------------------------------
@pytest.fixture
def fused_on_cpu(monkeypatch):
    """blocked_hmm `score` on the fused path as on CUDA (buckets, runner cache), with its PyTorch ops on CPU."""
    monkeypatch.setattr(BlockedHMM, "score_backend", lambda self, backend=Backend.AUTO, width=0: Backend.CUDA_FUSED)
    monkeypatch.setattr(tc, "blocked_forward_cuda",
                        functools.partial(tc.blocked_forward_cuda, bucket=True, impl="torch"))
    tc.clear_cache()
    yield tc.stats
    tc.clear_cache()


@pytest.fixture
def blocked_store(tmp_path):
    store = tmp_path / "store"
    add_model(store, "blk", "blocked_hmm", seed=3)
    return store


def _requests(n: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(V - 2) for _ in range(rng.randint(20, 40))] for _ in range(rng.randint(1, 8))]
            for _ in range(n)]


def test_dynamic_batches_reuse_few_runners_and_stay_exact(blocked_store, fused_on_cpu):
    m = ops.load_model(blocked_store, "blk")
    reqs = _requests(60, seed=1)
    want = [ops.run(m, "score", r, token_logprobs=True) for r in reqs]  # one request per call
    tc.clear_cache()

    async def go():
        b = Batcher(Metrics(), max_batch_tokens=1 << 18, max_queue_delay_ms=5)
        await b.start()
        try:
            outs = []
            for wave in range(4):  # waves of different sizes: every merged batch another (B, T)
                part = reqs[wave * 15: wave * 15 + 3 + 4 * wave]
                outs += await asyncio.gather(*(b.submit(prepared(m, "score", r, token_logprobs=True)) for r in part))
            return outs
        finally:
            await b.stop()

    outs = asyncio.run(go())
    got_reqs = [reqs[w * 15 + i] for w in range(4) for i in range(3 + 4 * w)]
    got_want = [want[w * 15 + i] for w in range(4) for i in range(3 + 4 * w)]
    assert len(outs) == len(got_reqs)
    for out, ref in zip(outs, got_want, strict=True):
        for a, b in zip(out, ref, strict=True):
            assert a["index"] == b["index"]
            assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-6, abs=1e-6)
            assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], rel=1e-6, abs=1e-6)
    # the merged batches had T 20..40 (buckets 24, 32, 48) and B from a few rows to ~100: a handful of runners
    assert fused_on_cpu["runners"] <= 8 and fused_on_cpu["evictions"] == 0


def test_fused_results_equal_the_chain_engine(blocked_store, fused_on_cpu):
    m = ops.load_model(blocked_store, "blk")
    seqs = [s for r in _requests(10, seed=2) for s in r]
    fused = ops.run(m, "score", seqs, token_logprobs=True)
    assert fused_on_cpu["runners"] >= 1
    batch = Batch.from_lists(seqs)
    init, emit, trans = m.impl.chain(batch)
    log_cond, _ = chain.forward(init, emit, trans, batch.lengths, backend="torch")
    for i, r in enumerate(fused):
        assert r["token_logprobs"] == pytest.approx(log_cond[i, : len(seqs[i])].double().tolist(), abs=1e-5)


def test_batch_job_runs_one_large_merged_call(blocked_store, tmp_path, fused_on_cpu, monkeypatch):
    calls: list[tuple[int, int]] = []
    inner = tc.blocked_forward_cuda

    def counted(*a, **kw):
        ids = a[4]
        calls.append(tuple(ids.shape))
        return inner(*a, **kw)

    monkeypatch.setattr(tc, "blocked_forward_cuda", counted)
    s = Settings(store=blocked_store, device="cpu", state_dir=tmp_path / "state",
                 **settings_mod.CUDA_DEFAULTS)  # the CUDA defaults, on a CPU model
    reqs = _requests(300, seed=3)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/score", "body": {"model": "blk", "input": r}}
             for i, r in enumerate(reqs)]
    with TestClient(create_app(s)) as c:
        deadline = time.time() + 60
        while c.get("/ready").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        data = "".join(json.dumps(ln) + "\n" for ln in lines).encode()
        fid = c.post("/v1/files", files={"file": ("in.jsonl", data, "application/jsonl")},
                     data={"purpose": "batch"}).json()["id"]
        bid = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/score"}).json()["id"]
        while (b := c.get(f"/v1/batches/{bid}").json())["status"] not in ("completed", "failed"):
            assert time.time() < deadline, b
            time.sleep(0.05)
        assert b["status"] == "completed" and b["request_counts"]["completed"] == 300
        out = [json.loads(ln) for ln in c.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()]
    n_seqs = sum(len(r) for r in reqs)
    assert len(calls) == 1 and calls[0][0] == n_seqs  # 300 lines, one merged call
    m = ops.load_model(blocked_store, "blk")
    byid = {o["custom_id"]: o["response"]["body"]["data"] for o in out}
    for i in (0, 150, 299):
        ref = ops.run(m, "score", reqs[i])
        assert [d["logprob"] for d in byid[f"r{i}"]] == pytest.approx([d["logprob"] for d in ref], rel=1e-6)
