"""Error types. They carry data (file, key path, details); the CLI turns them
into one line ``treecli: error: FILE: KEYPATH: what is wrong`` and exit code 2."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

# Whose words an error uses for an option: the Python API's parameter names, or,
# inside the CLI's boundary, its flags (``drop_unsupported=True`` / ``--drop-unsupported``).
_SPEAKING_CLI = contextvars.ContextVar("treecli_speaking_cli", default=False)

# Flags whose spelling is not the parameter's with dashes.
_FLAGS = {"rules": "--index", "lambda_": "--lambda"}


@contextlib.contextmanager
def cli_voice() -> Iterator[None]:
    """Within this block, errors name options as the CLI spells them."""
    token = _SPEAKING_CLI.set(True)
    try:
        yield
    finally:
        _SPEAKING_CLI.reset(token)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 leaf``, ``2 leaves``: a count and its noun, agreeing."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def option(name: str, value: Any = True) -> str:
    """An option as the caller wrote it: ``force=True`` from Python, ``--force`` from the shell.

    ``value`` is what the option is given: ``True`` for a bare flag, ``False`` for
    its ``--no-`` form, else a value shown as Python shows it.
    """
    if not _SPEAKING_CLI.get():
        return f"{name}={value!r}"
    flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
    if value is True:
        return flag
    if value is False:
        return "--no-" + flag[2:]
    return f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {value}"


def in_cli(text: str) -> str:
    """``text`` inside the CLI (a hint about a flag the Python API has no twin of), else nothing."""
    return text if _SPEAKING_CLI.get() else ""


class TreecliError(Exception):
    """Base of every error treecli raises on purpose.

    Attributes:
        message: what is wrong, one line.
        file: the file (or directory) concerned, if any.
        keypath: the key path concerned (text form), if any.
        details: extra lines (a list of differing leaves, a caret line, ...),
            printed indented under the message; at most 20 are shown.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        keypath: str | None = None,
        details: Sequence[str] = (),
    ):
        self.message = message
        self.file = None if file is None else str(file)
        self.keypath = keypath
        self.details = list(details)
        super().__init__(self.headline())

    def headline(self) -> str:
        from treecli._escape import quote  # a file or key name may come from a hostile file

        parts = []
        if self.file is not None:
            parts.append(quote(self.file))
        if self.keypath is not None:
            parts.append(quote(self.keypath) if self.keypath else "<root>")
        parts.append(self.message)
        return ": ".join(parts)

    def with_file(self, file: str, replace: str | None = None) -> "TreecliError":
        """Attach the file when the raiser did not know it (or knew it as ``replace``,
        a temporary name the user never typed); returns self."""
        if self.file is None or (replace is not None and self.file.startswith(replace)):
            self.file = str(file)
            self.args = (self.headline(),)
        return self

    def with_keypath(self, keypath: str) -> "TreecliError":
        """Attach the key path when the raiser did not know it; returns self."""
        if self.keypath is None:
            self.keypath = keypath
            self.args = (self.headline(),)
        return self


class FormatError(TreecliError):
    """A file is not a valid checkpoint of its format (corrupt, truncated, hostile)."""


class RefusedError(FormatError):
    """A file treecli refuses on principle (a pickle: loading it can run code)."""


class KeyPathError(TreecliError):
    """A key path or pattern that does not resolve against a tree."""


class KeyPathSyntaxError(KeyPathError):
    """A key path or pattern that cannot be parsed."""

    def __init__(self, text: str, position: int, reason: str):
        self.text = text
        self.position = position
        super().__init__(
            f"bad key path {text!r} at character {position + 1}: {reason}",
            details=[text, " " * position + "^"],
        )


class StructureError(TreecliError):
    """Trees that should agree (average, diff) do not: key paths, shapes or dtypes."""


class UsageError(TreecliError):
    """A command-line argument or option value that makes no sense."""


class NotDurableError(TreecliError):
    """The output is in place, but syncing its directory (what makes the rename
    survive a power cut) failed. Not "nothing was written": the CLI exits 3."""

    def __init__(self, target: object, cause: OSError):
        super().__init__(f"written, but syncing its directory failed ({cause.strerror or cause}): the output is "
                         "in place; its durability is not confirmed", file=str(target))
