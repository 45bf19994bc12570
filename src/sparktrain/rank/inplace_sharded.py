"""Elastic in place for a sharded model (HSDP): replica groups of shards; a loss drops a group.

The model is sharded with ``fully_shard`` inside this rank's replica group (its default process
group, made by :func:`sparktrain.rank.replicas.mesh`), so the forward's all-gathers and the
backward's reduce-scatter stay inside the group. Across groups each generation ``g`` has two
groups of its own, over ``PrefixStore("g<g>/...", store)``: ``shard<k>``, the ranks that hold
shard ``k`` (one per replica group), and ``world``, every rank. A step is the all-reduce of the
local gradient shards over ``shard<k>``, then the all-reduce of a small tail over ``world`` (each
rank's notice, and rank 0's count of the driver's requests). Both are waited on with the
generation's ``abort`` key in view.

A rank that completes the tail's all-reduce knows that every rank entered it, hence that every
rank completed its gradients' all-reduce: it commits. After a failure each survivor writes its
committed step count and whether it holds the step's reduced gradients; if any committed, the
others commit the same step from the gradients they hold; else the step is dropped everywhere.
The survivors keep their shards and their groups: only the cross-group groups form again. A
returning group is healed over ``shard<k>`` from the first replica group (each parameter's and
buffer's local shard, then the optimizer's state), with no checkpoint read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sparktrain.contract.inplace import (
    abort,
    gone,
    keep_whole,
    post,
    replica_groups,
    whole_groups,
)
from sparktrain.ground.errors import ConfigError
from sparktrain.rank.inplace import InPlace, _on_sigterm
from sparktrain.rank.replica_heal import (
    broadcast_object,
    load_optimizer_state,
    optimizer_state,
    root_options,
)
from sparktrain.rank.replicas import Dropped, Layout


def _sharded_params(model: Any, layout: Layout) -> list[Any]:
    """The model's trained parameters: DTensors over the group's mesh, or a clear error."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    wrong = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and (not isinstance(p, DTensor) or p.device_mesh != layout.mesh)
    ]
    if wrong or not params:
        raise ConfigError(
            f"sparktrain.elastic.in_place(..., mesh=...): parameter(s) {wrong[:3]} are not sharded "
            "over that mesh. Shard the model with torch.distributed.fsdp.fully_shard(module, "
            "mesh=mesh) (each block, then the whole model) before making its optimizer."
        )
    devices = sorted({str(p.device) for p in params})
    if devices != ["cpu"]:
        raise ConfigError(
            f"sparktrain.elastic.in_place trains a model on the CPU over gloo today; this one has "
            f"parameters on {devices}. Keep the model on the CPU, or leave in_place out."
        )
    return params


