"""The operation routes' disconnect watcher (`routes.operations.Watch`): a request answered within WATCH_AFTER_S
starts no task; one still running after it watches its connection, and a client that goes away cancels its work."""

from __future__ import annotations

import asyncio

import pytest

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


def test_the_plain_access_formatter_prints_uvicorns_lines():
    import logging

    import uvicorn.logging

    from latentlm.service.server import UVICORN_ACCESS_FORMAT, PlainAccessFormatter

    theirs = uvicorn.logging.AccessFormatter(UVICORN_ACCESS_FORMAT, use_colors=False)
    ours = PlainAccessFormatter()
    assert PlainAccessFormatter.replaces(theirs)
    assert not PlainAccessFormatter.replaces(uvicorn.logging.AccessFormatter(UVICORN_ACCESS_FORMAT, use_colors=True))
    assert not PlainAccessFormatter.replaces(uvicorn.logging.AccessFormatter("%(asctime)s %(message)s",
                                                                             use_colors=False))
    cases = [("127.0.0.1:5000", "POST", "/v1/score", "1.1", 200, logging.INFO),
             ("[::1]:80", "GET", "/v1/models?api_key=***", "1.0", 404, logging.INFO),
             ("10.0.0.2:1", "POST", "/v1/sample", "1.1", 599, logging.INFO),  # no phrase for 599
             ("10.0.0.2:1", "GET", "/", "1.1", 503, logging.WARNING),
             ("10.0.0.2:1", "GET", "/%20x", "2", 200, logging.DEBUG)]
    for _ in range(2):  # the second time from the phrase cache
        for client, method, path, version, status, level in cases:
            record = logging.LogRecord("uvicorn.access", level, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                       (client, method, path, version, status), None)
            assert ours.format(record) == theirs.format(record)
            assert str(status) in ours.format(record) and path in ours.format(record)
    odd = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "not an access line", None, None)
    for formatter in (ours, theirs):  # a record that is not an access line fails alike in both
        with pytest.raises(TypeError):
            formatter.format(odd)
