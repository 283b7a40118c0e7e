"""Scaled forward pass (scoring) of the rank-space HMM and the blocked VL-HMM on CUDA, near the device limit.

(A kernel module: its length is the two families' fused Triton kernels and their launch plans.)

Both families run the recursion of `models.chain.forward`:
    alpha_0 = init * e(x_0);   alpha_t = (alpha_{t-1} A_t) * e(x_t);   c_t = sum(alpha_t);   alpha_t /= c_t
    log_cond[:, t] = log c_t   (0 at padding positions, which leave alpha unchanged; -inf from a zero c on)
and return `log_cond` (B, T) float32.

rank_hmm (`rank_forward_cuda`): A_t = R (r x r, shared). Per step one cuBLAS GEMM (B x r) @ (r x r), then ONE
Triton kernel per step fuses the emission-row gather, the product, the row sum, the normalisation, the log and
the padding rule (`_emit_norm`); the eager PyTorch loop needs ~7 kernels for that. With `storage_dtype=bfloat16`
R and the emission table are stored in bfloat16 (half the bytes, bf16 tensor-core GEMM with fp32 accumulation,
fp32 output where torch has `mm(..., out_dtype=)`); alpha is rounded to bf16 only as the GEMM's input.

blocked_hmm (`blocked_forward_cuda`): A_t is the k x k block (cluster(x_{t-1}), cluster(x_t)) of the Z x Z
matrix. The PyTorch path gathers B blocks per step into a (B, k, k) tensor (write + read of B k^2 floats) and
then runs bmm (a third pass). Here the batch is sorted by (previous cluster, cluster) pair for every step at
once (one `torch.sort` on (T, B) keys), and one Triton kernel per step (`_block_step_*`) reads each block
where it lies in the matrix, multiplies it into the alphas of the sequences that use it, and applies the same
fused emission/normalise/log/padding epilogue, writing alpha in place. With `block_rows=1` (default) a program
serves one sequence (fp32 FMA, exact; sequences sharing a block are adjacent programs, so the block is read
from DRAM about once per group and then from L2); with `block_rows=16` a program serves up to 16 sequences of
one group with tensor-core `tl.dot` (bf16, or tf32 with `allow_tf32`), reading the block once per 16 rows.
With `storage_dtype=bfloat16` the matrix is kept as a bf16 (M, M, k, k) copy (each block contiguous).

The whole T-step loop (sorting included) is captured in a CUDA graph per (batch, length) bucket and replayed
(`use_graph=True`): no host synchronisation and no per-step launch overhead. Under dynamic batching nearly every
batch has another (B, T), and a capture (an eager run, then the capture, on the inference thread that competes
with the event loop for the GIL) costs tens of milliseconds, so the buckets are few: B and T are padded up to the
next of 8, 16, 24, 32, 48, 64, 96, 128, 192, ... (`_bucket`: two shapes per octave), padded rows have length 0
and padded positions lie beyond every length, so no result changes (the kernels skip them; the rank GEMM is
row-independent). Batches of more than `_rows_cap(T)` rows (at most MAX_GRAPH_ROWS, and MAX_GRAPH_SLOTS padded
positions) run as several calls of that many rows. The runners (static buffers + graph) are kept in an LRU of
GRAPH_CACHE_SIZE entries and GRAPH_CACHE_BYTES of buffers; `stats` counts runners made (= captures on CUDA),
captures and replays. Calls from several threads (the batcher's inference thread, the batch-job thread) are
serialised by one lock: a runner's static buffers are shared state.

Triton is imported lazily; without it (or on CPU without TRITON_INTERPRET=1) the same loop runs with PyTorch
ops (`impl="torch"`), which is also what the tests compare against. On CPU with TRITON_INTERPRET=1 set before
triton is imported, the Triton kernels run in Triton's interpreter (tests, `bench/gpu_bench.py --small`).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["rank_forward_cuda", "blocked_forward_cuda", "score_rank", "score_blocked", "available",
           "clear_cache", "triton_version"]

# the documented error bound of bf16 storage: `backend.BF16_TOKEN_ABS_BOUND` (checked in tests/models/test_triton.py)
GRAPH_CACHE_SIZE = 64  # captured (model, shape bucket) graphs kept (LRU) ...
GRAPH_CACHE_BYTES = 4 << 30  # ... and at most this many bytes of their static buffers (the oldest go first)
MAX_GRAPH_ROWS = 4096  # rows of one graph call; a larger batch runs as several calls
MAX_GRAPH_SLOTS = 1 << 21  # padded positions (rows x length) of one graph call
graph_errors: list[str] = []  # why a capture failed (that shape then runs eagerly)
stats = {"runners": 0, "captures": 0, "replays": 0, "evictions": 0}  # runners made (= captures on CUDA), ...
_lock = threading.RLock()  # one fused call at a time: the runners' static buffers are shared


# ---------------------------------------------------------------------------------------------------------
# Triton (lazy)
@functools.lru_cache(maxsize=1)
def _triton() -> Any | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return None
    return triton


def triton_version() -> str | None:
    t = _triton()
    return None if t is None else t.__version__


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with triton, or any device under the interpreter."""
    device = torch.device(device)
    if _triton() is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not _interpreting()
    return _interpreting() and device.type == "cpu"


