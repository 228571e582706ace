"""One treecli run over several processes, on JAX's distributed runtime.

``treecli --coordinator HOST:PORT --num-processes N --process-id I COMMAND ...`` (or
``TREECLI_COORDINATOR`` / ``TREECLI_NUM_PROCESSES`` / ``TREECLI_PROCESS_ID``, or
``--distributed`` to let JAX find the cluster: SLURM, a TPU pod, MPI) starts
``jax.distributed.initialize``, and every message between the processes goes through
its coordinator: its key-value store and its barriers. treecli has no transport of its
own.

Every process opens the same inputs, checks them the same way and builds the same lazy
output tree, so that they agree on the output's layout without a word; then each
computes and writes its own :func:`share` of the output's bytes (reading only that share
of every input), and they :meth:`Cluster.agree` after each step: a failure anywhere
stops every process before the next step, and process 0 publishes only after every
process has written its share.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from treecli._errors import TreecliError, UsageError

# How long a process waits for the others at one step: the slowest one's share of the
# reading and writing, on a busy cluster.
BARRIER_SECONDS = float(os.environ.get("TREECLI_BARRIER_SECONDS", 3600))
# How long a process waits for all the others to join, unless --join-timeout says.
JOIN_SECONDS = 30.0
# After this long without a heartbeat the runtime stops the others (JAX's default: 100 s).
HEARTBEAT_SECONDS = 20


class ClusterFailure(TreecliError):
    """Another process (or several) failed: nothing is published."""


@dataclass
class Cluster:
    """This process's place in a run of several, and the coordinator's messages."""

    process_id: int
    count: int
    client: Any  # JAX's distributed runtime client: its key-value store and barriers
    coordinator: str = "the coordinator JAX found"  # its address, for messages
    _steps: Any = field(default_factory=itertools.count)

    @property
    def who(self) -> str:
        """This process and its run, as a message names them."""
        return f"process {self.process_id} of {self.count} (coordinator {self.coordinator})"

    @property
    def publishes(self) -> bool:
        """The one process that publishes what all of them wrote (process 0)."""
        return self.process_id == 0

    def agree(self, step: str, error: str | None = None) -> None:
        """Say how this process's part of ``step`` went, wait for every process to say
        so, and fail together if any failed — here or anywhere before (a process that
        could not open its inputs says so through :func:`failed`, and is not waited for).

        Raises:
            ClusterFailure: some process failed (each named with its one line), or the
                others did not all come within ``TREECLI_BARRIER_SECONDS``.
        """
        if error:
            self.fail(error)
        name = f"treecli/step/{next(self._steps)}"
        self.client.key_value_set(f"{name}/{self.process_id}", "done")
        deadline = time.monotonic() + BARRIER_SECONDS
        pause = 0.001
        while True:
            failures = self.client.key_value_dir_get("treecli/failed/")
            if failures:
                lines = sorted((int(key.rsplit("/", 1)[1]), line) for key, line in failures)
                first = "; ".join(f"process {i}: {line}" for i, line in lines[:2])
                raise ClusterFailure(f"{self.who}: {len(lines)} of {self.count} processes failed ({first}); "
                                     "nothing was published")
            if len(self.client.key_value_dir_get(f"{name}/")) == self.count:
                return
            if time.monotonic() > deadline:
                raise ClusterFailure(f"{self.who}: the other processes did not all finish {step!r} within "
                                     f"{BARRIER_SECONDS:g} s (TREECLI_BARRIER_SECONDS); nothing was published")
            time.sleep(pause)
            pause = min(0.05, pause * 2)  # the coordinator is asked often at first, then every 50 ms

    def check_same(self, fingerprint: str, timeout: float) -> None:
        """Show the others this process's command, and see theirs, before any work.

        Raises:
            ClusterFailure: one runs another command or on other inputs (two runs on one
                address pair up), or they did not all say theirs within ``timeout``.
        """
        self.client.key_value_set(f"treecli/command/{self.process_id}", fingerprint)
        deadline = time.monotonic() + timeout
        while True:
            said = dict(self.client.key_value_dir_get("treecli/command/"))
            if len(said) >= self.count:
                break
            if time.monotonic() > deadline:
                raise ClusterFailure(f"{self.who}: the other processes did not all start their command within "
                                     f"{timeout:g} s")
            time.sleep(0.01)
        others = sorted(int(key.rsplit("/", 1)[1]) for key, value in said.items() if value != fingerprint)
        if others:
            raise ClusterFailure(f"{self.who}: process {others[0]} runs another command, or on other inputs: are "
                                 "two runs on one address? nothing was done")

    def fail(self, line: str) -> None:
        """Tell every process that this one failed (its one line): none of them goes on."""
        self.client.key_value_set(f"treecli/failed/{self.process_id}", line, allow_overwrite=True)

    def tell(self, key: str, value: str) -> None:
        self.client.key_value_set(f"treecli/said/{key}", value)

    def hear(self, key: str) -> str:
        return self.client.blocking_key_value_get(f"treecli/said/{key}", int(BARRIER_SECONDS * 1000))


_current: Cluster | None = None


def current() -> Cluster | None:
    """The run of several processes this one belongs to, if any (one process alone: ``None``)."""
    return _current


def start(coordinator: str | None, num_processes: int | None, process_id: int | None, detect: bool, *,
          join_timeout: float | None = None, command: list[str] = (), on_joined=lambda: None) -> None:
    """Join the run the options (or ``TREECLI_*`` variables) name, or the one JAX detects,
    within ``join_timeout`` seconds; then every process shows the others its ``command``
    (the arguments, with each local input's identity) before any work, and a run whose
    processes do not all run the same command on the same inputs stops.

    Raises:
        UsageError: some of the three are given without the others, or bad values.
        TreecliError: the runtime could not start (the coordinator unreachable); another
            process runs another command.
    """
    global _current
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if not detect and all(v is None for v in given.values()):
        return
    missing = [name for name, value in given.items() if value is None]
    if not detect and missing:
        raise UsageError(f"a run of several processes needs --coordinator, --num-processes and --process-id "
                         f"(or --distributed); missing: {', '.join(missing)}")
    if num_processes is not None and (num_processes < 1 or not 0 <= (process_id or 0) < num_processes):
        raise UsageError(f"--process-id {process_id} is not one of 0..{num_processes - 1}")
    if coordinator is not None:
        _check_address(coordinator)
    timeout = JOIN_SECONDS if join_timeout is None else join_timeout
    if not 0 < timeout <= 86400:
        raise UsageError(f"--join-timeout {timeout:g}: give seconds, more than 0 and at most a day")
    import jax
    from jax._src import distributed  # the runtime's client: its key-value store and barriers

    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=max(1, math.ceil(timeout)),
                                   heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
    except Exception as e:
        raise TreecliError(f"process {process_id} could not join the run at {coordinator}: "
                           f"{str(e).splitlines()[0][:300]}") from None
    on_joined()
    count = jax.process_count()
    if count > 1:
        _current = Cluster(jax.process_index(), count, distributed.global_state.client,
                           distributed.global_state.coordinator_address or "the coordinator JAX found")
        _current.check_same(_fingerprint(command), timeout)


def _check_address(coordinator: str) -> None:
    """``HOST:PORT`` with a port a socket can have, before the runtime is asked (it aborts)."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator {coordinator!r}: write HOST:PORT, the port 1 to 65535")


