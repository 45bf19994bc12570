"""The strategy registry: each ``prepare_model`` name bound to one strategy object.

Runs inside a rank. Modelled on Lightning Fabric's ``StrategyRegistry``: choosing a strategy is a
lookup, and an unknown name is refused with the list of choices. The registry is also the one
place where ``prepare_model``'s names meet the planner's rows (the ZeRO paper's names, which the
planner keeps): every object says which row prices it (``priced_as``) and which rows ``auto``
runs with it (``auto_runs``); :func:`auto_map` is derived from them, so that no second table
can drift from the first.

Models wrapped outside ``prepare_model`` carry no strategy object: :func:`strategy_of` gives a
DeepSpeed model or optimizer of sparktrain's the ZeRO steps, and anything else the plain
PyTorch ones (the base's), as the type checks it replaces did.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.strategies import zero
from sparktrain.strategies.auto import AutoStrategy, Runs, runs_of
from sparktrain.strategies.base import Strategy, made_by
from sparktrain.strategies.ddp import DdpStrategy
from sparktrain.strategies.fsdp import FsdpStrategy


def _registry(*strategies: Strategy) -> Mapping[str, Strategy]:
    found: dict[str, Strategy] = {}
    for strategy in strategies:
        if strategy.name in found:
            raise ValueError(f"strategy {strategy.name!r} is registered twice")
        found[strategy.name] = strategy
    return MappingProxyType(found)


#: Every strategy object by name, in the order the error lists them.
_CONCRETE: tuple[Strategy, ...] = (DdpStrategy(), FsdpStrategy(), *zero.ZERO_STRATEGIES)
REGISTRY: Mapping[str, Strategy] = _registry(*_CONCRETE, AutoStrategy(among=_CONCRETE))


def names() -> tuple[str, ...]:
    """The registered names, in order."""
    return tuple(REGISTRY)


def get(name: object) -> Strategy:
    """The strategy object registered as ``name``.

    Raises:
        ConfigError: No strategy has that name; the message lists them.
    """
    found = REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(names())}")
    return found


def strategy_of(prepared: Any) -> Strategy:
    """The object that made ``prepared`` (a model or optimizer), else the one whose steps fit it.

    ``ddp``'s steps are plain PyTorch's, which also serve FSDP and pipelines; the ZeRO objects
    differ only in their module step (the stage lives in the model's configuration).
    """
    found = made_by(prepared)
    if found is not None:
        return found
    if isinstance(prepared, (zero.ZeroModel, zero.ZeroOptimizer)):
        return REGISTRY["zero1"]
    return REGISTRY["ddp"]


def auto_map() -> Runs:
    """Each planner row, with the strategy ``auto`` runs it as and the sharding it sets.

    Raises:
        ValueError: A row no strategy runs, or one claimed twice (a registry bug).
    """
    return runs_of(REGISTRY.values())
