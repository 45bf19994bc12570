"""``sparktrain.errors``: the public name of :mod:`sparktrain.ground.errors`.

Every error sparktrain raises lives in ``ground/`` (every process uses them); this module lets
``from sparktrain.errors import TrainingFailedError`` keep working. The same classes are also
``sparktrain.TrainingFailedError`` and so on.
"""

from sparktrain.ground.errors import (
    CapacityError,
    CheckpointError,
    ClusterConfigError,
    ClusterError,
    ConfigError,
    GrowBack,
    HangError,
    RankFailure,
    SparkJobError,
    StackSite,
    TrainingFailedError,
    TrainingTimeoutError,
)

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ClusterConfigError",
    "ClusterError",
    "ConfigError",
    "GrowBack",
    "HangError",
    "RankFailure",
    "SparkJobError",
    "StackSite",
    "TrainingFailedError",
    "TrainingTimeoutError",
]
