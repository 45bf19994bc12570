"""What a search returns: every trial's configuration, outcome and metric, and the best one."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Literal

TrialState = Literal["complete", "pruned", "failed", "interrupted"]


@dataclass(frozen=True)
class TrialRecord:
    """One trial of a search.

    Attributes:
        number: The trial's number in the study (0, 1, ...).
        config: The configuration it ran with (searched values and constants).
        state: ``complete``, ``pruned`` (stopped early by the scheduler), ``failed`` or
            ``interrupted`` (stopped by Ctrl-C; retried when the search is resumed).
        value: The metric: the trial's final value, or its last report when pruned.
        step: The step of its last report.
        duration: Seconds the trial ran.
        error: The first line of its error, for failed trials.
    """

    number: int
    config: dict[str, Any]
    state: TrialState
    value: float | None
    step: int | None
    duration: float | None
    error: str | None = None


@dataclass(frozen=True)
class TuneResult:
    """The outcome of :func:`sparktrain.tune`.

    Attributes:
        metric: The metric searched on.
        mode: ``min`` or ``max``.
        trials: Every trial of the study, in order (with those of earlier, resumed sessions).
    """

    metric: str
    mode: Literal["min", "max"]
    trials: tuple[TrialRecord, ...]

    @property
    def best(self) -> TrialRecord | None:
        """The complete trial with the best metric."""
        done = [t for t in self.trials if t.state == "complete" and t.value is not None]
        if not done:
            return None
        pick = min if self.mode == "min" else max
        return pick(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]

    @property
    def best_config(self) -> dict[str, Any] | None:
        """The best trial's configuration."""
        best = self.best
        return None if best is None else best.config

    @property
    def best_value(self) -> float | None:
        """The best trial's metric."""
        best = self.best
        return None if best is None else best.value

    def count(self, state: TrialState) -> int:
        """How many trials ended in ``state``."""
        return sum(1 for t in self.trials if t.state == state)

    def median_value(self) -> float | None:
        """The median metric of the complete trials."""
        values = [t.value for t in self.trials if t.state == "complete" and t.value is not None]
        return statistics.median(values) if values else None

    def table(self) -> str:
        """The trials as a plain-text table, best first."""
        sign = 1 if self.mode == "min" else -1
        rows = sorted(
            self.trials,
            key=lambda t: (t.state != "complete", sign * (t.value if t.value is not None else 0)),
        )
        names = sorted({k for t in rows for k in t.config})
        head = ["trial", "state", self.metric, "step", "seconds", *names]
        body = [
            [
                str(t.number),
                t.state,
                "" if t.value is None else f"{t.value:.4g}",
                "" if t.step is None else str(t.step),
                "" if t.duration is None else f"{t.duration:.1f}",
                *(_cell(t.config.get(n)) for n in names),
            ]
            for t in rows
        ]
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]
        ]
        return "\n".join(line.rstrip() for line in lines)

    def to_dataframe(self) -> Any:
        """The trials as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(
            [
                {"trial": t.number, "state": t.state, self.metric: t.value, "step": t.step,
                 "seconds": t.duration, "error": t.error, **t.config}
                for t in self.trials
            ]
        )  # fmt: skip


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
