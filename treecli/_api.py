"""The Python API: every public function takes any JAX pytree and gives back its own type.

The operations underneath (``_average``, ``_slice``, ``_edit``, ``_diff``) and the
CLI work on native dict / list / tuple trees; these functions convert at the
boundary (``_pytree``): an ``eqx.Module`` in, an ``eqx.Module`` out. Leaves that
came in memory (NumPy, JAX) come out in memory, of the same kind; leaves loaded
lazily from files stay lazy, so that ``save`` streams them.
"""

from __future__ import annotations

import dataclasses
import json
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Sequence

from treecli import _average, _configmerge, _devices, _diff, _edit, _merge, _pytree, _slice, _tree
from treecli._bytes import digest as _digest
from treecli._errors import UsageError
from treecli._keypath import format_keypath
from treecli.formats import Record, WriteOptions, open_checkpoint, save as _save
from treecli.formats._base import Checkpoint


# The metadata entry naming each typed PRNG key leaf's implementation, stored as its key data.
PRNG_KEYS_METADATA = "treecli.prng_keys"


def open(path: str | Path, format: str | None = None, *, like: Any = None,  # noqa: A001
         step: int | None = None, item: str | None = None) -> Checkpoint:
    """Open a checkpoint lazily; use as a context manager to close its files.

    ``like``, a template pytree, names an ``.eqx`` file's records by its key paths.
    ``step`` picks a CheckpointManager root's step (default: the latest), ``item`` one
    of its items (``"default"``, ``"state"``): the tree is then that item's alone.

    Returns:
        A :class:`~treecli.formats._base.Checkpoint` with ``tree`` (lazy leaves),
        ``metadata``, ``format``.

    Raises:
        FormatError: the file is not a valid checkpoint.
        UsageError: no such item.
    """
    checkpoint = open_checkpoint(path, format, like=None if like is None else _pytree.structure(like), step=step)
    if item is not None:
        checkpoint.tree = checkpoint.item(item)
    return checkpoint


def load(path: str | Path, format: str | None = None, *, like: Any = None, sharding: Any = None,
         lazy: bool | None = None, step: int | None = None, item: str | None = None, threads: int = _devices.READERS,
         buffer_bytes: int = _devices.BUFFER_BYTES, direct_io: bool = False) -> Any:
    """The tree of a checkpoint.

    Every JAX array is read shard by shard, each addressable shard from its own byte
    ranges (or TensorStore slice) straight onto its device, on several threads: no
    whole array is assembled on the host.

    Args:
        step: a CheckpointManager root's step (default: the latest).
        item: one item of a CheckpointManager step (``"default"``, ``"state"``); with
            ``like`` and a step of a single item, that item.
        like: a template pytree (a model, a ``TrainState``, ``jax.eval_shape``'s
            output): the result is the template's own type, its data leaves taken
            from the file by key path (by order for an ``.eqx`` file), shapes and
            dtypes checked. Its other leaves (functions, static fields) come from
            the template. A JAX leaf (an array, or a ``ShapeDtypeStruct``) gives its
            ``sharding``: a ``NamedSharding`` over a mesh, a ``SingleDeviceSharding``.
        sharding: without a template, where the arrays go: one ``jax.sharding.Sharding``
            for every array leaf, or a function of the key path (``"layers.0.w"``)
            returning one (``None``: the default device). The result is the file's
            own tree, of JAX arrays.
        lazy: lazy leaves (``np.asarray(leaf)`` or ``leaf[0]`` reads only what it
            needs) or arrays read now (of the template's kind: JAX arrays for JAX
            arrays and ``ShapeDtypeStruct``\\ s, else NumPy). Default: lazy without
            ``like``, arrays with it. Arrays go straight into ``jax.jit``.
        threads: reads onto devices at once (files are read in requests on all of them).
        buffer_bytes: the bytes of a read request, and of each host buffer an accelerator's
            copies go through (a ring of ``threads`` of them, reused: the host memory a
            load takes).
        direct_io: read past the page cache (``O_DIRECT``), neither needing nor filling it,
            where the file system takes it (else through it): for files read once, larger
            than the memory free for the cache.

    Raises:
        FormatError: the file is not a valid checkpoint.
        StructureError: the file does not fit ``like`` (differences listed).
        UsageError: a sharding that does not fit a leaf; both ``like`` and ``sharding``.

    Example:
        >>> model = treecli.load("model.safetensors", like=eqx.filter_eval_shape(make_model))
        >>> params = treecli.load("model.safetensors", sharding=NamedSharding(mesh, P()))
    """
    if like is not None and sharding is not None:
        raise UsageError("give like= (whose leaves carry their shardings) or sharding=, not both")
    if sharding is not None and lazy:
        raise UsageError("sharding= reads the arrays onto devices; it cannot be lazy")
    template = None if like is None else _pytree.structure(like)
    lazy = like is None if lazy is None else lazy
    checkpoint = open_checkpoint(path, format, like=template, step=step)
    items = checkpoint.info.get("items")
    if item is None and template is not None and items is not None and len(items) == 1:
        item = items[0]  # a template describes one item's tree, as CheckpointManager.restore does
    if item is not None:
        checkpoint.tree = checkpoint.item(item)
    settings = _devices.Settings(threads=threads, buffer_bytes=buffer_bytes, direct_io=direct_io)
    if template is not None:
        tree = _pytree.fill(template, checkpoint.tree, file=str(path), lazy=lazy, settings=settings)
    elif sharding is not None:
        tree = _pytree.onto_devices(checkpoint.tree, sharding, file=str(path), settings=settings)
        lazy = False
    elif lazy:
        tree = checkpoint.tree
    else:
        tree = _pytree.in_memory(checkpoint.tree, {})
    if not lazy:
        checkpoint.close()
    return tree


