"""The driver's side of elastic in place: the runs in progress, and ``sparktrain.preempt``.

An in-place attempt (``launch(..., in_place=True)``) hosts its ranks' store in the driver
(:func:`sparktrain.contract.inplace.host_store`) and registers its nodes here while it runs, so
that :func:`preempt`, called from the driver's process (a callback, another thread), can ask
the ranks of a node to leave at the end of their current step: the step commits, their share
of the data goes to the others, and nothing is trained again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from sparktrain.contract.inplace import (
    KIND,
    abort,
    gone,
    joined,
    keep_whole,
    latest,
    members,
    partitions_lost,
    post,
    replica_groups,
    replica_size,
    zero_node_ranks,
    zero_plans,
)
from sparktrain.driver.monitor import Monitor, say
from sparktrain.driver.results import Outcome, Rescale
from sparktrain.ground.errors import ConfigError

if TYPE_CHECKING:
    from sparktrain.backends.base import Nodes

_LOCK = threading.Lock()
NO_RANK_LEFT = "no rank is left"
#: Where a restart of an in-place run reads its state from, as the driver says it.
RELOADED = (
    " (its newest checkpoint, read from the survivors' memory where they hold it, else from "
    "storage)"
)
_RUNNING: list[Nodes] = []


@contextmanager
def running(nodes: Nodes) -> Iterator[None]:
    """While inside, :func:`preempt` reaches ``nodes``."""
    with _LOCK:
        _RUNNING.append(nodes)
    try:
        yield
    finally:
        with _LOCK:
            _RUNNING.remove(nodes)


def preempt(node: int | str) -> tuple[int, ...]:
    """Let a node of the in-place run in progress go without losing a step (a notice).

    Its ranks leave the group at the end of their current step, which commits on every rank;
    the others divide the rest of the data among themselves and go on. The run's
    ``RunResult.rescales`` gets a ``"preempted"`` entry once the node has ended.

    Args:
        node: The node's index in the run, or its host name as the logs show it.

    Returns:
        The ranks that leave.

    Raises:
        ConfigError: No in-place run is in progress in this process, or none has that node.
    """
    with _LOCK:
        runs = list(_RUNNING)
    if not runs:
        raise ConfigError(
            f"preempt({node!r}): no in-place run is in progress in this process; call it while "
            "launch(..., in_place=True) runs (from on_report, or another thread)."
        )
    for nodes in reversed(runs):
        ranks = nodes.preempt(node)
        if ranks:
            return ranks
    raise ConfigError(
        f"preempt({node!r}): no in-place run in progress has that node; pass a node index of "
        "the run or a host name its logs show (for example 'node1'), of a node still running."
    )


class Generations:
    """An in-place attempt's record on the driver: its ranks' store, and the rescales.

    The ranks re-form on their own when ranks leave or join; the driver names the survivors when
    nodes are lost, as the generation after the latest one in the store.
    """

    def __init__(self, store: Any, world_size: int, monitor: Monitor | None) -> None:
        """Follow the ranks of ``store`` (the attempt's, hosted here), ``world_size`` at first."""
        self.store, self.world, self.monitor = store, world_size, monitor
        self.generation = 0  # the latest the driver knows of
        self.rescales: list[Rescale] = []
        # ranks started to join (or dropped with their replica group) -> what they are, and the
        # generation then (a rank let in again has a later generation under joined/<rank>)
        self.joining: dict[tuple[int, ...], tuple[str, int]] = {}
        self.partners: dict[tuple[int, ...], tuple[int, ...]] = {}  # noticed -> dropped with them
        self.lost: set[int] = set()  # every rank lost in this attempt

    def lose(self, ranks: set[int], detail: str) -> bool:
        """The group's ``ranks`` are gone: name the others as the next generation.

        In a sharded run a replica group that lost a rank is dropped whole: its other ranks are
        out of the next generation and wait to join again with a returning node.

        Returns:
            ``False`` when no rank of the group would be left, (sharded) no replica group is
            whole, (ZeRO) an optimizer partition lost its owner and its copy, or no rank has
            started its in-place loop yet: the run goes back to its restart path.
        """
        self.check_joined()  # a join the group made before this loss is recorded before it
        self.generation = latest(self.store, self.generation)
        group = json.loads(self.store.get(members(self.generation)))
        if not ranks & set(group):  # a joiner lost before it was let in: the group is whole
            self.joining = {r: j for r, j in self.joining.items() if not ranks & set(r)}
            return True
        size = replica_size(self.store)
        survivors, dropped = keep_whole(group, ranks, size)
        node_ranks = zero_node_ranks(self.store)
        self.lost |= ranks
        why = self._no_live_copy(group, ranks, survivors)
        if why == NO_RANK_LEFT:  # the restart path says what it does
            return False
        if why:
            say(
                f"sparktrain: elastic: {detail}; {why}: the run goes back to its restart path"
                + ("" if why.startswith("no rank has") else RELOADED),
                self.monitor,
            )
            return False
        self.generation += 1
        self.store.set(members(self.generation), json.dumps(survivors))
        self.store.set(abort(self.generation - 1), "1")  # wakes a rank still in a collective
        outcome: Outcome = (  # sharded: a group goes; ZeRO: the partitions are cut anew
            "dropped group" if size > 1 else "redivided" if node_ranks else "kept"
        )
        if dropped:
            detail += (
                f"; replica group(s) with rank(s) {sorted(ranks & set(group))} dropped whole, "
                f"rank(s) {dropped} wait to join again as a group with a returning node"
            )
            self.join(tuple(dropped), f"rank(s) {dropped} of a dropped replica group, healed")
        self._note("lost", detail, len(group), len(survivors), outcome)
        return True

    def _no_live_copy(self, group: list[int], ranks: set[int], survivors: list[int]) -> str:
        """Why the survivors of ``ranks``' loss cannot go on in place ("": they can)."""
        if not self.store.check([KIND]):  # no rank reached its in-place loop yet
            return (
                "no rank has started its in-place loop yet (sparktrain.elastic.in_place or "
                "mesh), so what the survivors keep is not known and nothing has trained"
            )
        size, node_ranks = replica_size(self.store), zero_node_ranks(self.store)
        if not survivors:
            if size > 1:
                return (
                    f"no replica group of {size} ranks is whole (of "
                    f"{replica_groups(group, size)}), so no live copy of every shard is left"
                )
            return NO_RANK_LEFT
        if node_ranks:  # the ranks may hold partitions of the plan before their last cut
            plans = [group, *zero_plans(self.store)]
            lost = sorted({k for p in plans for k in partitions_lost(p, self.lost, node_ranks)})
            if lost:
                return (
                    f"optimizer partition(s) {lost} of {len(group)} lost their owner and their "
                    f"copy (ranks {sorted(ranks)} held them), so no live copy of the optimizer "
                    "state is left"
                )
        return ""

    def leave(self, ranks: tuple[int, ...]) -> None:
        """Ask ``ranks`` to leave at the end of their current step (a notice).

        In a sharded run the other ranks of their replica groups leave the group with them and
        wait to join again.
        """
        post(self.store, {"leave": list(ranks)})
        size = replica_size(self.store)
        if size > 1:
            group = json.loads(self.store.get(members(latest(self.store, self.generation))))
            _, partners = keep_whole(group, set(ranks), size)
            if partners:
                self.partners[ranks] = tuple(partners)

    def left(self, ranks: tuple[int, ...], detail: str) -> None:
        """A noticed node ended: a rescale if its ``ranks`` left (not if the run ended first)."""
        if self.store.check([gone(rank) for rank in ranks]):
            partners = self.partners.pop(ranks, ())
            if partners:
                detail += f"; rank(s) {list(partners)} of its replica group(s) wait to join again"
                self.join(partners, f"rank(s) {list(partners)} of a replica group, healed")
            outcome: Outcome = (
                "dropped group"
                if replica_size(self.store) > 1
                else "redivided"
                if zero_node_ranks(self.store)
                else "kept"
            )
            left = self.world - len(ranks) - len(partners)
            self._note("preempted", detail, self.world, left, outcome)

    def join(self, ranks: tuple[int, ...], detail: str) -> None:
        """``ranks`` were started to join the group (they ask in once they have started)."""
        self.joining[ranks] = (detail, latest(self.store, self.generation))

    def check_joined(self) -> None:
        """Record each joining node whose ranks are in (the group let them in: ``joined/<r>``)."""
        for ranks, (detail, since) in list(self.joining.items()):
            keys = [joined(rank) for rank in ranks]
            if self.store.check(keys) and all(int(self.store.get(k)) > since for k in keys):
                del self.joining[ranks]
                self._note("grew", detail, self.world, self.world + len(ranks), "healed")

    def _note(
        self,
        cause: Literal["lost", "grew", "preempted"],
        detail: str,
        old: int,
        new: int,
        outcome: Outcome,
    ) -> None:
        self.world = new
        rescale = Rescale(cause, detail, old, new, time.time(), in_place=True, outcome=outcome)
        self.rescales.append(rescale)
        say(rescale.describe(), self.monitor)
