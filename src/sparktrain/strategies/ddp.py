"""``strategy="ddp"``: a whole copy of the model per rank, gradients all-reduced.

Runs inside a rank. The module comes back as ``DistributedDataParallel``, which
:func:`~sparktrain.strategies.plain_module` unwraps, so DDP needs no weightless skeleton unless
the model is split over ``tp`` ranks (then the base's layout step runs instead). Every other step
is the base's plain PyTorch one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sparktrain.planner.strategies import Strategy as PlannerRow
from sparktrain.strategies.base import Strategy
from sparktrain.strategies.options import PrepareOptions


class DdpStrategy(Strategy):
    """``DistributedDataParallel``; priced as the planner's ``ddp``, and what ``auto`` runs."""

    name = "ddp"
    auto_runs: ClassVar[dict[PlannerRow, dict[str, bool]]] = {"ddp": {}}

    def priced_as(self, options: PrepareOptions) -> PlannerRow:
        """The planner's ``ddp``: every rank holds every state."""
        return "ddp"

    def prepare_module(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """``DistributedDataParallel`` over ``model`` moved to ``where``."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [where] if where.type == "cuda" else None
        return DistributedDataParallel(model.to(where), device_ids=ids)
