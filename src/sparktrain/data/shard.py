"""Inside a rank: its share of the DataFrame as tensors.

Numeric and boolean columns become 1-D tensors; arrays of numbers become 2-D tensors (every row
must have the same length); Spark ML vectors (dense or sparse) become dense 2-D float64 tensors.
Other columns (strings, maps, ...) are an error naming the column: drop or encode them first.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from sparktrain.data import arrow
from sparktrain.errors import ConfigError

_path: str | None = None


def set_path(path: str) -> None:
    """Record where this rank's share lies (called by the worker before user code runs)."""
    global _path  # noqa: PLW0603 - one value per rank process, set once
    _path = path


def _is_ml_vector(arrow_type: Any) -> bool:
    pa = arrow._pyarrow()
    if not pa.types.is_struct(arrow_type):
        return False
    return {arrow_type.field(i).name for i in range(arrow_type.num_fields)} == {
        "type",
        "size",
        "indices",
        "values",
    }


def _dense_vectors(column: Any) -> Any:
    import torch

    rows = column.to_pylist()
    width = max((r["size"] if r["type"] == 0 else len(r["values"])) for r in rows) if rows else 0
    out = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, r in enumerate(rows):
        if r["type"] == 1:
            out[i, : len(r["values"])] = torch.tensor(r["values"], dtype=torch.float64)
        else:
            out[i, r["indices"]] = torch.tensor(r["values"], dtype=torch.float64)
    return out


def column_tensor(name: str, column: Any) -> Any:
    """Convert one Arrow column to a tensor, or raise :class:`ConfigError` naming it."""
    import torch

    pa = arrow._pyarrow()
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        rows = column.to_pylist()
        widths = {len(r) for r in rows}
        if len(widths) > 1:
            raise ConfigError(
                f"column {name!r} holds arrays of different lengths {sorted(widths)[:5]}; pad "
                "them to one length before training."
            )
        return torch.tensor(rows)
    if _is_ml_vector(kind):
        return _dense_vectors(column)
    raise ConfigError(
        f"column {name!r} of type {kind} cannot become a tensor; select numeric, array or ML "
        "vector columns only (drop or encode the others first)."
    )


class ShardDataset(Dataset[tuple[Any, ...]]):
    """A map-style dataset over a rank's rows; an item is a tuple of its columns' values."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        """Wrap ``tensors`` (column name -> tensor, all of one length)."""
        self.columns = list(tensors)
        self.tensors = [tensors[c] for c in self.columns]

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0]) if self.tensors else 0

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(t[index] for t in self.tensors)


def rank_dataset() -> ShardDataset:
    """This rank's share of the DataFrame given to ``train_on_dataframe``."""
    if _path is None:
        raise ConfigError(
            "rank_dataset() works inside a rank started by TorchDistributor.train_on_dataframe"
            "(main, df); this process has no DataFrame share."
        )
    table = arrow.read(_path)
    return ShardDataset({name: column_tensor(name, table[name]) for name in table.column_names})


def rank_dataloader(batch_size: int, **options: Any) -> Any:
    """A ``DataLoader`` over :func:`rank_dataset`; ``options`` go to ``DataLoader``."""
    from torch.utils.data import DataLoader

    return DataLoader(rank_dataset(), batch_size=batch_size, **options)
