"""Elastic in place: a step commits only when every rank reduced it; a loss costs one step.

The ranks of generation ``g`` form their group over ``PrefixStore("g<g>", store)`` with the
members named under ``members/<g>`` (their first ranks, in order). The store outlives every rank
(the driver hosts it). The gradients are views into one flat buffer, so ``backward()`` writes
them where the reduction reads them; its tail carries each rank's notice that it leaves and, from
the generation's rank 0, how many of the driver's requests (``request/<k>``: ranks to let go,
ranks that join) it has seen. Each step is one all-reduce of that buffer (asynchronous, the
generation's ``abort/<g>`` key looked at every few milliseconds while it runs: a rank whose
peer stopped taking part is woken at once instead of waiting for the group's timeout); then the
optimizer steps.

A rank that completes the all-reduce knows every rank contributed to it, so the committed step
counts of any two ranks differ by at most one. On a failure the rank sets ``abort/<g>``, writes
its committed count under ``state/<g>/<rank>``, leaves the group and waits for the survivors,
named under ``members/<g+1>``. They form generation ``g+1``; if some completed the step in flight
and others did not, the first of those that did sends its model, optimizer and data state to
the group (a broadcast, no disk), else the step is dropped everywhere. The data is divided again
at the new size from its in-memory state (``StreamingDataset.load_state_dict`` at another world
size reads every row once). A joining rank is healed by the same broadcast.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from sparktrain.contract.inplace import (
    FINISHED,
    KIND,
    abort,
    gone,
    joined,
    latest,
    members,
    post,
    posted,
    request,
)
from sparktrain.ground.errors import ConfigError
from sparktrain.rank import process_groups
from sparktrain.rank.flat_grads import grad_views, trained_params, use_views
from sparktrain.rank.inplace_keep import NO_KEEPER

#: How often a rank waiting on a collective looks at its generation's abort key (seconds).
ABORT_POLL_SECONDS = 0.01
#: How often the generation's rank 0 looks for the driver's requests (seconds).
REQUEST_POLL_SECONDS = 0.2
#: How many generations in a row a rank tries to form after a loss before it gives up.
RECOVERIES = 10
#: How long the survivors wait for the driver to name the next generation (seconds).
MEMBERS_TIMEOUT = 60.0


def _on_sigterm(leave: Callable[[], None]) -> None:
    """A SIGTERM (the cloud's or Spark's notice) makes the rank leave at the step's end."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: leave())


class Aborted(RuntimeError):
    """A peer of this generation failed: the collective was left, not finished."""