class ShardedInPlace(InPlace):
    """One rank of a sharded in-place run (see the module's docstring).

    Args:
        model: The model, sharded with ``fully_shard`` over ``layout.mesh``.
        optimizer: Its optimizer (``step()`` steps it and sets the gradients to ``None``).
        make_data: ``make_data(rank, world_size)``: this rank's dataset at a size (every rank
            reads its own batches, as in any data-parallel run).
        layout: This rank's replica group (:func:`sparktrain.rank.replicas.mesh`).
        timeout: The cross-group collectives' timeout.
    """

    FINAL = (Dropped,)  # a recovery that finds this rank's group broken sends it to join again

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        make_data: Callable[[int, int], Any],
        *,
        layout: Layout,
        timeout: float = 30.0,
    ) -> None:
        self.model, self.optimizer, self.make_data = model, optimizer, make_data
        self.store, self.me, self.timeout, self.layout = layout.store, layout.me, timeout, layout
        self.params = _sharded_params(model, layout)
        self.generation = layout.since
        self.members: list[int] = []
        self.steps = self.dropped = self.requests_done = self._requests_seen = 0
        self._next_look = 0.0
        self.data: Any = None
        self.data_state: dict[str, Any] | None = None
        self._reshard = self.leaving = self.left = self.reduced = False
        self._groups: list[Any] = []  # this generation's (world, shard<k>) groups
        self._spent: list[Any] = []  # failed generations' groups, kept (a peer may be dead)
        self._rep_work: Any = None
        layout.run = self
        if layout.finished:
            self.left = True
        elif layout.joining:
            if layout.index == 0:  # the group asks in once, as a whole
                post(self.store, {"join": layout.group})
            if self._let_in(after=layout.since):
                self._form()
                self._heal_shards(full=True)
            else:
                self.left = True
        else:
            self._form()
            self._heal_shards(full=False)  # every group starts from the first group's weights
        _on_sigterm(self.leave)

    # -- the groups across replicas --------------------------------------------------------------
    def _named(self, generation: int) -> list[int]:
        """The generation's members in whole replica groups (a short rest joins later)."""
        return whole_groups(super()._named(generation), self.layout.size)

    def _form(self) -> None:
        """Form this generation's ``world`` and ``shard<k>`` groups; a new gradient buffer."""
        import torch
        import torch.distributed as dist

        if not self._assemble():
            raise Dropped(f"rank {self.me} is not a member of generation {self.generation}")
        place, size = self.members.index(self.me), self.layout.size
        if place % size != self.layout.index:
            raise ConfigError(
                f"rank {self.me} holds shard {self.layout.index} of its replica group but is "
                f"place {place % size} of generation {self.generation}'s group"
            )
        self.replicas = len(replica_groups(self.members, size))
        wait = timedelta(seconds=self.timeout)
        prefix = f"g{self.generation}"
        Gloo, Prefix = dist.ProcessGroupGloo, dist.PrefixStore  # type: ignore[attr-defined]
        world = Gloo(Prefix(f"{prefix}/world", self.store), place, len(self.members), wait)
        index = self.layout.index
        here = Prefix(f"{prefix}/shard{index}", self.store)
        shard = Gloo(here, place // size, self.replicas, wait)
        self._groups = [world, shard]
        self.locals = [p.to_local().detach() for p in self.params]  # views of the shards
        self.grads = torch.zeros(sum(t.numel() for t in self.locals), dtype=self.locals[0].dtype)
        self.tail = torch.zeros(len(self.members) + 1)
        self._rep_work = None

    def close(self) -> None:
        """Let this generation's cross-group groups go (the rank leaves the run's group)."""
        self._spent += self._groups
        self._groups = []

    def _heal_shards(self, *, full: bool) -> None:
        """Every group takes the first group's shards (``full``: its optimizer and counts too)."""
        world, shard = self._groups
        mine = self.members.index(self.me) // self.layout.size
        if self.replicas > 1:
            for tensor in [*self.locals, *self.model.buffers()]:
                self._wait(shard.broadcast([tensor.detach()], root_options(0)))
            if full:
                state = broadcast_object(
                    self._wait, shard, optimizer_state(self.optimizer), 0, mine
                )
                if mine != 0:
                    load_optimizer_state(self.optimizer, state)
        if full:
            place = self.members.index(self.me)
            counts = (self.steps, self.data_state, self.requests_done)
            counts = broadcast_object(self._wait, world, counts, 0, place)
            self.steps, self.data_state, self.requests_done = counts
            self._requests_seen = self.requests_done

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Reduce this step's gradient shards across replicas; step if every rank did.

        Returns ``True`` if the step committed. Raises :class:`Dropped` when this rank's replica
        group lost a member (the training function then runs again, as a joiner).
        """
        offset = 0
        for p, local in zip(self.params, self.locals, strict=True):
            segment = self.grads[offset : offset + local.numel()]
            offset += local.numel()
            if p.grad is None:
                segment.zero_()
            else:
                segment.copy_(p.grad.to_local().reshape(-1))
        self._fill_tail()
        world, shard = self._groups
        try:
            if self.replicas > 1:
                self._rep_work = shard.allreduce([self.grads])
                self._wait(self._rep_work)
            self.reduced = True
            self._wait(world.allreduce([self.tail]))
        except RuntimeError:  # Aborted too
            return self._recovered()
        return self._settle()

    def _commit_step(self, flags: list[float] | None) -> None:
        """Step with the reduced gradients; then act on the tail's requests (``None``: none)."""
        from torch.distributed.tensor import DTensor

        self.grads.div_(self.replicas)
        offset = 0
        for p, local in zip(self.params, self.locals, strict=True):
            reduced = self.grads[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            if p.grad is None:
                p.grad = DTensor.from_local(
                    reduced.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                    run_check=False,
                )  # fmt: skip
            else:
                p.grad.to_local().copy_(reduced)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.reduced, self._rep_work = False, None  # a recovery must not take them for the next
        if self.data is not None:
            self.data_state = self.data.state_dict()
        if flags is not None:
            leavers, joiners = self._requests(flags)
            if leavers or joiners:
                self._part(leavers, joiners)

    def _part(self, leavers: list[int], joiners: list[int]) -> None:
        """After a committed step: groups with a leaver go, joining groups come."""
        kept, dropped = keep_whole(self.members, set(leavers), self.layout.size)
        if not kept:  # no whole group would be left: the notice is not acted on in place
            leavers, dropped, kept = [], [], list(self.members)
        if not leavers and not joiners:
            return
        self.close()
        if self.me in leavers:
            self.left = True
            self.store.set(gone(self.me), str(self.steps))  # the driver records the rescale
            return
        if self.me in dropped:
            raise Dropped(f"rank(s) {sorted(set(leavers))} of its replica group left on notice")
        self._next_generation(kept, joiners)
        if joiners:
            self._heal_shards(full=True)
        self._reshard = True

    def _recover(self) -> bool:
        """Leave the failed generation; commit or drop its step everywhere; form the next."""
        old = self.generation
        if not self.reduced and self._rep_work is not None:  # it may have ended as we left it
            future = self._rep_work.get_future()
            if future.done():
                try:
                    future.wait()
                    self.reduced = True
                except RuntimeError:
                    pass
        self.store.set(abort(old), "1")
        self.store.set(f"state/{old}/{self.me}", json.dumps([self.steps, self.reduced]))
        self.close()
        self.generation += 1
        if not self._assemble():
            raise Dropped(f"a peer of rank {self.me}'s replica group was lost")
        # every member wrote its state before it arrived in the generation it forms
        top = max(json.loads(self.store.get(f"state/{old}/{m}"))[0] for m in self.members)
        committed = self._catch_up(top)  # a peer committed: every rank reduced the step
        if not committed:  # dropped everywhere: its gradients too (a backward adds to them)
            self.reduced = False
            self.optimizer.zero_grad(set_to_none=True)
            self.dropped += 1
        self._form()
        world, _ = self._groups
        place = self.members.index(self.me)
        counts = broadcast_object(
            self._wait, world, (self.data_state, self.requests_done), 0, place
        )
        self.data_state, self.requests_done = counts
        self._requests_seen = self.requests_done
        self._reshard = True
        return committed
