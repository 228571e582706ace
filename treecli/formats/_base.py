"""The contract every format fulfils, and what opening a checkpoint returns.

A format is one subclass of :class:`Format`, in a module of its own under
``treecli/formats/``, named in the registry (``treecli.formats.FORMATS``). The
base class documents every member and gives the default of each one a format
may leave out, so that nothing asks a format what it can do: it says so in its
class attributes, and what it cannot do raises a clear error here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from treecli._errors import FormatError


@dataclass
class Origin:
    """Where a checkpoint's weights live: what ``--in-place`` rewrites, and what
    no output may land on.

    ``layout`` is ``"file"`` (one file: ``path``), ``"sharded"`` (an index at
    ``path`` naming shard files), ``"directory"`` (a checkpoint directory
    rewritten whole: Orbax) or ``"step"`` (a CheckpointManager step, which is
    never rewritten in place). ``files`` are every file the weights are read from.
    """

    layout: str
    path: Path
    files: list[Path] = field(default_factory=list)


@dataclass
class Checkpoint:
    """An opened checkpoint: a tree of lazy leaves plus what surrounds it."""

    tree: Any
    format: str
    file: str
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Other files of an input directory (config.json, tokenizer files), copied
    #: unchanged to a directory output.
    companions: list[Path] = field(default_factory=list)
    #: Warnings met while opening (a file opened flat, an ignored stray shard).
    warnings: list[str] = field(default_factory=list)
    #: Extra facts for ``show`` (the steps of a CheckpointManager root, ...).
    info: dict[str, Any] = field(default_factory=dict)
    #: The model the weights belong to, where the checkpoint says (``_model.Model``: a GGUF
    #: file's metadata), or how to find it (a callable: an HF directory's ``config.json``,
    #: read only when asked); see ``described_model``.
    model: Any = None
    #: The folder (``_folder.Folder``) of a directory checkpoint, anywhere: where a recipe
    #: reads the files beside its weights (config.json, the tokenizer's); None for a file.
    folder: Any = None
    #: Where its weights live on disk (None for a tree in memory).
    origin: Origin | None = None
    #: The model its leaves belong to (``--like``): a ``_pytree.Structure``, whose
    #: order, shapes and dtypes an ``.eqx`` output follows.
    like: Any = None
    #: Each item's tree, by name, for a CheckpointManager step (``info["items"]`` lists them).
    items: dict[str, Any] = field(default_factory=dict)
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def described_model(self) -> Any:
        """The model the weights belong to (``_model.Model``), or None where the checkpoint
        does not say; a ``config.json`` is read on the first call only (a remote one is a
        request that only ``show`` needs)."""
        if callable(self.model):
            self.model = self.model()
        return self.model

    def item(self, name: str) -> Any:
        """The tree of one item of a CheckpointManager step.

        Raises:
            UsageError: not a step, or it has no such item (its items named).
        """
        from treecli._errors import UsageError

        if name not in self.items:
            known = f"; items: {', '.join(self.items)}" if self.items else " (not a CheckpointManager step)"
            raise UsageError(f"no item {name!r}{known}", file=self.file)
        return self.items[name]

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# What treecli writes, for the messages that refuse another name (an output of a format
# it only reads, a checkpoint named like one array).
WRITES = (".safetensors, .npz, .msgpack, .eqx, .pt/.bin/.pth, .gguf, or a directory (an HF safetensors directory, or an "
          "Orbax checkpoint)")


@dataclass
class WriteOptions:
    """Options every writer understands (a writer ignores what does not apply)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    max_shard_size: int | None = None
    companions: list[Path] = field(default_factory=list)
    drop_unsupported: bool = False
    #: The pytree the data leaves belong to (a ``_pytree.Structure``): an ``.eqx``
    #: output holds its leaves in its JAX flatten order, each of its shape and dtype,
    #: so that the model loads it. None: the tree's own order.
    like: Any = None
    #: Called with the number of bytes written after each chunk (progress bars).
    progress: Callable[[int], None] | None = None
    #: Where writers record the digests of the leaves they write, for a verification (see
    #: ``writer.write_leaf``); None: not recorded.
    digests: dict[int, tuple[Any, tuple[int, int, int]]] | None = None
    #: A ``writer.ReadBack`` for a verified output: each file's writer reads it back as it
    #: writes it (through its ``writer.Writeback``); None: not read back.
    readback: Any = None
    #: A progress display for a stage of its own, ``stage(description, total_bytes)``: a
    #: context giving an ``advance(nbytes)`` callable (the verification's). None: none shown.
    stage: Callable[[str, int], Any] | None = None
    #: The record of where the output came from (a ``_record.Record``), for formats that keep
    #: one (``Format.keeps_records``): the writer puts it in the header and takes each
    #: tensor's digest as it writes it; None: no record.
    record: Any = None
    #: Called with each warning line the writer has for the user.
    warn: Callable[[str], None] | None = None
    #: The input's file or URL as the user gave it, for the commands a hint suggests.
    source: str | None = None

    def source_in_hint(self) -> str:
        """The input as a hint's command names it: the user's own path, shell-quoted."""
        import shlex

        return shlex.quote(self.source) if self.source else "CHECKPOINT"

    def refuse_or_drop(self, unsupported: list[str], holder: str, file: str) -> None:
        """What a format cannot hold (``"name (why)"`` lines): an error listing them, or,
        with ``drop_unsupported``, one warning naming them (the caller leaves them out).

        Raises:
            TreecliError: some, without ``drop_unsupported``.
        """
        from treecli._errors import TreecliError, counted, option

        if not unsupported:
            return
        if not self.drop_unsupported:
            raise TreecliError(f"{holder} cannot hold {counted(len(unsupported), 'leaf', 'leaves')} (use "
                               f"{option('drop_unsupported')} to drop them)", file=file, details=unsupported)
        if self.warn:
            self.warn(f"dropped {counted(len(unsupported), 'leaf', 'leaves')} {holder} cannot hold: "
                      f"{', '.join(unsupported[:20])}")

    def writeback(self, f: Any) -> Any:
        """The ``writer.Writeback`` of an output file open for writing as ``f``, reading it
        back as it is written when the output is verified."""
        from treecli._bytes import writer

        return writer.Writeback(f, self.readback.file(f) if self.readback is not None else None)


