"""Digests of the weights themselves, whatever holds them: ``hash``, ``verify`` and the
record each output keeps of where it came from.

A leaf's digest is BLAKE3 over what the leaf is, not how a file lays it out: its stored
type and shape, then its elements in C order, little-endian, as stored. A float or integer
array's type is its dtype (``float32``, ``bfloat16``); a quantized tensor's is its
quantization (``Q4_K``), and its bytes are its stored blocks, so a GGUF copy of a Q4_K
tensor hashes as the original does, and its dequantized values as the float array they
are. A leaf stored as several tensors (an FP8 weight and its block scales: ``FP8
128x128``) hashes each as a leaf of its own, then their digests under its type and shape.
A value that is not an array (a step number, a string) hashes its Python type and
``repr``. The root digest is BLAKE3 over each leaf's key path (its keys joined with ``.``)
and digest, sorted by key path: the same weights give the same root whatever the format,
file, sharding, tensor order or compression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from treecli import _leaf, _tree
from treecli._errors import FormatError

ALGORITHM = "blake3"
MANIFEST_BYTES = 256 << 20  # a manifest of a 200k-tensor model is about 30 MB


@dataclass
class Digests:
    """The digests of a tree's leaves (by key path) and its root digest."""

    leaves: dict[str, str]
    root: str = ""

    def __post_init__(self) -> None:
        self.root = self.root or root_of(self.leaves)

    def as_json(self) -> dict[str, Any]:
        return {"algorithm": ALGORITHM, "root": self.root, "leaves": dict(sorted(self.leaves.items()))}


@dataclass
class Verification:
    """How a tree's digests compare with the expected ones: the key paths whose leaves
    differ, those expected but missing, and those not expected."""

    differ: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    #: Checked against a record (which holds the root digest, not each leaf's): the root differs.
    unlike_record: bool = False

    @property
    def equal(self) -> bool:
        return not (self.differ or self.missing or self.extra or self.unlike_record)

    def as_json(self) -> dict[str, Any]:
        return {"equal": self.equal, "differ": self.differ, "missing": self.missing, "extra": self.extra}


def keypath_name(keypath: tuple) -> str:
    """A key path as digests name it: its keys joined with ``.`` (``model.layers.0.weight``),
    as a safetensors file, a GGUF file and a nested dict name the same leaf."""
    return ".".join(map(str, keypath))


_ONE_AT_A_TIME = 8 << 20  # a leaf this big has every core to itself: BLAKE3 spreads its chunks over them


def digests(tree: Any, *, progress: Callable[[int], None] | None = None, part: tuple[int, int] = (0, 1),
            gather: Callable[[dict[str, str]], list[dict[str, str]]] | None = None,
            known: Callable[[_leaf.ArrayLeaf], str | None] | None = None) -> Digests:
    """Every leaf's digest and the root's: big leaves one at a time (BLAKE3 hashes each chunk
    on every core, the next chunk read meanwhile), small ones two at a time (their reads
    and per-leaf work overlap). ``part``: ``(i, n)``, digest only the i-th of n shares of
    the leaves (by bytes, the same shares in every process of a run); ``gather`` then gives
    every part's digests for this part's (the processes exchange them): the whole tree's.
    ``known``: a stored tensor's digest where it is already known (taken as its bytes were
    written), else None: it is read."""
    from treecli._bytes import stream

    named = [(keypath_name(keypath), leaf) for keypath, leaf in _tree.flatten(tree)]
    owner = _tree.shares(named, part[1])
    items = [item for item in named if owner[item[0]] == part[0]]
    found: dict[str, str] = {}
    if known is not None:  # (those known here, not handed to a thread each: 60k of them took a second so)
        for name, leaf in items:
            if _leaf.is_array(leaf) and not getattr(_leaf.as_leaf(leaf), "parts", None):
                digest = known(_leaf.as_leaf(leaf))
                if digest is not None:
                    found[name] = digest
                    if progress is not None:
                        progress(_leaf.as_leaf(leaf).stored_nbytes)
        items = [item for item in items if item[0] not in found]

    def visit(item: tuple[str, Any]) -> None:
        name, leaf = item
        found[name] = leaf_digest(leaf, progress, known)

    def is_big(item: tuple[str, Any]) -> bool:
        return _leaf.is_array(item[1]) and _leaf.as_leaf(item[1]).stored_nbytes >= _ONE_AT_A_TIME

    stream.each_on_two_threads(visit, [item for item in items if not is_big(item)])
    for item in filter(is_big, items):
        visit(item)
    if gather is not None:
        found = {name: digest for share in gather(found) for name, digest in share.items()}
    return Digests(found)


def leaf_digest(leaf: Any, progress: Callable[[int], None] | None = None,
                known: Callable[[_leaf.ArrayLeaf], str | None] | None = None) -> str:
    """One leaf's digest (the module's docstring says over what); ``known`` as :func:`digests`'."""
    from blake3 import blake3

    if not _leaf.is_array(leaf):
        return _hex(blake3(f"py:{type(leaf).__name__}\0{leaf!r}".encode()))
    array = _leaf.as_leaf(leaf)
    parts = getattr(array, "parts", None)
    if array.stored_otherwise and isinstance(parts, dict):
        # Stored as several tensors (FP8's weight and its scales): each part's own digest, by
        # the name it adds, under the leaf's type and shape. A writer writes each part as a
        # tensor of its own and takes its digest then; the leaf's follows from theirs.
        combined = started(array.stored_dtype, array.shape, 0)
        for suffix in sorted(parts):
            combined.update(f"{suffix}\0{leaf_digest(parts[suffix], progress, known)}\n".encode())
        return _hex(combined)
    found = known(array) if known is not None else None
    if found is not None:
        if progress is not None:
            progress(array.stored_nbytes)
        return found
    digest = started(array.stored_dtype, array.shape, array.stored_nbytes)
    for piece in _stored_pieces(array):
        digest.update(piece)
        if progress is not None:
            progress(len(piece))
    return finished(digest)


