"""``treecli hash``: digests of a checkpoint's weights, the same in any format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, hash_shares, hashed, open_input
from treecli.cli._output import Output


def hash_(
    checkpoint: opt.CheckpointArg,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write the manifest (every leaf's digest and the root's, JSON) to this file, for "
        "treecli verify.", show_default=False)] = None,
    where: opt.WhereOpt = None,
    input_format: opt.InputFormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Digest the weights: one BLAKE3 digest per leaf, over its dtype, shape and bytes, and one
    root digest over them, the same whatever the format, sharding or tensor order.

    Prints the root digest (--json: every leaf's too). A quantized tensor hashes its
    stored blocks, under its type.

    Examples:

    \b
        treecli hash model.safetensors
        treecli hash Llama-3.2-1B/ -o weights.blake3.json
        treecli hash ckpt_dir --where 'params.**' --json
    """
    from treecli._bytes import digest as _digest
    from treecli._errors import counted
    from treecli.formats import check_output

    out = Output(quiet=quiet)
    with open_input(out, checkpoint, input_format, step, like) as ckpt, about(checkpoint):
        if output is not None:  # (before reading a byte of the weights: never an input, a shard of it too)
            check_output(output, [ckpt], force=force)
        tree = _digest.selected(ckpt.tree, where or [])
        found = hashed(out, tree, "hashing", hash_shares("hash"))
    if output is not None:
        _write_manifest(output, found)
    if json:
        out.json({"checkpoint": str(checkpoint), **found.as_json()})
    else:
        out.lines([f"{found.root}  {_shown(str(checkpoint))}"])
        written = f"; manifest written to {output}" if output is not None else ""
        out.note(counted(len(found.leaves), "leaf", "leaves") + written)


def _shown(text: str) -> str:
    from treecli._escape import visible

    return visible(text)


def _write_manifest(output: Path, found: Any) -> None:
    import json

    from treecli._atomic import atomic_file

    with atomic_file(output) as tmp:
        tmp.write_text(json.dumps(found.as_json(), indent=1) + "\n")

