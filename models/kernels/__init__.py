"""CPU kernels that PyTorch has no fused op for, compiled with numba (LLVM) on first use and cached on disk.

By concern:
- `jit`: numba's presence (`HAVE_NUMBA`), `njit`, fast-math flags;
- `maxplus`: the (max, +) micro-kernel with exact pruning and the whole Viterbi recursions (a batch; one
  sequence, optionally split over two threads);
- `alias`: Walker/Vose alias tables for O(1) categorical draws;
- `rows`: compiled building blocks of the sum-product (row-block products, per-row sweeps);
- `groups`: sum-product recursions whole in compiled code (ROWS-sequence groups; one sequence, optionally
  on two threads);
- `lockstep`: sum-product with one BLAS GEMM per step, all of a thread's sequences together;
- `blas`: the ctypes bindings to the BLAS libraries (torch's MKL, numpy's OpenBLAS: `PROVIDERS`) and the cache of
  matrices derived from a model's (packed, transposed);
- `threads`: the helper thread pool and the spin-wait primitives of two-thread kernels;
- `sum_product`: tensor-level drivers of `groups` / `lockstep`;
- `blocked`: a blocked (emission-constrained) HMM's sweeps, reading each step's block where it lies (score,
  posteriors, the training E-step's counts), with their drivers;
- `cluster_emit`: per-cluster normalised emission logits and their gradient (a VL-HMM's training step).
Which kernel runs for a call, and every threshold behind that choice, is `models.backend`'s business;
these modules take the decision (engine, threads, packing) as arguments.
"""

from __future__ import annotations

import numpy as np
import torch

from latentlm.models.kernels import alias, blas, blocked, groups, maxplus, sum_product
from latentlm.models.kernels import rows as row_ops
from latentlm.models.kernels.jit import HAVE_NUMBA

_WARM: set = set()


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's cache) every CPU kernel for `dtype` on tiny inputs, so that the first
    real request does not pay seconds of JIT. Idempotent per process and dtype; no-op without numba."""
    if not HAVE_NUMBA or dtype in _WARM:
        return
    K, T, B = 8, 5, 4
    g = torch.Generator().manual_seed(0)
    trans = torch.rand(K, K, generator=g, dtype=dtype)
    trans /= trans.sum(1, keepdim=True)
    emit = torch.rand(B, T, K, generator=g, dtype=dtype)
    init = torch.full((B, K), 1.0 / K, dtype=dtype)
    lengths = torch.tensor([T, T - 2] * (B // 2))
    ids = torch.randint(0, T, (B, T), generator=g)
    engines = [("groups", "")] + [("lockstep", name) for name in blas.PROVIDERS]
    for table, rows in ((emit, None), (emit[0], ids)):
        for engine, provider in engines:
            cond, alphas = sum_product.forward_cpu(init, table, rows, trans, lengths, engine=engine,
                                                   keep_alphas=True, threads=1, provider=provider)
            sum_product.backward_cpu(table, rows, trans, lengths, cond, engine=engine, threads=1, provider=provider)
            sum_product.backward_cpu(table, rows, trans, lengths, cond, engine=engine, threads=1, alphas=alphas,
                                     provider=provider)
            if engine == "lockstep":
                sum_product.posterior_cpu(init, table, rows, trans, lengths, threads=1, provider=provider)
        e, r = sum_product.emission_rows(table, rows)
        a, first = blas.as_array(trans), blas.as_array(init[0])
        out = np.zeros(T)
        groups.forward_one(first, e, r[0], a, out)
        shared, partial, flags = np.zeros((2, K), dtype=e.dtype), np.zeros((2, 16)), np.zeros(32, np.int64)
        flags[16] = T  # the other thread's step counter reads "finished": thread 0 runs every column alone
        groups.forward_one_split(first, e, r[0], a, out, shared, partial, flags, 0, 0, K)
        row_ops.rows_matmul(e[:3], a, np.empty_like(e[:3]))
    log_trans = trans.log()
    maxplus.maxplus_cpu(emit[:, 0].log(), log_trans)
    for threads in (1, 2):  # a batch, and one sequence split over two threads
        maxplus.viterbi_cpu(init.log(), emit.log(), None, log_trans, lengths, threads)
        maxplus.viterbi_cpu(init[:1].log(), emit[:1].log(), None, log_trans, lengths[:1], threads)
    clusters = torch.zeros(B, T, dtype=torch.long)  # a blocked HMM's sweeps: one cluster of K states
    for stored in (trans, trans.to(torch.bfloat16)):  # the matrix as stored: float, or bfloat16 storage
        for want_last in (False, True):
            blocked.score_cpu(init, emit[0], ids, clusters, lengths, stored, 1, want_last)
        blocked.posterior_cpu(init, emit, clusters, lengths, stored, 1)
        blocked.viterbi_cpu(init, emit[0], ids, clusters, lengths, stored, 1)
        alias.chunk_masses(stored, 3, 1)
    _WARM.add(dtype)
