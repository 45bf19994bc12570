"""The values ``sparktrain doctor`` produces: one :class:`Check` per question, one report, as text.

Design choices:
- A check is a frozen value (name, verdict, what was found, the fix, facts for programs); the
  checks never print, so they can be tested and serialised without a terminal.
- Four verdicts: ``ok``; ``info`` for a fact that needs no action (an extra not installed);
  ``warning`` for something that may hurt (small ``/dev/shm``, no GPU); ``error`` for something
  that blocks a launch. Only errors make the exit code non-zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from sparktrain.ground.version import __version__

Verdict = Literal["ok", "info", "warning", "error"]
#: Verdicts from best to worst.
VERDICTS: tuple[Verdict, ...] = ("ok", "info", "warning", "error")


class Finding(NamedTuple):
    """What a check found, before it is named and given its facts (see :class:`Check`)."""

    verdict: Verdict
    found: str
    fix: str = ""


@dataclass(frozen=True, kw_only=True)
class Check:
    """The answer to one question about the environment.

    Attributes:
        name: Short name of the question, e.g. ``"torch"`` or ``"spark.slots"``.
        verdict: ``ok``, ``info``, ``warning`` or ``error`` (an error blocks a launch).
        found: What was found, one line for people.
        fix: What to do about it ("" when there is nothing to do).
        facts: The same findings for programs (versions, counts, bytes).
    """

    name: str
    verdict: Verdict
    found: str
    fix: str = ""
    facts: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def judged(cls, name: str, finding: Finding, facts: dict[str, Any]) -> Check:
        """The check called ``name`` that found ``finding``, with ``facts``."""
        verdict, found, fix = finding
        return cls(name=name, verdict=verdict, found=found, fix=fix, facts=facts)

    def to_dict(self) -> dict[str, Any]:
        """The check as JSON-ready data."""
        return {
            "name": self.name,
            "verdict": self.verdict,
            "found": self.found,
            "fix": self.fix,
            "facts": dict(self.facts),
        }


@dataclass(frozen=True)
class DoctorReport:
    """Every check that ran, in order.

    Attributes:
        checks: The checks, local ones first, then Spark's when a session was examined.
    """

    checks: tuple[Check, ...]

    @property
    def errors(self) -> tuple[Check, ...]:
        """The checks whose verdict blocks a launch."""
        return tuple(c for c in self.checks if c.verdict == "error")

    @property
    def warnings(self) -> tuple[Check, ...]:
        """The checks with a warning."""
        return tuple(c for c in self.checks if c.verdict == "warning")

    @property
    def exit_code(self) -> int:
        """1 when a check blocks a launch, else 0 (warnings do not fail)."""
        return 1 if self.errors else 0

    def get(self, name: str) -> Check:
        """The check called ``name``.

        Raises:
            KeyError: No check of that name ran; the message lists those that did.
        """
        for check in self.checks:
            if check.name == name:
                return check
        names = ", ".join(c.name for c in self.checks)
        raise KeyError(f"no check named {name!r}; these ran: {names}")

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: the checks, the counts and the exit code."""
        counts = {v: sum(1 for c in self.checks if c.verdict == v) for v in VERDICTS}
        return {
            "exit_code": self.exit_code,
            "counts": counts,
            "checks": [c.to_dict() for c in self.checks],
        }

    def __str__(self) -> str:
        return render_report(self)


_MARK = {"ok": "ok", "info": "info", "warning": "WARNING", "error": "ERROR"}


def render_report(report: DoctorReport) -> str:
    """The report as text; every check that is not ok shows its fix."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = [f"sparktrain doctor (sparktrain {__version__})", ""]
    for check in report.checks:
        lines.append(f"  {_MARK[check.verdict]:<8} {check.name:<{width}}  {check.found}")
        if check.fix and check.verdict != "ok":
            lines.append(f"  {'':<8} {'':<{width}}  fix: {check.fix}")
    errors, warnings = len(report.errors), len(report.warnings)
    lines.append("")
    if errors:
        names = ", ".join(c.name for c in report.errors)
        lines.append(f"{errors} error(s) block a launch ({names}); {warnings} warning(s).")
    elif warnings:
        lines.append(f"Nothing blocks a launch; {warnings} warning(s) above.")
    else:
        lines.append("Nothing blocks a launch.")
    return "\n".join(lines)


def render_json(report: DoctorReport) -> str:
    """The report as indented JSON (see :meth:`DoctorReport.to_dict`)."""
    return json.dumps(report.to_dict(), indent=2, default=str)
