"""The one object that prints: results on stdout, warnings/errors/progress on stderr.

Created per command from the current ``sys.stdout``/``sys.stderr`` (so tests
that swap the streams see everything). Plain output — no colour, no
box-drawing characters — when stdout is not a terminal or ``NO_COLOR`` is set;
on a terminal, lines carry bold/dim ANSI styles, and Rich draws progress bars
and other renderables.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
from typing import Any, Callable, Iterable, Iterator

from treecli._escape import all_printable, json_text, visible


class OutputClosed(Exception):
    """The reader of stdout went away (`treecli show big | head`): not an error.

    Raised instead of BrokenPipeError, which Click would turn into exit code 1.
    """


class Output:
    def __init__(self, quiet: bool = False):
        from treecli import _cluster

        self._no_color = bool(os.environ.get("NO_COLOR"))
        self.plain = self._no_color or not _isatty(sys.stdout)
        # In a run of several processes, process 0 speaks for all; the others say only errors.
        cluster = _cluster.current()
        self.silent = cluster is not None and not cluster.publishes
        self.quiet = quiet or self.silent
        self._consoles: dict[str, Any] = {}
        self._bar: Any = None  # the live progress display, while there is one

    # Rich is imported only for a terminal or a progress bar: piped output is
    # plain strings, and importing rich.console costs 40 ms of show's budget.
    @property
    def stdout(self):
        return self._console("stdout", sys.stdout, soft_wrap=False)

    @property
    def stderr(self):
        return self._console("stderr", sys.stderr, soft_wrap=True)

    def _console(self, name: str, stream: Any, soft_wrap: bool):
        if name not in self._consoles:
            from rich.console import Console

            self._consoles[name] = Console(file=stream, highlight=False, no_color=self._no_color,
                                           soft_wrap=soft_wrap)
        return self._consoles[name]

    def print(self, text: str) -> None:
        """One text for a person on stdout, as is apart from escaped terminal controls."""
        self.lines(text.split("\n"))

    def lines(self, lines: Iterable[str | list[tuple[str, str]]]) -> None:
        """Print lines, each a str or a list of ``(text, style)`` segments: plain text for pipes,
        styled on a terminal."""
        # In batches of 4096 lines: a terminal's stdout is line-buffered, and one write per
        # line was 333k system calls for a big tree.
        if self.silent:
            return
        if self.plain:
            lines = iter(lines)
            chunks = map(_visible_lines, iter(lambda: list(itertools.islice(lines, 4096)), []))
        else:
            # A terminal: Rich's console decides the width and the escape codes of each style;
            # the lines are laid out here (Rich's Text took a minute to lay out the 333k lines
            # of a 200k-tensor tree).
            console = self.stdout
            width, codes = console.width, _StyleCodes(console.color_system is not None)
            texts = (_styled(line, width, codes) + "\n" for line in lines)
            chunks = iter(lambda: "".join(itertools.islice(texts, 4096)), "")
        with _writing_stdout():
            for chunk in chunks:
                sys.stdout.write(chunk)

    def json(self, document: Any) -> None:
        if self.silent:
            return
        with _writing_stdout():
            sys.stdout.write(json_text(_indented_json(document)) + "\n")

    def warn(self, message: str) -> None:
        if self.silent:
            return
        sys.stderr.write(visible(f"treecli: warning: {message}") + "\n")

    def note(self, message: str) -> None:
        if not self.quiet:
            sys.stderr.write(visible(f"treecli: {message}") + "\n")

    @contextlib.contextmanager
    def progress(self, description: str, total_bytes: int, threshold: int = 64 << 20) -> Iterator[Callable[[int], None]]:
        """A byte-counting progress bar on stderr; yields ``advance(nbytes)``.

        Silent when stderr is not a terminal, with ``--quiet``, or for small work.
        """
        if self.quiet or total_bytes < threshold or not _isatty(sys.stderr):
            yield lambda n: None
            return
        if self._bar is not None:  # a stage inside another (verifying inside writing): a line of its own
            task = self._bar.add_task(visible(description), total=total_bytes)
            try:
                yield lambda n: self._bar.advance(task, n)
            finally:
                self._bar.remove_task(task)
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   _BinarySpeedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.stderr, transient=True) as bar:
            self._bar = bar
            task = bar.add_task(visible(description), total=total_bytes)
            try:
                yield lambda n: bar.advance(task, n)
            finally:
                self._bar = None


def _indented_json(document: Any) -> str:
    """``json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False)``, the same text.

    With an indent, ``json`` encodes in Python: 1.1 s for the 200k leaves of a big model's
    ``show --json``. Encoded compact (in C) and laid out by msgspec (which keeps every token
    as written, so numbers keep Python's spelling), 0.3 s. Text msgspec cannot take (a lone
    surrogate: a file name that is not UTF-8) goes the slow way."""
    compact = json.dumps(document, ensure_ascii=False, allow_nan=False)
    try:
        import msgspec

        return msgspec.json.format(compact, indent=2)
    except UnicodeEncodeError:
        return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False)


def _BinarySpeedColumn():
    """Speed in the binary units of the byte counts beside it (MiB/s next to GiB),
    where Rich's own speed column says MB/s."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    from treecli._units import human_bytes

    class Speed(ProgressColumn):
        def render(self, task: Any) -> Any:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(int(speed))}/s", style="progress.data.speed")

    return Speed()


class _StyleCodes(dict):
    """Style name -> (start, end) escape codes, as Rich renders them; empty without colour."""

    def __init__(self, enabled: bool):
        super().__init__()
        self._enabled = enabled

    def __missing__(self, style: str) -> tuple[str, str]:
        from rich.style import Style

        start, end = Style.parse(style).render("\0").split("\0") if self._enabled else ("", "")
        self[style] = (start, end)
        return start, end


def _visible_lines(lines: list[str | list[tuple[str, str]]]) -> str:
    """Lines as printed to a pipe: unstyled, each ended by a newline, with terminal controls
    escaped. Checked a batch at a time, in C, when none holds a control (a call per line was
    a fifth of the time of showing a 200k-tensor tree)."""
    if not set(map(type, lines)) <= {str}:
        lines = [line if type(line) is str else "".join(t for t, _ in line).rstrip() for line in lines]
    if all_printable("".join(lines)):
        return "\n".join(lines) + "\n"
    return "".join(visible(line) + "\n" for line in lines)


def _styled(line: str | list[tuple[str, str]], width: int, codes: _StyleCodes) -> str:
    """One line for a terminal: its segments with their styles, trailing blanks dropped,
    cut to ``width`` characters with an ellipsis when longer (as Rich's crop does)."""
    segments = [(visible(line), "")] if type(line) is str else [(visible(text), style) for text, style in line]
    length = len("".join(text for text, _ in segments).rstrip())
    if length <= width:  # the common case: nothing to cut
        return "".join(f"{codes[style][0]}{text}{codes[style][1]}" if style else text
                       for text, style in segments).rstrip()
    room = max(width - 1, 0)
    parts = []
    for text, style in segments:
        text = text[:room]
        room -= len(text)
        if text:
            parts.append(f"{codes[style][0]}{text}{codes[style][1]}" if style else text)
        if room <= 0:
            break
    return "".join(parts) + "…"


@contextlib.contextmanager
def _writing_stdout() -> Iterator[None]:
    """A reader that went away is not an error; a full disk behind `> file` is one."""
    try:
        yield
    except BrokenPipeError:
        raise OutputClosed from None
    except OSError as e:
        from treecli._errors import TreecliError

        raise TreecliError(f"cannot write standard output: {e.strerror or e}") from None


def _isatty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
