"""Writing Orbax checkpoints: here with Orbax's own PyTree handler (which needs the whole
tree in memory), into a bucket file by file with the commit markers last."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from treecli import _leaf, _memory, _tree
from treecli._errors import TreecliError, UsageError, in_cli
from treecli._keypath import format_keypath
from treecli.formats._base import WriteOptions
from treecli.formats._orbax_layout import OWNED, param_name
from treecli.formats._record import KEY

_MEMORY_FACTOR = 4


# What Orbax's PyTree handler stores besides arrays, as Orbax stores them.
_PLAIN_VALUES = (str, int, float, bool, type(None))
# Every entry Orbax's writers put in a checkpoint directory: `-o DIR --force` and
# --in-place may replace a directory only when it holds nothing else.


def write(tree: Any, target: Path, options: WriteOptions) -> None:
    """Save with Orbax's PyTree handler, which needs the whole tree in memory."""
    import orbax.checkpoint as ocp

    data = _in_memory(_storable(tree, str(target), options), options)
    record = options.record
    # target is the empty directory the atomic writer made inside its locked holder;
    # Orbax replaces it (force), keeping its own temporaries in the holder too.
    with _orbax_errors(), ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(target), data, force=True,
                          custom_metadata={KEY: record.as_json()} if record is not None else None)
    if record is not None:  # (where its roots go, once known: Orbax's metadata file, in the temporary)
        record.wrote_head(target / _CHECKPOINT_METADATA, (target / _CHECKPOINT_METADATA).read_bytes())


def write_global(tree: Any, target: Path, options: WriteOptions, replace: bool) -> None:
    """Save global arrays with every process of the program: Orbax writes each process's
    shards (its own ``ocdbt.process_N``), commits once all have, and makes the save
    atomic itself (a temporary directory, renamed by the primary process)."""
    import orbax.checkpoint as ocp

    data = _in_memory(_storable(tree, str(target), options), options)
    with _orbax_errors(), ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(target), data, force=replace)


def _in_memory(tree: Any, options: WriteOptions) -> Any:
    """What Orbax's handler is given: JAX arrays as they are, every other array read."""
    import numpy as np

    needed = _tree.array_bytes(tree)
    available = _memory.available()
    # Measured: writing 0.5 GiB peaked at 1.7 GB (our arrays, Orbax's and tensorstore's buffers, jax).
    if available is not None and needed * _MEMORY_FACTOR > available:
        raise TreecliError(f"Orbax's writer needs the whole output in memory, about {_MEMORY_FACTOR}x its "
                           f"{needed / 2**30:.1f} GiB, but {available / 2**30:.1f} GiB is available; "
                           "write safetensors instead (-o out.safetensors)")

    jax = sys.modules.get("jax")

    def materialize(keypath: tuple, x: Any) -> Any:
        if jax is not None and isinstance(x, jax.Array):
            # Orbax writes a JAX array itself, each shard from its device, a replicated one once
            if options.progress:
                options.progress(x.nbytes)
            return x
        if _leaf.is_array(x):
            leaf = _leaf.as_leaf(x)
            array = leaf.read()
            if options.progress:
                options.progress(leaf.nbytes)
            return np.asarray(array)
        return x

    return _tree.map_leaves(materialize, tree)


@contextlib.contextmanager
def _orbax_errors() -> Iterator[None]:
    """Orbax's and TensorStore's failures (a full disk is ``RESOURCE_EXHAUSTED`` or
    ``OUT_OF_RANGE`` with an errno inside) as one line, and absl's logged tracebacks of
    them kept off the terminal: the error is treecli's to report."""
    import logging

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    except TreecliError:
        raise
    except Exception as e:
        code = re.search(r"os_error_code='?(\d+)", str(e))
        reason = os.strerror(int(code.group(1))) if code else re.sub(r"\s+", " ", str(e))[:200]
        raise TreecliError(f"Orbax could not write it: {reason}") from e
    finally:
        absl.setLevel(level)


