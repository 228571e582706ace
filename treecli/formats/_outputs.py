"""What an output may replace: the one place every command and the Python API
go through before anything is written (docs/safety.md).

- Only regular files and checkpoint directories are ever replaced: never a
  device, FIFO or socket (nor a symlink to one).
- No output lands on a file an input is read from, compared by device and
  inode, unless in place; ``force`` does not change that.
- An existing output is replaced only with ``force``. An existing directory is
  replaced only when it holds no input and everything in it is something the
  format's writer writes (or a companion file the new output copies): nothing
  treecli did not write is ever lost.
- In place: a file is replaced atomically and keeps its mode, owner and group;
  a sharded safetensors directory gets new shards beside the old ones, then its
  index (the commit), then loses the old shards, and nothing else in it changes;
  an Orbax directory is swapped whole only when it holds nothing but Orbax's
  files; a CheckpointManager step is refused.
- In a bucket (``s3://``, ``gs://``): a safetensors object appears only when its
  upload completes, and an Orbax checkpoint is committed by its marker, uploaded
  last; an existing output is replaced only with ``force``, and never an input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from treecli import _atomic, _tree
from treecli._bytes import writer
from treecli._bytes.local import special_kind
from treecli._errors import TreecliError, UsageError, in_cli, option
from treecli.formats._base import Checkpoint, Format, WriteOptions

def check_target(target: Path, sources: Sequence[Path], *, force: bool, rewrite_hint: bool = True
                 ) -> os.stat_result | None:
    """Refuse a target that may not be replaced; return its stat if it exists (``rewrite_hint``:
    an input refused, name ``--in-place``, where the command has it).

    Raises:
        UsageError: its directory is missing; it is a dangling symlink, a special
            file, or one of ``sources`` (the files inputs are read from); it
            exists and ``force`` is false.
    """
    target = Path(target)
    if not target.parent.is_dir():
        raise UsageError(f"output directory {str(target.parent)!r} does not exist", file=str(target))
    try:
        link = os.lstat(target)
    except FileNotFoundError:
        return None
    try:
        info = os.stat(target)
    except FileNotFoundError:
        raise UsageError("output is a dangling symbolic link; remove it first", file=str(target)) from None
    for mode in (link.st_mode, info.st_mode):
        kind = special_kind(mode)
        if kind:
            raise UsageError(f"output is {kind}; treecli replaces only regular files and checkpoint directories",
                             file=str(target))
    for source in sources:
        try:
            if os.path.samestat(os.stat(source), info):
                raise UsageError(f"output is the input {str(source)!r}"
                                 + (in_cli("; use --in-place to rewrite an input") if rewrite_hint else ""),
                                 file=str(target))
        except OSError:
            continue
    if not force:
        raise UsageError(f"output exists; use {option('force')} to replace it", file=str(target))
    return info


def check_replaceable_directory(directory: Path, fmt: Any, companions: Sequence[str], sources: Sequence[Path],
                                in_place: bool = False) -> None:
    """A directory may be replaced whole only when nothing in it would be lost.

    Raises:
        UsageError: it holds an input, or entries that ``fmt``'s writer does not
            write (listed).
    """
    real = os.path.realpath(directory)
    if not in_place:
        for source in sources:
            inside = os.path.realpath(source)
            if inside == real or inside.startswith(real + os.sep):
                raise UsageError(f"output directory holds the input {str(source)!r}; refusing to replace it",
                                 file=str(directory))
    foreign = sorted(
        e.name for e in os.scandir(directory)
        if not fmt.owns(e.name) and not (e.name in companions and not e.is_symlink())
    )
    if foreign:
        raise UsageError(
            f"{'input' if in_place else 'output'} directory holds {len(foreign)} "
            f"{'entry' if len(foreign) == 1 else 'entries'} that {fmt.name} checkpoints do not; replacing it "
            f"would lose them ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
            + ("write a new checkpoint with -o" if in_place else "choose a new output directory"),
            file=str(directory), details=foreign if len(foreign) > 5 else ())


def write(fmt: Any, tree: Any, target: Path, is_dir: bool, options: WriteOptions, sources: Sequence[Path],
          force: bool, verify: Callable[[Path], None] | None = None) -> None:
    """Write a new output (``-o``), replacing an existing one only as the model allows.

    ``verify`` is called with the finished temporary before it is published: a
    failure leaves the previous output (or none) and no new one.
    """
    options = _recording(fmt, options)
    with _parents_made(target):
        existing = check_target(target, sources, force=force)
        check_room(fmt, tree, target.parent, target)
        with _read_back(options, verify) as options:
            _write_new(fmt, tree, target, is_dir, existing, options, sources, verify)


@contextlib.contextmanager
def _read_back(options: WriteOptions, verify: Callable[[Path], None] | None) -> Iterator[WriteOptions]:
    """``options`` with what a verification takes from the writer (``verify``'s digests and
    read-back), the read-back's descriptors closed after (the writing failed or not)."""
    if verify:
        options = dataclasses.replace(options, digests=getattr(verify, "digests", None),
                                      readback=getattr(verify, "readback", None))
    try:
        yield options
    finally:
        if options.readback is not None:
            options.readback.close()


