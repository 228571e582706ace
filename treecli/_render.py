"""What ``show`` prints: lines of styled cells, and the JSON form. No I/O.

Tables are laid out here rather than with ``rich.table.Table``: for a 70B
checkpoint (~3,000 rows) Rich's table layout alone took over a second, ten
times the whole budget of ``show``. A *line* is a plain str or a list of
``(text, style)`` segments; the output object prints them plain (pipes) or
styled (terminals).
User strings are never parsed as Rich markup (key paths contain ``[``).
"""

from __future__ import annotations

import itertools
import textwrap
from typing import Any, Callable, Iterable, Sequence

from treecli import _summary
from treecli._errors import counted
from treecli._escape import quote
from treecli._keypath import format_key
from treecli._units import human_bytes, human_count
from treecli._summary import Node

Segment = tuple[str, str]  # (text, Rich style)
Line = str | list[Segment]  # a str is an unstyled line


def fit_columns(header: list[str], rows: list[Sequence[Any]], width: int,
                droppable: Sequence[str]) -> tuple[list[str], list[Sequence[Any]], list[str]]:
    """Leave out columns, least useful first (``droppable`` in that order), until the
    table fits ``width`` characters; returns the header, the rows and what was left out."""
    def cell_len(c: Any) -> int:
        return len(c) if type(c) is str else sum(len(text) for text, _ in c)

    widths = [max(len(title), max((cell_len(r[i]) for r in rows), default=0)) for i, title in enumerate(header)]
    keep = list(range(len(header)))
    dropped: list[str] = []
    for name in droppable:
        if sum(widths[i] + 2 for i in keep) - 2 <= width or name not in header:
            continue
        keep.remove(header.index(name))
        dropped.append(name)
    if not dropped:
        return header, rows, []
    def pick(row: Sequence[Any]) -> tuple:
        return tuple(row[i] for i in keep)

    return list(pick(header)), [pick(r) for r in rows], dropped


def table(header: list[str], rows: list[Sequence[Any]], right: set[int] = frozenset()) -> Iterable[Line]:
    """Lay out rows of cells in aligned columns, lazily (a 333k-row table is formatted
    as it is printed, never held twice in memory).

    A cell is a str; the first cell of a row may instead be a list of segments (a
    styled key). Rows of plain strings give plain lines; otherwise the header is bold.
    """
    return keyed_table(header, [row[0] for row in rows], [row[1:] for row in rows], right)


def keyed_table(header: list[str], firsts: list[str | list[Segment]], other_cells: list[Sequence[str]],
                right: set[int] = frozenset()) -> Iterable[Line]:
    """``table`` of rows given as two columns: each row's first cell, and its other cells.
    Rows that show the same may share one sequence of other cells (``_cells_memo``): each
    distinct one is laid out once, and a line is its first cell, padded, and that text (333k
    rows of a big tree, ~2,000 distinct). Plain rows are joined by ``map`` (in C)."""
    distinct = list(dict(zip(map(id, other_cells), other_cells)).values())
    widths = [max(len(title), max((len(cells[i]) for cells in distinct), default=0))
              for i, title in enumerate(header[1:])]
    formats = [f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths, 1)]
    tail = "".join("  " + f for f in formats)
    tails = {id(cells): tail.format(*cells).rstrip() for cells in distinct}
    head_tail = tail.format(*header[1:]).rstrip()
    row_tails = map(tails.__getitem__, map(id, other_cells))
    pad = str.rjust if 0 in right else str.ljust
    if set(map(type, firsts)) <= {str}:
        width = max(len(header[0]), max(map(len, firsts), default=0))
        lines = map(str.__add__, map(pad, firsts, itertools.repeat(width)), row_tails)
        return itertools.chain([(pad(header[0], width) + head_tail).rstrip()], map(str.rstrip, lines))
    lengths = [len(c) if type(c) is str else sum(len(text) for text, _ in c) for c in firsts]
    width = max([len(header[0]), *lengths])
    head: Line = [(pad(header[0], width), "bold")]
    for f, title in zip(formats, header[1:]):
        head += [("  ", ""), (f.format(title), "bold")]

    def line(first: str | list[Segment], length: int, row_tail: str) -> Line:
        segments = [(first, "")] if type(first) is str else list(first)
        spaces = " " * (width - length)
        if 0 in right:
            return [(spaces, ""), *segments, (row_tail, "")]
        segments.append((spaces + row_tail, ""))
        return segments

    return itertools.chain([head], map(line, firsts, lengths, row_tails))


