"""``TorchDistributor``, call-compatible with ``pyspark.ml.torch.distributor.TorchDistributor``.

Same positional order and meaning: ``TorchDistributor(num_processes, local_mode, use_gpu)`` and
``.run(main, *args, **kwargs)``. Differences, each on purpose:

- ``use_gpu=None`` (our default) means GPUs when CUDA is available, else CPU with gloo;
  ``use_gpu=True`` without a GPU, or with fewer GPUs than processes, is an error, not pyspark's
  silent fallback.
- ``run`` returns rank 0's value (pyspark's local mode returns whichever rank wrote last), and a
  failing script raises instead of returning ``None``.
- No SparkSession is needed in local mode. With ``local_mode=False`` the ranks run as barrier
  tasks of the active SparkSession (classic or Spark Connect); its settings are checked here,
  before anything is submitted.
- ``backend="ray"`` (ours) runs the ranks on a Ray cluster instead, one actor per node.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from sparktrain.driver.launch import launch
from sparktrain.errors import ConfigError
from sparktrain.plan.layout import LaunchPlan, make_cluster_plan, make_plan
from sparktrain.plan.topology import detect_local


class TorchDistributor:
    """Run a PyTorch training function or script on several processes."""

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool | None = None,
        *,
        timeout: float | None = None,
        log_ranks: Collection[int] | None = None,
        max_restarts: int = 0,
        hang_timeout: float | None = None,
        mlflow: bool | None = None,
        mlflow_strict: bool = False,
        backend: Literal["local", "spark", "ray"] | None = None,
        ray_address: str | None = None,
    ) -> None:
        """Describe the run; input is checked here, before anything starts.

        Args:
            num_processes: Number of ranks (on GPU: number of GPUs used).
            local_mode: ``True`` runs every rank on this machine; ``False`` runs them as barrier
                tasks on the active SparkSession's executors (one rank per task on CPU, one per
                GPU of a task on GPU).
            use_gpu: ``True``, ``False``, or ``None`` for GPUs when CUDA is available.
            timeout: Seconds after which the run is stopped (``None``: no limit).
            log_ranks: Ranks whose output is shown (``None``: all).
            max_restarts: After a failure, restart the whole group up to this many times.
            hang_timeout: Seconds without progress (output or ``sparktrain.report()``) before
                the run is declared hung and each rank's waiting line is reported.
            mlflow: Track the run in MLflow (``None``: when the caller has an active run).
            mlflow_strict: Raise, instead of warning, when tracking cannot be used.
            backend: Where the ranks run; ``None`` follows ``local_mode`` (``"local"`` or
                ``"spark"``). ``"ray"``: one actor per node of a Ray cluster; ``local_mode``
                is then not used.
            ray_address: With ``backend="ray"``: the cluster to join when this process has
                no Ray initialised (``None``: ``RAY_ADDRESS``, else a local Ray).

        Raises:
            ConfigError: A value is out of range; the message says what to pass.
        """
        if not isinstance(local_mode, bool):
            raise ConfigError(f"local_mode={local_mode!r} must be True or False.")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.timeout = timeout
        self.log_ranks = log_ranks
        self.max_restarts = max_restarts
        self.hang_timeout = hang_timeout
        self.mlflow = mlflow
        self.mlflow_strict = mlflow_strict
        self._topology = None
        self.backend = backend or ("local" if local_mode else "spark")
        self.ray_address = ray_address
        if self.backend == "ray":
            from sparktrain.driver import ray

            self.plan: LaunchPlan = ray.plan_run(
                num_processes,
                address=ray_address,
                use_gpu=use_gpu,
                timeout=timeout,
                log_ranks=log_ranks,
                max_restarts=max_restarts,
                hang_timeout=hang_timeout,
            )
        elif self.backend not in ("local", "spark"):
            raise ConfigError(f"backend={backend!r} is not one of: local, spark, ray")
        elif self.backend == "local":
            self._topology = detect_local(gpus=use_gpu is not False)
            self.plan = make_plan(
                num_processes,
                topology=self._topology,
                use_gpu=use_gpu,
                timeout=timeout,
                log_ranks=log_ranks,
                max_restarts=max_restarts,
                hang_timeout=hang_timeout,
            )
        else:
            from sparktrain.driver import spark

            self.plan = make_cluster_plan(
                num_processes,
                facts=spark.cluster_facts(spark.active_session(), num_processes),
                use_gpu=use_gpu,
                timeout=timeout,
                log_ranks=log_ranks,
                max_restarts=max_restarts,
                hang_timeout=hang_timeout,
            )

    def run(self, main: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` on every rank and return rank 0's value.

        Args:
            main: A function, called as ``main(*args, **kwargs)`` on every rank; or the path of
                a Python script, run like ``torchrun main *args``.
            *args: Arguments for the function, or the script's command line.
            **kwargs: Keyword arguments for the function (an error with a script).

        Returns:
            Rank 0's return value (a DDP/FSDP-wrapped module comes back unwrapped); ``None``
            for a script.

        Raises:
            TrainingFailedError: A rank failed; the message names it with its traceback.
        """
        return self._launch(main, args, kwargs, None).value

    def train_on_dataframe(self, main: Any, df: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` with each rank's share of ``df``'s rows; return rank 0's value.

        Inside ``main``, ``sparktrain.data.rank_dataset()`` (or ``rank_dataloader(batch_size)``)
        gives the rank's rows as tensors. Every rank gets the same number of rows (shorter
        shares repeat rows), so every rank runs the same number of batches.

        Args:
            main: The training function, called as ``main(*args, **kwargs)`` on every rank.
            df: A Spark DataFrame of numeric, array or ML vector columns.
            *args: Arguments for ``main``.
            **kwargs: Keyword arguments for ``main``.

        Returns:
            Rank 0's return value.
        """
        if not callable(main):
            raise ConfigError(f"main={main!r} must be the training function for a DataFrame run.")
        return self._launch(main, args, kwargs, df).value

    def _launch(self, main: Any, args: Any, kwargs: Any, df: Any) -> Any:
        return launch(
            main,
            args,
            kwargs,
            num_processes=self.num_processes,
            use_gpu=self.use_gpu,
            timeout=self.timeout,
            log_ranks=self.log_ranks,
            max_restarts=self.max_restarts,
            hang_timeout=self.hang_timeout,
            mlflow=self.mlflow,
            mlflow_strict=self.mlflow_strict,
            topology=self._topology,
            backend=self.backend,
            dataframe=df,
            ray_address=self.ray_address,
        )
