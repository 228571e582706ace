"""Shell completion of key paths, read from the checkpoint's metadata."""

from __future__ import annotations

from typing import Any


def complete_keypaths(ctx: Any, incomplete: str) -> list[str]:
    """Key paths (inner nodes and leaves) of the checkpoint named on the command line."""
    path = ctx.params.get("checkpoint")
    if not path:
        inputs = ctx.params.get("checkpoints") or []
        path = inputs[0] if inputs else None
    if not path:
        return []
    try:
        from treecli import _tree
        from treecli._keypath import format_keypath
        from treecli.formats import open_checkpoint

        with open_checkpoint(path, ctx.params.get("format"), step=ctx.params.get("step")) as checkpoint:
            names = [format_keypath(kp) for kp, _ in _tree.iter_nodes(checkpoint.tree) if kp]
    except Exception:  # completion must never print a traceback into the shell
        return []
    return [name for name in names if name.startswith(incomplete)]
