"""Inside Spark's Python workers: Arrow batches in, predictions out, the model loaded once.

This module runs in the executors (it is what the inference UDF calls). Design choices:

- **One load per Python worker.** The model travels in the UDF as bytes with a key (a hash of
  the bytes). Spark reuses its Python workers across tasks, so the loaded model is kept in this
  module, by key and device, and every later batch and task of that worker uses it. The last
  :data:`KEEP` models are kept; older ones are dropped.
- **No loop over rows.** Arrow columns become tensors through ``sparktrain.data.columns``
  (numbers, arrays, ML vectors: views of Arrow's buffers where the dtype allows), and outputs
  go back through ``outputs.to_arrow``. Floating inputs take the model's floating dtype.
- **Reading overlaps computing.** A thread takes the next Arrow batch from Spark while the model
  runs on the current one (torch releases the GIL), so Spark's conversion and the forward pass
  proceed together. The thread only reads; an error on either side ends both.
- **The task's GPU.** With GPUs in the task's resources (``spark.task.resource.gpu.amount``),
  the model runs on the first: Spark's address *i* is the *i*-th device this process sees, as
  pyspark's own distributor reads it.
- **Bad rows are named**: a null, a null inside an array, or a row whose length differs from
  the others is an error naming the column, the partition and the row's position in it.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparktrain.data.columns import column_tensor, first_null, is_ml_vector, kind_of
from sparktrain.errors import ConfigError
from sparktrain.spark import outputs, tasks

#: How many loaded models a Python worker keeps.
KEEP = 2
_MODELS: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
_LOCK = threading.Lock()


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


def _task_device(use_gpu: bool | None) -> Any:
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    gpus = context.resources().get("gpu") if context is not None else None
    address = gpus.addresses[0] if gpus is not None and gpus.addresses else None
    count = torch.cuda.device_count() if address is not None and use_gpu is not False else 0
    return torch.device(device_for(address, use_gpu, count))


def model_for(scorer: Scorer, device: Any) -> Any:
    """The scorer's model on ``device``: loaded once per process, then taken from the cache."""
    import cloudpickle

    key = (scorer.key, str(device))
    with _LOCK:
        model = _MODELS.get(key)
        if model is not None:
            _MODELS.move_to_end(key)
            return model
    from torch import nn

    model = cloudpickle.loads(scorer.payload)
    if isinstance(model, nn.Module):
        model = model.to(device).eval()
    with _LOCK:
        _MODELS[key] = model
        while len(_MODELS) > KEEP:
            _MODELS.popitem(last=False)
    return model


def float_dtype(model: Any) -> Any:
    """The floating dtype of the model's weights (float32 when it has none)."""
    import torch

    for tensor in [*getattr(model, "parameters", list)(), *getattr(model, "buffers", list)()]:
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


@dataclass
class Where:
    """Where a batch's rows are: a partition (``None``: the driver's sample of the first rows)."""

    partition: int | None
    offset: int = 0  # rows of this partition before the current batch

    def row(self, index: int) -> str:
        """How a message names the batch's row ``index``."""
        if self.partition is None:
            return f"row {index} of the DataFrame's first rows"
        return f"row {self.offset + index} of partition {self.partition}"


def _lengths(array: Any) -> Any:
    """Values per row of a list or ML-vector column."""
    if is_ml_vector(array.type):
        fields = {array.type.field(i).name: c for i, c in enumerate(array.flatten())}
        sizes = np.asarray(fields["size"].fill_null(0))
        dense = np.asarray(fields["values"].value_lengths().fill_null(0))
        return np.where(np.asarray(fields["type"].fill_null(1)) == 0, sizes, dense)
    return np.diff(np.asarray(array.offsets))


def _check_column(array: Any, name: str, width: int | None, where: Where) -> int | None:
    """Refuse nulls and uneven rows, naming the row; the row width found (lists, vectors)."""
    kind = kind_of(array.type)
    if kind not in ("number", "list", "vector"):
        raise ConfigError(
            f"column {name!r} holds {array.type}; a model's inputs must be numbers, arrays of "
            "numbers or ML vectors."
        )
    null = first_null(array)
    if null >= 0:
        raise ConfigError(
            f"column {name!r} is null at {where.row(null)}; fill or filter the nulls before "
            f"predicting (df.na.drop(subset=[{name!r}]))."
        )
    if kind == "number" or len(array) == 0:
        return None
    lengths = _lengths(array)
    if kind == "list":
        flat = array.flatten()
        if flat.null_count:
            inner = int(np.flatnonzero(np.asarray(flat.is_null()))[0])
            row = int(np.searchsorted(np.cumsum(lengths), inner, side="right"))
            raise ConfigError(
                f"column {name!r} holds a null inside the array at {where.row(row)}; fill or "
                "filter the nulls before predicting."
            )
    expected = width if width is not None else int(lengths[0])
    uneven = np.flatnonzero(lengths != expected)
    if len(uneven):
        row = int(uneven[0])
        raise ConfigError(
            f"column {name!r} has {int(lengths[row])} values at {where.row(row)}, where the "
            f"model takes {expected} per row; every row must have the same length."
        )
    return expected


def input_tensors(
    arrays: Sequence[Any], names: Sequence[str], widths: list[int | None], where: Where, dtype: Any
) -> list[Any]:
    """The batch's columns as tensors for the model (``widths`` learns unknown widths)."""
    tensors = []
    for i, (array, name) in enumerate(zip(arrays, names, strict=True)):
        widths[i] = _check_column(array, name, widths[i], where)
        tensor = column_tensor(array)
        tensors.append(tensor.to(dtype) if tensor.is_floating_point() else tensor)
    return tensors


def _concat(parts: list[Any]) -> Any:
    import torch

    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts)


def _forward(model: Any, tensors: list[Any], batch_size: int, device: Any) -> Any:
    rows = len(tensors[0])
    parts = []
    for start in range(0, max(rows, 1), batch_size):
        chunk = [t[start : start + batch_size] for t in tensors]
        if device.type == "cuda":
            chunk = [t.pin_memory().to(device, non_blocking=True) for t in chunk]
        parts.append(model(*chunk))
    return _concat(parts)


def _prefetched(source: Iterator[Any]) -> Iterator[Any]:
    """``source``'s items, read one ahead by a thread (module doc)."""
    slot: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                slot.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for item in source:
                if not put(("item", item)):
                    return
            put(("end", None))
        except BaseException as error:  # handed to the consuming thread
            put(("error", error))

    thread = threading.Thread(target=pump, name="sparktrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = slot.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


def score(batches: Iterator[Any], scorer: Scorer) -> Iterator[Any]:
    """The UDF's body: for each batch of input arrays, the predictions as one Arrow array."""
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    where = Where(partition=context.partitionId() if context is not None else 0)
    device = _task_device(scorer.use_gpu)
    model = model_for(scorer, device)
    dtype = float_dtype(model)
    widths = list(scorer.widths)
    with torch.inference_mode():
        for arrays in _prefetched(batches):
            columns = list(arrays) if isinstance(arrays, (tuple, list)) else [arrays]
            rows = len(columns[0])
            tensors = input_tensors(columns, scorer.inputs, widths, where, dtype)
            output = _forward(model, tensors, scorer.batch_size, device) if rows else None
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
