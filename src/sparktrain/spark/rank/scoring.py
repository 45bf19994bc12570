"""Inside Spark's Python workers: the UDF path's Arrow batches in, predictions out.

This module runs in the executors (it is what the inference UDF calls); what it does to each
batch (the model loaded once per worker, columns to tensors without a loop over rows, reading
overlapped with computing, bad rows named) is :mod:`sparktrain.inference.rank.batches`, shared with
the files path. What is Spark's own is here: the task's GPU (with GPUs in the task's resources,
``spark.task.resource.gpu.amount``, the model runs on the first: Spark's address *i* is the
*i*-th device this process sees, as pyspark's own distributor reads it), the partition that
names a bad row, and the task heads (:mod:`sparktrain.spark.rank.tasks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.inference.rank import outputs
from sparktrain.inference.rank.batches import (
    Where,
    float_dtype,
    input_tensors,
    loaded_model,
    prefetched,
    run_model,
)
from sparktrain.spark.rank import tasks

__all__ = ["Scorer", "Where", "device_for", "float_dtype", "input_tensors", "model_for", "score"]


@dataclass(frozen=True)
class Scorer:
    """Everything the executors need to score: the model and how to call it.

    Attributes:
        key: Identifies the model (a hash of ``payload``).
        payload: The model, pickled (cloudpickle).
        inputs: The input columns, in the order the model takes them.
        widths: Values per row of each input, where known (``None``: the first batch decides).
        batch_size: Rows per forward pass.
        use_gpu: ``True``, ``False``, or ``None`` for the task's GPU when it has one.
        task: ``raw`` (the output as it is) or a task whose columns are added (``tasks``).
        fields: For a task other than ``raw``: the fields the UDF returns.
        output: The UDF's result type.
    """

    key: str
    payload: bytes
    inputs: tuple[str, ...]
    widths: tuple[int | None, ...]
    batch_size: int
    use_gpu: bool | None
    task: tasks.Task
    fields: tuple[str, ...]
    output: outputs.Spec


def device_for(address: str | None, use_gpu: bool | None, cuda_devices: int) -> str:
    """The device for a task given GPU ``address`` (or none), where torch sees ``cuda_devices``.

    Raises:
        ConfigError: ``use_gpu=True`` without a GPU in the task, or without CUDA.
    """
    if use_gpu is False:
        return "cpu"
    if address is None:
        if use_gpu:
            raise ConfigError(
                "use_gpu=True, but this Spark task was given no GPU: set "
                "spark.task.resource.gpu.amount (1, or a fraction such as 0.25 to let 4 tasks "
                "share a GPU) and spark.executor.resource.gpu.amount, or pass use_gpu=None."
            )
        return "cpu"
    if cuda_devices == 0:
        if use_gpu:
            raise ConfigError(
                f"use_gpu=True: this Spark task was given GPU {address}, but torch in the "
                "executor's Python sees no CUDA device; install a CUDA build of torch on the "
                "executors, or pass use_gpu=False."
            )
        return "cpu"
    if not address.isdigit() or int(address) >= cuda_devices:
        raise ConfigError(
            f"this Spark task was given GPU {address!r}, but torch sees {cuda_devices} "
            "device(s), numbered 0 to "
            f"{cuda_devices - 1}; Spark's GPU addresses must be the indices of the devices the "
            "executor sees (check the discovery script and CUDA_VISIBLE_DEVICES)."
        )
    return f"cuda:{address}"


def task_device(use_gpu: bool | None) -> Any:
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    gpus = context.resources().get("gpu") if context is not None else None
    address = gpus.addresses[0] if gpus is not None and gpus.addresses else None
    count = torch.cuda.device_count() if address is not None and use_gpu is not False else 0
    return torch.device(device_for(address, use_gpu, count))


def model_for(scorer: Scorer, device: Any) -> Any:
    """The scorer's model on ``device``: loaded once per process, then taken from the cache."""
    return loaded_model(scorer.key, scorer.payload, device)


def score(batches: Iterator[Any], scorer: Scorer) -> Iterator[Any]:
    """The UDF's body: for each batch of input arrays, the predictions as one Arrow array."""
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    where = Where(partition=context.partitionId() if context is not None else 0)
    device = task_device(scorer.use_gpu)
    model = model_for(scorer, device)
    dtype = float_dtype(model)
    widths = list(scorer.widths)
    with torch.inference_mode():
        for arrays in prefetched(batches):
            columns = list(arrays) if isinstance(arrays, (tuple, list)) else [arrays]
            rows = len(columns[0])
            tensors = input_tensors(columns, scorer.inputs, widths, where, dtype)
            output = None
            if rows:
                output = run_model(model, (tuple(tensors), {}), scorer.batch_size, device, None)
            if output is None:
                yield _empty(scorer.output)
            elif scorer.task == "raw":
                yield outputs.to_arrow(output, scorer.output)
            else:
                yield outputs.to_arrow(
                    tasks.head(output, scorer.task, scorer.fields), scorer.output
                )
            where.offset += rows


def _empty(spec: outputs.Spec) -> Any:
    import pyarrow as pa

    return pa.array([], type=outputs.arrow_type(spec))
