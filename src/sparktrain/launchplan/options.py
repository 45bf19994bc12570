"""``RunOptions``: a run's policy (time limits, restarts, what is shown, tracking), as one value.

The layout of a run (how many ranks, where, on which devices) is planned from the cluster; its
policy is the user's choice and the same for every front door. ``launch``, ``TorchDistributor``,
``DeepspeedTorchDistributor``, ``HorovodRunner``, ``MirroredStrategyRunner``, ``tune`` and
``sparktrain run`` all take these options by the same names, through :func:`run_options`, which
checks each value once and names an unknown option with the closest known one. Each field
documents itself (``help``), and the command line builds its flags from the same fields, so a new
option is one field here plus the code that uses it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import textwrap
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

from sparktrain.ground.errors import ConfigError

OnReport = Callable[[int, dict[str, Any]], "bool | None"]

#: Seconds a rank that has returned (or raised) gets to exit before it is killed.
DEFAULT_EXIT_GRACE = 10.0
#: Seconds a node may be silent on the driver's channel (and the driver on the node's).
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


def _seconds_or_none(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds, or None.")
    return None if math.isinf(value) else float(value)


def _folder_or_none(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(
            f"{name}={value!r} must be a folder path or URL (e.g. 'dbfs:/tmp/c'), or None."
        )
    return str(os.fspath(value))


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a positive, finite number of seconds.")
    return float(value)


def _restarts(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 0 (0: fail at the first failure)."
        )
    return value


def _count_or_none(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name}={value!r} must be a whole number >= 1 (the fewest ranks the run may go "
            "on with), or None for a run that is not elastic."
        )
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False.")
    return value


def _flag_or_none(name: str, value: object) -> bool | None:
    return None if value is None else _flag(name, value)


def _ranks(name: str, value: object) -> frozenset[int] | None:
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


def _callback(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise ConfigError(
            f"{name}={value!r} must be a function called with (rank, record), or None."
        )
    return value


def _variables(name: str, value: object) -> Mapping[str, str] | None:
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


def _parse_variables(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"{text!r} must be comma-separated NAME=VALUE pairs, e.g. A=1,B=x")
    return {key.strip(): val for key, val in pairs}


def _parse_ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{text!r} must be comma-separated ranks, e.g. 0,1") from None


def _option(default: Any, check: Callable[[str, Any], Any], help: str, *, cli: Any = float) -> Any:
    """A field of :class:`RunOptions`: its default, its check, its help, its command-line type.

    ``cli``: how the command line parses the flag's text (``float``, ``int``, ``bool`` for a
    ``--name/--no-name`` pair, a function), or ``None`` when the option cannot be given there.
    """
    return field(default=default, metadata={"check": check, "help": help, "cli": cli})


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run behaves, whatever its layout; every front door takes these by name."""

    timeout: float | None = _option(
        None,
        _seconds_or_none,
        "stop every rank after this many seconds and raise TrainingTimeoutError (None: no limit)",
    )
    hang_timeout: float | None = _option(
        None,
        _seconds_or_none,
        "seconds without a line or a sparktrain.report() from any rank "
        "after which the run is declared hung and where each rank waits is reported (None: off)",
    )
    max_restarts: int = _option(
        0,
        _restarts,
        "after a failure, stop every rank and start the whole group again, up to "
        "this many times (timeouts are not restarted)",
        cli=int,
    )
    min_processes: int | None = _option(
        None,
        _count_or_none,
        "make the run elastic: when a node, executor or process is lost, go on from the latest "
        "sparktrain.checkpoint on the ranks still available, down to this many (None: not "
        "elastic; a loss fails the run or uses max_restarts)",
        cli=int,
    )
    grow_back: bool = _option(
        True,
        _flag,
        "in an elastic run that shrank, grow back to the full size at the next checkpoint "
        "once the capacity returns",
        cli=bool,
    )
    in_place: bool = _option(
        False,
        _flag,
        "in an elastic run, keep the surviving ranks in place on a loss (model, optimizer and "
        "data in memory; the training loop uses sparktrain.elastic.in_place) instead of "
        "restarting them from the checkpoint (see docs/elastic.md, 'In place')",
        cli=bool,
    )
    max_rescales: int = _option(
        10,
        _restarts,
        "in an elastic run, how many times it may shrink or grow before a loss fails it",
        cli=int,
    )
    heartbeat_timeout: float | None = _option(
        DEFAULT_HEARTBEAT_TIMEOUT,
        _seconds_or_none,
        "on a run of several nodes, seconds a node may be silent on the driver's channel (they "
        "exchange a heartbeat every second) before it is lost; a node that hears nothing from "
        "the driver that long stops its own ranks (None: no bound)",
    )
    exit_grace: float = _option(
        DEFAULT_EXIT_GRACE,
        _seconds,
        "seconds a rank that has returned gets to exit; it is "
        "then killed with one warning line, and what it returned stands",
    )
    stop_grace: float = _option(
        3.0, _seconds, "seconds between SIGTERM and SIGKILL when ranks are stopped"
    )
    log_ranks: frozenset[int] | None = _option(
        None, _ranks, "ranks whose output is shown, e.g. 0,1 (None: all)", cli=_parse_ranks
    )
    return_all: bool = _option(
        False, _flag, "bring back every rank's return value, not only rank 0's", cli=None
    )
    mlflow: bool | None = _option(
        None,
        _flag_or_none,
        "track the run in MLflow (None: when the caller has an active run)",
        cli=bool,
    )
    mlflow_strict: bool = _option(
        False, _flag, "raise, instead of warning, when the MLflow server cannot be used", cli=bool
    )
    progress: bool | None = _option(
        None,
        _flag_or_none,
        "draw a progress bar from rank 0's sparktrain.report() calls (None: "
        "when the output is a terminal or a notebook)",
        cli=bool,
    )
    env: Mapping[str, str] | None = _option(
        None,
        _variables,
        "environment variables set in every rank, on top of the caller's "
        "(on a cluster: the executor's), e.g. A=1,B=x",
        cli=_parse_variables,
    )
    data_cache_dir: str | None = _option(
        None,
        _folder_or_none,
        "where Spark writes a DataFrame given to train_on_dataframe (or "
        "dataframe=) for the ranks to stream; every rank must read it (None: the Spark conf "
        "spark.sparktrain.data.cacheDir, else a private temporary folder in local mode)",
        cli=str,
    )
    on_report: OnReport | None = _option(  # noqa: RUF009 - _option returns a dataclasses.field
        None,
        _callback,
        "called as on_report(rank, record) for every report in the caller's "
        "thread; returning True stops every rank",
        cli=None,
    )

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = item.metadata["check"](item.name, getattr(self, item.name))
            object.__setattr__(self, item.name, value)

    def shows(self, rank: int) -> bool:
        """Whether ``rank``'s output is shown to the caller."""
        return self.log_ranks is None or rank in self.log_ranks

    def for_nodes(self) -> RunOptions:
        """These options as they travel to the nodes: without the caller's callback."""
        return dataclasses.replace(self, on_report=None)

    @property
    def elastic(self) -> bool:
        """Whether a lost node shrinks the run instead of failing it (``min_processes``)."""
        return self.min_processes is not None

    def check_ranks(self, world_size: int, name: str = "num_processes") -> None:
        """Raise :class:`ConfigError` if ``log_ranks`` or ``min_processes`` do not fit the run."""
        if self.min_processes is not None and self.min_processes > world_size:
            raise ConfigError(
                f"min_processes={self.min_processes} is more than {name}={world_size}; the "
                f"fewest ranks an elastic run goes on with must be at most its full size: pass "
                f"min_processes<={world_size}."
            )
        if self.in_place and self.min_processes is None:
            raise ConfigError(
                "in_place=True keeps the survivors of an elastic run in place, but this run is "
                "not elastic: pass min_processes (for example "
                f"min_processes={max(1, world_size - 1)}), or leave in_place out."
            )
        if self.log_ranks is None:
            return
        outside = sorted(r for r in self.log_ranks if r >= world_size)
        if outside:
            raise ConfigError(
                f"log_ranks={sorted(self.log_ranks)!r} names {outside!r}, not ranks of this run "
                f"(0 to {world_size - 1}); pass ranks in that range, or None to show all."
            )