def save(
    tree: Any,
    path: str | Path,
    format: str | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    max_shard_size: int | None = None,
    force: bool = False,
    drop_unsupported: bool = False,
    verify: bool = False,
    record: bool = True,
) -> Path:
    """Write any pytree (lazy, NumPy or JAX leaves) atomically, streaming leaf by leaf.

    With ``record`` (the default), a format that keeps metadata (safetensors, GGUF, Orbax)
    holds treecli's record of the output: the root digest of its weights (``hash``), the
    treecli version, and ``treecli.save`` as the command; ``show`` prints it and ``verify``
    with no ``against`` checks the weights against it.

    With ``verify=True`` the finished temporary is opened by its own reader and every leaf
    checked bit for bit before it replaces anything, as ``treecli convert`` does (a local
    output: a bucket's upload is checked by its checksums).

    The format follows ``format``, else the extension of ``path``. A pytree's
    key paths name its leaves (``layers.0.weight``); an ``.eqx`` output keeps
    the order ``eqx.tree_serialise_leaves`` writes, so Equinox reads it back.
    Python numbers are stored as they are in Orbax and msgpack, and as 0-d arrays
    elsewhere (``3`` as int64, as Equinox does). A typed PRNG key array (NNX's
    ``Rngs``) is stored as its key data (uint32), its implementation recorded in the
    metadata where the format keeps any (``treecli.prng_keys``); ``load(like=)`` makes
    it a key again.

    Raises:
        UsageError: ``path`` exists and ``force`` is false.
        TreecliError: the format cannot hold some leaves (``drop_unsupported=True``
            drops them with a warning).
    """
    native, structure = _pytree.to_native(tree)
    metadata = dict(metadata or {})
    keys = {format_keypath(kp): leaf.key_impl for kp, leaf in _tree.flatten(native)
            if isinstance(leaf, _pytree.KeyData)}
    if keys:  # (where the format keeps metadata: safetensors)
        metadata.setdefault(PRNG_KEYS_METADATA, json.dumps(keys, sort_keys=True))
    options = WriteOptions(metadata=metadata, max_shard_size=max_shard_size,
                           drop_unsupported=drop_unsupported, like=structure,
                           record=Record("treecli.save (Python)") if record else None)
    return _save(native, path, format=format, options=options, force=force, verify=verify)


def average(trees: Sequence[Any], weights: Sequence[float] | None = None, **options: Any) -> tuple[Any, Any]:
    """The weighted average of pytrees with the same key paths, shapes and dtypes,
    as the first one's type.

    Options (``names``, ``normalize``, ``dtype``, ``non_float``) and the report
    are those of ``treecli._average.average``: float leaves are averaged in
    float64 and cast back to their dtype; integer, bool and non-array leaves
    that differ are copied from the last input (``non_float="first"``, or
    ``"error"`` to refuse).

    Example:
        >>> soup, report = treecli.average([model_a, model_b], [0.3, 0.7])
    """
    natives, structures = zip(*(_pytree.to_native(t) for t in trees)) if trees else ((), ())
    result, report = _average.average(list(natives), None if weights is None else list(weights), **options)
    return _finish(result, natives, structures[0]), report


