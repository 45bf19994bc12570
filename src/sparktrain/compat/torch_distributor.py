"""``TorchDistributor``, call-compatible with ``pyspark.ml.torch.distributor.TorchDistributor``.

Same positional order and meaning: ``TorchDistributor(num_processes, local_mode, use_gpu)`` and
``.run(main, *args, **kwargs)``. Differences, each on purpose:

- ``use_gpu=None`` (our default) means GPUs when CUDA is available, else CPU with gloo;
  ``use_gpu=True`` without a GPU, or with fewer GPUs than processes, is an error, not pyspark's
  silent fallback.
- ``run`` returns rank 0's value (pyspark's local mode returns whichever rank wrote last), and a
  failing script raises instead of returning ``None``.
- No SparkSession is needed in local mode.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sparktrain.errors import ConfigError
from sparktrain.launcher import launch
from sparktrain.layout import LaunchPlan, make_plan
from sparktrain.topology import detect_local


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
    ) -> None:
        """Describe the run; input is checked here, before anything starts.

        Args:
            num_processes: Number of ranks (on GPU: number of GPUs used).
            local_mode: ``True`` runs every rank on this machine. ``False`` (a Spark cluster)
                is not available in this version and raises :class:`ConfigError`.
            use_gpu: ``True``, ``False``, or ``None`` for GPUs when CUDA is available.
            timeout: Seconds after which the run is stopped (``None``: no limit).
            log_ranks: Ranks whose output is shown (``None``: all).

        Raises:
            ConfigError: A value is out of range; the message says what to pass.
        """
        if not isinstance(local_mode, bool):
            raise ConfigError(f"local_mode={local_mode!r} must be True or False.")
        if not local_mode:
            raise ConfigError(
                "local_mode=False runs the ranks on a Spark cluster, which this version of "
                "sparktrain does not support yet; pass local_mode=True to run on this machine."
            )
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.timeout = timeout
        self.log_ranks = log_ranks
        self._topology = detect_local(gpus=use_gpu is not False)
        self.plan: LaunchPlan = make_plan(
            num_processes,
            topology=self._topology,
            use_gpu=use_gpu,
            timeout=timeout,
            log_ranks=log_ranks,
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
        result = launch(
            main,
            args,
            kwargs,
            num_processes=self.num_processes,
            use_gpu=self.use_gpu,
            timeout=self.timeout,
            log_ranks=self.log_ranks,
            topology=self._topology,
        )
        return result.value
