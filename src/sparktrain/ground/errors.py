"""Errors that sparktrain raises, and the culprit/victim report of a failed run.

Design choices:
- Bad input is a :class:`ConfigError` (a ``ValueError``) raised before any process starts; its
  message names the value and says what to do. When the fault is the machine's or the
  cluster's set-up (GPUs, Spark's resources, TLS), it is a :class:`ClusterConfigError`, which is
  a ``RuntimeError`` as well, as the originals' errors for those conditions are.
- A failed run is one :class:`TrainingFailedError` (a ``RuntimeError``) that names the *culprit*,
  the rank that failed first, with its remote traceback, and the *victims*, the ranks stopped
  because of it. Every rank's failure stays available in ``failures`` for programs.
- A failure of the infrastructure (a lost node, executor, actor or fork server) is one
  :class:`ClusterError`, whatever the backend. Like a rank's failure, it is restarted under
  ``max_restarts``; an elastic run (``min_processes``) continues on the capacity left instead.
- A rank killed from outside without a Python exception (SIGKILL, SIGTERM: preempted,
  OOM-killed) or failed only because a peer vanished is infrastructure too:
  :attr:`TrainingFailedError.cause` says ``"infrastructure"``, and an elastic run treats it as
  a lost process. A Python exception raised by the training code (or a crash such as SIGSEGV)
  is ``"training code"``: a bug, never retried elastically.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A launch was asked for with a bad value; nothing was started."""


class ClusterConfigError(ConfigError, RuntimeError):
    """The machine or cluster is set up in a way this launch cannot run on; nothing was started.

    GPUs asked for but absent or too few, Spark's GPU resources unset or not matching the ranks,
    TLS on without the override. pyspark's ``TorchDistributor`` and spark-tensorflow-distributor
    raise ``RuntimeError`` (or ``Exception``) for these conditions, so this error is a
    ``RuntimeError`` too: ``except RuntimeError`` in code written for them still catches it,
    and ``except ConfigError`` (a ``ValueError``) in code written for sparktrain as well.
    """


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed.

    Attributes:
        rank: Global rank.
        host: Host the rank ran on.
        time: Wall-clock time of the failure (seconds since the epoch).
        exc_type: Qualified name of the exception type, or ``None`` when the rank died without one.
        message: The exception's message, or a sentence on how the process ended.
        traceback: The remote traceback as text ("" when there is none).
        exit_code: Process exit code; negative for a signal (``-9`` is SIGKILL).
        log_tail: The last lines the rank wrote to stderr, for deaths without a traceback.
    """

    rank: int
    host: str
    time: float
    exc_type: str | None
    message: str
    traceback: str = ""
    exit_code: int | None = None
    log_tail: tuple[str, ...] = ()

    @property
    def signal_name(self) -> str | None:
        """The name of the signal that killed the rank, if one did."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def summary(self) -> str:
        """One line: what happened to this rank."""
        if self.exc_type:
            return f"{self.exc_type}: {self.message}"
        return self.message


class TrainingFailedError(RuntimeError):
    """A distributed run failed: names the culprit rank, its traceback and the victim ranks.

    Attributes:
        culprit: The rank that failed first, or ``None`` (a timeout has no culprit).
        victims: Ranks stopped, or failing, because of the culprit.
        failures: Every failed rank's report, by rank.
        attempts: How many times the group was started.
    """

    def __init__(
        self,
        culprit: RankFailure | None,
        victims: tuple[int, ...],
        failures: dict[int, RankFailure],
        *,
        attempts: int = 1,
        headline: str | None = None,
    ) -> None:
        self.culprit = culprit
        self.victims = victims
        self.failures = failures
        self.attempts = attempts
        self.headline = headline
        super().__init__(headline or _describe(culprit, victims, attempts))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from every field, so the error survives pickling (process pools, Ray...).
        return (_rebuild, (type(self), dict(self.__dict__)))

    @property
    def cause(self) -> str:
        """``"training code"`` (a Python exception: a bug) or ``"infrastructure"``.

        Infrastructure: the culprit was killed from outside without a Python exception (SIGKILL,
        SIGTERM, SIGHUP or SIGINT: preempted, OOM-killed, its node gone), or failed only because
        a peer vanished. A crash (SIGSEGV, SIGABRT...) is the training code's.
        """
        return "training code" if self.culprit is None else _cause_of(self.culprit)

    def __str__(self) -> str:
        text = self.headline or _describe(self.culprit, self.victims, self.attempts)
        if self.headline and self.attempts > 1:
            text += f" ({self.attempts} attempts ran)"
        return text