def merge(trees: Sequence[Any] | None = None, method: str | None = None, *, base: Any = None, config: Any = None,
          models: dict[str, Any] | None = None, **options: Any) -> tuple[Any, Any]:
    """Merge pytrees with mergekit's methods (``treecli.merge_methods``), as the first
    one's type; options (``weights``, ``density``, ``lambda_``, ``t``, ``gamma``,
    ``epsilon``, ``seed``, ``normalize``, ``rescale``, ``parameters``, ...) and the report
    are those of ``treecli._merge.merge``.

    Or run a mergekit config (``config``: a path to its YAML, or the parsed mapping): its
    models are the trees in ``models`` (by the names the config gives them), the others
    opened from their paths; options ``seed``, ``non_float``, ``layer_pattern``.

    Example:
        >>> merged, report = treecli.merge([ft_a, ft_b], "ties", base=base, density=0.5)
        >>> merged, report = treecli.merge(config="merge.yml")
    """
    if config is not None:
        if trees is not None or method is not None or base is not None:
            raise UsageError("a config names the method, the base and the models; give config alone "
                             "(models= maps its names to trees)")
        parsed = merge_config_file(config) if isinstance(config, (str, PathLike)) else _configmerge.load_config(config)
        given = dict(models or {})
        natives = {name: _pytree.to_native(tree)[0] if name in given else open(name).tree
                   for name, tree in ((n, given.get(n)) for n in parsed.models())}
        return _configmerge.merge_config(parsed, natives, **options)
    if trees is None or method is None:
        raise UsageError("give the trees and the method, or a mergekit config")
    natives, structures = zip(*(_pytree.to_native(t) for t in trees)) if trees else ((), ())
    native_base, base_structure = _pytree.to_native(base) if base is not None else (None, None)
    result, report = _merge.merge(list(natives), method, base=native_base, **options)
    if base is None:
        return _finish(result, natives, structures[0] if structures else None), report
    return _finish(result, (native_base, *natives), base_structure), report


def merge_config_file(path: str | PathLike) -> Any:
    """A mergekit config file, checked: a regular file (never a FIFO or a device, which would
    hang or never end) of at most 1 MiB of UTF-8, parsed as YAML plain data."""
    from treecli._bytes.local import read_text
    from treecli._mergeconfig import MAX_CONFIG_BYTES, parse

    try:
        text = read_text(path, MAX_CONFIG_BYTES, "merge config")
    except OSError as e:
        raise UsageError(f"cannot read the config: {e.strerror or e}", file=str(path)) from None
    return _configmerge.load_config(parse(text, str(path)), where=str(path))


def slice_tree(tree: Any, rules: Sequence[Any]) -> tuple[Any, Any]:
    """Index the leaves of any pytree by rules (``"layers.*.weight=0"``, ``":1"``); see
    ``treecli._slice.slice_tree``. Returns the tree, of its own type, and a report."""
    native, structure = _pytree.to_native(tree)
    result, report = _slice.slice_tree(native, list(rules))
    return _finish(result, [native], structure), report


def edit(tree: Any, edits: _edit.Edits) -> tuple[Any, Any]:
    """Rename, delete, set, cast and scale leaves of any pytree by key path; see
    ``treecli._edit.edit``. A result whose key paths changed (a rename or delete)
    comes back as nested dicts: the original type cannot hold them."""
    from treecli.formats import open_array

    native, structure = _pytree.to_native(tree)
    if edits.open_array is None:
        edits = dataclasses.replace(edits, open_array=open_array)
    result, report = _edit.edit(native, edits)
    return _finish(result, [native], structure), report


def cast(tree: Any, dtype: str) -> tuple[Any, Any]:
    """Every floating-point leaf of any pytree as ``dtype`` (lazily, rounding to nearest
    even; integer, bool and other leaves as they are): what ``treecli convert --dtype``
    does. The report's ``warnings()`` name values outside the dtype's range (become inf),
    found as the leaves are read.

    Example:
        >>> half, report = treecli.cast(treecli.load("model.safetensors"), "bfloat16")
    """
    from treecli import _combine, _dtypes

    native, structure = _pytree.to_native(tree)
    report = _combine.AverageReport()
    result = _combine.cast_floats(native, _dtypes.parse(dtype), report)
    return _finish(result, [native], structure), report


