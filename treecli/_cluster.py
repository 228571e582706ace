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
import os
import time
from dataclasses import dataclass, field
from typing import Any

from treecli._errors import TreecliError, UsageError

# How long a process waits for the others at one step: the slowest one's share of the
# reading and writing, on a busy cluster.
BARRIER_SECONDS = float(os.environ.get("TREECLI_BARRIER_SECONDS", 3600))


class ClusterFailure(TreecliError):
    """Another process (or several) failed: nothing is published."""


@dataclass
class Cluster:
    """This process's place in a run of several, and the coordinator's messages."""

    process_id: int
    count: int
    client: Any  # JAX's distributed runtime client: its key-value store and barriers
    _steps: Any = field(default_factory=itertools.count)

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
                raise ClusterFailure(f"{len(lines)} of {self.count} processes failed ({first}); "
                                     "nothing was published")
            if len(self.client.key_value_dir_get(f"{name}/")) == self.count:
                return
            if time.monotonic() > deadline:
                raise ClusterFailure(f"the other processes did not all finish {step!r} within "
                                     f"{BARRIER_SECONDS:g} s (TREECLI_BARRIER_SECONDS); nothing was published")
            time.sleep(pause)
            pause = min(0.05, pause * 2)  # the coordinator is asked often at first, then every 50 ms

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


def start(coordinator: str | None, num_processes: int | None, process_id: int | None, detect: bool) -> None:
    """Join the run the options (or ``TREECLI_*`` variables) name, or the one JAX detects.

    Raises:
        UsageError: some of the three are given without the others, or bad values.
        TreecliError: the runtime could not start (the coordinator unreachable).
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
    import jax
    from jax._src import distributed  # the runtime's client: its key-value store and barriers

    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    except Exception as e:
        raise TreecliError(f"JAX's distributed runtime did not start: {str(e).splitlines()[0][:300]}") from None
    count = jax.process_count()
    if count > 1:
        _current = Cluster(jax.process_index(), count, distributed.global_state.client)


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