@dataclass(frozen=True)
class StackSite:
    """Where one rank was waiting when a hang was detected.

    Attributes:
        rank: Global rank.
        function: The innermost function (e.g. ``all_reduce``).
        user_file: File of the innermost frame outside torch and the standard library.
        user_line: Its line.
        user_function: Its function.
        stack: The rank's whole Python stack, most recent call first.
        note: What the rank waited on, where more is known than its stack says (a build lock
            that no process holds), with what to do.
    """

    rank: int
    function: str
    user_file: str
    user_line: int
    user_function: str
    stack: str
    note: str = ""

    def describe(self) -> str:
        """``rank 1 in all_reduce at train.py:42 (in train)``, and the note if there is one."""
        where = f"{os.path.basename(self.user_file)}:{self.user_line}" if self.user_file else "?"
        said = f"rank {self.rank} in {self.function} at {where} (in {self.user_function})"
        return f"{said}: {self.note}" if self.note else said


class HangError(TrainingFailedError):
    """No rank made progress for ``hang_timeout`` seconds; says where each rank waited."""

    def __init__(self, hang_timeout: float, sites: dict[int, StackSite], silent: tuple[int, ...]):
        self.sites = sites
        lines = [
            f"no rank made progress for hang_timeout={hang_timeout:g}s (no output, no "
            "sparktrain.report()); the run was stopped. Where each rank was waiting:"
        ]
        lines += [f"  {sites[r].describe()}" for r in sorted(sites)]
        lines += [f"  rank {r}: no stack (it did not answer)" for r in silent if r not in sites]
        if not sites or not all(site.note for site in sites.values()):
            lines.append(
                "A rank waiting in a collective that another rank never reached usually means "
                "the ranks took different branches or ran different numbers of steps."
            )
        super().__init__(
            None, tuple(sorted(set(sites) | set(silent))), {}, headline="\n".join(lines)
        )


class ClusterError(RuntimeError):
    """The infrastructure failed, not a rank's code.

    A lost node, executor, Ray actor or fork server, a Spark job that failed or was cancelled,
    nodes that did not end when killed. On every backend, ``max_restarts`` restarts the run
    after one, as after a rank's failure; an elastic run continues on the capacity left.
    """

    cause = "infrastructure"


class CapacityError(ClusterError):
    """An elastic run lost capacity and fewer ranks than ``min_processes`` can run now."""


class GrowBack(BaseException):
    """Raised in every rank by ``sparktrain.checkpoint.save`` when the run is to grow back.

    The driver of an elastic run that lost capacity asks the ranks to stop at their next
    checkpoint once capacity has returned; the checkpoint is on disk when this is raised, and
    the run starts again at its target size from it. A ``BaseException``, like ``SystemExit``,
    so that ``except Exception`` in training code does not swallow it.
    """


class CheckpointError(RuntimeError):
    """A checkpoint could not be written: raised by the next ``save`` or ``checkpoint.wait()``.

    A checkpoint is written in the background after ``save`` returns; when that write fails (a
    full disk, a rank's part that did not arrive), the checkpoint is not published, the
    previous one stays the newest, and this error names the step, the rank and the cause.
    """


#: The name this error had when only the Spark backend raised it; the same class.
SparkJobError = ClusterError


class TrainingTimeoutError(TrainingFailedError):
    """A run outlived its ``timeout=``; names the ranks that were still running."""

    def __init__(self, timeout: float, running: tuple[int, ...], done: tuple[int, ...]) -> None:
        self.running = running
        what = (
            f"stopped the ranks still running: {_ranks(running)}"
            + (f" (finished: {_ranks(done)})" if done else "")
            if running
            else "it passed between two attempts (after a restart or a rescale); the next was "
            "not started"
        )
        headline = (
            f"the run did not finish within timeout={timeout:g}s; {what}. Raise timeout= if the "
            "run needs longer, or look for a rank waiting on a collective that another rank "
            "never reached."
        )
        super().__init__(None, running, {}, headline=headline)


