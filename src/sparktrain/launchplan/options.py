"""``RunOptions``: a run's policy, one value of typed groups by concern.

The layout of a run (how many ranks, where, on which devices) is planned from the cluster; its
policy is the user's choice and the same for every front door. It comes in groups, as
torchtitan's job config and Ray Train's ``RunConfig``/``FailureConfig`` do:

- :class:`Limits`: the bounds in time (the run, a hang, a silent node, a rank's exit, a stop);
- :class:`Recovery`: what follows a failure or a loss (restarts, an elastic run's floor, growing
  back, keeping the survivors in place, how often it may change size);
- :class:`Output`: what the caller sees and gets (whose lines, every rank's value, the bar, the
  report callback);
- :class:`Tracking`: MLflow;
- :class:`Environment`: what every rank is given besides the function (variables, the data
  cache's folder).

``launch``, ``TorchDistributor``, ``DeepspeedTorchDistributor``, ``HorovodRunner``,
``MirroredStrategyRunner``, ``tune`` and ``sparktrain run`` all take every option by its own
flat name, through :func:`run_options`, which puts it in its group, checks each value once and
names an unknown option with the closest known one. The keyword arguments' type
(:class:`RunOptionsArgs`) is tested against the groups' fields, and the command line and the
front doors' documentation are made from them (:mod:`sparktrain.launchplan.option_docs`), so a
new option is one field of a group plus the code that uses it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from typing_extensions import Unpack

from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan import checks

OnReport = Callable[[int, dict[str, Any]], "bool | None"]

#: Seconds a rank that has returned (or raised) gets to exit before it is killed.
DEFAULT_EXIT_GRACE = 10.0
#: Seconds a node may be silent on the driver's channel (and the driver on the node's).
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


def _option(default: Any, check: Callable[[str, Any], Any], help: str, *, cli: Any = float) -> Any:
    """A field of a group: its default, its check, its help, its command-line type.

    ``cli``: how the command line parses the flag's text (``float``, ``int``, ``bool`` for a
    ``--name/--no-name`` pair, a function), or ``None`` when the option cannot be given there.
    """
    return field(default=default, metadata={"check": check, "help": help, "cli": cli})


@dataclass(frozen=True, kw_only=True)
class _Checked:
    """A group whose fields check their values once, when it is made."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = item.metadata["check"](item.name, getattr(self, item.name))
            object.__setattr__(self, item.name, value)


@dataclass(frozen=True, kw_only=True)
class Limits(_Checked):
    """The bounds in time of a run and of its parts."""

    timeout: float | None = _option(
        None,
        checks.seconds_or_none,
        "stop every rank this many seconds after the call started (across its restarts, "
        "rescales and late joiners) and raise TrainingTimeoutError (None: no limit)",
    )
    hang_timeout: float | None = _option(
        None,
        checks.seconds_or_none,
        "seconds without a line or a sparktrain.report() from any rank "
        "after which the run is declared hung and where each rank waits is reported (None: off)",
    )
    heartbeat_timeout: float | None = _option(
        DEFAULT_HEARTBEAT_TIMEOUT,
        checks.seconds_or_none,
        "on a run of several nodes, seconds a node may be silent on the driver's channel (they "
        "exchange a heartbeat every second) before it is lost; a node that hears nothing from "
        "the driver that long stops its own ranks (None: no bound)",
    )
    exit_grace: float = _option(
        DEFAULT_EXIT_GRACE,
        checks.seconds,
        "seconds a rank that has returned gets to exit; it is "
        "then killed with one warning line, and what it returned stands",
    )
    stop_grace: float = _option(
        3.0, checks.seconds, "seconds between SIGTERM and SIGKILL when ranks are stopped"
    )


