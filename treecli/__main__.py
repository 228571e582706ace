"""``python -m treecli``."""

from treecli.cli import run

run()