@functools.lru_cache(maxsize=1)
def _kernels() -> dict[str, Callable]:
    triton = _triton()
    if triton is None:
        raise RuntimeError("triton is not importable")
    import triton.language as tl

    @triton.jit(do_not_specialize=["t"])
    def _emit_norm(g_ptr, g_rows_ptr, g_stride, emit_ptr, ids_ptr, ids_stride, len_ptr, alpha_ptr, alpha_stride,
                   lc_ptr, lc_stride, t, K: tl.constexpr, BLOCK: tl.constexpr):
        """Row b: p = g[g_rows[b]] * emit[ids[b, t]]; c = sum p; alpha[b] = p / c (0 where c == 0);
        log_cond[b, t] = log c. Rows with t >= length are left untouched (log_cond 0)."""
        b = tl.program_id(0).to(tl.int64)
        n = tl.load(len_ptr + b)
        if t < n:
            tok = tl.load(ids_ptr + b * ids_stride + t).to(tl.int64)
            grow = tl.load(g_rows_ptr + b).to(tl.int64)
            if K <= BLOCK:  # one pass, the row stays in registers
                offs = tl.arange(0, BLOCK)
                m = offs < K
                gv = tl.load(g_ptr + grow * g_stride + offs, mask=m, other=0.0).to(tl.float32)
                ev = tl.load(emit_ptr + tok * K + offs, mask=m, other=0.0).to(tl.float32)
                pv = gv * ev
                c = tl.sum(pv, axis=0)
                inv = tl.where(c > 0, 1.0 / tl.where(c > 0, c, 1.0), 0.0)
                tl.store(alpha_ptr + b * alpha_stride + offs, (pv * inv).to(alpha_ptr.dtype.element_ty), mask=m)
            else:  # two passes over the row (the second from L1/L2)
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    offs = k0 + tl.arange(0, BLOCK)
                    m = offs < K
                    gv = tl.load(g_ptr + grow * g_stride + offs, mask=m, other=0.0).to(tl.float32)
                    ev = tl.load(emit_ptr + tok * K + offs, mask=m, other=0.0).to(tl.float32)
                    acc += gv * ev
                c = tl.sum(acc, axis=0)
                inv = tl.where(c > 0, 1.0 / tl.where(c > 0, c, 1.0), 0.0)
                for k0 in range(0, K, BLOCK):
                    offs = k0 + tl.arange(0, BLOCK)
                    m = offs < K
                    gv = tl.load(g_ptr + grow * g_stride + offs, mask=m, other=0.0).to(tl.float32)
                    ev = tl.load(emit_ptr + tok * K + offs, mask=m, other=0.0).to(tl.float32)
                    tl.store(alpha_ptr + b * alpha_stride + offs, (gv * ev * inv).to(alpha_ptr.dtype.element_ty),
                             mask=m)
            tl.store(lc_ptr + b * lc_stride + t, tl.log(c))
        else:
            tl.store(lc_ptr + b * lc_stride + t, 0.0)

    @triton.jit(do_not_specialize=["t"])
    def _block_step_row(alpha_ptr, blk_ptr, s_cp, s_row, s_c, perm_ptr, key_ptr, emit_ptr, ids_ptr, ids_stride,
                        lc_ptr, lc_stride, t, M, K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
        """One sequence per program (position p of the step's sorted order): alpha <- normalised
        (alpha @ block(key)) * emit[x_t]. Key -1 = padding (skipped). FMA in fp32 (exact)."""
        p = tl.program_id(0)
        key = tl.load(key_ptr + p)
        if key >= 0:
            row = tl.load(perm_ptr + p).to(tl.int64)
            cp = (key // M).to(tl.int64)
            cn = (key % M).to(tl.int64)
            base = blk_ptr + cp * s_cp + cn * s_c
            offs_n = tl.arange(0, BN)
            nmask = offs_n < K
            acc = tl.zeros((BK, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < K
                a = tl.load(alpha_ptr + row * K + offs_k, mask=kmask, other=0.0)
                w = tl.load(base + offs_k[:, None].to(tl.int64) * s_row + offs_n[None, :],
                            mask=kmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
                acc += a[:, None] * w
            v = tl.sum(acc, axis=0)
            tok = tl.load(ids_ptr + row * ids_stride + t).to(tl.int64)
            e = tl.load(emit_ptr + tok * K + offs_n, mask=nmask, other=0.0).to(tl.float32)
            pv = v * e
            c = tl.sum(pv, axis=0)
            inv = tl.where(c > 0, 1.0 / tl.where(c > 0, c, 1.0), 0.0)
            tl.store(alpha_ptr + row * K + offs_n, pv * inv, mask=nmask)
            tl.store(lc_ptr + row * lc_stride + t, tl.log(c))

    @triton.jit(do_not_specialize=["t"])
    def _block_step_dot(alpha_ptr, blk_ptr, s_cp, s_row, s_c, perm_ptr, key_ptr, tile_ptr, emit_ptr, ids_ptr,
                        ids_stride, lc_ptr, lc_stride, t, B, M, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                        BN: tl.constexpr, PREC: tl.constexpr,
                        UPCAST: tl.constexpr):
        """Up to BM sequences of one (prev cluster, cluster) group per program (tile starting at sorted position
        tile[p]; -1 = no tile): (BM x k) @ (k x k) with tl.dot, fp32 accumulation, then the fused epilogue."""
        p = tl.program_id(0)
        s = tl.load(tile_ptr + p)
        if s >= 0:
            key0 = tl.load(key_ptr + s)
            if key0 >= 0:
                offs_m = s + tl.arange(0, BM)
                inb = offs_m < B
                keys = tl.load(key_ptr + offs_m, mask=inb, other=-1)
                rmask = inb & (keys == key0)
                rows = tl.load(perm_ptr + offs_m, mask=rmask, other=0).to(tl.int64)
                cp = (key0 // M).to(tl.int64)
                cn = (key0 % M).to(tl.int64)
                base = blk_ptr + cp * s_cp + cn * s_c
                offs_n = tl.arange(0, BN)
                nmask = offs_n < K
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for k0 in range(0, K, BK):
                    offs_k = k0 + tl.arange(0, BK)
                    kmask = offs_k < K
                    a = tl.load(alpha_ptr + rows[:, None] * K + offs_k[None, :],
                                mask=rmask[:, None] & kmask[None, :], other=0.0)
                    w = tl.load(base + offs_k[:, None].to(tl.int64) * s_row + offs_n[None, :],
                                mask=kmask[:, None] & nmask[None, :], other=0.0)
                    if UPCAST:  # Triton's interpreter has no bf16 dot: same roundings, fp32 product
                        acc = tl.dot(a.to(w.dtype).to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PREC)
                tok = tl.load(ids_ptr + rows * ids_stride + t, mask=rmask, other=0).to(tl.int64)
                e = tl.load(emit_ptr + tok[:, None] * K + offs_n[None, :], mask=rmask[:, None] & nmask[None, :],
                            other=0.0).to(tl.float32)
                pv = acc * e
                c = tl.sum(pv, axis=1)
                inv = tl.where(c > 0, 1.0 / tl.where(c > 0, c, 1.0), 0.0)
                tl.store(alpha_ptr + rows[:, None] * K + offs_n[None, :], pv * inv[:, None],
                         mask=rmask[:, None] & nmask[None, :])
                tl.store(lc_ptr + rows * lc_stride + t, tl.log(tl.where(rmask, c, 1.0)), mask=rmask)

    return {"emit_norm": _emit_norm, "block_row": _block_step_row, "block_dot": _block_step_dot}


# ---------------------------------------------------------------------------------------------------------
# helpers
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _bucket(n: int) -> int:
    """Graph shape bucket: the smallest of 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... (2^j and 3 2^(j-2)
    from 24 on) that holds n: two shapes per octave (few captures under dynamic batching), padding < 50%."""
    if n <= 8:
        return 8
    p = _pow2(n)
    three_q = p * 3 // 4
    return three_q if n <= three_q and three_q % 8 == 0 else p


def _rows_cap(Tb: int) -> int:
    """Rows of one graph call for (bucketed) length Tb: a bucket size, at most MAX_GRAPH_ROWS and MAX_GRAPH_SLOTS
    padded positions (at least 8)."""
    want = max(8, min(MAX_GRAPH_ROWS, MAX_GRAPH_SLOTS // max(1, Tb)))
    b = 8
    while _bucket(b + 1) <= want:  # the largest bucket size <= want
        b = _bucket(b + 1)
    return b


@contextmanager
def _tf32(enabled: bool):
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


_prep_cache: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()
_graph_cache: OrderedDict[tuple, _Runner] = OrderedDict()


def clear_cache() -> None:
    """Drop captured graphs and storage-dtype copies of model tensors (and zero `stats`)."""
    with _lock:
        _prep_cache.clear()
        _graph_cache.clear()
        for k in stats:
            stats[k] = 0


def _tkey(t: Tensor) -> tuple:
    return (id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device))


def _prepared(src: Tensor, what: str, dtype: torch.dtype, make: Callable[[], Tensor]) -> Tensor:
    """A derived copy of `src` (storage dtype, layout), cached while `src` is unchanged (keeps `src` alive)."""
    key = (_tkey(src), what, dtype)
    with _lock:
        hit = _prep_cache.get(key)
        if hit is not None:
            _prep_cache.move_to_end(key)
            return hit[1]
        out = make()
        _prep_cache[key] = (src, out)
        while len(_prep_cache) > 8:
            _prep_cache.popitem(last=False)
        return out


def _use_triton(device: torch.device, impl: str) -> bool:
    if impl == "torch":
        return False
    ok = available(device)
    if impl == "triton" and not ok:
        raise RuntimeError(f"impl='triton' needs triton and CUDA (or TRITON_INTERPRET=1 on CPU); "
                           f"triton {triton_version()}, device {device}")
    return ok


def _norm_block(K: int) -> tuple[int, int]:
    block = min(_pow2(K), 4096)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, warps


def _torch_emit_norm(g: Tensor, emit_rows: Tensor, valid: Tensor, alpha: Tensor, log_cond: Tensor, t: int) -> None:
    """PyTorch version of `_emit_norm` (rows already gathered): in place on alpha and log_cond[:, t]."""
    p = g.float() * emit_rows.float()
    c = p.sum(-1, keepdim=True)
    new = p * torch.where(c > 0, 1.0 / c, torch.zeros((), dtype=c.dtype, device=c.device))
    alpha.copy_(torch.where(valid[:, None], new.to(alpha.dtype), alpha))
    log_cond[:, t] = torch.where(valid, c.squeeze(-1).log(), torch.zeros((), device=c.device))


class _Runner:
    """Static buffers for one (model, shape bucket, options) and the T-step loop on them; optionally a CUDA
    graph of that loop."""

    def __init__(self, body: Callable[[_Runner], None], bufs: dict[str, Tensor]):
        self.body, self.bufs = body, bufs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_only = False
        self.nbytes = sum(b.numel() * b.element_size() for b in bufs.values())

    def run(self, use_graph: bool) -> None:
        dev = self.bufs["ids"].device
        if not (use_graph and dev.type == "cuda") or self.eager_only:
            self.body(self)
            return
        if self.graph is not None:
            stats["replays"] += 1
            self.graph.replay()
            return
        # first call: run eagerly on a side stream (compiles the kernels, picks cuBLAS algorithms; its results
        # are this call's), then capture the same loop (capturing executes nothing) for the next calls.
        # thread_local: another thread's CUDA work (the batch-job thread, a posterior on the batcher's) does not
        # break this capture, nor this capture that work
        s = _side_stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            self.body(self)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                self.body(self)
        except Exception as e:  # an op that cannot be captured: stay eager for this shape, say why
            graph_errors.append(repr(e)[:500])
            self.eager_only = True
            _side_stream.cache_clear()  # a fresh side stream for the next capture
            torch.cuda.synchronize(dev)
            return
        stats["captures"] += 1
        self.graph = g


@functools.cache
def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One side stream per device for warm-up runs and captures (a pool of streams would do as well)."""
    return torch.cuda.Stream(device=dev)


def _load(runner: _Runner, ids: Tensor, lengths: Tensor) -> None:
    B, T = ids.shape
    bi, bl = runner.bufs["ids"], runner.bufs["lengths"]
    if bl.shape[0] != B:
        bl[B:].zero_()  # padded rows: length 0 (skipped at every step)
    # positions beyond a row's length are never read as tokens that count (t >= length), whatever they hold
    bi[:B, :T].copy_(ids, non_blocking=True)
    bl[:B].copy_(lengths, non_blocking=True)


def _get_runner(key: tuple, make: Callable[[], _Runner]) -> _Runner:
    r = _graph_cache.get(key)
    if r is None:
        r = make()
        stats["runners"] += 1
        _graph_cache[key] = r
        total = sum(x.nbytes for x in _graph_cache.values())
        while len(_graph_cache) > 1 and (len(_graph_cache) > GRAPH_CACHE_SIZE or total > GRAPH_CACHE_BYTES):
            _, old = _graph_cache.popitem(last=False)
            total -= old.nbytes
            stats["evictions"] += 1
    else:
        _graph_cache.move_to_end(key)
    return r


def _check(ids: Tensor, lengths: Tensor) -> None:
    if ids.ndim != 2 or lengths.shape != ids.shape[:1]:
        raise ValueError(f"ids must be (B, T) and lengths (B,); got {tuple(ids.shape)} and {tuple(lengths.shape)}")


# ---------------------------------------------------------------------------------------------------------
# rank_hmm
def rank_forward_cuda(init: Tensor, emit_table: Tensor, ids: Tensor, lengths: Tensor, trans: Tensor, *,
                      storage_dtype: torch.dtype = torch.float32, use_graph: bool = True, allow_tf32: bool = False,
                      impl: str = "auto", bucket: bool | None = None) -> Tensor:
    """Scaled forward of a chain with one shared (r, r) step matrix: log_cond (B, T) float32.

    init (r,) or (B, r); emit_table (V, r) (row x = p(x | state)); ids (B, T) int64, lengths (B,);
    trans (r, r) row-stochastic. storage_dtype float32 or bfloat16 (trans and emit_table stored in it);
    allow_tf32: TF32 GEMMs for float32 storage (default exact float32). use_graph: capture the T-step loop
    in a CUDA graph per shape bucket (CUDA only). impl "auto" | "triton" | "torch" (fused Triton epilogue or
    PyTorch ops). bucket: pad (B, T) up to `_bucket` sizes and split rows beyond `_rows_cap` into several calls
    (default: where graphs are used; the results are the same either way). Any device; the Triton kernels need
    CUDA, or the interpreter on CPU."""
    _check(ids, lengths)
    dev = trans.device
    B, T = ids.shape
    r = trans.shape[0]
    if B == 0 or T == 0:
        return torch.zeros(B, T, dtype=torch.float32, device=dev)
    use_tr = _use_triton(dev, impl)
    sd = storage_dtype
    R = trans if trans.dtype == sd else _prepared(trans, "rank_trans", sd, lambda: trans.to(sd).contiguous())
    E = emit_table if emit_table.dtype == sd and emit_table.is_contiguous() else \
        _prepared(emit_table, "emit", sd, lambda: emit_table.to(sd).contiguous())
    shared = init.ndim == 1
    graph = use_graph and dev.type == "cuda"
    if graph if bucket is None else bucket:
        Bb, Tb = _bucket(B), _bucket(T)
        cap = _rows_cap(Tb)
        if B > cap:
            return torch.cat([rank_forward_cuda(init if shared else init[i:i + cap], emit_table, ids[i:i + cap],
                                                lengths[i:i + cap], trans, storage_dtype=storage_dtype,
                                                use_graph=use_graph, allow_tf32=allow_tf32, impl=impl, bucket=True)
                              for i in range(0, B, cap)])
    else:
        Bb, Tb = B, T
    key = ("rank", _tkey(R), _tkey(E), (_tkey(init) if shared else None), shared, Bb, Tb, sd, allow_tf32, use_tr,
           graph)

    def make() -> _Runner:
        bufs = {"ids": torch.zeros(Bb, Tb, dtype=torch.long, device=dev),
                "lengths": torch.zeros(Bb, dtype=torch.long, device=dev),
                "init": (init.float().contiguous() if shared else torch.zeros(Bb, r, device=dev)),
                "alpha": torch.zeros(Bb, r, dtype=sd, device=dev),
                "log_cond": torch.zeros(Bb, Tb, device=dev),
                "rows": torch.arange(Bb, device=dev)}
        fp32_out = sd != torch.float32 and dev.type == "cuda" and _mm_out_dtype_ok(dev, sd)
        bufs["g"] = torch.zeros(Bb, r, dtype=torch.float32 if (fp32_out or sd == torch.float32) else sd, device=dev)
        init_rows = torch.zeros(Bb, dtype=torch.long, device=dev) if shared else bufs["rows"]
        block, warps = _norm_block(r)
        mm_kw = {"out_dtype": torch.float32} if fp32_out else {}  # bf16 inputs, fp32 accumulator and output

        def body(self: _Runner) -> None:
            b = self.bufs
            ids_, len_, alpha, g, lc = b["ids"], b["lengths"], b["alpha"], b["g"], b["log_cond"]
            with _tf32(allow_tf32):
                if use_tr:
                    k = _kernels()["emit_norm"]
                    k[(Bb,)](b["init"], init_rows, 0 if shared else r, E, ids_, Tb, len_, alpha, r, lc, Tb, 0, r,
                             BLOCK=block, num_warps=warps)
                    for t in range(1, Tb):
                        torch.mm(alpha, R, out=g, **mm_kw)
                        k[(Bb,)](g, b["rows"], r, E, ids_, Tb, len_, alpha, r, lc, Tb, t, r,
                                 BLOCK=block, num_warps=warps)
                else:
                    valid = torch.arange(Tb, device=dev)[None, :] < len_[:, None]
                    init_b = b["init"].expand(Bb, r) if shared else b["init"]
                    _torch_emit_norm(init_b, E[ids_[:, 0]], valid[:, 0], alpha, lc, 0)
                    for t in range(1, Tb):
                        torch.mm(alpha, R, out=g, **mm_kw)
                        _torch_emit_norm(g, E[ids_[:, t]], valid[:, t], alpha, lc, t)

        return _Runner(body, bufs)

    with _lock:
        runner = _get_runner(key, make)
        _load(runner, ids, lengths)
        if not shared:
            runner.bufs["init"][:B].copy_(init)
        runner.run(graph)
        out = runner.bufs["log_cond"][:B, :T].clone()
    return _dead(out, lengths)


@functools.lru_cache(maxsize=8)
def _mm_out_dtype_ok(dev: torch.device, sd: torch.dtype) -> bool:
    """Whether this torch has `mm(a, b, out_dtype=float32)` for `sd` inputs on `dev` (fp32 GEMM output)."""
    try:
        a = torch.ones(16, 16, dtype=sd, device=dev)
        o = torch.empty(16, 16, dtype=torch.float32, device=dev)
        torch.mm(a, a, out_dtype=torch.float32, out=o)
        return bool((o == 16).all())
    except Exception:
        return False


def _dead(log_cond: Tensor, lengths: Tensor) -> Tensor:
    """After a zero-probability step every later real position is -inf (as `models.chain.forward`)."""
    T = log_cond.shape[1]
    mask = torch.arange(T, device=log_cond.device)[None, :] < lengths.to(log_cond.device)[:, None]
    ninf = (log_cond == -math.inf) & mask
    dead = ninf.cumsum(1) > 0
    return torch.where(dead & mask, torch.full_like(log_cond, -math.inf), log_cond)


# ---------------------------------------------------------------------------------------------------------
# blocked_hmm
def _tiles(sk: Tensor, BM: int) -> Tensor:
    """(S, B) sorted keys -> (S, B) start positions of the row tiles (<= BM rows of one key), -1 padded."""
    S, B = sk.shape
    ar = torch.arange(B, device=sk.device).expand(S, B)
    if BM == 1:
        return ar.contiguous()
    new = torch.ones_like(sk, dtype=torch.bool)
    new[:, 1:] = sk[:, 1:] != sk[:, :-1]
    gstart = torch.cummax(torch.where(new, ar, torch.zeros_like(ar)), dim=1).values
    flag = ((ar - gstart) % BM) == 0
    slot = torch.where(flag, flag.long().cumsum(1) - 1, torch.full_like(ar, B))
    tiles = torch.full((S, B + 1), -1, dtype=torch.long, device=sk.device)
    tiles.scatter_(1, slot, ar.contiguous())
    return tiles[:, :B].contiguous()


def blocked_forward_cuda(start: Tensor, trans: Tensor, emit_table: Tensor, word_cluster: Tensor, ids: Tensor,
                         lengths: Tensor, *, storage_dtype: torch.dtype = torch.float32, use_graph: bool = True,
                         allow_tf32: bool = False, block_rows: int | None = None, block_k: int | None = None,
                         num_warps: int | None = None, impl: str = "auto", bucket: bool | None = None) -> Tensor:
    """Scaled forward of a blocked HMM: log_cond (B, T) float32.

    start (Z,); trans (Z, Z) row-stochastic, states ordered by cluster (Z = M k); emit_table (V, k):
    emit[w, i] = p(w | state cluster(w) k + i); word_cluster (V,) int64; ids (B, T) int64; lengths (B,).
    storage_dtype float32 (the matrix is read in place, no copy) or bfloat16 (a (M, M, k, k) bf16 copy, cached).
    block_rows 1 (one sequence per program, fp32 FMA) or 16 (tile of one group, tl.dot; tf32 with allow_tf32 for
    float32 storage). Default: 1. block_k, num_warps: kernel tiling (defaults 32 and 4).
    use_graph / impl / bucket as in `rank_forward_cuda`."""
    _check(ids, lengths)
    dev = trans.device
    B, T = ids.shape
    k = emit_table.shape[1]
    Z = trans.shape[0]
    M = Z // k
    if M * k != Z or trans.shape != (Z, Z):
        raise ValueError(f"trans must be (M k, M k) with k = emit_table.shape[1] = {k}; got {tuple(trans.shape)}")
    if B == 0 or T == 0:
        return torch.zeros(B, T, dtype=torch.float32, device=dev)
    use_tr = _use_triton(dev, impl)
    sd = storage_dtype
    BM = block_rows or 1
    if BM not in (1, 16, 32, 64):
        raise ValueError("block_rows must be 1, 16, 32 or 64")
    BK = block_k or (32 if BM == 1 else 64 if sd != torch.float32 else 32)
    BK = min(BK, max(16, _pow2(k)))
    warps = num_warps or 4
    prec = "tf32" if (allow_tf32 or sd != torch.float32) else "ieee"
    if sd == torch.float32 and trans.dtype == torch.float32:
        src = trans.contiguous()
        blocks = src.view(M, k, M, k)  # [cp, i, c, j], read in place
    else:
        src = trans

        def make_copy() -> Tensor:
            out = torch.empty(M, M, k, k, dtype=sd, device=dev)
            for c0 in range(0, M, 8):  # chunked: no full-size temporary
                out[c0:c0 + 8].copy_(trans.view(M, k, M, k)[c0:c0 + 8].permute(0, 2, 1, 3))
            return out

        blocks = _prepared(trans, "blocks4", sd, make_copy).permute(0, 2, 1, 3)  # (M, k, M, k) view
    E = emit_table.float().contiguous() if emit_table.dtype != torch.float32 else emit_table.contiguous()
    S0 = start.float().view(M, k).contiguous()
    wc = word_cluster.to(dev)
    graph = use_graph and dev.type == "cuda"
    if graph if bucket is None else bucket:
        Bb, Tb = _bucket(B), _bucket(T)
        cap = _rows_cap(Tb)
        if B > cap:
            return torch.cat([blocked_forward_cuda(start, trans, emit_table, word_cluster, ids[i:i + cap],
                                                   lengths[i:i + cap], storage_dtype=storage_dtype,
                                                   use_graph=use_graph, allow_tf32=allow_tf32,
                                                   block_rows=block_rows, block_k=block_k, num_warps=num_warps,
                                                   impl=impl, bucket=True)
                              for i in range(0, B, cap)])
    else:
        Bb, Tb = B, T
    key = ("blocked", _tkey(src), _tkey(emit_table), _tkey(start), _tkey(word_cluster), Bb, Tb, sd, BM, BK, warps,
           prec, use_tr, graph)

    def make() -> _Runner:
        bufs = {"ids": torch.zeros(Bb, Tb, dtype=torch.long, device=dev),
                "lengths": torch.zeros(Bb, dtype=torch.long, device=dev),
                "alpha": torch.zeros(Bb, k, device=dev),
                "log_cond": torch.zeros(Bb, Tb, device=dev)}
        block, nw = _norm_block(k)
        s_cp, s_row, s_c, s_col = blocks.stride()
        assert s_col == 1

        def body(self: _Runner) -> None:
            b = self.bufs
            ids_, len_, alpha, lc = b["ids"], b["lengths"], b["alpha"], b["log_cond"]
            cl = wc[ids_]  # (Bb, Tb)
            if use_tr:
                kern = _kernels()
                kern["emit_norm"][(Bb,)](S0, cl[:, 0].contiguous(), k, E, ids_, Tb, len_, alpha, k, lc, Tb, 0, k,
                                         BLOCK=block, num_warps=nw)
                if Tb == 1:
                    return
                valid = torch.arange(1, Tb, device=dev)[None, :] < len_[:, None]
                keys = torch.where(valid, cl[:, :-1] * M + cl[:, 1:], torch.full_like(cl[:, 1:], -1))
                sk, perm = torch.sort(keys.T.contiguous(), dim=1)  # (Tb - 1, Bb)
                lc[:, 1:].zero_()  # padding positions
                if BM == 1:
                    for t in range(1, Tb):
                        kern["block_row"][(Bb,)](alpha, blocks, s_cp, s_row, s_c, perm[t - 1], sk[t - 1], E, ids_, Tb,
                                                 lc, Tb, t, M, k, BK=BK, BN=_pow2(k), num_warps=warps)
                else:
                    tiles = _tiles(sk, BM)
                    for t in range(1, Tb):
                        kern["block_dot"][(Bb,)](alpha, blocks, s_cp, s_row, s_c, perm[t - 1], sk[t - 1], tiles[t - 1],
                                                 E, ids_, Tb, lc, Tb, t, Bb, M, k, BM=BM, BK=BK, BN=_pow2(k),
                                                 PREC=prec, UPCAST=_interpreting(), num_warps=warps)
            else:
                valid = torch.arange(Tb, device=dev)[None, :] < len_[:, None]
                _torch_emit_norm(S0[cl[:, 0]], E[ids_[:, 0]], valid[:, 0], alpha, lc, 0)
                for t in range(1, Tb):
                    blk = blocks[cl[:, t - 1], :, cl[:, t], :]  # (Bb, k, k)
                    if blk.dtype != torch.float32:
                        blk = blk.float()
                    g = torch.bmm(alpha.unsqueeze(1), blk).squeeze(1)
                    _torch_emit_norm(g, E[ids_[:, t]], valid[:, t], alpha, lc, t)

        return _Runner(body, bufs)

    with _lock:
        runner = _get_runner(key, make)
        _load(runner, ids, lengths)
        runner.run(graph)
        out = runner.bufs["log_cond"][:B, :T].clone()
    return _dead(out, lengths)


# ---------------------------------------------------------------------------------------------------------
# family entry points: `RankHMM.score_fused` / `BlockedHMM.score_fused`, which `ChainFamily.score` runs where
# `models.backend.score` picks "cuda_fused" (auto on CUDA)
def score_rank(model: Any, batch: Any, **kw: Any) -> tuple[Tensor, Tensor]:
    """`RankHMM.score` through `rank_forward_cuda`: (log p(x) float64 (B,), log_cond (B, T))."""
    ids, lengths = batch.ids.to(model.device), batch.lengths.to(model.device)
    lc = rank_forward_cuda(model.rank_start, model.emit, ids, lengths, model.rank_trans, **kw)
    return lc.double().sum(1), lc


def score_blocked(model: Any, batch: Any, **kw: Any) -> tuple[Tensor, Tensor]:
    """`BlockedHMM.score` through `blocked_forward_cuda`: (log p(x) float64 (B,), log_cond (B, T))."""
    ids, lengths = batch.ids.to(model.device), batch.lengths.to(model.device)
    lc = blocked_forward_cuda(model.start, model.trans, model.emit, model.word_cluster, ids, lengths, **kw)
    return lc.double().sum(1), lc
