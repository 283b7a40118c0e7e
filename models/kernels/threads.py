"""Threads for the compiled kernels: a process-wide helper pool (Python side) and the spin-wait primitives
two compiled threads use to meet every step (release/acquire step counters, `sched_yield`).

`run_split(fn, threads)` runs fn(k) for k < threads, k = 0 on the calling thread and the others on the
pool; the kernels themselves release the GIL (`nogil=True`), so the threads run in parallel. `spans` cuts
independent items into contiguous ranges of equal weight, one per thread (`run_ranges` runs them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from latentlm.models.kernels.jit import HAVE_NUMBA, njit

_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least `workers` helper threads (grown on demand, never shrunk)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0]._max_workers < workers:
            _POOL[:] = [ThreadPoolExecutor(max_workers=workers, thread_name_prefix="latentlm-chain")]
        return _POOL[0]


def run_split(fn: Callable[[int], object], threads: int) -> None:
    """fn(0) on this thread and fn(1), ..., fn(threads - 1) on the pool; returns when all are done (an
    exception in any is raised here)."""
    if threads <= 1:
        fn(0)
        return
    futures = [pool(threads - 1).submit(fn, k) for k in range(1, threads)]
    fn(0)
    for f in futures:
        f.result()


def spans(weights: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ranges [lo, hi) covering every item of `weights` (n,) (tokens per row, words per
    cluster), at most `parts` of them, each with about the same total weight: independent items split over
    threads that never wait for each other. O(n)."""
    n = len(weights)
    total = np.cumsum(weights)
    cuts = [0]
    for i in range(1, max(1, min(parts, n))):
        cut = int(np.searchsorted(total, total[-1] * i / parts, side="right"))
        cuts.append(min(max(cut, cuts[-1] + 1), n))
    cuts.append(n)
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True) if hi > lo]


def run_ranges(weights: np.ndarray, threads: int, fn: Callable[[int, int], object]) -> None:
    """fn(lo, hi) for each of the `spans` of `weights` over `threads` threads (`run_split`)."""
    ranges = spans(weights, threads)
    run_split(lambda i: fn(*ranges[i]), len(ranges))


SPINS_BEFORE_YIELD = 2000  # polls of the other thread's counter before giving up the core once

if HAVE_NUMBA:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def load_acquire(typingctx, arr, idx):  # pragma: no cover - compiled
        """arr[idx] (int64) read with acquire ordering: a spin loop on it is never hoisted or torn."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]], wraparound=False)
            return builder.load_atomic(ptr, "acquire", 8)
        return types.int64(arr, idx), codegen

    @intrinsic
    def store_release(typingctx, arr, idx, val):  # pragma: no cover - compiled
        """arr[idx] = val (int64) with release ordering: every earlier write is visible to an acquirer."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]], wraparound=False)
            builder.store_atomic(args[2], ptr, "release", 8)
            return context.get_dummy_value()
        return types.void(arr, idx, val), codegen

    @intrinsic
    def yield_core(typingctx):  # pragma: no cover - compiled
        """sched_yield(2): let another runnable thread have this core (a call by symbol name, so the
        function stays cacheable, unlike a ctypes pointer)."""
        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    @njit(nogil=True, inline="always", cache=True)
    def spin_until(flags, idx, value):  # pragma: no cover - compiled
        """Wait until flags[idx] >= value (acquire), polling, and yielding the core every SPINS_BEFORE_YIELD
        polls."""
        spins = 0
        while load_acquire(flags, idx) < value:
            spins += 1
            if spins >= SPINS_BEFORE_YIELD:
                yield_core()
                spins = 0
