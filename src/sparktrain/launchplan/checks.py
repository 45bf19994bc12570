"""The checks of the run options' values, and the command line's parsers of their text.

Every check takes the option's name and its value, and returns the value as the options keep it
(a frozen set of ranks, a copy of a mapping, ``None`` for an infinite bound) or raises a
:class:`~sparktrain.ground.errors.ConfigError` that names the option, the value and what to pass.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from typing import Any

from sparktrain.ground.errors import ConfigError


def seconds_or_none(name: str, value: object) -> float | None:
    """A positive number of seconds (infinity: no bound), or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds, or None.")
    return None if math.isinf(value) else float(value)


def folder_or_none(name: str, value: object) -> str | None:
    """A folder's path or URL, or ``None``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(
            f"{name}={value!r} must be a folder path or URL (e.g. 'dbfs:/tmp/c'), or None."
        )
    return str(os.fspath(value))


def seconds(name: str, value: object) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a positive, finite number of seconds.")
    return float(value)


def restarts(name: str, value: object) -> int:
    """A whole number, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 0 (0: fail at the first failure)."
        )
    return value


def count_or_none(name: str, value: object) -> int | None:
    """A whole number, 1 or more, or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 1 (the fewest ranks the run may go "
            "on with), or None for a run that is not elastic."
        )
    return value


def flag(name: str, value: object) -> bool:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False.")
    return value


def flag_or_none(name: str, value: object) -> bool | None:
    """``True``, ``False`` or ``None``."""
    return None if value is None else flag(name, value)


def ranks(name: str, value: object) -> frozenset[int] | None:
    """A collection of ranks, as a frozen set, or ``None`` for all."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise ConfigError(
            f"{name}={value!r} must be a collection of ranks such as [0], or None for all."
        )
    bad = [r for r in value if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ConfigError(f"{name}={sorted(value, key=repr)!r} names {bad!r}, which are not ranks.")
    return frozenset(value)


def callback(name: str, value: object) -> Any:
    """A function, or ``None``."""
    if value is not None and not callable(value):
        raise ConfigError(
            f"{name}={value!r} must be a function called with (rank, record), or None."
        )
    return value


def variables(name: str, value: object) -> Mapping[str, str] | None:
    """Environment variables for the ranks (a copy), none of the torch contract's, or ``None``."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(
            f"{name}={value!r} must map variable names to string values, e.g. "
            "{'HF_HOME': '/dbfs/hf'}, or be None."
        )
    from sparktrain.contract.env import CONTRACT_VARS

    owned = sorted(set(value) & set(CONTRACT_VARS))
    if owned:
        raise ConfigError(
            f"{name} sets {', '.join(owned)}, which sparktrain sets for each rank (the torch "
            f"contract); leave {'them' if len(owned) > 1 else 'it'} out."
        )
    return dict(value)  # a copy: the caller's dict may change later


def parse_variables(text: str) -> dict[str, str]:
    """``A=1,B=x`` from the command line, as a dict."""
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"{text!r} must be comma-separated NAME=VALUE pairs, e.g. A=1,B=x")
    return {key.strip(): val for key, val in pairs}


def parse_ranks(text: str) -> list[int]:
    """``0,1`` from the command line, as a list of ranks."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{text!r} must be comma-separated ranks, e.g. 0,1") from None
