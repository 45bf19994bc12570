"""Inside a rank started by ``TorchDistributor.train_on_dataframe``: its share of the DataFrame.

Spark wrote the DataFrame to the cache before the ranks started (``sparktrain.data.cache``);
the worker records the cache's URL here. Every rank gets the same number of rows (the shorter
shares repeat rows from the epoch's start), so every rank runs the same number of batches.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from sparktrain.ground.errors import ConfigError

_path: str | None = None


def set_path(path: str) -> None:
    """Record where the run's DataFrame was cached (called by the worker before user code)."""
    global _path  # noqa: PLW0603 - one value per rank process, set once
    _path = path


def _dataset(**options: Any) -> Any:
    from sparktrain.data.dataset import StreamingDataset
    from sparktrain.data.sources import parquet_source

    if _path is None:
        raise ConfigError(
            "rank_dataset() and rank_dataloader() work inside a rank started by "
            "TorchDistributor.train_on_dataframe(main, df); this process has no DataFrame. "
            "Elsewhere use sparktrain.data.from_dataframe(df) or from_parquet(path)."
        )
    return StreamingDataset(parquet_source(_path), uneven="pad", **options)


class ShardDataset(Dataset[tuple[Any, ...]]):
    """A map-style dataset over a rank's rows; an item is a tuple of its columns' values."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        """Wrap ``tensors`` (column name -> tensor, all of one length)."""
        self.columns = list(tensors)
        self.tensors = [tensors[c] for c in self.columns]

    def __len__(self) -> int:
        return len(self.tensors[0]) if self.tensors else 0

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(t[index] for t in self.tensors)


def rank_dataset() -> ShardDataset:
    """This rank's whole share of the DataFrame, in memory, as a map-style dataset.

    For data larger than memory use :func:`rank_dataloader`, which streams.
    """
    import torch

    parts = list(_dataset(batch_size=65536, shuffle=False))
    return ShardDataset(
        {k: torch.cat([p[k] for p in parts]) if isinstance(parts[0][k], torch.Tensor)
         else [row for p in parts for row in p[k]] for k in parts[0]}
    )  # fmt: skip


def _as_tuple(batch: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(batch.values())


def rank_dataloader(
    batch_size: int, *, shuffle: bool = False, seed: int = 0, **options: Any
) -> Any:
    """This rank's share streamed in batches of tuples (the DataFrame's columns, in order).

    Args:
        batch_size: Rows per batch.
        shuffle: Shuffle each epoch (row groups, and rows within a window of 2048).
        seed: The shuffle's seed.
        **options: ``StreamingLoader`` (``DataLoader``) options such as ``num_workers``.
    """
    dataset = _dataset(batch_size=batch_size, shuffle=shuffle, seed=seed, transform=_as_tuple)
    return dataset.loader(**options)
