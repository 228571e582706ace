"""The key-path language: parse, format and glob-match key paths.

A *key path* addresses a node inside a tree. As a tuple it is the sequence of
keys from the root: ``str`` for dict keys, ``int`` for sequence indices (and the
rare int dict key). As text it is segments joined by ``.``::

    params.dense.kernel        model.layers.0.self_attn.q_proj.weight
    model["a.b"].weight        opt_state[0].mu          ['params']['dense']

Parsing gives a *pattern*: a tuple of ``Segment``. A bare integer segment
(``layers.0``) matches a sequence index or a string key spelled that way,
whichever the node has; ``[0]`` means a sequence index only and ``["0"]`` a
string key only. ``*`` matches within one segment, ``**`` zero or more segments.

This module has no dependencies: the CLI's start-up and completion use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

from treecli._errors import KeyPathSyntaxError, UsageError
from treecli._escape import is_safe, json_text

KeyPath = tuple  # tuple[str | int, ...]

# Characters that force a key into brackets and quotes when formatted.
_PLAIN_KEY = re.compile(r"[^.=*\[\]\"'\s]+")
_DIGITS = re.compile(r"-?[0-9]+")
MAX_INDEX_DIGITS = 19  # no sequence or array axis has 10**19 items: longer integers are refused, never converted
_DIGIT_RUNS = re.compile(r"([0-9]+)")  # ASCII digits only: '²'.isdigit() but int('²') fails


@dataclass(frozen=True)
class Segment:
    """One parsed segment of a key path or pattern.

    kind is one of: ``key`` (a string key, literal), ``index`` (a sequence
    index, ``[0]``), ``bare`` (a bare integer: index or string key), ``glob``
    (a segment containing ``*``), ``any`` (``**``).
    """

    kind: str
    value: str | int

    def matches(self, key: str | int) -> bool:
        """Whether this single segment matches one key of a tree node."""
        if self.kind == "key":
            return isinstance(key, str) and key == self.value
        if self.kind == "index":
            return isinstance(key, int) and key == self.value
        if self.kind == "bare":  # value is the digits as typed: "0" matches index 0 and key "0"
            return (key if isinstance(key, str) else str(key)) == self.value
        if self.kind == "glob":
            return _glob_regex(self.value).fullmatch(str(key)) is not None
        raise ValueError(f"segment {self} matches sequences of keys, not one key")


Pattern = tuple  # tuple[Segment, ...]


# A layer's number in a key path's text: what follows ``layers``, ``blocks``, ``h`` or ``layer``
# (``model.layers.12.mlp.up_proj.weight`` is layer 12).
LAYER_PATTERN = r"(?:^|\.)(?:layers|blocks|h|layer)\.(\d+)(?:\.|$)"
# The embedding matrices whose rows are a model's vocabulary (Llama, GPT-2, BERT, Meta's own names).
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")


def layer_regex(pattern: str | None, what: str = "--layer-pattern") -> re.Pattern:
    """``pattern`` (default ``LAYER_PATTERN``) compiled: a regular expression searched in a
    key path's text whose first group captures the layer number."""

    try:
        compiled = re.compile(pattern or LAYER_PATTERN)
    except re.error as e:
        raise UsageError(f"{what} {pattern!r}: {e}") from None
    if compiled.groups < 1:
        raise UsageError(f"{what} {pattern!r} must capture the layer number in a group")
    return compiled


