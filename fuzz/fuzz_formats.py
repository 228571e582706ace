"""Coverage-guided fuzzing of treecli's readers with atheris (run by hand, not in CI).

    pip install atheris
    python fuzz/fuzz_formats.py safetensors -max_total_time=600 fuzz/corpus/safetensors
    python fuzz/fuzz_formats.py npz|msgpack|index|eqx -max_total_time=600
    python fuzz/fuzz_formats.py typed -max_total_time=600 fuzz/corpus/typed

The only allowed outcome for any input is treecli's own error class; and
whatever treecli accepts, the reference must accept with the same bytes:
`safetensors.deserialize`, `np.load(allow_pickle=False)` for npz, Flax's
`msgpack_restore` for msgpack. Anything else is a crash atheris reports, with the
input saved as `crash-*` (commit minimized ones as regression tests). `typed` reads
each input (a safetensors file, and its header as an index's JSON) through msgspec's fast
paths and through the exact parser: their results, or their errors, must be the same.

treecli imports its format modules lazily, so they are imported here, inside
`instrument_imports`: imported later, the parsers would run uninstrumented and
atheris would see a few dozen coverage edges instead of hundreds.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    import numpy as np

    import treecli
    import treecli._api
    import treecli._escape
    import treecli._keypath
    import treecli.formats
    import treecli._bytes.local
    import treecli._bytes.stream
    import treecli.formats._filedata
    import treecli.formats._flatkeys
    import treecli.formats._foreign
    import treecli.formats._npy
    import treecli.formats.eqx
    import treecli.formats.msgpack
    import treecli.formats.npz
    import treecli.formats.safetensors
    from treecli import _leaf, _tree
    from treecli._errors import TreecliError

FORMAT = sys.argv.pop(1) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "safetensors"
SUFFIX = {"safetensors": ".safetensors", "npz": ".npz", "msgpack": ".msgpack", "eqx": ".eqx",
          "index": "model.safetensors.index.json", "typed": ".safetensors"}[FORMAT]
WORKDIR = tempfile.mkdtemp(prefix="treecli-fuzz-")
PATH = os.path.join(WORKDIR, SUFFIX if FORMAT == "index" else "input" + SUFFIX)
if FORMAT == "index":  # a real shard for the index to point at
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, os.path.join(WORKDIR, "model-00001-of-00001.safetensors"))


SEPARATOR = {"safetensors": ".", "npz": "/", "msgpack": "/"}.get(FORMAT, ".")


def read_everything(path: str) -> dict:
    # Read the bytes as the format being fuzzed even when they look like another one
    # (the differential check is against that format's reference).
    fmt = FORMAT if FORMAT in ("safetensors", "npz", "msgpack") else None
    with treecli.open(path, format=fmt) as checkpoint:
        return {SEPARATOR.join(map(str, kp)): _leaf.as_leaf(x).read().tobytes()
                for kp, x in _tree.flatten(checkpoint.tree) if _leaf.is_array(x)}


def reference(data: bytes, ours: dict) -> dict | None:
    """What the format's reference reads, by flat key; None where there is no reference."""
    if FORMAT == "safetensors":
        from safetensors import deserialize

        return {name: bytes(info["data"]) for name, info in deserialize(data)}
    if FORMAT == "npz":  # the members treecli read (it skips what is no .npy, with a warning)
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {name: np.ascontiguousarray(archive[name]).tobytes() for name in ours}
    if FORMAT == "msgpack":
        from flax import serialization

        state = serialization.msgpack_restore(data)  # walked as treecli walks trees
        return {"/".join(map(str, kp)): np.ascontiguousarray(x).tobytes() for kp, x in _tree.flatten(state)
                if isinstance(x, np.ndarray)}
    return None


def read_both_ways(data: bytes) -> None:
    """The typed (msgspec) and exact readings of a header, and of its JSON as an index, agree."""
    from treecli.formats import _safetensors_header as safetensors

    def outcome(parse, typed_from):
        safetensors._TYPED_FROM = typed_from
        try:
            return parse()
        except TreecliError as e:
            return str(e)

    def header():
        return safetensors.parse_header(lambda offset, count: data[offset:offset + count], len(data), "f")

    def index():
        return safetensors._parse_json(data[8:].decode("utf-8", "replace"), "f")

    assert outcome(header, 0) == outcome(header, 2**40), "the typed header path read otherwise than the exact one"
    assert outcome(index, 0) == outcome(index, 2**40), "the plain index path read otherwise than the exact one"


def test_one_input(data: bytes) -> None:
    if FORMAT == "typed":
        read_both_ways(data)
        return
    with open(PATH, "wb") as f:
        f.write(data)
    try:
        ours = read_everything(PATH)
    except TreecliError:
        return
    theirs = reference(data, ours)
    if theirs is None:
        return
    for key, value in ours.items():  # every array treecli reads, the reference reads alike
        assert theirs.get(key) == value, f"treecli accepted a file and read other bytes than the reference: {key}"
    if FORMAT == "safetensors":
        assert set(ours) == set(theirs), "treecli and the reference read different tensors"


def seeds() -> None:
    """Write a few valid inputs to start from, if the corpus directory given is empty."""
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if not corpus or os.path.isfile(corpus) or (os.path.isdir(corpus) and os.listdir(corpus)):
        return  # a crash file to replay, or a corpus that has inputs already
    os.makedirs(corpus, exist_ok=True)
    if FORMAT in ("safetensors", "typed"):
        from safetensors.numpy import save

        blob = save({"a.w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.int8)}, metadata={"k": "v"})
    elif FORMAT == "npz":
        buffer = io.BytesIO()
        np.savez(buffer, **{"a/w": np.arange(6, dtype=np.float32)})
        blob = buffer.getvalue()
    elif FORMAT == "msgpack":
        import msgpack

        ext = msgpack.ExtType(1, msgpack.packb(([2], "float32", np.ones(2, np.float32).tobytes())))
        blob = msgpack.packb({"params": {"w": ext}})
    elif FORMAT == "eqx":
        buffer = io.BytesIO()
        np.save(buffer, np.ones(3, np.float32))
        blob = buffer.getvalue()
    else:
        blob = json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode()
    with open(os.path.join(corpus, "seed"), "wb") as f:
        f.write(blob)


if __name__ == "__main__":
    seeds()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