def _fingerprint(command: Sequence[str]) -> str:
    """What every process of one run must share: its arguments (less its own process id),
    and each local file or directory they name, by real path, size and time of change."""
    import hashlib

    words, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word == "--process-id":
            skip = True
        elif not word.startswith("--process-id="):
            words.append(word)
            with contextlib.suppress(OSError, ValueError):
                if os.path.exists(word):
                    info = os.stat(word)
                    words.append(f"{os.path.realpath(word)}:{info.st_size}:{info.st_mtime_ns}")
    return hashlib.sha256("\0".join(words).encode("utf-8", "surrogatepass")).hexdigest()


def failed(line: str) -> None:
    """This process stops with an error: the others of its run stop at their next step."""
    if _current is not None:
        with contextlib.suppress(Exception):  # the runtime itself may be what failed
            _current.fail(line)


def finish() -> None:
    """Leave the run: every process waits here for the others, so that process 0, whose
    coordinator serves them all, never exits while one still needs it."""
    global _current
    if _current is None:
        return
    _current = None
    import jax

    with contextlib.suppress(Exception):  # a run already broken: each process has said its line
        jax.distributed.shutdown()


def share(total: int, cluster: Cluster) -> tuple[int, int]:
    """This process's bytes ``[begin, end)`` of ``total``: equal parts, in process order."""
    return total * cluster.process_id // cluster.count, total * (cluster.process_id + 1) // cluster.count
