"""Print a doctor report for people: one line per check, its fix under it, and a summary."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from sparktrain._version import __version__

if TYPE_CHECKING:
    from sparktrain.doctor.verdicts import DoctorReport

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
