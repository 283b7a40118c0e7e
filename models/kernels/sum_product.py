"""The compiled sum-product (scaled forward / backward) on CPU, called from tensors: each driver converts
its arguments to numpy views, runs one kernel family on the number of threads it is given, and returns
tensors. Which family runs and on how many threads is decided by the caller (`models.backend`):
- "single": `groups.forward_one` for one sequence (log_cond only); threads=2 splits it by columns;
- "groups": `groups.forward_groups` / `backward_groups`, groups of ROWS sequences spread over threads;
- "lockstep": `lockstep.*` (one BLAS GEMM per step); only where `blas.HAVE_GEMM`.
Emissions come as a table (N, K) read by row index, rows (B, T) int64, or as a dense (B, T, K) tensor
(rows None); the kernels read each row where it lies.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

from latentlm.models.kernels import blas, groups, lockstep
from latentlm.models.kernels import rows as row_ops
from latentlm.models.kernels.blas import as_array
from latentlm.models.kernels.rows import ROWS
from latentlm.models.kernels.threads import run_ranges, run_split


def emission_rows(table: Tensor, rows: Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """(table (N, K), rows (B, T) or None) -> contiguous numpy views for the kernels. Without rows the table
    is a dense (B, T, K) emission tensor, seen as B T rows read in order (no copy)."""
    if rows is None:
        B, T, K = table.shape
        return as_array(table).reshape(B * T, K), np.arange(B * T, dtype=np.int64).reshape(B, T)
    r = np.ascontiguousarray(rows.numpy(), dtype=np.int64)
    if r.size and (r.min() < 0 or r.max() >= table.shape[0]):  # compiled code does not bounds-check
        raise IndexError(f"emission row index out of range: rows span [{r.min()}, {r.max()}], table has "
                         f"{table.shape[0]} rows")
    return as_array(table), r


def _length_order(lengths: np.ndarray) -> np.ndarray:
    return np.argsort(-lengths, kind="stable")


def run_groups(kernel, num_rows: int, args: tuple, threads: int) -> None:
    """Run `kernel(*args, first, stride)` over the ROWS-sequence groups of `num_rows` rows on `threads`
    threads: thread k takes groups k, k + threads, ... (rows sorted by length, so this balances work)."""
    threads = max(1, min(threads, (num_rows + ROWS - 1) // ROWS))
    run_split(lambda k: kernel(*args, k, threads), threads)


def run_lockstep(kernel, args: tuple, dtype: np.dtype, threads: int, packed: np.ndarray | None = None,
                 provider: str = "") -> None:
    """Run `kernel(gemm, compute, packed, ints, *args, k, threads)` for k < threads (a lockstep kernel over
    `dtype` data: `provider`'s sgemm or dgemm, "" the default one), each thread with BLAS held to one thread
    of its own. With `packed` (from `blas.packed_matrix`; MKL only), the steps run MKL's compute on it."""
    gemm, compute = blas.gemm_addresses(dtype, provider)
    ints = blas.dims_template(provider)
    if packed is None or not compute:
        packed = np.empty(0, dtype=dtype)

    def part(k: int) -> None:
        before = blas.set_local_threads(1 if threads > 1 else 0, provider)  # one lockstep thread: BLAS may use all
        try:
            kernel(gemm, compute, packed, ints, *args, k, threads)
        finally:
            blas.set_local_threads(before, provider)

    run_split(part, threads)


def _backward_operands(trans: Tensor, pack: bool) -> tuple[np.ndarray | None, np.ndarray, bool]:
    """What the lockstep backward steps multiply by: (trans^T packed or None, the matrix, whether it is trans
    itself). Packed: trans^T straight from trans, no transposed copy; otherwise a (cached) transposed copy,
    which is faster than GEMM on 'T' at these sizes."""
    if pack:
        return blas.packed_matrix(trans, True), as_array(trans), True
    return None, blas.transposed(trans), False


def forward_cpu(init: Tensor, table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, *, engine: str,
                keep_alphas: bool, threads: int, out_last: Tensor | None = None, pack: bool = False,
                provider: str = "", out_alphas: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scaled forward on CPU in compiled code: init (B, K), emissions table[rows[b, t]] (table (N, K), rows
    (B, T); or a dense (B, T, K) table with rows None), trans (K, K), lengths (B,) -> log_cond (B, T) in
    the table's dtype (0 at padding) and, with `keep_alphas`, filtered marginals (B, T, K) (0 at padding).
    With `out_last` (B, K), also writes there each sequence's filtered marginal at its last position.
    `engine` "single" (B = 1, neither output), "groups" or "lockstep"; `pack`: lockstep on trans packed
    once (float32, `blas.HAVE_PACK`); `provider`: the BLAS of the lockstep GEMMs ("" the default);
    `out_alphas` (B, T, K) contiguous: where the marginals are written (and returned). O(B T K^2)."""
    e, r = emission_rows(table, rows)
    a, L = as_array(trans), lengths.numpy().astype(np.int64)
    B, T = r.shape
    K = e.shape[1]
    log_cond = np.zeros((B, T), dtype=np.float64)
    if engine == "single":
        if B != 1 or keep_alphas or out_last is not None:
            raise ValueError("the single-sequence kernel scores one sequence (no marginals)")
        n = int(L[0])
        _forward_one(as_array(init[0]), e, r[0, :n], a, log_cond[0, :n], threads)
    else:
        # np.empty, not np.zeros: calloc maps fresh zero pages on every call, and first-touch page faults
        # then cost more than the recursion (in a VM, ~20 ms for 13 MB); malloc reuses the freed heap
        alphas = (_output(out_alphas, (B, T, K), e.dtype) if keep_alphas and out_alphas is not None
                  else np.empty((B, T, K) if keep_alphas else (1, 1, K), dtype=e.dtype))
        last = np.zeros((B, K) if out_last is not None else (0, K), dtype=e.dtype)
        args = (as_array(init), e, r, a, L, _length_order(L), log_cond, alphas, keep_alphas, last)
        if engine == "lockstep":
            run_lockstep(lockstep.forward_lockstep, args, e.dtype, threads,
                         blas.packed_matrix(trans, False) if pack else None, provider)
        else:
            run_groups(groups.forward_groups, B, args, threads)
        if out_last is not None:
            out_last.copy_(torch.from_numpy(last))
        if keep_alphas:
            for b in np.flatnonzero(L < T):
                alphas[b, L[b]:] = 0.0
    out = torch.from_numpy(log_cond).to(table.dtype)
    if keep_alphas and out_alphas is not None:
        return out, out_alphas
    return out, (torch.from_numpy(alphas) if keep_alphas else None)


def _output(x: Tensor, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A caller's output tensor as the numpy view the kernels write through (never a copy)."""
    a = x.detach().numpy()
    if a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"output buffer: expected a C-contiguous {shape} {dtype} array, got {a.shape} {a.dtype}")
    return a


def _forward_one(init: np.ndarray, table: np.ndarray, rows: np.ndarray, trans: np.ndarray, log_cond: np.ndarray,
                 threads: int) -> None:
    """One sequence; with threads >= 2 split by columns over two threads (where K leaves both a share)."""
    K = table.shape[1]
    half = (K // 2 + 15) // 16 * 16  # 64-byte aligned column split
    if threads < 2 or half >= K:
        groups.forward_one(init, table, rows, trans, log_cond)
        return
    shared = np.zeros((2, K), dtype=table.dtype)
    partial = np.zeros((2, 16), dtype=np.float64)
    flags = np.zeros(32, dtype=np.int64)
    # a thread of its own, not the pool: the two threads wait on each other every step, so the helper must
    # start now, not behind other callers' tasks
    helper = threading.Thread(target=groups.forward_one_split,
                              args=(init, table, rows, trans, log_cond, shared, partial, flags, 1, half, K))
    helper.start()
    groups.forward_one_split(init, table, rows, trans, log_cond, shared, partial, flags, 0, 0, half)
    helper.join()


def posterior_cpu(init: Tensor, table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, *,
                  threads: int, pack: bool = False, provider: str = "") -> tuple[Tensor, Tensor]:
    """`forward_cpu` with the filtered marginals and `backward_cpu` into them, fused per thread (lockstep
    kernels only): -> posteriors (B, T, K) (0 at padding) and log_cond (B, T). O(B T K^2)."""
    e, r = emission_rows(table, rows)
    L = lengths.numpy().astype(np.int64)
    B, T = r.shape
    K = e.shape[1]
    log_cond = np.zeros((B, T), dtype=np.float64)
    gamma = np.empty((B, T, K), dtype=e.dtype)  # every position written: posteriors, 0 at padding
    packed_b, mat_b, mat_is_trans = _backward_operands(trans, pack)
    args = (np.empty(0, dtype=e.dtype) if packed_b is None else packed_b, as_array(init), e, r, as_array(trans),
            mat_b, L, _length_order(L), log_cond, gamma, mat_is_trans)
    run_lockstep(lockstep.posterior_lockstep, args, e.dtype, threads,
                 blas.packed_matrix(trans, False) if pack else None, provider)
    return torch.from_numpy(gamma), torch.from_numpy(log_cond).to(table.dtype)


def posterior_halves(init: Tensor, table: Tensor, rows: Tensor | None, trans: Tensor, length: int
                     ) -> tuple[Tensor, Tensor]:
    """The posterior of one sequence (init (1, K), emissions as in `forward_cpu` with B = 1, its first `length`
    positions) on two threads that meet in the middle: one runs the forward from the start, the other the
    backward from the end, each keeping its half (alphas of [0, m), betas of [m, T)); then each goes on
    into the other's half, turning the kept vectors into posteriors alpha_t beta_t / sum as it passes.
    Each thread does T matrix-vector products, with no meeting but the one at the middle and no
    approximation (the backward normalises its betas by their own sum: the posterior does not depend on
    their scale). -> posteriors (1, T_in, K) (0 at padding) and log_cond (1, T_in) (0 at padding), T_in
    being the emissions' width. O(T K^2) per thread; one (T, K) output and nothing else of that size."""
    e, r = emission_rows(table, rows)
    T_in, K = r.shape[1], e.shape[1]
    n = int(length)
    log_cond = np.zeros((1, T_in), dtype=np.float64)
    # np.empty, not np.zeros (see `forward_cpu`): every position below n is written by the kernels
    gamma = blas.aligned_empty((1, T_in, K), e.dtype)  # rows on cache lines where K allows
    gamma[0, n:] = 0.0
    if n > 0:
        a, a_t, r0, lc, g = as_array(trans), blas.transposed(trans), r[0, :n], log_cond[:, :n], gamma[:, :n]
        # the vectors each step reads and writes whole, on cache-line boundaries (`blas.aligned_empty`)
        x, beta, *scratch = (blas.aligned_empty((K,), e.dtype) for _ in range(5))
        x[:], beta[:] = 0.0, 1.0
        first = as_array(init[0])
        m = n // 2

        def half(k: int, second: bool) -> None:
            if k == 0:
                groups.halves_forward(first, e, r0, a, m if second else 0, n if second else m, second, lc, g, x,
                                      scratch[0])
            else:
                groups.halves_backward(e, r0, a_t, 0 if second else m, m if second else n, second, g, beta,
                                       scratch[1], scratch[2])

        run_split(lambda k: half(k, False), 2)  # each its own half ...
        run_split(lambda k: half(k, True), 2)  # ... then the other's
    return torch.from_numpy(gamma), torch.from_numpy(log_cond).to(table.dtype)


def backward_cpu(table: Tensor, rows: Tensor | None, trans: Tensor, lengths: Tensor, log_cond: Tensor, *,
                 engine: str, threads: int, alphas: Tensor | None = None, pack: bool = False,
                 provider: str = "", out: Tensor | None = None) -> Tensor:
    """Scaled backward on CPU in compiled code, with `forward_cpu`'s scales `log_cond` (B, T) and its
    emission arguments; `engine` "groups" or "lockstep", `pack` as in `forward_cpu`.

    Without `alphas`: the betas (B, T, K) (1 at the last position and at padding; written into `out`, contiguous,
    where given, and it is returned). With `alphas` (as
    returned by `forward_cpu`): the posteriors p(z_t | x) (B, T, K), written into `alphas` in place (0 at
    padding), so a posterior needs one (B, T, K) tensor, not three. O(B T K^2)."""
    e, r = emission_rows(table, rows)
    B, T = r.shape
    L = lengths.numpy().astype(np.int64)
    lc = np.ascontiguousarray(log_cond.detach().double().numpy())
    if alphas is not None:
        dest = alphas.numpy()
    elif out is not None:
        dest = _output(out, (B, T, e.shape[1]), e.dtype)
    else:
        dest = np.empty((B, T, e.shape[1]), dtype=e.dtype)
    if engine == "lockstep":
        packed_b, mat_b, mat_is_trans = _backward_operands(trans, pack)
        args = (e, r, mat_b, L, _length_order(L), lc, dest, alphas is not None, mat_is_trans)
        run_lockstep(lockstep.backward_lockstep, args, e.dtype, threads, packed_b, provider)
    else:
        run_groups(groups.backward_groups, B,
                   (e, r, blas.transposed(trans), L, _length_order(L), lc, dest, alphas is not None), threads)
    if alphas is not None:
        return alphas
    return out if out is not None else torch.from_numpy(dest)


def posteriors_from(alphas: Tensor, betas: Tensor, threads: int) -> Tensor:
    """alphas (N, K) contiguous <- alphas * betas normalised per row (0 where a row's sum is 0), in place and
    returned: one pass over both (torch ops take three), the rows split over `threads` threads. O(N K)."""
    a, b = _output(alphas, tuple(alphas.shape), as_array(betas).dtype), as_array(betas)
    run_ranges(np.ones(len(a)), threads, lambda lo, hi: row_ops.products_normalised(a, b, lo, hi))
    return alphas


def rows_times(x: Tensor, trans: Tensor) -> Tensor:
    """x @ trans for a few rows x (N, K), trans (K, K), in compiled code on the calling thread (between two
    kernel calls a BLAS call would wake BLAS's thread pool, which then spins for milliseconds on the cores
    the next kernel needs)."""
    out = torch.empty_like(x)
    row_ops.rows_matmul(as_array(x), as_array(trans), out.numpy())
    return out
