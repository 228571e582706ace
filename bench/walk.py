"""The walk of one treecli command: which of treecli's functions it calls ("steps": each
distinct function, counted once; what imports run is not) and in which modules
("rooms"), in the order first entered. A measure of how many places a reader must visit to follow a command, for the
architecture issues (41): compare before and after a change on the same command.

    python bench/walk.py show examples/tiny.safetensors
    python bench/walk.py merge --config merge.yml -o out.safetensors --force
    python bench/walk.py --list show examples/tiny.safetensors   # every step, in order

Runs the command in this process (``treecli.cli.main``) under ``sys.setprofile``; the
command's own output goes where it always does, the walk to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path


def walk(argv: list[str]) -> tuple[list[str], list[str], int]:
    """The steps and rooms of ``treecli ARGV``, and its exit status (of the treecli that
    imports: ``PYTHONPATH=OTHER_CHECKOUT`` walks another version)."""
    import treecli
    from treecli.cli import main

    package = Path(treecli.__file__).resolve().parent

    steps: dict[str, None] = {}
    rooms: dict[str, None] = {}

    def importing(frame) -> bool:
        """Whether the frame runs as part of an import (a module body below it on the stack)."""
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_code.co_filename != __file__:
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, _arg):
        # An import is not a step, nor anything a module's body calls as it is imported:
        # a walk counts the same whether a module was imported before the command or in it.
        if event != "call" or importing(frame):
            return
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(package):
            module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
            steps.setdefault(f"{module}.{frame.f_code.co_qualname}", None)
            rooms.setdefault(module, None)

    sys.setprofile(profile)
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    finally:
        sys.setprofile(None)
    return list(steps), list(rooms), status


def main() -> None:
    argv = sys.argv[1:]
    listing = argv[:1] == ["--list"]
    steps, rooms, status = walk(argv[1:] if listing else argv)
    if listing:
        print("\n".join(steps), file=sys.stderr)
    print(f"treecli {' '.join(argv[1:] if listing else argv)}: {len(steps)} steps through {len(rooms)} rooms "
          f"(exit {status})", file=sys.stderr)
    print("rooms: " + ", ".join(r.removeprefix("treecli.") for r in rooms), file=sys.stderr)


if __name__ == "__main__":
    main()
