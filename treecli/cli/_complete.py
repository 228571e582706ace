"""Shell completion of key paths, read from the checkpoint's metadata."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Callable


def complete_keypaths(ctx: Any, args: list[str], incomplete: str) -> list[str]:
    """Key paths of the checkpoint named on the command line, one level at a time, as a
    shell completes directories: the nodes one segment below what is typed, an inner node
    ending in ``.``; while only one inner node fits, its children instead. After ``=``
    (``PATTERN=VALUE``) nothing: a value is no key path."""
    if "=" in incomplete:
        return []
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
            nodes = [(kp, format_keypath(kp), _tree.is_node(node))
                     for kp, node in _tree.iter_nodes(checkpoint.tree) if kp]
    except Exception:  # completion must never print a traceback into the shell
        return []
    level = _segments(incomplete)
    while True:
        found = [(kp, text + "." if inner else text) for kp, text, inner in nodes
                 if len(kp) == level and text.startswith(incomplete)]
        if len(found) != 1 or not found[0][1].endswith("."):
            return [text for _, text in found]
        incomplete, level = found[0][1], level + 1


def _segments(typed: str) -> int:
    """How many segments a partly typed key path has (the one being typed included):
    dots outside brackets, plus one."""
    depth, count = 0, 1
    for ch in typed:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "." and depth == 0:
            count += 1
    return count


def choices(*values: str) -> Callable[[str], list[str]]:
    """Completion of an option that takes one of ``values`` (never file names)."""
    return lambda incomplete: [v for v in values if v.startswith(incomplete)]


def complete_methods(incomplete: str) -> list[str]:
    from treecli.merge_methods import METHODS

    return [name for name in METHODS if name.startswith(incomplete)]


def complete_formats(incomplete: str) -> list[str]:
    from treecli.formats import FORMATS

    return [name for name in FORMATS if name.startswith(incomplete)]


def complete_dtypes(incomplete: str) -> list[str]:
    from treecli._dtypes import names

    return [name for name in names() if name.startswith(incomplete)]


def complete_cast(ctx: Any, args: list[str], incomplete: str) -> list[str]:
    """``--cast PATTERN=DTYPE``: key paths before the ``=``, dtypes after it."""
    if "=" not in incomplete:
        return complete_keypaths(ctx, args, incomplete)
    pattern, _, dtype = incomplete.rpartition("=")
    return [f"{pattern}={name}" for name in complete_dtypes(dtype)]


def complete_recipe(incomplete: str) -> list[str]:
    """``--recipe``: the built-in recipes' names (a YAML file is completed by the shell)."""
    from treecli.recipes import BUILTIN

    return [name for name in BUILTIN if name.startswith(incomplete)]


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


# Typer writes a ' inside a description as '' within single quotes, which zsh reads as
# nothing unless RC_QUOTES is set ("mergekit's" became "mergekits"): set it for the eval.
_ZSH_EVAL = "  eval $(env _TYPER_COMPLETE_ARGS="
_ZSH_QUOTES_AND_EVAL = "  setopt local_options rc_quotes  # Typer writes ' as '' in descriptions\n" + _ZSH_EVAL


def fixed_zsh_script(script: str) -> str:
    """Typer's zsh completion script, made to complete on the first TAB as well, and to
    keep the apostrophes of descriptions."""
    if not script.lstrip().startswith("#compdef") or _ZSH_REGISTER_AND_COMPLETE in script:
        return script
    return script.replace(_ZSH_REGISTER, _ZSH_REGISTER_AND_COMPLETE).replace(_ZSH_EVAL, _ZSH_QUOTES_AND_EVAL, 1)


def fix_installed_zsh_script(path: Path) -> None:
    """After Typer's --install-completion for zsh: the same fix in the file it wrote."""
    if path.is_file():
        path.write_text(fixed_zsh_script(path.read_text()))


def rejoined_at_equals(words: list[str], cword: int) -> tuple[list[str], int, str]:
    """bash's words with a ``KEY = VALUE`` it split at ``=`` joined back into the word being
    completed (``KEY=VALUE``); the new index of that word; and what bash keeps before the
    part it replaces (``KEY=``; ``""`` where nothing was split)."""
    if 1 <= cword < len(words) and words[cword] == "=":  # `KEY=` and TAB: the word is the `=`
        before = words[cword - 1] + "="
        return words[:cword - 1] + [before] + words[cword + 1:], cword - 1, before
    if 2 <= cword < len(words) and words[cword - 1] == "=":  # `KEY=bf` and TAB
        before = words[cword - 2] + "="
        return words[:cword - 2] + [before + words[cword]] + words[cword + 1:], cword - 2, before
    if 2 <= cword == len(words) and words[cword - 1] == "=":  # `KEY=` then TAB, no word after it
        before = words[cword - 2] + "="
        return words[:cword - 2] + [before], cword - 2, before
    return words, cword, ""