def _recording(fmt: Any, options: WriteOptions) -> WriteOptions:
    """``options`` with the record's text in the metadata, where ``fmt`` keeps records and a
    record is asked for (``_record``); else with no record at all: an input's, copied with
    its other metadata, would describe other weights."""
    from treecli.formats import _record

    metadata = _record.without_record(options.metadata)
    if options.record is None or not fmt.keeps_records:
        return dataclasses.replace(options, metadata=metadata, record=None)
    return dataclasses.replace(options, metadata={**metadata, _record.KEY: options.record.text()})


def _sealed(fmt: Any, written: Path, options: WriteOptions) -> None:
    """The record's roots written into a finished temporary (``_record.Record.seal``)."""
    if options.record is not None:
        options.record.seal(fmt.open, written)


def _checked(written: Path, verify: Callable[[Path], None] | None) -> None:
    """A finished temporary verified (when asked), then dropped from the page cache."""
    if verify:
        verify(written)
        writer.drop_cached(written)


@contextlib.contextmanager
def _parents_made(target: Path) -> Iterator[None]:
    """The directories above ``target`` that do not exist yet, made (as ``mkdir -p``, as
    mergekit and Orbax do); removed again, when still empty, if the write fails: nothing
    is left of an output that was not written.

    Raises:
        UsageError: something on the way is not a directory.
    """
    missing = []
    parent = target.parent
    while not parent.exists():
        if parent.is_symlink():
            raise UsageError(f"{str(parent)!r} is a dangling symbolic link, not a directory", file=str(target))
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{str(parent)!r} is not a directory", file=str(target))
    made = []
    try:
        for directory in reversed(missing):
            os.mkdir(directory)
            made.append(directory)
            _atomic.fsync_path(directory.parent)  # (its own entry lasts; the output's is synced by its writer)
        yield
    except BaseException:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def _write_new(fmt: Any, tree: Any, target: Path, is_dir: bool, existing: os.stat_result | None,
               options: WriteOptions, sources: Sequence[Path], verify: Callable[[Path], None] | None) -> None:
    if is_dir:
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            check_replaceable_directory(target, fmt, [c.name for c in options.companions], sources)
        with _atomic.atomic_directory(target, replace=existing is not None) as built:
            fmt.write(tree, built, options)
            _copy_companions(built, options.companions, tree, options)  # (config.json: how its weights read)
            _sealed(fmt, built, options)
            _checked(built, verify)
        return
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise UsageError(f"output is a directory; name a file or use {option('format', 'FORMAT')}", file=str(target))
    with _atomic.atomic_file(target) as tmp:
        fmt.write(tree, tmp, options)
        _sealed(fmt, tmp, options)
        _checked(tmp, verify)


def write_global(fmt: Any, tree: Any, target: Path, options: WriteOptions, sources: Sequence[Path],
                 force: bool) -> None:
    """Write global arrays with every process of a JAX program (``fmt.write_global``:
    Orbax's writer, each process its own shards), after the checks :func:`write` makes.

    Raises:
        UsageError: a format that global arrays cannot be written to, naming the way out.
    """
    existing = check_target(target, sources, force=force)
    if existing is not None and not stat.S_ISDIR(existing.st_mode):
        raise UsageError(f"output is a file; a {fmt.name} checkpoint of global arrays is a directory: name a new one",
                         file=str(target))
    if existing is not None:
        check_replaceable_directory(target, fmt, [], sources)
    # (no record: Orbax publishes the checkpoint itself, before treecli could write its roots in)
    fmt.write_global(tree, target, _recording(fmt, dataclasses.replace(options, record=None)),
                     replace=existing is not None)


