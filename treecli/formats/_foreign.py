"""Recognise files that are not checkpoints at all, by their bytes, so the user
gets a message about what the file really is (not "header too large")."""

from __future__ import annotations

import zipfile
from pathlib import Path

from treecli._errors import FormatError, RefusedError
from treecli._bytes.local import open_regular

_PICKLE_ADVICE = (
    "loading a pickle can run arbitrary code, so treecli never does; where you trust the file, convert it: "
    "python -c \"import torch; from safetensors.torch import save_file; "
    "save_file(torch.load('FILE', weights_only=True), 'FILE.safetensors')\""
)


def check(path: Path) -> None:
    """Raise a clear error if ``path`` is a known kind of non-checkpoint file.

    Raises:
        RefusedError: pickles (PyTorch ``.pt``/``.bin``, ``.pkl``), zips holding pickles.
        FormatError: empty files, Git LFS pointers, HTML pages.
    """
    if path.is_dir():
        return
    file = str(path)
    with open_regular(path) as f:
        head = f.read(512)
    if not head:
        raise FormatError("file is empty (0 bytes)", file=file)
    if head.startswith(b"version https://git-lfs.github.com/spec/"):
        raise FormatError(
            "this is a Git LFS pointer, not the checkpoint itself; fetch the real file with `git lfs pull`",
            file=file,
        )
    stripped = head.lstrip().lower()
    if stripped.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<body")):
        raise FormatError(
            "this is an HTML/XML page, not a checkpoint (a failed or login-walled download?)", file=file
        )
    if _is_pickle(head):
        raise RefusedError(f"refused: this is a Python pickle (PyTorch checkpoint?); {_PICKLE_ADVICE}", file=file)
    if head.startswith(b"PK\x03\x04") and _zip_holds_pickle(path):
        raise RefusedError(
            f"refused: this zip holds pickled data (PyTorch/TorchScript archive?); {_PICKLE_ADVICE}", file=file
        )


def _is_pickle(head: bytes) -> bool:
    # Protocol 2+ pickles start with PROTO (0x80), the protocol number, then an
    # opcode: FRAME (0x95) for protocols 4-5; for 2-3 the usual first opcodes
    # (EMPTY_DICT, EMPTY_LIST, MARK, GLOBAL, LONG1 of torch's legacy magic, ...).
    # A safetensors header length can start 0x80 0x02 too, followed by zeros.
    if len(head) < 3 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    return head[2] == 0x95 if head[1] >= 4 else head[2] in b"}](c\x8a\x8cK"


def _zip_holds_pickle(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(name.endswith((".pkl", "/data.pkl", ".pickle")) for name in z.namelist())
    except Exception:  # a damaged zip (BadZipFile, NotImplementedError, ...) holds no pickle we can see
        return False
