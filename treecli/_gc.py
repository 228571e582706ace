"""Pausing Python's cyclic garbage collector while a big metadata tree is built
(a header parse, for library callers) or for a whole CLI command.

Parsing a 200k-tensor header and building its summary allocate millions of
long-lived containers and no garbage cycles; the collector's repeated passes
over them took half of ``show``'s time on such files (0.9 s of JSON parsing
became 0.45 s). Reference counting still frees everything as usual, except what a command hands to
the process's end (``outlive``).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block (re-enabled after, if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_outliving: list | None = None  # a list once the process ends with os._exit after one command


def exit_without_freeing() -> None:
    """Say that this process ends by ``os._exit`` once its command returns (the CLI's entry
    point does): objects handed to ``outlive`` are then never freed one by one."""
    global _outliving
    _outliving = []


def outlive(*objects: object) -> None:
    """Keep ``objects`` to the end of the process, where freeing a big tree object by object
    (0.1 s of showing a 200k-tensor header) is skipped; a no-op for a process that goes on
    (tests, library callers), where they are freed as usual."""
    if _outliving is not None:
        _outliving.extend(objects)


class Orphans:
    """What finalizers hand back to a store guarded by ``lock``: ``collected(key)`` may be
    called by the collector anywhere, even inside the store's own locked section on this
    thread, so it never waits for the lock: it forgets the key at once when the lock is
    free, else leaves it to the next holder, who calls ``drain`` first."""

    def __init__(self, lock: threading.Lock, forget: Callable[[Any], None]):
        self._lock, self._forget = lock, forget
        self._keys: collections.deque = collections.deque()

    def collected(self, key: Any) -> None:
        self._keys.append(key)
        if self._lock.acquire(blocking=False):
            try:
                self.drain()
            finally:
                self._lock.release()

    def drain(self) -> None:
        """Forget every key handed back (the lock held)."""
        while self._keys:
            self._forget(self._keys.popleft())
