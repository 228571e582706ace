"""The format registry: pick a format for a file, open it, write a tree.

Formats are modules named in ``FORMATS``, imported only when needed (so that
opening a safetensors file never imports orbax). To add a format, write a
module with a ``FORMAT`` object (see ``_base.py``) and add its name here.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

from treecli._errors import FormatError, TreecliError, UsageError
from treecli.formats import _foreign
from treecli.formats._base import Checkpoint, WriteOptions

# Order matters only for sniffing: the first format whose sniff accepts wins.
FORMATS = ("safetensors", "npz", "msgpack", "eqx", "orbax")


def get(name: str) -> Any:
    """The ``FORMAT`` object of a format by name."""
    if name not in FORMATS:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return importlib.import_module(f"treecli.formats.{name}").FORMAT


def detect(path: Path) -> Any:
    """The format of a file or directory, from its bytes or layout, then its extension.

    Raises:
        UsageError: the path does not exist.
        FormatError / RefusedError: no format accepts it (the message says why each refused).
    """
    path = Path(path)
    if not path.exists():
        raise UsageError("no such file or directory", file=str(path))
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
    kind = "directory" if path.is_dir() else "file"
    raise FormatError(f"not a checkpoint treecli can read ({kind}; {'; '.join(reasons)})", file=str(path))


def open_checkpoint(path: str | Path, format: str | None = None, **options: Any) -> Checkpoint:
    """Open a checkpoint lazily: metadata is read now, array data only when asked."""
    path = Path(path)
    fmt = get(format) if format else detect(path)
    if format and not path.exists():
        raise UsageError("no such file or directory", file=str(path))
    try:
        return fmt.open(path, **options)
    except TreecliError as e:
        raise e.with_file(str(path))
    except Exception as e:
        # The safety net: whatever a damaged file makes a library raise (zipfile's
        # NotImplementedError, struct.error, ...) is one clean line; --debug shows the chain.
        raise FormatError(f"cannot read it as {fmt.name}: {type(e).__name__}: {str(e)[:200]}",
                          file=str(path)) from e


def output_format(target: Path, format: str | None, input_format: str | None) -> tuple[Any, bool]:
    """The format to write and whether the output is a directory.

    ``--format`` wins; else the extension of ``-o`` names it; else ``-o`` is a
    directory in the first input's format.
    """
    if format:
        fmt = get(format)
        is_dir = not any(target.name.endswith(ext) for ext in fmt.extensions)
        return fmt, is_dir
    for name in FORMATS:
        fmt = get(name)
        if any(target.name.endswith(ext) for ext in fmt.extensions):
            return fmt, False
    if input_format is None:
        raise UsageError("cannot tell the output format from the name; add --format", file=str(target))
    return get(input_format), True


def save(
    tree: Any,
    target: str | Path,
    *,
    format: str | None = None,
    input_format: str | None = None,
    options: WriteOptions | None = None,
    inputs: list[Path] = (),
    force: bool = False,
    in_place: bool = False,
    mode: int | None = None,
) -> Path:
    """Write ``tree`` to ``target`` atomically, streaming leaf by leaf.

    Returns:
        The path written.

    Raises:
        UsageError: the output exists (without ``force``), is an input
            (without ``in_place``), or its directory is missing.

    ``mode`` sets the output file's permissions (``--in-place`` keeps the
    input's); by default they follow the umask.
        TreecliError: the tree cannot be stored in the format.
    """
    from treecli import _atomic

    target = Path(target)
    options = options or WriteOptions()
    fmt, is_dir = output_format(target, format, input_format)
    if not hasattr(fmt, "write"):
        raise UsageError(f"treecli cannot write {fmt.name} files", file=str(target))
    _atomic.check_output(target, list(inputs), force=force, in_place=in_place)
    if target.is_dir() and not _is_replaceable_directory(target):
        raise UsageError("output is a directory that is not a checkpoint; refusing to replace it", file=str(target))
    tmp_prefix = str(target.parent / _atomic.TMP_PREFIX)
    try:
        if is_dir:
            with _atomic.atomic_directory(target) as tmp:
                fmt.write(tree, tmp, options)
                for companion in options.companions:
                    if not (tmp / companion.name).exists():
                        shutil.copy2(companion, tmp / companion.name)
        else:
            if target.is_dir():
                raise UsageError("output is a directory; name a file or use --format", file=str(target))
            with _atomic.atomic_file(target, mode=mode) as tmp:
                fmt.write(tree, tmp, options)
    except TreecliError as e:
        raise e.with_file(str(target), replace=tmp_prefix)
    except OSError as e:
        raise TreecliError(f"cannot write: {e.strerror or e}", file=str(target)) from e
    return target


def _is_replaceable_directory(path: Path) -> bool:
    """A directory output may replace an existing directory only if that is a checkpoint."""
    try:
        detect(path)
        return True
    except TreecliError:
        return not any(path.iterdir())
