"""Search spaces: what each hyperparameter may be, as Optuna distributions (pure, no I/O).

A search space is a dict from a name to one of:

- :func:`uniform`, :func:`loguniform`, :func:`randint`, :func:`choice` (these helpers);
- an Optuna distribution (``optuna.distributions.FloatDistribution`` etc.), used as it is;
- a list or tuple of values: a choice among them;
- any other value: a constant, passed to every trial unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError


@dataclass(frozen=True)
class Dimension:
    """One hyperparameter's range before Optuna is imported."""

    kind: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()


def uniform(low: float, high: float) -> Dimension:
    """A float drawn evenly between ``low`` and ``high``."""
    return _bounded("uniform", low, high)


def loguniform(low: float, high: float) -> Dimension:
    """A positive float whose logarithm is drawn evenly (learning rates, weight decay)."""
    if not (isinstance(low, (int, float)) and low > 0):
        raise ConfigError(
            f"loguniform(low={low!r}, ...) needs low > 0; use uniform() for ranges from 0"
        )
    return _bounded("loguniform", low, high)


def randint(low: int, high: int) -> Dimension:
    """An integer from ``low`` to ``high``, both included."""
    if not (isinstance(low, int) and isinstance(high, int)):
        raise ConfigError(f"randint({low!r}, {high!r}) needs two integers")
    return _bounded("int", low, high)


def choice(options: Sequence[Any]) -> Dimension:
    """One of ``options`` (numbers, strings, booleans or ``None``)."""
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
        raise ConfigError(f"choice({options!r}) needs a non-empty list of values")
    return Dimension("choice", choices=tuple(options))


def _bounded(kind: str, low: float, high: float) -> Dimension:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        raise ConfigError(f"{kind}({low!r}, {high!r}) needs two numbers")
    if not low < high:
        raise ConfigError(f"{kind}({low!r}, {high!r}) needs low < high")
    return Dimension(kind, float(low) if kind != "int" else low, high)


def optuna_module() -> Any:
    """Optuna, quiet (sparktrain prints one line a trial), or the install hint."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("sparktrain.tune needs Optuna: pip install 'sparktrain[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def to_optuna(space: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``space`` into Optuna distributions (searched) and constants (passed as they are)."""
    od = optuna_module().distributions

    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            f"search_space={space!r} must be a non-empty dict such as "
            "{'lr': sparktrain.tuning.loguniform(1e-4, 1e-1), 'hidden': [64, 128]}"
        )
    searched: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    for name, value in space.items():
        if not isinstance(name, str):
            raise ConfigError(f"search_space key {name!r} must be a string")
        if isinstance(value, od.BaseDistribution):
            searched[name] = value
        elif isinstance(value, Dimension):
            searched[name] = _distribution(od, value)
        elif isinstance(value, (list, tuple)):
            searched[name] = _distribution(od, choice(value))
        else:
            constants[name] = value
    if not searched:
        raise ConfigError(
            "search_space has only constants; give at least one range, e.g. "
            "'lr': sparktrain.tuning.loguniform(1e-4, 1e-1)"
        )
    return searched, constants


def _distribution(od: Any, dim: Dimension) -> Any:
    if dim.kind == "choice":
        return od.CategoricalDistribution(dim.choices)
    if dim.kind == "int":
        return od.IntDistribution(int(dim.low), int(dim.high))
    return od.FloatDistribution(dim.low, dim.high, log=dim.kind == "loguniform")
