"""The schedule of ``chaos.py``: which workload, which fault, when and where, drawn from a seed.

Pure and deterministic: ``plan(seed, count, workloads, faults)`` gives the same runs for the
same arguments on any machine, and a soak takes as many of them, in order, as its minutes
allow. The fault kinds come in rounds, each kind once per round in a shuffled order (so a
short soak meets every kind); each run then draws a workload the kind applies to, its moment,
target rank, restarts and durations.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: The 2-rank workloads: the four on the local backend, the elastic one on a ``LocalCluster``
#: of two nodes (``min_processes=1``), and DDP on the Spark ``local-cluster``.
WORKLOADS = ("ddp", "fsdp2", "deepspeed", "stream", "elastic", "spark")

#: Seconds from the first rank's start (its PID file) within which a fault's moment is drawn:
#: about the training's length (12 steps of 0.1 s, 0.15 s for elastic; DeepSpeed's engine
#: takes a second or two to build after the ranks start).
WINDOW = {
    "ddp": 1.2,
    "fsdp2": 1.2,
    "deepspeed": 2.5,
    "stream": 1.2,
    "elastic": 2.0,
    "spark": 1.4,
}
#: Faults whose moment counts from the launch call instead, start-up included: the caller's
#: fork server may be hit before it has forked a rank, the caller before it has a fork server.
FROM_LAUNCH = {"kill-forkserver": 1.5, "kill-caller": 5.0}

#: Workloads that write ``sparktrain.checkpoint``s (on the small tmpfs: a disk can fill).
CHECKPOINTING = ("ddp", "stream", "elastic", "spark")
#: Workloads with a node other than the caller, and a TCP channel from it to the driver.
REMOTE = ("elastic", "spark")
#: Workloads a caller started as a subprocess can run (the caller-kill fault).
SUBPROCESS = ("ddp", "fsdp2", "stream")

#: Fault kind -> the workloads it applies to.
FAULTS: dict[str, tuple[str, ...]] = {
    "none": WORKLOADS,
    "kill-rank": WORKLOADS,
    "kill-forkserver": WORKLOADS,
    "kill-node": REMOTE,
    "kill-caller": SUBPROCESS,
    "stop-rank": WORKLOADS,
    "disk-full": CHECKPOINTING,
    "slow-rank": WORKLOADS,
    "drop-connection": WORKLOADS,
}
#: Fault kind -> its row in the table.
LABELS = {
    "none": "none (control)",
    "kill-rank": "SIGKILL a rank",
    "kill-forkserver": "SIGKILL the fork server",
    "kill-node": "SIGKILL a node/executor",
    "kill-caller": "SIGKILL the caller",
    "stop-rank": "SIGSTOP a rank > hang_timeout",
    "disk-full": "disk full at a checkpoint",
    "slow-rank": "slow rank (short SIGSTOPs)",
    "drop-connection": "dropped TCP connection",
}
#: Fault kinds that strike a rank (the others strike its server, node, caller or disk).
RANK_FAULTS = ("kill-rank", "stop-rank", "slow-rank", "drop-connection")


@dataclass(frozen=True)
class Run:
    """One run of the soak.

    Attributes:
        index: Its number in the schedule (from 1).
        fault: A key of :data:`FAULTS`.
        workload: One of :data:`WORKLOADS`.
        moment: Seconds after the first rank started (after the launch call for the kinds of
            :data:`FROM_LAUNCH` on the local backend) when the fault strikes; it then waits
            for its target.
        rank: The rank it strikes (rank faults; for node and fork-server faults, the rank whose
            node or server it is).
        max_restarts: The launch's ``max_restarts``.
        hold: Seconds a disk stays full.
        pauses: The stops of a slow rank, in seconds each.
    """

    index: int
    fault: str
    workload: str
    moment: float
    rank: int
    max_restarts: int
    hold: float
    pauses: tuple[float, ...]

    @property
    def from_launch(self) -> bool:
        """Whether :attr:`moment` counts from the launch call (else from the first rank)."""
        return self.fault in FROM_LAUNCH and self.workload not in REMOTE

    def describe(self) -> str:
        """``#12 ddp, SIGKILL rank 1 at 1.23s, max_restarts=1``."""
        target = f" (rank {self.rank})" if self.fault in RANK_FAULTS else ""
        after = "" if self.from_launch else " of training"
        if self.fault == "none":
            return f"#{self.index} {self.workload}, no fault, max_restarts={self.max_restarts}"
        if self.fault == "kill-caller":  # its caller runs without restarts
            return f"#{self.index} {self.workload}, kill-caller at {self.moment:.2f}s"
        return (
            f"#{self.index} {self.workload}, {self.fault}{target} at {self.moment:.2f}s{after}, "
            f"max_restarts={self.max_restarts}"
        )


def kinds(workloads: Sequence[str], faults: Sequence[str]) -> list[str]:
    """The fault kinds among ``faults`` that apply to at least one of ``workloads``."""
    return [f for f in FAULTS if f in faults and any(w in FAULTS[f] for w in workloads)]


def _one(rng: random.Random, index: int, fault: str, workloads: Sequence[str]) -> Run:
    workload = rng.choice([w for w in workloads if w in FAULTS[fault]])
    window = FROM_LAUNCH.get(fault, WINDOW[workload])
    if workload in REMOTE:  # a remote node's fork server is found from its rank
        window = WINDOW[workload]
    return Run(
        index=index,
        fault=fault,
        workload=workload,
        moment=round(rng.uniform(0.0, window), 3),
        rank=rng.randrange(2),
        max_restarts=rng.choice((0, 1, 2)),
        hold=round(rng.uniform(0.5, 4.0), 3),
        pauses=tuple(round(rng.uniform(0.1, 1.5), 3) for _ in range(rng.randint(2, 5))),
    )


def plan(
    seed: int,
    count: int,
    workloads: Sequence[str] = WORKLOADS,
    faults: Sequence[str] = tuple(FAULTS),
) -> list[Run]:
    """The first ``count`` runs of the schedule of ``seed``, for the kinds that apply."""
    usable = kinds(workloads, faults)
    if not usable:
        raise ValueError(f"no fault kind of {list(faults)} applies to workloads {list(workloads)}")
    ordered = [w for w in WORKLOADS if w in workloads]  # the draw does not follow the order given
    rng = random.Random(seed)
    runs: list[Run] = []
    while len(runs) < count:
        for fault in rng.sample(usable, len(usable)):
            if len(runs) < count:
                runs.append(_one(rng, len(runs) + 1, fault, ordered))
    return runs
