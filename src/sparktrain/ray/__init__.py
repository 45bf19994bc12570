"""Ray on Spark, and a warm local Ray: start a Ray, run on it, leave nothing behind.

``import sparktrain.ray`` imports no Ray; :func:`setup_on_spark` and :func:`start_local` do,
when called.
"""

from sparktrain.backends.ray.connect import start_local
from sparktrain.ray.on_spark import RayOnSpark, setup_on_spark

__all__ = ["RayOnSpark", "setup_on_spark", "start_local"]
