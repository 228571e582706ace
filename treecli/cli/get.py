"""``treecli get``: one leaf, printed or written to .npy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import open_input
from treecli.cli._output import Output


def get(
    checkpoint: opt.CheckpointArg,
    keypath: Annotated[str, typer.Argument(help="Key path of one leaf, e.g. model.embed_tokens.weight.",
                                           autocompletion=opt.complete_keypaths, show_default=False,
                                           metavar="KEYPATH")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the leaf to this .npy file.",
                                                   show_default=False)] = None,
    format: opt.FormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    json: opt.JsonOpt = False,
) -> None:
    """Print one leaf (summarised when large) or write it to a .npy file.

    Examples:

    \b
        treecli get model.safetensors model.norm.weight
        treecli get ckpt_dir params.dense.kernel -o kernel.npy
    """
    from treecli import _leaf, _summary, _tree
    from treecli._errors import UsageError

    out = Output()
    with open_input(out, checkpoint, format, step, like) as ckpt:
        found = _tree.resolve(ckpt.tree, keypath)
        if len(found) > 1:
            raise UsageError(f"names {len(found)} nodes; give one key path", file=str(checkpoint), keypath=keypath)
        node = _tree.get(ckpt.tree, found[0])
        if _tree.is_node(node):
            raise UsageError("is a subtree, not a leaf; see it with: treecli show CKPT --where " + keypath,
                             file=str(checkpoint), keypath=keypath)
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
            out.json({"keypath": keypath, "shape": list(leaf.shape), "dtype": leaf.dtype_name,
                      "value": _summary.json_array(leaf.read())})
            return
        out.print(f"{keypath}  {list(leaf.shape)} {leaf.dtype_name}")
        out.print(_summary.array_text(leaf))


def _write_npy(out, leaf, path: Path, force: bool, keypath: str, source) -> None:
    """One leaf saved as a .npy file, as every output is saved (atomic, checked, verified)."""
    from treecli._errors import UsageError
    from treecli._verify import Verifier
    from treecli.formats import get as get_format, save

    if not path.name.endswith(".npy"):
        raise UsageError("get -o writes one leaf as a .npy file; name it *.npy (for a checkpoint of some leaves: "
                         "treecli edit CKPT --delete ... -o out.safetensors)", file=str(path), keypath=keypath)
    save(leaf, path, format="npy", inputs=[source], force=force,
         verify=Verifier(leaf, get_format("npy"), dropped_allowed=False, progress=out.progress))