class InPlace:
    """One rank of an in-place elastic run: its model, optimizer and data stay in memory.

    Args:
        model: The module (plain, not wrapped in DDP: this class reduces its gradients).
        optimizer: Its optimizer (``step()`` steps it and zeroes the gradients).
        make_data: ``make_data(rank, world_size)``: this rank's dataset at a size (a
            ``sparktrain.data`` dataset, whose ``state_dict`` resumes at any size).
        store: The run's store, kept outside the ranks (a ``torch.distributed.Store``).
        me: This rank's first rank (its name in ``members/<g>``).
        timeout: The group's timeout for a collective.
        joining: This rank joins a running group: it waits until the survivors let it in
            (``joined/<me>``) and takes their state.
    """

    #: Errors of a recovery that end it rather than being tried again.
    FINAL: tuple[type[RuntimeError], ...] = ()
    keeper: Any = NO_KEEPER  #: its own checkpoint (``in_place(..., checkpoint_dir=)``)

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        make_data: Callable[[int, int], Any],
        *,
        store: Any,
        me: int,
        timeout: float = 30.0,
        joining: bool = False,
    ) -> None:
        self.model, self.optimizer, self.make_data = model, optimizer, make_data
        self.store, self.me, self.timeout = store, me, timeout
        self.params = trained_params(model)
        store.set(KIND, "replicated")  # the driver decides a loss by it
        self.generation = 0
        self.members: list[int] = []
        self.steps = self.dropped = 0  # committed; dropped
        self.requests_done = 0  # the driver's requests acted on
        self._requests_seen = 0
        self._next_look = 0.0
        self.data: Any = None
        self.data_state: dict[str, Any] | None = None  # at the last committed step
        self._reshard = False
        self.leaving = False  # set by SIGTERM (a preemption notice) or leave()
        self.left = False  # this rank left the group at a step boundary
        if joining:  # ask in when ready: the group does not wait on this rank's start
            post(self.store, {"join": [me]})
            if self._let_in():
                try:
                    self._form()
                    self._heal(0)
                except RuntimeError:  # a member lost while the group took this rank in
                    self._recovered()
            else:  # the run ended first
                self.left = True
        else:
            self._form()
            import torch.distributed as dist

            for tensor in self.model.state_dict().values():  # rank 0's weights, as DDP does
                dist.broadcast(tensor, 0)
        _on_sigterm(self.leave)

    def _let_in(self, after: int = -1) -> bool:
        """Wait until the group lets this joiner in (``True``) or the run ends (``False``)."""
        # after: the generation it asked in at (a rank let in again is let in at a later one)
        key, deadline = joined(self.me), time.monotonic() + MEMBERS_TIMEOUT
        while time.monotonic() < deadline:
            if self.store.check([key]) and int(self.store.get(key)) > after:
                self.generation = int(self.store.get(key))
                return True
            if self.store.check([FINISHED]):
                return False
            time.sleep(0.02)
        raise TimeoutError(f"rank {self.me} was not let in within {MEMBERS_TIMEOUT:.0f} s")

    def leave(self) -> None:
        """Leave the run at the end of the current step (the others go on without this rank)."""
        self.leaving = True

    @property
    def rank(self) -> int:
        """This rank's place in the current generation."""
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        """The current generation's size."""
        return len(self.members)

    # -- the group -----------------------------------------------------------------------------
    def _named(self, generation: int) -> list[int]:
        """The members ``generation`` is named with (in the store)."""
        return list(json.loads(self.store.get(members(generation))))

    def _assemble(self) -> bool:
        """Wait until every member of the latest generation is here; ``False``: not a member.

        A generation named while its ranks still gather (a node lost during start-up, or while
        the survivors of a loss form their group) is followed at once: the ranks never wait in
        ``init_process_group`` for a rank that is gone (that wait only ends at its timeout).
        """
        self.store.wait([members(self.generation)], timedelta(seconds=MEMBERS_TIMEOUT))
        deadline = time.monotonic() + MEMBERS_TIMEOUT
        while True:
            self.generation = latest(self.store, self.generation)
            self.members = self._named(self.generation)
            if self.me not in self.members:
                return False
            here = f"here/{self.generation}"
            self.store.set(f"{here}/{self.me}", "1")
            keys = [f"{here}/{m}" for m in self.members]
            while not self.store.check([members(self.generation + 1)]):
                if self.store.check(keys):
                    return True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {self.me}: the members of generation {self.generation} "
                        f"({self.members}) did not all arrive within {MEMBERS_TIMEOUT:.0f} s"
                    )
                time.sleep(ABORT_POLL_SECONDS)

    def _form(self) -> None:
        """Join the latest generation; the gradients become views of a new buffer."""
        import torch

        self._join_group()
        size = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(size + self.world_size + 1, dtype=self.params[0].dtype)
        self.grads = self.flat[:size]
        self.tail = self.flat[size:]
        self.views = grad_views(self.params, self.grads)

    def _join_group(self) -> None:
        """Form the latest generation's process group (``torch.distributed``'s default one)."""
        import torch.distributed as dist

        if not self._assemble():
            raise ConfigError(f"rank {self.me} is not a member of generation {self.generation}")
        # Every member must name the group alike ("0"): torch names it from a counter that a
        # destroy after a failed collective does not always reset (torch 2.13), so a survivor
        # and a joiner would wait on each other's keys under different names.
        process_groups.name_from_zero()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"g{self.generation}", self.store),  # type: ignore[attr-defined]
            rank=self.members.index(self.me),
            world_size=len(self.members),
            timeout=timedelta(seconds=self.timeout),
        )

    def _heal(self, source: int) -> None:
        """Everyone takes the state of the group's rank ``source`` (a broadcast, no disk)."""
        import torch.distributed as dist

        for tensor in self.model.state_dict().values():
            dist.broadcast(tensor, source)
        sent = [(self.optimizer.state_dict(), self.data_state, self.steps, self.requests_done)]
        dist.broadcast_object_list(sent, source)
        if self.rank != source:
            optimizer_state, self.data_state, self.steps, self.requests_done = sent[0]
            self.optimizer.load_state_dict(optimizer_state)
        self._requests_seen = self.requests_done

    def _reduce(self) -> None:
        import torch.distributed as dist

        self._wait(dist.all_reduce(self.flat, async_op=True))

    def _wait(self, work: Any) -> None:
        """Wait for ``work``, leaving it when the generation's ``abort`` key is set."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        key = abort(self.generation)
        while not done.wait(ABORT_POLL_SECONDS):  # woken at once when the work ends
            if self.store.check([key]):
                raise Aborted(f"a peer of generation {self.generation} failed")
        work.wait()

    # -- the loop --------------------------------------------------------------------------------
    def batches(self) -> Iterator[Any]:
        """This rank's batches; after a rescale, the rest of the epoch divided anew."""
        while not self.left:
            self.data = self.make_data(self.rank, self.world_size)
            if self.data_state is not None:
                self.data.load_state_dict(self.data_state)
            self._reshard = False
            for batch in self.data:
                generation = self.generation
                yield batch
                self.keeper.after_step(self, generation)  # a checkpoint every N steps
                if self._reshard or self.left:
                    break
            else:
                self.keeper.finish(self)  # its last save's failure said, not raised at the end
                self.store.set(FINISHED, "1")  # a joiner still waiting need not
                return

    def step(self) -> bool:
        """Reduce this step's gradients; step the optimizer if every rank did.

        Returns ``True`` if the step committed (after a loss, the survivors have re-formed
        either way, and the data is divided among them).
        """
        use_views(self.params, self.views)
        self._fill_tail()
        try:
            self._reduce()
        except RuntimeError:  # Aborted too
            return self._recovered()
        return self._settle()

    def _settle(self) -> bool:
        """Commit the reduced step, and return ``True``.

        A group formed at its end (ranks leave or join) may fail too: that is recovered from,
        unless the error is :attr:`FINAL`.
        """
        try:
            self._commit_step(self.tail.tolist())
        except RuntimeError as error:
            if isinstance(error, self.FINAL):
                raise
            self._recovered()
        return True

    def _recovered(self) -> bool:
        """:meth:`_recover`, again while the group it forms fails too (a loss while forming).

        Each try waits for the driver to name a newer generation, so a failure that is no loss
        ends as the last try's error.
        """
        for _ in range(RECOVERIES - 1):
            try:
                return self._recover()
            except RuntimeError as error:  # the new group lost a member while it formed or healed
                if isinstance(error, self.FINAL):
                    raise
        return self._recover()

    def _commit_step(self, flags: list[float] | None) -> None:
        self.grads.div_(self.world_size)
        self.optimizer.step()
        self.flat.zero_()
        self.steps += 1
        if self.data is not None:
            self.data_state = self.data.state_dict()
        if flags is None:  # a step committed in a recovery: its requests are the group's
            return
        leavers, joiners = self._requests(flags)
        if leavers or joiners:
            self._part(leavers, joiners)

    def _requests(self, flags: list[float]) -> tuple[list[int], list[int]]:
        """The ranks that leave and join at this step's end, from its reduced tail ``flags``."""
        world = self.world_size
        leavers = [m for m, flag in zip(self.members, flags[:world], strict=True) if flag > 0]
        joiners: list[int] = []
        for k in range(self.requests_done, int(flags[-1])):
            asked = request(self.store, k)
            leavers += [m for m in asked.get("leave", ()) if m in self.members]
            joiners += [m for m in asked.get("join", ()) if m not in self.members]
        self.requests_done = max(self.requests_done, int(flags[-1]))
        return leavers, joiners

    def _fill_tail(self) -> None:
        """The tail this rank adds to the step's reduction: its notice; rank 0's requests."""
        self.tail.zero_()
        self.tail[self.rank] = float(self.leaving)
        if self.rank == 0 and time.monotonic() >= self._next_look:
            self._requests_seen = posted(self.store, self._requests_seen)
            self._next_look = time.monotonic() + REQUEST_POLL_SECONDS
        self.tail[-1] = float(self._requests_seen if self.rank == 0 else 0)

    def _part(self, leavers: list[int], joiners: list[int]) -> None:
        """After a committed step: the leavers go, the joiners come, the group forms again."""
        import torch.distributed as dist

        dist.destroy_process_group()
        if self.me in leavers:
            self.left = True
            self.store.set(gone(self.me), str(self.steps))  # the driver records the rescale
            return
        self._next_generation([m for m in self.members if m not in leavers], joiners)
        if joiners:
            self._heal(0)
        self._reshard = True

    def _catch_up(self, top: int) -> bool:
        """Commit from its held gradients the step a peer committed (``top``): ``True`` if so."""
        if self.steps >= top:
            return False
        if not getattr(self, "reduced", False):
            raise RuntimeError(
                f"rank {self.me}: a peer committed step {top} but this rank holds no reduced "
                "gradients for it; the run cannot agree on its state in place"
            )
        self._commit_step(None)
        return True

    def _next_generation(self, kept: list[int], joiners: list[int]) -> None:
        """Name and form the generation of ``kept`` and ``joiners`` (each member names it alike)."""
        self.generation += 1
        self.store.set(members(self.generation), json.dumps(kept + joiners))
        for joiner in joiners:
            self.store.set(joined(joiner), str(self.generation))
        self._form()

    def _recover(self) -> bool:
        """Leave the failed generation, agree on the step, form the next one."""
        import torch.distributed as dist

        old = self.generation
        self.store.set(abort(old), "1")
        self.store.set(f"state/{old}/{self.me}", str(self.steps))
        if dist.is_initialized():  # not when the group failed to form
            dist.destroy_process_group()
        self.generation += 1
        mine = self.steps
        self._form()  # a new buffer: the step in flight's gradients are gone
        # every member wrote its count before it arrived in the generation it formed
        counts = {m: int(self.store.get(f"state/{old}/{m}")) for m in self.members}
        top = max(counts.values())
        if min(counts.values()) < top:  # some completed the step in flight: the others take it
            self._heal(self.members.index(max(self.members, key=counts.__getitem__)))
        self._reshard = True
        if self.steps > mine:
            return True
        self.dropped += 1
        return False