@dataclass(frozen=True, kw_only=True)
class Recovery(_Checked):
    """What a run does after a failure or the loss of a node."""

    max_restarts: int = _option(
        0,
        checks.restarts,
        "after a failure, stop every rank and start the whole group again, up to "
        "this many times (timeouts are not restarted)",
        cli=int,
    )
    min_processes: int | None = _option(
        None,
        checks.count_or_none,
        "make the run elastic: when a node, executor or process is lost, go on from the latest "
        "sparktrain.checkpoint on the ranks still available, down to this many (None: not "
        "elastic; a loss fails the run or uses max_restarts)",
        cli=int,
    )
    grow_back: bool = _option(
        True,
        checks.flag,
        "in an elastic run that shrank, grow back to the full size at the next checkpoint "
        "once the capacity returns",
        cli=bool,
    )
    in_place: bool = _option(
        False,
        checks.flag,
        "in an elastic run, keep the surviving ranks in place on a loss (model, optimizer and "
        "data in memory; the training loop uses sparktrain.elastic.in_place) instead of "
        "restarting them from the checkpoint (see docs/elastic.md, 'In place')",
        cli=bool,
    )
    max_rescales: int = _option(
        10,
        checks.restarts,
        "in an elastic run, how many times it may shrink or grow before a loss fails it",
        cli=int,
    )

    @property
    def elastic(self) -> bool:
        """Whether a lost node shrinks the run instead of failing it (``min_processes``)."""
        return self.min_processes is not None


@dataclass(frozen=True, kw_only=True)
class Output(_Checked):
    """What the caller sees while the run goes, and gets back."""

    log_ranks: frozenset[int] | None = _option(
        None,
        checks.ranks,
        "ranks whose output is shown, e.g. 0,1 (None: all)",
        cli=checks.parse_ranks,
    )
    return_all: bool = _option(
        False, checks.flag, "bring back every rank's return value, not only rank 0's", cli=None
    )
    progress: bool | None = _option(
        None,
        checks.flag_or_none,
        "draw a progress bar from rank 0's sparktrain.report() calls (None: "
        "when the output is a terminal or a notebook)",
        cli=bool,
    )
    on_report: OnReport | None = _option(  # noqa: RUF009 - _option returns a dataclasses.field
        None,
        checks.callback,
        "called as on_report(rank, record) for every report in the caller's "
        "thread; returning True stops every rank",
        cli=None,
    )

    def shows(self, rank: int) -> bool:
        """Whether ``rank``'s output is shown to the caller."""
        return self.log_ranks is None or rank in self.log_ranks


@dataclass(frozen=True, kw_only=True)
class Tracking(_Checked):
    """Whether, and how strictly, the run is tracked in MLflow."""

    mlflow: bool | None = _option(
        None,
        checks.flag_or_none,
        "track the run in MLflow (None: when the caller has an active run)",
        cli=bool,
    )
    mlflow_strict: bool = _option(
        False,
        checks.flag,
        "raise, instead of warning, when the MLflow server cannot be used",
        cli=bool,
    )


@dataclass(frozen=True, kw_only=True)
class Environment(_Checked):
    """What every rank is given besides the function: variables, the data cache's folder."""

    env: Mapping[str, str] | None = _option(
        None,
        checks.variables,
        "environment variables set in every rank, on top of the caller's "
        "(on a cluster: the executor's), e.g. A=1,B=x",
        cli=checks.parse_variables,
    )
    data_cache_dir: str | None = _option(
        None,
        checks.folder_or_none,
        "where Spark writes a DataFrame given to train_on_dataframe (or "
        "dataframe=) for the ranks to stream; every rank must read it (None: the Spark conf "
        "spark.sparktrain.data.cacheDir, else a private temporary folder in local mode)",
        cli=str,
    )