def quantize(tree: Any, kind: str, tensor_types: dict[str, str] | None = None) -> Any:
    """Any pytree with its float weights quantized under ``kind``, llama-quantize's mix
    (``q4_k_m``, ``q5_k_m``, ``q3_k_s``/``m``/``l``, ``q4_k_s``, ``q5_k_s``, ``q2_k``,
    ``q6_k``, ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``, ``iq4_nl``, ``iq4_xs``; ``q3_k``,
    ``q4_k`` and ``q5_k``
    its aliases of the ``_m`` mixes): each tensor's type by its llama.cpp name and layer,
    as llama.cpp's quantizer picks it, where it would quantize (two or more dimensions,
    rows of whole blocks, not a norm). ``tensor_types`` maps regexes to types (``{"attn_v":
    "q8_0"}``): a tensor whose name one is found in takes the first such one's type. Saved
    into a ``.gguf`` file they are written quantized, and read they hold the values a GGUF
    reader gets back. What ``treecli convert --dtype q4_k_m`` does.

    Example:
        >>> treecli.save(treecli.quantize(treecli.load("model.safetensors"), "q8_0"), "model.gguf")
    """
    from treecli.formats import quantized

    native, structure = _pytree.to_native(tree)
    return _finish(quantized(native, kind, list((tensor_types or {}).items())), [native], structure)


def transform(tree: Any, steps: Sequence[Any], params: dict[str, Any] | None = None, *,
              reverse: bool = False) -> Any:
    """Any pytree through reversible operations by name (``treecli.Rename``, ``Stack``,
    ``Unstack``, ``Concat``, ``Split``, ``Transpose``, ``Rotary``, ``Unflatten``,
    ``Flatten``), each leaf made chunk by chunk when it is read or written; ``reverse``
    runs their inverses backwards. ``params`` are the hyper-parameters sizes may name
    (an HF ``config.json``'s). The result is nested dicts of names split at ``.``.

    Example:
        >>> scanned = treecli.transform(tree, [treecli.Stack("model.layers.{i}.(.+)", "layers.\\1")])
    """
    from treecli import _transforms

    native, _ = _pytree.to_native(tree)
    steps = _transforms.inverted(steps) if reverse else list(steps)
    return _transforms.tree_of(_transforms.applied(steps, _transforms.items_of(native), params or {}))


def recipe(checkpoint: Checkpoint | str | PathLike, name: str, *, reverse: bool = False) -> Any:
    """A checkpoint made by a recipe (``llama.cpp``, ``scanned``, or a YAML file's): its
    ``tree``, the ``metadata`` to write (``metadata_of(tree)``) and the companion ``files``
    of an output directory (name -> bytes). What ``treecli convert --recipe`` writes."""
    from treecli import recipes

    if not isinstance(checkpoint, Checkpoint):
        checkpoint = open_checkpoint(checkpoint)
    return recipes.convert(checkpoint, recipes.named(name), reverse=reverse)


def diff(a: Any, b: Any, **options: Any) -> _diff.DiffResult:
    """Compare two pytrees (or checkpoints' trees) leaf by leaf, by key-path text:
    ``layers.0.weight`` of a module matches ``layers.0.weight`` of a safetensors
    file. Options: ``rtol``, ``atol``, ``where`` (see ``treecli._diff.diff``)."""
    def native(tree: Any) -> Any:  # a Python number compares with the 0-d array it is saved as
        return _pytree.numbers_as_arrays(_pytree.to_native(tree)[0])

    return _diff.diff(native(a), native(b), **options)


def hash(source: Any, *, where: str | Sequence[str] | None = None) -> _digest.Digests:  # noqa: A001
    """The digests of a checkpoint's (a path or URL) or a pytree's weights: one per leaf, over
    its dtype, shape and bytes (a quantized tensor's stored blocks, under its type), and the
    root's over them, the same whatever the format, sharding or tensor order; a JAX array
    sharded over devices hashes as the whole array. What ``treecli hash`` prints.

    Example:
        >>> treecli.hash("model.safetensors").root == treecli.hash("model.gguf").root
    """
    selection = [where] if isinstance(where, str) else list(where or [])
    if isinstance(source, (str, PathLike)):
        with open_checkpoint(source) as checkpoint:
            return _digest.digests(_digest.selected(checkpoint.tree, selection))
    return _digest.digests(_digest.selected(_pytree.to_native(source)[0], selection))


