"""What each sparsifying task-vector method keeps of a task vector, and the rescale of
what it keeps: TIES' largest magnitudes and breadcrumbs' (by the streaming exact
selection of ``_selection``), DARE's and DELLA's coin flips.

The coins come from a counter-based generator (SplitMix64's mixer) keyed by the seed,
the leaf's key path and the model, at each element's offset: the same bytes whatever
the chunk size or thread count.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import math
import threading
import weakref
from typing import Any

from treecli import _combine, _gc, _leaf
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK
from treecli._errors import UsageError
from treecli._selection import Space, Trims, key_base, magnitude_keys


def keeps_of(sparsify: str, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], per_model: list[dict[str, Any]],
             densities: list[float], seed: int, keypath: str):
    """What each model's task vector keeps, by the method's way of sparsifying it."""
    size = base.size
    if sparsify == "magnitude":  # TIES: the k largest magnitudes, at least one (as mergekit)
        return TopKeeps(Trims(base, models, [size if d >= 1 else max(1, int(d * size)) if d > 0 else 0
                                              for d in densities]))
    if sparsify == "outliers":
        # Breadcrumbs: of the magnitudes in ascending order, mergekit keeps [n_bot, n_bot + target)
        # with n_bot = size - target - n_top (n_top = int(gamma · size), fewer where the target needs
        # them): the largest size - n_bot less the largest size - n_bot - target.
        uppers, outliers = [], []
        for d, m in zip(densities, per_model):
            gamma = float(m.get("gamma", 0.01))
            if not 0 <= gamma <= 1:
                raise UsageError(f"gamma {gamma:g}: the fraction of outliers must lie in [0, 1]", keypath=keypath)
            target = int(d * size) if d < 1 else size
            bottom = max(0, size - target - int(gamma * size))
            uppers.append(size - bottom)
            outliers.append(size - bottom - target if d < 1 else 0)
        return TopKeeps(Trims(base, models, uppers), Trims(base, models, outliers))
    if sparsify == "della":
        epsilons = [float(m.get("epsilon", 0.15)) for m in per_model]
        for d, e in zip(densities, epsilons):
            if d < 1 and (d + e >= 1 or d - e <= 0):
                raise UsageError(f"epsilon {e:g} with density {d:g}: density ± epsilon must lie in (0, 1)",
                                 keypath=keypath)
        return _DellaKeeps(base, models, densities, epsilons, seed, keypath)
    return _DareKeeps(densities, seed, keypath)


class KeptMasks:
    """The masks an L1 rescale's pass made, packed (a bit an element), for the output's
    pass over the same blocks: it takes each once instead of making it again (DARE's
    coins, DELLA's ranking). At most CACHE_BYTES are kept, across every leaf of the
    process: when more come, the oldest go (those of a leaf whose output was written by
    another process, or in other blocks), and are made again if asked for. A leaf's go
    with it, when it is no longer used."""

    CACHE_BYTES = 64 << 20
    _packed: collections.OrderedDict = collections.OrderedDict()  # (owner, model, start, stop) -> bits
    _bytes = 0
    _lock = threading.Lock()
    _owners = itertools.count()
    _orphans = _gc.Orphans(_lock, lambda owner: KeptMasks._forget(owner))  # leaves no longer used

    def __init__(self):
        self._owner = next(self._owners)
        weakref.finalize(self, KeptMasks._orphans.collected, self._owner)

    @classmethod
    def _forget(cls, owner: int) -> None:
        """Drop an owner's masks (the lock held)."""
        for key in [key for key in cls._packed if key[0] == owner]:
            cls._bytes -= cls._packed.pop(key).nbytes

    def take(self, key: tuple[int, int, int], out) -> bool:
        """Into ``out``, the mask kept for ``key``, forgetting it; False when none is."""
        import numpy as np

        with KeptMasks._lock:
            packed = self._packed.pop((self._owner, *key), None)
            if packed is None:
                return False
            KeptMasks._bytes -= packed.nbytes
        out[...] = np.unpackbits(packed, count=out.size).view(bool)
        return True

    def keep(self, key: tuple[int, int, int], mask) -> None:
        import numpy as np

        packed = np.packbits(mask)
        with KeptMasks._lock:
            self._orphans.drain()
            while self._packed and KeptMasks._bytes + packed.nbytes > self.CACHE_BYTES:
                KeptMasks._bytes -= self._packed.popitem(last=False)[1].nbytes
            if packed.nbytes <= self.CACHE_BYTES:
                self._packed[(self._owner, *key)] = packed
                KeptMasks._bytes += packed.nbytes


class TopKeeps:
    """TIES' keeps (the ``k`` largest magnitudes of each task vector) or, with ``outliers``,
    breadcrumbs' (those less the largest few), by the streaming exact selection."""

    needs_keys = True
    remembers = False  # its mask is a comparison with the keys this block computes anyway

    def __init__(self, trims: Trims, outliers: Trims | None = None):
        self.trims, self.outliers = trims, outliers

    def select(self) -> None:
        self.trims.select()
        if self.outliers is not None:
            self.outliers.select()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key):
        keys = magnitude_keys(space.model, base_key, space)
        keep = self.trims.keep(i, start, stop, keys, space.keep)
        if self.outliers is not None:
            keep &= ~self.outliers.keep(i, start, stop, keys, space.flag)
        return keep


