"""Moving a leaf's bytes through a command, the reading side: prefetch and helper
threads, chunks of one leaf or of two compared, work spread over two threads. The
writing side (the chunk-by-chunk leaf writer, write-back hints, read-back and
digests) is ``writer``. Every reader of every format streams here.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterator, Sequence

from treecli._leaf import CHUNK_BYTES, ArrayLeaf


class _Worker:
    """One daemon thread that runs submitted calls in order, returning futures.

    Not a ThreadPoolExecutor: its workers are joined when the interpreter exits, and
    one whose start a Ctrl-C interrupted was never registered to be told to stop, so
    exit waited on it forever. A daemon thread never holds up exit, for the CLI and
    for a Python caller of the library alike.
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"treecli-{name}", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            self._run_one(*self._queue.get())

    @staticmethod
    def _run_one(future: Future, fn: Callable[..., Any], args: tuple) -> None:
        # A call of its own: nothing of a task outlives it (held by the loop until the next
        # task came, a closure kept a merged leaf's statistics and buffers alive).
        if not future.set_running_or_notify_cancel():  # cancelled while it waited
            return
        try:
            result = fn(*args)
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
        else:
            future.set_result(result)


_pools: dict[str, _Worker] = {}
_pools_lock = threading.Lock()


def _pool(name: str) -> _Worker:
    with _pools_lock:
        if name not in _pools:
            _pools[name] = _Worker(name)
        return _pools[name]


def _on_pool_thread(name: str) -> bool:
    """Whether the calling thread is the worker of ``_pool(name)``."""
    worker = _pools.get(name)
    return worker is not None and threading.current_thread() is worker.thread


_spare_buffers: list[Any] = []  # CHUNK_BYTES byte buffers, reused from leaf to leaf
INLINE_BYTES = 1 << 20  # a leaf this small is read without the prefetch thread


def iter_chunks(leaf: ArrayLeaf, chunk_bytes: int = CHUNK_BYTES, *,
                each: Callable[[Any], None] | None = None) -> Iterator[Any]:
    """The leaf's chunks in order, each computed in a background thread while the
    caller consumes the previous one (writing overlaps reading and arithmetic).
    ``each(chunk)``, when given, runs on that thread too, in order, before the chunk
    is handed over.

    A chunk is valid until the next one is asked for: leaves that fill buffers
    take turns on two reused ones (touching fresh memory for every chunk of a
    1 GiB output cost 60k page faults, a fifth of ``average``'s time).
    Leaves of one small chunk are read in the caller's thread: a hand-off to the
    background thread and back costs about 0.3 ms here, and a file of 60k small
    tensors took 21 s to convert that way.
    """
    ranges = list(leaf.chunk_ranges(chunk_bytes))
    if not ranges:
        return
    if len(ranges) == 1 and leaf.nbytes <= INLINE_BYTES:
        chunk = leaf.read_flat(*ranges[0])
        if each:
            each(chunk)
        yield chunk
        return
    buffers: list[Any] = []
    if leaf.fills_buffers and chunk_bytes <= CHUNK_BYTES:
        buffers, views = _chunk_buffers(leaf, ranges[0])
        turns = itertools.count()  # reads run one at a time, in order, on the prefetch thread

        def read(start: int, stop: int):
            out = views[next(turns) % 2][: stop - start]
            leaf.read_into(start, stop, out)
            return out
    else:
        read = leaf.read_flat
    if each:
        plain_read = read

        def read(start: int, stop: int):
            chunk = plain_read(start, stop)
            each(chunk)
            return chunk

    pool = _pool("prefetch")
    future = pool.submit(read, *ranges[0])
    try:
        for i in range(len(ranges)):
            chunk = future.result()
            if i + 1 < len(ranges):
                future = pool.submit(read, *ranges[i + 1])
            yield chunk
    finally:
        future.cancel()
        if buffers:
            wait([future])  # never recycle a buffer the prefetch thread may still fill
            _spare_buffers.extend(buffers)


