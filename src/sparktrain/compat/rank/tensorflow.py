"""Inside a rank of :class:`~sparktrain.MirroredStrategyRunner`: one TensorFlow worker.

Each rank becomes worker ``RANK`` of one ``tf.distribute.MultiWorkerMirroredStrategy`` cluster,
described to TensorFlow by ``TF_CONFIG``. Design choices:

- **No port race.** TensorFlow's gRPC server binds the port named in ``TF_CONFIG`` itself and
  cannot be handed a socket. So each rank binds a free port with ``SO_REUSEPORT`` and keeps
  that socket (bound, never listening) until the function returns, and sets
  ``TF_GRPC_REUSE_PORT=true`` so that TensorFlow's server may bind the same port: no other
  process can take it in between, and connections only reach TensorFlow's listening socket.
- **Addresses travel through the run's store.** Every sparktrain rank can reach the TCPStore
  that rank 0 hosts (``MASTER_ADDR``/``MASTER_PORT``); each rank writes its ``host:port`` there
  and reads everyone's, so no extra server or Spark round trip is needed.
- **TensorFlow is imported here only**, in the rank, never in the fork server (which has
  imported torch and forks every rank).
- **Keras 2 by default.** Keras 3's ``model.fit`` fails under a multi-worker
  ``MultiWorkerMirroredStrategy`` ("Attempt to convert a value (PerReplica...)",
  keras-team/keras#20585). With ``tf-keras`` installed (the ``tensorflow`` extra brings it),
  the workers run ``TF_USE_LEGACY_KERAS=1``, so ``import tensorflow as tf; tf.keras`` is Keras 2,
  whose ``fit`` works; rank 0 says so once. A ``TF_USE_LEGACY_KERAS`` the user set (in the
  environment or ``env=``) is kept.
- **The original's barrier task.** On Spark, the function may call
  ``BarrierTaskContext.get()`` as it could in spark-tensorflow-distributor's barrier task
  (:mod:`sparktrain.compat.rank.barrier_context`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from typing import Any

import cloudpickle

from sparktrain.contract import env
from sparktrain.contract.env import contract_int, contract_rank
from sparktrain.rank.stores import contract_store

_PREFIX = "sparktrain/tf_worker/"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def reserve_port() -> socket.socket:
    """A TCP socket bound to a free port with ``SO_REUSEPORT``, not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", 0))
    return sock


def own_host(master: str) -> str:
    """This host's address on the route to ``master`` (loopback when ``master`` is)."""
    if master in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((master, 9))
        return str(probe.getsockname()[0])


def exchange(address: str, rank: int, world_size: int) -> list[str]:
    """Every rank's ``address``, in rank order, through the run's TCPStore."""
    store = contract_store()
    store.set(f"{_PREFIX}{rank}", address)
    return [bytes(store.get(f"{_PREFIX}{r}")).decode() for r in range(world_size)]


def tf_config(workers: list[str], index: int) -> str:
    """``TF_CONFIG`` for worker ``index`` of ``workers``."""
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def _import_tensorflow() -> Any:
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ImportError(
            f"MirroredStrategyRunner needs TensorFlow in every rank ({exc}): pip install "
            "'sparktrain[tensorflow]'."
        ) from exc
    return tf


def choose_keras(rank: int) -> str:
    """Set ``TF_USE_LEGACY_KERAS=1`` where tf-keras is installed and the user chose nothing.

    Returns what was chosen, and rank 0 prints it once: ``legacy`` (tf-keras), ``user`` (the
    user's setting kept) or ``keras3`` (tf-keras missing; ``fit`` may fail).
    """
    if "TF_USE_LEGACY_KERAS" in os.environ:
        return "user"
    if importlib.util.find_spec("tf_keras") is None:
        if rank == 0:
            print(
                "sparktrain: tf-keras is not installed, so the workers use Keras 3, whose "
                "model.fit fails under MultiWorkerMirroredStrategy (custom training loops "
                "work); pip install 'sparktrain[tensorflow]' brings tf-keras.",
                flush=True,
            )
        return "keras3"
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if rank == 0:
        print(
            "sparktrain: the workers use tf-keras (TF_USE_LEGACY_KERAS=1): Keras 3's model.fit "
            "fails under MultiWorkerMirroredStrategy. Pass env={'TF_USE_LEGACY_KERAS': '0'} for "
            "Keras 3.",
            flush=True,
        )
    return "legacy"


def run_worker(payload: bytes, use_custom_strategy: bool, use_gpu: bool, on_spark: bool) -> Any:
    """Set ``TF_CONFIG``, then run ``main(**kwargs)`` (inside the strategy's scope by default)."""
    rank, world_size = contract_rank(), contract_int("WORLD_SIZE", 1)
    reserved = reserve_port()
    try:
        host = own_host(env.contract_master_addr("127.0.0.1"))
        workers = exchange(f"{host}:{reserved.getsockname()[1]}", rank, world_size)
        os.environ["TF_CONFIG"] = tf_config(workers, rank)
        os.environ["TF_GRPC_REUSE_PORT"] = "true"
        if not use_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if on_spark:
            from sparktrain.compat.rank.barrier_context import install

            install(host)
        choose_keras(rank)
        tf = _import_tensorflow()
        main, kwargs = cloudpickle.loads(payload)
        if use_custom_strategy:
            return main(**kwargs)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            return main(**kwargs)
    finally:
        reserved.close()
