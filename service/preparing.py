"""Preparation that costs CPU, off the event loop: a constraint's automaton is compiled (`ops.constrain`, up to
LATENTLM_CONSTRAINT_COMPILE_SECONDS of work) on a small pool of preparation threads, never on the thread that
answers /health, /ready, /metrics and light requests.

`Preparer.run(fn, scope)` runs `fn` on the pool and awaits it: at most `workers` compilations run at once (each
holds the GIL in turns with the event loop, so more of them would only slow the loop), more wait in the pool's
queue, and beyond `max_waiting` waiting or running (the heavy lane's `max_heavy_requests`) a request is refused
429 (`QueueFull`). The request's `CancelScope` cancels the wait when its client goes away, and `cancelled_for(scope)`
is what the compilation polls (`automata.Budget`), so it stops at its next check; `stop()` (the end of the
shutdown grace, or the app stopping) cancels every compilation the same way and answers their requests 503.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from latentlm.models.automata import CompileCancelled
from latentlm.service.batcher import CancelScope, QueueFull
from latentlm.service.errors import ShuttingDown

DEFAULT_WORKERS = 1
DEFAULT_MAX_WAITING = 16


class Preparer:
    """A bounded pool of preparation threads (see the module docstring)."""

    def __init__(self, workers: int = DEFAULT_WORKERS, max_waiting: int = DEFAULT_MAX_WAITING):
        self.workers, self.max_waiting = workers, max_waiting
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="latentlm-prepare")
        self.pending = 0  # requests waiting for or running on the pool (event loop only)
        self.stopped = False

    def cancelled_for(self, scope: CancelScope | None) -> Callable[[], bool]:
        """What a compilation for the request of `scope` polls: its client went away, or the service stops."""
        if scope is None:
            return lambda: self.stopped
        return lambda: self.stopped or scope.cancelled

    async def run(self, fn: Callable[..., Any], *args: Any, scope: CancelScope | None = None) -> Any:
        """`fn(*args)` on the pool; QueueFull above `max_waiting`, ShuttingDown once stopped (or when `fn` was
        cancelled by `stop`); when `scope` is cancelled the await raises CancelledError at once."""
        if self.stopped:
            raise ShuttingDown()
        if self.pending >= self.max_waiting:
            raise QueueFull(f"{self.pending} requests are preparing (compiling a constraint) or waiting to "
                            f"(limit {self.max_waiting}, max_heavy_requests); retry later")
        self.pending += 1
        fut = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))
        if scope is not None:
            scope.futures.append(fut)
        try:
            return await fut
        except CompileCancelled:
            if self.stopped:
                raise ShuttingDown() from None
            raise asyncio.CancelledError() from None  # its client went away (the route answers 499)
        finally:
            self.pending -= 1
            if scope is not None and fut in scope.futures:
                scope.futures.remove(fut)

    def stop(self) -> None:
        """Cancel every compilation (they stop at their next check) and refuse new work; idempotent."""
        self.stopped = True
        self.pool.shutdown(wait=False, cancel_futures=True)
