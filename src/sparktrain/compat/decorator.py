"""``@sparktrain.distributed``: the decorator front door of the Serverless GPU API's shape.

Databricks' Serverless GPU Python API decorates a function (``@distributed(gpus=8,
gpu_type="H100", remote=True)``) and runs it with ``fn.distributed(...)``, which returns every
process's result. Here::

    @sparktrain.distributed(num_processes=2, use_gpu=False, max_restarts=1)
    def train(lr):
        ...
        return loss

    train(0.1)                 # the function itself, in this process
    train.distributed(0.1)     # every rank, through the same launch: [loss of rank 0, rank 1]

The arguments are checked when the decorator is applied (counts, ``use_gpu``, the backend's
name, every run option, and the Serverless API's own names, which are refused with what to
pass instead), so a typo fails where it is written, not at the first run. The ranks are laid
out at each ``distributed`` call, on the cluster as it is then. Logs, errors naming the failed
rank, the progress bar, MLflow and restarts are those of every front door.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar, overload

from typing_extensions import ParamSpec, Unpack

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, check_backend
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.front import FrontDoor
from sparktrain.launchplan.layout import check_count, check_use_gpu
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import RunOptions, RunOptionsArgs, run_options

P = ParamSpec("P")
R = TypeVar("R")

DECORATOR = FrontDoor("sparktrain.distributed")

#: The Serverless GPU API's arguments, and what to pass here instead.
_SERVERLESS = {
    "gpus": "num_processes=N, use_gpu=True",
    "gpu_type": "nothing: the GPUs are those of the machine or cluster the ranks run on",
    "remote": "backend='spark' (or 'ray') to run on a cluster; the default runs here",
}


@dataclass(eq=False, repr=False)
class DistributedFunction(Generic[P, R]):
    """A function that runs as itself when called, and on every rank with :meth:`distributed`.

    The decorator makes one (its arguments already checked).

    Attributes:
        fn: The function.
        num_processes: The ranks of each :meth:`distributed` run.
        use_gpu: ``True``, ``False`` or ``None`` (GPUs where there are some).
        backend: ``"local"``, ``"spark"``, ``"ray"`` or a ``Backend``.
        ray_address: With ``backend="ray"``: the cluster to join.
        options: The run options.
    """

    fn: Callable[P, R]
    _: KW_ONLY
    num_processes: int
    use_gpu: bool | None
    backend: BackendName | Backend
    ray_address: str | None
    options: RunOptions

    def __post_init__(self) -> None:
        functools.update_wrapper(self, self.fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function itself, in this process."""
        return self.fn(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run the function on every rank; every rank's return value, in rank order.

        Raises:
            ConfigError: The ranks do not fit, or an argument does not pickle.
            TrainingFailedError: A rank failed; the message names it with its traceback.
        """
        from sparktrain.driver.launch import prepare

        prepared = prepare(
            self.num_processes,
            use_gpu=self.use_gpu,
            backend=self.backend,
            ray_address=self.ray_address,
            options=self.options,
            front=DECORATOR,
        )
        result = prepared.run(self.fn, args, kwargs)
        return [result.return_values[rank] for rank in range(result.world_size)]

    def __repr__(self) -> str:
        return (
            f"<sparktrain.distributed {getattr(self.fn, '__qualname__', self.fn)!r}: "
            f"{self.num_processes} ranks, backend={self.backend!r}>"
        )


@overload
def distributed(fn: Callable[P, R], /) -> DistributedFunction[P, R]: ...


@overload
def distributed(
    fn: None = None,
    /,
    *,
    num_processes: int = 1,
    use_gpu: bool | None = None,
    backend: BackendName | Backend = "local",
    ray_address: str | None = None,
    options: RunOptions | None = None,
    **option_args: Unpack[RunOptionsArgs],
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]: ...


@documents_options
def distributed(
    fn: Callable[P, R] | None = None,
    /,
    *,
    num_processes: int = 1,
    use_gpu: bool | None = None,
    backend: BackendName | Backend = "local",
    ray_address: str | None = None,
    options: RunOptions | None = None,
    **option_args: Any,
) -> Any:
    """Decorate a function so that ``fn.distributed(...)`` runs it on every rank.

    Args:
        fn: The function, when the decorator is used bare (``@sparktrain.distributed``).
        num_processes: Ranks per run.
        use_gpu: ``True`` (one GPU per rank), ``False`` (CPU, gloo), ``None`` (GPUs if any).
        backend: ``"local"`` (this machine), ``"spark"`` (barrier tasks of the active
            SparkSession), ``"ray"``, or a ``Backend``.
        ray_address: With ``backend="ray"``: the cluster to join.
        options: A :class:`~sparktrain.RunOptions` to start from.
        **option_args: Run options by name (:class:`~sparktrain.RunOptions`; ``return_all``
            does not apply, ``fn.distributed()`` returns every rank's value):

            {run_options}

    Returns:
        A :class:`DistributedFunction` (or, with arguments, the decorator that makes one).

    Raises:
        ConfigError: A bad argument, named with the fix, when the decorator is applied.
    """
    serverless = sorted(set(option_args) & set(_SERVERLESS))
    if serverless:
        name = serverless[0]
        raise ConfigError(
            f"{name}= is the Serverless GPU API's argument; sparktrain.distributed takes "
            f"{_SERVERLESS[name]}."
        )
    if "return_all" in option_args:
        raise ConfigError("return_all= does not apply: fn.distributed() returns every rank's.")
    check_count("num_processes", num_processes)
    check_use_gpu(use_gpu)
    check_backend(backend)
    checked = run_options(options, **option_args, return_all=True)

    def wrap(target: Callable[P, R]) -> DistributedFunction[P, R]:
        if not callable(target):
            raise ConfigError(f"sparktrain.distributed decorates a function, not {target!r}.")
        return DistributedFunction(
            target, num_processes=num_processes, use_gpu=use_gpu, backend=backend,
            ray_address=ray_address, options=checked,
        )  # fmt: skip

    return wrap(fn) if fn is not None else wrap
