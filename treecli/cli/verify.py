"""``treecli verify``: are these the weights? Against a manifest or another checkpoint."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, hash_shares, hashed, open_input, record_of
from treecli.cli._output import Output
from treecli.cli._status import ExitStatus


def verify(
    checkpoint: opt.CheckpointArg,
    against: Annotated[Optional[str], typer.Argument(
        help="A manifest (treecli hash -o) or another checkpoint, in any format (default: the record the "
             "checkpoint keeps of the weights treecli wrote).", show_default=False,
        metavar="AGAINST")] = None,
    where: opt.WhereOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> int:
    """Check that a checkpoint holds the weights a manifest (or another checkpoint) holds,
    leaf by leaf, by their digests: whatever the formats, sharding or tensor order. Without
    AGAINST, the weights are checked against the root digest the checkpoint's own record
    holds (what treecli wrote: see show).

    Exit 0 when every leaf matches, 1 when some differ, are missing or are extra (listed
    as diff lists them), 2 on error.

    Examples:

    \b
        treecli verify converted_dir b.safetensors
        treecli verify Llama-3-8B/ model.safetensors --where 'model.layers.0.**'
        treecli verify llama.gguf

    """
    from treecli._bytes import digest as _digest
    from treecli._api import read_manifest
    from treecli._errors import UsageError, counted

    out = Output(quiet=quiet)
    if against is None:
        return _against_record(out, checkpoint, where, step, like, json)
    expected = read_manifest(against)
    files: list[str] = []  # (a Hub repository's files, checked against the Hub's own digests)
    with open_input(out, checkpoint, step=step, like=like) as ckpt, about(checkpoint):
        tree = _digest.selected(ckpt.tree, where or [])
        shared = hash_shares("verify")
        found = hashed(out, tree, "hashing", shared)
        files += _hub_files(checkpoint, tree)
        if expected is None:
            with open_input(out, against, step=step, like=like) as other:
                against_tree = _digest.selected(other.tree, where or [])
                expected = hashed(out, against_tree, "hashing AGAINST", shared)
                files += _hub_files(against, against_tree)
        else:  # (a manifest of the whole: only the leaves selected here are expected)
            expected = _digest.restricted(expected, where or [])
        hub = _hub_mismatches(out, files)
    result = _digest.compare(found, expected)
    if json:
        out.json({**result.as_json(), "root": found.root, "expected_root": expected.root, "hub_files": hub})
    elif result.equal and not hub:
        checked = f"; {counted(len(files), 'file')} the Hub's SHA-256" if files else ""
        out.note(f"verified: {counted(len(found.leaves), 'leaf', 'leaves')}, root {found.root}{checked}")
    else:
        _print(out, result, hub)
    return ExitStatus.OK if result.equal and not hub else ExitStatus.DIFFERENCES


def _against_record(out: Output, checkpoint: str, where: list[str] | None, step: int | None, like: str | None,
                    json: bool) -> int:
    """The weights against the root digest of the checkpoint's own record: a record holds the
    whole's root, not each leaf's, so a difference says that they differ, not where."""
    from treecli._errors import UsageError, counted
    from treecli._escape import quote

    if where:
        raise UsageError("--where needs AGAINST: a checkpoint's record holds the root digest of all its weights",
                         file=checkpoint)
    with open_input(out, checkpoint, step=step, like=like) as ckpt, about(checkpoint):
        _, record, why = record_of(ckpt)
        if record is None:
            raise UsageError(f"no record to verify against: {why or 'treecli did not write it'}; give AGAINST (a "
                             "manifest, or another checkpoint)", file=checkpoint)
        found = hashed(out, ckpt.tree, "hashing", hash_shares("verify"))
        files = _hub_files(checkpoint, ckpt.tree)
        hub = _hub_mismatches(out, files)
    equal = found.root == record["root"]
    if json:
        out.json({"equal": equal, "root": found.root, "expected_root": record["root"], "against": "record",
                  "hub_files": hub})
    elif equal and not hub:
        checked = f"; {counted(len(files), 'file')} the Hub's SHA-256" if files else ""
        out.note(f"verified: {counted(len(found.leaves), 'leaf', 'leaves')}, root {found.root}, as recorded by "
                 f"{quote(record['command'])}{checked}")
    else:
        out.lines([f"! {line}" for line in hub])
        if not equal:
            out.lines([f"~ root {found.root}, recorded {record['root']}"])
        out.warn("the weights are not those their record names" if not equal else
                 f"{len(hub)} Hub files not as the Hub publishes them")
    return ExitStatus.OK if equal and not hub else ExitStatus.DIFFERENCES


def _hub_files(source: str, tree: Any) -> list[str]:
    """The files of a Hub repository (``hf://``) that hold ``tree``'s leaves."""
    from treecli import _tree

    if not str(source).startswith("hf://"):
        return []
    return sorted(name for name in set(_tree.sources(tree)) if str(name).startswith("hf://"))


def _hub_mismatches(out: Output, files: list[str]) -> list[str]:
    """Each Hub file's SHA-256 against the Hub's (the files read whole, once more)."""
    from treecli import _cluster
    from treecli.formats import hub_mismatches

    cluster = _cluster.current()
    if not files or (cluster is not None and cluster.process_id != 0):  # (process 0 checks the files)
        return []
    return hub_mismatches(files)


def _print(out: Output, result: Any, hub: list[str]) -> None:
    from treecli import _render

    rows = [[f"~ {name}", "differs"] for name in result.differ]
    rows += [[f"- {name}", "missing"] for name in result.missing]
    rows += [[f"+ {name}", "not expected"] for name in result.extra]
    if rows:
        out.lines(_render.table(["key path", ""], rows, set()))
    out.lines([f"! {line}" for line in hub])
    out.warn(f"{len(result.differ)} differ, {len(result.missing)} missing, {len(result.extra)} not expected"
             + (f"; {len(hub)} Hub files not as the Hub publishes them" if hub else ""))

