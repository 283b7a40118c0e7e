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
