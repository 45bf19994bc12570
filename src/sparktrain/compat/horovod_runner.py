"""``HorovodRunner``, call-compatible with Databricks' ``sparkdl.HorovodRunner``.

``HorovodRunner(np=4).run(train_hvd, **kwargs)`` keeps the real runner's meaning of ``np``:

- ``np > 0``: ``np`` ranks as barrier tasks of the active SparkSession;
- ``np < 0``: ``-np`` ranks on this machine (the driver), the runner's debug mode;
- ``np = 0``: every task slot of the cluster (every GPU of a GPU cluster).

(Some articles say ``np=-1`` uses every GPU of the cluster; with the real runner it starts one
local process, and so it does here, so that existing notebooks behave as before.)

Inside the ranks, ``import horovod.torch as hvd`` gives :mod:`sparktrain.horovod.torch` when
Horovod is not installed, so ``hvd.init()``, ``hvd.DistributedOptimizer`` and
``hvd.broadcast_parameters`` run unchanged on ``torch.distributed``. The function travels as
pickled bytes inside :func:`sparktrain.rank.horovod_alias.run_with_alias`, which installs that alias
before unpickling it. Errors, logs and return values are those of :class:`TorchDistributor`:
rank 0's value comes back, a failure names the rank that failed first.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import Unpack

from sparktrain.backends.base import Backend, Wanted
from sparktrain.backends.registry import BackendName, backend_class, make_backend
from sparktrain.contract import pickling
from sparktrain.driver.launch import PreparedLaunch, prepare
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.entrypoint import make_entrypoint
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs, run_options
from sparktrain.rank.horovod_alias import run_with_alias

Verbosity = Literal["all", "log_callback_only"]


def _where(np: int, backend: BackendName | Backend | None, wanted: Wanted) -> Backend:
    """The backend of ``np``: this machine for ``np < 0``, else ``backend`` (Spark by default).

    What the backend can do is asked of its class before one is made (a Ray is not started to
    be refused).

    Raises:
        ConfigError: ``backend`` cannot span nodes (``np > 0`` runs on a cluster) or count its
            slots (``np=0``), or the default Spark has no active SparkSession (the message says
            to pass ``np < 0``).
    """
    named = "local" if np < 0 else ("spark" if backend is None else backend)
    kind = backend_class(named)
    if np >= 0 and not kind.multi_node:
        raise ConfigError(
            f"backend={backend!r}: HorovodRunner runs np>0 processes on 'spark' (the default) "
            "or 'ray'; np<0 runs them on this machine."
        )
    if np == 0 and not kind.counts_slots():
        raise ConfigError(
            f"np=0 uses every task slot of a Spark cluster; with backend={backend!r}, pass the "
            "number of processes, e.g. np=4."
        )
    try:
        return make_backend(named, wanted)
    except ConfigError:
        if backend is not None or np < 0:
            raise
        raise ConfigError(
            f"np={np} runs on the Spark cluster, which needs an active SparkSession; create one "
            f"first, or pass np={-max(np, 1)} to run {max(np, 1)} process(es) on this machine."
        ) from None


class HorovodRunner:
    """Run a Horovod training function on ``np`` processes (Databricks' signature)."""

    @documents_options
    def __init__(
        self,
        np: int,
        driver_log_verbosity: Verbosity = "all",
        *,
        use_gpu: bool | None = None,
        backend: BackendName | Backend | None = None,
        ray_address: str | None = None,
        options: RunOptions | None = None,
        **option_args: Unpack[RunOptionsArgs],
    ) -> None:
        """Describe the run; input is checked, and the ranks laid out, here.

        Args:
            np: ``> 0``: that many ranks on the cluster; ``< 0``: ``-np`` ranks on this
                machine; ``0``: every task slot (or GPU) of the Spark cluster.
            driver_log_verbosity: ``"all"`` shows every rank's output; ``"log_callback_only"``
                shows rank 0's only (there is no separate log callback here). An explicit
                ``log_ranks=`` wins.
            use_gpu: ``True``, ``False``, or ``None`` for GPUs when there are some (sparktrain's
                addition; Databricks decides from the cluster).
            backend: The cluster of ``np > 0``: ``"spark"`` (the default), ``"ray"``, or a
                backend object whose ranks may span nodes.
            ray_address: With ``backend="ray"``: the cluster to join.
            options: A :class:`~sparktrain.launchplan.options.RunOptions` to start from.
            **option_args: Run options by name (:class:`~sparktrain.RunOptions`):

                {run_options}

        Raises:
            ConfigError: ``np`` is not an int, a bad verbosity, or the layout does not fit.
        """
        if isinstance(np, bool) or not isinstance(np, int):
            raise ConfigError(
                f"np={np!r} ({type(np).__name__}) must be an int: np>0 runs np processes on "
                "the Spark cluster, np<0 runs -np processes on this machine, np=0 uses every "
                "task slot of the cluster."
            )
        if driver_log_verbosity not in ("all", "log_callback_only"):
            raise ConfigError(
                f"driver_log_verbosity={driver_log_verbosity!r} must be 'all' or "
                "'log_callback_only'."
            )
        self.np = np
        self.driver_log_verbosity = driver_log_verbosity
        if driver_log_verbosity == "log_callback_only" and "log_ranks" not in option_args:
            option_args["log_ranks"] = (0,)
        self.options = run_options(options, **option_args)
        where = _where(np, backend, Wanted(address=ray_address))
        try:
            processes = -np if np < 0 else (np or where.every_slot(use_gpu) or 0)
            self.prepared: PreparedLaunch = prepare(
                processes,
                use_gpu=use_gpu,
                backend=where,
                options=self.options,
                name="-np" if np < 0 else "np",
            )
        except BaseException:
            if where is not backend:  # made here: what it started is ours to stop
                where.close()
            raise
        self.num_processes = processes

    def run(self, main: Any, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every rank and return rank 0's value.

        Args:
            main: The training function; ``import horovod.torch as hvd`` works inside it (or
                at the top of its module) without Horovod installed.
            **kwargs: Keyword arguments for ``main``.

        Returns:
            Rank 0's return value.

        Raises:
            ConfigError: ``main`` is not a function, or it or its arguments do not pickle.
            TrainingFailedError: A rank failed; the message names it with its traceback.
        """
        if not callable(main):
            raise ConfigError(f"main={main!r} must be the training function (a callable)")
        make_entrypoint(main, (), kwargs)  # names what does not pickle, before anything starts
        payload = pickling.dumps((main, (), kwargs))
        return self.prepared.run(run_with_alias, (payload,)).value
