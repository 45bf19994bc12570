"""Checks of the optional engines (pyspark, mlflow, deepspeed, ray, tensorflow, optuna), Java.

Design choices:
- An extra is looked up, not imported: ``importlib.util.find_spec`` and the installed
  distribution's version answer "is it there, which version" in milliseconds, where importing
  mlflow, deepspeed or tensorflow takes seconds and may print. A missing extra is ``info``: it
  blocks only the features that use it, and the fix is its pip command.
- Java is asked for its version only when pyspark is installed (classic Spark starts a JVM).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from importlib import metadata

from sparktrain.doctor.checks import version_tuple
from sparktrain.doctor.verdicts import Check

#: Extra -> (module, distribution, minimum version, install command, what it enables).
EXTRAS: dict[str, tuple[str, str, str, str, str]] = {
    "pyspark": ("pyspark", "pyspark", "3.5", "pip install 'sparktrain[spark]'", "Spark backend"),
    "mlflow": ("mlflow", "mlflow", "2.10", "pip install 'sparktrain[mlflow]'", "MLflow tracking"),
    "deepspeed": (
        "deepspeed",
        "deepspeed",
        "0.14",
        "pip install --no-build-isolation deepspeed",
        "ZeRO strategies, DeepspeedTorchDistributor",
    ),
    "ray": ("ray", "ray", "2.9", "pip install 'sparktrain[ray]'", "Ray backend"),
    "tensorflow": (
        "tensorflow",
        "tensorflow",
        "2.13",
        "pip install 'sparktrain[tensorflow]'",
        "MirroredStrategyRunner",
    ),
    "optuna": ("optuna", "optuna", "3.4", "pip install 'sparktrain[tune]'", "sparktrain.tune"),
}
#: Other distributions that ship the same module.
ALSO_SHIPPED_BY: dict[str, tuple[str, ...]] = {
    "tensorflow": ("tensorflow-cpu", "tensorflow-macos", "tf-nightly"),
}
#: What the Spark backend needs beside pyspark (barrier mapInArrow).
SPARK_COMPANIONS = ("pandas", "pyarrow")


def _installed(module: str, distribution: str) -> str | None:
    """The installed version of ``distribution`` when ``module`` can be found, else ``None``."""
    if importlib.util.find_spec(module) is None:
        return None
    for name in (distribution, *ALSO_SHIPPED_BY.get(distribution, ())):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


def extra_check(name: str) -> Check:
    """Whether the extra ``name`` (a key of :data:`EXTRAS`) is installed, and new enough."""
    module, distribution, minimum, install, enables = EXTRAS[name]
    version = _installed(module, distribution)
    facts: dict[str, object] = {"installed": version is not None, "version": version}
    label = f"extra.{name}"
    if version is None:
        return Check(
            name=label,
            verdict="info",
            found=f"{name} is not installed ({enables} unavailable)",
            fix=install,
            facts=facts,
        )
    if version != "unknown version" and version_tuple(version) < version_tuple(minimum):
        return Check(
            name=label,
            verdict="warning",
            found=f"{name} {version} is older than the {minimum} sparktrain is tested with",
            fix=f"pip install '{distribution}>={minimum}'",
            facts=facts,
        )
    if name == "pyspark":
        missing = [m for m in SPARK_COMPANIONS if importlib.util.find_spec(m) is None]
        facts["missing"] = missing
        if missing:
            return Check(
                name=label,
                verdict="warning",
                found=f"pyspark {version}, but {', '.join(missing)} missing: the Spark "
                "backend's barrier stage (mapInArrow) needs them",
                fix=f"pip install {' '.join(missing)} (or {install})",
                facts=facts,
            )
    return Check(name=label, verdict="ok", found=f"{name} {version}", facts=facts)


def extras_checks() -> list[Check]:
    """One check per optional engine, in :data:`EXTRAS` order."""
    return [extra_check(name) for name in EXTRAS]


def java_version(java: str) -> str | None:
    """The version ``java -version`` prints (``"17.0.15"``), or ``None`` when it cannot run."""
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "([^"]+)"', done.stderr + done.stdout)
    return match.group(1) if match else None


def _java_major(version: str) -> int:
    parts = version_tuple(version)
    if not parts:
        return 0
    return parts[1] if parts[0] == 1 and len(parts) > 1 else parts[0]  # "1.8.0" is Java 8


def java_check(*, needed: bool = False) -> Check:
    """Java for classic Spark: found through ``JAVA_HOME`` or ``PATH``, and its version.

    Args:
        needed: A Spark session is about to be created, so a missing Java is an error.
    """
    spark_version = _installed("pyspark", "pyspark")
    if spark_version is None and not needed:
        return Check(name="java", verdict="info", found="not checked: pyspark is not installed")
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    facts: dict[str, object] = {"java_home": home, "java": java, "version": None}
    version = java_version(java) if java else None
    if version is None:
        where = f"JAVA_HOME={home}" if home else "PATH"
        return Check(
            name="java",
            verdict="error" if needed else "warning",
            found=f"no working java found through {where}: classic Spark cannot start its JVM",
            fix="install a JDK (17 or 21 for Spark 4, e.g. apt-get install openjdk-17-jre-headless)"
            " and set JAVA_HOME; Spark Connect clients need no Java",
            facts=facts,
        )
    facts["version"] = version
    major = _java_major(version)
    spark_major = version_tuple(spark_version or "4")[:1] or (4,)
    need = 17 if spark_major[0] >= 4 else 8
    if major < need:
        return Check(
            name="java",
            verdict="error" if needed else "warning",
            found=f"Java {version} at {java}, but pyspark {spark_version} needs Java {need}+",
            fix=f"install Java {need} or newer and point JAVA_HOME at it",
            facts=facts,
        )
    return Check(name="java", verdict="ok", found=f"Java {version} ({java})", facts=facts)
