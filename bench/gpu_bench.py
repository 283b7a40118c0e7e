"""GPU scoring kernels (models/triton_chain.py) next to the shared yardstick, in one process on one device.

Cases (the issue's targets): rank_hmm r = 4096 at batch 256 and 1024 (>= 2x and >= 1.5x the yardstick), blocked_hmm
2^15 states, k = 256, batch 1024 (>= 3x); T = 64, V = 10,000. For each: the yardstick's plain PyTorch loop, the
family's `.score()` (the chain engine as it is), and `triton_chain` in float32 (exact), TF32 and bfloat16 storage
(blocked: one-sequence-per-program FMA kernel and the 16-row tl.dot kernel, a few tilings). Also measured in the
same run: the bf16 / TF32 / fp32 matmul peak and the device copy bandwidth, so each rate is reported against what
this device reaches. Errors of the fast variants are reported against the exact float32 result (log p(x)).

Its length (over 600 lines) is one self-contained script a GPU loan runs at once: every case, its references and
its report, with nothing to install or import from other benches.

    python bench/gpu_bench.py [--yardstick PATH] [--out bench/results/gpu_bench.md] [--json FILE]
    python bench/gpu_bench.py --small     # tiny shapes; on CPU the Triton kernels run in the interpreter
    python bench/gpu_bench.py --mode service [--small]   # `latentlm serve` under load (warm-up pass, measured
        pass with the batcher's figures from /metrics), then a batch job through /v1/files + /v1/batches
    python bench/gpu_bench.py --mode service --engine process --workers 4 --seqs-per-request 1 --no-job
        # the same load as one sentence per request from API workers handing them to the engine process (a
        # redis-server on PATH is started for several workers; without one, one worker)

Prints one JSON line per measurement and writes a markdown table (device name and date in its header).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if "--small" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from latentlm.models import triton_chain as tc  # noqa: E402
from latentlm.models.base import Batch  # noqa: E402
from latentlm.models.blocked_hmm import BlockedHMM  # noqa: E402
from latentlm.models.rank_hmm import RankHMM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FULL = {"rank": dict(r=4096, V=10000, T=64, batches=(256, 1024)),
        "blocked": dict(M=128, k=256, V=10000, T=64, B=1024)}
SMALL = {"rank": dict(r=32, V=50, T=6, batches=(4, 8)), "blocked": dict(M=4, k=16, V=50, T=6, B=8)}
TARGETS = {("rank", 256): 2.0, ("rank", 1024): 1.5, ("blocked", 1024): 3.0}
ROWS: list[dict] = []
QUICK = {"reps": 3, "subset": None}  # --small: one rep and a few variants (the interpreter is slow)
SMALL_VARIANTS = {"triton fp32", "triton bf16", "torch-ops+graph bf16", "engine", "triton fp32 rows",
                  "triton bf16 dot16", "torch-ops+graph fp32"}


DEADLINE = {"t": math.inf}  # --deadline-s: variants not started by then are skipped (the markdown is kept)
REPORT: dict = {}


def wanted(name: str) -> bool:
    if time.time() > DEADLINE["t"]:
        emit({"case": "deadline", "skipped": name})
        return False
    return QUICK["subset"] is None or name in QUICK["subset"]


def default_yardstick() -> Path:
    shared = ROOT.parent / "shared" / "bench" / "gpu_yardstick.py"
    return shared if shared.exists() else ROOT / "bench" / ".yardstick" / "gpu_yardstick.py"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def best_of(fn, dev: torch.device, reps: int | None = None) -> float:
    reps = reps or QUICK["reps"]
    fn()
    sync(dev)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def emit(row: dict) -> dict:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def stochastic(*shape: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, device=dev, generator=g), dim=-1)


# -- device limits -----------------------------------------------------------------------------------------------
def peaks(dev: torch.device, small: bool) -> dict:
    n = 256 if small else 8192
    out = {}
    saved = torch.backends.cuda.matmul.allow_tf32
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        t = best_of(lambda a=a, b=b: torch.mm(a, b), dev, reps=5 if name != "fp32" else 2)
        out[f"matmul_{name}_tflops"] = 2 * n**3 / t / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = saved
    nbytes = (16 if small else 2048) << 20
    x = torch.empty(nbytes // 4, device=dev)
    y = torch.empty_like(x)
    t = best_of(lambda: y.copy_(x), dev, reps=5)
    out["copy_gbps"] = 2 * nbytes / t / 1e9  # read + write
    x = y = None
    free(dev)
    return emit({"case": "peak", **out})


# -- rank_hmm ----------------------------------------------------------------------------------------------------
def bench_rank(yard, shape: dict, dev: torch.device, peak: dict) -> None:
    r, V, T = shape["r"], shape["V"], shape["T"]
    g = torch.Generator(device=dev).manual_seed(0)
    R = stochastic(r, r, dev=dev, g=g)
    W = stochastic(r, V, dev=dev, g=g).T.contiguous()  # (V, r)
    s = stochastic(r, dev=dev, g=g)
    m = 64  # the state-space factors are not used by scoring; small ones keep the model cheap to build
    try:  # the engine path is only a comparison: a refactor in flight must not cost the kernel measurements
        model = RankHMM({"start": stochastic(m, dev=dev, g=g), "state_in": stochastic(m, r, dev=dev, g=g),
                         "state_out": stochastic(r, m, dev=dev, g=g), "emit": W, "rank_start": s, "rank_trans": R})
    except Exception as e:
        model = None
        emit({"case": "rank", "B": 0, "impl": "RankHMM(...)", "error": repr(e)[:400]})
    mem = {"fp32_mb": (r * r + V * r + r) * 4 / 2**20, "bf16_mb": (r * r + V * r) * 2 / 2**20 + r * 4 / 2**20}
    emit({"case": "rank", "model_memory": mem, "rank": r, "vocab": V})
    for B in shape["batches"]:
        ids = torch.randint(0, V, (B, T), device=dev, generator=g)
        lengths = torch.full((B,), T, device=dev)
        flops = 2 * r * r * B * T
        ys = yard.CASES["rank"](r=r, V=V, B=B, T=T)
        torch.backends.cuda.matmul.allow_tf32 = False  # the yardstick module turned TF32 on for itself
        free(dev)
        y_tps = ys["tokens_per_s"]
        emit({"case": "rank", "B": B, "impl": "yardstick (TF32)", "tokens_per_s": y_tps, "ratio": 1.0,
              "tflops": ys.get("tflops"), "pct_peak": 100 * ys.get("tflops", 0) / peak["matmul_tf32_tflops"]})
        try:
            batch = Batch(ids, lengths)
            with torch.no_grad():
                t = best_of(lambda batch=batch: model.score(batch), dev)
            emit({"case": "rank", "B": B, "impl": "RankHMM.score (auto backend, fp32)", "tokens_per_s": B * T / t,
                  "ratio": B * T / t / y_tps, "tflops": flops / t / 1e12,
                  "pct_peak": 100 * flops / t / 1e12 / peak["matmul_fp32_tflops"]})
        except Exception as e:
            emit({"case": "rank", "B": B, "impl": "RankHMM.score (auto backend, fp32)", "error": repr(e)[:400]})
        exact = None
        for name, kw, pk in (("triton fp32", dict(), "fp32"), ("triton tf32", dict(allow_tf32=True), "tf32"),
                             ("triton bf16", dict(storage_dtype=torch.bfloat16), "bf16"),
                             ("torch-ops+graph bf16", dict(storage_dtype=torch.bfloat16, impl="torch"), "bf16"),
                             ("triton bf16 no graph", dict(storage_dtype=torch.bfloat16, use_graph=False), "bf16")):
            if (name.startswith("triton") and not tc.available(dev)) or not wanted(name):
                continue
            if pk == "fp32" and B != max(shape["batches"]) and dev.type == "cuda":
                continue  # exact fp32 GEMMs are slow; once is enough
            fn = lambda kw=kw, ids=ids, lengths=lengths: tc.rank_forward_cuda(s, W, ids, lengths, R, **kw)  # noqa
            try:
                out = fn()
                t = best_of(fn, dev)
            except Exception as e:  # report and go on: one failure must not cost the whole run
                emit({"case": "rank", "B": B, "impl": name, "error": repr(e)[:400]})
                continue
            logp = out.double().sum(1)
            if exact is None:
                exact = tc.rank_forward_cuda(s, W, ids, lengths, R, use_graph=False, impl="torch").double().sum(1)
            err = ((logp - exact).abs() / exact.abs()).max().item()
            tps = B * T / t
            emit({"case": "rank", "B": B, "impl": name, "tokens_per_s": tps, "ratio": tps / y_tps,
                  "tflops": flops / t / 1e12, "pct_peak": 100 * flops / t / 1e12 / peak[f"matmul_{pk}_tflops"],
                  "max_rel_err_logp_vs_fp32": err, "target": TARGETS.get(("rank", B))})
        tc.clear_cache()
        free(dev)


# -- blocked_hmm -------------------------------------------------------------------------------------------------
def distinct_pairs(cl: torch.Tensor) -> int:
    M = int(cl.max()) + 1
    keys = cl[:, :-1] * M + cl[:, 1:]  # (B, T - 1)
    return int(sum(torch.unique(keys[:, t]).numel() for t in range(keys.shape[1])))


def bench_blocked(yard, shape: dict, dev: torch.device, peak: dict) -> None:
    M, k, V, T, B = shape["M"], shape["k"], shape["V"], shape["T"], shape["B"]
    Z = M * k
    ys = yard.CASES["blocked"](M=M, k=k, B=B, T=T)
    torch.backends.cuda.matmul.allow_tf32 = False
    free(dev)
    y_tps = ys["tokens_per_s"]
    emit({"case": "blocked", "B": B, "impl": "yardstick (gather + bmm)", "tokens_per_s": y_tps, "ratio": 1.0,
          "gbps_gathered": ys.get("gb_per_s_gathered")})
    g = torch.Generator(device=dev).manual_seed(1)
    trans = torch.empty(Z, Z, device=dev)
    for i in range(0, Z, 4096):  # row chunks: no second full-size temporary
        trans[i:i + 4096] = stochastic(min(4096, Z - i), Z, dev=dev, g=g)
    word_cluster = torch.arange(V, device=dev) % M
    raw = torch.rand(V, k, device=dev, generator=g)
    col = torch.zeros(M, k, device=dev).index_add_(0, word_cluster, raw)
    emit_t = raw / col[word_cluster]
    start = stochastic(Z, dev=dev, g=g)
    mem = {"fp32_mb": (Z * Z + V * k + Z) * 4 / 2**20, "bf16_mb": Z * Z * 2 / 2**20 + (V * k + Z) * 4 / 2**20}
    emit({"case": "blocked", "model_memory": mem, "states": Z, "clusters": M, "k": k})
    draws = {"uniform": torch.randint(0, V, (B, T), device=dev, generator=g)}
    # skewed clusters (as in text: a few frequent cluster pairs) -> sequences share blocks; not the yardstick's case
    zipf = 1.0 / torch.arange(1, M + 1, device=dev, dtype=torch.float64) ** 1.1
    cz = torch.multinomial(zipf.float(), B * T, replacement=True, generator=g).view(B, T)
    if QUICK["subset"] is None:
        draws["zipf clusters"] = cz + M * torch.randint(0, V // M, (B, T), device=dev, generator=g)
    lengths = torch.full((B,), T, device=dev)
    variants = [("engine", None), ("triton fp32 rows", dict(block_rows=1)),
                ("triton fp32 rows BK64 w8", dict(block_rows=1, block_k=64, num_warps=8)),
                ("triton tf32 dot16", dict(block_rows=16, allow_tf32=True)),
                ("triton bf16 rows", dict(block_rows=1, storage_dtype=torch.bfloat16)),
                ("triton bf16 rows BK64 w8", dict(block_rows=1, block_k=64, num_warps=8,
                                                  storage_dtype=torch.bfloat16)),
                ("triton bf16 dot16", dict(block_rows=16, storage_dtype=torch.bfloat16)),
                ("triton bf16 dot16 w8", dict(block_rows=16, num_warps=8, storage_dtype=torch.bfloat16)),
                ("torch-ops+graph fp32", dict(impl="torch"))]
    for draw, ids in draws.items():
        pairs = distinct_pairs(word_cluster[ids])
        exact = None
        for name, kw in variants:
            if not wanted(name):
                continue
            if name == "engine":
                if draw != "uniform":
                    continue
                try:
                    model = BlockedHMM(start, trans, emit_t, word_cluster, M, {})
                    batch = Batch(ids, lengths)
                    with torch.no_grad():
                        t = best_of(lambda batch=batch, model=model: model.score(batch), dev)
                    tps = B * T / t
                    emit({"case": "blocked", "B": B, "draw": draw, "impl": "BlockedHMM.score (auto backend, fp32)",
                          "tokens_per_s": tps, "ratio": tps / y_tps, "gbps_gathered": k * k * 4 * B * T / t / 1e9})
                except Exception as e:
                    emit({"case": "blocked", "B": B, "draw": draw, "impl": "BlockedHMM.score (auto backend, fp32)",
                          "error": repr(e)[:400]})
                model = batch = None
                free(dev)
                continue
            if name.startswith("triton") and not tc.available(dev):
                continue
            if name.startswith("torch") and draw != "uniform":
                continue
            fn = lambda kw=kw: tc.blocked_forward_cuda(start, trans, emit_t, word_cluster, ids, lengths, **kw)  # noqa
            try:
                out = fn()
                t = best_of(fn, dev)
            except Exception as e:
                emit({"case": "blocked", "B": B, "draw": draw, "impl": name, "error": repr(e)[:400]})
                continue
            if exact is None:
                exact = tc.blocked_forward_cuda(start, trans, emit_t, word_cluster, ids, lengths, use_graph=False,
                                                impl="torch").double().sum(1)
            err = ((out.double().sum(1) - exact).abs() / exact.abs()).max().item()
            item = 2 if kw.get("storage_dtype") == torch.bfloat16 else 4
            tps = B * T / t
            unique_gbps = pairs * k * k * item / t / 1e9
            emit({"case": "blocked", "B": B, "draw": draw, "impl": name, "tokens_per_s": tps, "ratio": tps / y_tps,
                  "gbps_gathered": k * k * 4 * B * T / t / 1e9, "gbps_unique_blocks": unique_gbps,
                  "pct_copy_bw": 100 * unique_gbps / peak["copy_gbps"], "distinct_pairs_per_step": pairs / (T - 1),
                  "max_rel_err_logp_vs_fp32": err,
                  "target": TARGETS.get(("blocked", B)) if draw == "uniform" else None})
        tc.clear_cache()
        free(dev)


# -- service under load (--mode service) --------------------------------------------------------------------------
def make_store(store: Path, small: bool) -> tuple[str, int]:
    """A 4,096-state blocked_hmm (16 clusters x 256 states, V = 10,000) with random weights (--small: 4 x 16,
    V = 200), saved as the tests save models."""
    try:
        from latentlm.models.registry import save_artifact
    except ImportError:
        from latentlm.models.store import save_artifact  # type: ignore[no-redef]
    from latentlm.models.synthetic import random_blocked_hmm
    from latentlm.models.vocab import Vocabulary

    M, k, V = (4, 16, 200) if small else (16, 256, 10000)
    t, c = random_blocked_hmm(M, k, V, seed=0)
    t = {n: (x.float() if x.is_floating_point() else x) for n, x in t.items()}
    vocab = Vocabulary([f"w{i}" for i in range(V - 2)] + ["<unk>", "<eos>"])
    save_artifact(store, "blocked4096", "blocked_hmm", t, vocab, config=c)
    return "blocked4096", V


def _metrics(text: str) -> dict[str, float]:
    """Sums of the batcher's Prometheus series for operation "score" (+ the tokens counter)."""
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("#") or 'operation="score"' not in ln:
            continue
        name = ln.split("{", 1)[0]
        if name.endswith(("_sum", "_count")) or name == "latentlm_tokens_processed_total":
            out[name] = out.get(name, 0.0) + float(ln.rsplit(" ", 1)[1])
    return out


