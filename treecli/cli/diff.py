"""``treecli diff``: compare two checkpoints of any formats, like ``diff``."""

from __future__ import annotations

import functools
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, open_input
from treecli.cli._output import Output, OutputClosed
from treecli.cli._status import ExitStatus


def diff(
    a: Annotated[str, typer.Argument(help="First checkpoint (a path or URL).", show_default=False, metavar="A")],
    b: Annotated[str, typer.Argument(help="Second checkpoint (a path or URL).", show_default=False, metavar="B")],
    rtol: Annotated[Optional[float], typer.Option("--rtol", help="Compare numerically with this relative "
                                                  "tolerance (default: exact bytes).", show_default=False)] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="Compare numerically with this absolute "
                                                  "tolerance (default: exact bytes).", show_default=False)] = None,
    where: opt.WhereOpt = None,
    step: Annotated[Optional[int], typer.Option("--step", help="Step of both CheckpointManager roots (default: "
                                               "each one's latest).", show_default=False)] = None,
    step_a: Annotated[Optional[int], typer.Option("--step-a", help="Step of A, a CheckpointManager root.",
                                                 show_default=False)] = None,
    step_b: Annotated[Optional[int], typer.Option("--step-b", help="Step of B, a CheckpointManager root.",
                                                 show_default=False)] = None,
    like: opt.LikeOpt = None,
    by_layer: Annotated[bool, typer.Option("--by-layer", help="One row per layer and kind of module "
                                           "(attention, MLP, norms): the relative change ‖b − a‖ / ‖a‖, as a bar.")
                        ] = False,
    layer_pattern: Annotated[Optional[str], typer.Option(
        "--layer-pattern", metavar="REGEX", show_default=False,
        help="With --by-layer: a regular expression whose first group is the layer number (default: the number "
             "after layers., blocks., h. or layer.).")] = None,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", metavar="FILE.png", show_default=False,
        help="With --by-layer: also draw the changes per layer as a PNG (needs matplotlib: pip install "
             "'treecli[plot]').")] = None,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> int:
    """Compare two checkpoints: key paths only in one, shape/dtype changes, value differences.

    Exit 0 when equal, 1 when different, 2 on error. Streams one pair of leaves
    at a time. NaN equals NaN under --rtol/--atol.

    Examples:

    \b
        treecli diff model.safetensors converted_dir
        treecli diff run1/100 run2/100 --atol 1e-6 --where 'state.params.**'
        treecli diff run1 run2 --step 300 --where 'state.params.**'
        treecli diff run1 run1 --step-a 200 --step-b 300
    """
    from treecli import _cluster, _diff

    from treecli._errors import UsageError

    out = Output(quiet=quiet)
    if step is not None and (step_a is not None or step_b is not None):
        raise UsageError("--step names both sides' step; give it, or --step-a and --step-b, not both")
    steps = (step if step_a is None else step_a, step if step_b is None else step_b)
    if plot is not None and not by_layer:
        raise UsageError("--plot draws --by-layer's changes; add --by-layer")
    if by_layer:
        return _by_layer(out, a, b, steps, like, layer_pattern, json, plot)
    cluster = _cluster.current()  # several processes: each compares its share of the leaves
    part = (cluster.process_id, cluster.count) if cluster else (0, 1)
    with open_input(out, a, step=steps[0], like=like) as left, \
            open_input(out, b, step=steps[1], like=like) as right, about(a):  # (--where is looked for in A first)
        total = sum(getattr(leaf, "nbytes", 0) for leaf in _leaves(left.tree))
        with out.progress("comparing", total * 2) as advance:
            result = _diff.diff(left.tree, right.tree, rtol=rtol, atol=atol, where=where or [], progress=advance,
                                part=part, gather=None if cluster is None else functools.partial(_gather, cluster))
    try:
        _print(out, result, json)
    except OutputClosed:  # the reader went away: the verdict stands, it never turns into "equal"
        pass
    return ExitStatus.OK if result.equal else ExitStatus.DIFFERENCES


