"""One protocol for every asynchronous phx operation.

Whatever starts work in the background - ``File.pread_async`` into host
memory or a GPU tensor, ``phx.gpu.read_async`` on a stream, a GPU batch, a
``phx.kv`` write - returns a :class:`PhxFuture`:

``result(timeout=None)``
    the value (bytes moved; a list of them for a batch), waiting up to
    ``timeout`` seconds: :class:`TimeoutError` when it is not done by then,
    the operation's :class:`OSError` when it failed.
``done()``
    whether it has finished (never blocks).
``exception(timeout=None)``
    the operation's exception, or None.
``add_done_callback(fn)``
    ``fn(future)`` once it is done: at once (in this thread) when it already
    is, else from phx's completion thread, in the order added.
``bytes_by_path()``
    bytes moved by path once done, always with the keys of :data:`PATHS`:
    ``direct`` (O_DIRECT between the file and the caller's memory or GPU
    staging), ``bounce`` (O_DIRECT through aligned bounce buffers) and
    ``page_cache`` (through the page cache).
``await future``
    in a coroutine, the same value as ``result()``.

Callbacks and ``await`` are driven by one daemon thread per process that
sleeps on the eventfds of the engines and GPU contexts whose futures are
watched (``Engine.eventfd``, ``phx_cuda_eventfd``): it uses no CPU while
nothing completes.  That thread reads those eventfds to reset them; a
program that also reads an engine's eventfd itself should call ``poll()``
after every wake-up rather than count wake-ups.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import os
import select
import threading
from typing import Any, Callable, Generator

__all__ = ["PhxFuture", "PoolFuture", "DoneFuture", "PATHS", "add_done_callback", "empty_paths",
           "wait_async"]

#: the path names of :meth:`PhxFuture.bytes_by_path`, everywhere
PATHS: tuple[str, str, str] = ("direct", "bounce", "page_cache")

_log = logging.getLogger("phx")


class PhxFuture(abc.ABC):
    """The one future type of phx (see the module's text).  Subclasses give
    :meth:`done`, :meth:`result`, :meth:`bytes_by_path` and, when they can,
    :meth:`_wake_fd`; the rest is here.  ``phx.Future`` (host requests,
    compiled) is registered as one."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the operation has finished."""

    @abc.abstractmethod
    def result(self, timeout: float | None = None) -> Any:
        """The operation's value; see the module's text."""

    @abc.abstractmethod
    def bytes_by_path(self) -> dict[str, int]:
        """Bytes moved by path (the keys of :data:`PATHS`); zeros until done."""

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's exception, or None (TimeoutError when not done in time)."""
        return _exception(self, timeout)

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(self)`` once done (now, if it already is)."""
        add_done_callback(self, fn)

    def _wake_fd(self) -> int | None:
        """An fd readable when the operation may have finished, or None (then
        the completion thread looks every few milliseconds)."""
        return None

    def __await__(self) -> Generator[Any, None, Any]:
        return wait_async(self).__await__()


class PoolFuture(PhxFuture):
    """An operation that runs on a worker thread (a
    :class:`concurrent.futures.Future` inside), e.g. ``phx.kv``'s NVMe writes:
    all its bytes (its integer result) went by ``path``; ``path=None`` for
    work that moves none (``phx.loader.prepare``)."""

    def __init__(self, cf: concurrent.futures.Future[Any], path: str | None = "direct"):
        self._cf, self._path = cf, path

    def done(self) -> bool:
        return self._cf.done()

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._cf.result(timeout)
        except concurrent.futures.TimeoutError:      # not TimeoutError before 3.11
            raise TimeoutError(f"not complete after {timeout} s") from None

    def bytes_by_path(self) -> dict[str, int]:
        out = empty_paths()
        if (self._path and self._cf.done() and not self._cf.cancelled()
                and self._cf.exception() is None):
            out[self._path] = int(self._cf.result())
        return out

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self._cf.add_done_callback(lambda _: _call(fn, self))


class DoneFuture(PhxFuture):
    """An operation that finished before it was returned (e.g. a copy into
    the page cache): ``result()`` is ``value``, its bytes went by ``path``."""

    def __init__(self, value: int, path: str = "page_cache"):
        self._value, self._path = value, path

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> int:
        return self._value

    def bytes_by_path(self) -> dict[str, int]:
        out = empty_paths()
        out[self._path] = self._value
        return out


def _exception(fut: Any, timeout: float | None) -> BaseException | None:
    try:
        fut.result(timeout)
    except TimeoutError:
        raise
    except Exception as e:          # the operation's error, as result() raises it
        return e
    return None


def empty_paths() -> dict[str, int]:
    """``bytes_by_path()`` of an operation that moved nothing (yet)."""
    return dict.fromkeys(PATHS, 0)


def _call(fn: Callable[[Any], object], fut: Any) -> None:
    try:
        fn(fut)
    except Exception:
        _log.exception("phx: a done callback of %r raised", fut)


def add_done_callback(fut: Any, fn: Callable[[Any], object]) -> None:
    """``fut.add_done_callback(fn)`` for any phx future (the compiled
    ``phx.Future`` calls this too)."""
    if fut.done():
        _call(fn, fut)
        return
    _Watcher.get().add(fut, fn)


async def wait_async(fut: Any) -> Any:
    """``await fut``: its ``result()``, without blocking the event loop."""
    if not fut.done():
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_: Any) -> None:
            def settle() -> None:
                if not woken.done():
                    woken.set_result(None)

            loop.call_soon_threadsafe(settle)

        add_done_callback(fut, wake)
        await woken
    return fut.result()


def _drain(fd: int) -> None:
    try:
        os.read(fd, 8)
    except (BlockingIOError, OSError):
        pass


class _Watcher:
    """The completion thread: fires done callbacks (see the module's text)."""

    _inst: "_Watcher | None" = None
    _inst_lock = threading.Lock()
    POLL_MS = 5          # for futures without a wake fd
    IDLE_MS = 200        # a safety net: every fd is looked at this often anyway

    @classmethod
    def get(cls) -> "_Watcher":
        with cls._inst_lock:
            # a forked child has no thread: it gets a watcher of its own
            if cls._inst is None or cls._inst.pid != os.getpid():
                cls._inst = cls()
            return cls._inst

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.items: list[tuple[Any, list[Callable[[Any], object]], int | None]] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.thread: threading.Thread | None = None

    def add(self, fut: Any, fn: Callable[[Any], object]) -> None:
        fd = fut._wake_fd()
        with self.lock:
            for f, fns, _ in self.items:
                if f is fut:
                    fns.append(fn)
                    break
            else:
                self.items.append((fut, [fn], fd))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="phx-completions",
                                               daemon=True)
                self.thread.start()
        os.write(self.wake_w, b"x")
        # it may have finished before the thread saw it: the thread looks again

    def _run(self) -> None:
        while True:
            with self.lock:
                fds = {fd for _, _, fd in self.items if fd is not None}
                blind = any(fd is None for _, _, fd in self.items)
            poller = select.poll()
            poller.register(self.wake_r, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            timeout = self.POLL_MS if blind else (self.IDLE_MS if fds else None)
            try:
                ready = poller.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ in ready:
                _drain(fd)
            self._fire()

    def _fire(self) -> None:
        with self.lock:
            items = list(self.items)
        finished = []
        for item in items:
            try:
                if item[0].done():
                    finished.append(item)
            except Exception:       # a broken future must not stop the thread
                _log.exception("phx: done() of %r raised", item[0])
                finished.append(item)
        if not finished:
            return
        with self.lock:
            self.items = [it for it in self.items if all(it is not f for f in finished)]
        for fut, fns, _ in finished:
            for fn in fns:
                _call(fn, fut)