def changes_json(rows: Sequence[Sequence[str]], output: Any = None, skipped: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON of what a command changes (``slice``, ``edit``; dry run or not): every row
    ``(keypath, before, after, what)``, before/after described as ``diff`` describes a
    leaf (``"[2, 3] float32"``); ``output`` is the path written, or None for a dry run."""
    return {"output": None if output is None else str(output),
            "changed": [{"keypath": k, "before": b, "after": a, "what": w} for k, b, a, w in rows],
            "skipped": list(skipped)}


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


def _cells(node: Node, stats: bool, stored: bool = False) -> list[str]:
    """A row's cells; ``stored``: with the column of how it is stored (a quantized array's
    type and bytes on disk, an inner node's bytes on disk)."""
    if node.kind == "node":
        noun = "leaf" if node.num_leaves == 1 else "leaves"
        cells = [f"{node.num_leaves} {noun}", "", human_count(node.params), human_bytes(node.nbytes)]
        cells += [human_bytes(node.stored_nbytes)] if stored else []
    elif node.kind == "array":
        cells = [format_shape(node.shape), node.dtype, human_count(node.params), human_bytes(node.nbytes)]
        cells += [f"{node.stored} {human_bytes(node.stored_nbytes)}" if node.stored else
                  human_bytes(node.stored_nbytes)] if stored else []
    else:
        cells = ["= " + _value(node.value), _summary.value_type(node.value), "", ""] + ([""] if stored else [])
    if stats:
        s = node.stats or {}
        cells += [_stat(s.get(name)) if node.kind == "array" else "" for name in _STAT_COLUMNS]
    return cells


# Right-aligned: the numbers.
_RIGHT = {"params", "size", "stored", *_STAT_COLUMNS}


def _columns(root: Node, stats: bool) -> list[str]:
    """The columns after the key: ``stored`` where some array is stored otherwise than it
    reads (GGUF's quantized tensors), the statistics with ``stats``."""
    return [*_COLUMNS, *(["stored"] if root.any_stored_otherwise else []), *(_STAT_COLUMNS if stats else [])]


def _cells_memo(stats: bool, stored: bool) -> Callable[[Node], list[str]]:
    """``_cells`` for one table: without stats, rows that show the same share one list
    (most rows of a big tree repeat another's shape, dtype and sizes)."""
    shared: dict[tuple, list[str]] = {}

    def cells(node: Node) -> list[str]:
        if stats or node.kind == "value":
            return _cells(node, stats, stored)
        key = (node.shape, node.dtype, node.stored) if node.kind == "array" else (
            node.num_leaves, node.params, node.nbytes, node.stored_nbytes)
        found = shared.get(key)
        if found is None:
            found = shared[key] = _cells(node, False, stored)
        return found

    return cells


def _shapes(root: Node) -> dict[int, int]:
    """A small number per layout of inner node (``Node.layout``), equal for nodes of identical
    structure (keys, shapes, dtypes, value types, recursively): what folding compares. Each
    layout is described once, a leaf inline in its parent's description; nodes of one layout
    have one structure (values aside, which folding does not compare)."""
    ids: dict[tuple, int] = {}
    shape_of: dict[int, int] = {}

    def shape(node: Node) -> int:
        found = shape_of.get(node.layout)
        if found is None:
            signature = tuple((c.key, shape(c)) if c.kind == "node"
                              else (c.key, "array", c.shape, c.dtype, c.stored) if c.kind == "array"
                              else (c.key, "value", _summary.value_type(c.value)) for c in node.children)
            found = shape_of[node.layout] = ids.setdefault(signature, len(ids))
        return found

    shape(root)
    return shape_of


def _runs(children: list[Node], shape_of: dict[int, int]) -> list[list[Node]]:
    """Consecutive inner nodes with numbered keys (0, 1, 2, ...) and one structure, as
    runs to fold; every other child a run of one."""
    runs: list[list[Node]] = []
    for child in children:
        previous = runs[-1] if runs else None
        if (previous and child.kind == "node" and previous[-1].kind == "node"
                and shape_of[child.layout] == shape_of[previous[-1].layout]
                and str(child.key).isdigit() and str(previous[-1].key).isdigit()
                and int(child.key) == int(previous[-1].key) + 1):
            previous.append(child)
        else:
            runs.append([child])
    return runs


def _folded(run: list[Node]) -> Node:
    """One row for a run of identical siblings: their totals summed."""
    return Node(key=run[0].key, kind="node", children=run[0].children,
                nbytes=sum(n.nbytes for n in run), params=sum(n.params for n in run),
                num_leaves=sum(n.num_leaves for n in run), stored_nbytes=sum(n.stored_nbytes for n in run))


def tree_lines(root: Node, *, depth: int | None = None, stats: bool = False, plain: bool = False,
               fold: bool = False, width: int | None = None) -> Iterable[Line]:
    """The tree of ``show``: one row per node, guides (or indentation) before the key.

    ``fold``: siblings with numbered keys and identical structure (the 32 layers of a
    model) are one row, ``{0..31} ×32`` with their totals summed, over the structure
    shown once.
    """
    firsts: list[str | list[Segment]] = []  # the key column, and beside it the other cells
    other_cells: list[list[str]] = []
    cells = _cells_memo(stats, root.any_stored_otherwise)
    shape_of = _shapes(root) if fold else {}

    key_texts: dict[tuple[type, Any], str] = {}  # most keys repeat (weight, bias, 0 ... 255)

    def key_text(key: Any) -> str:
        text = key_texts.get((type(key), key))
        if text is None:
            text = key_texts[(type(key), key)] = format_key(key)
        return text

    # The rows below a node, once laid out, by its layout and where it stands: the same
    # layout at the same place shows the same rows again (a model's 61 layers, each with 256
    # experts: 333k rows, a few hundred distinct). Not with stats (each leaf its own) or
    # folding (rows of runs).
    laid_out: dict[tuple[int, str, int], tuple[int, int]] | None = None if stats or fold else {}

    def add_subtree(node: Node, prefix: str, level: int) -> None:
        if laid_out is None:
            add_children(node, prefix, level)
            return
        span = laid_out.get((node.layout, prefix, level))
        if span is None:
            start = len(firsts)
            add_children(node, prefix, level)
            laid_out[node.layout, prefix, level] = (start, len(firsts))
        else:
            firsts.extend(firsts[span[0]:span[1]])
            other_cells.extend(other_cells[span[0]:span[1]])

    # One call per inner node, not per row: 333k rows for a 200k-tensor header.
    def add_children(node: Node, prefix: str, level: int) -> None:
        if fold:
            shown = [(run[0], key_text(run[0].key)) if len(run) == 1
                     else (_folded(run), f"{{{run[0].key}..{run[-1].key}}} ×{len(run)}")
                     for run in _runs(node.children, shape_of)]
        else:
            shown = [(child, key_texts.get((type(child.key), child.key)) or key_text(child.key))
                     for child in node.children]
        deeper = depth is None or level < depth
        if plain:
            for child, key in shown:
                other_cells.append(cells(child))
                firsts.append(prefix + key)
                if deeper and child.kind == "node":
                    add_subtree(child, prefix + "  ", level + 1)
            return
        last_index = len(shown) - 1
        for i, (child, key) in enumerate(shown):
            other_cells.append(cells(child))
            last = i == last_index
            firsts.append([(prefix + ("└── " if last else "├── "), "dim"),
                           (key, "bold" if child.kind == "node" else "")])
            if deeper and child.kind == "node":
                add_subtree(child, prefix + ("    " if last else "│   "), level + 1)

    if root.kind != "node":
        firsts.append("<root>")
        other_cells.append(_cells(root, stats, root.any_stored_otherwise))
    add_children(root, "", 1)
    return _stats_table(["key", *_columns(root, stats)], firsts, other_cells, width)


def flat_lines(root: Node, *, stats: bool = False, width: int | None = None) -> Iterable[Line]:
    """``show --flat``: one row per leaf with its full key path."""
    cells = _cells_memo(stats, root.any_stored_otherwise)
    leaves = _summary.leaves_by_keypath(root)
    return _stats_table(["key path", *_columns(root, stats)],
                        [keypath or "<root>" for keypath, _ in leaves], [cells(node) for _, node in leaves], width)


# On a narrow terminal these go first (in this order), and a line says which, so that
# what is left fits whole instead of every row cropped to "…".
_LEAST_USEFUL = ["zeros", "params", "std", "size", "dtype", "shape"]


def _stats_table(header: list[str], firsts: list[Any], other_cells: list[list[str]],
                 width: int | None) -> Iterable[Line]:
    """The table of ``show``'s rows (``keyed_table``'s two columns); on a terminal (``width``),
    fitted to its width, saying what was left out."""
    right_aligned = _RIGHT
    dropped: list[str] = []
    if width:
        header, whole, dropped = fit_columns(header, [(first, *cells) for first, cells in zip(firsts, other_cells)],
                                             width, _LEAST_USEFUL)
        firsts, other_cells = [row[0] for row in whole], [row[1:] for row in whole]
    lines = keyed_table(header, firsts, other_cells, {i for i, name in enumerate(header) if name in right_aligned})
    return itertools.chain(lines, _left_out(dropped, width))


def _left_out(dropped: list[str], width: int | None) -> list[str]:
    """The line (wrapped to ``width``) that says which columns were left out to fit, if any."""
    if not dropped:
        return []
    said = f"(left out to fit: {', '.join(dropped)}; all in --json)"
    return textwrap.wrap(said, width, break_on_hyphens=False) if width else [said]


def dtype_lines(root: Node, totals: list[tuple[str, int, int, int]], width: int | None = None) -> Iterable[Line]:
    """Totals by dtype, or by stored type where some arrays are quantized
    (``_summary.dtype_totals``), for the bottom of ``show``; on a terminal
    (``width``), columns left out to fit it, as in the tree above."""
    rows = [[dtype, str(count), human_count(params), human_bytes(nbytes)] for dtype, count, params, nbytes in totals]
    if len(totals) > 1:
        rows.append([[("total", "bold")], str(sum(r[1] for r in totals)), human_count(root.params),
                     human_bytes(root.nbytes)])
    first = "stored" if root.any_stored_otherwise else "dtype"  # (a quantization is no dtype)
    header = [first, "arrays", "params", "size"]
    dropped: list[str] = []
    if width:
        header, rows, dropped = fit_columns(header, rows, width, ["params", "size", "arrays"])
    lines = table(header, rows, {i for i, name in enumerate(header) if name != first})
    return itertools.chain(lines, _left_out(dropped, width))


def metadata_lines(metadata: dict[str, Any], width: int | None = None) -> Iterable[Line]:
    """The metadata as a two-column table; on a terminal (``width``), a value too long for
    it goes on over the lines below, in its column."""
    rows = [[quote(str(k)), _clipped_value(v)] for k, v in metadata.items()]
    room = width - max(len("metadata"), *(len(k) for k, _ in rows)) - 2 if width and rows else 0
    if room >= 16:
        rows = [[key if i == 0 else "", value[start:start + room]]
                for key, value in rows for i, start in enumerate(range(0, max(len(value), 1), room))]
    return table(["metadata", "value"], rows)


_SHOWN_CHARS = 4096  # a metadata text longer than this (a whole tokenizer.json) shows its start


def _clipped_value(value: Any) -> str:
    if not isinstance(value, str):
        return repr(value)
    if len(value) <= _SHOWN_CHARS:
        return quote(value)
    return quote(value[:_SHOWN_CHARS]) + f"… ({len(value):,} characters)"


def headline(file: str, fmt: str, root: Node, totals: list[tuple[str, int, int, int]],
             separator: str = " · ", model: Any = None) -> Line:
    """The file, then its format, its model where the checkpoint names one (architecture,
    layers, vocabulary) and its totals, ``separator`` between them (piped: ASCII)."""
    arrays = sum(count for _, count, _, _ in totals)
    facts = [fmt, *(quote(fact) for fact in (model.facts() if model is not None else [])),
             counted(arrays, "array"), f"{human_count(root.params)} params", human_bytes(root.nbytes)]
    if root.any_stored_otherwise and root.params:  # (quantized: what it takes on disk, per weight)
        facts.append(f"{human_bytes(root.stored_nbytes)} stored, {8 * root.stored_nbytes / root.params:.2f} bits "
                     "per weight")
    return [(quote(file), "bold"), ("  " + separator.join(facts), "")]


def info_lines(info: dict[str, Any]) -> Iterable[Line]:
    """Extra facts a format reports (the steps of a CheckpointManager root, ...), one per line."""
    lines = []
    for key, value in info.items():
        shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        lines.append([(f"{key}: ", "bold"), (shown, "")])
    return lines


def _joined_to_fit(parts: list[str], separator: str, width: int) -> list[str]:
    """``parts`` joined by ``separator`` into as few lines of at most ``width`` as they go."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(separator) + len(part) <= width:
            lines[-1] += separator + part
        else:
            lines.append(part)
    return lines


def record_lines(record: dict[str, Any] | None, note: str) -> Iterable[Line]:
    """Where the weights came from, as their record says (``formats.parsed_record``): their
    root digest, the treecli that wrote them, the command, each input's root digest, and the
    earlier steps, oldest first; or ``note`` (why there is none), where there is none."""
    if record is None:
        return [[("record: ", "bold"), (quote(note), "")]] if note else []
    rows = [["root", record["root"]], ["written by", f"treecli {quote(record['treecli'])}"],
            ["command", quote(record["command"])]]
    rows += [["input", f"{quote(i['name'])}  {i['root'] or '(its root not taken: read in part, or remote)'}"]
             for i in record["inputs"]]
    for number, step in enumerate(record["history"], 1):
        rows.append([f"earlier {number}", f"{quote(step['command'])}  ->  {step['root']}"])
    return table(["record", ""], rows)


def show_lines(file: str, fmt: str, root: Node, metadata: dict[str, Any], info: dict[str, Any], *,
               flat: bool, depth: int | None, stats: bool, plain: bool, fold: bool = False,
               width: int | None = None, model: Any = None, record: Iterable[Line] = ()) -> Iterable[Line]:
    """Everything ``show`` prints in human form (chained lazily: a big tree is formatted as it prints)."""
    totals = _summary.dtype_totals(root)
    separator = ", " if plain else " · "
    head = headline(file, fmt, root, totals, separator, model)
    if width and sum(len(text) for text, _ in head) > width:  # the file on a line, the totals below it
        totals_text = head[1][0].strip().split(separator)
        name = head[0][0]  # a name longer than the line goes on over the next ones, never cropped
        head_lines = [[(name[i:i + width], "bold")] for i in range(0, len(name), width)]
        head_lines += [[(line, "")] for line in _joined_to_fit(totals_text, separator, width)]
    else:
        head_lines = [head]
    parts: list[Iterable[Line]] = [head_lines, info_lines(info), [[]]]
    parts.append(flat_lines(root, stats=stats, width=width) if flat else
                 tree_lines(root, depth=depth, stats=stats, plain=plain, fold=fold, width=width))
    if totals:  # (a tree of values only, a JSON item, has no dtypes to total)
        parts += [[[]], dtype_lines(root, totals, width)]
    if metadata:
        parts += [[[]], metadata_lines(metadata, width)]
    record = list(record)
    if record:
        parts += [[[]], record]
    return itertools.chain.from_iterable(parts)


# A metadata array or text longer than this shows its start and its length in --json.
_JSON_ITEMS, _JSON_CHARS = 256, 1 << 16


def _metadata_json(value: Any) -> Any:
    """A metadata value in ``--json``: a GGUF value as its type is (numbers as numbers, arrays
    as arrays), bounded: a longer array or text as ``{"length": n, "first": its start}``;
    any other as before."""
    if isinstance(value, (dict, list)):
        return value
    typed = getattr(value, "value", None)
    if typed is None or not hasattr(value, "kind"):
        return _summary.json_value(value)
    return _bounded(typed, value.kind)


def _bounded(value: Any, kind: int) -> Any:
    from treecli.formats import GGUF_ARRAY

    if kind == GGUF_ARRAY:
        item, items = value
        shown = [_bounded(v, item) for v in items[:_JSON_ITEMS]]
        return shown if len(items) <= _JSON_ITEMS else {"length": len(items), "first": shown}
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str) and len(value) > _JSON_CHARS:
        return {"length": len(value), "first": value[:_JSON_CHARS]}
    return _summary.json_value(value)


def show_json(file: str, fmt: str, root: Node, metadata: dict[str, Any], model: Any = None) -> dict[str, Any]:
    """The ``show --json`` document (DESIGN.md "Output conventions"); ``model`` where the
    checkpoint names one."""
    out_leaves = []
    for keypath, node in _summary.leaves_by_keypath(root):
        if node.kind == "array":
            entry: dict[str, Any] = {"keypath": keypath, "shape": list(node.shape), "dtype": node.dtype,
                                     "nbytes": node.nbytes, "stored_dtype": node.stored or node.dtype,
                                     "stored_nbytes": node.stored_nbytes}
            if node.stats is not None:
                entry["stats"] = {k: _summary.json_value(v) for k, v in node.stats.items()}
        elif node.kind == "value":
            entry = {"keypath": keypath, "type": _summary.value_type(node.value),
                     "value": _summary.json_value(node.value)}
        else:
            continue
        out_leaves.append(entry)
    return {
        "format": fmt,
        "file": file,
        **({"model": model.as_json()} if model is not None else {}),
        "metadata": {k: _metadata_json(v) for k, v in metadata.items()},
        "num_leaves": root.num_leaves,
        "total_params": root.params,
        "total_bytes": root.nbytes,
        "stored_bytes": root.stored_nbytes,
        "leaves": out_leaves,
    }