def write_together(fmt: Any, tree: Any, target: Path, is_dir: bool, options: WriteOptions, sources: Sequence[Path],
                   force: bool, cluster: Any, verify: bool) -> None:
    """Write one output (a file, or a directory of files) with every process of a run,
    each its share of the bytes.

    Every process checks the target as :func:`write` does and plans the same layout
    (``fmt.plan``); process 0 makes the temporary (each file's header, then the file at
    its full size) and says where it is; each process writes its share of all the files'
    data (``_cluster.share``), fsyncs, and with ``verify`` reads it back against the
    leaves; once every process has said its share is written, process 0 writes what
    comes last (an HF index, the companion files) and renames the temporary into place.
    A failure in any process removes the temporary: nothing is published.

    Raises:
        UsageError: the format cannot be written by several processes (a zip, Orbax's
            writer).
        ClusterFailure: a process failed (each failure named).
    """
    from treecli import _cluster

    options = _recording(fmt, options)
    plan = fmt.plan(tree, str(target), options, is_dir)
    if plan is None and fmt.writes_global_arrays:
        write_global(fmt, _spread(tree, str(target)), target, options, sources, force)
        return
    if plan is None:
        raise UsageError(f"a run of several processes writes safetensors and Orbax, not {fmt.name}; "
                         "write safetensors, then convert it from one process", file=str(target))
    existing = check_target(target, sources, force=force)
    if existing is not None and stat.S_ISDIR(existing.st_mode) != is_dir:
        raise UsageError(f"output is a {'file' if is_dir else 'directory'}; name a new one", file=str(target))
    if existing is not None and is_dir:
        check_replaceable_directory(target, fmt, [c.name for c in options.companions], sources)
    check_room(fmt, tree, target.parent, target)
    publishing = contextlib.ExitStack()
    try:
        error = None
        if cluster.publishes:
            error = _one_line(lambda: cluster.tell("output", str(_start(publishing, target, is_dir, existing, plan,
                                                                         options))), target)
        cluster.agree("create the output", error)
        where = Path(cluster.hear("output"))
        share = _cluster.share(sum(f.size - len(f.head) for _, f in plan.files), cluster)
        cluster.agree("write its share", _one_line(lambda: _write_share(where, target, plan, share, options, verify),
                                                   target))
        if cluster.publishes:
            error = _one_line(lambda: _finish(fmt, where, plan, tree, options, is_dir), target)
        cluster.agree("finish the output", error)
    except BaseException:
        publishing.__exit__(*sys.exc_info())  # the temporary goes
        raise
    cluster.agree("publish", _one_line(publishing.close, target))


def _spread(tree: Any, file: str) -> Any:
    """The tree as global JAX arrays over every process's CPU devices, each array's rows
    split among them where they divide evenly (else every process holds it whole): each
    process reads only its rows, and Orbax's writer writes each process's own."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from treecli import _leaf, _pytree
    from treecli._keypath import format_keypath

    jax.config.update("jax_enable_x64", True)  # int64 stays int64 (this process is treecli's own)
    devices = jax.devices("cpu")
    mesh = Mesh(devices, ("processes",))
    rows, whole = NamedSharding(mesh, PartitionSpec("processes")), NamedSharding(mesh, PartitionSpec())
    chosen = {format_keypath(kp): rows if leaf.ndim and leaf.shape[0] % len(devices) == 0 else whole
              for kp, leaf in ((kp, _leaf.as_leaf(x)) for kp, x in _tree.flatten(tree) if _leaf.is_array(x))}
    return _pytree.onto_devices(tree, chosen.get, file=file)


def _start(publishing: contextlib.ExitStack, target: Path, is_dir: bool, existing: Any, plan: Any,
           options: WriteOptions) -> Path:
    """The temporary output, each file holding its header and at its full size (a hole)."""
    where = publishing.enter_context(_atomic.atomic_directory(target, replace=existing is not None) if is_dir
                                     else _atomic.atomic_file(target))
    for name, file in plan.files:
        with open(where / name if name else where, "wb") as f:
            f.write(file.head)
            f.truncate(file.size)
        if options.record is not None:
            options.record.wrote_head(where / name if name else where, file.head)
    return where


def _write_share(where: Path, target: Path, plan: Any, share: tuple[int, int], options: WriteOptions,
                 verify: bool) -> None:
    """This process's bytes ``share`` of the data of every file, counted across the files in order."""
    begin, end = share
    before = 0  # data bytes of the files before this one
    for name, file in plan.files:
        data = file.size - len(file.head)
        low, high = max(begin - before, 0), min(end - before, data)
        before += data
        if low >= high:
            continue
        low, high = low + len(file.head), high + len(file.head)
        fd = os.open(where / name if name else where, os.O_RDWR)
        try:
            writeback = writer.RangeWriteback(fd, low)
            touched = [(offset, leaf) for offset, leaf in file.leaves if offset < high and offset + leaf.nbytes > low]
            for offset, leaf in touched:
                writer.write_range(fd, leaf, offset, low, high, writeback, options.progress)
            os.fsync(fd)
            if verify and not all(writer.same_range(fd, leaf, offset, low, high) for offset, leaf in touched):
                raise TreecliError("verification failed: the bytes written differ from the leaf's (read back from "
                                   "the disk)", file=str(target / name if name else target))
        finally:
            os.close(fd)


