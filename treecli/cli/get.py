"""``treecli get``: one leaf, printed or written to .npy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, command_line, open_input
from treecli.cli._output import Output


def get(
    context: typer.Context,
    checkpoint: opt.CheckpointArg,
    keypath: Annotated[str, typer.Argument(help="Key path of one leaf, e.g. model.embed_tokens.weight; with -o, "
                                           "of a subtree too.", autocompletion=opt.complete_keypaths,
                                           show_default=False, metavar="KEYPATH")],
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write it to this file: a leaf to .npy, or a leaf or subtree, at its own key "
        "path and in its own dtype, to any format treecli writes (.safetensors, .npz, ...).",
        show_default=False)] = None,
    format: opt.FormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    no_record: opt.NoRecordOpt = False,
    json: opt.JsonOpt = False,
) -> None:
    """Print one leaf (summarised when large) or write a leaf or subtree to a file.

    Examples:

    \b
        treecli get model.safetensors model.norm.weight
        treecli get ckpt_dir params.dense.kernel -o kernel.npy
        treecli get model.safetensors model.layers.0 -o layer0.safetensors
    """
    from treecli import _leaf, _summary, _tree
    from treecli._errors import UsageError

    out = Output()
    with open_input(out, checkpoint, format, step, like) as ckpt, about(checkpoint):
        found = _tree.resolve(ckpt.tree, keypath)
        if len(found) > 1:
            raise UsageError(f"names {len(found)} nodes; give one key path", file=str(checkpoint), keypath=keypath)
        node = _tree.get(ckpt.tree, found[0])
        if output is not None and (_tree.is_node(node) or not output.name.endswith(".npy")):
            _write_subtree(out, ckpt, keypath, output, force, json, None if no_record else command_line(context))
            return
        if _tree.is_node(node):
            raise UsageError(f"is a subtree, not a leaf; see it with: treecli show {_quoted(checkpoint)} --where "
                             f"{_quoted(keypath)}, or write it with -o subtree.safetensors", file=str(checkpoint),
                             keypath=keypath)
        if not _leaf.is_array(node):
            if output is not None:
                raise UsageError(f"is a {_summary.value_type(node)} value, not an array; it cannot go to .npy",
                                 file=str(checkpoint), keypath=keypath)
            out.json({"keypath": keypath, "type": _summary.value_type(node), "value": _summary.json_value(node)}) \
                if json else out.print(repr(node))
            return
        leaf = _leaf.as_leaf(node)
        if output is not None:
            _write_npy(out, leaf, output, force, keypath, ckpt)
            out.note(f"wrote {output}")
            return
        if json:
            _check_room_for_json(leaf, checkpoint, keypath)
            out.json({"keypath": keypath, "shape": list(leaf.shape), "dtype": leaf.dtype_name,
                      "value": _summary.json_array(leaf.read())})
            return
        out.print(f"{keypath}  {list(leaf.shape)} {leaf.dtype_name}")
        out.print(_summary.array_text(leaf))


# What one element costs on its way to JSON text: widened to float64, a Python float in a
# list, and its text (measured here: 76 bytes for a float32 element at its peak).
_JSON_BYTES_PER_ELEMENT = 96


def _check_room_for_json(leaf, checkpoint: str, keypath: str) -> None:
    """Refuse, before reading it, a leaf whose JSON would not fit in the memory available."""
    from treecli import _memory
    from treecli._errors import UsageError
    from treecli._units import human_bytes

    needed = leaf.size * _JSON_BYTES_PER_ELEMENT
    available = _memory.available()
    if available is not None and needed > available // 2:
        raise UsageError(f"--json of {leaf.size:,} elements needs about {human_bytes(needed)} of memory, and "
                         f"{human_bytes(available)} is available: write it with -o leaf.npy, or take a part of it "
                         f"first (treecli slice {_quoted(checkpoint)} --index ...)", file=str(checkpoint),
                         keypath=keypath)


def _quoted(text: str) -> str:
    """A user's path or key path as a shell would take it back, in a hint."""
    import shlex

    return shlex.quote(str(text))


def _write_subtree(out, ckpt, keypath: str, output: Path, force: bool, json: bool, record: str | None) -> None:
    """A leaf or subtree written at its own key paths, in its own dtypes, to any format."""
    from treecli import _tree
    from treecli.cli._common import report_written, write_output, written_json

    written = write_output(out, _tree.selected(ckpt.tree, [keypath]), output, source=ckpt, inputs=[ckpt],
                           format=None, force=force, verify=True, record=record,
                           inputs_read_whole=False)
    report_written(out, written, json=written_json(written, [], [], input=ckpt.file, keypath=keypath)
                   if json else None)


def _write_npy(out, leaf, path: Path, force: bool, keypath: str, source) -> None:
    """One leaf saved as a .npy file, as every output is saved (atomic, checked, verified)."""
    from treecli import _dtypes
    from treecli._errors import UsageError
    from treecli.formats import WriteOptions, save

    if _dtypes.needs_ml_dtypes(leaf.dtype_name):
        raise UsageError(f"the .npy format cannot name {leaf.dtype_name}; write it where it keeps its dtype: "
                         f"treecli get {_quoted(source.file)} {_quoted(keypath)} -o {_quoted(path.stem)}.safetensors",
                         file=str(path), keypath=keypath)
    save(leaf, path, format="npy", inputs=[source], force=force, options=WriteOptions(stage=out.progress), verify=True)
