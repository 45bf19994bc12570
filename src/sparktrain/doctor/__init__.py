"""``sparktrain doctor``: what on this machine (and Spark cluster) would stop a launch, and the fix.

``run_checks()`` returns a :class:`DoctorReport` of :class:`Check` values (ok, info, warning,
error); ``print(report)`` shows them, ``report.to_dict()`` is the same for programs, and
``report.exit_code`` is 1 when an error blocks a launch. Importing this package is cheap; the
checks import torch (and pyspark only with a Spark session).
"""

from __future__ import annotations

from sparktrain.doctor.api import run_checks
from sparktrain.doctor.verdicts import Check, DoctorReport, Verdict

__all__ = ["Check", "DoctorReport", "Verdict", "run_checks"]