class _DareKeeps:
    """DARE's keeps: each element with probability ``density``, by ``dare_keep``'s coins."""

    needs_keys = False
    remembers = True

    def __init__(self, densities: list[float], seed: int, keypath: str):
        self._densities, self._seed, self._keypath = densities, seed, keypath
        self._kept = KeptMasks()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key, remember: bool = False):
        if not self._kept.take((i, start, stop), space.keep):
            dare_keep(self._seed, self._keypath, i, start, stop, self._densities[i], out=space.keep,
                      work=space.coins)
            if remember:
                self._kept.keep((i, start, stop), space.keep)
        return space.keep


class _DellaKeeps:
    """DELLA's keeps (mergekit's ``della_magprune``): along each row (the second axis; a
    1-D leaf is one row) an element is kept with probability ``density − epsilon`` for the
    smallest magnitude rising evenly to ``density + epsilon`` for the largest, by
    counter-based coins (``coin_bits``) drawn in rank order: the row's ``j``-th smallest
    magnitude takes the coin of the row's ``j``-th place, so no chunking or thread count
    changes a keep. Magnitudes are ranked at bfloat16 precision (see ``_compute``): where
    two are equal at it, the earlier ranks lower. A block is widened to whole rows to rank
    them."""

    needs_keys = False
    remembers = True

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], densities: list[float],
                 epsilons: list[float], seed: int, keypath: str):
        import numpy as np

        self._base, self._models = base, models
        self._seed, self._keypath = seed, keypath
        shape = base.shape
        self._unit = math.prod(shape[1:]) if len(shape) >= 2 else max(1, base.size)  # one index of axis 0
        self._row = shape[1] if len(shape) >= 2 else max(1, base.size)  # the ranked axis' length
        # Per model and rank, the keep probability times 2³² (float32 arithmetic, as mergekit's).
        spread = (np.arange(self._row, dtype=np.float32) / np.float32(self._row - 1) if self._row > 1
                  else np.zeros(1, np.float32))
        self._thresholds = [((d - e) + spread * np.float32(2 * e)).astype(np.float64) * 2.0**32
                            for d, e in zip(densities, epsilons)]
        self._kept = KeptMasks()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key, remember: bool = False):
        if not self._kept.take((i, start, stop), space.keep):
            space.keep[...] = self._compute(i, start, stop)
            if remember:
                self._kept.keep((i, start, stop), space.keep)
        return space.keep

    def _compute(self, i: int, start: int, stop: int):
        import numpy as np

        unit, row = self._unit, self._row
        lo, hi = start // unit * unit, min(self._base.size, -(-stop // unit) * unit)
        b, m = np.empty(hi - lo, self._base.dtype), np.empty(hi - lo, self._models[i].dtype)
        self._base.read_into(lo, hi, b)
        self._models[i].read_into(lo, hi, m)
        # Ranked by the magnitude's top 16 bits (its bfloat16 truncation: exact for a bf16
        # checkpoint), earlier first among equals: a radix sort of 16-bit keys ran 5.6 ns an
        # element here, a comparison sort of float32 ones 31 ns.
        magnitude = np.abs(np.subtract(m, b, dtype=np.float32))
        keys = np.right_shift(magnitude.view(np.uint32), 16).astype(np.uint16).reshape(-1, row, unit // row)
        order = np.argsort(keys, axis=1, kind="stable")
        # The coins in rank order: whether the j-th smallest is kept is one comparison with the
        # j-th place's coin, and the keeps go back to the elements' places in one scatter.
        coins = coin_bits(self._seed, self._keypath, i, lo, hi).reshape(keys.shape)
        kept_by_rank = coins < self._thresholds[i].reshape(1, -1, 1)
        # Each place's element as an index into the block (a flat scatter ran 2x put_along_axis').
        slabs, inner = keys.shape[0], keys.shape[2]
        if inner > 1:
            order *= inner
        order += np.arange(0, slabs * unit, unit).reshape(-1, 1, 1) + np.arange(inner).reshape(1, 1, -1)
        keep = np.empty(hi - lo, bool)
        keep[order.reshape(-1)] = kept_by_rank.reshape(-1)
        return keep[start - lo : stop - lo]


class L1Rescale:
    """The rescale of what a sparsifying method keeps as mergekit's (``RescaleNorm.l1``):
    each task vector's kept elements scaled by ``‖d‖₁ / ‖d ⊙ keep‖₁`` over the whole leaf (1
    where either is below 1e-7), found on first use by one pass over the inputs, in float64."""

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], keeps: Any, sparse: list[bool]):
        self._base, self._models, self._keeps, self._sparse = base, models, keeps, sparse
        self._lock = threading.Lock()
        self._factors: list[float] | None = None

    def factors(self) -> list[float]:
        with self._lock:  # (blocks run on two threads; the first to ask makes the pass)
            if self._factors is None:
                self._factors = self._measure()
            return self._factors

    def _measure(self) -> list[float]:
        """Per model, ``‖d‖₁ / ‖d ⊙ keep‖₁``, in one pass on two threads (run before the
        output's blocks fan out to them: see ``task_vectors._task_leaf``'s ``fill_chunk``)."""
        import numpy as np

        if isinstance(self._keeps, TopKeeps):
            self._keeps.select()
        def measure(start: int) -> list[tuple[float, float]]:
            """Per model, ``(‖d‖₁, ‖d ⊙ keep‖₁)`` over one block."""
            stop = min(self._base.size, start + SUB_CHUNK)
            sums = []
            with _combine.scratch_buffers(Space.BUFFERS) as buffers:
                space = Space(buffers, stop - start, self._base.dtype)
                self._base.read_into(start, stop, space.base)
                np.copyto(space.base64, space.base)
                base_key = key_base(space.base, space) if self._keeps.needs_keys else None
                d = space.delta
                for i, model in enumerate(self._models):
                    if not self._sparse[i]:
                        sums.append((0.0, 0.0))
                        continue
                    model.read_into(start, stop, space.model)
                    np.copyto(d, space.model)
                    d -= space.base64
                    if self._keeps.remembers:  # made once, kept for the output's pass
                        keep = self._keeps.mask(i, start, stop, space, base_key, remember=True)
                    else:
                        keep = self._keeps.mask(i, start, stop, space, base_key)
                    np.abs(d, out=d)
                    before = float(d.sum())
                    d *= keep  # (in place: a dot with the bool mask would cast it to a new array)
                    sums.append((before, float(d.sum())))
            return sums

        partials = stream.map_on_two_threads(measure, range(0, self._base.size, SUB_CHUNK))
        factors = []
        for i in range(len(self._models)):  # summed in block order: the same bytes whatever the threads
            before = math.fsum(block[i][0] for block in partials)
            after = math.fsum(block[i][1] for block in partials)
            factors.append(before / after if before >= 1e-7 and after >= 1e-7 else 1.0)
        return factors


