"""Parse and print sizes: parameter counts (``"13B"``) and bytes (``"80GB"``, ``"512GiB"``).

Design choices:
- ``GB`` is 10^9 bytes, as in the ZeRO paper's figures (7.5B parameters x 16 bytes = 120 GB);
  ``GiB`` is 2^30. A GPU sold as "80 GB" has about 80 GiB (85.9e9 bytes), so reading "80GB" as
  80e9 bytes errs on the safe side by about 7 %.
- A bare number of bytes below 1 MB is refused: ``gpu_memory=80`` almost certainly meant
  ``"80GB"``, and the error says so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from sparktrain.ground.errors import ConfigError

_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_BYTE_SUFFIXES = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SMALLEST_MEMORY = 10**6


def _scaled(
    value: object, *, name: str, suffixes: Mapping[str, float], what: str, spelled: str, typed: str
) -> float:
    """A number, or text like ``"13B"``/``"80GB"`` scaled by its suffix (NaN for booleans)."""
    if isinstance(value, bool):
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _NUMBER.match(value)
        suffix = match.group(2).upper() if match else ""
        if match is None or suffix not in suffixes:
            raise ConfigError(f"{name}={value!r} is not {what}; {spelled}.")
        return float(match.group(1)) * suffixes[suffix]
    raise ConfigError(f"{name}={value!r} ({type(value).__name__}) is not {what}; {typed}.")


def parse_count(value: object, *, name: str = "params") -> int:
    """Read a parameter count: an int, a float, or text such as ``"13B"``, ``"350M"``, ``"1.3b"``.

    Args:
        value: The count; suffixes K, M, B (billion) and T, case-insensitive.
        name: The argument's name, for the error message.

    Raises:
        ConfigError: Not a positive count; the message shows accepted spellings.
    """
    number = _scaled(
        value,
        name=name,
        suffixes=_COUNT_SUFFIXES,
        what="a parameter count",
        spelled="write it like '13B', '350M', '1.3B' or 13000000000",
        typed="pass an int or text like '13B'",
    )
    if not (math.isfinite(number) and number >= 1):
        raise ConfigError(f"{name}={value!r} must be a positive parameter count such as '13B'.")
    return round(number)


def parse_bytes(value: object, *, name: str) -> int:
    """Read a memory size: bytes as an int, or text such as ``"80GB"``, ``"512 GiB"``, ``"1.5TB"``.

    Args:
        value: The size; GB = 10^9 bytes, GiB = 2^30 bytes.
        name: The argument's name, for the error message.

    Raises:
        ConfigError: Not a size, or implausibly small (below 1 MB: a unit was probably left out).
    """
    number = _scaled(
        value,
        name=name,
        suffixes=_BYTE_SUFFIXES,
        what="a memory size",
        spelled="write it like '80GB' (10^9 bytes), '80GiB' (2^30 bytes) or a number of bytes",
        typed="pass text like '80GB' or a number of bytes",
    )
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive memory size such as '80GB'.")
    if number < _SMALLEST_MEMORY:
        raise ConfigError(
            f"{name}={value!r} is {number:g} bytes, too small for a device; a number means bytes, "
            f"so write the unit, e.g. '{value}GB'."
        )
    return round(number)


def format_bytes(value: float) -> str:
    """Print bytes in decimal units, 3 significant figures: ``52.0 GB``, ``1.12 TB``, ``840 MB``."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(value) >= size:
            return f"{_three_figures(value / size)} {unit}"
    return f"{value:.0f} B"


def format_count(value: float) -> str:
    """Print a parameter count: ``13.0B``, ``350M``, ``1.05M``, ``512``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(value) >= size:
            return f"{_three_figures(value / size)}{unit}"
    return f"{value:.0f}"


def _three_figures(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"
