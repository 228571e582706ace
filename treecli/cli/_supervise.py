"""A process of a multi-process run, watched from a thin parent.

JAX's distributed runtime ends a process with ``abort()`` and a C++ stack trace when it
cannot join (a coordinator that never comes up), when the coordinator goes away, or when
a peer stops answering; while it waits to join it does not see Ctrl-C. None of that can
be caught inside the process. So ``treecli --coordinator ...`` runs the command in a
child process and stays beside it, importing nothing heavy: it passes stdout through
untouched and stderr line by line, less the runtime's own log and trace lines; it turns
a child killed by the runtime into one line naming the process and the coordinator, exit
2; and on Ctrl-C (or SIGTERM) it stops the child at once, exit 130 (143).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

# Set in the child: it runs the command itself. (The child says "joined" on stderr once
# it is part of the run: ``JOINED``, which the parent keeps to itself.)
CHILD = "TREECLI_SUPERVISED"
JOINED = "treecli-internal: joined the run"

# What JAX's runtime and abseil write as they stop a process: log lines (I/W/E/F, a date,
# a time), a check failure's stack trace, C++'s terminate handler.
_RUNTIME_NOISE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|\*\*\* Check failure|    @ +0x|terminate called"
                            r"|  what\(\):)")
_FATAL = re.compile(r"^F\d{4} [^\]]*\] (.*)")


def needed(args: list[str], environ: dict[str, str]) -> bool:
    """Whether ``args`` run as one process of several (and this is not already the child)."""
    if environ.get(CHILD):
        return False
    named = any(a in ("--distributed",) or a.split("=", 1)[0] in ("--coordinator", "--num-processes",
                                                                   "--process-id") for a in args)
    return named or any(environ.get(v) for v in ("TREECLI_COORDINATOR", "TREECLI_NUM_PROCESSES",
                                                 "TREECLI_PROCESS_ID"))


def _option(args: list[str], name: str, variable: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return os.environ.get(variable)


def run(args: list[str]) -> int:
    """Run ``treecli ARGS`` in a child process, watched; its exit status, or 2 with one line
    where the runtime killed it."""
    process = _option(args, "--process-id", "TREECLI_PROCESS_ID") or "?"
    count = _option(args, "--num-processes", "TREECLI_NUM_PROCESSES") or "?"
    coordinator = _option(args, "--coordinator", "TREECLI_COORDINATOR") or "the one JAX found"
    timeout = _option(args, "--join-timeout", "TREECLI_JOIN_TIMEOUT") or "30"
    debug = "--debug" in args
    child = subprocess.Popen([sys.executable, "-m", "treecli", *args], env={**os.environ, CHILD: "1"},
                             stderr=subprocess.PIPE, start_new_session=True,  # (Ctrl-C is the parent's to pass on)
                             preexec_fn=_dies_with_parent)
    state = {"joined": False, "fatal": None}
    relay = threading.Thread(target=_relay, args=(child.stderr, state, debug), daemon=True)
    relay.start()
    stopped = _waiting(child)
    relay.join(timeout=5)
    if stopped is not None:
        _say("interrupted" if stopped == signal.SIGINT else f"interrupted by {signal.Signals(stopped).name}")
        return 130 if stopped == signal.SIGINT else 128 + stopped
    code = child.returncode
    if code >= 0:
        return code
    where = f"process {process} of {count} (coordinator {coordinator})"
    if not state["joined"]:
        why = (f"could not join the run within {timeout} s (--join-timeout, TREECLI_JOIN_TIMEOUT): is every "
               "process started, on this coordinator's address?")
    else:
        why = ("the run broke: another process stopped answering, or the coordinator went away; nothing was "
               "published")
    reason = f" ({state['fatal'][:200]})" if state["fatal"] and debug else ""
    _say(f"error: {where}: {why}{reason}")
    return 2


def _dies_with_parent() -> None:
    """In the child, before it runs: a parent killed outright (SIGKILL) takes it along (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child outlives a parent killed outright
        pass


def _waiting(child: subprocess.Popen) -> int | None:
    """Wait for the child; on Ctrl-C, SIGTERM or SIGHUP, stop it (a moment to clean up its
    temporaries, then killed) and return that signal."""
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)
        child.send_signal(signal.SIGTERM)  # (the child removes its temporaries on SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    kill_at = None
    try:
        while child.poll() is None:
            if received and kill_at is None:
                kill_at = time.monotonic() + 2
            if kill_at is not None and time.monotonic() > kill_at:  # stuck in the runtime, deaf to signals
                child.kill()
            try:
                child.wait(timeout=0.1)  # (a short wait: a signal's handler runs between two)
            except subprocess.TimeoutExpired:
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return received[0] if received else None


def _relay(stream, state: dict, debug: bool) -> None:
    """The child's stderr to ours, line by line, less the runtime's own lines (all of them
    with ``--debug``); what its fatal line said is kept for the one line."""
    in_runtime_message = False  # (its lines go on until treecli speaks again: a status, an RPC's name)
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if line.rstrip("\n") == JOINED:
            state["joined"] = True
            continue
        fatal = _FATAL.match(line)
        if fatal and state["fatal"] is None:
            state["fatal"] = fatal.group(1).strip()
        if _RUNTIME_NOISE.match(line):
            in_runtime_message = True
        elif line.startswith("treecli"):
            in_runtime_message = False
        if debug or not in_runtime_message:
            sys.stderr.write(line)
            sys.stderr.flush()


def _say(text: str) -> None:
    sys.stderr.write(f"treecli: {text}\n")
    sys.stderr.flush()
