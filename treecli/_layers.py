"""``diff --by-layer``: how much each layer changed between two checkpoints of one tree
(what a merge or a fine-tune did), streaming one pair of leaves at a time.

Each float leaf present in both, of one shape, adds to its row ``‖a‖²`` and
``‖b − a‖²`` (in float64, chunk by chunk; a leaf whose dtypes differ, a model against
its bf16 cast, is read in the dtype holding both); a row's relative change is
``‖b − a‖ / ‖a‖``. Rows are per layer and per kind of module inside it (attention,
MLP, norms, other), and each layer's total over its kinds. A leaf's layer is the number
after ``layers``, ``blocks``, ``h`` or ``layer`` in its key path
(``model.layers.12.mlp.up_proj.weight`` is layer 12), or what the first group of
``layer_pattern`` (a regular expression searched in the key path's text) captures;
leaves outside every layer (embeddings, the head) are one row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from treecli import _dtypes, _keypath, _leaf, _tree
from treecli._combine import widened_pair
from treecli._errors import UsageError
from treecli._keypath import format_keypath

# Kinds of module by the names in a key path, the first that matches (a norm first:
# post_attention_layernorm is a norm).
_KINDS = (("norm", ("norm", "ln_", "ln1", "ln2")),
          ("attention", ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "qkv")),
          ("mlp", ("mlp", "ffn", "feed_forward", "gate_proj", "up_proj", "down_proj", "fc1", "fc2")))


@dataclass
class Row:
    layer: int | None  # None: outside every layer
    kind: str
    params: int = 0
    a_squares: float = 0.0
    change_squares: float = 0.0

    @property
    def relative_change(self) -> float | None:
        """``‖b − a‖ / ‖a‖``; None where ``a`` is all zeros."""
        if not self.a_squares:
            return None
        return math.sqrt(self.change_squares / self.a_squares) if math.isfinite(self.a_squares) else math.nan


@dataclass
class LayerReport:
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # key paths not compared, with why

    compared_in: dict[str, str] = field(default_factory=dict)  # key path -> dtype, where a's and b's differ

    @property
    def equal(self) -> bool:
        return not self.skipped and not self.compared_in and all(r.change_squares == 0 for r in self.rows)

    def layer_totals(self) -> list[Row]:
        """Each layer's change over all its kinds of module (kind ``total``), in layer order."""
        totals: dict[int | None, Row] = {}
        for r in self.rows:
            total = totals.setdefault(r.layer, Row(r.layer, "total"))
            total.params += r.params
            total.a_squares += r.a_squares
            total.change_squares += r.change_squares
        return list(totals.values())

    def as_json(self) -> dict[str, Any]:
        def number(x: float | None) -> Any:  # (JSON has no NaN: a leaf holding one changes by "nan")
            return x if x is None or math.isfinite(x) else str(x)

        def row(r: Row) -> dict[str, Any]:
            return {"layer": r.layer, "kind": r.kind, "params": r.params, "relative_change": number(r.relative_change)}

        return {"equal": self.equal, "rows": [row(r) for r in self.rows],
                "layers": [row(r) for r in self.layer_totals()], "compared_in": self.compared_in,
                "skipped": self.skipped}


def kind_of(text: str) -> str:
    """The kind of module a key path's leaf belongs to, by the names in it."""
    lowered = text.lower()
    return next((kind for kind, names in _KINDS if any(name in lowered for name in names)), "other")


def by_layer(a: Any, b: Any, *, layer_pattern: str | None = None, progress=None) -> LayerReport:
    """Per-layer, per-kind relative change from ``a`` to ``b`` (trees lined up by key-path text).

    Raises:
        UsageError: a ``layer_pattern`` that is no regular expression with a group.
    """
    from treecli._bytes import stream

    pattern = _keypath.layer_regex(layer_pattern)
    flat_b = _tree.by_text(b)
    rows: dict[tuple, Row] = {}
    report = LayerReport()
    for keypath, x in _tree.flatten(a):
        text = format_keypath(keypath)
        y = flat_b.get(text)
        if not (_leaf.is_array(x) and _leaf.is_array(y)):
            report.skipped.append(f"{text}: {'only in a' if y is None else 'not an array in both'}")
            continue
        x, y = _leaf.as_leaf(x), _leaf.as_leaf(y)
        if not _tree.same_layout(x, y):
            pair = widened_pair(x, y, text) if _dtypes.is_float(x.dtype_name) or _dtypes.is_float(y.dtype_name) \
                else None
            if pair is None:
                report.skipped.append(f"{text}: shapes or dtypes differ")
                continue
            x, y = pair
            report.compared_in[text] = x.dtype_name
        elif not _dtypes.is_float(x.dtype_name):
            report.skipped.append(f"{text}: not a float leaf")
            continue
        found = pattern.search(text)
        try:
            layer = int(found.group(1)) if found else None
        except (TypeError, ValueError):
            raise UsageError(f"--layer-pattern {layer_pattern!r} captured {found.group(1)!r} in {text}, not a "
                             "layer number") from None
        row = rows.setdefault((layer, kind_of(text)), Row(layer, kind_of(text)))
        row.params += x.size
        for cx, cy in stream.paired_chunks(x, y):
            import numpy as np

            wide = cx.astype(np.float64)
            row.a_squares += float(np.dot(wide, wide))
            change = cy.astype(np.float64) - wide
            row.change_squares += float(np.dot(change, change))
            if progress:
                progress(cx.nbytes + cy.nbytes)
    report.skipped.extend(f"{text}: only in b" for text in flat_b.keys() - set(_tree.by_text(a)))
    report.rows = sorted(rows.values(), key=lambda r: (r.layer is None, r.layer or 0, r.kind))
    return report
