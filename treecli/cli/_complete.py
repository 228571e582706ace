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


# Typer's zsh script only registers its function with compdef. Autoloaded from $fpath
# by compinit (the file is then the body of _treecli, run on the first TAB), that
# registers it for the next TAB and completes nothing now: the first TAB of every
# new shell did nothing. The fixed script also completes when it runs as _treecli.
_ZSH_REGISTER = "compdef _treecli_completion treecli"
_ZSH_REGISTER_AND_COMPLETE = """if [[ "${funcstack[1]}" == "_treecli" ]]; then
  # autoloaded from $fpath: this is the first TAB, so complete it too
  compdef _treecli_completion treecli
  _treecli_completion "$@"
else
  compdef _treecli_completion treecli
fi"""


def fixed_zsh_script(script: str) -> str:
    """Typer's zsh completion script, made to complete on the first TAB as well."""
    if not script.lstrip().startswith("#compdef") or _ZSH_REGISTER_AND_COMPLETE in script:
        return script
    return script.replace(_ZSH_REGISTER, _ZSH_REGISTER_AND_COMPLETE)


def fix_installed_zsh_script(path: Path) -> None:
    """After Typer's --install-completion for zsh: the same fix in the file it wrote."""
    if path.is_file():
        path.write_text(fixed_zsh_script(path.read_text()))
