"""The operation routes' disconnect watcher (`routes.operations.Watch`): a request answered within WATCH_AFTER_S
starts no task; one still running after it watches its connection, and a client that goes away cancels its work."""

from __future__ import annotations

import asyncio

from latentlm.service.batcher import CancelScope
from latentlm.service.routes import operations
from latentlm.service.routes.operations import Watch


def run(coro):
    return asyncio.run(coro)


def test_a_request_answered_before_the_delay_starts_no_watcher():
    received = []

    async def receive():
        received.append(1)
        await asyncio.sleep(10)

    async def main():
        scope = CancelScope()
        watch = Watch(receive, scope)
        tasks_before = len(asyncio.all_tasks())
        watch.arm()
        await asyncio.sleep(0)
        watch.stop()
        assert len(asyncio.all_tasks()) == tasks_before
        await asyncio.sleep(operations.WATCH_AFTER_S * 2)  # the timer was cancelled: nothing starts later
        assert watch.task is None and not received and not scope.cancelled

    run(main())


def test_a_slow_request_whose_client_goes_away_is_cancelled():
    async def main():
        disconnected = asyncio.Event()

        async def receive():
            await disconnected.wait()
            return {"type": "http.disconnect"}

        scope = CancelScope()
        fut = asyncio.get_running_loop().create_future()
        scope.futures.append(fut)
        watch = Watch(receive, scope)
        watch.arm()
        await asyncio.sleep(operations.WATCH_AFTER_S * 1.5)
        assert watch.task is not None and not watch.task.done()  # watching now
        disconnected.set()
        await asyncio.sleep(0.01)
        assert scope.cancelled and fut.cancelled()
        watch.stop()

    run(main())


def test_stop_cancels_a_running_watcher():
    async def main():
        async def receive():
            await asyncio.sleep(10)

        watch = Watch(receive, CancelScope())
        watch.arm()
        await asyncio.sleep(operations.WATCH_AFTER_S * 1.5)
        task = watch.task
        assert task is not None
        watch.stop()
        await asyncio.sleep(0)
        assert task.cancelled() and watch.task is None

    run(main())


def test_access_lines_are_written_in_blocks_and_none_is_lost():
    import io
    import logging
    import time

    from latentlm.service.server import BlockWriter

    out = io.StringIO()
    block = BlockWriter(out, logging.Formatter("%(message)s"), max_delay_s=1.0, max_bytes=200)
    logger = logging.getLogger("test.access.blocks")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(block)
    try:
        for i in range(5):
            logger.info("line %d", i)
        assert out.getvalue() == ""  # waiting: one write for many lines
        deadline = time.monotonic() + 5
        while out.getvalue().count("\n") < 5:  # written at most max_delay_s later, without another line
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert out.getvalue() == "".join(f"line {i}\n" for i in range(5))
        for _ in range(40):  # max_bytes waiting: written at once
            logger.info("x" * 9)
        assert out.getvalue().count("x" * 9) >= 19
        logger.info("last")
        block.close()  # at exit (or when uvicorn stops): what waits is written
        assert out.getvalue().endswith("last\n") and out.getvalue().count("x" * 9) == 40
    finally:
        logger.removeHandler(block)