@lru_cache(maxsize=1024)
def _glob_regex(glob: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")), re.DOTALL)


# ---------------------------------------------------------------------------
# format


def plain_key(key: object) -> str | int:
    """A key as treecli spells it: ``str`` and ``int`` as they are, and JAX's key-path
    entries by what they hold (``GetAttrKey('mu')`` -> ``"mu"``, ``SequenceKey(0)`` -> ``0``,
    ``DictKey('a')`` -> ``"a"``), so that a path in memory reads like the same path on disk."""
    if isinstance(key, (str, int)):
        return key
    for attribute in ("name", "key", "idx"):  # GetAttrKey, DictKey / FlattenedIndexKey, SequenceKey
        value = getattr(key, attribute, None)
        if isinstance(value, (str, int)):
            return value
    return str(key)


@lru_cache(maxsize=1 << 16, typed=True)  # keys repeat: "weight" 200k times in a big checkpoint
def format_key(key: str | int) -> str:
    """Format one key as it appears in a key path (without the joining dot)."""
    if isinstance(key, int):
        return str(key)
    if _PLAIN_KEY.fullmatch(key) and is_safe(key):
        return key
    # JSON escapes C0 controls, quotes and backslashes; the terminal controls it leaves
    # raw (DEL, C1, bidi) become \u escapes too, which parse back to the same key.
    return "[" + json_text(json.dumps(key, ensure_ascii=False)) + "]"


def format_keypath(keypath: Sequence[str | int]) -> str:
    """Format a key path tuple as text: ``("model", "layers", "0")`` -> ``model.layers.0``.

    A JAX key path (``jax.tree_util.tree_flatten_with_path``) formats the same
    way: ``(GetAttrKey('layers'), SequenceKey(0), GetAttrKey('bias'))`` -> ``layers.0.bias``.

    Keys that contain ``.``, ``=``, ``*``, brackets, quotes, white space or
    terminal controls, or are empty, are written in brackets and quotes, with
    JSON escapes: ``model["a.b"].weight``, ``["\\u202egnp.exe"]``.
    The empty key path (the root) formats as ``""``.
    """
    out: list[str] = []
    for key in keypath:
        text = format_key(key if isinstance(key, (str, int)) else plain_key(key))
        if out and not text.startswith("["):
            out.append(".")
        out.append(text)
    return "".join(out)


# ---------------------------------------------------------------------------
# parse


def parse(text: str) -> Pattern:
    """Parse a key path or pattern into a tuple of :class:`Segment`.

    Accepts the dotted form (``a.b.0``), brackets with quoted keys or integer
    indices (``a["x.y"][0]``) and JAX's ``keystr`` forms (``['a']['b'][0]``,
    ``.layers[0].bias``).

    Raises:
        KeyPathSyntaxError: with the position of the offending character.
    """
    segments: list[Segment] = []
    i, n = 0, len(text)
    if n == 0:
        return ()
    expect_segment = True  # at the start, or just after a dot
    if text[0] == "." and n > 1 and text[1] not in ".[":
        i = 1  # JAX's keystr writes an attribute first as `.layers[0].bias`
    while i < n:
        ch = text[i]
        if ch == "[":
            segment, i = _parse_bracket(text, i)
            segments.append(segment)
            expect_segment = False
        elif ch == ".":
            if expect_segment:
                raise KeyPathSyntaxError(text, i, "empty segment (quote an empty key as [\"\"])")
            i += 1
            expect_segment = True
            if i == n:
                raise KeyPathSyntaxError(text, i, "key path ends with '.'")
        else:
            if not expect_segment:
                raise KeyPathSyntaxError(text, i, "expected '.' or '[' between segments")
            j = i
            while j < n and text[j] not in ".[":
                if text[j] in "]\"'=" or text[j].isspace():
                    raise KeyPathSyntaxError(
                        text, j, f"{text[j]!r} is not allowed in a bare key; quote the key as [\"...\"]"
                    )
                j += 1
            segments.append(_bare_segment(text[i:j]))
            i = j
            expect_segment = False
    return tuple(segments)


def _bare_segment(word: str) -> Segment:
    if word == "**":
        return Segment("any", "**")
    if "*" in word:
        return Segment("glob", word)
    if _DIGITS.fullmatch(word):
        return Segment("bare", word)
    return Segment("key", word)


def _parse_bracket(text: str, start: int) -> tuple[Segment, int]:
    """Parse ``[...]`` at ``text[start]``; return the segment and the index after ``]``."""
    i = start + 1
    n = len(text)
    if i < n and text[i] in "\"'":
        quote = text[i]
        j = i + 1
        chars: list[str] = []
        while j < n and text[j] != quote:
            if text[j] == "\\":
                if j + 1 >= n:
                    break
                esc = text[j + 1]
                if quote == '"':
                    # JSON escapes, as format_key writes them.
                    if esc == "u":
                        try:
                            chars.append(chr(int(text[j + 2 : j + 6], 16)))
                        except ValueError:
                            raise KeyPathSyntaxError(text, j, "bad \\u escape") from None
                        j += 6
                        continue
                    mapping = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/"}
                    chars.append(mapping.get(esc, esc))
                else:
                    chars.append(esc)
                j += 2
                continue
            chars.append(text[j])
            j += 1
        if j >= n:
            raise KeyPathSyntaxError(text, start, "unterminated quoted key")
        if j + 1 >= n or text[j + 1] != "]":
            raise KeyPathSyntaxError(text, j + 1, "expected ']' after the quoted key")
        return Segment("key", "".join(chars)), j + 2
    j = text.find("]", i)
    if j < 0:
        raise KeyPathSyntaxError(text, start, "unterminated '['")
    inner = text[i:j].strip()
    if not _DIGITS.fullmatch(inner):
        raise KeyPathSyntaxError(text, i, "expected an integer index or a quoted key inside [...]")
    if len(inner.lstrip("0")) > MAX_INDEX_DIGITS:
        raise KeyPathSyntaxError(text, i, "index too large for any sequence")
    return Segment("index", int(inner)), j + 1


def split_assignment(text: str) -> tuple[str, str]:
    """Split ``KEYPATH=VALUE`` at the first ``=`` outside brackets and quotes.

    Raises:
        KeyPathSyntaxError: when there is no such ``=``.
    """
    depth, quote = 0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'" and depth:
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "=" and depth == 0:
            return text[:i], text[i + 1 :]
        i += 1
    raise KeyPathSyntaxError(text, len(text), "expected KEYPATH=VALUE")


# ---------------------------------------------------------------------------
# match


def is_literal(pattern: Pattern) -> bool:
    """True when the pattern has no ``*`` or ``**``: it names one key path."""
    return all(seg.kind in ("key", "index", "bare") for seg in pattern)


def matches(pattern: Pattern, keypath: Sequence[str | int]) -> bool:
    """Whether the pattern matches exactly this key path (all of it)."""
    return _matched_prefixes(tuple(pattern), tuple(keypath))[-1]


def covers(pattern: Pattern, keypath: Sequence[str | int]) -> bool:
    """Whether the pattern matches the key path or one of its ancestors.

    A pattern that names an inner node covers every leaf under it.
    """
    return any(_matched_prefixes(tuple(pattern), tuple(keypath)))


def _matched_prefixes(pattern: tuple, keypath: tuple) -> list[bool]:
    """For each ``k`` from 0 to ``len(keypath)``: whether ``pattern`` matches ``keypath[:k]``.
    One pass per segment over the positions reached so far (no recursion, so a pattern of
    thousands of segments is no deeper than one of three; time is segments x keys)."""
    reached = [True] + [False] * len(keypath)
    for segment in pattern:
        if segment.kind == "any":  # zero or more keys: every position from the first reached
            first = reached.index(True) if True in reached else len(reached)
            reached = [k >= first for k in range(len(reached))]
        else:
            reached = [False] + [reached[k] and segment.matches(key) for k, key in enumerate(keypath)]
        if not any(reached):
            break
    return reached


@lru_cache(maxsize=1 << 16)  # keys repeat: "weight" 200k times in a big checkpoint
def natural_sort_key(key: str | int) -> tuple:
    """Sort key for display order: ``layers.2`` before ``layers.10``."""
    if isinstance(key, int):
        return (0, key, "")
    # Text and digit runs alternate, text first, so each position compares like with like;
    # a digit run sorts by value, then by spelling ("01" and "1" still get an order).
    parts = _DIGIT_RUNS.split(key)
    # (by length, then spelling, of the digits without leading zeros: a number's order without
    # int(), which refuses runs over 4300 digits and costs more)
    parts[1::2] = [(len(p.lstrip("0")), p.lstrip("0"), p) for p in parts[1::2]]
    return (1, 0, tuple(parts))


def closest(wanted: str, candidates: Iterable[str], limit: int = 3) -> list[str]:
    """The candidates closest to ``wanted`` in spelling, best first."""
    import difflib

    pool = list(dict.fromkeys(candidates))
    found = difflib.get_close_matches(wanted, pool, n=limit, cutoff=0.4)
    if not found:
        # Fall back on shared prefixes: `model.layer.3` -> `model.layers.3...`
        head = wanted.split(".")[0]
        found = [c for c in pool if c.startswith(head)][:limit]
    return found


def match_prefix_with_captures(pattern: Pattern, keypath: Sequence[str | int]) -> tuple[int, list] | None:
    """The shortest prefix of ``keypath`` the pattern matches, with what ``*`` and ``**`` captured.

    Returns ``(prefix length, captures)`` — a key for each ``*``, a tuple of keys
    for each ``**``, in pattern order — or ``None``.
    """
    keypath = tuple(keypath)

    def walk(p: int, k: int, captured: list) -> list | None:
        if p == len(pattern):
            return captured + [k]
        seg = pattern[p]
        if seg.kind == "any":
            for end in range(k, len(keypath) + 1):
                found = walk(p + 1, end, captured + [keypath[k:end]])
                if found is not None:
                    return found
            return None
        if k < len(keypath) and seg.matches(keypath[k]):
            return walk(p + 1, k + 1, captured + ([keypath[k]] if seg.kind == "glob" else []))
        return None

    found = walk(0, 0, [])
    return None if found is None else (found[-1], found[:-1])


def fill_template(template: Pattern, captures: list, text: str) -> tuple:
    """The key path ``template`` names, with its ``*`` / ``**`` replaced by ``captures`` in order.

    Raises:
        KeyPathSyntaxError: the template has more wildcards than the pattern captured.
    """
    out: list = []
    remaining = list(captures)
    for seg in template:
        if seg.kind in ("any", "glob"):
            if seg.kind == "glob" and seg.value != "*":
                raise KeyPathSyntaxError(text, 0, "a rename target may use * and ** only as whole segments")
            if not remaining:
                raise KeyPathSyntaxError(text, 0, "the target has more * / ** than the pattern captures")
            value = remaining.pop(0)
            out.extend(value if isinstance(value, tuple) else (value,))
        elif seg.kind == "index":
            out.append(seg.value)
        else:
            out.append(seg.value)  # keys, and bare digits as string keys ("layers.0")
    return tuple(out)
