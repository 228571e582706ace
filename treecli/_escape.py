"""Text that came from a file, made safe for a terminal.

A tensor name, a metadata value, an Orbax key or a shard's file name may hold
terminal controls: ESC sequences that retitle the window or clear the screen,
OSC 8 links, C1 controls (U+009B is a one-character CSI), a lone CR that
overwrites the line, bidi controls that show a name reversed ("Trojan Source").
Every such character is shown as an escape (``\\x1b``, ``\\u202e``):

- ``quote`` for a value on its own (a file name, a metadata value): a text that
  needs escapes is shown in double quotes, with ``\\`` and ``"`` escaped too,
  so it cannot be mistaken for a text that spells the escape (as ``git`` and
  ``ls`` quote file names);
- ``visible`` as the last pass over every line treecli prints for a person,
  whatever it holds;
- ``json_text`` for ``--json``: the same characters as JSON ``\\u`` escapes,
  so the document decodes to exactly the original strings.

No dependencies: the error boundary and ``show`` use it.
"""

from __future__ import annotations

import re

# C0 controls (newline and tab included: one printed line is one line), DEL, C1
# controls, the Arabic letter mark, LRM/RLM, line and paragraph separators, and
# the bidi embeddings, overrides and isolates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _json_escape(match: re.Match) -> str:
    return f"\\u{ord(match.group()):04x}"


_ASCII_CONTROLS = tuple(map(chr, [*range(0x20), 0x7F]))


def all_printable(text: str) -> bool:
    """Whether a long ``text`` is all printable (``str.isprintable``): an ASCII one (a flag
    Python keeps) is searched for its 33 controls, a memchr each, 7x faster than that."""
    if text.isascii():
        return not any(control in text for control in _ASCII_CONTROLS)
    return text.isprintable()


def is_safe(text: str) -> bool:
    return text.isprintable() or _UNSAFE.search(text) is None  # isprintable: the fast path, in C


def visible(text: str) -> str:
    """``text`` with every terminal control shown as an escape."""
    return text if is_safe(text) else _UNSAFE.sub(_escape, text)


def quote(text: str) -> str:
    """``text`` as is when it is safe, else double-quoted with its controls, ``\\`` and ``"`` escaped."""
    if is_safe(text):
        return text
    return '"' + _UNSAFE.sub(_escape, text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def clipped(text: str, limit: int = 60) -> str:
    """At most ``limit`` characters of ``text`` (a value quoted in a message), the rest counted."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def clipped_middle(text: str, limit: int) -> str:
    """``text`` in at most about ``limit`` characters, its start and its end kept (a message's
    end says what is wrong), what lies between counted."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} ... ({len(text) - head - tail:,} characters) ... {text[-tail:]}"


def json_text(document: str) -> str:
    """A JSON document with the controls JSON leaves raw (DEL, C1, bidi) escaped as ``\\uXXXX``."""
    # JSON escapes every C0 control in its strings: in an ASCII document (a flag Python keeps)
    # only DEL is left to look for, in one memchr (a big model's 34 MB document took 0.1 s so).
    if document.isascii() and "\x7f" not in document:
        return document
    return document if is_safe(document.replace("\n", "")) else _UNSAFE.sub(
        lambda m: m.group() if m.group() == "\n" else _json_escape(m), document)
