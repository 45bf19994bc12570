"""Ray on Spark: start a Ray cluster on the active SparkSession, run on it, leave nothing behind.

``import sparktrain.ray`` imports no Ray; :func:`setup_on_spark` does, when called.
"""

from sparktrain.ray.on_spark import RayOnSpark, setup_on_spark

__all__ = ["RayOnSpark", "setup_on_spark"]