def _chunk_buffers(leaf: ArrayLeaf, first_range: tuple[int, int]) -> tuple[list, list]:
    """Two CHUNK_BYTES byte buffers, reused from earlier leaves where there are spares (give
    them back to ``_spare_buffers``), and views of them as ``leaf``'s chunks, as long as
    its first (and longest) range."""
    import numpy as np

    buffers = [_spare_buffers.pop() if _spare_buffers else np.empty(CHUNK_BYTES, np.uint8) for _ in range(2)]
    length = (first_range[1] - first_range[0]) * leaf.itemsize
    return buffers, [buffer[:length].view(leaf.dtype) for buffer in buffers]


def paired_chunks(a: ArrayLeaf, b: ArrayLeaf, start: int = 0) -> Iterator[tuple[Any, Any]]:
    """Two leaves of one shape and dtype, chunk by chunk side by side from the chunk that
    begins at element ``start``: ``a``'s chunk read on the prefetch thread while this thread
    reads ``b``'s, into two reused buffers.

    No read-ahead: comparing equal bytes takes far less than reading them, and the two
    reads at once beat a lookahead that ran them in turn on one thread (1 GiB compared
    in 0.16-0.18 s against 0.18-0.26 s; remote chunks wait one round trip a step, not two).
    """
    every = list(a.chunk_ranges())
    ranges = [r for r in every if r[0] >= start]
    # Read in turn on this thread: leaves that fill no buffers or differ in layout, a small
    # one, and any call made on the prefetch thread itself (a computed leaf's fill), which
    # would wait forever for a read queued behind it.
    if not ranges or not (a.fills_buffers and b.fills_buffers) or a.dtype != b.dtype or \
            every != list(b.chunk_ranges()) or (len(every) == 1 and a.nbytes <= INLINE_BYTES) or \
            _on_pool_thread("prefetch"):
        yield from zip((a.read_flat(*r) for r in ranges), (b.read_flat(*r) for r in ranges))
        return
    buffers, (first, second) = _chunk_buffers(a, ranges[0])
    pool = _pool("prefetch")
    future: Future | None = None
    try:
        for start, stop in ranges:
            x, y = first[: stop - start], second[: stop - start]
            future = pool.submit(a.read_into, start, stop, x)
            b.read_into(start, stop, y)
            future.result()
            yield x, y
    finally:
        if future is not None:
            wait([future])  # never recycle a buffer the prefetch thread may still fill
        _spare_buffers.extend(buffers)


_spare_raw: list[bytearray] = []  # CHUNK_BYTES byte buffers for first_difference, reused from leaf to leaf


def first_difference(a: Any, b: Any, progress: Callable[[int], None] | None = None) -> int | None:
    """Where the bytes of two leaves of one size stored in local files (``FileArrayLeaf``
    leaves of ``FileReader`` sources) first differ: the first element of the first chunk (of
    ``chunk_ranges``) that differs, or None when all are equal. Read side by side as
    ``paired_chunks`` reads, but into plain byte buffers compared by ``memcmp``: no NumPy,
    whose import was a fifth of comparing two equal 1 GiB files."""
    ranges = list(a.chunk_ranges())
    alone = (len(ranges) == 1 and a.nbytes <= INLINE_BYTES) or _on_pool_thread("prefetch")
    buffers = [_spare_raw.pop() if _spare_raw else bytearray(CHUNK_BYTES) for _ in range(2)]
    future: Future | None = None
    try:
        x, y = buffers
        for start, stop in ranges:
            begin, length = start * a.itemsize, (stop - start) * a.itemsize
            part_x, part_y = memoryview(x)[:length], memoryview(y)[:length]
            if alone:
                a.reader.read_view(part_x, a.offset + begin)
            else:
                future = _pool("prefetch").submit(a.reader.read_view, part_x, a.offset + begin)
            b.reader.read_view(part_y, b.offset + begin)
            if future is not None:
                future.result()
            # bytearrays compare with memcmp (memoryviews item by item): slices only for a short chunk
            if not (x == y if length == CHUNK_BYTES else x[:length] == y[:length]):
                return start  # (this chunk's progress is the caller's, who reads it again)
            if progress:
                progress(2 * length)
        return None
    finally:
        if future is not None:
            wait([future])  # never recycle a buffer the prefetch thread may still fill
        _spare_raw.extend(buffers)


