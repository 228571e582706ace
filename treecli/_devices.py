"""Lazy leaves read onto JAX devices: each leaf into its sharding, shard by shard, on
several threads at once, keeping the file reads and the copies to the devices busy together.

A leaf's sharding (a ``NamedSharding`` over a mesh, a ``SingleDeviceSharding``, ...;
``None`` for the default device) decides its *pieces*: the distinct indices of its
addressable shards, each with the devices that hold it (a replicated shard is read once
and copied to each of its devices).

A piece that is one run of a local file's bytes (a safetensors, ``.bin``, GGUF or stored
npz tensor, or rows of one) is read in requests of ``buffer_bytes`` on a pool of
``threads``, each request a task of its own (a big leaf's reads on every thread, not one),
through the page cache or, with ``direct_io``, past it:

- onto an accelerator, each request's whole rows into a buffer of a bounded ring (made once,
  reused across leaves), copied to the piece's devices while other threads read the next,
  the buffer given back once the copy is done; a piece of several requests is put together
  on its device. Host memory: the ring, never the model.
- onto CPU devices, whose memory is the host's, straight into the array that becomes the
  device's (JAX takes it without a copy): no ring, and no second copy of any byte.

Any other piece (a TensorStore slice of an Orbax array, columns of a matrix, a computed
leaf) is read by the leaf itself (``read(index)``: only the byte ranges the index needs),
at most a budget of host bytes in flight; a leaf that can only be read whole (a compressed
npz member) is read once and sliced for its pieces, never decompressed once per shard.
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from treecli import _leaf
from treecli._errors import UsageError
from treecli._hostbuffers import ALIGN, Ring, RunReader, aligned, aligned_room

# Threads reading pieces. On a 16-core H100 host 8 readers came near its floor (page
# cache to GPU, issue 33); more only add contention on small machines.
READERS = 8
# A read request's bytes, and a ring buffer's. (bench/load.py's floor: on the 2-core VM,
# the page cache read at 13-15 GiB/s in requests of 1-4 MiB on 4-8 threads, 10 at 64 MiB.)
BUFFER_BYTES = 8 << 20
# Host bytes read and not yet on their devices, across the threads: a quarter of the
# largest leaf, and never more than this (a big leaf's buffer is a smaller share of it);
# one piece larger than that is read alone. (Measured on 8 CPU devices, a 256 MiB leaf in
# eight pieces peaked at 1.52-1.59x the leaf with all eight in flight, at 1.27x so.)
MAX_IN_FLIGHT = 256 << 20


@dataclass(frozen=True)
class Settings:
    """How a load reads (``treecli.load``'s ``threads``, ``buffer_bytes``, ``direct_io``):
    ``threads`` reading at once, in requests of ``buffer_bytes`` (the size of each of the
    ring's ``threads`` buffers), past the page cache with ``direct_io`` where the file
    system takes it (else through it)."""

    threads: int = READERS
    buffer_bytes: int = BUFFER_BYTES
    direct_io: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.threads, int) and self.threads >= 1):
            raise UsageError(f"threads={self.threads!r}: a load reads on at least 1 thread")
        if not (isinstance(self.buffer_bytes, int) and self.buffer_bytes >= ALIGN):
            raise UsageError(f"buffer_bytes={self.buffer_bytes!r}: a buffer holds at least {ALIGN} bytes")


class _InFlight:
    """A budget of host bytes: a piece waits until its bytes fit beside those in flight."""

    def __init__(self, budget: int):
        self._budget, self._used = budget, 0
        self._ready = threading.Condition()

    def hold(self, nbytes: int) -> int:
        nbytes = min(nbytes, self._budget)  # (a piece larger than the budget goes alone)
        with self._ready:
            self._ready.wait_for(lambda: self._used + nbytes <= self._budget)
            self._used += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        with self._ready:
            self._used -= nbytes
            self._ready.notify_all()


@dataclass
class _Whole:
    """A leaf read whole once for all its pieces, dropped after the last one."""

    leaf: _leaf.ArrayLeaf
    pending: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    data: Any = None

    def piece(self, index: tuple, into_host_memory: bool) -> Any:
        """The piece ``index`` of the leaf: a copy of its own; onto CPU devices, a range of
        rows as a view of the whole (the devices' arrays then share the one read)."""
        import numpy as np

        with self.lock:
            if self.data is None:
                if into_host_memory and self.leaf.reads_into_arrays:  # (aligned, as the devices take it)
                    self.data = aligned(self.leaf.nbytes).view(self.leaf.dtype).reshape(self.leaf.shape)
                    self.leaf.read_index_into((), self.data)
                else:
                    self.data = np.asarray(self.leaf).reshape(self.leaf.shape)
            data = self.data
            self.pending -= 1
            if self.pending == 0:
                self.data = None
        view = data[index]
        return view if into_host_memory and view.flags.c_contiguous else np.array(view, copy=True)


@dataclass
class _Together:
    """The pieces of a leaf read whole, placed by one task: a task a piece would each hold a
    thread waiting for the one that reads the leaf (a leaf's eight shards, every thread)."""

    whole: _Whole
    pieces: list

    def run(self) -> None:
        for piece in self.pieces:
            piece.run()


@dataclass
class _Piece:
    leaf: _leaf.ArrayLeaf
    index: tuple  # of slices, () for the whole leaf
    devices: list  # the devices that hold it; empty: JAX's default device
    whole: _Whole | None  # where the leaf is read whole once
    in_flight: _InFlight | None = None
    result: list | None = None  # its arrays, once placed
    into_host_memory: bool = False  # whether its devices keep arrays in host memory (CPU devices)

    @property
    def shape(self) -> tuple:
        return tuple(len(range(*s.indices(n))) for s, n in zip(self.index, self.leaf.shape)) if self.index \
            else tuple(self.leaf.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.leaf.itemsize

    def read(self) -> Any:
        import numpy as np

        if self.whole is not None:
            return self.whole.piece(self.index, self.into_host_memory)
        if self.into_host_memory and self.leaf.reads_into_arrays:  # (aligned: the CPU device takes it as it is)
            out = aligned(self.nbytes).view(self.leaf.dtype).reshape(self.shape)
            self.leaf.read_index_into(self.index, out)
            return out
        return np.asarray(self.leaf.read(self.index) if self.index else self.leaf.read())

    def run(self) -> None:
        self.result = self.place()

    def place(self) -> list:
        held = self.in_flight.hold(self.nbytes) if self.in_flight is not None else 0
        try:
            return self._place()
        finally:
            if held:
                self.in_flight.release(held)

    def _place(self) -> list:
        import jax

        host = self.read()
        if not self.devices:  # uncommitted, on the default device, as jnp.asarray would put it
            return [jax.device_put(host).block_until_ready()]
        # Waiting for each copy keeps host memory to the pieces in flight.
        return [jax.device_put(host, device).block_until_ready() for device in self.devices]


def _pieces(leaf: _leaf.ArrayLeaf, sharding: Any) -> list[_Piece]:
    if sharding is None:
        return [_Piece(leaf, (), [], None)]
    groups: dict[tuple, tuple[tuple, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(leaf.shape)).items():
        index = tuple(index)
        if all(s.indices(n) == (0, n, 1) for s, n in zip(index, leaf.shape)):
            index = ()  # the whole leaf (replicated, or one device): read as it is stored
        name = tuple((s.start, s.stop, s.step) for s in index)
        groups.setdefault(name, (index, []))[1].append(device)
    partial = len(groups) == 1 or getattr(leaf, "reads_parts", False)
    whole = None if partial else _Whole(leaf, len(groups))
    return [_Piece(leaf, index, devices, whole) for index, devices in groups.values()]


def target(like: Any) -> Any:
    """Where a leaf read for a JAX template goes: the template's sharding, or ``None`` (the
    default device, uncommitted) for a ``ShapeDtypeStruct`` without one and for an array
    that lives, uncommitted, on the default device."""
    import jax

    sharding = getattr(like, "sharding", None)
    if isinstance(like, jax.Array) and not like.committed and len(sharding.device_set) == 1:
        return None
    return sharding


class _Run:
    """A piece that is one run of a local file's bytes, read in requests (one task each) and
    put on its devices once the last is read (module docstring: the two ways)."""

    def __init__(self, piece: _Piece, run: tuple[int, int, int], settings: Settings, reads: RunReader,
                 ring: Ring | None):
        self.piece, self.reads, self.ring = piece, reads, ring
        self.offset, self.nbytes, self.row = run
        self.shape = piece.shape
        self.arrays: list = []
        self._lock = threading.Lock()
        if ring is None:  # (the array the device takes: requests split at blocks, for direct I/O)
            self._base = self.offset - self.offset % ALIGN if settings.direct_io else self.offset
            end = self.offset + self.nbytes
            self.host = aligned((-(-end // ALIGN) * ALIGN if settings.direct_io else end) - self._base)
            step = max(ALIGN, settings.buffer_bytes // ALIGN * ALIGN)
            cuts = [self.offset, *range(self._base + step, end, step), end]
            self.requests = list(zip(cuts, cuts[1:])) or [(self.offset, self.offset)]
        else:  # (whole rows a buffer)
            rows = self.nbytes // self.row if self.row else 0
            per = max(1, (ring.nbytes - aligned_room(0)) // self.row) if self.row else 1
            self.requests = [(r, min(r + per, rows)) for r in range(0, rows, per)] or [(0, 0)]
            self._parts: list = [None] * len(self.requests)
        self._pending = len(self.requests)

    def tasks(self) -> list:
        return [(self, i) for i in range(len(self.requests))]

    def read(self, i: int) -> None:
        """Request ``i``: read; the last one read puts the piece on its devices."""
        if i == 0 and not self.reads.direct and hasattr(self.piece.leaf.reader, "will_need"):
            self.piece.leaf.reader.will_need(self.offset, self.nbytes)  # (the kernel reads the run ahead)
        if self.ring is None:
            begin, end = self.requests[i]
            self.reads.read(self.piece.leaf.reader, begin, end - begin, self.host, self._base)
        else:
            self._parts[i] = self._copied(*self.requests[i])
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.arrays = self._placed()

    def _copied(self, first: int, stop: int) -> list:
        """Rows ``[first, stop)`` through a ring buffer (one of their own where a row is larger
        than a buffer), copied to every device of the piece; the buffer back once they are."""
        import jax

        nbytes = (stop - first) * self.row
        from_ring = aligned_room(nbytes) <= self.ring.nbytes
        buffer = self.ring.take() if from_ring else aligned(aligned_room(nbytes))
        try:
            offset = self.offset + first * self.row
            view = self.reads.read(self.piece.leaf.reader, offset, nbytes, buffer, offset - offset % ALIGN)
            host = view.view(self.piece.leaf.dtype)
            host = host.reshape(self.shape if len(self.requests) == 1 else (stop - first, *self.shape[1:]))
            arrays = [_detached(jax.device_put(host, device, may_alias=False), buffer)
                      for device in self.piece.devices or [None]]
            for array in arrays:
                array.block_until_ready()  # (the copy done: the buffer may be read into again)
            return arrays
        finally:
            if from_ring:
                self.ring.give(buffer)

    def _placed(self) -> list:
        import jax

        if self.ring is None:
            start = self.offset - self._base
            host = self.host[start:start + self.nbytes].view(self.piece.leaf.dtype).reshape(self.shape)
            # (JAX takes host memory as a CPU device's without copying it, where it is aligned for it)
            return [jax.device_put(host, device, may_alias=True).block_until_ready()
                    for device in self.piece.devices or [None]]
        if len(self._parts) == 1:
            return self._parts[0]
        return [jax.numpy.concatenate([part[k] for part in self._parts]).block_until_ready()
                for k in range(len(self._parts[0]))]


def _detached(array: Any, buffer: Any) -> Any:
    """``array`` (on a device), copied again where it holds ``buffer``'s own memory: JAX 0.10
    takes some host arrays of a CPU device as they are even when told not to
    (``may_alias=False``), and a ring buffer is read into again."""
    low = buffer.ctypes.data
    pointer = array.unsafe_buffer_pointer()
    if low <= pointer < low + buffer.nbytes:
        import jax

        return jax.numpy.array(array, copy=True)
    return array


def _run_of(leaf: _leaf.ArrayLeaf, index: tuple) -> tuple[int, int, int] | None:
    """``(offset, bytes, row bytes)`` where a piece is one run of a local file's bytes: its
    leaf whole, or a range of its first axis; else None."""
    if not leaf.in_local_file:
        return None
    row = math.prod(leaf.shape[1:]) * leaf.itemsize
    if not index:
        return leaf.offset, leaf.nbytes, row
    first, rest = index[0], index[1:]
    if first.step not in (None, 1) or any(s.indices(n) != (0, n, 1) for s, n in zip(rest, leaf.shape[1:])):
        return None
    start, stop, _ = first.indices(leaf.shape[0])
    return leaf.offset + start * row, max(0, stop - start) * row, row


def _host_memory_is_device(pieces: Sequence[_Piece]) -> bool:
    """Whether every device the pieces go to keeps its arrays in host memory (CPU devices)."""
    import jax

    return all(device.platform == "cpu" for piece in pieces for device in piece.devices or [jax.devices()[0]])


def place(leaves: Sequence[tuple[_leaf.ArrayLeaf, Any]], names: Sequence[str] = (),
          settings: Settings = Settings()) -> list:
    """JAX arrays of lazy leaves, each with its sharding (``None``: the default device),
    in order. Only addressable shards are read (in a multi-process program, this
    process's own). ``names``: the leaves' key paths, for messages.

    Raises:
        UsageError: a 64-bit leaf while JAX runs without ``jax_enable_x64`` (JAX would
            make int64 int32), before anything is read.
        whatever a leaf's read raises (a ``FormatError`` naming the file and key path).
    """
    import jax

    for i, (leaf, _) in enumerate(leaves):
        narrowed = jax.dtypes.canonicalize_dtype(leaf.dtype)
        if narrowed != leaf.dtype:
            article = "an" if leaf.dtype_name[0] in "aeiou" else "a"
            raise UsageError(f"{article} {leaf.dtype_name} leaf would become {narrowed} on a JAX device: enable 64-bit "
                             "types first (jax.config.update('jax_enable_x64', True))",
                             keypath=names[i] if i < len(names) else None)
    per_leaf = [_pieces(leaf, sharding) for leaf, sharding in leaves]
    pieces = [piece for group in per_leaf for piece in group]
    in_flight = _InFlight(MAX_IN_FLIGHT)
    reads = RunReader(settings.direct_io)
    into_host_memory = _host_memory_is_device(pieces)
    ring = None if into_host_memory else Ring(settings.threads, aligned_room(settings.buffer_bytes))
    jobs, tasks = [], []  # (each piece's: a _Run, or the piece read by its leaf), (what the threads do)
    for piece in pieces:
        run = _run_of(piece.leaf, piece.index) if piece.whole is None else None
        if run is None:
            piece.in_flight, piece.into_host_memory = in_flight, into_host_memory
            jobs.append(piece)
            if piece.whole is None:
                tasks.append((piece, None))
            elif not any(isinstance(job, _Together) and job.whole is piece.whole for job, _ in tasks[-1:]):
                tasks.append((_Together(piece.whole, []), None))  # (a leaf read whole: its pieces one task)
            if piece.whole is not None:
                tasks[-1][0].pieces.append(piece)
        else:
            jobs.append(_Run(piece, run, settings, reads, ring))
            tasks += jobs[-1].tasks()
    _run_all(tasks, settings.threads)
    placed = [job.arrays if isinstance(job, _Run) else job.result for job in jobs]
    out, at = [], 0
    for (leaf, sharding), group in zip(leaves, per_leaf):
        arrays = [array for piece in placed[at:at + len(group)] for array in piece]
        at += len(group)
        if sharding is None:
            out.append(arrays[0])
        else:
            out.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, arrays))
    return out


def _run_all(tasks: list, threads: int) -> None:
    """Every task on ``threads`` threads; at the first failure (or Ctrl-C) the tasks not
    started are dropped and those running finished before it is raised: no read goes on
    behind the caller's back."""
    import concurrent.futures

    def do(task: tuple) -> None:
        job, i = task
        if i is None:
            job.run()
        else:
            job.read(i)

    if len(tasks) <= 1 or threads <= 1:
        for task in tasks:
            do(task)
        return
    futures = [_pool(threads).submit(do, task) for task in tasks]
    try:
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)
        raise


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """The threads loads of ``threads`` readers run on, made once: starting eight threads
    for each load took 35 ms of a 0.2 s load of 1 GiB (on 2 cores, the reads running)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="treecli-place")
