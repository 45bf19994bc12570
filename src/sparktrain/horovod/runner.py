"""``horovod.run(func, args, kwargs, num_proc)``: every rank's value, in rank order (a front door).

Horovod's interactive front door starts ``num_proc`` processes (``np=`` before Horovod 0.25,
still accepted), runs ``func(*args, **kwargs)`` in each and returns the list of their return
values, indexed by rank. Here the processes are one sparktrain launch on this machine (or on
``backend="spark"``/``"ray"``), with the ``horovod`` alias installed before the function is
unpickled, so code written for ``import horovod.torch as hvd`` runs unchanged; a failure raises
:class:`~sparktrain.TrainingFailedError` (a ``RuntimeError``, as Horovod's is) naming the rank.

Horovod's options are taken at their defaults and at values that ask for nothing more:
``use_gloo`` (any value: the collectives run on gloo or NCCL), ``use_mpi=False``, ``hosts`` that
name only this machine with enough slots (Horovod's default is ``localhost:<num_proc>``), and
every option that only tunes Horovod's own launcher (``verbose``, ``start_timeout``, ...),
ignored. A value that asks for what a launch cannot do (other hosts, a host file, MPI, SSH,
Horovod's elastic bounds) is refused by name with what to do instead
(:func:`check_horovod_options`, a pure check), so Horovod's own examples run unchanged:
``pytorch_mnist.py --num-proc 2`` passes ``hosts=None, use_gloo=False, use_mpi=False``.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, backend_class
from sparktrain.contract import pickling
from sparktrain.ground.errors import ConfigError
from sparktrain.launchplan.option_docs import documents_options
from sparktrain.launchplan.options import NAMES
from sparktrain.rank.horovod_alias import run_with_alias

#: Horovod launcher settings with no meaning here, accepted and ignored whatever their value.
IGNORED = frozenset(
    {"verbose", "use_gloo", "disable_cache", "network_interface", "network_interfaces",
     "start_timeout", "executable", "output_filename"}
)  # fmt: skip
#: The names under which a ``hosts`` entry means this machine.
THIS_MACHINE = frozenset({"localhost", "127.0.0.1", "::1"})
_REFUSED = (
    "sparktrain starts the ranks itself (on this machine, or backend='spark'/'ray'), without "
    "hosts, SSH, MPI or Horovod's elastic bounds. Leave it out; min_processes= makes the run "
    "elastic (docs/elastic.md), max_restarts= restarts a failed group."
)
_NO_MPI = (
    "sparktrain's horovod runs its collectives on torch.distributed (gloo on CPUs, NCCL on "
    "GPUs), never on MPI: hvd.mpi_built() is False, as in a Horovod built without MPI. Leave "
    "use_mpi out, or pass use_mpi=False."
)
_ELSEWHERE = (
    "sparktrain does not start ranks over SSH: leave it out to run on this machine, or pass "
    "backend='spark' (the active SparkSession's executors) or backend='ray' to run on several."
)


def _refuse(name: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"horovod.run({name}=...) does not apply here: {name}={value!r}; {why}")


def _check_hosts(hosts: object, count: object, backend: object) -> None:
    """Accept ``hosts`` that name only this machine, with ``count`` slots or more, on "local"."""
    if not isinstance(hosts, str):
        raise _refuse("hosts", hosts, "pass a string such as 'localhost:2', or leave it out.")
    entries = [entry.strip().rpartition(":") for entry in hosts.split(",") if entry.strip()]
    others = sorted({name or slots for name, _, slots in entries} - THIS_MACHINE)
    others = [name for name in others if name != socket.gethostname()]
    if others:
        raise _refuse("hosts", hosts, f"it names other hosts ({', '.join(others)}); {_ELSEWHERE}")
    if not backend_class(backend).on_this_machine:
        why = f"it names this machine, but backend={backend!r} runs elsewhere; leave it out."
        raise _refuse("hosts", hosts, why)
    if not all(slots.isdigit() for _, _, slots in entries):
        raise _refuse("hosts", hosts, "each entry is host:slots, e.g. 'localhost:2'.")
    slots = sum(int(slots) for _, _, slots in entries)
    if isinstance(count, int) and slots < count:
        why = (
            f"{slots} slot(s) for num_proc={count}; pass hosts='localhost:{count}', or leave "
            "hosts out (Horovod's default is localhost:<num_proc>)."
        )
        raise _refuse("hosts", hosts, why)


def check_horovod_options(options: Mapping[str, Any], count: object, backend: object) -> None:
    """Accept Horovod's launcher options at harmless values; refuse the rest by name.

    Args:
        options: Horovod's options as the caller passed them (sparktrain's run options left out).
        count: The number of ranks asked for.
        backend: Where the ranks run (a backend's name, or the backend).

    Raises:
        ConfigError: An option asks for what a launch cannot do; names it, its value and the fix.
    """
    for name, value in sorted(options.items()):
        if name in IGNORED or value is None:
            continue
        if name == "use_mpi":
            if value:
                raise _refuse(name, value, _NO_MPI)
        elif name == "hosts":
            _check_hosts(value, count, backend)
        elif name == "hostfile":
            raise _refuse(name, value, f"a host file lists hosts; {_ELSEWHERE}")
        else:
            raise _refuse(name, value, _REFUSED)


@documents_options
def run(
    func: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    np: int | None = None,
    use_gpu: bool | None = None,
    backend: BackendName | Backend = "local",
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
        **options: Horovod's launcher settings (accepted at their defaults and harmless
            values, refused where they ask for what a launch cannot do), and sparktrain's run
            options by name (:class:`~sparktrain.RunOptions`):

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
    check_horovod_options({k: v for k, v in options.items() if k not in NAMES}, count, backend)
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