_CONNECTION = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|"
    r"connection refused|socket timeout|NCCL communicator was aborted|"
    r"ProcessGroupNCCL.*(abort|timeout)|gloo.*(closed|reset)",
    re.IGNORECASE,
)


#: Ends the error of a rank that failed only because a peer did (a checkpoint a peer could not
#: write): the peer is the culprit.
PEERS_OWN_ERROR = "(their own error says why)"


def is_consequence(message: str) -> bool:
    """Whether a rank's error is a consequence of a peer's: its connection, or its write."""
    return is_connection_error(message) or PEERS_OWN_ERROR in message


def is_connection_error(message: str) -> bool:
    """Whether a rank's error message is a peer's connection failing (a consequence)."""
    return bool(_CONNECTION.search(message))


_FORMING = re.compile(r"connectFullMesh|init_process_group|rendezvous|new_group|TCPStore")
_REMOTE = re.compile(r"remote=\[?([0-9A-Fa-f.:]+?)\]?:(\d+)")


def failed_forming_group(failure: RankFailure) -> bool:
    """Whether ``failure`` is a connection that failed while the process group formed.

    That is before any collective: the ranks never reached each other, which a lost node
    does not explain when every node is still there. It is the network's set-up.
    """
    text = f"{failure.message}\n{failure.traceback}"
    return is_connection_error(text) and bool(_FORMING.search(text))


def _forming_hint(failure: RankFailure) -> str:
    found = _REMOTE.search(f"{failure.message}\n{failure.traceback}")
    tried = f" (it tried {found.group(1)}:{found.group(2)})" if found else ""
    loopback = ""
    if found and (found.group(1).startswith("127.") or found.group(1) in ("::1", "localhost")):
        loopback = (
            f" {found.group(1)} is a loopback address: that peer's host name resolves to "
            "loopback on its machine, so its device announced an address no other host reaches."
        )
    return (
        f"hint: the ranks could not connect to each other while the process group formed"
        f"{tried}.{loopback} gloo and NCCL announce the address of the interface that "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name; sparktrain sets them to the interface "
        "of each node's address unless you do. Set them to the interface by which the nodes "
        "reach each other, e.g. env={'GLOO_SOCKET_IFNAME': 'eth1', 'NCCL_SOCKET_IFNAME': "
        "'eth1'}, or fix the host name's address (`sparktrain doctor` checks it)."
    )


_CAUSES = {
    "training code": "training code (a Python exception raised by it: a bug, which "
    "max_restarts may retry but an elastic run never rescales for)",
    "infrastructure": "infrastructure (a process died without a Python exception, or "
    "lost its peers; an elastic run continues on the capacity left)",
}


#: Signals that end a process from outside (preemption, the OOM killer, a node going away);
#: a crash of the process itself (SIGSEGV, SIGABRT, SIGFPE, SIGBUS) is the training code's.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})


def _cause_of(culprit: RankFailure) -> str:
    code = culprit.exit_code or 0
    if culprit.exc_type is None and code < 0 and -code in _OUTSIDE_SIGNALS:
        return "infrastructure"
    return "infrastructure" if is_connection_error(culprit.message) else "training code"


def _rebuild(cls: type[TrainingFailedError], fields: dict[str, Any]) -> TrainingFailedError:
    error = cls.__new__(cls)
    error.__dict__.update(fields)
    RuntimeError.__init__(error, str(error))
    return error


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(f"rank {r}" for r in ranks) if ranks else "none"


def _describe(culprit: RankFailure | None, victims: tuple[int, ...], attempts: int) -> str:
    if culprit is None:
        return "the run failed"
    where = f"rank {culprit.rank}" + (f" on {culprit.host}" if culprit.host else "")
    lines = [f"{where} failed first: {culprit.summary()}"]
    if attempts > 1:
        lines[0] += f" (attempt {attempts} of {attempts})"
    lines.append(f"victims (stopped because of it): {_ranks(victims)}")
    lines.append(f"cause: {_CAUSES[_cause_of(culprit)]}")
    if failed_forming_group(culprit):
        lines.append(_forming_hint(culprit))
    if culprit.traceback:
        lines += ["", f"Traceback of rank {culprit.rank}:", culprit.traceback.rstrip()]
    elif culprit.log_tail:
        lines += ["", f"last lines of rank {culprit.rank}'s stderr:", *culprit.log_tail]
    return "\n".join(lines)