@dataclass
class FilePlan:
    """One output file laid out before any byte is written: its header, and where each
    leaf's bytes go."""

    head: bytes
    leaves: list[tuple[int, Any]]  # (offset in the file, the leaf written there), in order

    @property
    def size(self) -> int:
        return self.leaves[-1][0] + self.leaves[-1][1].nbytes if self.leaves else len(self.head)


@dataclass
class OutputPlan:
    """An output laid out before any byte is written: its files (by name in the output
    directory; ``""`` for a one-file output), and what is written last, once every file
    is (an HF index). Several processes that plan the same tree agree on every offset,
    so each can write its own share of the bytes (``_outputs.write_together``)."""

    files: list[tuple[str, FilePlan]]
    last: Callable[[Path], None] | None = None  # given the directory


class NotInFolder(FormatError):
    """A folder that cannot be listed does not hold the file a format presumed it held
    (an HTTP directory's ``model.safetensors``): the next format is tried."""


class Format:
    """One checkpoint format: how to recognise it, open it lazily and write it.

    A subclass sets ``name`` and implements ``sniff`` and ``open``; one that writes
    sets ``writable`` and implements ``write``. Everything else has a default.
    """

    #: The name users give ``--format`` and the registry knows it by.
    name: ClassVar[str]
    #: File names of this format (``.safetensors``): the extension decides for a damaged
    #: file no ``sniff`` accepts.
    extensions: ClassVar[tuple[str, ...]] = ()
    #: The names it writes, when fewer than it reads (``.eqx`` is written, ``.npy`` read too).
    write_extensions: ClassVar[tuple[str, ...] | None] = None
    #: How flat stored keys nest (``"."``, ``"/"``); None for a format that stores a real tree.
    separator: ClassVar[str | None] = None
    #: Whether it stores Python numbers as they are (else as 0-d arrays, as Equinox does).
    holds_numbers: ClassVar[bool] = False
    #: Whether its arrays take less room on disk than in memory (the free-space check is skipped).
    compresses: ClassVar[bool] = False
    #: Whether ``write`` is implemented.
    writable: ClassVar[bool] = False
    #: Whether its metadata holds treecli's record of where an output came from (``_record``).
    keeps_records: ClassVar[bool] = False
    #: Whether a checkpoint of it written under a name without extension is a directory
    #: (an HF safetensors directory, an Orbax checkpoint), not a file.
    writes_directories: ClassVar[bool] = False
    #: Whether ``write_remote`` streams it into a bucket.
    writes_to_buckets: ClassVar[bool] = False
    #: The format a directory output of this input format is written in, when this one
    #: writes only files (PyTorch's HF directories become safetensors ones).
    directory_output: ClassVar[str | None] = None
    #: Whether ``write_global`` writes global arrays, each process its own shards.
    writes_global_arrays: ClassVar[bool] = False
    #: Whether its directories are HF model directories, a ``config.json`` beside the
    #: weights naming the model (``show`` says it).
    hf_directories: ClassVar[bool] = False
    #: The ends of the names of its files a URL may name (``.gguf``; a shard index's
    #: ``.safetensors.index.json``), read by byte ranges through the URL's folder
    #: (``open_folder(folder, entry=NAME)``). Empty: its files are read here only.
    remote_extensions: ClassVar[tuple[str, ...]] = ()

    def plan(self, tree: Any, file: str, options: WriteOptions, directory: bool) -> OutputPlan | None:
        """The layout of an output (a file, or a ``directory``), for a run of several
        processes to write together; None: this format's writer writes alone (its bytes
        depend on each other: a zip's CRCs, msgpack's lengths, Orbax's own writer)."""
        return None

    def sniff(self, path: Path) -> str | None:
        """None if the file or directory looks like this format, else why not (shown when
        no format accepts it). Never raises for a file of another format."""
        raise NotImplementedError

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        """Metadata now, lazy leaves for the data. ``like`` (a ``_pytree.Structure``) names
        the leaves of a format that stores none; ``step`` picks a CheckpointManager step.
        A format of directories opens a local one through ``open_folder``."""
        raise NotImplementedError

    def in_folder(self, folder: Any) -> str | None:
        """None if ``folder`` (a ``_folder.Folder``: a local directory, a bucket prefix, an
        HTTP directory) holds a checkpoint of this format, else why not. Directories are
        tried in one order wherever they lie (the registry's ``DIRECTORIES``); a folder
        that cannot be listed may be presumed to, ``open_folder`` then saying if not."""
        return f"{self.name} checkpoints are files, not directories"

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        """The checkpoint in ``folder``, read through it whatever the place: ``entry`` is a
        file of it the user named (a shard index, a weights file), else the one the format's
        layout finds. Metadata now, lazy leaves for the data."""
        from treecli._errors import UsageError

        raise UsageError(f"treecli reads {self.name} checkpoints from local files only; copy it here first",
                         file=folder.named(entry) if entry else folder.name)

    @property
    def written_extensions(self) -> tuple[str, ...]:
        """The extensions of the files it writes (none when it writes nothing)."""
        if not self.writable:
            return ()
        return self.extensions if self.write_extensions is None else self.write_extensions

    def held(self, tree: Any) -> Any:
        """``tree`` as this format holds it, where that is another tree (GGUF: a quantized
        tensor's edited values quantized in its type again); as it is by default."""
        return tree

    def owns(self, name: str) -> bool:
        """Whether an entry of an output directory is one its writer writes (``-o DIR --force``
        may replace a directory that holds nothing else)."""
        return False

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        """Stream ``tree`` to ``target`` (a temporary the atomic writer made: a new file, or an
        empty directory for a directory output)."""
        from treecli._errors import UsageError

        raise UsageError(f"treecli cannot write {self.name} files", file=str(target))

    def write_in_place(self, tree: Any, origin: Origin, options: WriteOptions) -> None:
        """Rewrite a checkpoint of layout ``"sharded"`` where it lies (other layouts are
        rewritten whole by the atomic writer)."""
        from treecli._errors import UsageError

        raise UsageError(f"treecli does not rewrite sharded {self.name} checkpoints in place", file=str(origin.path))

    def write_global(self, tree: Any, target: Path, options: WriteOptions, replace: bool) -> None:
        """Write, together with every other process of a JAX program, a tree of global arrays
        (each process holding only its shards): each process its own shards."""
        from treecli._errors import UsageError

        raise UsageError(f"the tree holds global arrays of a program of several processes (each holds only its own "
                         f"shards), which {self.name} files cannot be written from: save it as an Orbax checkpoint "
                         "(each process writes its shards, as Orbax does), or gather the arrays first "
                         "(jax.experimental.multihost_utils.process_allgather)", file=str(target))

    def write_remote(self, tree: Any, url: str, options: WriteOptions, replace: bool) -> None:
        """Write into a bucket (``writes_to_buckets``), appearing only when complete."""
        from treecli._errors import UsageError

        raise UsageError(f"treecli writes safetensors files and Orbax checkpoints to buckets, not {self.name}; "
                         "write it here and copy it", file=url)

    def stored_leaves(self, tree: Any, written: Any, like: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Both sides of a verification by the names this format stores: ``tree`` as its writer
        names each leaf, and ``written`` (the output read back). Flat formats join a key path
        with their separator; tree formats name a leaf by its key path. Block-scaled weights
        read back are compared as their stored tensors, as they were written."""
        from treecli.formats._blockscaled import stored_form

        return stored_names(tree, self.separator), stored_names(stored_form(written).tree, self.separator)

    def reference_problems(self, path: Path, written: dict[str, Any]) -> list[str]:
        """What the format's own reference reader finds wrong with a finished output (``written``:
        what treecli read back, by stored name); none where there is no reference to ask."""
        return []


def stored_names(tree: Any, separator: str | None) -> dict[str, Any]:
    """``{stored name: leaf}``: what a writer with this separator names each leaf."""
    from treecli import _tree
    from treecli._keypath import format_keypath

    if separator is None:
        return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree)}
    return {separator.join(str(k) for k in kp): leaf for kp, leaf in _tree.flatten(tree)}
