"""What ``show`` prints: lines of styled cells, and the JSON form. No I/O.

Tables are laid out here rather than with ``rich.table.Table``: for a 70B
checkpoint (~3,000 rows) Rich's table layout alone took over a second, ten
times the whole budget of ``show``. A *line* is a list of ``(text, style)``
segments; the output object prints them plain (pipes) or styled (terminals).
User strings are never parsed as Rich markup (key paths contain ``[``).
"""

from __future__ import annotations

from typing import Any

from treecli import _summary
from treecli._keypath import format_key
from treecli._summary import Node

Segment = tuple[str, str]  # (text, Rich style)
Line = list[Segment]


def human_bytes(n: int) -> str:
    """``1.2 GiB``; exact below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError


def human_count(n: int) -> str:
    """``7.0 B`` (billions), ``139.6 K``; exact below 1000."""
    if n < 1000:
        return str(n)
    value = float(n)
    for unit in ("K", "M", "B", "T"):
        value /= 1000
        if value < 1000 or unit == "T":
            return f"{value:.1f} {unit}"
    raise AssertionError


def table(header: list[str], rows: list[list[Any]], right: set[int] = frozenset()) -> list[Line]:
    """Lay out rows of cells in aligned columns. A cell is a str or a list of segments."""
    if all(isinstance(cell, str) for row in rows for cell in row):
        # Unstyled (plain output): str.ljust is several times faster than segment lists.
        all_rows = [header, *rows]
        widths = [max(len(row[i]) for row in all_rows) for i in range(len(header))]
        return [[("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                            for i, (cell, w) in enumerate(zip(row, widths))), "")] for row in all_rows]
    all_rows = [[[(h, "bold")] for h in header]]
    all_rows += [[[(c, "")] if isinstance(c, str) else c for c in row] for row in rows]
    lengths = [[sum(len(t) for t, _ in cell) for cell in row] for row in all_rows]
    widths = [max(row[i] for row in lengths) for i in range(len(header))]
    lines = []
    for row, row_lengths in zip(all_rows, lengths):
        line: Line = []
        for i, (cell, length) in enumerate(zip(row, row_lengths)):
            pad = (" " * (widths[i] - length), "")
            if i:
                line.append(("  ", ""))
            if i in right:
                line.append(pad)
                line.extend(cell)
            else:
                line.extend(cell)
                line.append(pad)
        lines.append(line)
    return lines


def format_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _value(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _stat(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


_COLUMNS = ["shape", "dtype", "params", "size"]
_STAT_COLUMNS = ["min", "max", "mean", "std", "nan", "inf", "zeros"]


def _cells(node: Node, stats: bool) -> list[str]:
    if node.kind == "node":
        noun = "leaf" if node.num_leaves == 1 else "leaves"
        cells = [f"{node.num_leaves} {noun}", "", human_count(node.params), human_bytes(node.nbytes)]
    elif node.kind == "array":
        cells = [format_shape(node.shape), node.dtype, human_count(node.params), human_bytes(node.nbytes)]
    else:
        cells = ["= " + _value(node.value), _summary.value_type(node.value), "", ""]
    if stats:
        s = node.stats or {}
        cells += [_stat(s.get(name)) if node.kind == "array" else "" for name in _STAT_COLUMNS]
    return cells


def _right(stats: bool) -> set[int]:
    return {3, 4} | ({5, 6, 7, 8, 9, 10, 11} if stats else set())


def tree_lines(root: Node, *, depth: int | None = None, stats: bool = False, plain: bool = False) -> list[Line]:
    """The tree of ``show``: one row per node, guides (or indentation) before the key."""
    rows: list[list[Any]] = []

    def add(node: Node, prefix: str, last: bool, level: int) -> None:
        if plain:
            lead, child_prefix = prefix, prefix + "  "
        else:
            lead = prefix + ("└── " if last else "├── ")
            child_prefix = prefix + ("    " if last else "│   ")
        key = format_key(node.key)
        first = lead + key if plain else [(lead, "dim"), (key, "bold" if node.kind == "node" else "")]
        rows.append([first, *_cells(node, stats)])
        if node.kind == "node" and not (depth is not None and level >= depth):
            for i, child in enumerate(node.children):
                add(child, child_prefix, i == len(node.children) - 1, level + 1)

    if root.kind != "node":
        rows.append(["<root>", *_cells(root, stats)])
    for i, child in enumerate(root.children):
        add(child, "", i == len(root.children) - 1, 1)
    return table(["key", *_COLUMNS, *(_STAT_COLUMNS if stats else [])], rows, _right(stats))


def flat_lines(root: Node, *, stats: bool = False) -> list[Line]:
    """``show --flat``: one row per leaf with its full key path."""
    rows = [[node.text_keypath or "<root>", *_cells(node, stats)] for node in _summary.leaves(root)]
    return table(["key path", *_COLUMNS, *(_STAT_COLUMNS if stats else [])], rows, _right(stats))


def dtype_lines(root: Node) -> list[Line]:
    """Totals by dtype, for the bottom of ``show``."""
    totals = _summary.dtype_totals(root)
    rows = [[dtype, str(count), human_count(params), human_bytes(nbytes)] for dtype, count, params, nbytes in totals]
    if len(totals) > 1:
        rows.append([[("total", "bold")], str(sum(r[1] for r in totals)), human_count(root.params),
                     human_bytes(root.nbytes)])
    return table(["dtype", "arrays", "params", "size"], rows, {1, 2, 3})


def metadata_lines(metadata: dict[str, Any]) -> list[Line]:
    rows = [[str(k), v if isinstance(v, str) else repr(v)] for k, v in metadata.items()]
    return table(["metadata", "value"], rows)


def headline(file: str, fmt: str, root: Node) -> Line:
    arrays = sum(1 for n in _summary.leaves(root) if n.kind == "array")
    return [(file, "bold"), (f"  {fmt} · {arrays} arrays · {human_count(root.params)} params · "
                             f"{human_bytes(root.nbytes)}", "")]


def info_lines(info: dict[str, Any]) -> list[Line]:
    """Extra facts a format reports (the steps of a CheckpointManager root, ...), one per line."""
    lines = []
    for key, value in info.items():
        shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        lines.append([(f"{key}: ", "bold"), (shown, "")])
    return lines


def show_lines(file: str, fmt: str, root: Node, metadata: dict[str, Any], info: dict[str, Any], *,
               flat: bool, depth: int | None, stats: bool, plain: bool) -> list[Line]:
    """Everything ``show`` prints in human form."""
    lines = [headline(file, fmt, root), *info_lines(info), []]
    if flat:
        lines += flat_lines(root, stats=stats)
    else:
        lines += tree_lines(root, depth=depth, stats=stats, plain=plain)
    if root.num_leaves:
        lines += [[], *dtype_lines(root)]
    if metadata:
        lines += [[], *metadata_lines(metadata)]
    return lines


def show_json(file: str, fmt: str, root: Node, metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``show --json`` document (DESIGN.md "Output conventions")."""
    out_leaves = []
    for node in _summary.leaves(root):
        if node.kind == "array":
            entry: dict[str, Any] = {"keypath": node.text_keypath, "shape": list(node.shape),
                                     "dtype": node.dtype, "nbytes": node.nbytes}
            if node.stats is not None:
                entry["stats"] = {k: _summary.json_value(v) for k, v in node.stats.items()}
        elif node.kind == "value":
            entry = {"keypath": node.text_keypath, "type": _summary.value_type(node.value),
                     "value": _summary.json_value(node.value)}
        else:
            continue
        out_leaves.append(entry)
    return {
        "format": fmt,
        "file": file,
        "metadata": {k: v if isinstance(v, (dict, list)) else _summary.json_value(v) for k, v in metadata.items()},
        "num_leaves": root.num_leaves,
        "total_params": root.params,
        "total_bytes": root.nbytes,
        "leaves": out_leaves,
    }
