"""The optimizer partitions of a ZeRO in-place run: how they are cut, held and cut anew.

A plan is the list of members the partitions are cut for: place ``i`` owns partition ``i`` (a
slice of ``ceil(n / len(plan))`` elements of the flat parameter vector) and holds a copy of the
partition whose :func:`~sparktrain.contract.inplace.copy_holder` it is. Cutting anew for another
plan (:meth:`Partitions._redivide`) broadcasts each old partition from a live holder over the
current group, its parameters and then its optimizer state, and each rank keeps the slices of
its new partitions. A rank keeps the plan before its last cut until a step proves that every
rank finished cutting (:meth:`Partitions._roll_back` goes back to it otherwise).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sparktrain.contract.inplace import ZERO_PLANS, copy_holder
from sparktrain.ground.errors import ConfigError
from sparktrain.rank.flat_grads import grad_views
from sparktrain.rank.replica_heal import broadcast_object


class NoLiveCopy(RuntimeError):
    """An optimizer partition lost its owner and its copy: only a checkpoint holds it."""


def held(plan: list[int], me: int, node_ranks: int) -> list[int]:
    """The partitions ``me`` steps in ``plan``: its own, and the one whose copy it holds."""
    if me not in plan:
        return []
    world, own = len(plan), plan.index(me)
    copied = [k for k in range(world) if copy_holder(k, world, node_ranks) == own]
    return sorted({own, *copied})


class Partitions:
    """What a ZeRO in-place rank holds of the optimizer (a mixin of its loop)."""

    store: Any
    me: int
    members: list[int]
    params: list[Any]
    size: int
    stage: int
    node_ranks: int
    plan: list[int]
    parts: dict[int, Any]
    cuts: int
    optimizer: Any
    flat: Any
    _make: Callable[[list[Any]], Any]
    _before: tuple[list[int], dict[int, dict[str, Any]]] | None
    _wait: Callable[[Any], None]

    def _chunk(self, plan: list[int]) -> int:
        return int(-(-self.size // len(plan)))

    def _adopt(self, plan: list[int], flat: Any, states: dict[int, dict[str, Any]]) -> None:
        """Make ``flat`` (cut for ``plan``) the parameters, and ``states`` the optimizer's."""
        import torch

        chunk = self._chunk(plan)
        offset = 0
        for p in self.params:  # the model's parameters become views of the flat vector
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._before = (self.plan, self._states())  # until a step proves every rank cut
        self.flat, self.plan, self.cuts = flat, plan, self.cuts + 1
        self.gflat = torch.zeros_like(flat)
        self.views = grad_views(self.params, self.gflat)
        self.parts = {
            k: torch.nn.Parameter(flat[k * chunk : (k + 1) * chunk])
            for k in held(plan, self.me, self.node_ranks)
        }
        if self.optimizer is None:
            self.optimizer = self._make(list(self.parts.values()))
        else:  # the same object (a scheduler holds it): its parameters and state swapped
            self.optimizer.param_groups[0]["params"] = list(self.parts.values())
            self.optimizer.state = defaultdict(dict)
        for k, state in states.items():
            if state:
                self.optimizer.state[self.parts[k]] = state
        if plan and self.me == plan[0]:  # the driver checks a loss against the plans held
            before = self._before[0] if self._before else plan
            self.store.set(ZERO_PLANS, json.dumps([before, plan]))

    def _states(self) -> dict[int, dict[str, Any]]:
        """The optimizer state of each partition this rank holds now (by partition)."""
        if self.optimizer is None:
            return {}
        return {k: dict(self.optimizer.state.get(part, {})) for k, part in self.parts.items()}

    def _roll_back(self) -> None:
        """Go back to the plan before the last cut (a peer did not finish cutting anew)."""
        import torch

        assert self._before is not None
        plan, states = self._before
        if not plan:  # a joiner: nothing held before
            self.plan, self.parts, self.cuts, self._before = [], {}, 0, None
            return
        chunk = self._chunk(plan)
        flat = torch.zeros(chunk * len(plan), dtype=self.params[0].dtype)
        flat[: self.size] = self.flat[: self.size]
        self._adopt(plan, flat, states)
        self.cuts -= 2  # the count of the plan rolled back to
        self._before = None

    def _redivide(self, old: list[int], new: list[int]) -> None:
        """Cut the partitions of ``old`` anew for ``new``, over this generation's group.

        Each old partition comes from a live holder (its owner, else its copy's): its
        parameters, then its optimizer state; each rank keeps the slices of its new partitions.
        """
        import torch

        chunk, size, place = self._chunk(new), self.size, self.members.index(self.me)
        flat = torch.zeros(chunk * len(new), dtype=self.params[0].dtype)
        if self.plan:  # a joiner holds no flat vector yet: its own weights, overwritten here
            flat[:size] = self.flat[:size]
        mine = {k: (k * chunk, (k + 1) * chunk) for k in held(new, self.me, self.node_ranks)}
        states: dict[int, dict[str, Any]] = {k: {} for k in mine}
        before, kinds = self._chunk(old), {}
        for k in range(len(old)):
            lo, hi = k * before, min((k + 1) * before, size)
            if lo >= size:
                continue  # a partition of padding only
            source = self._source(old, k)
            meta = broadcast_object(
                self._wait, world(), self._meta(k) if source == place else None, source, place
            )
            self._broadcast(flat[lo:hi], source)
            for key, kind in meta.items():
                if not (isinstance(kind, tuple) and kind[:1] == ("flat",)):
                    for state in states.values():  # a value each partition keeps (Adam's step)
                        state[key] = kind.clone() if isinstance(kind, torch.Tensor) else kind
                    continue
                kinds[key] = kind[1]
                buffer = (
                    self.optimizer.state[self.parts[k]][key][: hi - lo]
                    if source == place
                    else torch.empty(hi - lo, dtype=kind[1])
                )
                self._broadcast(buffer, source)
                for j, (jlo, jhi) in mine.items():
                    a, b = max(lo, jlo), min(hi, jhi)
                    if a < b:
                        state = states[j].setdefault(key, torch.zeros(chunk, dtype=kind[1]))
                        state[a - jlo : b - jlo] = buffer[a - lo : b - lo]
        for state in states.values():  # a partition of padding only holds zeros
            for key, dtype in kinds.items():
                if state:
                    state.setdefault(key, torch.zeros(chunk, dtype=dtype))
        self._adopt(new, flat, states)

    def _source(self, old: list[int], k: int) -> int:
        """The place of this generation that holds old partition ``k``."""
        holders = [old[k], old[copy_holder(k, len(old), self.node_ranks)]]
        for holder in holders:
            if holder in self.members:
                return self.members.index(holder)
        raise NoLiveCopy(
            f"optimizer partition {k} of {len(old)} has no live copy: rank(s) "
            f"{sorted(set(holders))} held it and are gone; the run goes back to its checkpoint"
        )

    def _meta(self, k: int) -> dict[str, Any]:
        """What partition ``k``'s optimizer state holds: flat tensors' dtypes, other values."""
        import torch

        part = self.parts[k]
        meta: dict[str, Any] = {}
        for key, value in self.optimizer.state.get(part, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == part.shape:
                meta[key] = ("flat", value.dtype)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ConfigError(
                    f"sparktrain.elastic.in_place(..., zero={self.stage}): the optimizer's state "
                    f"{key!r} has shape {tuple(value.shape)}, neither the parameter's nor a "
                    "scalar, so it cannot be cut with the partitions. Use an elementwise "
                    "optimizer (SGD, Adam, AdamW, ...), or leave zero= out."
                )
            else:
                meta[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return meta

    def _broadcast(self, tensor: Any, source: int) -> None:
        import torch.distributed as dist

        self._wait(dist.broadcast(tensor, source, async_op=True))


def world() -> Any:
    """The default process group (its backend's own ``broadcast``)."""
    import torch.distributed as dist

    return dist.group.WORLD
