"""Shell completion of key paths, read from the checkpoint's metadata."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any


def complete_keypaths(ctx: Any, args: list[str], incomplete: str) -> list[str]:
    """Key paths (inner nodes and leaves) of the checkpoint named on the command line."""
    # While completing `--where <TAB>`, Click's resilient parse stops at the
    # dangling option and fills neither ctx.params nor args, so the checkpoint
    # is the first word of the shell's command line that names a file.
    words = args or shlex.split(os.environ.get("_TYPER_COMPLETE_ARGS") or os.environ.get("COMP_WORDS") or "")
    path = ctx.params.get("checkpoint") or next(
        (word for word in words[1:] if not word.startswith("-") and Path(word).exists()), None
    )
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
