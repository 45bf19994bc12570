"""Elastic in place for ZeRO-1/2: every rank holds the parameters, the optimizer state is cut.

The model's trained parameters become views of one flat vector, cut into one partition a rank
(``ceil(n / world)`` elements; the last padded with zeros, which stay zero). Place ``i`` of a
generation owns partition ``i`` and holds a copy of the partition whose
:func:`~sparktrain.contract.inplace.copy_holder` it is (the same place on the previous node):
its optimizer steps both, one flat parameter each, and only the owner's result travels. A step:

1. all-reduces the flat gradient (both stages on gloo, whose reduce-scatter runs inside
   ``wait()`` and could not be left when a peer dies): each rank steps with the slices of the
   partitions it holds;
2. all-reduces a small tail (each rank's notice, rank 0's count of the driver's requests): a
   rank that completes it knows that every rank completed step 1, and commits;
3. steps the rank's partitions and all-gathers the owners' ones.

After a failure each survivor writes its committed count and whether it holds the step's
reduced gradients; if any committed, the others commit from what they hold, else the step is
dropped everywhere (as for HSDP). Then the partitions are divided anew over the survivors: each
old partition's parameters and optimizer state are broadcast from its owner if alive, else from
the rank that held its copy (both stepped it alike), and each rank keeps the slices of its new
partitions. No parameter is reloaded: the broadcast only repairs a partition whose all-gather
the failure cut. A joining rank receives every partition the same way. A loss that takes a
partition's owner and its copy leaves no live copy of that optimizer state: the driver sends
the run back to its restart path (:func:`sparktrain.contract.inplace.partitions_lost`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sparktrain.contract.inplace import (
    KIND,
    ZERO_NODE_RANKS,
    ZERO_PLANS,
    abort,
    gone,
    post,
)
from sparktrain.ground.errors import ConfigError
from sparktrain.rank.flat_grads import trained_params, use_views
from sparktrain.rank.inplace import InPlace, _on_sigterm
from sparktrain.rank.replica_heal import broadcast_object
from sparktrain.rank.zero_partitions import NoLiveCopy, Partitions, world


class ZeroInPlace(Partitions, InPlace):
    """One rank of a ZeRO-1/2 in-place run (see the module's docstring).

    Args:
        model: The module (plain: this class reduces its gradients and steps its partitions).
        make_optimizer: Makes the optimizer from a list of flat parameters (one group).
        make_data: ``make_data(rank, world_size)``: this rank's dataset at a size.
        stage: The ZeRO stage, 1 or 2 (both all-reduce the gradient on gloo; see above).
        store: The run's store, kept outside the ranks.
        me: This rank's first rank.
        node_ranks: The ranks of a node (a partition's copy goes to another node).
        timeout: The group's timeout for a collective.
        joining: This rank joins a running group.
    """

    FINAL = (NoLiveCopy,)

    def __init__(
        self,
        model: Any,
        make_optimizer: Callable[[list[Any]], Any],
        make_data: Callable[[int, int], Any],
        *,
        stage: int,
        store: Any,
        me: int,
        node_ranks: int = 1,
        timeout: float = 30.0,
        joining: bool = False,
    ) -> None:
        self.model, self.make_data, self._make = model, make_data, make_optimizer
        self.store, self.me, self.timeout = store, me, timeout
        self.stage, self.node_ranks = stage, node_ranks
        self.params = trained_params(model)
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            raise ConfigError(
                f"sparktrain.elastic.in_place(..., zero={stage}) keeps the parameters in one flat "
                f"vector; this model's are of {dtypes}. Cast the model to one dtype first."
            )
        self.size = sum(p.numel() for p in self.params)
        self.generation = self.steps = self.dropped = 0
        self.requests_done = self._requests_seen = 0
        self._next_look = 0.0
        self.members: list[int] = []
        self.plan: list[int] = []  # the members the partitions are cut for (none yet: a joiner)
        self.parts: dict[int, Any] = {}  # partition -> its flat parameter (a view of self.flat)
        self.cuts = 0  # how many times this rank cut its partitions (0: none yet, a joiner)
        # the plan and states before the last cut, until a step proves that every rank cut
        self._before: tuple[list[int], dict[int, dict[str, Any]]] | None = None
        self.optimizer: Any = None
        self.data: Any = None
        self.data_state: dict[str, Any] | None = None
        self._reshard = self.leaving = self.left = self.reduced = self._pending = False
        self._reduced: dict[int, Any] = {}
        self._works: list[Any] = []
        self._ranks = 1
        store.set(ZERO_NODE_RANKS, str(node_ranks))  # the driver checks for lost copies
        store.set(KIND, "zero")
        if joining:
            post(self.store, {"join": [me]})
            if self._let_in():
                try:
                    self._form()
                    self._welcome(0)
                except RuntimeError:  # a member lost while the group took this rank in
                    self._recovered()
            else:
                self.left = True
        else:
            self._form()
            self._start()
        _on_sigterm(self.leave)

    # -- the partitions ------------------------------------------------------------------------
    def _start(self) -> None:
        """The first generation: rank 0's weights everywhere, the partitions cut, no state."""
        import torch
        import torch.distributed as dist

        chunk = self._chunk(self.members)
        flat = torch.zeros(chunk * self.world_size, dtype=self.params[0].dtype)
        flat[: self.size] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self._wait(dist.broadcast(flat, 0, async_op=True))
        self._adopt(list(self.members), flat, {})
        self._sync_rest(0)

    def _sync_rest(self, source: int) -> None:
        """The model's buffers and frozen parameters from place ``source`` (as DDP starts)."""
        import torch.distributed as dist

        rest = [*self.model.buffers(), *(p for p in self.model.parameters() if not p.requires_grad)]
        for tensor in rest:
            self._wait(dist.broadcast(tensor.detach(), source, async_op=True))

    def _form(self) -> None:
        """Form the latest generation's group; a new tail (the partitions stay as they are)."""
        import torch

        self._join_group()
        self.tail = torch.zeros(self.world_size + 1)

    def _welcome(self, source: int) -> None:
        """Every rank takes place ``source``'s counts and partition plan; cut anew for all."""
        place = self.members.index(self.me)
        sent = (self.plan, self.cuts, self.steps, self.data_state, self.requests_done)
        plan, cuts, steps, data_state, requests_done = broadcast_object(
            self._wait, world(), sent, source, place
        )
        if not plan:
            raise NoLiveCopy(
                f"rank {self.me}: no rank of generation {self.generation} holds the optimizer "
                "partitions (every survivor was still joining); the run goes back to its checkpoint"
            )
        self.steps, self.data_state, self.requests_done = steps, data_state, requests_done
        self._requests_seen = self.requests_done
        self.cuts = cuts  # a joiner counts the cuts as the group does (a recovery compares them)
        self._redivide(plan, list(self.members))
        self._sync_rest(source)

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Reduce this step's gradients; step this rank's partitions if every rank did.

        Returns ``True`` if the step committed (after a loss, the survivors have re-formed and
        divided the partitions and the data among them either way).
        """
        import torch.distributed as dist

        use_views(self.params, self.views)
        self._fill_tail()
        self._pending = True
        try:
            self._reduce_gradients()
            self.reduced = True
            self._wait(dist.all_reduce(self.tail, async_op=True))
        except RuntimeError:  # Aborted too
            return self._recovered()
        return self._settle()

    def _reduce_gradients(self) -> None:
        """Each of this rank's partitions gets its reduced gradient (summed over the ranks).

        Both stages all-reduce on gloo: its reduce-scatter runs inside ``wait()`` (no future,
        never completed before it), so a rank could not leave it when a peer dies.
        """
        import torch.distributed as dist

        chunk = self._chunk(self.plan)
        self._ranks = self.world_size  # the sum's divisor, kept for a commit after a re-form
        self._works = [dist.all_reduce(self.gflat, async_op=True)]
        self._reduced = {k: self.gflat[k * chunk : (k + 1) * chunk] for k in self.parts}
        for work in self._works:
            self._wait(work)

    def _commit_step(self, flags: list[float] | None) -> None:
        """Step the partitions with the reduced gradients; gather; act on the requests.

        ``flags`` is ``None`` in a recovery: no gather (the partitions are divided anew next).
        """
        import torch.distributed as dist

        for k, part in self.parts.items():
            part.grad = self._reduced[k].div(self._ranks)  # a copy: a retry divides once
        self.optimizer.step()
        for part in self.parts.values():
            part.grad = None
        self.gflat.zero_()
        self.steps += 1
        if self._before is not None:  # every rank took part in this step: all cut alike
            self._before = None
            if self.me == self.plan[0]:
                self.store.set(ZERO_PLANS, json.dumps([self.plan, self.plan]))
        self.reduced = self._pending = False
        self._reduced, self._works = {}, []
        if self.data is not None:
            self.data_state = self.data.state_dict()
        if flags is None:
            return
        own, chunk = self.members.index(self.me), self._chunk(self.plan)
        mine = self.flat[own * chunk : (own + 1) * chunk].clone()
        self._wait(dist.all_gather_into_tensor(self.flat, mine, async_op=True))
        leavers, joiners = self._requests(flags)
        if leavers or joiners:
            self._part(leavers, joiners)

    def _part(self, leavers: list[int], joiners: list[int]) -> None:
        """After a committed step: the leavers hand their partitions over and go; joiners come."""
        import torch
        import torch.distributed as dist

        kept = [m for m in self.members if m not in leavers]
        if not kept:  # no rank would be left to hold the partitions: the notice is not acted on
            leavers, kept = [], list(self.members)
            if not joiners:
                return
        if leavers:  # over this generation's group, the leavers in it: nothing is lost
            self._redivide(self.plan, kept)
            # the leavers go once every rank holds its new partitions (a rank lost while they
            # are cut leaves the leavers in the recovery, which they take part in)
            self._wait(dist.all_reduce(torch.zeros(1), async_op=True))
        dist.destroy_process_group()
        if self.me in leavers:
            self.left = True
            self.store.set(gone(self.me), str(self.steps))  # the driver records the rescale
            return
        self._next_generation(kept, joiners)
        if joiners:
            self._welcome(0)
        self._reshard = True

    def _recover(self) -> bool:
        """Leave the failed generation; commit or drop its step everywhere; cut anew."""
        import torch.distributed as dist

        old = self.generation
        ended = all(work.get_future().done() for work in self._works)
        if self._pending and not self.reduced and self._works and ended:  # as we left it
            try:
                for work in self._works:
                    work.wait()
                self.reduced = True
            except RuntimeError:
                pass
        self.store.set(abort(old), "1")
        state = [self.steps, self.reduced, self.cuts]
        self.store.set(f"state/{old}/{self.me}", json.dumps(state))
        if dist.is_initialized():  # not when the group failed to form
            dist.destroy_process_group()
        self.generation += 1
        self._form()
        # every member wrote its state before it arrived in the generation it formed
        states = [json.loads(self.store.get(f"state/{old}/{m}")) for m in self.members]
        agreed = min((cuts for _, _, cuts in states if cuts), default=0)
        if self.cuts > agreed and self._before is not None:  # a peer did not finish cutting
            self._roll_back()
        top = max((steps for steps, _, cuts in states if cuts), default=self.steps)
        committed = bool(self.plan) and self._catch_up(top)
        if not committed and self._pending:  # dropped everywhere: its gradients too
            self.dropped += 1
            self.reduced = self._pending = False
            self._reduced, self._works = {}, []
            self.gflat.zero_()
        self._welcome(next((i for i, (_, _, cuts) in enumerate(states) if cuts), 0))
        self._reshard = True
        return committed