def verify(source: Any, against: Any = None, *, where: str | Sequence[str] | None = None) -> _digest.Verification:
    """Whether ``source`` (a checkpoint's path or URL, or a pytree) holds the weights
    ``against`` holds: a manifest (``treecli hash -o``'s file, or a :class:`Digests`), a
    checkpoint or a pytree; the key paths whose leaves differ, are missing or extra. With no
    ``against``, the root digest of the record the checkpoint keeps of what treecli wrote
    (``unlike_record`` where it differs). What ``treecli verify`` reports.

    Example:
        >>> assert treecli.verify("model.gguf", "weights.blake3.json").equal
        >>> assert treecli.verify("model.gguf").equal

    Raises:
        UsageError: no ``against``, and ``source`` holds no record (or ``where`` is given).
    """
    if against is None:
        return _against_record(source, where)
    found = hash(source, where=where)
    manifest = None
    if isinstance(against, _digest.Digests):
        expected = against
    else:
        manifest = read_manifest(against) if isinstance(against, (str, PathLike)) else None
        expected = manifest if manifest is not None else hash(against, where=where)
    if isinstance(against, _digest.Digests) or manifest is not None:  # (a manifest of the whole)
        expected = _digest.restricted(expected, [where] if isinstance(where, str) else list(where or []))
    return _digest.compare(found, expected)


def _against_record(source: Any, where: Any) -> _digest.Verification:
    """``source``'s weights against the root digest its record holds."""
    from treecli.formats import RECORD_KEY, parsed_record

    if where or not isinstance(source, (str, PathLike)):
        raise UsageError("verify without against checks a checkpoint (a path or URL) whole against its own record")
    with open_checkpoint(source) as checkpoint:
        record, why = parsed_record(checkpoint.metadata[RECORD_KEY]) if RECORD_KEY in checkpoint.metadata \
            else (None, "treecli did not write it")
        if record is None:
            raise UsageError(f"no record to verify against: {why}", file=str(source))
        return _digest.Verification(unlike_record=_digest.digests(checkpoint.tree).root != record["root"])


def read_manifest(path: str | PathLike) -> _digest.Digests | None:
    """The manifest ``treecli hash -o`` wrote at ``path``, checked (its root the one its leaves
    give); None where ``path`` is no manifest (a checkpoint, a URL).

    Raises:
        FormatError: a manifest that is damaged or was changed.
    """
    from treecli._bytes.local import open_regular, read_text

    path = Path(path)
    if not path.is_file():
        return None
    with open_regular(path) as f:
        head = f.read(4096)
    if not _digest.is_manifest(head):
        return None
    return _digest.parse_manifest(read_text(path, _digest.MANIFEST_BYTES, "digest manifest"), str(path))


def at(tree: Any, where: str | list[str], replace: Any = _edit.MISSING,
       replace_fn: Callable[[Any], Any] | None = None) -> Any:
    """``eqx.tree_at`` with key-path strings (treecli's ``layers.0.bias`` or JAX's
    ``.layers[0].bias``): a new tree with the nodes at ``where`` replaced.

    Any node can be named, leaf or subtree (a whole ``eqx.nn.Linear``), and is
    rebuilt through its own type without calling ``__init__``.

    Args:
        where: a key path, or a list of them (each must name one existing node).
        replace: the new value (a list of values, one per key path, when ``where`` is a list).
        replace_fn: or a function of the old node (exactly one of the two).

    Raises:
        KeyPathError: a key path that names no node (closest named) or several.

    Example:
        >>> treecli.at(model, "layers.0.bias", replace_fn=jnp.zeros_like)
    """
    if _pytree.is_native(tree):
        return _edit.at(tree, where, replace, replace_fn)
    wheres, values = _edit.pair_up(where, replace, replace_fn)
    for text, value in zip(wheres, values):
        _, jax_path, old = _pytree.find_one(tree, text)
        tree = _pytree.replace(tree, jax_path, replace_fn(old) if replace_fn else value)
    return tree


def jax_keypath(tree: Any, keypath: str) -> tuple:
    """The JAX key path (``GetAttrKey``, ``SequenceKey``, ``DictKey`` entries) of the one
    node a treecli key path names in ``tree``; ``treecli.format_keypath`` goes back.

    Example:
        >>> treecli.jax_keypath(model, "layers.0.bias")
        (GetAttrKey(name='layers'), SequenceKey(idx=0), GetAttrKey(name='bias'))
    """
    return _pytree.find_one(tree, keypath)[1]


def _finish(result: Any, inputs: Sequence[Any], structure: _pytree.Structure | None) -> Any:
    """In memory in, in memory out; then the first input's own type."""
    if inputs and not any(_pytree.is_lazy(t) for t in inputs):
        result = _pytree.in_memory(result, inputs[0])
    return structure.rebuild(result) if structure is not None else result


