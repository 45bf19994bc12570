"""sparktrain: launch PyTorch distributed training from a notebook cell or a script.

``import sparktrain`` is cheap: it imports neither torch nor any optional engine (pyspark, ray,
mlflow, deepspeed, tensorflow). Public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sparktrain.ground.errors import (
    CapacityError as CapacityError,
)
from sparktrain.ground.errors import (
    CheckpointError as CheckpointError,
)
from sparktrain.ground.errors import (
    ClusterConfigError as ClusterConfigError,
)
from sparktrain.ground.errors import (
    ClusterError as ClusterError,
)
from sparktrain.ground.errors import (
    ConfigError as ConfigError,
)
from sparktrain.ground.errors import (
    HangError as HangError,
)
from sparktrain.ground.errors import (
    RankFailure as RankFailure,
)
from sparktrain.ground.errors import (
    SparkJobError as SparkJobError,
)
from sparktrain.ground.errors import (
    TrainingFailedError as TrainingFailedError,
)
from sparktrain.ground.errors import (
    TrainingTimeoutError as TrainingTimeoutError,
)
from sparktrain.ground.version import __version__ as __version__

if TYPE_CHECKING:
    from sparktrain import checkpoint as checkpoint
    from sparktrain import elastic as elastic
    from sparktrain import tuning as tuning
    from sparktrain.backends.local_cluster.cluster import LocalCluster as LocalCluster
    from sparktrain.compat.decorator import distributed as distributed
    from sparktrain.compat.deepspeed_distributor import (
        DeepspeedTorchDistributor as DeepspeedTorchDistributor,
    )
    from sparktrain.compat.horovod_runner import HorovodRunner as HorovodRunner
    from sparktrain.compat.tensorflow_runner import MirroredStrategyRunner as MirroredStrategyRunner
    from sparktrain.compat.torch_distributor import TorchDistributor as TorchDistributor
    from sparktrain.contract.env import restart_count as restart_count
    from sparktrain.driver.inplace import preempt as preempt
    from sparktrain.driver.launch import launch as launch
    from sparktrain.driver.results import Rescale as Rescale
    from sparktrain.driver.results import RunResult as RunResult
    from sparktrain.launchplan.layout import LaunchPlan as LaunchPlan
    from sparktrain.launchplan.options import RunOptions as RunOptions
    from sparktrain.node.warm import shutdown as shutdown_warm  # noqa: F401 - in _LAZY
    from sparktrain.planner import plan as plan
    from sparktrain.rank.reporting import progress as progress
    from sparktrain.rank.reporting import report as report
    from sparktrain.strategies import (
        backward as backward,
    )
    from sparktrain.strategies import (
        deepspeed_config as deepspeed_config,
    )
    from sparktrain.strategies import (
        forward_backward as forward_backward,
    )
    from sparktrain.strategies import (
        full_state_dict as full_state_dict,
    )
    from sparktrain.strategies import (
        prepare_data_loader as prepare_data_loader,
    )
    from sparktrain.strategies import (
        prepare_model as prepare_model,
    )
    from sparktrain.strategies import (
        prepare_optimizer as prepare_optimizer,
    )
    from sparktrain.tracking import (
        log_metrics as log_metrics,
    )
    from sparktrain.tracking import (
        log_model as log_model,
    )
    from sparktrain.tracking import (
        log_params as log_params,
    )
    from sparktrain.tuning import tune as tune

#: Every public name loaded on first use: name -> (module, attribute); ``("sparktrain", x)`` is
#: the submodule ``x``. The one place a public name is declared: ``__all__`` is made from it, and
#: ``tests/test_imports.py`` checks that the ``TYPE_CHECKING`` imports above name the same.
_LAZY: dict[str, tuple[str, str]] = {
    "checkpoint": ("sparktrain", "checkpoint"),
    "elastic": ("sparktrain", "elastic"),
    "tuning": ("sparktrain", "tuning"),
    "distributed": ("sparktrain.compat.decorator", "distributed"),
    "DeepspeedTorchDistributor": (
        "sparktrain.compat.deepspeed_distributor",
        "DeepspeedTorchDistributor",
    ),
    "HorovodRunner": ("sparktrain.compat.horovod_runner", "HorovodRunner"),
    "MirroredStrategyRunner": ("sparktrain.compat.tensorflow_runner", "MirroredStrategyRunner"),
    "TorchDistributor": ("sparktrain.compat.torch_distributor", "TorchDistributor"),
    "restart_count": ("sparktrain.contract.env", "restart_count"),
    "preempt": ("sparktrain.driver.inplace", "preempt"),
    "launch": ("sparktrain.driver.launch", "launch"),
    "LocalCluster": ("sparktrain.backends.local_cluster.cluster", "LocalCluster"),
    "Rescale": ("sparktrain.driver.results", "Rescale"),
    "RunResult": ("sparktrain.driver.results", "RunResult"),
    "LaunchPlan": ("sparktrain.launchplan.layout", "LaunchPlan"),
    "RunOptions": ("sparktrain.launchplan.options", "RunOptions"),
    "shutdown_warm": ("sparktrain.node.warm", "shutdown"),
    "plan": ("sparktrain.planner", "plan"),
    "progress": ("sparktrain.rank.reporting", "progress"),
    "report": ("sparktrain.rank.reporting", "report"),
    "backward": ("sparktrain.strategies", "backward"),
    "deepspeed_config": ("sparktrain.strategies", "deepspeed_config"),
    "forward_backward": ("sparktrain.strategies", "forward_backward"),
    "full_state_dict": ("sparktrain.strategies", "full_state_dict"),
    "prepare_data_loader": ("sparktrain.strategies", "prepare_data_loader"),
    "prepare_model": ("sparktrain.strategies", "prepare_model"),
    "prepare_optimizer": ("sparktrain.strategies", "prepare_optimizer"),
    "log_metrics": ("sparktrain.tracking", "log_metrics"),
    "log_model": ("sparktrain.tracking", "log_model"),
    "log_params": ("sparktrain.tracking", "log_params"),
    "tune": ("sparktrain.tuning", "tune"),
}

_ERRORS = [
    "CapacityError",
    "CheckpointError",
    "ClusterConfigError",
    "ClusterError",
    "ConfigError",
    "HangError",
    "RankFailure",
    "SparkJobError",
    "TrainingFailedError",
    "TrainingTimeoutError",
]
__all__ = ["__version__", *_ERRORS, *_LAZY]  # noqa: PLE0604 - made from the two tables


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
