"""Spark ML and batch inference: ``TorchEstimator``, ``TorchModel`` and :func:`predict`.

``TorchEstimator`` is a ``pyspark.ml`` estimator: ``fit(df)`` trains a PyTorch model through the
same launch as every sparktrain front door (the DataFrame streamed into the ranks, never
collected) and returns a ``TorchModel``, a transformer whose ``transform(df)`` adds predictions
computed in the executors. Both work in a ``Pipeline`` with Spark's own stages, in
``CrossValidator``, and save and load with ML persistence. :func:`predict` scores a DataFrame
with any PyTorch model or MLflow model URI. docs/spark-ml.md has the guide.

This package needs pyspark (the ``spark`` extra); its names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sparktrain.ground.errors import ConfigError

if TYPE_CHECKING:
    from sparktrain.spark.estimator import TorchEstimator
    from sparktrain.spark.model import TorchModel
    from sparktrain.spark.predict import predict
    from sparktrain.spark.rank.fitjob import FitContext

__all__ = ["FitContext", "TorchEstimator", "TorchModel", "predict"]

_LAZY = {
    "FitContext": "sparktrain.spark.rank.fitjob",
    "TorchEstimator": "sparktrain.spark.estimator",
    "TorchModel": "sparktrain.spark.model",
    "predict": "sparktrain.spark.predict",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sparktrain.spark' has no attribute {name!r}")
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"sparktrain.spark.{name} needs pyspark: pip install 'sparktrain[spark]'"
        ) from None
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
