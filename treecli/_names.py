"""Name patterns that can be reversed: a regular expression matched against a leaf's
whole name, literal outside its ``(groups)`` (``.`` is the key path's dot), with ``{i}``
for a layer's or an expert's number; and the template its matches become (``\\1`` for a
group, ``{i}`` for the number). :class:`Mapping` pairs them, and its :meth:`~Mapping.inverse`
swaps them: ``model.layers.(\\d+).mlp.up_proj.weight`` -> ``blk.\\1.ffn_up.weight`` becomes
``blk.(\\d+).ffn_up.weight`` -> ``model.layers.\\1.mlp.up_proj.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from treecli._errors import UsageError

INDEX = "{i}"
_LITERAL = re.compile(r"[A-Za-z0-9_\-/:@ ]")



@dataclass(frozen=True)
class _Name:
    """A pattern or template taken apart: literal text, groups (their regex), the index."""

    parts: tuple[tuple[str, str], ...]  # ("text", "..."), ("group", regex or number), ("index", "")

    def regex(self) -> re.Pattern:
        out, number = [], 0
        for kind, value in self.parts:
            if kind == "group":
                number += 1
                out.append(f"(?P<g{number}>{value})")
            else:
                out.append(re.escape(value) if kind == "text" else r"(?P<i>0|[1-9][0-9]*)")
        return re.compile("".join(out))

    def fill(self, groups: Sequence[str], index: int | None = None) -> str:
        return "".join(value if kind == "text" else str(index) if kind == "index" else groups[int(value) - 1]
                       for kind, value in self.parts)

    def instance(self, groups: Sequence[str]) -> str:
        """The name a pattern matches with these groups (a pattern's groups in order)."""
        filled, number = [], 0
        for kind, value in self.parts:
            number += kind == "group"
            filled.append(value if kind == "text" else groups[number - 1])
        return "".join(filled)

    def groups(self) -> list[str]:
        return [value for kind, value in self.parts if kind == "group"]

    def has_index(self) -> bool:
        return any(kind == "index" for kind, _ in self.parts)


def pattern(text: str, what: str) -> _Name:
    """A name pattern: literal text, ``(groups)`` and ``{i}``."""
    parts, literal, at = [], [], 0

    def flush() -> None:
        if literal:
            parts.append(("text", "".join(literal)))
            literal.clear()

    while at < len(text):
        char = text[at]
        if text.startswith(INDEX, at):
            flush()
            parts.append(("index", ""))
            at += len(INDEX)
        elif char == "\\" and at + 1 < len(text) and not text[at + 1].isalnum():
            literal.append(text[at + 1])
            at += 2
        elif char == "." or _LITERAL.fullmatch(char):
            literal.append(char)
            at += 1
        elif char == "(":
            flush()
            end = _group_end(text, at, what)
            body = text[at + 1 : end]
            try:
                re.compile(body)
            except re.error as e:
                raise UsageError(f"{what}: group ({body}) is no regular expression: {e}") from None
            parts.append(("group", body))
            at = end + 1
        else:
            raise UsageError(f"{what}: {text!r}: outside (groups) a name pattern is literal text, and "
                             f"{char!r} is not (escape it as \\{char})")
    flush()
    return _Name(tuple(parts))


def _group_end(text: str, start: int, what: str) -> int:
    depth, at, in_class = 0, start, False
    while at < len(text):
        char = text[at]
        if char == "\\":
            at += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return at
        at += 1
    raise UsageError(f"{what}: {text!r}: a ( without its )")


def _template(text: str, groups: int, what: str) -> _Name:
    """A template: literal text, ``\\1``... for a pattern's groups, ``{i}`` for the index."""
    parts, literal, at = [], [], 0
    while at < len(text):
        found = re.match(r"\\([1-9][0-9]*)", text[at:])
        if found or text.startswith(INDEX, at):
            if literal:
                parts.append(("text", "".join(literal)))
                literal.clear()
            if found:
                if int(found.group(1)) > groups:
                    raise UsageError(f"{what}: {text!r} names group \\{found.group(1)}; the pattern has {groups}")
                parts.append(("group", found.group(1)))
                at += found.end()
            else:
                parts.append(("index", ""))
                at += len(INDEX)
        else:
            literal.append(text[at + 1] if text[at] == "\\" and at + 1 < len(text) else text[at])
            at += 2 if text[at] == "\\" and at + 1 < len(text) else 1
    if literal:
        parts.append(("text", "".join(literal)))
    return _Name(tuple(parts))


@dataclass(frozen=True)
class Mapping:
    """A pattern and the template its matches become; :meth:`inverse` swaps them."""

    pattern: str
    template: str
    what: str

    def __post_init__(self) -> None:
        source = pattern(self.pattern, self.what)
        target = _template(self.template, len(source.groups()), self.what)
        used = sorted(int(v) for k, v in target.parts if k == "group")
        if used != list(range(1, len(source.groups()) + 1)):
            raise UsageError(f"{self.what}: {self.pattern!r} -> {self.template!r}: use each group once, so that it "
                             "can be reversed")
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_regex", source.regex())

    def match(self, name: str) -> re.Match | None:
        return self._regex.fullmatch(name)

    def rendered(self, found: re.Match, index: int | None = None) -> str:
        groups = [found.group(f"g{n}") for n in range(1, len(self._source.groups()) + 1)]
        if index is None and self._source.has_index():
            index = int(found.group("i"))
        return self._target.fill(groups, index)

    def inverse(self) -> "Mapping":
        regexes = self._source.groups()
        order = [int(v) for k, v in self._target.parts if k == "group"]  # the old group numbers, in the new order
        pattern = "".join(re.sub(r"([^A-Za-z0-9_\-/:@ .])", r"\\\1", v) if k == "text" else
                          f"({regexes[int(v) - 1]})" if k == "group" else INDEX for k, v in self._target.parts)
        template, number = [], 0
        for kind, value in self._source.parts:
            if kind == "group":
                number += 1
                template.append(f"\\{order.index(number) + 1}")
            else:
                template.append(INDEX if kind == "index" else value.replace("\\", "\\\\"))
        return Mapping(pattern, "".join(template), self.what)
