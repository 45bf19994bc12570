"""``prepare_model(..., pp=N)``: pipeline stages over ranks, one training loop on every rank.

The model, an ``nn.Sequential`` built identically on every rank, is cut into stages
(:mod:`sparktrain.strategies.split`); stage ``i`` runs on the pipeline rank ``i % pp`` (torch's
loop placement, so interleaved schedules give each rank every ``pp``-th stage). Each local stage is
split over ``tp`` and sharded over the replicas by the caller's ``prepare_part``, then wrapped in
``torch.distributed.pipelining``'s ``PipelineStage``; the schedule is built at the first step,
when the loss function is known. :class:`PipelineModel` holds the rank's layers under their own
names, so ``parameters()`` feeds the optimizer, ``state_dict()`` feeds ``sparktrain.checkpoint``
(DCP merges the stages' disjoint keys), and :func:`gather_state` rebuilds the whole model's state.

Every rank runs the same loop: ``loss = sparktrain.forward_backward(model, x, y, loss_fn)``.
The first stage reads ``x``, the last ``y``; the mean micro-batch loss comes back on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparktrain.ground.errors import ConfigError
from sparktrain.strategies.mesh import MeshShape
from sparktrain.strategies.split import MULTI_STAGE, SCHEDULES, split_children


class PipelineModel(nn.Module):
    """This rank's pipeline stages, their layers registered under the whole model's names.

    Train it with :func:`sparktrain.forward_backward`; calling it directly is refused (a stage
    alone cannot run the model).
    """

    def __init__(
        self,
        parts: list[nn.Module],
        stages: list[Any],
        *,
        schedule: str,
        microbatches: int,
        group: Any,
        last_rank: int,
    ) -> None:
        """Hold ``parts`` (prepared stage modules) and their ``PipelineStage`` objects."""
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                self.add_module(name, child)
        self._parts = parts
        self._stages = stages
        self._schedule_name = schedule
        self.microbatches = microbatches
        self._group = group
        self._last_rank = last_rank
        self._runner: Any = None
        self._loss_fn: Any = None
        self._shapes: Any = None

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it reads the inputs)."""
        return any(stage.is_first for stage in self._stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it reads the targets and computes the loss)."""
        return any(stage.is_last for stage in self._stages)

    @property
    def parts(self) -> list[nn.Module]:
        """The prepared stage modules this rank runs."""
        return list(self._parts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a pipeline runs through its schedule."""
        raise ConfigError(
            "a pipelined model (prepare_model(..., pp=N)) holds only this rank's stages and "
            "cannot be called: train with loss = sparktrain.forward_backward(model, inputs, "
            "target, loss_fn) on every rank."
        )

    def _runner_for(self, loss_fn: Callable[..., Any]) -> Any:
        from torch.distributed.pipelining.schedules import get_schedule_class

        if self._runner is not None:
            if loss_fn is not self._loss_fn:
                raise ConfigError(
                    "forward_backward got a different loss_fn than at the first step: a "
                    "pipeline's schedule is built around one loss function. Pass the same one."
                )
            return self._runner
        cls = get_schedule_class(SCHEDULES[self._schedule_name])
        single = self._schedule_name not in MULTI_STAGE  # one stage a rank
        stage: Any = self._stages[0] if single else self._stages
        self._runner = cls(stage, n_microbatches=self.microbatches, loss_fn=loss_fn)
        self._loss_fn = loss_fn
        return self._runner

    def _check_batch(self, inputs: tuple[Any, ...], target: Any) -> None:
        shapes = tuple(tuple(t.shape) for t in (*inputs, target) if isinstance(t, torch.Tensor))
        first = shapes[0][0] if shapes and shapes[0] else 0
        if first % self.microbatches:
            raise ConfigError(
                f"a batch of {first} does not split into microbatches={self.microbatches} equal "
                "micro-batches: use a batch size that is a multiple of it (equal micro-batches "
                "keep the mean loss exact)."
            )
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ConfigError(
                f"the batch shapes changed from {self._shapes} to {shapes}: a pipeline's stages "
                "fix their shapes at the first step. Use DataLoader(..., drop_last=True) and "
                "pad sequences to one length."
            )

    def step(self, inputs: Any, target: Any, loss_fn: Callable[..., Any]) -> Any:
        """Forward and backward of one batch through every micro-batch; the mean loss."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        self._check_batch(args, target)
        runner = self._runner_for(loss_fn)
        losses: list[Any] = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if self.is_last:
            kwargs.update(target=target, losses=losses)
        runner.step(*(args if self.is_first else ()), **kwargs)
        if losses:
            value = torch.stack([_local(loss).detach().float() for loss in losses]).mean()
        else:
            value = torch.zeros((), dtype=torch.float32, device=self._stages[0].device)
        dist.broadcast(value, src=self._last_rank, group=self._group)
        return value


def _local(loss: Any) -> Any:
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def build_pipeline(
    model: nn.Module,
    *,
    shape: MeshShape,
    mesh: Any,
    where: Any,
    schedule: str,
    stages_per_rank: int,
    microbatches: int,
    split_points: list[str] | None,
    prepare_part: Callable[[nn.Module], nn.Module],
) -> PipelineModel:
    """Cut ``model`` into ``pp * stages_per_rank`` stages and prepare this rank's.

    Raises:
        ConfigError: The model is not an ``nn.Sequential``, or the split is impossible.
    """
    from torch.distributed.pipelining import PipelineStage

    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pp={shape.pp} cuts an nn.Sequential into stages, and the model is a "
            f"{type(model).__name__}: build it as nn.Sequential(embedding, *blocks, head) (each "
            "child's forward taking the previous one's output), or use tp/fsdp without pp."
        )
    names = [name for name, _ in model.named_children()]
    sizes = [sum(p.numel() for p in child.parameters()) for child in model.children()]
    count = shape.pp * stages_per_rank
    groups = split_children(names, sizes, count, split_points)
    pp_rank = int(mesh.get_local_rank("pp"))
    group = mesh.get_group("pp")
    parts: list[nn.Module] = []
    stages: list[Any] = []
    for index in range(pp_rank, count, shape.pp):
        run = nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n in groups[index]))
        part = prepare_part(run)  # prepare_part puts it on the device (or keeps it offloaded)
        parts.append(part)
        stages.append(PipelineStage(part, index, count, where, group=group))
    last_rank = dist.get_global_rank(group, (count - 1) % shape.pp)
    return PipelineModel(
        parts,
        stages,
        schedule=schedule,
        microbatches=microbatches,
        group=group,
        last_rank=last_rank,
    )


def gather_state(model: PipelineModel, part_state: Callable[[nn.Module], dict[str, Any]]) -> Any:
    """The whole model's state on every rank: each stage's full state, exchanged over ``pp``.

    A collective over every rank (each stage's shards are gathered first).
    """
    state: dict[str, Any] = {}
    for part in model.parts:
        state.update(part_state(part))
    pieces: list[Any] = [None] * dist.get_world_size(model._group)
    dist.all_gather_object(pieces, state, group=model._group)
    merged: dict[str, Any] = {}
    for piece in pieces:
        merged.update(piece)
    return merged