@dataclass(frozen=True, init=False)
class RunOptions:
    """How a run behaves, whatever its layout, in groups; every front door takes each by name.

    ``RunOptions(limits=Limits(timeout=60), max_restarts=2)``: whole groups, and options by
    their own names on top (each goes to its group), both checked.

    Attributes:
        limits: The bounds in time.
        recovery: What follows a failure or a loss.
        output: What the caller sees and gets back.
        tracking: MLflow.
        environment: What every rank is given.
    """

    limits: Limits
    recovery: Recovery
    output: Output
    tracking: Tracking
    environment: Environment

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        recovery: Recovery | None = None,
        output: Output | None = None,
        tracking: Tracking | None = None,
        environment: Environment | None = None,
        **options: Unpack[RunOptionsArgs],
    ) -> None:
        """Make the groups (defaults where not given), with ``options`` by name in them.

        Raises:
            ConfigError: A group of the wrong type, an unknown option (the message names the
                closest known one), or a bad value.
        """
        given = {
            "limits": limits, "recovery": recovery, "output": output, "tracking": tracking,
            "environment": environment,
        }  # fmt: skip
        _refuse_unknown(options)
        for group, cls in GROUPS.items():
            value = given[group] if given[group] is not None else cls()
            if not isinstance(value, cls):
                raise ConfigError(
                    f"RunOptions({group}={value!r}): pass a {cls.__name__}, or name its options "
                    f"one by one, e.g. RunOptions({_fields(group)[0]}=...)."
                )
            mine = {k: v for k, v in options.items() if GROUP_OF[k] == group}
            object.__setattr__(self, group, dataclasses.replace(value, **mine) if mine else value)

    @property
    def elastic(self) -> bool:
        """Whether a lost node shrinks the run instead of failing it (``min_processes``)."""
        return self.recovery.elastic

    def for_nodes(self) -> RunOptions:
        """These options as they travel to the nodes: without the caller's callback."""
        return dataclasses.replace(self, output=dataclasses.replace(self.output, on_report=None))

    def check_ranks(self, world_size: int, name: str = "num_processes") -> None:
        """Raise :class:`ConfigError` if ``log_ranks`` or ``min_processes`` do not fit the run."""
        recovery, log_ranks = self.recovery, self.output.log_ranks
        if recovery.min_processes is not None and recovery.min_processes > world_size:
            raise ConfigError(
                f"min_processes={recovery.min_processes} is more than {name}={world_size}; the "
                f"fewest ranks an elastic run goes on with must be at most its full size: pass "
                f"min_processes<={world_size}."
            )
        if recovery.in_place and recovery.min_processes is None:
            raise ConfigError(
                "in_place=True keeps the survivors of an elastic run in place, but this run is "
                "not elastic: pass min_processes (for example "
                f"min_processes={max(1, world_size - 1)}), or leave in_place out."
            )
        outside = sorted(r for r in log_ranks or () if r >= world_size)
        if outside:
            raise ConfigError(
                f"log_ranks={sorted(log_ranks or ())!r} names {outside!r}, not ranks of this run "
                f"(0 to {world_size - 1}); pass ranks in that range, or None to show all."
            )


class RunOptionsArgs(TypedDict, total=False):
    """Every option of every group by its own name, for ``**options`` of the front doors.

    Kept equal to the groups' fields by ``tests/test_imports.py``.
    """

    timeout: float | None
    hang_timeout: float | None
    heartbeat_timeout: float | None
    exit_grace: float
    stop_grace: float
    max_restarts: int
    min_processes: int | None
    grow_back: bool
    in_place: bool
    max_rescales: int
    log_ranks: Collection[int] | None
    return_all: bool
    progress: bool | None
    on_report: OnReport | None
    mlflow: bool | None
    mlflow_strict: bool
    env: Mapping[str, str] | None
    data_cache_dir: str | None


def _fields(group: str) -> tuple[str, ...]:
    return tuple(item.name for item in dataclasses.fields(GROUPS[group]))


#: Each group's field of :class:`RunOptions` -> its class.
GROUPS: dict[str, type[_Checked]] = {
    "limits": Limits,
    "recovery": Recovery,
    "output": Output,
    "tracking": Tracking,
    "environment": Environment,
}
#: Each option's name -> the group that holds it.
GROUP_OF: dict[str, str] = {name: group for group in GROUPS for name in _fields(group)}
#: Every option's name, group by group.
NAMES = tuple(GROUP_OF)


def fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """``(group, field)`` of every option, group by group."""
    return [(group, item) for group, cls in GROUPS.items() for item in dataclasses.fields(cls)]


def _refuse_unknown(given: Mapping[str, Any]) -> None:
    unknown = sorted(set(given) - set(NAMES))
    if unknown:
        close = difflib.get_close_matches(unknown[0], NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown option {unknown[0]!r}{hint}; the run options are: {', '.join(NAMES)}."
        )


def run_options(base: RunOptions | None = None, /, **given: Any) -> RunOptions:
    """``base`` (or the defaults) with the options ``given`` by name, each in its group, checked.

    Raises:
        ConfigError: An unknown option (the message names the closest known one and lists them
            all), or a bad value.
    """
    _refuse_unknown(given)
    base = base or RunOptions()
    return RunOptions(**{group: getattr(base, group) for group in GROUPS}, **given)
