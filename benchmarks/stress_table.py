"""The rows of ``stress.py``'s table: runs, hangs, failures and times; what killed callers left."""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds a stress run may take; a run stopped by it counts as a hang.
RUN_TIMEOUT = 60.0


@dataclass
class Row:
    """One row of the table."""

    label: str
    durations: list[float] = field(default_factory=list)
    hangs: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, result: str, seconds: float) -> None:
        with self.lock:
            self.durations.append(seconds)
            if result == "hang":
                self.hangs += 1
            elif result != "ok":
                self.failures.append(result)

    def line(self) -> str:
        runs = len(self.durations)
        median = statistics.median(self.durations) if runs else float("nan")
        longest = max(self.durations) if runs else float("nan")
        return (
            f"  {self.label:<44} {runs:>6} {self.hangs:>6} {len(self.failures):>9} "
            f"{median:>9.3f} {longest:>8.3f}"
        )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class KillRow:
    """What SIGKILLing callers left."""

    trials: int = 0
    late_starts: int = 0
    survivors: int = 0
    dirs_left: int = 0
