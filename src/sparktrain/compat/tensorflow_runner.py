"""``MirroredStrategyRunner``, call-compatible with spark-tensorflow-distributor's.

``MirroredStrategyRunner(num_slots, local_mode=False, use_gpu=True, gpu_resource_name="gpu",
use_custom_strategy=False).run(train_fn, **kwargs)`` starts ``num_slots`` ranks through the same
``launch`` as the torch runners (same logs, same errors naming the failed rank, rank 0's value
back). Each rank is one worker of a ``tf.distribute.MultiWorkerMirroredStrategy`` cluster set up
through ``TF_CONFIG`` (see :mod:`sparktrain.compat.rank.tensorflow`); ``train_fn`` runs inside
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

from typing_extensions import Unpack

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, backend_class, for_local_mode
from sparktrain.compat.rank.tensorflow import run_worker
from sparktrain.contract import pickling
from sparktrain.driver.launch import PreparedLaunch, prepare
from sparktrain.ground.errors import ClusterConfigError, ConfigError
from sparktrain.launchplan.entrypoint import make_entrypoint
from sparktrain.launchplan.front import MIRRORED_STRATEGY_RUNNER
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs, run_options

_INSTALL = "pip install 'sparktrain[tensorflow]' (TensorFlow with tf-keras)"


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False.")


class MirroredStrategyRunner:
    """Run a TensorFlow function on ``num_slots`` workers of one MultiWorkerMirroredStrategy."""

    @documents_options
    def __init__(
        self,
        num_slots: int,
        local_mode: bool = False,
        use_gpu: bool = True,
        gpu_resource_name: str = "gpu",
        use_custom_strategy: bool = False,
        *,
        backend: BackendName | Backend | None = None,
        ray_address: str | None = None,
        options: RunOptions | None = None,
        **option_args: Unpack[RunOptionsArgs],
    ) -> None:
        """Describe the run; input is checked, and the workers laid out, here.

        Args:
            num_slots: Number of workers (one GPU each with ``use_gpu=True``, else one task
                slot or local process each).
            local_mode: ``True``: every worker on this machine; ``False``: barrier tasks of the
                active SparkSession.
            use_gpu: One GPU per worker (``True``) or CPU only (``False``).
            gpu_resource_name: Spark's GPU resource name; only ``"gpu"`` is supported.
            use_custom_strategy: ``True``: ``train_fn`` creates its own strategy; ``False``: it
                runs inside a ``MultiWorkerMirroredStrategy`` scope.
            backend: Where the workers run (``None``: follows ``local_mode``); sparktrain's
                addition, as for :class:`~sparktrain.TorchDistributor`.
            ray_address: With ``backend="ray"``: the cluster to join.
            options: A :class:`~sparktrain.launchplan.options.RunOptions` to start from.
            **option_args: Run options by name (:class:`~sparktrain.RunOptions`):

                {run_options}

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
        where = for_local_mode(local_mode, backend)
        if backend_class(where).on_this_machine and importlib.util.find_spec("tensorflow") is None:
            raise ConfigError(f"MirroredStrategyRunner needs TensorFlow: {_INSTALL}")
        self.num_slots = num_slots
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.gpu_resource_name = gpu_resource_name
        self.use_custom_strategy = use_custom_strategy
        self.options = run_options(options, **option_args)
        self.prepared: PreparedLaunch = prepare(
            num_slots,
            use_gpu=use_gpu,
            backend=where,
            ray_address=ray_address,
            options=self.options,
            name="num_slots",
            front=MIRRORED_STRATEGY_RUNNER,
        )

    @property
    def sc(self) -> Any:
        """The SparkContext, as the original holds it (its session is made if none exists)."""
        from pyspark.sql import SparkSession

        session = SparkSession.builder.getOrCreate()
        if type(session).__module__.startswith("pyspark.sql.connect"):
            raise ConfigError(
                "MirroredStrategyRunner.sc: a Spark Connect session has no SparkContext."
            )
        return session.sparkContext

    def get_num_tasks(self) -> int:
        """The Spark tasks a run on the cluster takes, as the original computes it.

        On GPUs: ``ceil(num_slots / spark.task.resource.gpu.amount)``, each task running one
        worker over its share of the GPUs; on CPUs: ``num_slots``.

        Raises:
            ClusterConfigError: ``use_gpu=True`` and ``spark.task.resource.gpu.amount`` is unset
                or below 1.
        """
        if not self.use_gpu:
            return self.num_slots
        key = f"spark.task.resource.{self.gpu_resource_name}.amount"
        conf = self.sc.getConf()
        if not conf.contains(key):
            raise ClusterConfigError(
                f"Your cluster might not have Spark GPU-aware scheduling enabled: the conf {key} "
                "was not found in the Spark configuration. Set it (for example to 1), or pass "
                "use_gpu=False."
            )
        amount = int(float(conf.get(key)))
        if amount < 1:
            raise ClusterConfigError(f"The Spark conf {key}={conf.get(key)} must be at least 1.")
        return -(-self.num_slots // amount)

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
        payload = pickling.dumps((train_fn, kwargs))
        barrier = self.prepared.backend.barrier_context
        args = (payload, self.use_custom_strategy, self.use_gpu, barrier)
        return self.prepared.run(run_worker, args).value
