"""Verification of a written output before it is published: re-read the
temporary and compare it with the tree that was written, leaf by leaf, under
the writer's own naming.

Names, not nestings, are compared: an npz key ``a.b`` is one key there and
nests as ``a`` / ``b`` when re-read from safetensors, yet both are the stored
name ``a.b``. Flat formats name a leaf by its key path joined with their
separator; tree formats by the key path itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager

from treecli import _diff, _keypath, _leaf, _tree
from treecli._errors import TreecliError
from treecli._keypath import format_keypath


def _in_order(names: set[str]) -> list[str]:
    return sorted(names, key=_keypath.natural_sort_key)


def _shown(name: str) -> str:
    """A stored name as ``diff`` shows a key of its own."""
    return format_keypath((name,))


class Verifier:
    """A check of a finished temporary against ``tree``, raising on any difference; called
    with the temporary. The output is opened by its own reader, and its names, shapes and
    dtypes compared with the tree's. Its bytes: the writer records the digest of what it was
    given for each leaf in ``digests`` (by the leaf's ``id``) and reads the output back as it
    writes it, into ``readback`` (:class:`writer.ReadBack`); each leaf of the output, where its
    reader finds it, must hold bytes of that digest. A leaf not recorded so (an Orbax
    output's, or where the reader finds another place than the writer's) is read again:
    from the output, and from the source unless its digest was recorded.

    ``progress(description, total_bytes)``, when given, is a context giving an
    ``advance(nbytes)`` callable (a progress bar: the check reads everything twice).
    """

    def __init__(self, tree: Any, fmt: Any, dropped_allowed: bool,
                 progress: Callable[[str, int], ContextManager[Callable[[int], None]]] | None = None,
                 like: Any = None):
        self._tree, self._fmt, self._dropped_allowed = tree, fmt, dropped_allowed
        self._progress, self._like = progress, like
        self.digests: dict[int, tuple[Any, tuple[int, int, int]]] = {}  # id(leaf): (leaf, digest)
        from treecli._bytes import writer

        self.readback = writer.ReadBack()

    def __call__(self, written_path: Path) -> None:
        from treecli.formats import open_checkpoint

        self.readback.finish()
        total = 2 * _tree.array_bytes(self._tree)
        with open_checkpoint(written_path, self._fmt.name) as written, \
                (self._progress("verifying", total) if self._progress else contextlib.nullcontext(None)) as advance:
            expected, written_names = self._fmt.stored_leaves(self._tree, written.tree, self._like)
            problems = self._check_digests(expected, written_names, advance)
            # Names on one side only are found by set, and diff compares the leaves on both sides that
            # no digest checked (with an equal marker for each of 200k checked leaves, it took 3.5 s).
            unchecked = [k for k, v in expected.items() if k in written_names and self._digest(v) is None]
            changed = _diff.diff({k: expected[k] for k in unchecked}, {k: written_names[k] for k in unchecked},
                                 progress=advance).changed if unchecked else []
        problems += self._fmt.reference_problems(written_path, written_names)
        problems += [f"only in the output: {_shown(k)}" for k in _in_order(written_names.keys() - expected.keys())]
        if not self._dropped_allowed:
            problems += [f"missing from the output: {_shown(k)}"
                         for k in _in_order(expected.keys() - written_names.keys())]
        problems += [f"{c.keypath}: {c.a} -> {c.b}" for c in changed]
        if problems:
            raise TreecliError(f"verification failed: the output differs from the input in {len(problems)} "
                               "leaves; nothing was replaced", file=str(written_path), details=problems)

    def _check_digests(self, expected: dict, written: dict, advance: Any) -> list[str]:
        """The leaves with a recorded digest: the output's bytes must give the same one."""
        from treecli._bytes import stream

        problems, to_read = [], []
        for name, source in expected.items():
            recorded = self._digest(source)
            output = written.get(name)
            if recorded is None or output is None:  # (a missing output: the comparison of names reports it)
                continue
            if not _leaf.is_array(output) or not _tree.same_layout(source, output):
                problems.append(f"{name}: {_tree.describe_leaf(source)} -> {_tree.describe_leaf(output)}")
            else:
                to_read.append((name, _leaf.as_leaf(output), recorded, source))

        def check(item: tuple) -> None:
            name, output, recorded, source = item
            if self._read_back(output, recorded) != recorded:
                problems.append(f"{name}: {_tree.describe_leaf(source)}: the bytes written differ from the bytes "
                                "read back")
            if advance:
                advance(2 * output.nbytes)

        # Two leaves at a time: where leaves are read again, the CRC is most of the cost, and lets go of the GIL.
        stream.each_on_two_threads(check, to_read)
        return sorted(problems)

    def _read_back(self, output: Any, recorded: tuple[int, int, int]) -> tuple[int, int, int]:
        """The digest of ``output``'s bytes (a leaf of the written file, where its reader finds
        it): as read back while it was written, where the writer put a leaf of its size just
        there; else read now."""
        from treecli._bytes import writer

        identity = getattr(getattr(output, "reader", None), "identity", None)
        digest = (self.readback.leaves.get((*identity[:2], output.offset, output.nbytes)) if identity is not None
                  else None)
        return digest.value() if digest is not None else writer.digest_of(output, recorded[2])

    def _digest(self, source: Any) -> tuple[int, int, int] | None:
        entry = self.digests.get(id(source))
        return entry[1] if entry is not None and entry[0] is source else None