FETCHERS = 4  # remote ranges in flight at once for one chunk


def in_flight(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` at once: the first on this thread, the rest on the fetch workers
    (each keeps its own connection), for a remote chunk read as several ranges.
    Waits for all of them; the first failure is raised."""
    futures = [_pool(f"fetch-{i % FETCHERS}").submit(call) for i, call in enumerate(calls[1:])]
    try:
        if calls:
            calls[0]()
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:  # the rest would fill a buffer the caller is about to drop or reuse
            future.cancel()
        wait(futures)
        raise


def on_two_threads(fill: Callable[[int, int, Any], None], start: int, stop: int, out: Any, block: int) -> None:
    """Run ``fill(start, stop, out)`` in blocks of ``block`` elements on this thread and a
    helper (NumPy releases the GIL), each taking the next block when it is free.

    Not two fixed halves: the writer and the kernel's writeback share the two
    cores, so one half often finished 0.5 s (a fifth of the run) before the other.
    """
    if stop - start < 2 * block:
        fill(start, stop, out)
        return

    def fill_block(s: int) -> None:
        e = min(stop, s + block)
        fill(s, e, out[s - start : e - start])

    each_on_two_threads(fill_block, range(start, stop, block))


def each_on_two_threads(visit: Callable[[Any], None], items: Sequence[Any]) -> None:
    """``visit(item)`` for each item, on this thread and a helper, each taking the next
    item when it is free; returns when all are done, raising the first failure."""
    # On the helper itself (a computed leaf read by another's fill), waiting for a
    # second task of its one-thread pool would wait forever.
    if _on_pool_thread("half"):
        for item in items:
            visit(item)
        return
    shared = iter(items)  # next() on a sequence's iterator is atomic under the GIL (a generator's is not)

    def work() -> None:
        for item in shared:
            visit(item)

    future = _pool("half").submit(work)
    try:
        work()
    except BaseException:
        collections.deque(shared, maxlen=0)  # let the helper stop early
        future.cancel()
        wait([future])  # never leave it writing into a buffer the caller reuses
        raise
    # A helper that has not started is not waited for: it may be busy with a block that
    # waits on a lock this thread holds (a TIES selection, run on first use).
    if not future.cancel():
        future.result()


def map_on_two_threads(fn: Callable[[Any], Any], items: Sequence[Any]) -> list:
    """``fn(item)`` for each item, on two threads as ``each_on_two_threads``; the results
    in the items' order (a sum of them is then the same bytes whichever thread did which)."""
    results: list = [None] * len(items)

    def run(index: int) -> None:
        results[index] = fn(items[index])

    each_on_two_threads(run, range(len(items)))
    return results


def map_at_once(fn: Callable[[Any], Any], items: Sequence[Any], width: int) -> list:
    """``fn(item)`` for each item, ``width`` at a time on threads of their own (requests
    that each wait a round trip: a sharded repository's headers), the results in the
    items' order; the first failure, in that order, raised once all have finished."""
    if width <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    results: list = [None] * len(items)
    slots = threading.Semaphore(width)

    def run(index: int) -> None:
        with slots:
            try:
                results[index] = (True, fn(items[index]))
            except BaseException as e:  # handed to the caller's thread
                results[index] = (False, e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for ok, value in results:
        if not ok:
            raise value
    return [value for _, value in results]
