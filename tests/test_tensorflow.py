"""MirroredStrategyRunner: a 2-worker Keras model on MultiWorkerMirroredStrategy, locally and on
Spark executors; TF_CONFIG, rank 0's value, early errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch

from sparktrain import ConfigError, MirroredStrategyRunner, TrainingFailedError

pytest.importorskip("tensorflow")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _train_keras(out_dir: str, custom: bool) -> dict[str, object]:
    """A Keras model trained by every worker. ``model.fit`` is not used: Keras 3 cannot fit
    under a multi-worker MultiWorkerMirroredStrategy (keras-team/keras#20585), so the loop is
    the custom one of TensorFlow's multi-worker tutorial."""
    import contextlib

    import keras
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if custom:
        assert not tf.distribute.has_strategy()
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        scope: contextlib.AbstractContextManager[object] = strategy.scope()
    else:
        strategy = tf.distribute.get_strategy()
        scope = contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(index)  # different starts: the strategy must sync them
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = x @ rng.normal(size=(8, 1)).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).with_options(options)
    replicas = strategy.num_replicas_in_sync

    def replica_step(bx: object, by: object) -> object:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(bx, training=True) - by))
            scaled = loss / replicas  # apply_gradients sums over the replicas
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(bx: object, by: object) -> object:
        return strategy.reduce("MEAN", strategy.run(replica_step, args=(bx, by)), axis=None)

    losses = []
    for _ in range(3):
        epoch = [float(step(bx, by)) for bx, by in strategy.experimental_distribute_dataset(data)]
        losses.append(sum(epoch) / len(epoch))
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    np.save(Path(out_dir) / f"worker-{index}.npy", weights)
    return {
        "index": index,
        "replicas": replicas,
        "loss": losses,
        "workers": json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"],
    }


def _fit_keras(out_dir: str) -> dict[str, object]:
    """The most common Keras program: Sequential, compile, fit (tf.keras, as the original's
    examples write it), started from different weights on each worker."""
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tf.keras.utils.set_random_seed(index)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((8,)),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = x @ rng.normal(size=(8, 1)).astype("float32")
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    np.save(Path(out_dir) / f"worker-{index}.npy", weights)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    return {
        "index": index,
        "replicas": replicas,
        "loss": history.history["loss"],
        "workers": workers,
    }


def _check(out: dict[str, object], folder: Path) -> None:
    assert out["index"] == 0 and out["replicas"] == 2  # worker 0's value, one 2-worker cluster
    losses = out["loss"]
    assert isinstance(losses, list) and losses[-1] < 0.5 * losses[0]
    workers = out["workers"]
    assert isinstance(workers, list) and len(set(workers)) == 2
    first, second = np.load(folder / "worker-0.npy"), np.load(folder / "worker-1.npy")
    np.testing.assert_array_equal(first, second)  # both workers end with the same weights


def test_keras_two_workers_local(tmp_path: Path) -> None:
    runner = MirroredStrategyRunner(num_slots=2, local_mode=True, use_gpu=False)
    _check(runner.run(_train_keras, out_dir=str(tmp_path), custom=False), tmp_path)


@pytest.mark.spark
def test_keras_two_workers_on_spark_custom_strategy(spark: object, tmp_path: Path) -> None:
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True)
    _check(runner.run(_train_keras, out_dir=str(tmp_path), custom=True), tmp_path)


def test_keras_fit_two_workers_local(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    runner = MirroredStrategyRunner(num_slots=2, local_mode=True, use_gpu=False)
    _check(runner.run(_fit_keras, out_dir=str(tmp_path)), tmp_path)
    assert capfd.readouterr().out.count("the workers use tf-keras (TF_USE_LEGACY_KERAS=1)") == 1


@pytest.mark.spark
def test_keras_fit_two_workers_on_spark(spark: object, tmp_path: Path) -> None:
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False)
    assert runner.get_num_tasks() == 2
    _check(runner.run(_fit_keras, out_dir=str(tmp_path)), tmp_path)


def _cuda_devices_per_task() -> list[list[str]]:
    """spark-tensorflow-distributor's test function: each task's CUDA_VISIBLE_DEVICES, gathered
    through BarrierTaskContext in the barrier task (here: in the rank, through sparktrain)."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    gathered = context.allGather(os.environ["CUDA_VISIBLE_DEVICES"])
    context.barrier()
    assert [info.address for info in context.getTaskInfos()] == ["127.0.0.1"] * 2
    return [[d for d in devices.split(",") if d] for devices in gathered], context.partitionId()


@pytest.mark.spark
def test_the_original_runners_tests_on_spark(spark: object) -> None:
    """Ported from spark-tensorflow-distributor's test_mirrored_strategy_runner.py: CPU workers
    see no GPU (test_cpu_training_with_gpus); with one GPU per task, num_slots GPUs over
    ceil(num_slots / amount) tasks (test_equal_gpu_allocation), taken from the executor's
    CUDA_VISIBLE_DEVICES (test_spark_task_cuda_devices_env_support: 10,11 in the fixture);
    BarrierTaskContext.get() works inside train_fn; runner.sc is the SparkContext."""
    from conftest import EXECUTOR_GPUS

    cpu = MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True)
    assert cpu.get_num_tasks() == 2
    assert cpu.run(_cuda_devices_per_task) == ([[], []], 0)
    gpu = MirroredStrategyRunner(num_slots=2, use_gpu=True, use_custom_strategy=True)
    assert gpu.get_num_tasks() == 2 and gpu.sc is spark.sparkContext  # type: ignore[attr-defined]
    per_task, partition = gpu.run(_cuda_devices_per_task)
    assert partition == 0 and [len(devices) for devices in per_task] == [1, 1]
    # each executor's own GPU 0 or 1, read through its CUDA_VISIBLE_DEVICES
    assert {d for devices in per_task for d in devices} <= set(EXECUTOR_GPUS.split(","))


def _fails_on_worker_one() -> None:
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise RuntimeError("worker one broke")


def test_failure_names_the_worker() -> None:
    runner = MirroredStrategyRunner(2, local_mode=True, use_gpu=False, use_custom_strategy=True)
    with pytest.raises(TrainingFailedError, match="rank 1") as info:
        runner.run(_fails_on_worker_one)
    assert "worker one broke" in str(info.value)


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ConfigError, match="num_slots=0 must be a positive int"):
        MirroredStrategyRunner(num_slots=0, local_mode=True, use_gpu=False)
    with pytest.raises(ConfigError, match="num_slots='2'"):
        MirroredStrategyRunner(num_slots="2", local_mode=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="local_mode='yes'"):
        MirroredStrategyRunner(2, local_mode="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gpu_resource_name='fpga'"):
        MirroredStrategyRunner(2, local_mode=True, gpu_resource_name="fpga")
    with pytest.raises(ConfigError, match="train_fn=42"):
        MirroredStrategyRunner(2, local_mode=True, use_gpu=False).run(42)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"use_gpu=True but no GPU.*use_gpu=False"):
            MirroredStrategyRunner(num_slots=2, local_mode=True, use_gpu=True)
