"""``diff --by-layer --plot FILE.png``: the relative change per layer, one line per kind
of module, drawn with matplotlib (an optional extra: ``pip install 'treecli[plot]'``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from treecli._errors import UsageError


def check_target(target: str) -> None:
    """Refuse, before any work, a plot that would replace a file or cannot be drawn."""
    path = Path(target)
    if path.suffix.lower() != ".png":
        raise UsageError(f"--plot {target!r}: name a .png file")
    if os.path.lexists(path):  # (a dangling symlink too: writing would follow it somewhere else)
        raise UsageError(f"--plot {target!r}: the file exists; remove it or name another")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {target!r}: the directory {str(path.parent)!r} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"--plot {target!r}: the directory {str(path.parent)!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot draws with matplotlib, which is not installed: pip install 'treecli[plot]'")


def draw_layers(report: Any, target: str, title: str) -> None:
    """One line per kind of module over the layers (the leaves outside every layer are a
    point at the left, marked "–"), written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window
    from matplotlib.figure import Figure

    from treecli._atomic import atomic_file

    figure = Figure(figsize=(10, 4.5), dpi=120)
    axes = figure.add_subplot()
    layers = sorted({r.layer for r in report.rows if r.layer is not None})
    position = {layer: i + 1 for i, layer in enumerate(layers)}  # 0: outside every layer
    for kind in sorted({r.kind for r in report.rows}):
        rows = [r for r in report.rows if r.kind == kind and r.relative_change is not None]
        inside = sorted((r for r in rows if r.layer is not None), key=lambda r: r.layer)
        color = None
        if inside:
            line = axes.plot([position[r.layer] for r in inside], [100 * r.relative_change for r in inside], marker="o",
                             markersize=3, label=kind)
            color = line[0].get_color()
        outside = [100 * r.relative_change for r in rows if r.layer is None]
        if outside:  # a point of its own, never joined to layer 0
            axes.plot([0] * len(outside), outside, marker="o", linestyle="none", color=color,
                      label="_" if inside else kind)
    ticks = [0, *position.values()]
    step = max(1, len(ticks) // 20)
    axes.set_xticks(ticks[::step], ["–", *map(str, layers)][::step])
    axes.set_xlabel("layer")
    axes.set_ylabel("‖b − a‖ / ‖a‖ (%)")  # the table's unit
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    if any(not line.get_label().startswith("_") for line in axes.lines):
        axes.legend()
    figure.tight_layout()
    try:
        with atomic_file(Path(target)) as tmp:
            figure.savefig(tmp, format="png")
    except OSError as e:
        raise UsageError(f"--plot {target!r}: cannot write it: {e.strerror or e}") from None
