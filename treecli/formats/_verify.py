"""Verification of a written output before it is published: re-read the
temporary and compare it with the tree that was written, leaf by leaf, under
the writer's own naming. Part of the write path (``formats.save(verify=True)``):
every command and the Python API ask for it the same way.

Names, not nestings, are compared: an npz key ``a.b`` is one key there and
nests as ``a`` / ``b`` when re-read from safetensors, yet both are the stored
name ``a.b``. Flat formats name a leaf by its key path joined with their
separator; tree formats by the key path itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager

from treecli import _keypath, _leaf, _tree
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
        self.readback.finish()
        total = 2 * _tree.array_bytes(self._tree)
        with self._reopened(written_path) as written, \
                (self._progress("verifying", total) if self._progress else contextlib.nullcontext(None)) as advance:
            expected, written_names = self._fmt.stored_leaves(self._tree, written.tree, self._like)
            problems = self._check_digests(expected, written_names, advance)
            # Names on one side only are found by set; the leaves on both sides that no digest
            # checked are read on both sides and their digests compared.
            problems += self._check_unrecorded([k for k, v in expected.items()
                                                if k in written_names and self._digest(v) is None],
                                               expected, written_names, advance)
        problems += self._fmt.reference_problems(written_path, written_names)
        problems += [f"only in the output: {_shown(k)}" for k in _in_order(written_names.keys() - expected.keys())]
        if not self._dropped_allowed:
            problems += [f"missing from the output: {_shown(k)}"
                         for k in _in_order(expected.keys() - written_names.keys())]
        if problems:
            raise TreecliError(f"verification failed: the output differs from the input in {len(problems)} "
                               "leaves; nothing was replaced", file=str(written_path), details=problems)

    def _reopened(self, written_path: Path) -> Any:
        """The written temporary, opened by its own format's reader."""
        try:
            return self._fmt.open(written_path)
        except TreecliError as e:
            raise TreecliError(f"verification failed: the output cannot be read back: {e.message}; nothing was "
                               "replaced", file=str(written_path)) from e
        except Exception as e:  # (a library's own exception on what treecli just wrote: a bug, said in one line)
            raise TreecliError(f"verification failed: the output cannot be read back as {self._fmt.name}: "
                               f"{type(e).__name__}: {str(e)[:200]}; nothing was replaced",
                               file=str(written_path)) from e

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

    @staticmethod
    def _check_unrecorded(names: list[str], expected: dict, written: dict, advance: Any) -> list[str]:
        """The leaves no digest was recorded for, read on both sides: arrays of the same
        shape and dtype, and the same bytes; other values equal, of the same type."""
        from treecli._bytes import stream, writer

        problems = []

        def check(name: str) -> None:
            source, output = expected[name], written[name]
            if _leaf.is_array(source) != _leaf.is_array(output) or (
                    _leaf.is_array(source) and not _tree.same_layout(source, output)):
                problems.append(f"{_shown(name)}: {_tree.describe_leaf(source)} -> {_tree.describe_leaf(output)}")
            elif _leaf.is_array(source):
                source, output = _leaf.as_leaf(source), _leaf.as_leaf(output)
                if writer.digest_of(source) != writer.digest_of(output):
                    problems.append(f"{_shown(name)}: {_tree.describe_leaf(source)}: the bytes written differ")
                if advance:
                    advance(2 * source.nbytes)
            elif type(source) is not type(output) or repr(source) != repr(output):  # (repr: NaN is NaN)
                problems.append(f"{_shown(name)}: {_escape_value(source)} -> {_escape_value(output)}")

        stream.each_on_two_threads(check, names)
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


def _escape_value(value: Any) -> str:
    """A non-array value of a leaf, short, as an error line shows it."""
    from treecli._escape import clipped_middle

    return clipped_middle(repr(value), 80)