class RunOptionsArgs(TypedDict, total=False):
    """The keyword arguments of :class:`RunOptions`, for ``**options`` of the front doors."""

    timeout: float | None
    hang_timeout: float | None
    max_restarts: int
    min_processes: int | None
    grow_back: bool
    in_place: bool
    max_rescales: int
    heartbeat_timeout: float | None
    exit_grace: float
    stop_grace: float
    log_ranks: Collection[int] | None
    return_all: bool
    mlflow: bool | None
    mlflow_strict: bool
    progress: bool | None
    env: Mapping[str, str] | None
    data_cache_dir: str | None
    on_report: OnReport | None


NAMES = tuple(item.name for item in dataclasses.fields(RunOptions))


def run_options(base: RunOptions | None = None, /, **given: Any) -> RunOptions:
    """``base`` (or the defaults) with the options ``given`` by name, checked.

    Raises:
        ConfigError: An unknown option (the message names the closest known one and lists them
            all), or a bad value.
    """
    unknown = sorted(set(given) - set(NAMES))
    if unknown:
        close = difflib.get_close_matches(unknown[0], NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown option {unknown[0]!r}{hint}; the run options are: {', '.join(NAMES)}."
        )
    return dataclasses.replace(base or RunOptions(), **given)


def cli_options() -> list[tuple[str, Any, str]]:
    """``(name, parse, help)`` of each option that the command line takes."""
    return [
        (item.name, item.metadata["cli"], item.metadata["help"])
        for item in dataclasses.fields(RunOptions)
        if item.metadata["cli"] is not None
    ]


#: Where a front door's docstring lists the run options (:func:`documents_options`).
OPTIONS_MARK = "{run_options}"


def options_doc(indent: str) -> str:
    """Every run option as docstring lines: ``name`` (its default): its help, wrapped."""
    lines = []
    for item in dataclasses.fields(RunOptions):
        first = f"{indent}- ``{item.name}`` (default ``{item.default!r}``): "
        wrapped = textwrap.wrap(
            item.metadata["help"] + ".",
            width=100,
            initial_indent=first,
            subsequent_indent=indent + "  ",
        )
        lines.extend(wrapped)
    return "\n".join(lines)


_F = TypeVar("_F", bound=Callable[..., Any])


def documents_options(func: _F) -> _F:
    """Write every run option into ``func``'s docstring where it says ``{run_options}``.

    The list is made from :class:`RunOptions`' fields, so a front door's documentation names
    every option the moment one is added. The mark stands alone on its line; its indentation
    is the list's.
    """
    doc = func.__doc__
    if doc is None:  # python -OO
        return func
    for line in doc.splitlines():
        if line.strip() == OPTIONS_MARK:
            indent = line[: len(line) - len(line.lstrip())]
            func.__doc__ = doc.replace(line, options_doc(indent))
            return func
    raise AssertionError(f"{func.__qualname__}'s docstring has no line {OPTIONS_MARK}")
