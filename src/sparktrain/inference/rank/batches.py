"""Arrow columns in, model outputs out: what every scoring path does to a batch of rows.

This module runs where the model runs: a rank of a launch, or one of Spark's Python workers. It
is shared by the files path (:mod:`sparktrain.inference.rank.reading`) and Spark's UDF path
(:mod:`sparktrain.spark.rank.scoring`). Design choices:

- **One load per process.** The model travels as bytes with a key (a hash of the bytes). The
  loaded model is kept here, by key and device, so later batches, parts and Spark tasks of the
  same process reuse it. The last :data:`KEEP` models are kept; older ones are dropped.
- **No loop over rows.** Arrow columns become tensors through ``sparktrain.data.columns``
  (views of Arrow's buffers where the dtype allows). Floating inputs take the model's dtype.
- **Reading overlaps computing** (:func:`prefetched`): a thread reads the next batch while the
  model runs on the current one (pyarrow and torch release the GIL).
- **On a GPU** (:func:`forward`): inputs go through pinned host memory, and the next batch's
  copy is issued on a side stream before the current batch's forward pass, so the copy and the
  compute overlap. ``autocast`` runs the forward pass in bf16 or fp16.
- **Bad rows are named**: a null, a null inside an array, or a row whose length differs from
  the others is an error naming the column, the file or partition, and the row.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparktrain.data.columns import column_tensor, first_null, is_ml_vector, kind_of
from sparktrain.ground.errors import ConfigError

#: How many loaded models a process keeps.
KEEP = 2
_MODELS: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
_LOCK = threading.Lock()
#: ``autocast=`` values and the torch dtype each names.
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def loaded_model(key: str, payload: bytes, device: Any) -> Any:
    """The pickled model ``payload`` on ``device``: loaded once per process, then cached."""
    import cloudpickle

    cache_key = (key, str(device))
    with _LOCK:
        model = _MODELS.get(cache_key)
        if model is not None:
            _MODELS.move_to_end(cache_key)
            return model
    from torch import nn

    model = cloudpickle.loads(payload)
    if isinstance(model, nn.Module):
        model = model.to(device).eval()
    with _LOCK:
        _MODELS[cache_key] = model
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
    """Where a batch's rows are, for messages.

    Attributes:
        partition: A Spark partition, or ``None``.
        offset: Rows of the partition or file before the current batch.
        file: The file the rows were read from (the files path), or ``None``.
        index: After a filter: each batch row's position among the rows read, else ``None``.
    """

    partition: int | None
    offset: int = 0
    file: str | None = None
    index: Any = None

    def row(self, index: int) -> str:
        """How a message names the batch's row ``index``."""
        at = int(self.index[index]) if self.index is not None else index
        if self.file is not None:
            return f"row {self.offset + at} of {self.file}"
        if self.partition is None:
            return f"row {at} of the DataFrame's first rows"
        return f"row {self.offset + at} of partition {self.partition}"


def _lengths(array: Any) -> Any:
    """Values per row of a list or ML-vector column."""
    if is_ml_vector(array.type):
        fields = {array.type.field(i).name: c for i, c in enumerate(array.flatten())}
        sizes = np.asarray(fields["size"].fill_null(0))
        dense = np.asarray(fields["values"].value_lengths().fill_null(0))
        return np.where(np.asarray(fields["type"].fill_null(1)) == 0, sizes, dense)
    if hasattr(array.type, "list_size"):  # a fixed-size list: no offsets, one width
        return np.full(len(array), array.type.list_size)
    return np.diff(np.asarray(array.offsets))


def _check_column(array: Any, name: str, width: int | None, where: Where) -> int | None:
    """Refuse nulls and uneven rows, naming the row; the row width found (lists, vectors)."""
    kind = kind_of(array.type)
    if kind not in ("number", "list", "vector"):
        raise ConfigError(
            f"column {name!r} holds {array.type}; a model's inputs must be numbers, arrays of "
            "numbers or ML vectors (or pass preprocess= to turn them into tensors)."
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


def concat(parts: list[Any]) -> Any:
    """Outputs of consecutive forward passes as one (tensors, dicts and tuples of tensors)."""
    import torch

    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts)


#: One forward pass's inputs: positional tensors and keyword tensors.
Call = tuple[tuple[Any, ...], dict[str, Any]]


def split(call: Call, rows: int) -> Iterator[Call]:
    """``call``'s inputs cut into calls of at most ``rows`` rows."""
    args, kwargs = call
    first = args[0] if args else next(iter(kwargs.values()))
    total = len(first)
    for start in range(0, max(total, 1), rows):
        yield (
            tuple(_rows(t, start, start + rows) for t in args),
            {k: _rows(v, start, start + rows) for k, v in kwargs.items()},
        )


def _rows(value: Any, start: int, stop: int) -> Any:
    return value[start:stop] if hasattr(value, "__getitem__") and hasattr(value, "shape") else value


def _moved(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and not value.is_pinned():
            value = value.pin_memory()
        return value.to(device, non_blocking=True)
    return value


def _staged(calls: Iterator[Call], device: Any) -> Iterator[tuple[Call, Any]]:
    """On a GPU: each call's tensors copied on a side stream through pinned memory."""
    import torch

    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    for args, kwargs in calls:
        with torch.cuda.stream(stream):
            moved = (
                tuple(_moved(a, device) for a in args),
                {k: _moved(v, device) for k, v in kwargs.items()},
            )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        yield moved, event


def forward(model: Any, calls: Iterator[Call], device: Any, autocast: str | None) -> Iterator[Any]:
    """The model's output for each call, in order (module doc: the GPU path and autocast)."""
    import torch

    cast = (
        torch.autocast(device.type, dtype=getattr(torch, AUTOCAST[autocast]))
        if autocast
        else contextlib.nullcontext()
    )
    if device.type != "cuda":
        for args, kwargs in calls:
            with cast:
                yield model(*args, **kwargs)
        return
    staged = _staged(calls, device)
    upcoming = next(staged, None)
    while upcoming is not None:
        (args, kwargs), event = upcoming
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        for tensor in [*args, *kwargs.values()]:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(current)
        upcoming = next(staged, None)  # the next copy starts while this forward pass runs
        with cast:
            yield model(*args, **kwargs)


def run_model(model: Any, call: Call, rows: int, device: Any, autocast: str | None) -> Any:
    """The model's output for ``call``, run ``rows`` rows at a time and put back together."""
    return concat(list(forward(model, split(call, rows), device, autocast)))


def prefetched(source: Iterator[Any]) -> Iterator[Any]:
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


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``'s traceback (Python 3.11+; on 3.10, to its message's args)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.args = (*error.args, note)