def _finish(fmt: Any, where: Path, plan: Any, tree: Any, options: WriteOptions, is_dir: bool) -> None:
    """What process 0 writes once every share is: a directory's companion files, then its
    index; then the record's roots (the output read back whole: no writer took them)."""
    if is_dir:
        _copy_companions(where, options.companions, tree, options)
        if plan.last is not None:
            plan.last(where)
    _sealed(fmt, where, options)


def _copy_companions(built: Path, companions: Sequence[Path], tree: Any, options: WriteOptions) -> None:
    """The input directory's other files (config.json, tokenizer files), unless written; a
    ``config.json`` made to describe the weights written (``_model.truthful_config``), or
    left out, said, where it cannot be."""
    for companion in companions:
        if (built / companion.name).exists():
            continue
        if companion.is_dir():
            shutil.copytree(companion, built / companion.name, symlinks=True)
        elif companion.name == "config.json":
            _write_config(built / companion.name, companion, tree, options)
        else:
            shutil.copy2(companion, built / companion.name)


def _write_config(target: Path, source: Path, tree: Any, options: WriteOptions) -> None:
    """``source`` (an HF ``config.json``) at ``target``, describing ``tree``: copied as it is
    where it already does, rewritten where a count or a dtype changed, left out (with a
    warning) where it cannot be kept true."""
    texts = _truthful_config(source, tree, options, "config.json not written")
    if texts is None or texts[1] == texts[0]:
        shutil.copy2(source, target)
    elif texts[1] is not None:
        target.write_text(texts[1])


def _truthful_config(config: Path, tree: Any, options: WriteOptions, otherwise: str
                     ) -> tuple[str, str | None] | None:
    """An HF ``config.json``'s text, and the text that describes ``tree``
    (``_model.truthful_config``), or None for it where none can (a warning says why, and
    ``otherwise``, what is done instead); None for both where it is no small text file."""
    from treecli import _keypath
    from treecli._bytes.local import read_text
    from treecli.formats import _model

    try:
        text = read_text(config, what="config.json")
    except (OSError, TreecliError):  # (not a small text file: no model config to keep true)
        return None
    truthful, why = _model.truthful_config(text, tree, _keypath.layer_regex(None))
    if why and options.warn:
        options.warn(f"{why}: {otherwise}")
    return text, truthful


def _one_line(step: Callable[[], Any], target: Path) -> str | None:
    """Run one process's part of a step: None if it went well, else its one line for the
    others (an error here must not leave them waiting at the next barrier)."""
    try:
        step()
    except TreecliError as e:
        return str(e.with_file(str(target), replace=str(target.parent / _atomic.TMP_PREFIX)))
    except OSError as e:
        return f"{target}: cannot write: {e.strerror or e}"
    except Exception as e:  # a bug: said, not hidden, but the other processes must hear of it too
        return f"internal error: {type(e).__name__}: {e}"
    return None


