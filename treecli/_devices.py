"""Lazy leaves read onto JAX devices: each leaf into its sharding, shard by shard, on
several threads at once.

A leaf's sharding (a ``NamedSharding`` over a mesh, a ``SingleDeviceSharding``, ...;
``None`` for the default device) decides its *pieces*: the distinct indices of its
addressable shards, each with the devices that hold it (a replicated shard is read once
and copied to each of its devices). Every piece is one task on a pool of
:data:`READERS` threads: read its bytes from the file (a lazy leaf reads only those byte
ranges, or that TensorStore slice), copy them to its devices, wait for the copies, drop
the host copy. Reads of one piece overlap copies of another (file reads and
host-to-device copies release the GIL), and host memory holds at most one piece per
thread — never a whole leaf assembled on the host, unlike
``jax.make_array_from_callback``, which runs every callback before placing any shard.

A leaf that can only be read whole (a compressed npz member, an Orbax array stored as one
chunk) is read once and sliced for its pieces, never decompressed once per shard.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from treecli import _leaf
from treecli._errors import UsageError

# Threads reading pieces. On a 16-core H100 host 8 readers came near its floor (page
# cache to GPU, issue 33); more only add contention on small machines.
READERS = 8
# Host bytes read and not yet on their devices, across the threads: a quarter of the
# largest leaf, and never more than this (a big leaf's buffer is a smaller share of it);
# one piece larger than that is read alone. (Measured on 8 CPU devices, a 256 MiB leaf in
# eight pieces peaked at 1.52-1.59x the leaf with all eight in flight, at 1.27x so.)
MAX_IN_FLIGHT = 256 << 20


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

    def piece(self, index: tuple) -> Any:
        import numpy as np

        with self.lock:
            if self.data is None:
                self.data = np.asarray(self.leaf).reshape(self.leaf.shape)
            out = np.array(self.data[index], copy=True)
            self.pending -= 1
            if self.pending == 0:
                self.data = None
            return out


@dataclass
class _Piece:
    leaf: _leaf.ArrayLeaf
    index: tuple  # of slices, () for the whole leaf
    devices: list  # the devices that hold it; empty: JAX's default device
    whole: _Whole | None  # where the leaf is read whole once
    in_flight: _InFlight | None = None

    @property
    def nbytes(self) -> int:
        import math

        if not self.index:
            return self.leaf.nbytes
        return math.prod(len(range(*s.indices(n))) for s, n in zip(self.index, self.leaf.shape)) * self.leaf.itemsize

    def read(self) -> Any:
        import numpy as np

        if self.whole is not None:
            return self.whole.piece(self.index)
        return np.asarray(self.leaf.read(self.index) if self.index else self.leaf.read())

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


def place(leaves: Sequence[tuple[_leaf.ArrayLeaf, Any]], names: Sequence[str] = (), readers: int = READERS) -> list:
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
    tasks = [piece for pieces in per_leaf for piece in pieces]
    in_flight = _InFlight(max(1, min(MAX_IN_FLIGHT, max((leaf.nbytes for leaf, _ in leaves), default=0) // 4)))
    for piece in tasks:
        piece.in_flight = in_flight
    if len(tasks) <= 1 or readers <= 1:
        placed = [piece.place() for piece in tasks]
    else:
        with ThreadPoolExecutor(min(readers, len(tasks)), thread_name_prefix="treecli-place") as pool:
            placed = list(pool.map(_Piece.place, tasks))
    out, at = [], 0
    for (leaf, sharding), pieces in zip(leaves, per_leaf):
        arrays = [array for piece in placed[at:at + len(pieces)] for array in piece]
        at += len(pieces)
        if sharding is None:
            out.append(arrays[0])
        else:
            out.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, arrays))
    return out
