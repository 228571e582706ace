"""The Typer app and its one error boundary.

Commands live one per module and are thin: parse, one library call, render.
Heavy imports (NumPy, formats) happen inside the command functions, so
``treecli --help`` and completion stay fast and never import jax or orbax.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

import typer

from treecli import _cluster, _gc
from treecli.cli._status import ExitStatus

# The commands, in the order --help lists them: each one's function as "module:function",
# imported only when it runs (or when the whole app is laid out: --help, completion).
COMMANDS = {
    "show": "treecli.cli.show:show",
    "slice": "treecli.cli.slice:slice_",
    "average": "treecli.cli.average:average",
    "merge": "treecli.cli.merge:merge",
    "edit": "treecli.cli.edit:edit",
    "diff": "treecli.cli.diff:diff",
    "convert": "treecli.cli.convert:convert",
    "get": "treecli.cli.get:get",
    "hash": "treecli.cli.hash:hash_",
    "verify": "treecli.cli.verify:verify",
}

_SETTINGS = dict(
    name="treecli",
    help="Look inside ML checkpoints and operate on them as PyTrees: show, slice, average, merge, edit, "
    "diff, convert, get, hash, verify.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"treecli {version('treecli')}")
        raise typer.Exit(0)


class _Session:
    """What the root options said, for the error boundary (reset by every ``main``), and
    the arguments, which the processes of a run compare."""

    debug = False
    args: list[str] = []


def _root(
    debug: bool = typer.Option(False, "--debug", help="Show a traceback for errors."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the version and exit."),
    coordinator: Optional[str] = typer.Option(
        None, "--coordinator", envvar="TREECLI_COORDINATOR", metavar="HOST:PORT", show_default=False,
        help="Run as one of several processes (JAX's distributed runtime): process 0's address. Each process reads "
        "and writes its share; process 0 publishes the output once all have finished."),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", envvar="TREECLI_NUM_PROCESSES",
                                                show_default=False, help="How many processes run the command."),
    process_id: Optional[int] = typer.Option(None, "--process-id", envvar="TREECLI_PROCESS_ID", show_default=False,
                                             help="This process's number, 0 to --num-processes - 1."),
    distributed: bool = typer.Option(False, "--distributed", help="Run as one of the processes JAX finds "
                                     "(SLURM, a TPU pod, MPI), as jax.distributed.initialize() does."),
    join_timeout: Optional[float] = typer.Option(
        None, "--join-timeout", envvar="TREECLI_JOIN_TIMEOUT", metavar="SECONDS", show_default=False,
        help="How long a process of several waits for all of them to join (default 30)."),
) -> None:
    """Look inside ML checkpoints and operate on them as PyTrees: show, slice, average, merge, edit, diff, convert,
    get, hash, verify."""
    _Session.debug = debug
    if distributed or coordinator is not None or num_processes is not None or process_id is not None:
        _cluster.start(coordinator, num_processes, process_id, detect=distributed, join_timeout=join_timeout,
                       command=_Session.args, on_joined=_say_joined)


def _say_joined() -> None:
    """Tell the watching parent (``_supervise``) that this process joined its run."""
    from treecli.cli import _supervise

    if os.environ.get(_supervise.CHILD):
        sys.stderr.write(_supervise.JOINED + "\n")
        sys.stderr.flush()


def _command(name: str) -> Callable[..., Any]:
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _app_of(names: list[str]) -> typer.Typer:
    """A Typer app of the root options and the commands ``names``."""
    made = typer.Typer(**_SETTINGS)
    made.callback()(_root)
    for name in names:
        made.command(name)(_command(name))
    return made


@functools.cache
def _whole_app() -> typer.Typer:
    return _app_of(list(COMMANDS))


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole app (completion scripts, tests), laid out on first use
        return _whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ROOT_OPTIONS_WITH_VALUES = ("--coordinator", "--num-processes", "--process-id", "--join-timeout")


def _app_for(args: list[str]) -> typer.Typer:
    """The app to run ``args`` with: where they name a command, one that holds only that
    command, its module the only one imported (Typer lays out every command's options on
    each run: 14 ms of a 90 ms ``show``, against 2 ms for one); else the whole app (help,
    completion, a mistyped command)."""
    name = next((arg for arg, before in zip(args, [None, *args]) if not arg.startswith("-")
                 and before not in _ROOT_OPTIONS_WITH_VALUES), None)
    return _app_of([name]) if name in COMMANDS else _whole_app()


class _Terminated(BaseException):
    """SIGTERM (a scheduler's preemption) or SIGHUP (the terminal went away), raised in
    the main thread like KeyboardInterrupt so that every temporary is cleaned up."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; map every error to one line on stderr and an :class:`ExitStatus`."""
    args = sys.argv[1:] if argv is None else list(argv)
    _Session.debug = False
    _Session.args = args
    if not args:  # bare `treecli`: the help, as `treecli --help` prints it
        args = ["--help"]
    # A command runs once and exits: Python's cyclic collector would only walk the
    # millions of long-lived objects of a big header again and again (half of
    # `show`'s time on a 200k-tensor file). Reference counting frees as usual.
    for stream in (sys.stdout, sys.stderr):
        # A name from a file on an ASCII-only terminal (LANG=C) is escaped, never a crash.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if args[0] in ("--show-completion", "--install-completion"):
        return _completion(args)
    if os.environ.get("_TREECLI_COMPLETE") == "complete_bash":
        return _bash_completion(args)
    with _gc.paused(), _terminating_signals_raise(), _warnings_as_lines():
        try:
            return _run_app(args)
        except _Terminated as e:
            with contextlib.suppress(OSError):
                sys.stderr.write(f"treecli: interrupted by {signal.Signals(e.signum).name}\n")
            return 128 + e.signum
        finally:
            _cluster.finish()  # a run of several processes: leave it together


def _completion(args: list[str]) -> int:
    """Typer's --show-completion / --install-completion, with its zsh script fixed to
    complete on the first TAB of a new shell (see ``_complete.fixed_zsh_script``)."""
    import io
    from pathlib import Path

    from treecli.cli._complete import fix_installed_zsh_script, fixed_zsh_script

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        code = _run_app(args)
    sys.stdout.write(fixed_zsh_script(shown.getvalue()) if args[0] == "--show-completion" else shown.getvalue())
    if args[0] == "--install-completion":
        fix_installed_zsh_script(Path.home() / ".zfunc" / "_treecli")
    return code


def _bash_completion(args: list[str]) -> int:
    """Typer's bash completion, with the word bash split at ``=`` put back together: for
    ``--cast KEY=bf`` bash passes ``KEY``, ``=``, ``bf`` (``=`` is one of its
    COMP_WORDBREAKS) and replaces only ``bf``; so the completions go without ``KEY=``."""
    import io
    import shlex

    from treecli.cli._complete import rejoined_at_equals

    try:
        words, cword = shlex.split(os.environ.get("COMP_WORDS", "")), int(os.environ.get("COMP_CWORD", "0"))
    except ValueError:  # an unclosed quote: as Typer would take it
        return _run_app(args)
    words, cword, before = rejoined_at_equals(words, cword)
    if not before:
        return _run_app(args)
    os.environ["COMP_WORDS"], os.environ["COMP_CWORD"] = shlex.join(words), str(cword)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        code = _run_app(args)
    for line in shown.getvalue().splitlines():
        sys.stdout.write((line[len(before):] if line.startswith(before) else line) + "\n")
    return code


@contextlib.contextmanager
def _terminating_signals_raise():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _run_app(args: list[str]) -> int:
    from treecli._errors import NotDurableError, TreecliError, cli_voice
    from treecli.cli._output import OutputClosed

    try:
        with cli_voice():  # errors name --flags, not the library's parameters
            result = _app_for(args)(args=args, prog_name="treecli", standalone_mode=False)
        if result == ExitStatus.INTERRUPTED:  # Typer turns Ctrl-C into a returned 130 (no command returns it)
            sys.stderr.write("treecli: interrupted\n")
        return result if isinstance(result, int) else ExitStatus.OK
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:  # completion scripts and --help exit this way
        return e.code if isinstance(e.code, int) else ExitStatus.OK
    except (KeyboardInterrupt, typer.Abort):
        sys.stderr.write("treecli: interrupted\n")
        return ExitStatus.INTERRUPTED
    except TreecliError as e:
        if _Session.debug:
            raise
        _print_error(e.headline(), e.details, json="--json" in args, error=e)
        return ExitStatus.NOT_DURABLE if isinstance(e, NotDurableError) else ExitStatus.ERROR
    except typer.TyperException as e:  # Click usage errors: bad option, missing argument
        if _Session.debug:
            raise
        _print_error(e.format_message(), json="--json" in args)
        return ExitStatus.ERROR
    except (BrokenPipeError, OutputClosed):  # `treecli show big | head`: diff keeps its verdict itself
        return ExitStatus.OK
    except MemoryError as e:  # (what a command checks before it allocates is its own line; this is the rest)
        if _Session.debug:
            raise
        _print_error(f"not enough memory for this command: {e or 'an allocation failed'}", json="--json" in args)
        return ExitStatus.ERROR
    except Exception as e:
        if _Session.debug:
            raise
        _print_error(f"internal error: {type(e).__name__}: {e} (run with --debug for a traceback)",
                     json="--json" in args)
        return ExitStatus.ERROR


@contextlib.contextmanager
def _warnings_as_lines():
    """A Python warning from any library (NumPy's overflow in a cast, a deprecation) is
    treecli's one ``warning:`` line, never a file name and a source line. Which warnings
    show is left to the filters (tests turn them into errors)."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        from treecli._escape import visible

        with contextlib.suppress(OSError):
            sys.stderr.write(visible(f"treecli: warning: {' '.join(str(message).splitlines())}") + "\n")

    shown, warnings.showwarning = warnings.showwarning, show
    try:
        yield
    finally:
        warnings.showwarning = shown


# A message line is cut here, whatever built it: an error never floods a terminal.
_MAX_LINE = 2000


def _print_error(headline: str, details: list[str] = (), *, json: bool = False, error: object = None) -> None:
    """The error's one line on stderr (and its details under it); with ``--json``, also a
    JSON document on stdout, so that a script reading it never reads nothing."""
    from treecli._escape import clipped_middle, visible

    headline = clipped_middle(" ".join(headline.splitlines()), _MAX_LINE)
    details = [clipped_middle(d, _MAX_LINE) for d in details]
    _cluster.failed(headline)  # the other processes of a run stop too
    lines = [f"treecli: error: {headline}"]
    lines += [f"    {d}" for d in details[:20]]
    if len(details) > 20:
        lines.append(f"    ... and {len(details) - 20} more")
    sys.stderr.write("\n".join(visible(line) for line in lines) + "\n")
    if json:
        import json as json_module

        from treecli._escape import json_text

        document = {"error": {"line": headline, "file": getattr(error, "file", None),
                              "keypath": getattr(error, "keypath", None),
                              "message": clipped_middle(getattr(error, "message", headline), _MAX_LINE),
                              "details": details}}
        with contextlib.suppress(OSError):
            sys.stdout.write(json_text(json_module.dumps(document, indent=2)) + "\n")


def run() -> None:
    """Console-script entry point.

    The process ends with the command, so the cyclic collector stays off throughout (in
    ``main`` it is paused only) and the exit skips the interpreter's teardown: a last
    collection and freeing a big tree object by object, 0.15-0.3 s of showing a 200k-tensor
    header. Every output is fsynced and closed by the time ``main`` returns, and no treecli
    thread outlives it; stdout and stderr are flushed here.
    """
    from treecli.cli import _supervise

    if _supervise.needed(sys.argv[1:], dict(os.environ)):  # one process of several: watched from a parent
        os._exit(_supervise.run(sys.argv[1:]))
    gc.disable()
    _gc.exit_without_freeing()
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `treecli show big | head` closed the pipe: not an error
        pass
    except OSError as e:  # `treecli show big > file` on a full disk: not a success
        _print_error(f"cannot write standard output: {e.strerror or e}")
        code = code or ExitStatus.ERROR
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)