# What marks an Orbax checkpoint finished: uploaded after every other file, and removed
# from a checkpoint being replaced before any of its files change. commit_success.txt
# is how Orbax itself marks a finished save in a bucket.
_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_MARKERS = (_CHECKPOINT_METADATA, "commit_success.txt")
_UPLOADS_IN_FLIGHT = 8


def write_remote(tree: Any, url: str, options: WriteOptions, replace: bool) -> None:
    """Orbax writes the checkpoint here, in a temporary directory; then TensorStore uploads
    its files, the commit markers last, and removes what is left of a replaced one."""
    import tempfile

    import tensorstore as ts

    from treecli._bytes import kvstore
    from treecli.formats._folder import BucketFolder

    folder = BucketFolder.open(url)
    existing = folder.keys
    if existing:
        if not replace:
            raise UsageError("output exists (add --force to replace it)", file=url)
        foreign = sorted(top for top in set(map(_top, existing)) if not OWNED.fullmatch(top))
        if foreign:
            raise UsageError(f"holds {', '.join(foreign[:5])}, which Orbax's writer does not write; refusing to "
                             "replace it", file=url)
    with tempfile.TemporaryDirectory(prefix="treecli-orbax-") as tmp:
        built = Path(tmp) / "checkpoint"
        write(tree, built, options)
        files = sorted(p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file())
        try:
            store = ts.KvStore.open(folder.kvstore()).result()
            for marker in _MARKERS:  # the old checkpoint stops counting as finished first
                if marker in existing:
                    store.delete_range(ts.KvStore.KeyRange(marker, marker + "\0")).result()
            body = [f for f in files if f not in _MARKERS]
            for start in range(0, len(body), _UPLOADS_IN_FLIGHT):
                batch = body[start : start + _UPLOADS_IN_FLIGHT]
                for future in [store.write(name, (built / name).read_bytes()) for name in batch]:
                    future.result()
            for marker in _MARKERS:
                data = (built / marker).read_bytes() if marker in files else b"committed by treecli\n"
                store.write(marker, data).result()
            for stale in sorted(existing - set(files) - set(_MARKERS)):
                store.delete_range(ts.KvStore.KeyRange(stale, stale + "\0")).result()
        except TreecliError:
            raise
        except Exception as e:
            raise kvstore.describe(e, url) from None


def _top(key: str) -> str:
    return key.split("/", 1)[0]


def _storable(tree: Any, file: str, options: WriteOptions) -> Any:
    """The tree Orbax will be given: every leaf one it can store under a name of its own.

    Orbax names each array by its key path joined with ``.``: two key paths that
    join alike (``["a.b"]`` and ``a.b``) would share one parameter, so that is an
    error. Zero-size arrays and values Orbax cannot store are refused, or dropped
    with ``drop_unsupported``.
    """
    items = _tree.flatten(tree, nones=True)  # Orbax stores None: it stays where it is
    seen: dict[str, tuple] = {}
    for keypath, _ in items:
        name = param_name(keypath)
        if name in seen:
            raise TreecliError(f"key paths {format_keypath(seen[name])} and {format_keypath(keypath)} would both "
                               f"be stored as the Orbax parameter {name!r}; rename one first"
                               + in_cli(" (treecli edit --rename)"), file=file)
        seen[name] = keypath
    unsupported = []
    for keypath, x in items:
        if _leaf.is_array(x):
            if _leaf.as_leaf(x).size == 0:
                unsupported.append((keypath, f"{_tree.describe_leaf(x)}: zero-size"))
        elif not isinstance(x, (*_PLAIN_VALUES, dict, list, tuple)):  # empty containers are leaves here
            unsupported.append((keypath, type(x).__name__))
    if not unsupported:
        return tree
    options.refuse_or_drop([f"{format_keypath(kp)} ({what})" for kp, what in unsupported], "Orbax", file)
    dropped = {kp for kp, _ in unsupported}
    return _tree.unflatten([(kp, x) for kp, x in items if kp not in dropped], template=tree)
