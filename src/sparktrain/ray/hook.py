"""The start hook through which Ray on Spark gives its worker nodes our environment.

``ray.util.spark`` builds the environment of the ``ray start`` it runs in each Spark task from
its start hook's ``custom_environment_variables()``, and loads the hook class named by
``RAY_ON_SPARK_START_HOOK``. :func:`sparktrain.ray.setup_on_spark` names one of these classes
for the duration of its call (the Databricks one on Databricks, to keep its behaviour) after
filling :data:`EXTRA_ENV`. This module imports Ray: it is loaded only by Ray, during that call.
"""

from __future__ import annotations

from ray.util.spark.databricks_hook import DefaultDatabricksRayOnSparkStartHook
from ray.util.spark.start_hook_base import RayOnSparkStartHook

#: Variables added to every Ray worker node's environment (set by ``setup_on_spark``).
EXTRA_ENV: dict[str, str] = {}


class Hook(RayOnSparkStartHook):  # type: ignore[misc]
    """Ray's default hook, plus :data:`EXTRA_ENV`."""

    def __init__(self, is_global: bool = False) -> None:
        super().__init__(is_global)

    def custom_environment_variables(self) -> dict[str, str]:
        """Ray's variables and ours."""
        return {**super().custom_environment_variables(), **EXTRA_ENV}


class DatabricksHook(DefaultDatabricksRayOnSparkStartHook):  # type: ignore[misc]
    """Ray's Databricks hook, plus :data:`EXTRA_ENV`."""

    def __init__(self, is_global: bool = False) -> None:
        super().__init__(is_global)

    def custom_environment_variables(self) -> dict[str, str]:
        """Ray's variables and ours."""
        return {**super().custom_environment_variables(), **EXTRA_ENV}
