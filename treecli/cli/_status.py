"""The exit status of every treecli command, in one place."""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    """What treecli's exit code says (docs/safety.md, "Exit codes")."""

    OK = 0
    DIFFERENCES = 1  # diff found some
    ERROR = 2  # nothing was written
    NOT_DURABLE = 3  # the output is in place, but syncing its directory failed
    INTERRUPTED = 130  # Ctrl-C; SIGTERM and SIGHUP exit 128 + their number
