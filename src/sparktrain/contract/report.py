"""How one node's ranks ended, in a form that travels from the node to the driver.

After its agent returns, a node reads each failed rank's record (exception, traceback, time) and
each kept rank's pickled return value from the run directory, and packs them into a
:class:`NodeReport`. Reports are built here only: a node that could not start its ranks, or
whose agent failed, or that the driver lost, is described by the constructors below.
"""

from __future__ import annotations

import pickle
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparktrain.contract.outcome import NodeOutcome
from sparktrain.contract.paths import error_path, result_path
from sparktrain.ground.errors import RankFailure, StackSite


def _signal_failure(
    rank: int, host: str, code: int, when: float, tail: tuple[str, ...]
) -> RankFailure:
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    message = f"killed by {name}"
    if -code == signal.SIGKILL:
        message += " (often the out-of-memory killer: check `dmesg` and the rank's memory use)"
    elif -code == signal.SIGSEGV:
        message += " (a segmentation fault in native code)"
    return RankFailure(rank, host, when, None, message, "", code, tail)


def rank_failure(
    rank: int,
    host: str,
    code: int,
    when: float,
    *,
    record: dict[str, Any] | None,
    tail: tuple[str, ...],
) -> RankFailure:
    """The failure report of one rank from its exit code and, if it wrote one, its record."""
    if record is not None:
        return RankFailure(
            rank,
            host,
            record["time"],
            record["exc_type"],
            record["message"],
            record["traceback"],
            code,
            tail,
        )
    if code < 0:
        return _signal_failure(rank, host, code, when, tail)
    message = f"exited with code {code} without a Python exception"
    return RankFailure(rank, host, when, None, message, "", code, tail)


def _read_record(run_dir: str, rank: int) -> dict[str, Any] | None:
    path = error_path(run_dir, rank)
    if not path.exists():
        return None
    record: dict[str, Any] = pickle.loads(path.read_bytes())
    return record


@dataclass(frozen=True)
class NodeReport:
    """How one node's ranks ended, in a form that travels (from a Spark task to the driver).

    Attributes:
        node_rank: The node.
        host: Its host.
        ranks: The global ranks it ran.
        failures: Ranks that failed on their own (not stopped by us), by rank.
        stopped: Ranks stopped because of a failure elsewhere, a timeout or Ctrl-C.
        values: Pickled return values of the ranks asked for, by rank.
        running_at_timeout: Ranks still running when the timeout passed.
        gpus: GPU addresses the node's ranks owned.
        hung: Whether the node's ranks made no progress for ``hang_timeout``.
        hang_sites: Where each hung rank waited.
        hang_silent: Hung ranks that gave no stack.
        agent_error: Why the node agent itself failed (not a rank), if it did.
        setup_errors: Why the node's ranks were not started (bad GPU addresses, ...), as told
            by every node, so that all nodes agree.
    """

    node_rank: int
    host: str
    ranks: tuple[int, ...]
    failures: Mapping[int, RankFailure]
    stopped: tuple[int, ...]
    values: Mapping[int, bytes]
    running_at_timeout: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()
    setup_errors: tuple[str, ...] = ()
    agent_error: str | None = None
    hung: bool = False
    hang_sites: Mapping[int, StackSite] = field(default_factory=dict)
    hang_silent: tuple[int, ...] = ()

    @classmethod
    def not_started(cls, node: int, host: str, errors: Sequence[str]) -> NodeReport:
        """A node whose ranks were not started, for ``errors`` that every node agrees on."""
        return cls(
            node_rank=node, host=host, ranks=(), failures={}, stopped=(), values={},
            setup_errors=tuple(errors),
        )  # fmt: skip

    @classmethod
    def broken(cls, node: int, host: str, why: str) -> NodeReport:
        """A node whose agent failed (or was lost) for ``why``: infrastructure, not a rank."""
        return cls(
            node_rank=node, host=host, ranks=(), failures={}, stopped=(), values={},
            agent_error=f"node {node} on {host}: {why}"[:2000],
        )  # fmt: skip

    @classmethod
    def left(cls, node: int, host: str) -> NodeReport:
        """A node lost while its peers went on in place (``in_place``): nothing to report."""
        return cls(node_rank=node, host=host, ranks=(), failures={}, stopped=(), values={})

    @classmethod
    def killed(cls, node: int, host: str, ranks: Sequence[int]) -> NodeReport:
        """A node the driver killed while stopping the run: its ranks count as stopped."""
        return cls(
            node_rank=node, host=host, ranks=tuple(ranks), failures={}, values={},
            stopped=tuple(ranks),
        )  # fmt: skip


def node_report(
    outcome: NodeOutcome,
    run_dir: str,
    *,
    node_rank: int,
    host: str,
    tails: Mapping[int, tuple[str, ...]],
    keep: tuple[int, ...],
    gpus: tuple[str, ...] = (),
) -> NodeReport:
    """Read a node's failure records and return values after its agent finished."""
    failures: dict[int, RankFailure] = {}
    stopped: list[int] = []
    for rank, ended in outcome.exits.items():
        if ended.exit_code == 0:
            continue
        record = _read_record(run_dir, rank)
        if ended.stopped and (record is None or record["time"] >= (outcome.stop_time or 0.0)):
            stopped.append(rank)  # stopped by us, not a failure of its own
            continue
        failures[rank] = rank_failure(
            rank, host, ended.exit_code, ended.time, record=record, tail=tails.get(rank, ())
        )
    values = {}
    for rank in keep:
        path = result_path(run_dir, rank)
        if path.exists():
            values[rank] = path.read_bytes()
    return NodeReport(
        node_rank=node_rank,
        host=host,
        ranks=tuple(sorted(outcome.exits)),
        failures=failures,
        stopped=tuple(sorted(stopped)),
        values=values,
        running_at_timeout=outcome.running_at_timeout,
        gpus=gpus,
        hung=outcome.hung,
        hang_sites=dict(outcome.hang_sites),
        hang_silent=outcome.hang_silent,
    )