def started(stored_dtype: str, shape: Sequence[int], nbytes: int) -> Any:
    """The BLAKE3 of a stored tensor's digest, its type and shape taken in: its ``nbytes``
    bytes follow (:func:`finished` gives the digest). A writer hashes what it writes so."""
    from blake3 import blake3

    # (on every core for a big tensor; a small one's hash on its own: starting the threads
    # for each of 60k small tensors took 3 s of a 4.5 s conversion)
    digest = blake3(max_threads=blake3.AUTO) if nbytes >= _ONE_AT_A_TIME else blake3()
    digest.update(f"{stored_dtype}\0{','.join(map(str, shape))}\0".encode())
    return digest


def finished(digest: Any) -> str:
    """The digest of a stored tensor :func:`started` hashed."""
    return _hex(digest)


def _stored_pieces(leaf: _leaf.ArrayLeaf) -> Any:
    """A stored tensor's bytes, a chunk at a time: a quantized tensor's blocks, else its
    elements (C order, little-endian)."""
    from treecli._bytes import stream, writer

    if leaf.stored_otherwise and hasattr(leaf, "read_raw"):
        for start in range(0, leaf.raw_nbytes, stream.CHUNK_BYTES):
            yield leaf.read_raw(start, min(leaf.raw_nbytes, start + stream.CHUNK_BYTES))
    else:
        for chunk in stream.iter_chunks(leaf):
            yield writer.stored_bytes(chunk)


def root_of(leaves: dict[str, str]) -> str:
    """The root digest of leaves' digests: BLAKE3 of ``key path TAB digest LF``, sorted."""
    from blake3 import blake3

    return _hex(blake3("".join(f"{name}\t{leaves[name]}\n" for name in sorted(leaves)).encode()))


def _hex(digest: Any) -> str:
    return f"{ALGORITHM}:{digest.hexdigest()}"


def compare(found: Digests, expected: Digests) -> Verification:
    """``found`` against ``expected``, key path by key path."""
    result = Verification()
    for name in sorted(set(found.leaves) | set(expected.leaves)):
        if name not in found.leaves:
            result.missing.append(name)
        elif name not in expected.leaves:
            result.extra.append(name)
        elif found.leaves[name] != expected.leaves[name]:
            result.differ.append(name)
    return result


def parse_manifest(text: str, file: str) -> Digests:
    """A manifest ``hash -o`` wrote (``Digests.as_json``), checked: its algorithm, every
    digest a string of the right form, and the root the one its leaves give.

    Raises:
        FormatError: not a manifest, or one whose root does not match its leaves.
    """
    try:
        data = strict_json(text)
    except ValueError as e:
        raise FormatError(f"not a treecli digest manifest: {e}", file=file) from None
    leaves = data.get("leaves") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM or not isinstance(leaves, dict):
        raise FormatError(f"not a treecli digest manifest: no \"algorithm\": \"{ALGORITHM}\" and \"leaves\" object",
                          file=file)
    for name, digest in leaves.items():
        if not isinstance(digest, str) or not well_formed(digest):
            raise FormatError("not a BLAKE3 digest (blake3: and 64 hex digits)", file=file, keypath=str(name)[:80])
    manifest = Digests(dict(leaves))
    if data.get("root") != manifest.root:
        raise FormatError("the manifest's root digest is not the one its leaves give: it was changed", file=file)
    return manifest


def strict_json(text: str) -> Any:
    """JSON as a manifest or a record is read from a file: a key given twice (which one counts
    would be the parser's choice) and nesting deeper than Python parses refused.

    Raises:
        ValueError: its message says which: not JSON, a key twice, nested too deep.
    """
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise ValueError(f"the key {key[:60]!r} is given twice")
            found[key] = value
        return found

    try:
        return json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None


def is_manifest(head: bytes) -> bool:
    """Whether a file's first bytes are a JSON manifest's (a checkpoint's never are)."""
    return head.lstrip()[:1] == b"{" and b'"algorithm"' in head


def well_formed(digest: str) -> bool:
    """Whether a text is a digest as treecli writes them (``blake3:`` and 64 hex digits)."""
    prefix = ALGORITHM + ":"
    return digest.startswith(prefix) and len(digest) == len(prefix) + 64 and \
        all(c in "0123456789abcdef" for c in digest[len(prefix):])


def restricted(expected: Digests, where: Sequence[str]) -> Digests:
    """A manifest's digests of the leaves ``where`` selects (by their key paths' keys)."""
    from treecli import _keypath

    if not where:
        return expected
    patterns = [_keypath.parse(text) for text in where]
    return Digests({name: digest for name, digest in expected.leaves.items()
                    if any(_keypath.covers(pattern, tuple(name.split("."))) for pattern in patterns)})


def selected(tree: Any, where: Sequence[str]) -> Any:
    """The leaves ``where`` selects (all without it)."""
    return _tree.selected(tree, list(where)) if where else tree
