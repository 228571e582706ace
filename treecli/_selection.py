"""The streaming exact selection of TIES: which elements of a task vector are among its
``k`` largest magnitudes, found without holding the leaf. (Any other ordered keys can be
ranked the same way: ``sce`` ranks the variances of its task vectors.)

Magnitudes are ranked as float32 bit patterns of ``|dᵢ|`` (mergekit ranks float32
magnitudes too). A leaf of up to 64K elements is read whole. A
larger one is sampled (runs spread over the leaf, 1/128 of it, 64K to 1M), the
sample's estimate of the ``k``-th largest widened to a range that holds it with
near certainty, and one pass (on two threads) counts the keys above that range and
records those inside it, among which the ``k``-th is found exactly. Where the sample
misled (or too many keys fell inside, past 4M recorded per leaf), a radix select runs
instead: one pass histograms the high 16 bits, a second the low 16 bits inside the
bin that holds the ``k``-th. When values equal to the ``k``-th straddle the cut, the
first ones in element order are kept (mergekit's ``topk`` keeps an unspecified set):
the counting pass finds where the cut lies by reading again the one block that holds
it, the radix passes from what they recorded or, failing that, by a third pass.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from treecli import _combine, _leaf
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK


class Space:
    """One thread's scratch memory for the task kernel, as typed views for a block of
    ``n`` elements (12 buffers of SUB_CHUNK float64s: 12 MiB a thread; the selection
    passes' larger blocks touch five of them)."""

    BUFFERS = 12

    def __init__(self, buffers: list, n: int, in_dtype: Any):
        import numpy as np

        f64 = [b.view(np.float64)[:n] for b in buffers]
        self.base, self.model = buffers[0].view(in_dtype)[:n], buffers[1].view(in_dtype)[:n]
        self.base64, self.delta, self.total, self.magnitude, self.work = f64[2:7]
        self.positive_weight, self.negative_weight = f64[7:9]  # the agreeing weights' sums, unequal weights
        self.base_key = buffers[9].view(np.float32)[:n]  # the base in float32, for the keys of bf16/fp16 leaves
        self.key = buffers[10].view(np.float32)[:n]
        self.coins = (buffers[9].view(np.uint64), buffers[10].view(np.uint64))  # DARE's, which needs no keys
        slot = buffers[11].size // 8  # eight slots of a byte per element
        flags = buffers[11]
        self.keep, self.flag = flags[:n].view(bool), flags[slot : slot + n].view(bool)
        self.positive, self.negative, self.mask = (flags[j * slot : j * slot + n] for j in (2, 3, 4))


def magnitude_keys(model, base, space: Space):
    """``|model − base|`` rounded once to float32, as bit patterns with the sign cleared:
    ordered as the magnitudes (NaN above Inf), mergekit's ranking in float32. Inputs of up
    to 32 bits are subtracted in float32, which rounds the exact difference once; float64
    ones in float64 first. The selection passes and the output pass share this function,
    so they rank alike. ``base`` is ``key_base``'s."""
    import numpy as np

    key = space.key
    if base.dtype.itemsize > 4:
        np.subtract(model, base, out=space.work)
        with np.errstate(over="ignore"):
            np.copyto(key, space.work, casting="unsafe")
    else:
        np.subtract(model, base, out=key, dtype=np.float32)
    keys = key.view(np.uint32)
    np.bitwise_and(keys, 0x7FFFFFFF, out=keys)
    return keys


class Trims:
    """TIES' trim of each task vector of one leaf: which elements are among the ``k``
    largest magnitudes. Found on first use (see the module's docstring): an estimate from
    a sample, one pass that counts what lies above it and records what lies near it, and
    the radix passes for a model whose sample misled it."""

    # Elements per model the estimate is drawn from: a leaf this small is read whole, a larger
    # one sampled at 1/128 of its size, within [SAMPLE, 16 * SAMPLE]. (A sample's cost is in its
    # partition, 0.7 ms for 64K keys; the range it gives holds about 6 / sqrt(sample) + 0.1 % of
    # the keys at density 0.5: see _bounds.)
    SAMPLE = 1 << 16
    SAMPLE_RUN = 4096  # contiguous elements per sampled piece
    # Recorded per leaf: the keys near the estimate, or the (offset, key) pairs in the radix cut's bin.
    MAX_RECORDED = 1 << 22
    # Elements a pass takes at a time. The counting pass ran no faster on two threads than on
    # one in SUB_CHUNK blocks (its steps are short, and finding the near keys holds the GIL);
    # in blocks four times larger it ran 1.5-2x faster (0.72-0.87 s against 1.26-1.7 s over 4 GiB).
    BLOCK = 4 * SUB_CHUNK

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], ks: list[int],
                 keys: Callable[[int, int, Space, Any], Any] | None = None):
        """``ks``: how many elements each model keeps (0 keeps none, the leaf's size all).
        ``keys(start, stop, space, which)``, when given, ranks by other keys than the
        magnitudes: it yields ``(model, keys)`` for each of the models ``which`` (indices
        among those selected), keys as ordered uint32 like ``magnitude_keys``'."""
        self._base, self._ks = base, ks
        self._keys = keys or self._magnitude_keys
        # Only the models that keep some but not all are selected among; the passes scan those.
        self._selected = [i for i, k in enumerate(ks) if 0 < k < base.size]
        self._models = [models[i] for i in self._selected]
        self._k = [ks[i] for i in self._selected]
        self._lock = threading.Lock()
        self._cuts: list[tuple[int, int | None]] | None = None  # per model: (threshold key, cut offset)

    def keep(self, model: int, start: int, stop: int, keys, out):
        """Into ``out``: which of elements ``[start, stop)`` (their ``keys``) survive the trim."""
        import numpy as np

        if self._ks[model] <= 0:
            out[...] = False
            return out
        threshold, cut = self.select()[model]
        if cut is None or cut >= stop:
            return np.greater_equal(keys, threshold, out=out)
        split = max(0, cut - start)  # of the keys equal to the threshold, those from the cut on go
        np.greater_equal(keys[:split], threshold, out=out[:split])
        np.greater(keys[split:], threshold, out=out[split:])
        return out

    def keeps_only_nonzero(self) -> bool:
        """Whether every model's threshold key is above 0, so that no kept delta is 0."""
        return all(k > 0 for k in self._ks) and all(threshold > 0 for threshold, _ in self.select())

    def select(self) -> list[tuple[int, int | None]]:
        """Each model's (threshold key, cut offset), found on the first call (a model that
        keeps all: key 0, no cut; one that keeps none: never asked, see ``keep``)."""
        with self._lock:
            if self._cuts is None:
                found = iter(self._select() if self._selected else [])
                self._cuts = [next(found) if i in self._selected else (0, None) for i in range(len(self._ks))]
            return self._cuts

    def _select(self) -> list[tuple[int, int | None]]:
        size, models = self._base.size, range(len(self._models))
        if size <= self.SAMPLE:
            cuts = []
            for keys in self._sample(whole=True):
                threshold, take = _kth_largest(keys, self._k[len(cuts)])
                cuts.append((threshold, _first_not_kept(keys, threshold, take)))
            return cuts
        bounds = [_bounds(sample, k, size) for sample, k in zip(self._sample(whole=False), self._k)]
        found = self._count_near(bounds)
        missed = [i for i in models if found[i] is None]
        if missed:
            for i, cut in zip(missed, self._radix(missed)):
                found[i] = cut
        return found

    def _sample(self, whole: bool) -> list:
        """Each model's keys, in element order: all of them, or runs of SAMPLE_RUN spread
        evenly over the leaf (see SAMPLE)."""
        import numpy as np

        size = self._base.size
        if whole:
            ranges = self._blocks()
        else:
            wanted = min(16 * self.SAMPLE, max(self.SAMPLE, size // 128))
            step = self.SAMPLE_RUN * -(-size // wanted)
            ranges = [(s, min(size, s + self.SAMPLE_RUN)) for s in range(0, size, step)]
        pieces: list[list] = [[] for _ in self._models]
        self._scan(ranges, range(len(self._models)), lambda i, keys, start, _: pieces[i].append(keys.copy()))
        return [np.concatenate(p) for p in pieces]

    def _count_near(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int | None] | None]:
        """One pass, on two threads: per model, how many keys lie at or above its bounds'
        ``high`` and which keys lie in ``[low, high)``; the threshold and cut when the
        ``k``-th largest is among those, else ``None``."""
        import numpy as np

        count = len(self._models)
        above = [0] * count
        near: list[list | None] = [[] for _ in range(count)]  # (block start, keys - low) per block
        room = [self.MAX_RECORDED // count] * count
        lock = threading.Lock()

        def visit(i: int, keys, start: int, space: Space) -> None:
            low, high = bounds[i]
            flag = space.flag
            more = int(np.count_nonzero(np.greater_equal(keys, high, out=flag)))
            keys -= np.uint32(low)  # wraps below low: one comparison finds [low, high)
            # Only the keys, in element order: compress lets the other thread run (flatnonzero
            # held the GIL for a fifth of the pass); where ties sit is found later, if needed.
            inside = np.compress(np.less(keys, np.uint32(high - low), out=flag), keys)
            with lock:
                above[i] += more
                room[i] -= inside.size
                if room[i] < 0:
                    near[i] = None
                elif near[i] is not None:
                    near[i].append((start, inside))

        self._scan(self._blocks(), range(count), visit, parallel=True)
        pieces = [sorted(near[i] or [], key=lambda piece: piece[0]) for i in range(count)]  # in element order
        wanted = [self._k[i] - above[i] for i in range(count)]  # how many of each model's near keys are kept
        def kth(i: int) -> tuple[int, int] | None:
            if pieces[i] and 0 < wanted[i] <= sum(k.size for _, k in pieces[i]):
                return _kth_largest(np.concatenate([k for _, k in pieces[i]]), wanted[i])
            return None

        # On two threads (the partition lets go of the GIL): a sixth of the selection on one.
        kths = stream.map_on_two_threads(kth, range(count))
        return [None if kths[i] is None else
                (kths[i][0] + bounds[i][0], self._tie_cut(i, pieces[i], kths[i][0], bounds[i][0], kths[i][1]))
                for i in range(count)]

    def _tie_cut(self, model: int, pieces: list, threshold: int, low: int, take: int) -> int | None:
        """The offset of the first key equal to the threshold that is not kept (``None``
        when none is cut), ``take`` keys equal to it coming before: found in the one block
        that holds it, read again. ``pieces`` are each block's near keys less ``low``, as
        ``_count_near`` records them; ``threshold`` is less ``low`` too."""
        import numpy as np

        for start, keys in pieces:
            equal = int(np.count_nonzero(keys == threshold))
            if take < equal:
                stop = min(self._base.size, start + self.BLOCK)
                key = threshold + low
                found: list[int] = []
                self._scan([(start, stop)], [model], lambda _, block_keys, s, __: found.append(
                    s + _first_not_kept(block_keys, key, take)))
                return found[0]
            take -= equal
        return None

    def _radix(self, which: list[int]) -> list[tuple[int, int | None]]:
        """The exact threshold and cut of the given models, whatever their keys: one pass
        histograms the keys' high 16 bits, a second the low 16 bits inside the bin that
        holds the ``k``-th largest, recording where that bin's keys lie; a third finds the
        cut when too many were in it to record."""
        import numpy as np

        count = len(self._models)
        blocks = self._blocks()
        high = {i: np.zeros(1 << 16, np.int64) for i in which}

        def high_pass(i: int, keys, start: int, _: Space) -> None:
            # The high halves as uint16: bincount of uint32 values ran 4x slower here.
            high[i] += np.bincount((keys >> 16).astype(np.uint16), minlength=1 << 16)

        self._scan(blocks, which, high_pass)
        bins = {i: _kth_bin(high[i], self._k[i]) for i in which}  # (bin, count above it)
        low = {i: np.zeros(1 << 16, np.int64) for i in which}
        recorded: dict[int, list | None] = {i: [] for i in which}  # (offsets, low bits) inside the bin
        room = {i: self.MAX_RECORDED // count for i in which}

        def low_pass(i: int, keys, start: int, _: Space) -> None:
            inside = np.flatnonzero((keys >> 16) == bins[i][0])
            bits = (keys[inside] & 0xFFFF).astype(np.uint16)
            low[i] += np.bincount(bits, minlength=1 << 16)
            room[i] -= len(inside)
            if room[i] < 0:
                recorded[i] = None
            elif recorded[i] is not None:
                recorded[i].append((inside + start, bits))

        self._scan(blocks, which, low_pass)
        cuts, needed = {}, {}
        for i in which:
            lo, above_lo = _kth_bin(low[i], self._k[i] - bins[i][1])
            threshold = (bins[i][0] << 16) | lo
            take = self._k[i] - bins[i][1] - above_lo  # how many keys equal to the threshold are kept
            cut = None
            if take < low[i][lo] and recorded[i] is not None:
                offsets = np.concatenate([o for o, _ in recorded[i]])
                bits = np.concatenate([b for _, b in recorded[i]])
                cut = int(offsets[bits == lo][take])  # the first key equal to the threshold not kept
            cuts[i] = [threshold, cut]
            needed[i] = take if take < low[i][lo] and recorded[i] is None else 0
        if any(needed.values()):
            self._find_cuts(blocks, cuts, needed)
        return [(int(cuts[i][0]), cuts[i][1]) for i in which]

    def _find_cuts(self, blocks: list, cuts: dict, needed: dict) -> None:
        """A third pass, when the bin at the cut held too many keys to record: where, in
        element order, the first key equal to the threshold that is not kept lies."""
        import numpy as np

        seen = dict.fromkeys(needed, 0)

        def tie_pass(i: int, keys, start: int, _: Space) -> None:
            if not needed[i] or cuts[i][1] is not None:
                return
            ties = np.flatnonzero(keys == cuts[i][0])
            if seen[i] + len(ties) > needed[i]:
                cuts[i][1] = start + int(ties[needed[i] - seen[i]])
            seen[i] += len(ties)

        self._scan(blocks, [i for i in needed if needed[i]], tie_pass)

    def _magnitude_keys(self, start: int, stop: int, space: Space, which):
        self._base.read_into(start, stop, space.base)
        base_key = key_base(space.base, space)
        for i in which:
            self._models[i].read_into(start, stop, space.model)
            yield i, magnitude_keys(space.model, base_key, space)

    def _blocks(self) -> list[tuple[int, int]]:
        size = self._base.size
        return [(s, min(size, s + self.BLOCK)) for s in range(0, size, self.BLOCK)]

    def _scan(self, ranges: list[tuple[int, int]], which, visit: Callable[[int, Any, int, Space], None],
              parallel: bool = False) -> None:
        """A pass over ``ranges`` of the leaf: ``visit(model, keys, start, space)`` for each of
        the models ``which``, their keys in a buffer reused for the next. In element order
        unless ``parallel``, when two threads take ranges in turn (the radix passes run on
        one: bincount holds the GIL)."""

        def scan(bounds: tuple[int, int]) -> None:
            start, stop = bounds
            with _combine.scratch_buffers(Space.BUFFERS, self.BLOCK) as buffers:
                space = Space(buffers, stop - start, self._base.dtype)
                for i, keys in self._keys(start, stop, space, which):
                    visit(i, keys, start, space)

        if parallel:
            stream.each_on_two_threads(scan, ranges)
        else:
            for bounds in ranges:
                scan(bounds)


def _bounds(sample, k: int, size: int) -> tuple[int, int]:
    """Keys ``[low, high)`` that hold the ``k``-th largest of ``size`` with near certainty,
    from a sample of them: its rank in the sample, give or take six binomial standard
    deviations and a little more, so that a sample drawn from rows that differ still holds
    it nearly always (the radix passes catch the rest)."""
    import numpy as np

    n = sample.size
    share = k / size
    rank = share * n  # the k-th largest's expected rank from the top, in the sample
    margin = 6 * math.sqrt(n * share * (1 - share)) + n / 2000 + 16
    top, bottom = math.floor(rank - margin), math.ceil(rank + margin)
    wanted = sorted({n - rank for rank, inside in ((top, top >= 1), (bottom, bottom <= n)) if inside})
    ordered = np.partition(sample, wanted) if wanted else sample
    high = int(ordered[n - top]) + 1 if top >= 1 else 1 << 31  # keys never reach 2**31: the sign is cleared
    low = int(ordered[n - bottom]) if bottom <= n else 0
    return low, high


def _kth_largest(keys, k: int) -> tuple[int, int]:
    """The ``k``-th largest of ``keys``, and how many keys equal to it are kept (``k`` less
    those above it)."""
    import numpy as np

    threshold = int(np.partition(keys, keys.size - k)[keys.size - k])
    return threshold, k - int(np.count_nonzero(keys > threshold))


def _first_not_kept(keys, threshold: int, take: int) -> int | None:
    """Where in ``keys`` (in element order) the first key equal to the threshold that is not
    kept lies, the first ``take`` being kept (mergekit's ``topk`` keeps an unspecified set);
    ``None`` when every one is."""
    import numpy as np

    equal = np.flatnonzero(keys == threshold)
    return int(equal[take]) if take < equal.size else None


def key_base(base, space: Space):
    """The base as the keys subtract it: itself, or in float32 for bf16/fp16."""
    import numpy as np

    if base.dtype.itemsize >= 4:
        return base
    np.copyto(space.base_key, base)
    return space.base_key


def _kth_bin(histogram, k: int) -> tuple[int, int]:
    """The bin holding the ``k``-th largest value, and how many values lie above it."""
    import numpy as np

    from_top = np.cumsum(histogram[::-1])
    position = int(np.searchsorted(from_top, k))  # first index where the running count reaches k
    bin_index = len(histogram) - 1 - position
    above = int(from_top[position - 1]) if position else 0
    return bin_index, above
