"""The format registry: pick a format for a file, open it, write a tree.

Each format is a subclass of :class:`~treecli.formats._base.Format` in a module of
its own, listed in ``FORMATS`` and imported only when needed (so that opening a
safetensors file never imports orbax). To add a format, write that module and add
one line here (CONTRIBUTING.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import urllib.parse
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Sequence

from treecli import _tree
from treecli._errors import FormatError, TreecliError, UsageError, option
from treecli.formats._mixes import ALIASES, MIXES
from treecli.formats import _foreign
from treecli.formats._base import WRITES, Checkpoint, Format, NotInFolder, Origin, WriteOptions
from treecli.formats._record import KEY as RECORD_KEY, Record, parsed as parsed_record

# Each format's class, as "module:Class". Order matters only for sniffing a file: the
# first format whose sniff accepts wins (a directory is tried in ``DIRECTORIES``' order).
FORMATS = {
    "safetensors": "treecli.formats.safetensors:SafetensorsFormat",
    "npz": "treecli.formats.npz:NpzFormat",
    "msgpack": "treecli.formats.msgpack:MsgpackFormat",
    "npy": "treecli.formats.npy:NpyFormat",
    "eqx": "treecli.formats.eqx:EqxFormat",
    "orbax": "treecli.formats.orbax:OrbaxFormat",
    "torch": "treecli.formats.torch:TorchFormat",
    "gguf": "treecli.formats.gguf:GgufFormat",
    "dcp": "treecli.formats.dcp:DcpFormat",
}


@functools.cache
def get(name: str) -> Format:
    """The format registered as ``name`` (its class imported on first use)."""
    if name not in FORMATS:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    module, _, cls = FORMATS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


# What a GGUF output quantizes float leaves to (``convert --dtype``): llama.cpp's mixes (each
# plain type the mix of that type), as llama-quantize names them.
GGUF_QUANTIZATIONS = tuple(MIXES) + tuple(ALIASES)


def quantized(tree: Any, kind: str, overrides: Sequence[tuple[str, str]] = ()) -> Any:
    """``tree`` with each float leaf quantized as llama.cpp's quantizer quantizes it under
    ``kind`` (one of ``GGUF_QUANTIZATIONS``: a mix such as ``q4_k_m`` that picks each
    tensor's type by its llama.cpp name and layer, ``_mixes``, or a plain type's) where it
    would quantize it (two or more dimensions, rows of whole blocks or a fallback type's,
    not a norm), ``overrides`` ((regex, type) pairs, the first found in a name) before the
    mix; the rest as it is: written quantized into a GGUF output, and read as the values a
    GGUF reader gets back (quantized, then dequantized) anywhere.

    Raises:
        UsageError: a kind GGUF's writer does not quantize to, an override's bad regex or type.
    """
    from treecli import _dtypes, _leaf
    from treecli.formats import _mixes, gguf

    kind = kind.lower()
    if kind not in GGUF_QUANTIZATIONS:
        raise UsageError(f"cannot quantize to {kind!r}; choose one of {', '.join(GGUF_QUANTIZATIONS)}")
    choose = _mixes.chooser({".".join(map(str, keypath)): tuple(leaf.shape) for keypath, leaf in _tree.flatten(tree)
                             if _leaf.is_array(leaf)}, kind, overrides)
    mix = ALIASES.get(kind, kind)

    def leaf(keypath: tuple, x: Any) -> Any:
        if not _leaf.is_array(x) or not _dtypes.is_float(_leaf.as_leaf(x).dtype_name):
            return x
        chosen = choose(".".join(map(str, keypath)))
        return x if chosen is None else gguf.quantizing(_leaf.as_leaf(x), chosen, mix=mix)

    return _tree.map_leaves(leaf, tree)


GGUF_ARRAY = 9  # a GGUF metadata value's type number for an array (gguf.GGUFValueType.ARRAY)


def gguf_value(kind: int, value: Any) -> Any:
    """A GGUF metadata value of GGUF type ``kind`` (``gguf.GGUFValueType``; an array's
    ``value`` is its items' type and the items), as a GGUF output writes it."""
    from treecli.formats._gguf_layout import MetaValue

    return MetaValue(kind, value)


def stored_type(leaf: Any) -> str:
    """What a leaf is written as: its dtype's name, or a GGUF quantization's (``Q8_0``)."""
    from treecli import _leaf
    from treecli.formats._gguf_layout import QuantizedLeaf, type_name

    return type_name(leaf.kind) if isinstance(leaf, QuantizedLeaf) else _leaf.as_leaf(leaf).dtype_name


def quantization_errors(tree: Any, *, requantized: bool = False) -> dict[str, tuple[int, float, float]]:
    """For each type ``quantized`` wrote ``tree``'s leaves in (``requantized``: a GGUF
    output quantized them in their own type again, ``held_by``): how many tensors, and the
    largest error in quantization steps and in value, as measured when their blocks were
    made (empty before they are written, and where nothing was quantized)."""
    found: dict[str, tuple[int, float, float]] = {}
    for leaf in _tree.leaves(tree):
        error = getattr(leaf, "error", None)
        if isinstance(error, tuple) and getattr(leaf, "requantized", False) == requantized:
            count, steps, value = found.get(leaf.stored_dtype, (0, 0.0, 0.0))
            found[leaf.stored_dtype] = (count + 1, max(steps, error[0]), max(value, error[1]))
    return found


def unrequantized(tree: Any) -> dict[tuple[str, str], int]:
    """How many leaves made from quantized tensors a GGUF output writes F32, by type and why
    (``formats.gguf.unrequantized``)."""
    from treecli.formats import gguf

    return gguf.unrequantized(tree)


def open_array(path: str | Path) -> Any:
    """The one array of a ``.npy`` file as a lazy leaf (``edit --set KEYPATH=@file.npy``)."""
    from treecli.formats import npy

    return npy.open_array(Path(path))


def detect(path: Path, step: int | None = None) -> Format:
    """The format of a file, from its bytes, then its extension; of a directory, as every
    folder's is found wherever it lies (``detect_folder``).

    Raises:
        UsageError: the path does not exist.
        FormatError / RefusedError: no format accepts it (the message says why each refused).
    """
    path = Path(path)
    if not path.exists():
        raise UsageError("no such file or directory", file=str(path))
    _refuse_special(path)
    if path.is_dir():
        from treecli.formats._folder import LocalFolder

        return detect_folder(LocalFolder(path), step)
    reasons = []
    for name in FORMATS:
        fmt = get(name)
        try:
            reason = fmt.sniff(path)
        except Exception as e:  # a sniff must never crash detection: it just says no
            reason = f"{type(e).__name__}: {e}"
        if reason is None:
            return fmt
        reasons.append(f"{name}: {reason}")
    # Before the extension decides: say what the file really is (a pickle, an LFS pointer, ...).
    _foreign.check(path)
    # Nothing recognised the bytes: the extension decides, so that a damaged
    # file gets its format's precise error ("truncated", ...), not a shrug.
    for name in FORMATS:
        fmt = get(name)
        if any(path.name.endswith(ext) for ext in fmt.extensions):
            return fmt
    raise FormatError(f"not a checkpoint treecli can read (file; {'; '.join(reasons)})", file=str(path))


URL_SCHEMES = ("http://", "https://", "hf://", "s3://", "gs://")  # read by byte ranges (_remote)
BUCKET_SCHEMES = ("s3://", "gs://")  # written too


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.startswith(URL_SCHEMES)


def open_checkpoint(path: str | Path, format: str | None = None, **options: Any) -> Checkpoint:
    """Open a checkpoint lazily: metadata is read now, array data only when asked.

    ``path`` may be a URL: ``https://...``, ``http://...`` or ``hf://ORG/REPO``
    (remote safetensors, read by byte ranges), ``s3://BUCKET/KEY`` or
    ``gs://BUCKET/KEY`` (safetensors, HF layouts and Orbax checkpoints).
    """
    if is_url(path):
        url = path

        def opening() -> Checkpoint:
            return _open_url(url, format, options.get("step"))
        name = format or "a remote checkpoint"
    else:
        path = Path(path)
        fmt = get(format) if format else detect(path, options.get("step"))
        if format:
            if not path.exists():
                raise UsageError("no such file or directory", file=str(path))
            _refuse_special(path)

        def opening() -> Checkpoint:
            checkpoint = fmt.open(path, **options)
            if path.is_dir():
                from treecli.formats._folder import LocalFolder

                _name_the_model(checkpoint, fmt, LocalFolder(path))
            return checkpoint
        name = fmt.name
    try:
        checkpoint = opening()
    except TreecliError as e:
        raise e.with_file(str(path))
    except Exception as e:
        # The safety net: whatever a damaged file makes a library raise (zipfile's
        # NotImplementedError, struct.error, ...) is one clean line; --debug shows the chain.
        raise FormatError(f"cannot read it as {name}: {type(e).__name__}: {str(e)[:200]}",
                          file=str(path)) from e
    if checkpoint.origin is None and isinstance(path, Path) and path.is_file():  # the single-file formats
        checkpoint.origin = Origin("file", path, [path])
    return checkpoint


def _open_url(url: str, format: str | None, step: int | None) -> Checkpoint:
    """A checkpoint at a URL: the file it names, opened by its format from its folder, or
    the checkpoint in the folder it names (``open_folder``)."""
    from treecli.formats import _remote  # urllib only when a URL is given

    # Which format each file name a URL may end in is read by (the longest end first).
    ends = sorted(((end, name) for name in FORMATS for end in get(name).remote_extensions),
                  key=lambda pair: -len(pair[0]))
    folder, entry = _remote.locate(url, tuple(end for end, _ in ends), format, step)
    if entry is None:
        checkpoint = open_folder(folder, format, step)
        _name_the_model(checkpoint, get(checkpoint.format), folder)
        return checkpoint
    named = format or next(name for end, name in ends if entry.endswith(end))
    checkpoint = get(named).open_folder(folder, step=step, entry=entry)
    checkpoint.file = url  # (as the user wrote it: a query string and all)
    return checkpoint


def _name_the_model(checkpoint: Checkpoint, fmt: Format, folder: Any) -> None:
    """An HF directory's model, from the ``config.json`` beside its weights wherever it lies,
    read when asked (``Checkpoint.described_model``); and the folder of any directory
    checkpoint, where a recipe reads the files beside its weights."""
    checkpoint.folder = folder
    if checkpoint.model is None and fmt.hf_directories:
        from treecli.formats import _model

        checkpoint.model = lambda: _model.of_folder(folder)


# The order in which a directory's format is recognised, the same wherever it lies (a
# local directory, a bucket prefix, an HTTP directory or Hub repository): an HF
# directory's safetensors weights, a DCP checkpoint, an HF directory's PyTorch weights
# (transformers' own preference after safetensors), its Flax weights, an Orbax checkpoint.
DIRECTORIES = ("safetensors", "dcp", "torch", "msgpack", "orbax", "gguf")


def detect_folder(folder: Any, step: int | None = None) -> Format:
    """The format of the checkpoint in a folder, the first of ``DIRECTORIES`` that finds
    one (with ``step``, Orbax: only it has steps).

    Raises:
        FormatError: none does (each says why not).
    """
    if step is not None:  # (Orbax's own opening says what a folder without that step holds)
        return get("orbax")
    reasons = []
    for fmt in map(get, DIRECTORIES):
        reason = fmt.in_folder(folder)
        if reason is None:
            return fmt
        reasons.append(f"{fmt.name}: {reason}")
    raise _nothing_in(folder, reasons)


def open_folder(folder: Any, format: str | None = None, step: int | None = None) -> Checkpoint:
    """The checkpoint in a folder anywhere, by ``format``, else by the first of
    ``DIRECTORIES`` that finds one. A folder that cannot be listed (HTTP) is asked for
    files by name: where a format only presumed its file (a repository's
    ``model.safetensors``) and it is not there, the next format is tried."""
    if format is not None or step is not None:
        return get(format or "orbax").open_folder(folder, step=step)
    reasons = []
    for fmt in map(get, DIRECTORIES):
        reason = fmt.in_folder(folder)
        if reason is None:
            try:
                return fmt.open_folder(folder, step=step)
            except NotInFolder as e:
                reason = e.message
        reasons.append(f"{fmt.name}: {reason}")
    raise _nothing_in(folder, reasons)


def _nothing_in(folder: Any, reasons: list[str]) -> FormatError:
    how = "" if folder.listable else (" (an HTTP directory cannot be listed: name a file, or a CheckpointManager "
                                      "step with --step)")
    return FormatError(f"no checkpoint here: not a checkpoint treecli can read ({'; '.join(reasons)}){how}",
                       file=folder.name)


def _refuse_special(path: Path) -> None:
    """A checkpoint is a regular file or a directory: a FIFO or a device is refused before any open."""
    import os
    import stat

    from treecli._bytes.local import refuse_special

    mode = os.stat(path).st_mode
    if not stat.S_ISDIR(mode):
        refuse_special(path, mode)


# Formats treecli writes, and how an output is named for each.
# Extensions of files treecli reads but does not write, or never reads: an output named
# so is a mistake, never a directory of that name.
_FOREIGN_EXTENSIONS = (".h5", ".hdf5", ".ckpt", ".pkl", ".pickle",
                       ".json", ".onnx", ".tflite", ".pb", ".zip", ".tar", ".gz", ".txt", ".keras")


def output_format(target: Path, format: str | None, input_format: str | None) -> tuple[Format, bool]:
    """The format to write and whether the output is a directory.

    ``--format`` wins; else the extension of ``-o`` names it; else ``-o`` is a
    directory in the first input's format (or the one it names for its directories:
    an HF safetensors directory for PyTorch's).

    Raises:
        UsageError: the name ends in an extension treecli does not write (``out.h5``,
            ``out.npy``), or ``--format`` contradicts the name's extension.
    """
    named = next((name for name in FORMATS if target.name.endswith(get(name).written_extensions)), None)
    foreign = next((ext for ext in _FOREIGN_EXTENSIONS if target.name.lower().endswith(ext)), None)
    if format:
        fmt = get(format)
        if (named and named != fmt.name) or (foreign and not named):
            raise UsageError(f"the name says {named or foreign} but {option('format', format)} says otherwise; "
                             "treecli writes "
                             f"{WRITES}", file=str(target))
        return fmt, not target.name.endswith(fmt.written_extensions)
    if named:
        return get(named), False
    foreign = foreign or next((ext for name in FORMATS if not get(name).writable for ext in get(name).extensions
                               if target.name.endswith(ext)), None)  # read, never written
    if foreign:
        raise UsageError(f"treecli does not write {foreign} files; it writes {WRITES}", file=str(target))
    if input_format is None:
        raise UsageError(f"cannot tell the output format from the name; add {option('format', 'FORMAT')}",
                         file=str(target))
    if get(input_format).directory_output:
        return get(get(input_format).directory_output), True
    if not get(input_format).writes_directories:
        extension = (get(input_format).written_extensions or (".safetensors",))[0]
        raise UsageError(f"a name without an extension is a directory, and {input_format} checkpoints are files: "
                         f"name a file ({target.name}{extension}) or write a directory with "
                         f"{option('format', 'orbax')} or {option('format', 'safetensors')} (an HF directory)",
                         file=str(target))
    return get(input_format), True


def save(
    tree: Any,
    target: str | Path,
    *,
    format: str | None = None,
    input_format: str | None = None,
    options: WriteOptions | None = None,
    inputs: Sequence[Checkpoint | Path] = (),
    force: bool = False,
    verify: bool = False,
    decided: tuple[Format, bool] | None = None,
) -> str | Path:
    """Write ``tree`` to ``target`` atomically, streaming leaf by leaf.

    The output's format and whether it is a directory are ``decided`` by the caller's
    ``output_format`` (a command decides once), else here.

    What may be replaced follows ``_outputs``: never an input (every file of
    ``inputs``), never a special file, an existing output only with ``force``,
    an existing directory only when nothing in it would be lost. With ``verify``, the
    finished temporary is opened by its own reader and compared with ``tree`` bit for
    bit before it is published (``_verify.Verifier``); a difference publishes nothing.

    ``target`` may be an ``s3://`` or ``gs://`` URL: a safetensors object (streamed
    as a multipart or resumable upload that appears only when complete) or an
    Orbax checkpoint (its commit marker uploaded last); ``verify`` is not used there (an
    upload is checked by its checksums: it cannot be read back before it appears).

    Returns:
        The path or URL written.

    Raises:
        UsageError: the output may not be written or replaced.
        TreecliError: the tree cannot be stored in the format.
        NotDurableError: the output is in place but its directory sync failed.
    """
    from treecli import _cluster
    from treecli.formats import _outputs

    options = options or WriteOptions()
    cluster = _cluster.current()
    if cluster is not None and is_url(target):
        raise UsageError("a run of several processes writes to a shared filesystem, not a bucket; write the file, "
                         "then copy it", file=str(target))
    if is_url(target):
        if not target.startswith(BUCKET_SCHEMES):
            raise UsageError("treecli writes to s3:// and gs:// buckets; HTTP servers and the Hub are read only",
                             file=target)
        key = PurePosixPath(urllib.parse.urlsplit(target).path or "/")
        try:
            fmt, _ = output_format(key, format, input_format)
        except TreecliError as e:
            raise e.with_file(target, replace=str(key))
        tree = held_by(tree, fmt, target)
        _outputs.write_remote(fmt, tree, target, options, [*inputs, *_tree.sources(tree)], force)
        return target
    target = Path(target)
    fmt, is_dir = decided or output_format(target, format, input_format)
    if not fmt.writable:
        raise UsageError(f"treecli cannot write {fmt.name} files", file=str(target))
    tree = held_by(tree, fmt, str(target))
    # the inputs the caller names, and every file the tree's lazy leaves still read from
    sources = _outputs.sources_of([*inputs, *map(Path, _tree.sources(tree))])
    with _writing(target):
        if _holds_global_arrays(tree):
            _outputs.write_global(fmt, tree, target, options, sources, force)
        elif cluster is not None:
            _outputs.write_together(fmt, tree, target, is_dir, options, sources, force, cluster, verify)
        else:
            _outputs.write(fmt, tree, target, is_dir, options, sources, force, _verifier(tree, fmt, options, verify))
    return target


def _verifier(tree: Any, fmt: Format, options: WriteOptions, verify: bool) -> Callable[[Path], None] | None:
    """The check of a finished temporary against ``tree`` (as ``fmt`` holds it), or None."""
    if not verify:
        return None
    from treecli.formats._verify import Verifier

    return Verifier(tree, fmt, options.drop_unsupported, progress=options.stage, like=options.like)


def held_by(tree: Any, fmt: Format, file: str) -> Any:
    """``tree`` as ``fmt`` holds it, decided here for the CLI and the Python API alike:
    Python numbers as 0-d arrays where the format stores no numbers (``3`` as int64, as
    Equinox does); and no leaf that could not be read back, refused before a byte is
    written. Idempotent: a verification takes the tree as it will be written.

    Raises:
        TreecliError: a leaf of more dimensions than NumPy (and so treecli) reads.
    """
    from treecli import _leaf, _pytree
    from treecli._index import MAX_NDIM
    from treecli.formats import _blockscaled
    from treecli._keypath import format_keypath

    numbers = False
    for keypath, leaf in _tree.flatten(tree):
        if _leaf.is_array(leaf) and len(leaf.shape) > MAX_NDIM:
            raise TreecliError(f"a leaf of {len(leaf.shape)} dimensions; NumPy, and so treecli, reads at most "
                               f"{MAX_NDIM}: nothing written", file=file, keypath=format_keypath(keypath)[:80])
        numbers = numbers or isinstance(leaf, (bool, int, float, complex))
    tree = _blockscaled.stored_form(tree).tree  # (block-scaled weights as stored, requantized, or all plain)
    return fmt.held(tree if fmt.holds_numbers or not numbers else _pytree.numbers_as_arrays(tree))


def hub_mismatches(files: list[str]) -> list[str]:
    """Each of ``files`` (``hf://`` names) whose SHA-256 is not the Hub's (``_remote``)."""
    from treecli.formats import _remote

    return _remote.hub_mismatches(files)


def block_scaled_written(tree: Any) -> Any:
    """``tree`` as an output writes its block-scaled weights (FP8, MXFP4), and how many of
    each scheme it writes requantized and as plain values (``_blockscaled.stored_form``)."""
    from treecli.formats import _blockscaled

    return _blockscaled.stored_form(tree)


def check_output(target: Path, inputs: Sequence[Checkpoint], *, force: bool) -> None:
    """Refuse, as ``save`` does, an output file that may not be replaced (``_outputs.check_target``)."""
    from treecli.formats import _outputs

    _outputs.check_target(Path(target), _outputs.sources_of(list(inputs)), force=force, rewrite_hint=False)


def save_in_place(tree: Any, checkpoint: Checkpoint, *, format: str | None = None,
                  options: WriteOptions | None = None, verify: bool = False) -> Path:
    """Rewrite an opened checkpoint where it lies: only its weight files change. With
    ``verify``, the rewritten file or directory is checked as ``save`` checks an output,
    before it replaces the old one.

    Returns:
        The file or directory rewritten.

    Raises:
        UsageError: a CheckpointManager step, a format change, or a directory
            holding files the format's writer would not write back.
    """
    from treecli import _cluster
    from treecli.formats import _outputs

    if _cluster.current() is not None:
        raise UsageError("a run of several processes writes a new file; use -o instead of --in-place",
                         file=checkpoint.file)
    if format and format != checkpoint.format:
        raise UsageError(f"--in-place keeps the input's format ({checkpoint.format}); write {format} with -o",
                         file=checkpoint.file)
    fmt = get(checkpoint.format)
    if not fmt.writable:
        raise UsageError(f"treecli cannot write {fmt.name} files", file=checkpoint.file)
    options = options or WriteOptions()
    tree = held_by(tree, fmt, checkpoint.file)
    with _writing(Path(checkpoint.file)):
        return _outputs.write_in_place(fmt, tree, checkpoint, options, _verifier(tree, fmt, options, verify))


def _holds_global_arrays(tree: Any) -> bool:
    """Whether some leaf is a JAX array of which this process holds only some shards (a
    program of several processes)."""
    jax = sys.modules.get("jax")
    return jax is not None and any(isinstance(x, jax.Array) and not x.is_fully_addressable
                                   for x in _tree.leaves(tree))


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[None]:
    """Errors of a write name the output the user gave, never a temporary name."""
    from treecli import _atomic

    try:
        yield
    except TreecliError as e:
        raise e.with_file(str(target), replace=str(target.parent / _atomic.TMP_PREFIX))
    except OSError as e:
        raise TreecliError(f"cannot write: {e.strerror or e}", file=str(target)) from e
