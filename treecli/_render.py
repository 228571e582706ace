"""Rich renderables for ``show`` and the JSON form. No I/O: callers print.

Every user string (key paths contain ``[``) goes into ``Text`` objects, never
through Rich markup. In plain mode (not a TTY, ``NO_COLOR``) the tree is
indented with spaces instead of box-drawing guides.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from treecli import _summary
from treecli._keypath import format_key
from treecli._summary import Node


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


def _shape(shape: tuple[int, ...]) -> str:
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


_STAT_COLUMNS = ("min", "max", "mean", "std", "nan", "inf", "zeros")


def _table(plain: bool, first: str, stats: bool) -> Table:
    table = Table(box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column(first, no_wrap=True, overflow="fold")
    table.add_column("shape", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    if stats:
        for name in _STAT_COLUMNS:
            table.add_column(name, justify="right", no_wrap=True)
    return table


def _row_cells(node: Node, stats: bool) -> list[Any]:
    if node.kind == "node":
        noun = "leaf" if node.num_leaves == 1 else "leaves"
        cells = [f"{node.num_leaves} {noun}", "", human_count(node.params), human_bytes(node.nbytes)]
    elif node.kind == "array":
        cells = [_shape(node.shape), node.dtype, human_count(node.params), human_bytes(node.nbytes)]
    else:
        cells = [Text("= " + _value(node.value)), _summary.value_type(node.value), "", ""]
    cells = [c if isinstance(c, Text) else Text(c) for c in cells]
    if stats:
        s = node.stats or {}
        cells += [Text(_stat(s.get(name)) if node.kind == "array" else "") for name in _STAT_COLUMNS]
    return cells


def tree_table(root: Node, *, depth: int | None = None, stats: bool = False, plain: bool = False) -> Table:
    """The tree of ``show``: one row per node, guides (or indentation) in the first column."""
    table = _table(plain, "key", stats)

    def add(node: Node, prefix: str, last: bool, level: int) -> None:
        if plain:
            lead, child_prefix = prefix, prefix + "  "
        else:
            lead = prefix + ("└── " if last else "├── ")
            child_prefix = prefix + ("    " if last else "│   ")
        name = Text(lead, style="dim")
        folded = node.kind == "node" and depth is not None and level >= depth
        name.append(format_key(node.key), style="bold" if node.kind == "node" else "")
        table.add_row(name, *_row_cells(node, stats))
        if node.kind == "node" and not folded:
            for i, child in enumerate(node.children):
                add(child, child_prefix, i == len(node.children) - 1, level + 1)

    if root.kind != "node":
        table.add_row(Text("<root>"), *_row_cells(root, stats))
    for i, child in enumerate(root.children):
        add(child, "", i == len(root.children) - 1, 1)
    return table


def flat_table(root: Node, *, stats: bool = False, plain: bool = False) -> Table:
    """``show --flat``: one row per leaf with its full key path."""
    table = _table(plain, "key path", stats)
    for node in _summary.leaves(root):
        table.add_row(Text(node.text_keypath or "<root>"), *_row_cells(node, stats))
    return table


def dtype_table(root: Node, *, plain: bool = False) -> Table:
    """Totals by dtype, for the bottom of ``show``."""
    table = Table(box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name, justify in (("dtype", "left"), ("arrays", "right"), ("params", "right"), ("size", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    rows = _summary.dtype_totals(root)
    for dtype, count, params, nbytes in rows:
        table.add_row(dtype, str(count), human_count(params), human_bytes(nbytes))
    if len(rows) > 1:
        table.add_row(Text("total", style="bold"), str(sum(r[1] for r in rows)),
                      human_count(root.params), human_bytes(root.nbytes))
    return table


def metadata_table(metadata: dict[str, Any], *, plain: bool = False) -> Table:
    table = Table(box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("metadata", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in metadata.items():
        table.add_row(Text(str(key)), Text(value if isinstance(value, str) else repr(value)))
    return table


def headline(file: str, fmt: str, root: Node) -> Text:
    arrays = sum(1 for n in _summary.leaves(root) if n.kind == "array")
    text = Text()
    text.append(file, style="bold")
    text.append(f"  {fmt} · {arrays} arrays · {human_count(root.params)} params · {human_bytes(root.nbytes)}")
    return text


def show_view(file: str, fmt: str, root: Node, metadata: dict[str, Any], *, flat: bool, depth: int | None,
              stats: bool, plain: bool, extra: list[Any] = ()) -> Group:
    """Everything ``show`` prints in human form."""
    parts: list[Any] = [headline(file, fmt, root), *extra, Text("")]
    if flat:
        parts.append(flat_table(root, stats=stats, plain=plain))
    else:
        parts.append(tree_table(root, depth=depth, stats=stats, plain=plain))
    if root.num_leaves:
        parts += [Text(""), dtype_table(root, plain=plain)]
    if metadata:
        parts += [Text(""), metadata_table(metadata, plain=plain)]
    return Group(*parts)


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
        "metadata": {k: _summary.json_value(v) if not isinstance(v, (dict, list)) else v for k, v in metadata.items()},
        "num_leaves": root.num_leaves,
        "total_params": root.params,
        "total_bytes": root.nbytes,
        "leaves": out_leaves,
    }

def info_text(info: dict[str, Any]) -> Text:
    """Extra facts a format reports (the steps of a CheckpointManager root, ...), one per line."""
    text = Text()
    for i, (key, value) in enumerate(info.items()):
        if i:
            text.append("\n")
        shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        text.append(f"{key}: ", style="bold")
        text.append(shown)
    return text