def write_in_place(fmt: Any, tree: Any, checkpoint: Checkpoint, options: WriteOptions,
                   verify: Callable[[Path], None] | None = None) -> Path:
    """Rewrite an input where it lies, changing only its weight files, ``verify`` (as
    :func:`write`'s) called before the new files replace the old. Returns what was rewritten."""
    origin = checkpoint.origin
    if origin is None:
        raise UsageError("--in-place rewrites checkpoints on this machine; write a remote one's edit with -o",
                         file=checkpoint.file)
    if origin.layout == "step":
        raise UsageError("--in-place does not rewrite a CheckpointManager step or root (other steps and items "
                         "share it); write the edited step with -o, e.g. treecli edit ROOT --step N -o OUT",
                         file=checkpoint.file)
    # the new files are written beside the old ones, which stay until they are replaced
    check_room(fmt, tree, origin.path.parent if origin.layout in ("file", "sharded") else origin.path,
               Path(checkpoint.file))
    if origin.layout == "sharded" and verify:
        raise UsageError("--verify checks a new output; an HF directory's shards are rewritten one by one in "
                         "place: write the edit with -o to verify it", file=checkpoint.file)
    options = _recording(fmt, options)
    with _read_back(options, verify) as options:
        if origin.layout == "file":
            like = os.stat(origin.path)  # through a symlink (a hub cache's blob): its mode, owner and group
            if not stat.S_ISREG(like.st_mode):
                raise UsageError("--in-place rewrites only regular files", file=str(origin.path))
            with _atomic.atomic_file(origin.path, like=like) as tmp:
                fmt.write(tree, tmp, options)
                _sealed(fmt, tmp, options)
                _checked(tmp, verify)
            _config_kept_true(checkpoint, tree, options)
            return origin.path
        if origin.layout == "sharded":
            fmt.write_in_place(tree, origin, options)
            _config_kept_true(checkpoint, tree, options)
            return origin.path.parent
        check_replaceable_directory(origin.path, fmt, [], [], in_place=True)
        with _atomic.atomic_directory(origin.path, replace=True) as built:
            fmt.write(tree, built, options)
            _sealed(fmt, built, options)
            _checked(built, verify)
        return origin.path


def _config_kept_true(checkpoint: Checkpoint, tree: Any, options: WriteOptions) -> None:
    """After an HF directory's weights were rewritten in place: its ``config.json`` made to
    describe them (atomically), or a warning where it cannot be."""
    config = next((p for p in checkpoint.companions if p.name == "config.json" and p.is_file()), None)
    texts = None if config is None else _truthful_config(
        config, tree, options, "config.json left as it was, now describing other weights")
    if texts is not None and texts[1] is not None and texts[1] != texts[0]:
        with _atomic.atomic_file(config, like=os.stat(config)) as tmp:
            tmp.write_text(texts[1])


def check_room(fmt: Any, tree: Any, directory: Path, target: Path) -> None:
    """Refuse an output whose arrays would not fit in the free space of ``directory``'s
    filesystem, before anything is written (rather than failing with a full disk after
    minutes of writing, or streaming the 512 GiB of fill values a 2 KB Orbax checkpoint
    may declare). Formats that compress (``fmt.compresses``) are not judged by the size."""
    if fmt.compresses:
        return
    try:
        info = os.statvfs(directory)
    except OSError:  # (no such call here, or the directory is gone: the write will say)
        return
    free = info.f_bavail * info.f_frsize
    needed = _tree.array_bytes(tree)
    if needed > free:
        from treecli._units import human_bytes

        raise TreecliError(f"the output's arrays need {human_bytes(needed)}, but its filesystem has "
                           f"{human_bytes(free)} free; nothing was written", file=str(target))


def write_remote(fmt: Format, tree: Any, url: str, options: WriteOptions,
                 inputs: Sequence[Checkpoint | Path | str], force: bool) -> None:
    """Write a new output into a bucket (a safetensors object, or an Orbax checkpoint), by
    the format's ``write_remote``."""
    target = url.rstrip("/")
    for c in inputs:
        source = (c.file if isinstance(c, Checkpoint) else str(c)).rstrip("/")  # (or a URL a lazy leaf reads)
        if source == target or source.startswith(target + "/") or target.startswith(source + "/"):
            raise UsageError(f"output would overwrite the input {source}; write to another URL", file=url)
    if options.record is not None and fmt.keeps_records:  # (an upload sends its header first: its roots known before)
        options.record.seal_before(tree)
    fmt.write_remote(tree, url, _recording(fmt, options), replace=force)


def sources_of(checkpoints: Sequence[Checkpoint | Path]) -> list[Path]:
    """Every file and directory the given inputs are read from."""
    out: list[Path] = []
    for c in checkpoints:
        if isinstance(c, Checkpoint):
            out.append(Path(c.file))
            out.extend(c.origin.files if c.origin else [])
        else:
            out.append(Path(c))
    return out
