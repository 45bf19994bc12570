"""``horovod.run(func, args, kwargs, num_proc)``: every rank's value, in rank order (a front door).

Horovod's interactive front door starts ``num_proc`` processes (``np=`` before Horovod 0.25,
still accepted), runs ``func(*args, **kwargs)`` in each and returns the list of their return
values, indexed by rank. Here the processes are one sparktrain launch on this machine (or on
``backend="spark"``/``"ray"``), with the ``horovod`` alias installed before the function is
unpickled, so code written for ``import horovod.torch as hvd`` runs unchanged; a failure raises
:class:`~sparktrain.TrainingFailedError` (a ``RuntimeError``, as Horovod's is) naming the rank.

Horovod's options for hosts, SSH, MPI and elastic bounds do not apply to a launch and are
refused by name; options that only tune Horovod's own launcher are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparktrain.contract import pickling
from sparktrain.errors import ConfigError
from sparktrain.horovod.alias import run_with_alias
from sparktrain.launchplan.options import NAMES, documents_options

#: Horovod launcher settings with no meaning here, accepted and ignored.
IGNORED = frozenset(
    {"verbose", "use_gloo", "disable_cache", "network_interface", "network_interfaces",
     "start_timeout", "executable", "output_filename"}
)  # fmt: skip


@documents_options
def run(
    func: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    np: int | None = None,
    use_gpu: bool | None = None,
    backend: str = "local",
    ray_address: str | None = None,
    **options: Any,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks; their values in rank order.

    Args:
        func: The function every rank runs.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        num_proc: How many ranks (Horovod's default: 1).
        np: The same, by its name before Horovod 0.25.
        use_gpu: ``True``, ``False`` or ``None`` (GPUs where there are some).
        backend: ``"local"`` (Horovod's default: this machine), ``"spark"`` or ``"ray"``.
        ray_address: With ``backend="ray"``: the cluster to join.
        **options: Horovod's launcher settings (ignored where meaningless, refused where they
            cannot apply), and sparktrain's run options by name
            (:class:`~sparktrain.RunOptions`):

            {run_options}

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        ConfigError: A bad argument, or a Horovod option that does not apply.
        TrainingFailedError: A rank failed; names it, with its traceback.
    """
    from sparktrain.driver.launch import launch

    if np is not None and num_proc is not None and np != num_proc:
        raise ConfigError(f"horovod.run got num_proc={num_proc} and np={np}; pass one.")
    count = np if np is not None else (1 if num_proc is None else num_proc)
    horovod = {k: v for k, v in options.items() if k not in NAMES}
    refused = sorted(k for k, v in horovod.items() if k not in IGNORED and v is not None)
    if refused:
        raise ConfigError(
            f"horovod.run({refused[0]}=...) does not apply here: sparktrain starts the ranks "
            "itself (on this machine, or backend='spark'/'ray'), without hosts, SSH, MPI or "
            "Horovod's elastic bounds. Leave it out; min_processes= makes the run elastic "
            "(docs/elastic.md), max_restarts= restarts a failed group."
        )
    if not callable(func):
        raise ConfigError(f"horovod.run(func={func!r}): func must be a function.")
    try:
        payload = pickling.dumps((func, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise ConfigError(f"horovod.run: func or its arguments cannot be pickled: {exc}") from exc
    result = launch(
        run_with_alias, (payload,), num_processes=count, use_gpu=use_gpu, backend=backend,
        ray_address=ray_address, return_all=True,
        **{k: v for k, v in options.items() if k in NAMES},
    )  # fmt: skip
    return [result.return_values[rank] for rank in range(count)]
