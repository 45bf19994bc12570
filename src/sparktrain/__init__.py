"""sparktrain: launch PyTorch distributed training from a notebook cell or a script.

``import sparktrain`` is cheap: it imports neither torch nor any optional engine (pyspark, ray,
mlflow, deepspeed, tensorflow). Public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sparktrain._version import __version__
from sparktrain.contract.env import restart_count
from sparktrain.errors import (
    CapacityError,
    ClusterConfigError,
    ClusterError,
    ConfigError,
    HangError,
    RankFailure,
    SparkJobError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from sparktrain.rank.reporting import progress, report

if TYPE_CHECKING:
    from sparktrain import checkpoint, elastic, tuning
    from sparktrain.compat.decorator import distributed
    from sparktrain.compat.deepspeed_distributor import DeepspeedTorchDistributor
    from sparktrain.compat.horovod_runner import HorovodRunner
    from sparktrain.compat.tensorflow_runner import MirroredStrategyRunner
    from sparktrain.compat.torch_distributor import TorchDistributor
    from sparktrain.driver.launch import launch
    from sparktrain.driver.local_cluster import LocalCluster
    from sparktrain.driver.results import Rescale, RunResult
    from sparktrain.launchplan.layout import LaunchPlan
    from sparktrain.launchplan.options import RunOptions
    from sparktrain.node.warm import shutdown as shutdown_warm
    from sparktrain.planner import plan
    from sparktrain.strategies import (
        backward,
        deepspeed_config,
        forward_backward,
        full_state_dict,
        prepare_data_loader,
        prepare_model,
        prepare_optimizer,
    )
    from sparktrain.tracking import log_metrics, log_model, log_params
    from sparktrain.tuning import tune

__all__ = [
    "CapacityError",
    "ClusterConfigError",
    "ClusterError",
    "ConfigError",
    "DeepspeedTorchDistributor",
    "HangError",
    "HorovodRunner",
    "LaunchPlan",
    "LocalCluster",
    "MirroredStrategyRunner",
    "RankFailure",
    "Rescale",
    "RunOptions",
    "RunResult",
    "SparkJobError",
    "TorchDistributor",
    "TrainingFailedError",
    "TrainingTimeoutError",
    "__version__",
    "backward",
    "checkpoint",
    "deepspeed_config",
    "distributed",
    "elastic",
    "forward_backward",
    "full_state_dict",
    "launch",
    "log_metrics",
    "log_model",
    "log_params",
    "plan",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "progress",
    "report",
    "restart_count",
    "shutdown_warm",
    "tune",
    "tuning",
]

_LAZY = {
    "DeepspeedTorchDistributor": (
        "sparktrain.compat.deepspeed_distributor",
        "DeepspeedTorchDistributor",
    ),
    "checkpoint": ("sparktrain", "checkpoint"),
    "elastic": ("sparktrain", "elastic"),
    "LocalCluster": ("sparktrain.driver.local_cluster", "LocalCluster"),
    "Rescale": ("sparktrain.driver.results", "Rescale"),
    "distributed": ("sparktrain.compat.decorator", "distributed"),
    "HorovodRunner": ("sparktrain.compat.horovod_runner", "HorovodRunner"),
    "MirroredStrategyRunner": ("sparktrain.compat.tensorflow_runner", "MirroredStrategyRunner"),
    "TorchDistributor": ("sparktrain.compat.torch_distributor", "TorchDistributor"),
    "launch": ("sparktrain.driver.launch", "launch"),
    "LaunchPlan": ("sparktrain.launchplan.layout", "LaunchPlan"),
    "RunResult": ("sparktrain.driver.results", "RunResult"),
    "RunOptions": ("sparktrain.launchplan.options", "RunOptions"),
    "plan": ("sparktrain.planner", "plan"),
    "log_params": ("sparktrain.tracking", "log_params"),
    "log_metrics": ("sparktrain.tracking", "log_metrics"),
    "log_model": ("sparktrain.tracking", "log_model"),
    "prepare_model": ("sparktrain.strategies", "prepare_model"),
    "prepare_data_loader": ("sparktrain.strategies", "prepare_data_loader"),
    "full_state_dict": ("sparktrain.strategies", "full_state_dict"),
    "forward_backward": ("sparktrain.strategies", "forward_backward"),
    "prepare_optimizer": ("sparktrain.strategies", "prepare_optimizer"),
    "backward": ("sparktrain.strategies", "backward"),
    "deepspeed_config": ("sparktrain.strategies", "deepspeed_config"),
    "shutdown_warm": ("sparktrain.node.warm", "shutdown"),
    "tune": ("sparktrain.tuning", "tune"),
    "tuning": ("sparktrain", "tuning"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'sparktrain' has no attribute {name!r}") from None
    if module == "sparktrain":  # a submodule
        value = importlib.import_module(f"sparktrain.{attr}")
    else:
        value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
