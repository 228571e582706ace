"""Coverage-guided fuzzing of treecli's readers with atheris (run by hand, not in CI).

    pip install atheris
    python fuzz/fuzz_formats.py safetensors -max_total_time=600 fuzz/corpus/safetensors
    python fuzz/fuzz_formats.py npz|msgpack|index|eqx -max_total_time=600

The only allowed outcome for any input is treecli's own error class; and for
safetensors, whatever treecli accepts the reference (`safetensors.deserialize`)
must accept with the same bytes. Anything else is a crash atheris reports,
with the input saved as `crash-*` (commit minimized ones as regression tests).
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
    from treecli import _leaf, _tree
    from treecli._errors import TreecliError

FORMAT = sys.argv.pop(1) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "safetensors"
SUFFIX = {"safetensors": ".safetensors", "npz": ".npz", "msgpack": ".msgpack", "eqx": ".eqx",
          "index": "model.safetensors.index.json"}[FORMAT]
WORKDIR = tempfile.mkdtemp(prefix="treecli-fuzz-")
PATH = os.path.join(WORKDIR, SUFFIX if FORMAT == "index" else "input" + SUFFIX)
if FORMAT == "index":  # a real shard for the index to point at
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, os.path.join(WORKDIR, "model-00001-of-00001.safetensors"))


def read_everything(path: str) -> dict:
    # The differential check is against the safetensors reference: read the bytes as
    # safetensors even when they look like another format (content wins over names).
    with treecli.open(path, format="safetensors" if FORMAT == "safetensors" else None) as checkpoint:
        return {".".join(map(str, kp)): _leaf.as_leaf(x).read().tobytes()
                for kp, x in _tree.flatten(checkpoint.tree) if _leaf.is_array(x)}


def test_one_input(data: bytes) -> None:
    with open(PATH, "wb") as f:
        f.write(data)
    try:
        ours = read_everything(PATH)
    except TreecliError:
        return
    if FORMAT == "safetensors":
        from safetensors import deserialize

        reference = {name: bytes(info["data"]) for name, info in deserialize(data)}
        assert ours == reference, "treecli accepted a file and read other bytes than the reference"


def seeds() -> None:
    """Write a few valid inputs to start from, if the corpus directory given is empty."""
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if not corpus or (os.path.isdir(corpus) and os.listdir(corpus)):
        return
    os.makedirs(corpus, exist_ok=True)
    if FORMAT == "safetensors":
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