def _batcher_figures(before: dict, after: dict, wall: float) -> dict:
    """What the inference thread did during a load: batches, mean tokens and requests per batch, mean batch
    (inference) seconds, the share of the wall it was busy, mean queue wait."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("latentlm_batch_seconds_count", 0.0)
    if not n:
        return {}
    return {"batches": int(n), "tokens_per_batch": d.get("latentlm_batch_tokens_sum", 0.0) / n,
            "requests_per_batch": d.get("latentlm_batch_requests_sum", 0.0) / n,
            "batch_ms": 1e3 * d.get("latentlm_batch_seconds_sum", 0.0) / n,
            "inference_busy": d.get("latentlm_batch_seconds_sum", 0.0) / wall,
            "queue_wait_ms": 1e3 * d.get("latentlm_queue_wait_seconds_sum", 0.0)
            / max(1.0, d.get("latentlm_queue_wait_seconds_count", 0.0))}


def service_load(args, dev: torch.device) -> dict:
    """`latentlm serve` (device defaults: on CUDA large merged batches) under `--concurrency` connections of
    8 x 50-token /v1/score requests: a warm-up pass (captures one CUDA graph per shape bucket), then the measured
    pass; then a batch job of `--job-lines` such lines through /v1/files + /v1/batches, timed end to end."""
    import asyncio
    import random
    import signal
    import socket
    import subprocess
    import tempfile

    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="latentlm-svc-"))
    store = tmp / "store"
    t0 = time.time()
    name, V = make_store(store, args.small)
    build_s = time.time() - t0
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    device = "cuda" if dev.type == "cuda" else "cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATENTLM_") and k != "REDIS_URL"}
    env.update(LATENTLM_STATE_DIR=str(tmp / "state"), PYTHONUNBUFFERED="1", LATENTLM_ENGINE=args.engine)
    workers, redis = args.workers, None
    if workers > 1:
        import shutil

        if shutil.which("redis-server") is None:
            workers = 1  # several workers need Redis; recorded in the row
        else:
            from serving import start_redis  # bench/serving.py

            redis, env["REDIS_URL"] = start_redis(tmp)
    env["LATENTLM_WORKERS"] = str(workers)
    log = tmp / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "latentlm.cli", "serve", "--store", str(store), "--port", str(port),
                             "--device", device, "--log-level", "warning"], env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)  # cwd: see gpu_check.sh
    url = f"http://127.0.0.1:{port}"
    row = {"case": "service", "device": device, "model_build_s": build_s, "engine": args.engine,
           "workers": workers, "workers_asked": args.workers,
           "model": "blocked_hmm 4 x 16 states" if args.small else "blocked_hmm 16 x 256 states"}
    job: dict = {"case": "service_batch_job", "device": device, "model": row["model"]}
    try:
        deadline = time.time() + args.ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-1500:]}")
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not ready after {args.ready_timeout} s: "
                                   f"{log.read_text(errors='replace')[-1500:]}")
            time.sleep(0.25)
        row["ready_s"] = time.time() - t0 - build_s
        rng = random.Random(0)
        conc, seqs, toks = (8 if args.small else args.concurrency), args.seqs_per_request, 50
        n_req = 32 if args.small else args.requests
        n_warm = 16 if args.small else args.warmup_requests

        def body() -> list[list[int]]:
            return [[rng.randrange(V - 2) for _ in range(toks)] for _ in range(seqs)]

        bodies = [json.dumps({"model": name, "input": body()}).encode() for _ in range(max(n_req, n_warm))]

        async def drive(n: int) -> tuple[float, float, list]:
            out: list = [None] * n
            it = iter(range(n))
            limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                await client.post("/v1/score", content=bodies[0], headers={"content-type": "application/json"})

                async def worker() -> None:
                    for i in it:
                        if time.perf_counter() - w0 > args.load_seconds:
                            break
                        t1 = time.perf_counter()
                        r = await client.post("/v1/score", content=bodies[i],
                                              headers={"content-type": "application/json"})
                        out[i] = (r.status_code, time.perf_counter() - t1, r.content)

                w0, c0 = time.perf_counter(), time.process_time()
                await asyncio.gather(*(worker() for _ in range(conc)))
                return time.perf_counter() - w0, time.process_time() - c0, out

        def load(n: int) -> dict:
            before = _metrics(httpx.get(url + "/metrics", timeout=30).text)
            wall, cpu, res = asyncio.run(drive(n))
            after = _metrics(httpx.get(url + "/metrics", timeout=30).text)
            res = [r for r in res if r is not None]
            ok = [r for r in res if r[0] == 200]
            lat = sorted(r[1] for r in ok) or [math.nan]
            sample = json.loads(ok[0][2]) if ok else None
            finite = sample is not None and "logprob" in json.dumps(sample) and "null" not in json.dumps(sample)
            return dict(requests=len(res), ok=len(ok), errors=len(res) - len(ok), wall_s=wall,
                        tokens_per_s=len(ok) * seqs * toks / wall, requests_per_s=len(ok) / wall,
                        p50_ms=1e3 * lat[len(lat) // 2],
                        p99_ms=1e3 * lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))],
                        finite_logprobs=finite, client_cpu_share=cpu / wall,  # ~1: the load generator is the limit
                        batcher=_batcher_figures(before, after, wall),
                        first_error=next((r[2][:300].decode(errors="replace") for r in res if r[0] != 200), None))

        warm = load(n_warm)
        row.update(concurrency=conc, seqs_per_request=seqs, tokens_per_seq=toks, **load(n_req),
                   warmup={k: warm[k] for k in ("requests", "tokens_per_s", "p99_ms", "batcher")})
        if args.no_job:
            job = {}
        else:
            job.update(batch_job(url, name, V, 64 if args.small else args.job_lines, seqs, toks, rng,
                                 args.job_timeout))
    except Exception as e:
        row["error"] = repr(e)[:1500]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if redis is not None:
            redis.terminate()
    if "error" in row or row.get("errors") or job.get("error") or job.get("request_counts", {}).get("failed"):
        row["server_log_tail"] = log.read_text(errors="replace")[-2000:]  # why the server refused them
    if "error" not in row and job:
        emit(job)
        if "error" in job:
            row["error"] = "batch job: " + job["error"]
    return emit(row)


def batch_job(url: str, name: str, V: int, lines: int, seqs: int, toks: int, rng, timeout: float) -> dict:
    """A /v1/score batch job of `lines` requests (seqs x toks tokens each): a small warm-up job, then the measured
    one: upload (/v1/files), run (/v1/batches until completed, polled every 10 ms), download; tokens/s of the run
    and end to end."""
    import httpx

    def make(n: int, tag: str) -> bytes:
        return "".join(json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/score",
                                   "body": {"model": name, "input": [[rng.randrange(V - 2) for _ in range(toks)]
                                                                     for _ in range(seqs)]}}) + "\n"
                       for i in range(n)).encode()

    def run(c: httpx.Client, data: bytes) -> dict:
        t0 = time.perf_counter()
        r = c.post("/v1/files", files={"file": ("in.jsonl", data, "application/jsonl")}, data={"purpose": "batch"})
        r.raise_for_status()
        t1 = time.perf_counter()
        b = c.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/score"}).json()
        while b.get("status") not in ("completed", "failed", "cancelled", "expired"):
            if time.perf_counter() - t1 > timeout:
                return {"error": f"batch job not done after {timeout} s: {b.get('status')} "
                                 f"{b.get('request_counts')}", "upload_s": t1 - t0}
            time.sleep(0.01)
            b = c.get(f"/v1/batches/{b['id']}").json()
        t2 = time.perf_counter()
        if b["status"] != "completed" or not b.get("output_file_id"):
            return {"error": f"batch job {b['status']}: {json.dumps(b.get('errors'))[:300]}"}
        out = c.get(f"/v1/files/{b['output_file_id']}/content").content
        t3 = time.perf_counter()
        return {"status": b["status"], "request_counts": b["request_counts"], "upload_s": t1 - t0, "run_s": t2 - t1,
                "download_s": t3 - t2, "output_bytes": len(out), "e2e_s": t3 - t0}

    with httpx.Client(base_url=url, timeout=120) as c:
        warm = run(c, make(min(64, lines), "w"))
        if "error" in warm:
            return warm
        res = run(c, make(lines, "r"))
    n_tok = lines * seqs * toks
    if "error" not in res:
        res.update(tokens_per_s=n_tok / res["run_s"], e2e_tokens_per_s=n_tok / res["e2e_s"])
    return {"lines": lines, "tokens": n_tok, **res, "warmup_run_s": warm["run_s"]}


# -- onnxruntime CUDA provider parity (--mode onnx) --------------------------------------------------------------
def onnx_parity(args, dev: torch.device) -> dict:
    row: dict = {"case": "onnx"}
    try:
        import onnxruntime as ort
    except Exception as e:
        return emit({**row, "skipped": f"onnxruntime not importable ({e!r})"})
    provs = ort.get_available_providers()
    row["providers"] = provs
    want = args.onnx_provider
    if want not in provs:
        return emit({**row, "skipped": f"onnxruntime has no {want} (providers: {', '.join(provs)})"})
    try:
        import onnx  # noqa: F401

        from latentlm.models.onnx_graph import export_onnx
        from latentlm.onnx_backend import OnnxScorer
    except Exception as e:
        return emit({**row, "skipped": f"cannot export ONNX graphs here ({e!r})"})
    import tempfile

    from latentlm.models.synthetic import random_blocked_hmm, random_rank_hmm

    g = torch.Generator().manual_seed(0)
    for fam, (t, c) in (("rank_hmm", random_rank_hmm(512, 256, 1000, seed=1)),
                        ("blocked_hmm", random_blocked_hmm(8, 64, 1000, seed=2))):
        cls = RankHMM if fam == "rank_hmm" else BlockedHMM
        model = cls.from_tensors(t, c, device=dev)
        ids = torch.randint(0, 1000, (16, 40), generator=g)
        lengths = torch.randint(1, 41, (16,), generator=g)
        path = Path(tempfile.mkdtemp()) / f"{fam}.onnx"
        try:
            export_onnx(model if dev.type == "cpu" else cls.from_tensors(t, c), path, name=fam)
            sc = OnnxScorer(path, providers=[want])
            seqs = [ids[b, : int(lengths[b])].tolist() for b in range(16)]
            lp, _ = sc.score(seqs)
            ref = model.score(Batch(ids.to(dev), lengths.to(dev)))[0].cpu()
            err = max(abs(a - b) / abs(b) for a, b in zip(lp, ref.tolist(), strict=True))
            mine = None
            if tc.available(dev):
                kw = {}
                fn = tc.score_rank if fam == "rank_hmm" else tc.score_blocked
                mine_lp = fn(model, Batch(ids.to(dev), lengths.to(dev)), **kw)[0].cpu()
                mine = max(abs(a - b) / abs(b) for a, b in zip(lp, mine_lp.tolist(), strict=True))
            emit({**row, "family": fam, "session_providers": sc.session.get_providers(), "max_rel_err_vs_torch": err,
                  "max_rel_err_vs_triton": mine, "ok": err < 1e-4})
        except Exception as e:
            emit({**row, "family": fam, "error": repr(e)[:600]})
    return row


# -- report ------------------------------------------------------------------------------------------------------
def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(device: str, small: bool, yard_path: Path, peak: dict, wall: float) -> str:
    lines = [f"# GPU scoring kernels vs the yardstick ({device})", "",
             f"date {dt.datetime.now().isoformat(timespec='minutes')}, torch {torch.__version__}, triton "
             f"{tc.triton_version()}; `python bench/gpu_bench.py{' --small' if small else ''}`, yardstick "
             f"`{yard_path}` run in the same process (plain PyTorch scaled forward, same shapes; it uses TF32). "
             f"Wall {wall:.0f} s.", "",
             f"Device limits measured here: matmul bf16 {peak['matmul_bf16_tflops']:.1f} TFLOP/s, tf32 "
             f"{peak['matmul_tf32_tflops']:.1f}, fp32 {peak['matmul_fp32_tflops']:.1f}; copy "
             f"{peak['copy_gbps']:.0f} GB/s (read + write).", ""]
    for r in ROWS:
        if "model_memory" in r:
            mm = r["model_memory"]
            lines.append(f"- {r['case']} model memory: fp32 {mm['fp32_mb']:,.0f} MiB, bf16 storage "
                         f"{mm['bf16_mb']:,.0f} MiB")
    lines += ["", "| case | batch | draw | implementation | tokens/s | x yardstick | target | rate | % of peak | "
              "max rel err log p vs fp32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        if r.get("case") not in ("rank", "blocked") or "impl" not in r:
            continue
        if "error" in r:
            lines.append(f"| {r['case']} | {r['B']} | {r.get('draw', '')} | {r['impl']} | error: "
                         f"{r['error'][:120].replace('|', '/')} | | | | | |")
            continue
        if r["case"] == "rank":
            rate, pct = f"{fmt(r.get('tflops'), '.3g')} TFLOP/s", fmt(r.get("pct_peak"), ".0f")
        elif "gbps_unique_blocks" in r:
            rate = f"{r['gbps_unique_blocks']:.4g} GB/s blocks read ({r['gbps_gathered']:.4g} gathered)"
            pct = f"{r['pct_copy_bw']:.0f} (copy bw)"
        else:
            rate, pct = f"{fmt(r.get('gbps_gathered'), '.4g')} GB/s gathered", "–"
        tgt = r.get("target")
        mark = "" if tgt is None else (" ✓" if r["ratio"] >= tgt else " ✗")
        lines.append(f"| {r['case']} | {r['B']} | {r.get('draw', 'uniform')} | {r['impl']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['ratio']:.2f}x{mark} | {fmt(tgt, '.1f')} | {rate} | {pct} | "
                     f"{fmt(r.get('max_rel_err_logp_vs_fp32'), '.1e')} |")
    fails = [r for r in ROWS if r.get("case") == "graphs"]
    if fails and fails[0]["capture_failures"]:
        lines += ["", f"CUDA graph capture failed {fails[0]['capture_failures']} time(s) (those shapes ran eagerly): "
                  f"{fails[0]['first']}"]
    lines += ["", "Rates: rank TFLOP/s = 2 r^2 B T / time against the matmul peak of the variant's precision; blocked "
              "'blocks read' = distinct (prev cluster, cluster) blocks per step x k^2 x bytes / time (the DRAM "
              "traffic the step needs) against the copy bandwidth; 'gathered' = B k^2 x 4 bytes per step (the "
              "yardstick's measure)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yardstick", type=Path, default=None)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="markdown (default bench/results/gpu_bench[_small].md)")
    ap.add_argument("--json", type=Path, default=None, help="also write all rows as JSON lines here")
    ap.add_argument("--cases", default="rank,blocked")
    ap.add_argument("--mode", choices=["kernels", "service", "onnx"], default="kernels",
                    help="kernels: the benchmark above; service: `latentlm serve --device cuda` under a load "
                    "generator (8 x 50-token sequences per request, 64 connections) on a 4,096-state blocked_hmm, "
                    "then a batch job of such requests (/v1/files + /v1/batches); "
                    "onnx: onnxruntime CUDAExecutionProvider parity")
    ap.add_argument("--requests", type=int, default=1280, help="service mode: requests to send (at most)")
    ap.add_argument("--warmup-requests", type=int, default=640, help="service mode: requests of the warm-up pass")
    ap.add_argument("--concurrency", type=int, default=64, help="service mode: connections")
    ap.add_argument("--job-lines", type=int, default=2000, help="service mode: lines (requests) of the batch job")
    ap.add_argument("--job-timeout", type=float, default=30.0, help="service mode: give the batch job this long")
    ap.add_argument("--load-seconds", type=float, default=30.0, help="service mode: stop sending after this")
    ap.add_argument("--ready-timeout", type=float, default=60.0)
    ap.add_argument("--engine", default="auto", choices=["auto", "inline", "process"],
                    help="service mode: LATENTLM_ENGINE (process: one engine process runs the models for the workers)")
    ap.add_argument("--workers", type=int, default=1, help="service mode: LATENTLM_WORKERS (more than one starts a "
                    "redis-server from PATH; without one, 1)")
    ap.add_argument("--seqs-per-request", type=int, default=8, help="service mode: 50-token sequences per request")
    ap.add_argument("--no-job", action="store_true", help="service mode: no batch job after the load")
    ap.add_argument("--deadline-s", type=float, default=math.inf, help="kernels mode: start no variant after this")
    ap.add_argument("--onnx-provider", default="CUDAExecutionProvider", help="onnx mode: the provider to check")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode != "kernels":
        row = service_load(args, dev) if args.mode == "service" else onnx_parity(args, dev)
        if args.json:
            args.json.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        sys.exit(1 if "error" in row else 0)
    small = args.small or dev.type != "cuda"
    if small:
        QUICK.update(reps=1, subset=SMALL_VARIANTS)
    yard_path = args.yardstick or default_yardstick()
    spec = importlib.util.spec_from_file_location("gpu_yardstick", yard_path)
    yard = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(yard)  # type: ignore[union-attr]
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    emit({"case": "env", "device": device, "torch": torch.__version__, "triton": tc.triton_version(),
          "triton_kernels": tc.available(dev), "interpreter": os.environ.get("TRITON_INTERPRET", "0")})
    shapes = SMALL if small else FULL
    DEADLINE["t"] = t0 + args.deadline_s
    peak = peaks(dev, small)
    REPORT.update(out=args.out or ROOT / "bench" / "results" / ("gpu_bench_small.md" if small else "gpu_bench.md"),
                  device=device, small=small, yard=yard_path, peak=peak, t0=t0, json=args.json)
    torch.backends.cuda.matmul.allow_tf32 = False
    for case in args.cases.split(","):
        try:
            (bench_rank if case == "rank" else bench_blocked)(yard, shapes[case], dev, peak)
        except Exception as e:  # keep what was measured
            emit({"case": case, "impl": "case", "B": 0, "error": repr(e)[:400]})
        tc.clear_cache()
        free(dev)
        write_report()
    emit({"case": "graphs", "capture_failures": len(tc.graph_errors), "first": tc.graph_errors[:1]})
    write_report()
    print(f"wrote {REPORT['out']}", flush=True)


def write_report() -> None:
    """The markdown (and JSON lines) of everything measured so far."""
    r = REPORT
    r["out"].parent.mkdir(parents=True, exist_ok=True)
    r["out"].write_text(markdown(r["device"], r["small"], r["yard"], r["peak"], time.time() - r["t0"]))
    if r["json"]:
        r["json"].write_text("".join(json.dumps(x) + "\n" for x in ROWS))


if __name__ == "__main__":
    main()
