"""The one object that prints: Rich on stdout, warnings/errors/progress on stderr.

Created per command from the current ``sys.stdout``/``sys.stderr`` (so tests
that swap the streams see everything). Plain output — no colour, no
box-drawing characters — when stdout is not a terminal or ``NO_COLOR`` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable, Iterator

from rich.console import Console


class Output:
    def __init__(self, quiet: bool = False):
        no_color = bool(os.environ.get("NO_COLOR"))
        self.stdout = Console(file=sys.stdout, highlight=False, no_color=no_color, soft_wrap=False)
        self.plain = not self.stdout.is_terminal or no_color
        self.stderr = Console(file=sys.stderr, highlight=False, no_color=no_color, soft_wrap=True)
        self.quiet = quiet

    def print(self, renderable: Any) -> None:
        self.stdout.print(renderable, markup=False)

    def lines(self, lines: list[list[tuple[str, str]]]) -> None:
        """Print lines of ``(text, style)`` segments: plain text for pipes, styled on a terminal."""
        if self.plain:
            sys.stdout.write("".join("".join(t for t, _ in line).rstrip() + "\n" for line in lines))
            return
        from rich.text import Text

        text = Text(no_wrap=True, overflow="ellipsis", end="\n")
        for i, line in enumerate(lines):
            if i:
                text.append("\n")
            for segment, style in line:
                text.append(segment, style or None)
        self.stdout.print(text, markup=False, crop=True)

    def json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n")

    def warn(self, message: str) -> None:
        sys.stderr.write(f"treecli: warning: {message}\n")

    def note(self, message: str) -> None:
        if not self.quiet:
            sys.stderr.write(f"treecli: {message}\n")

    @contextlib.contextmanager
    def progress(self, description: str, total_bytes: int, threshold: int = 64 << 20) -> Iterator[Callable[[int], None]]:
        """A byte-counting progress bar on stderr; yields ``advance(nbytes)``.

        Silent when stderr is not a terminal, with ``--quiet``, or for small work.
        """
        if self.quiet or not self.stderr.is_terminal or total_bytes < threshold:
            yield lambda n: None
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.stderr, transient=True) as bar:
            task = bar.add_task(description, total=total_bytes)
            yield lambda n: bar.advance(task, n)
