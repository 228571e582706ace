"""Where an output came from: the record treecli keeps in the metadata of what it writes.

A record is JSON, under ``treecli.record`` in a safetensors file's ``__metadata__``, a GGUF
file's keys and an Orbax checkpoint's custom metadata::

    {"treecli": "0.9.0", "root": "blake3:…", "command": "treecli convert a.safetensors b.gguf",
     "inputs": [{"name": "a.safetensors", "root": "blake3:…"}], "history": [earlier records]}

``root`` is the root digest of the weights written (``_bytes.digest``: what ``treecli hash``
of the output gives), each input's its own; ``history`` the records of the inputs' own
making, oldest first, each without a history of its own. Formats without metadata (npz,
msgpack, ``.eqx``, ``.pt``, ``.npy``) keep none.

A record never reads what its command would not: an input the command read only in part
(``slice``, ``get``) has no root (``null``), nor has a remote one some of whose leaves
were not written unchanged (they would be downloaded again): its root is ``"not taken"``.

The roots are known only once the weights are written: the header is written with a
random placeholder of a digest's length where each root goes, each written tensor's digest
is taken as its bytes are written (``writer.write_leaf``: no second pass over them), and
before the output is published, :meth:`Record.seal` opens it with its own reader, takes
each leaf's digest from those (reading only what no writer hashed), and writes the roots
over the placeholders. An input's leaves written unchanged take the digests taken as they
were written; the others are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from treecli import _leaf
from treecli._bytes import digest as _digest

KEY = "treecli.record"
# Records of earlier steps kept in a history: the latest ones (a loop of edits over a
# long-lived file must not grow its header without bound).
HISTORY_LIMIT = 100
_COMMAND_CHARS = 4096
_INPUTS_LIMIT = 64
# The longest record text read: past what HISTORY_LIMIT steps of the longest commands and
# most inputs treecli writes can take, checked before the JSON is parsed.
_RECORD_CHARS = 64 << 20


# What stands for an input's root where it was not taken (padded to a digest's length:
# it is written over a placeholder of that length).
NOT_TAKEN = "not taken"


class Record:
    """The record of one output being written: made by the caller with the ``command``
    (canonical form) and the ``inputs`` (``(name, tree, metadata)`` of each: the tree its
    root is taken of, None where the command reads it only in part; the metadata its own
    record is read from), then given to the writer in ``WriteOptions.record``."""

    def __init__(self, command: str, inputs: Sequence[tuple[str, Any, dict]] = (), *,
                 warn: Callable[[str], None] | None = None):
        self.command = command[:_COMMAND_CHARS]
        self._inputs = list(inputs)
        self._history = _history([(name, metadata) for name, _, metadata in self._inputs], warn)
        # the output's root, then each input's (None: not taken)
        self._placeholders = [_placeholder() if tree is not None or i == 0 else None
                              for i, (_, tree, _) in enumerate([("", True, {}), *self._inputs])]
        self._heads: dict[str, dict[str, list[int]]] = {}  # path -> placeholder -> offsets in the file
        self._by_place: dict[tuple[int, int, int], str] = {}  # (device, inode, offset) -> a written tensor's digest
        self._by_leaf: dict[int, tuple[Any, str]] = {}  # id(leaf) -> (leaf, its digest), as it was written
        self.sealed: dict[str, Any] | None = None

    def text(self) -> str:
        """The record as the header holds it: the roots yet to be known as placeholders
        (:meth:`seal` writes them), or known (:meth:`seal_before`)."""
        roots = [self.sealed["root"], *(i["root"] for i in self.sealed["inputs"])] if self.sealed \
            else self._placeholders
        return json.dumps(self._document(roots), ensure_ascii=False, separators=(",", ":"))

    def as_json(self) -> dict[str, Any]:
        """The record as a JSON object (Orbax's custom metadata holds it so)."""
        return json.loads(self.text())

    def _document(self, roots: Sequence[str]) -> dict[str, Any]:
        from importlib.metadata import version

        return {"treecli": version("treecli"), "root": roots[0], "command": self.command,
                "inputs": [{"name": name, "root": root} for (name, _, _), root in zip(self._inputs, roots[1:])],
                "history": self._history}

    # what the writers call

    def start(self, leaf: _leaf.ArrayLeaf) -> Any:
        """The hash of a stored tensor's digest, about to be written (its bytes follow)."""
        return _digest.started(leaf.stored_dtype, leaf.shape, leaf.stored_nbytes)

    def wrote(self, leaf: _leaf.ArrayLeaf, hashed: Any, place: tuple[int, int, int] | None) -> None:
        """A tensor's bytes were written whole, hashed as ``hashed`` (:meth:`start`'s), at
        ``place`` (device, inode, offset) where known."""
        found = _digest.finished(hashed)
        self._by_leaf[id(leaf)] = (leaf, found)
        if place is not None:
            self._by_place[place] = found

    def wrote_head(self, path: Path | str, head: bytes, at: int = 0) -> None:
        """A header written at ``at`` of ``path``: where in it the placeholders are."""
        found = {}
        for placeholder in filter(None, self._placeholders):
            offsets, start = [], head.find(placeholder.encode())
            while start >= 0:
                offsets.append(at + start)
                start = head.find(placeholder.encode(), start + 1)
            if offsets:
                found[placeholder] = offsets
        if found:
            self._heads[str(path)] = found

    def moved(self, old: Path | str, new: Path | str) -> None:
        """A file written with a header was renamed (a shard published under its name)."""
        if str(old) in self._heads:
            self._heads[str(new)] = self._heads.pop(str(old))

    # the roots

    def seal(self, opener: Callable[[Path], Any], written: Path) -> None:
        """The roots written over their placeholders: the output (``written``, opened by
        ``opener``, its format's reader) and each input hashed, from the digests the writers
        took where they did; each patched file then synced. Before the output is published."""
        if self.sealed is not None:
            return
        with opener(written) as checkpoint:
            root = _digest.digests(checkpoint.tree, known=self._known_place).root
        self._finish(root)
        for path, found in self._heads.items():
            fd = os.open(path, os.O_WRONLY)
            try:
                for placeholder, offsets in found.items():
                    for offset in offsets:
                        os.pwrite(fd, self._value_of(placeholder).encode(), offset)
                os.fsync(fd)
            finally:
                os.close(fd)

    def seal_before(self, tree: Any) -> None:
        """The roots known before anything is written (an upload, whose header goes first):
        the tree's, as it will be stored, and each input's."""
        self._finish(_digest.digests(tree).root)

    def _finish(self, root: str) -> None:
        self.sealed = self._document([root, *(self._input_root(tree) for _, tree, _ in self._inputs)])

    def _input_root(self, tree: Any) -> str | None:
        """An input's root: from the digests of its leaves written unchanged, the others read
        again; NOT_TAKEN where one of those is remote (not downloaded twice)."""
        if tree is None:
            return None

        def known(leaf: _leaf.ArrayLeaf) -> str | None:
            found = self._known_leaf(leaf)
            if found is None and any("://" in source for source in leaf.sources):
                raise _Remote
            return found

        try:
            return _digest.digests(tree, known=known).root
        except _Remote:
            return NOT_TAKEN.ljust(len(self._placeholders[0]))

    def _value_of(self, placeholder: str) -> str:
        index = self._placeholders.index(placeholder)
        return self.sealed["root"] if index == 0 else self.sealed["inputs"][index - 1]["root"]

    def _known_place(self, leaf: _leaf.ArrayLeaf) -> str | None:
        place = _place(leaf)
        return self._by_place.get(place) if place is not None else None

    def _known_leaf(self, leaf: _leaf.ArrayLeaf) -> str | None:
        entry = self._by_leaf.get(id(leaf))
        return entry[1] if entry is not None and entry[0] is leaf else None


class _Remote(Exception):
    """An input's leaf that would be downloaded again to hash it."""


def _place(leaf: _leaf.ArrayLeaf) -> tuple[int, int, int] | None:
    """Where a stored tensor of a local file lies: (device, inode, offset of its bytes)."""
    if leaf.stored_otherwise:  # (a GGUF tensor's blocks)
        place = getattr(leaf, "place", None)
        if place is None:
            return None
        path, offset = place
        try:
            info = os.stat(path)
        except OSError:
            return None
        return info.st_dev, info.st_ino, offset
    if not leaf.in_local_file:
        return None
    return (*leaf.reader.identity[:2], leaf.offset)


def _placeholder() -> str:
    """A digest's stand-in until it is known: of its length, and found nowhere else."""
    return f"{_digest.ALGORITHM}:{os.urandom(32).hex()}"


def _history(inputs: Sequence[tuple[str, dict]], warn: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """The earlier records of the inputs' making (each input's history, then its own record),
    each once, oldest first, the latest HISTORY_LIMIT."""
    steps: list[dict[str, Any]] = []
    for name, metadata in inputs:
        if KEY not in metadata:
            continue
        record, why = parsed(metadata[KEY])
        if record is None:
            if warn:
                warn(f"{name}: its {KEY} is not a record treecli wrote ({why}): not carried into the output's history")
            continue
        for step in [*record["history"], {k: v for k, v in record.items() if k != "history"}]:
            if step not in steps:
                steps.append(step)
    return steps[-HISTORY_LIMIT:]


def parsed(value: Any) -> tuple[dict[str, Any] | None, str]:
    """A record read from a file (text, or Orbax's JSON object), checked to be of the form
    treecli writes; else None and why. Nothing else in it is kept."""
    if hasattr(value, "value"):  # (a GGUF metadata value)
        value = value.value
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        if len(value) > _RECORD_CHARS:
            return None, f"{len(value):,} characters, over the {_RECORD_CHARS:,} a record may take"
        try:
            value = _digest.strict_json(value)
        except ValueError as e:
            return None, str(e)
    record = _step(value)
    if record is None:
        return None, "not of the form treecli writes"
    history = value.get("history", [])
    steps = [_step(step) for step in history] if isinstance(history, list) else [None]
    if len(steps) > HISTORY_LIMIT or None in steps:
        return None, "its history is not of the form treecli writes"
    record["history"] = steps
    return record, ""


def _step(value: Any) -> dict[str, Any] | None:
    """One record without its history, of the form treecli writes, or None."""
    if not isinstance(value, dict):
        return None
    fields = {key: value.get(key) for key in ("treecli", "root", "command")}
    inputs = value.get("inputs", [])
    if not all(isinstance(v, str) and len(v) <= _COMMAND_CHARS for v in fields.values()) \
            or not _digest.well_formed(fields["root"]) or not isinstance(inputs, list) or len(inputs) > _INPUTS_LIMIT:
        return None
    kept = []
    for item in inputs:
        root = item.get("root") if isinstance(item, dict) else None
        root = None if root is None or (isinstance(root, str) and root.strip() == NOT_TAKEN) else root
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and len(item["name"]) <= _COMMAND_CHARS
                and (root is None or isinstance(root, str) and _digest.well_formed(root))):
            return None
        kept.append({"name": item["name"], "root": root})
    return {**fields, "inputs": kept}


def without_record(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata to write without a record: an input's would describe other weights."""
    return {k: v for k, v in metadata.items() if k != KEY}
