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
- Every run option of :func:`sparktrain.launch` is a keyword here too (``timeout=``,
  ``max_restarts=``, ``hang_timeout=``, ...). The layout is made and checked in the constructor,
  and every ``run`` uses that same plan.
- As pyspark's, the constructor does not depend on the cluster's size now:
  ``TorchDistributor(100, local_mode=False)`` constructs on a cluster of two slots. Each ``run``
  counts the free task slots first; where the cluster can grow (dynamic allocation, Databricks
  autoscaling) it waits for them up to a bound, saying so in one line
  (:mod:`sparktrain.backends.spark.slots`), and a run whose tasks still do not fit is refused with
  a :class:`~sparktrain.ClusterConfigError` naming the number asked for, the slots and the fix.
"""

from __future__ import annotations

from typing import Any, ClassVar

from typing_extensions import Unpack

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, for_local_mode
from sparktrain.driver.launch import PreparedLaunch, prepare
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.front import TORCH_DISTRIBUTOR, FrontDoor
from sparktrain.launchplan.option_docs import OPTIONS_MARK, documents_options
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs, run_options


class TorchDistributor:
    """Run a PyTorch training function or script on several processes."""

    #: What messages call the number of ranks (subclasses use their own parameter's name).
    count_name: ClassVar[str] = "num_processes"
    #: The original's differences this front door keeps (its TLS-override conf).
    front_door: ClassVar[FrontDoor] = TORCH_DISTRIBUTOR

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's ``__init__`` lists every run option where its docstring has the mark.

        A user's subclass without the mark is left as it is.
        """
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and OPTIONS_MARK in (init.__doc__ or ""):
            documents_options(init)

    @documents_options
    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool | None = None,
        *,
        backend: BackendName | Backend | None = None,
        ray_address: str | None = None,
        options: RunOptions | None = None,
        **option_args: Unpack[RunOptionsArgs],
    ) -> None:
        """Describe the run; input is checked, and the ranks laid out, here.

        Args:
            num_processes: Number of ranks (on GPU: number of GPUs used).
            local_mode: ``True`` runs every rank on this machine; ``False`` runs them as barrier
                tasks on the active SparkSession's executors (one rank per task on CPU, one per
                GPU of a task on GPU).
            use_gpu: ``True``, ``False``, or ``None`` for GPUs when CUDA is available.
            backend: Where the ranks run; ``None`` follows ``local_mode`` (``"local"`` or
                ``"spark"``). ``"ray"``: one actor per node of a Ray cluster; ``local_mode``
                is then not used.
            ray_address: With ``backend="ray"``: the cluster to join when this process has
                no Ray initialised (``None``: ``RAY_ADDRESS``, else a local Ray).
            options: A :class:`~sparktrain.launchplan.options.RunOptions` to start from.
            **option_args: Run options by name (:class:`~sparktrain.RunOptions`):

                {run_options}

        Raises:
            ConfigError: A value is out of range, or the ranks cannot fit (more GPUs than this
                machine has); the message says what to pass. A cluster's free task slots are
                counted at each run, not here.
        """
        if not isinstance(local_mode, bool):
            raise ConfigError(f"local_mode={local_mode!r} must be True or False.")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.backend = for_local_mode(local_mode, backend)
        self.options = run_options(options, **option_args)
        self.prepared: PreparedLaunch = prepare(
            num_processes,
            use_gpu=use_gpu,
            backend=self.backend,
            ray_address=ray_address,
            options=self.options,
            name=self.count_name,
            front=self.front_door,
            room_at_run=True,
        )
        self.plan = self.prepared.plan
        tasks = self.prepared.backend.tasks(self.plan)
        #: The constructor's values, as pyspark's ``input_params`` holds them.
        self.input_params: dict[str, Any] = {
            "num_processes": self.prepared.target,
            "local_mode": local_mode,
            "use_gpu": use_gpu,
            "num_tasks": tasks,
        }

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
            ClusterConfigError: On a cluster, the ranks' tasks outnumber the free task slots
                (after a wait where the cluster can grow); nothing was started.
            TrainingFailedError: A rank failed; the message names it with its traceback.
        """
        return self.prepared.run(main, args, kwargs).value

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
        return self.prepared.run(main, args, kwargs, dataframe=df).value
