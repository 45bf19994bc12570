"""``MirroredStrategyRunner``, call-compatible with spark-tensorflow-distributor's.

``MirroredStrategyRunner(num_slots, local_mode=False, use_gpu=True, gpu_resource_name="gpu",
use_custom_strategy=False).run(train_fn, **kwargs)`` starts ``num_slots`` ranks through the same
``launch`` as the torch runners (same logs, same errors naming the failed rank, rank 0's value
back). Each rank is one worker of a ``tf.distribute.MultiWorkerMirroredStrategy`` cluster set up
through ``TF_CONFIG`` (see :mod:`sparktrain.compat.tensorflow_rank`); ``train_fn`` runs inside
the strategy's scope unless ``use_custom_strategy=True``, in which case it builds its own
strategy (``TF_CONFIG`` is set for it).

Differences, on purpose:

- ``local_mode=True`` starts ``num_slots`` worker processes on this machine (the original runs
  one process with ``MirroredStrategy`` over local GPUs), so that local mode tests the same
  multi-worker code that runs on the cluster, and works on CPU.
- ``use_gpu=True`` without GPUs is an error before anything starts, not a hang or a fallback.
- GPUs come from Spark's ``gpu`` resource (``spark.task.resource.gpu.amount``); another
  ``gpu_resource_name`` is an error.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import cloudpickle

from sparktrain.compat.tensorflow_rank import run_worker
from sparktrain.compat.torch_distributor import TorchDistributor
from sparktrain.errors import ConfigError
from sparktrain.plan.entrypoint import make_entrypoint

_INSTALL = "pip install 'sparktrain[tensorflow]' (tensorflow-cpu), or tensorflow on GPU machines"


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False.")


class MirroredStrategyRunner:
    """Run a TensorFlow function on ``num_slots`` workers of one MultiWorkerMirroredStrategy."""

    def __init__(
        self,
        num_slots: int,
        local_mode: bool = False,
        use_gpu: bool = True,
        gpu_resource_name: str = "gpu",
        use_custom_strategy: bool = False,
        *,
        timeout: float | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        """Describe the run; input is checked here, before anything starts.

        Args:
            num_slots: Number of workers (one GPU each with ``use_gpu=True``, else one task
                slot or local process each).
            local_mode: ``True``: every worker on this machine; ``False``: barrier tasks of the
                active SparkSession.
            use_gpu: One GPU per worker (``True``) or CPU only (``False``).
            gpu_resource_name: Spark's GPU resource name; only ``"gpu"`` is supported.
            use_custom_strategy: ``True``: ``train_fn`` creates its own strategy; ``False``: it
                runs inside a ``MultiWorkerMirroredStrategy`` scope.
            timeout: Seconds after which the run is stopped (sparktrain's addition).
            hang_timeout: Seconds without output before a hang is reported.

        Raises:
            ConfigError: A bad value, GPUs asked for but absent, TensorFlow missing locally.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(
                f"num_slots={num_slots!r} must be a positive int: the number of TensorFlow "
                "workers (one GPU each with use_gpu=True, one task slot each otherwise)."
            )
        for name, value in (
            ("local_mode", local_mode),
            ("use_gpu", use_gpu),
            ("use_custom_strategy", use_custom_strategy),
        ):
            _check_bool(name, value)
        if use_gpu and gpu_resource_name != "gpu":
            raise ConfigError(
                f"gpu_resource_name={gpu_resource_name!r}: sparktrain reads GPUs from Spark's "
                "'gpu' resource (spark.task.resource.gpu.amount); name the resource 'gpu' in "
                "the cluster configuration, or pass use_gpu=False."
            )
        if local_mode and importlib.util.find_spec("tensorflow") is None:
            raise ConfigError(f"MirroredStrategyRunner needs TensorFlow: {_INSTALL}")
        self.num_slots = num_slots
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.gpu_resource_name = gpu_resource_name
        self.use_custom_strategy = use_custom_strategy
        try:
            self._distributor = TorchDistributor(
                num_slots, local_mode, use_gpu, timeout=timeout, hang_timeout=hang_timeout
            )
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("num_processes", "num_slots")) from None

    def run(self, train_fn: Any, **kwargs: Any) -> Any:
        """Run ``train_fn(**kwargs)`` on every worker and return worker 0's value.

        Args:
            train_fn: The training function (Keras ``model.fit`` etc.).
            **kwargs: Keyword arguments for ``train_fn``.

        Returns:
            The value ``train_fn`` returned on worker 0 (the chief).

        Raises:
            ConfigError: ``train_fn`` is not callable or does not pickle.
            TrainingFailedError: A worker failed; the message names it with its traceback.
        """
        if not callable(train_fn):
            raise ConfigError(f"train_fn={train_fn!r} must be the training function")
        make_entrypoint(train_fn, (), kwargs)  # names what does not pickle, before starting
        payload = cloudpickle.dumps((train_fn, kwargs))
        return self._distributor.run(run_worker, payload, self.use_custom_strategy, self.use_gpu)
