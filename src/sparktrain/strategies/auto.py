"""``strategy="auto"``: ask :func:`sparktrain.plan` for this model on these GPUs and follow it.

Runs inside a rank. ``auto`` is a strategy object like the others, but its one real step is
resolve: it picks another registered strategy and its options, and ``prepare_model`` runs that
one (the prepared model records the strategy that made it, not ``auto``). Without the run's
shape the planner weighs model states only and picks a data-parallel row; the registry says
which strategy runs each row (:func:`runs_of` over the registry's strategies: PyTorch's own
wrappers, so that ``auto`` needs no DeepSpeed). With ``plan_shape`` (``seq_len``,
``micro_batch``, ...) it weighs activations too and may recommend a tensor x pipeline mesh,
which runs as ``fsdp`` with ``tp``/``pp``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from sparktrain.contract.env import contract_int
from sparktrain.ground.errors import ConfigError
from sparktrain.planner.strategies import STRATEGIES as PLANNER_ROWS
from sparktrain.planner.strategies import Strategy as PlannerRow
from sparktrain.strategies.base import Strategy, device, world
from sparktrain.strategies.options import PrepareOptions

log = logging.getLogger("sparktrain.strategies")


Runs = dict[PlannerRow, tuple[Strategy, Mapping[str, bool]]]


def runs_of(strategies: Iterable[Strategy]) -> Runs:
    """Each planner row, with the strategy among ``strategies`` that ``auto`` runs it as.

    Raises:
        ValueError: A row no strategy runs, or one claimed twice (a registry bug).
    """
    runs: Runs = {}
    for strategy in strategies:
        for row, sharding in strategy.auto_runs.items():
            if row in runs:
                raise ValueError(f"planner row {row!r} is run by two strategies")
            runs[row] = (strategy, sharding)
    missing = [row for row in PLANNER_ROWS if row not in runs]
    if missing:
        raise ValueError(f"no strategy runs the planner's {', '.join(missing)}")
    return runs


def choose(model: Any, options: PrepareOptions, runs: Runs) -> tuple[str, dict[str, Any]]:
    """The strategy name and the options it runs with (``tp``/``pp`` for a mesh)."""
    from sparktrain.planner import plan

    dist = world()
    where = device()
    budget, gpu_memory = options.budget, options.budget.gpu_memory
    if gpu_memory is None:
        if where.type != "cuda":
            log.info("strategy='auto' on CPU ranks: ddp (no GPU memory to fit)")
            return "ddp", {}
        import torch

        gpu_memory = torch.cuda.get_device_properties(where).total_memory
    local = contract_int("LOCAL_WORLD_SIZE", 1)
    precision = options.precision
    chosen = plan(
        model,
        gpus_per_node=local,
        nodes=max(1, dist.get_world_size() // local),
        gpu_memory=gpu_memory,
        cpu_memory=budget.cpu_memory,
        precision="fp32" if precision is None else f"{precision}-mixed",  # type: ignore[arg-type]
        **(budget.plan_shape or {}),
    )
    mesh = _auto_mesh(chosen, model)
    if mesh is not None:
        name, settings = "fsdp", {"tp": mesh.tp, "pp": mesh.pp}
        said, reasons = mesh.name, chosen.mesh_reasons
    elif chosen.recommended is None:
        raise ConfigError(
            "strategy='auto': no strategy fits this model on these GPUs:\n" + str(chosen)
        )
    else:
        runner, sharding = runs[chosen.recommended]
        name, settings = runner.name, dict(sharding)
        said, reasons = chosen.recommended, chosen.reasons
    if dist.get_rank() == 0:
        print(f"sparktrain: strategy='auto' chose {said} (runs as {name} {settings})")
        for reason in reasons:
            print(f"  - {reason}")
    return name, settings


def _auto_mesh(chosen: Any, model: Any) -> Any:
    """The mesh ``auto`` runs, or ``None`` for a data-parallel strategy.

    The planner's mesh when it splits the model; pipelines need an ``nn.Sequential``, so for
    other models the first mesh without stages that fits.
    """
    from torch import nn

    pick = chosen.recommended_mesh
    if pick is not None and pick.pp > 1 and not isinstance(model, nn.Sequential):
        pick = next((m for m in chosen.meshes if m.pp == 1 and m.fits_with_headroom), None)
    if pick is None or (pick.tp, pick.pp) == (1, 1):
        return None
    return pick


class AutoStrategy(Strategy):
    """Resolves to the registered strategy the planner's recommendation runs as."""

    name = "auto"

    def __init__(self, among: Iterable[Strategy]) -> None:
        """Choose among ``among``: the registry's other strategies (it makes this one)."""
        self.among = {strategy.name: strategy for strategy in among}

    def priced_as(self, options: PrepareOptions) -> PlannerRow | None:
        """``None``: the row is the planner's recommendation, known once resolved."""
        return None

    def resolve(self, model: Any, options: PrepareOptions) -> tuple[Strategy, PrepareOptions]:
        """The chosen strategy, with the sharding and layout ``auto`` chose over the user's."""
        name, settings = choose(model, options, runs_of(self.among.values()))
        layout = options.parallel
        parallel = replace(
            layout, tp=settings.pop("tp", layout.tp), pp=settings.pop("pp", layout.pp)
        )
        sharding = replace(options.sharding, **settings)
        return self.among[name], replace(options, sharding=sharding, parallel=parallel)

    def prepare(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """Resolve, then the chosen strategy's module step."""
        chosen, resolved = self.resolve(model, options)
        return chosen.prepare(model, resolved, where)

    def prepare_module(self, model: Any, options: PrepareOptions, where: Any) -> Any:
        """As :meth:`prepare`: ``auto`` has no module of its own."""
        return self.prepare(model, options, where)
