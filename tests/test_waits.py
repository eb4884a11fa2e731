"""A cancellation that lands in the same loop iteration as the awaited work ends
is never lost (no server: the exact interleavings, made deterministic).

These are the interleavings that made a caller's anyio scope leak a bare
``CancelledError`` in the cancel harness under CPU load (see ``_waits.py``).
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from lmkv_async._shield import finish, wait_finished
from lmkv_async._waits import acquire_within, wait_event

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_anyio_scope_catches_its_cancel_when_the_event_fires_with_it() -> None:
    """The event is set and the caller's scope cancelled in one callback, while
    two waits run under ``asyncio.gather``: the scope catches its own cancel and
    nothing escapes it (``asyncio.wait_for`` on 3.10/3.11 lets a bare
    ``CancelledError`` out here)."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    with anyio.CancelScope() as scope:

        def both() -> None:
            event.set()
            scope.cancel()

        loop.call_later(0.01, both)
        await asyncio.gather(wait_event(event, 10), wait_event(event, 10))
        pytest.fail("the scope was cancelled: the gather must not return")
    assert scope.cancelled_caught


async def test_task_cancel_is_not_lost_when_the_event_fires_with_it() -> None:
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_event(event, 10))
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_event_times_out_and_sees_a_set_event() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    assert await wait_event(event, -1) is False
    event.set()
    assert await wait_event(event, 0) is True


async def test_finish_keeps_a_cancel_that_lands_as_the_work_ends() -> None:
    """The work ends and the caller is cancelled in the same iteration: the
    caller still sees its cancellation (it used to get the result instead)."""
    gate = asyncio.Event()
    ran: list[int] = []

    async def work() -> int:
        await gate.wait()
        ran.append(7)
        return 7

    task = asyncio.ensure_future(finish(work()))
    await asyncio.sleep(0.01)
    gate.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == [7]  # and the work itself ran to its end


async def test_wait_finished_propagates_the_works_own_cancellation() -> None:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, fut.cancel)
    with pytest.raises(asyncio.CancelledError):
        await wait_finished(fut)


async def test_acquire_within_times_out_without_holding_the_lock() -> None:
    lock = asyncio.Lock()
    await lock.acquire()
    assert await acquire_within(lock, 0.01) is False
    loop = asyncio.get_running_loop()
    # granted in the same iteration as the deadline: either held (True) or passed on
    loop.call_later(0.02, lock.release)
    held = await acquire_within(lock, 0.02)
    if held:
        lock.release()
    assert not lock.locked()
    assert await acquire_within(lock, 0) is True
    lock.release()


async def test_acquire_within_does_not_lose_a_task_cancel() -> None:
    lock = asyncio.Lock()
    await lock.acquire()
    task = asyncio.ensure_future(acquire_within(lock, 10))
    await asyncio.sleep(0.01)
    lock.release()  # grants the lock to the waiter ...
    task.cancel()  # ... which is cancelled in the same iteration
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not lock.locked()  # the grant went back, not leaked to a cancelled waiter