def coin_bits(seed: int, keypath: str, model: int, start: int, stop: int, work=None):
    """32 random bits for each element ``[start, stop)`` of one model's task vector (in
    ``work`` if given: two uint64 arrays of ``(stop - start) / 2 + 1`` words or more).

    Counter-based: elements ``2j`` and ``2j + 1`` take the low and high 32 bits of
    SplitMix64's output for the state ``key + (j + 1) * golden``, the key hashed from
    (seed, key path, model), so no chunking or thread count changes a coin."""
    import numpy as np

    key = int.from_bytes(hashlib.blake2b(f"{seed}\0{keypath}\0{model}".encode(), digest_size=8).digest(), "little")
    first, last = start // 2 + 1, (stop + 1) // 2 + 1
    z, shifted = (np.empty(last - first, np.uint64) for _ in range(2)) if work is None else (
        w[: last - first] for w in work)
    np.add(_counters(last - first), np.uint64(first), out=z)
    with np.errstate(over="ignore"):
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(key)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
            np.right_shift(z, np.uint64(shift), out=shifted)
            z ^= shifted
            if factor:
                z *= np.uint64(factor)
    return z.view("<u4")[start % 2 : start % 2 + stop - start]


def dare_keep(seed: int, keypath: str, model: int, start: int, stop: int, density: float, *, out=None,
              work=None):
    """DARE's keep mask for elements ``[start, stop)`` of one model's task vector (into
    ``out`` if given, working in ``work``, as ``coin_bits``'): an element is kept where its
    32 bits are below ``density * 2**32``."""
    import numpy as np

    coins = coin_bits(seed, keypath, model, start, stop, work)
    return np.less(coins, np.uint32(min(2**32 - 1, int(density * 2**32))), out=out)


@functools.lru_cache(maxsize=1)
def _iota(count: int):
    import numpy as np

    return np.arange(count, dtype=np.uint64)


def _counters(count: int):
    """``0, 1, ..., count - 1`` as uint64, from one array made once per size class."""
    return _iota(max(count, SUB_CHUNK // 2 + 1))[:count]