def _print(out: Output, result, json: bool) -> None:
    from treecli import _render

    if json:
        out.json(result.as_json())
    elif result.equal:
        out.note("no differences")
    else:
        rows = [[f"- {k}", "only in a", "", "", ""] for k in result.only_in_a]
        rows += [[f"+ {k}", "only in b", "", "", ""] for k in result.only_in_b]
        for c in result.changed:
            same = c.a == c.b
            note = "values differ" if same else f"compared in {c.compared_in}" if c.compared_in else ""
            if c.nonfinite:
                note += f"{'; ' if note else ''}{c.nonfinite} non-finite differ"
            rows.append([f"~ {c.keypath}", c.a if same else f"{c.a} -> {c.b}",
                         note, _number(c.max_abs_diff), _number(c.max_rel_diff)])
        out.lines(_render.table(["key path", "a / b", "", "max abs diff", "max rel diff"], rows, {3, 4}))


def _by_layer(out: Output, a: str, b: str, steps: tuple, like, layer_pattern: str | None, json: bool,
              plot: str | None) -> int:
    from treecli import _layers

    if plot is not None:
        from treecli.cli._plot import check_target

        check_target(plot)  # (before reading a byte of the checkpoints)
    with open_input(out, a, step=steps[0], like=like) as left, \
            open_input(out, b, step=steps[1], like=like) as right:
        total = sum(getattr(leaf, "nbytes", 0) for leaf in _leaves(left.tree))
        with out.progress("comparing", total * 2) as advance:
            report = _layers.by_layer(left.tree, right.tree, layer_pattern=layer_pattern, progress=advance)
    if json:
        out.json(report.as_json())
    else:
        _print_layers(out, report)
    if plot is not None:
        from treecli.cli._plot import draw_layers

        draw_layers(report, plot, title=f"{a} -> {b}")
        out.note(f"wrote {plot}")
    return ExitStatus.OK if report.equal else ExitStatus.DIFFERENCES


def _print_layers(out: Output, report) -> None:
    """``--by-layer``'s table: a row per layer and kind of module, then the layer's total
    where it has several kinds; the change in percent, as a bar. Piped, plain ASCII."""
    from treecli import _render

    totals = {r.layer: r for r in report.layer_totals()}
    kinds: dict = {}
    for r in report.rows:
        kinds.setdefault(r.layer, []).append(r)
    ordered = [row for layer, rows in kinds.items() for row in rows + ([totals[layer]] if len(rows) > 1 else [])]
    changes = [r.relative_change for r in ordered]
    top = max((c for c in changes if c is not None and c == c), default=0.0) or 1.0
    bar, title = ("#", "|b-a|/|a|") if out.plain else ("█", "‖b−a‖/‖a‖")
    rows = [["-" if r.layer is None else str(r.layer), r.kind, f"{r.params:,}",
             "" if c is None else f"{c:.3%}", "" if c is None or c != c else bar * round(20 * c / top)]
            for r, c in zip(ordered, changes)]
    out.lines(_render.table(["layer", "kind", "params", title, ""], rows, {2, 3}))
    if report.compared_in:
        dtypes = sorted(set(report.compared_in.values()))
        out.note(f"{len(report.compared_in)} leaves differ in dtype; compared in {', '.join(dtypes)}")
    if report.skipped:
        out.note(f"{len(report.skipped)} leaves not compared (e.g. {report.skipped[0]})")


def _gather(cluster, changes: list) -> list[list]:
    """Every process's changes, through the run's coordinator."""
    import dataclasses
    import json

    from treecli._diff import Change

    cluster.tell(f"diff/{cluster.process_id}", json.dumps([dataclasses.asdict(c) for c in changes]))
    cluster.agree("compare its share")
    return [[Change(**c) for c in json.loads(cluster.hear(f"diff/{i}"))] for i in range(cluster.count)]


def _leaves(tree):
    from treecli import _leaf, _tree

    return [_leaf.as_leaf(x) for _, x in _tree.flatten(tree) if _leaf.is_array(x)]


def _number(x) -> str:
    return "" if x is None else f"{x:.4g}"
