"""The blocking facade's event loop: one asyncio loop in its own thread.

The blocking facade (:mod:`lmkv_async.sync`) needs an event loop that its callers
do not run. It uses this one, started on first use through anyio's blocking
portal and stopped at interpreter exit, after the objects still open on it
(contexts, fleets) were closed, so that no session or registration stays on a
server. Importing this module starts nothing. (Async code, on asyncio or trio,
runs the library on its own loop; nothing of it comes here.)

A forked child has no loop thread: the first use there starts a new one, and the
objects of the parent's loop are unusable in it (``generation()`` changes).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

__all__ = ["EXIT_CLOSE_TIMEOUT", "forget", "generation", "portal", "running", "stop",
           "thread", "track_if_on_loop"]

#: How long interpreter exit waits for objects still open on the loop to close.
EXIT_CLOSE_TIMEOUT = 10.0


class Closable(Protocol):
    """What the loop closes at exit: contexts and fleets opened on it."""

    async def aclose(self) -> None: ...


_lock = threading.Lock()
_portal: BlockingPortal | None = None
_portal_cm: contextlib.AbstractContextManager[BlockingPortal] | None = None
_thread: threading.Thread | None = None
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0
#: bumped whenever a loop thread is started; an object opened on it belongs to it
_generation = 0
_hooks_installed = False
_open: weakref.WeakSet[Closable] = weakref.WeakSet()


#: A forked child's references to its parent's portal. They are kept, never dropped:
#: dropping the portal's context manager finalizes it, and its ``finally`` calls into
#: the parent's loop thread, which does not exist in the child, so the child hangs.
_parent_portal: list[object] = []


def _after_fork_in_child() -> None:
    # The loop thread does not exist in a forked child; start a new one on demand.
    global _lock, _portal, _portal_cm, _thread, _loop
    _lock = threading.Lock()  # another thread of the parent may have held the old one
    if _portal_cm is not None:
        _parent_portal.append((_portal, _portal_cm, _thread, _loop))
    _portal = _portal_cm = _thread = _loop = None
    _open.clear()


def portal() -> BlockingPortal:
    """The process's portal, started on first use."""
    global _portal, _portal_cm, _thread, _loop, _pid, _hooks_installed, _generation
    found = _portal
    if found is not None and _pid == os.getpid():
        return found
    with _lock:
        if _portal is not None and _pid == os.getpid():
            return _portal
        from anyio.from_thread import start_blocking_portal

        try:
            cm = start_blocking_portal("asyncio", name="lmkv-loop")
        except TypeError:  # anyio < 4.? has no name=
            cm = start_blocking_portal("asyncio")
        started = cm.__enter__()
        thread_ = started.call(threading.current_thread)
        loop_ = started.call(asyncio.get_running_loop)
        _portal, _portal_cm, _thread, _loop, _pid = started, cm, thread_, loop_, os.getpid()
        _generation += 1
        if not _hooks_installed:
            _hooks_installed = True
            os.register_at_fork(after_in_child=_after_fork_in_child)
            # A daemon loop thread lets atexit run; a non-daemon one (older anyio)
            # would be joined before atexit, so stop it from threading's own exit
            # hooks, which run first (the hook concurrent.futures uses).
            register = getattr(threading, "_register_atexit", None)
            if thread_.daemon or register is None:
                atexit.register(stop)
            else:
                register(stop)
        return started


def thread() -> threading.Thread | None:
    """The loop's thread, or None while none runs in this process."""
    return _thread if _pid == os.getpid() else None


def generation() -> int:
    """Which loop thread is the current one; changes when a new one starts."""
    return _generation


def running() -> bool:
    """Whether a loop thread runs in this process now."""
    return _portal is not None and _pid == os.getpid()


def track_if_on_loop(obj: Closable) -> None:
    """Close ``obj`` (with ``aclose``) when the loop stops, if still open, when called
    on the client loop's thread (opened for the blocking facade); else
    nothing: the caller's own loop owns it."""
    if _thread is not None and threading.current_thread() is _thread:
        _open.add(obj)


def forget(obj: Closable) -> None:
    """``obj`` was closed by its owner: nothing to do for it at stop."""
    _open.discard(obj)


def stop(timeout: float = EXIT_CLOSE_TIMEOUT) -> None:
    """Close every tracked object still open and stop the loop thread, if one was started.

    Objects are closed concurrently, for at most ``timeout`` seconds in all. A
    later :func:`portal` starts a new thread.
    """
    global _portal, _portal_cm, _thread, _loop
    with _lock:
        found, cm = _portal, _portal_cm
        if found is None or cm is None or _pid != os.getpid():
            return
        objs = [o for o in list(_open) if not getattr(o, "closed", False)]

        async def close_all() -> None:
            import anyio

            with anyio.move_on_after(timeout):
                async with anyio.create_task_group() as tg:
                    for o in objs:
                        tg.start_soon(o.aclose)

        try:
            if objs:
                found.call(close_all)
        finally:
            _portal = _portal_cm = _thread = _loop = None
            _open.clear()
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
