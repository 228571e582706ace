"""Crash-consistent outputs: a temporary name in the target's directory, fsync,
rename into place, fsync of the directory.

A crash at any moment leaves the old output (or none), never a torn one.
Temporary names start with ``.treecli-tmp-`` so that readers ignore them. A
writer holds an ``flock`` on its temporary for as long as it writes; a later
run removes only temporaries nobody holds (a PID would not do: a writer in
another PID namespace, a container sharing the directory, has a PID that means
nothing here). What an output may replace is decided in ``treecli._outputs``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

from treecli._errors import NotDurableError

TMP_PREFIX = ".treecli-tmp-"
# A temporary is made under this prefix, locked, then renamed to its TMP_PREFIX name,
# so that every TMP_PREFIX entry nobody locks is provably abandoned.
_NEW_PREFIX = ".treecli-new-"
# Room left in a file name for what another library appends to our temporary
# (Orbax writes "<name>.orbax-checkpoint-tmp-<timestamp>" beside what it is given).
_SUFFIX_ROOM = 48
# An unlocked _NEW_PREFIX entry younger than this may be a writer between making and
# locking it; older, it was left by a run killed in that instant.
_GRACE_SECONDS = 60


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


def temp_name(target: Path) -> Path:
    """A fresh temporary name beside ``target`` that fits the file-name limit,
    however long the target's own name is."""
    head = f"{TMP_PREFIX}{os.urandom(4).hex()}-"  # (the secrets module: 4 ms of imports)
    try:
        limit = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    room = max(limit - len(head.encode()) - _SUFFIX_ROOM, 0)
    tail = target.name.encode()[:room].decode("utf-8", "ignore")
    return target.parent / f"{head}{tail}"


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _locked_temporary(target: Path, directory: bool) -> tuple[Path, int]:
    """A new empty file (or directory) beside ``target``, locked, under a temporary name;
    returns it and the descriptor that holds the lock."""
    name = temp_name(target)
    new = name.with_name(_NEW_PREFIX + name.name[len(TMP_PREFIX):])
    if directory:
        new.mkdir(mode=0o700)
        fd = os.open(new, os.O_RDONLY)
    else:
        fd = os.open(new, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(new, name)
    except BaseException:
        os.close(fd)
        if directory:
            shutil.rmtree(new, ignore_errors=True)
        else:
            os.unlink(new)
        raise
    return name, fd


def remove_stale_temporaries(directory: Path) -> None:
    """Remove temporaries in ``directory`` that no writer holds (left by killed runs)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith((TMP_PREFIX, _NEW_PREFIX)):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if entry.name.startswith(_NEW_PREFIX) and time.time() - info.st_mtime < _GRACE_SECONDS:
                continue
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if _lock(fd):  # nobody writes it: abandoned
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _publish(tmp: Path, target: Path) -> None:
    """Rename into place, then make the rename durable. Past the rename the output
    exists: a failed directory sync says so instead of claiming nothing was written."""
    os.replace(tmp, target)
    try:
        fsync_path(target.parent)
    except OSError as e:
        raise NotDurableError(target, e) from e


def _keep_identity(tmp: Path, like: os.stat_result | None) -> None:
    """The new file's mode (and, replacing a file in place, its owner and group)."""
    if like is None:
        os.chmod(tmp, 0o666 & ~_umask())
        return
    os.chmod(tmp, stat.S_IMODE(like.st_mode))
    current = os.stat(tmp)
    if (current.st_uid, current.st_gid) != (like.st_uid, like.st_gid):
        os.chown(tmp, like.st_uid, like.st_gid)
        os.chmod(tmp, stat.S_IMODE(like.st_mode))  # chown clears set-id bits


@contextlib.contextmanager
def atomic_file(target: Path, like: os.stat_result | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it replaces ``target``.

    The temporary exists (empty, locked) when yielded: the caller opens it for
    writing (``"wb"``) and writes the whole file. On any exception,
    KeyboardInterrupt included, the temporary is removed and ``target`` is
    untouched. ``like``: a stat result whose mode, owner and group the output
    takes (``--in-place``); by default the mode follows the umask.
    """
    target = Path(target)
    remove_stale_temporaries(target.parent)
    tmp, fd = _locked_temporary(target, directory=False)
    try:
        yield tmp
        _keep_identity(tmp, like)
        os.fsync(fd)
        _publish(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):  # gone already when the failure came after the rename
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield the path of a new directory to build; on success it becomes ``target``.

    The directory is built inside a locked holder next to ``target``, so that
    whatever a writer leaves there (Orbax's own temporaries included) goes with
    the holder on failure. With ``replace``, an existing ``target`` (which the
    caller has checked may be replaced) is moved aside and removed only after
    the new one is in place.
    """
    target = Path(target)
    remove_stale_temporaries(target.parent)
    holder, fd = _locked_temporary(target, directory=True)
    try:
        built = holder / "checkpoint"
        built.mkdir(mode=0o777 & ~_umask())
        yield built
        for entry in built.rglob("*"):
            if entry.is_file() and not entry.is_symlink():
                fsync_path(entry)
        fsync_path(built)
        if replace and (target.exists() or target.is_symlink()):
            old = holder / "previous"
            os.rename(target, old)
            try:
                os.rename(built, target)
            except BaseException:
                os.rename(old, target)
                raise
        else:
            os.rename(built, target)
        try:
            fsync_path(target.parent)
        except OSError as e:
            raise NotDurableError(target, e) from e
    finally:
        shutil.rmtree(holder, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def updating(checkpoint: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the right to rewrite ``checkpoint`` in place, for a whole read-modify-write:
    a second writer waits (``on_wait`` is called once first) and then reads the first one's
    result, so that no update is lost. The lock is an ``flock`` on the directory that holds
    the checkpoint (the checkpoint itself is replaced by a rename, a new inode each time),
    so it leaves no file behind and dies with its process."""
    try:
        fd = os.open(Path(checkpoint).resolve().parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a directory we may not read: nothing to lock with (the rewrite will say what fails)
        yield
        return
    try:
        if not _lock(fd):
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)
