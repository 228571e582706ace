"""Crash-consistent outputs: a temporary name in the target's directory, fsync,
rename into place, fsync of the directory.

A crash at any moment leaves the old output (or none), never a torn one.
Temporary names start with ``.treecli-tmp-<pid>-`` so that readers ignore them
and a later run removes those whose process is gone.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator

from treecli._errors import UsageError

TMP_PREFIX = ".treecli-tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Data written since the last hint, before the kernel is asked to start writing it
# to disk. Without hints a 1 GiB output stays dirty in memory (under the kernel's
# own threshold) and the final fsync then waits for all of it: `average` of
# 3 x 1 GiB spent 1.8 s in that fsync after 1.5 s of computing.
WRITEBACK_BYTES = 32 << 20


class Writeback:
    """Starts the disk writing a file's data while more is being produced.

    Call it after each write; every WRITEBACK_BYTES it hands what was written
    since to the kernel's writeback (posix_fadvise DONTNEED starts it). The same
    call covers the window before too: written back by then, its pages are clean
    and DONTNEED drops them, so a big output does not evict the inputs. (Pages
    still being written when first hinted are never dropped by that first hint.)
    """

    def __init__(self, f: BinaryIO):
        self._f = f
        self._previous = 0  # start of the last window hinted
        self._hinted = 0  # end of it
        self._enabled = hasattr(os, "posix_fadvise")

    def __call__(self) -> None:
        if not self._enabled:
            return
        try:
            end = self._f.tell()
            if end - self._hinted >= WRITEBACK_BYTES:
                self._f.flush()
                os.posix_fadvise(self._f.fileno(), self._previous, end - self._previous, os.POSIX_FADV_DONTNEED)
                self._previous, self._hinted = self._hinted, end
        except (AttributeError, OSError, io.UnsupportedOperation):  # not a plain file: only a hint is lost
            self._enabled = False


def _temp_name(target: Path) -> Path:
    return target.parent / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-{target.name}"


def remove_stale_temporaries(directory: Path) -> None:
    """Remove temporaries left in ``directory`` by treecli runs that were killed."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(TMP_PREFIX):
            continue
        pid_text = entry.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_file(target: Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it replaces ``target``.

    The caller writes the whole file to the yielded path (and may fsync it; this
    does too). On any exception, KeyboardInterrupt included, the temporary is
    removed and ``target`` is untouched.
    """
    target = Path(target)
    remove_stale_temporaries(target.parent)
    tmp = _temp_name(target)
    try:
        yield tmp
        os.chmod(tmp, (0o666 & ~_umask()) if mode is None else mode)
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; on success it becomes ``target``.

    Replacing an existing directory moves the old one aside first and removes
    it only after the new one is in place.
    """
    target = Path(target)
    remove_stale_temporaries(target.parent)
    tmp = _temp_name(target)
    tmp.mkdir(mode=0o777)
    try:
        yield tmp
        for entry in tmp.iterdir():
            if entry.is_file():
                fsync_path(entry)
        fsync_path(tmp)
        if target.exists() or target.is_symlink():
            aside = _temp_name(target)
            os.rename(target, aside)
            os.rename(tmp, target)
            fsync_path(target.parent)
            if aside.is_dir() and not aside.is_symlink():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                aside.unlink()
        else:
            os.rename(tmp, target)
            fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output(target: Path, inputs: list[Path], *, force: bool, in_place: bool = False) -> None:
    """Refuse outputs that would overwrite an input or an existing file unasked.

    "The input" is compared by device and inode, so ``./x``, a symlink to ``x``
    and a hard link to ``x`` are all the input.

    Raises:
        UsageError: output is an input (without ``in_place``), exists (without
            ``force``), or its directory does not exist.
    """
    target = Path(target)
    if not target.parent.is_dir():
        raise UsageError(f"output directory {str(target.parent)!r} does not exist", file=str(target))
    try:
        out_stat = os.stat(target)
    except FileNotFoundError:
        if target.is_symlink():
            raise UsageError("output is a dangling symbolic link; remove it first", file=str(target)) from None
        return
    for source in inputs:
        try:
            in_stat = os.stat(source)
        except OSError:
            continue
        if (in_stat.st_dev, in_stat.st_ino) == (out_stat.st_dev, out_stat.st_ino):
            if in_place:
                return
            raise UsageError(
                f"output is the input {str(source)!r}; use --in-place to replace it", file=str(target)
            )
    if not force:
        raise UsageError("output exists; use --force to replace it", file=str(target))
