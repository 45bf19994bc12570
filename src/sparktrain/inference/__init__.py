"""Batch inference that reads files where the model runs: :func:`score`.

``score`` writes predictions as Parquet or Delta files from ranks that read the input files
themselves (this machine, Spark executors or Ray); ``sparktrain.spark.predict`` hands the same
scoring back as a Spark DataFrame when its input is a plain scan of files. docs/spark-ml.md,
"Inference at scale", says which path applies when.

``import sparktrain.inference`` imports neither torch nor pyarrow; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparktrain.inference.api import ScoreResult, score

__all__ = ["ScoreResult", "score"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'sparktrain.inference' has no attribute {name!r}")
    value = getattr(importlib.import_module("sparktrain.inference.api"), name)
    globals()[name] = value
    return value
